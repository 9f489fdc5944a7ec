"""GatheredParametersAndBuffers: deepspeed.zero.GatheredParameters that also keeps module buffers right.

Two modes, two classes: :class:`_ReadOnly` (``modifier_rank=None``: gather, optionally check the buffers
agree) and :class:`_Commit` (``modifier_rank=r``: on exit rank r's parameters and buffers reach every rank,
all or nothing). The public class resolves the arguments and hands over to one of them.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._compat import deepspeed as ds_compat, torch as torch_compat
from .._core import (
    args as _args,
    group as _group,
    modules as _modules,
    notice as _notice,
    structure as _structure,
    transaction as _transaction,
    wire as _wire,
)
from .._core.rollback import Snapshot
from ..errors import InvalidArgumentError, ZeroBuffersError
from ..report import assert_buffers_in_sync
from . import _owners

_FN = "GatheredParametersAndBuffers"
_UNCHANGED = "nothing was committed: parameters and buffers are as before the context"


def targets(params: Any, fn: str = _FN) -> tuple[list[nn.Module], list[torch.Tensor], set[int]]:
    """Modules, the ZeRO parameters to gather (theirs and the loose ones, sorted by ds_id), and the ids of the loose
    tensors given, named by ``params``: what GatheredParameters takes (a tensor, an iterable with None entries)
    plus modules. Loose tensors that ZeRO does not manage are not gathered, as DeepSpeed ignores them."""
    if params is None or isinstance(params, (nn.Module, torch.Tensor)):
        items = [params]
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes)):
        unordered = isinstance(params, (set, frozenset)) or type(params).__name__ in ("dict_keys", "dict_values")
        items = list(params)
        if unordered and any(isinstance(i, nn.Module) for i in items):
            raise InvalidArgumentError(
                f"{fn}: modules are matched across ranks by their position, and a {type(params).__name__} has no "
                "order that is the same on every rank; pass a list or tuple")
    else:
        raise InvalidArgumentError(f"{fn}: expected a module, a parameter, or an iterable of them, got "
                                   f"{type(params).__name__} {params!r:.40}")
    modules: list[nn.Module] = []
    zero: dict[int, torch.Tensor] = {}
    given: set[int] = set()
    for i, item in enumerate(items):
        if isinstance(item, nn.Module):
            modules.append(item)
            zero.update({id(p): p for p in item.parameters() if ds_compat.is_zero_param(p)})
        elif isinstance(item, torch.Tensor):
            given.add(id(item))
            if ds_compat.is_zero_param(item):
                zero[id(item)] = item
        elif item is not None:
            raise InvalidArgumentError(f"{fn}: item {i} is a {type(item).__name__}; expected modules, parameters, "
                                       "None, or an iterable of them")
    return modules, sorted(zero.values(), key=ds_compat.ds_id), given


def resolve_group(group: Any, zero: Sequence[torch.Tensor], fn: str = _FN) -> _group.Group | None:
    """The group the sync runs over: by default the ZeRO parameters' own; an explicit one must have the same members
    (DeepSpeed partitions, and we broadcast, over that group). Decided on each rank alone, without a collective."""
    pgs = {id(pg): pg for pg in (ds_compat.process_group(p) for p in zero)}
    if len(pgs) > 1:
        raise InvalidArgumentError(f"{fn}: the ZeRO parameters given are partitioned over {len(pgs)} different "
                                   "process groups; gather each group's parameters in a context of its own")
    zero_pg = next(iter(pgs.values()), None)
    g = _group.resolve(zero_pg if group is None else group, fn)
    if zero and _group.initialized() and group is not None:
        theirs = sorted(dist.get_process_group_ranks(zero_pg if zero_pg is not None else dist.group.WORLD))
        ours = sorted(g.ranks) if g is not None else [dist.get_rank()]
        if theirs != ours:
            raise InvalidArgumentError(
                f"{fn}: group has ranks {ours} (as seen on rank {dist.get_rank()}) but the ZeRO parameters are "
                f"partitioned over ranks {theirs}; pass that group (or none: it is the default)")
    return g


def _zero_specs(zero: Sequence[torch.Tensor]) -> list[tuple[str, _structure.Spec]]:
    """The ZeRO parameters as structure agreement sees them (their ds_id is the same on every rank)."""
    out = []
    for p in zero:
        name = f"<ZeRO ds_id={ds_compat.ds_id(p)}>"
        out.append((name, _structure.Spec(name, str(p.dtype).removeprefix("torch."),
                                          tuple(getattr(p, "ds_shape", p.shape)), "zero")))
    return out


def _no_owner_text(unowned: Sequence[int], src: int) -> str:
    shown = ", ".join(map(str, unowned[:8])) + (f" and {len(unowned) - 8} more" if len(unowned) > 8 else "")
    return (f"{_FN}(modifier_rank={src}): no module registers the ZeRO parameter(s) with ds_id {shown} (on any rank), "
            "so zero_buffers cannot tell whose buffers the body changes: only those parameters are committed. If the "
            f"body loads buffers, pass the module instead, {_FN}(module, modifier_rank={src}), or call "
            f"zero_buffers.broadcast_buffers(module, src={src}) on every rank after the context")


def _overlap_error(held: Sequence[torch.Tensor]) -> ZeroBuffersError:
    return ZeroBuffersError(
        "Nested GatheredParameters contexts cannot overlap parameters (as in DeepSpeed); parameter ds_ids already "
        f"gathered by an outer context: {[ds_compat.ds_id(p) for p in held]}")


class _ReadOnly:
    """``modifier_rank=None``: gather; with modules and ``check_buffers``, their buffers must agree on enter."""

    def __init__(self, gather: ds_compat.Gather | None, box: nn.Module | None, g: _group.Group | None,
                 check: bool, atol: float, timeout: float | None):
        self.gather, self.box, self.g, self.check, self.atol, self.timeout = gather, box, g, check, atol, timeout

    def enter(self) -> None:
        zero = self.gather.params if self.gather is not None else []
        held = [p for p in zero if ds_compat.held(p)]
        if held:
            raise _overlap_error(held)  # as DeepSpeed: on this rank, before its all-gather
        if self.box is not None and self.g is not None:
            deadline = _wire.Deadline(self.timeout)
            entries = _modules.named_buffers(self.box)
            _structure.agree(self.g, (_FN, "enter", None), _zero_specs(zero) + entries, deadline, _FN)
            if self.check:
                assert_buffers_in_sync(self.box, group=self.g.pg, atol=self.atol,
                                       timeout=None if deadline.default else deadline.remaining() or math.inf)
        if self.gather is not None:
            self.gather.__enter__()

    def exit(self, exc: BaseException | None) -> None:
        if self.gather is not None:
            self.gather.close("own")


class _Commit:
    """``modifier_rank=src``: on exit the tensors ``entries()`` names and the gathered ZeRO parameters take group
    rank ``src``'s values on every rank in one transactional broadcast (ours, under the deadline), then DeepSpeed
    re-partitions the updated parameters. If anything failed on any rank, every rank rolls back instead."""

    def __init__(self, gather: ds_compat.Gather | None, modules: Sequence[nn.Module],
                 entries: Callable[[], list[_modules.Entry]], g: _group.Group | None, src: int,
                 timeout: float | None, snapshot: bool, only_if_changed: bool = False,
                 found: _owners.Found | None = None):
        self.gather, self.modules, self.entries, self.g, self.src = gather, list(modules), entries, g, src
        self.timeout, self.take_snapshot = timeout, snapshot
        self.only_if_changed = only_if_changed  # buffers travel only when the body changed them on rank src
        self.found = found  # the modules found behind a parameter list: part of the structure agreed on enter
        self.saved = Snapshot()
        self.gathered: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def zero(self) -> list[torch.Tensor]:
        return sorted(self.gather.params, key=ds_compat.ds_id) if self.gather is not None else []

    def enter(self) -> None:
        """Vote (on the structure, overlapping outer contexts and the rollback copy), then gather."""
        failure: _transaction.Failure = None
        held = [p for p in self.zero if ds_compat.held(p)]
        if held:  # as DeepSpeed: on this rank, before any collective (the outer context may be this rank's alone)
            raise _overlap_error(held)
        if self.take_snapshot:
            try:
                self.saved = Snapshot.take(self.modules)
            except BaseException as e:  # noqa: BLE001 - a vote
                failure = e
        if self.g is None:
            if failure is not None:
                raise failure if isinstance(failure, BaseException) else ZeroBuffersError(failure)
        else:
            deadline = _wire.Deadline(self.timeout)
            votes = _structure.agree(self.g, (_FN, "enter", self.src), _zero_specs(self.zero) + self._found_specs(),
                                     deadline, _FN, status=int(failure is not None))
            _transaction.abort_if_any(self.g, [s for s, _ in votes], failure, deadline, _FN,
                                      "entering failed", "nothing was gathered")
            if self.found is not None and self.found.unowned:  # agreed: every rank found no owner for the same ones
                _notice.warn(_no_owner_text(self.found.unowned, self.src), stacklevel=4, group=self.g)
        if self.gather is not None:
            self.gather.__enter__()
            self.gathered = [(p, p.data) for p in self.zero]  # references: a rollback gives each its data back

    def _found_specs(self) -> list[tuple[str, Any]]:
        """What the parameter list was found to name: ZeRO parameters no module registers, then the owners' tensors
        (ranks that found different owners differ here, and raise BufferStructureError together)."""
        if self.found is None:
            return []
        by_id = {ds_compat.ds_id(p): spec for p, (_, spec) in zip(self.zero, _zero_specs(self.zero))}
        marks = [(f"<ZeRO ds_id={k}: no module registers it>", by_id[k]) for k in self.found.unowned if k in by_id]
        return marks + self.found.entries()

    def exit(self, exc: BaseException | None) -> None:
        """Commit, or roll back on every rank; the body's own exception wins over ours on the rank it came from."""
        failure: _transaction.Failure = exc
        if failure is None:
            failure = self._refusal()
        try:
            if self.g is None:
                if failure is not None:
                    raise failure if isinstance(failure, BaseException) else ZeroBuffersError(failure)
            else:
                deadline = _wire.Deadline(self.timeout)
                zero = [(n, p.data) for (n, _), p in zip(_zero_specs(self.zero), self.zero)]
                entries = self.entries() if self._buffers_changed(deadline) else []
                # [Note: the transaction]: the body's failure is this rank's vote; on any failure, every rank rolls
                # back below
                _transaction.broadcast(self.g, entries + zero, self.src, (_FN, "exit"), deadline, _FN,
                                       failure=failure, unchanged=_UNCHANGED,
                                       step="the body raised, or the commit could not start,")
        except BaseException as err:
            self._roll_back()
            if exc is not None and isinstance(err, ZeroBuffersError):
                return  # the body's exception propagates on this rank
            raise
        if self.gather is not None:
            self.gather.close("updated")
        self.saved = Snapshot()

    def _buffers_changed(self, deadline: _wire.Deadline) -> bool:
        """True, or with ``only_if_changed`` whether the body changed the modules on rank src (one small collective:
        a read-only body, such as DeepSpeed's own 16-bit export, then leaves every rank's buffers alone)."""
        if not self.only_if_changed or self.g is None:
            return True
        mine = int(self.saved.changed()) if self.g.me == self.src else 0
        return bool(_wire.all_gather_values(self.g, [mine], deadline, _FN)[self.src][0])

    def _refusal(self) -> str | None:
        """Why this rank's gathered ZeRO data cannot be committed (the body replaced it with another shape/dtype)."""
        for p, data in self.gathered:
            if p.data.shape != data.shape or p.data.dtype != data.dtype:
                return (f"ZeRO parameter ds_id={ds_compat.ds_id(p)} changed from {data.dtype} {list(data.shape)} to "
                        f"{p.data.dtype} {list(p.data.shape)} in the body; DeepSpeed cannot re-partition that")
        return None

    def _roll_back(self) -> None:
        """Discard the body's updates: the rest get their copies back, DeepSpeed re-partitions without them."""
        problems = self.saved.restore(self.gathered)
        self.saved = Snapshot()
        if self.gather is not None:
            self.gather.close("discard")
        if problems:
            _notice.warn(f"{_FN}: rank {_group.global_rank()} could not restore " + "; ".join(problems), stacklevel=5,
                         here=True, category=RuntimeWarning)  # this rank's own failure: said where it happened


class GatheredParametersAndBuffers:
    """A drop-in for ``deepspeed.zero.GatheredParameters`` that also handles the buffers of the modules given.

    ``params`` is anything GatheredParameters accepts (a parameter, an iterable of parameters, with
    ``None`` entries, a generator), and also a module or a list of modules. As in DeepSpeed, tensors
    ZeRO does not manage are ignored, ZeRO parameters are matched across ranks by their ``ds_id`` (not
    by position), and a call with no ZeRO parameter and no module is a no-op without any collective.
    A context that overlaps an outer one on the same parameters raises, as DeepSpeed does.

    * ``modifier_rank=r`` (a rank within ``group``): on exit the gathered parameters, and the buffers
      and plain (non-ZeRO) parameters of the modules given, take rank r's values on every rank. Parameters
      given find their modules (a ``module.parameters()`` generator names ``module``; else the record
      ``install()`` / ``Init`` keep, ``fwd_module``, a search of the heap): a module every parameter of
      which was given counts as given (its whole tree), an owner given some of its parameters brings its
      own buffers and its parameter-free submodules'. Ranks that find different owners raise
      BufferStructureError on entering; a ZeRO parameter no module registers warns on every rank. All or
      nothing: if the body raised on any rank, or a rank cannot take part, no rank keeps any change:
      ZeRO parameters are re-partitioned with their values from before; buffers and plain parameters
      get back their values (and dtype, device, shape) from a host copy taken on enter, and every
      module its registrations (the original tensors after ``load_state_dict(assign=True)``, say;
      names and submodules the body added are dropped). The ranks where the body raised see their own
      exception; the others :class:`SyncAbortedError`. The commit is a two-phase commit over our own
      collectives: ranks agree they can take the data (receive space allocated), receive into scratch,
      vote that it arrived, then write without another collective. DeepSpeed's own context broadcasts
      whatever rank r holds even when a body raised, leaving a half-loaded model. ``snapshot=False``
      skips the host copy (for a large plain model): a failure then still commits nothing of ZeRO, but
      buffers and plain parameters stay as the body left them.
    * ``modifier_rank=None``: on enter, the buffers of the modules given must agree across ranks, else
      :class:`BuffersOutOfSyncError` on every rank (``check_buffers=False`` opts out). Nothing is modified.

    ``group`` defaults to the ZeRO parameters' process group (the world without them); one passed in must
    have the same members. ``timeout`` bounds every collective we issue (seconds, for the enter and for
    the exit step each); DeepSpeed's own all-gather on enter is bounded only by the process group's
    timeout, and runs right after a vote every rank has passed. Works without DeepSpeed for modules
    (plain or DDP models): there is nothing to gather, buffers are still handled.

    Example::

        with GatheredParametersAndBuffers(model, modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                model.load_state_dict(torch.load("ckpt.pt"))
        # every rank now has the checkpoint's weights AND buffers
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True, *, check_buffers: bool = True, atol: float = 0.0, group: Any = None,
                 timeout: _args.Timeout = None, snapshot: bool = True):
        self._mode: _ReadOnly | _Commit | None = None
        if not enabled:
            return
        src = _args.optional_rank(modifier_rank, "modifier_rank", _FN)
        seconds = _args.timeout(timeout, _FN)
        atol = _args.atol(atol, _FN)
        root = torch_compat.parameters_generator(params)  # before targets() consumes it
        modules, zero, given = targets(params)
        if not modules and not zero:
            return  # DeepSpeed's no-op: nothing ZeRO manages, no module
        g = resolve_group(group, zero)
        gather = ds_compat.Gather(zero, fwd_module) if zero else None
        box = _modules.box(modules) if modules else None
        if src is None:
            self._mode = _ReadOnly(gather, box, g, check_buffers, atol, seconds)
            return
        _group.check_src(g, src, _FN, "modifier_rank")
        theirs = {id(p) for m in modules for p in m.parameters()}
        loose = [p for p in zero if id(p) not in theirs]  # parameters given as such: find the modules they belong to
        found = _owners.find(loose, given, root=root, fwd_module=fwd_module) if loose else None

        def entries() -> list[_modules.Entry]:
            out = _modules.named_buffers(box, include_parameters=True) if box is not None else []
            if found is not None:
                mine = {id(t) for _, t in out}
                out += [(n, t) for n, t in found.entries() if id(t) not in mine]
            return out

        snapped = {id(m): m for m in (box.modules() if box is not None else ())}
        snapped.update((id(m), m) for m in (found.modules() if found is not None else ()))
        self._mode = _Commit(gather, list(snapped.values()), entries, g, src, seconds, snapshot, found=found)

    def __enter__(self) -> GatheredParametersAndBuffers:
        if self._mode is not None:
            self._mode.enter()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._mode is not None:
            self._mode.exit(exc)
