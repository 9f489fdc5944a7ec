"""GatheredParametersAndBuffers: deepspeed.zero.GatheredParameters that also keeps module buffers right."""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parameter import is_lazy

from . import _dist
from .broadcast import broadcast_buffers
from .errors import InvalidArgumentError, InvalidSourceRankError, ZeroBuffersError
from .report import assert_buffers_in_sync

_DEPTH_ATTR = "_ds_z3_gathered_param_context_depth"  # deepspeed.runtime.zero.partition_parameters


def _split(target: Any) -> tuple[list[nn.Module], list[torch.Tensor]]:
    """Modules and loose parameters named by ``target`` (one or an iterable of either)."""
    if isinstance(target, (nn.Module, torch.Tensor)):
        items = [target]
    elif isinstance(target, Iterable) and not isinstance(target, (str, bytes)):
        items = list(target)
    else:
        raise InvalidArgumentError(f"GatheredParametersAndBuffers: expected a module, a parameter, or an iterable of "
                                   f"them, got {type(target).__name__} {target!r:.40}")
    modules, params = [], []
    for i, item in enumerate(items):
        if isinstance(item, nn.Module):
            modules.append(item)
        elif isinstance(item, torch.Tensor):
            params.append(item)
        else:
            raise InvalidArgumentError(f"GatheredParametersAndBuffers: item {i} is a {type(item).__name__}; expected "
                                       "modules, parameters, or an iterable of them")
    return modules, params


def _held_outside(p: torch.Tensor) -> bool:
    """A ZeRO parameter an outer GatheredParameters context holds gathered right now."""
    return hasattr(p, "ds_id") and getattr(p, _DEPTH_ATTR, 0) > 0


def _gathered_parameters(params: list[torch.Tensor], modifier_rank: int | None, fwd_module: Any) -> Any:
    """DeepSpeed's context for the ZeRO parameters not already gathered by an outer context (or None)."""
    zero = [p for p in params if hasattr(p, "ds_id") and not _held_outside(p)]
    if not zero:
        return None
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    return GatheredParameters(zero, modifier_rank=modifier_rank, fwd_module=fwd_module)


def _discard_updates(ds_ctx: Any) -> None:
    """Make DeepSpeed's context exit like ``modifier_rank=None``: no broadcast; shards keep their pre-gather values.

    Compat wrapper around GatheredParameters' private ``src_rank`` (deepspeed 0.19); without it DeepSpeed commits.
    """
    if hasattr(ds_ctx, "src_rank"):
        ds_ctx.src_rank = None
        ds_ctx._param_versions = []  # skip the in-place-modification sanity check (it would raise)
    else:  # pragma: no cover - a DeepSpeed without the attribute
        warnings.warn("GatheredParametersAndBuffers: this DeepSpeed version's GatheredParameters cannot be told to "
                      "discard the body's updates; its parameters are broadcast from the modifier rank", stacklevel=3)


def _deepspeed_would_refuse(ds_ctx: Any) -> str | None:
    """Why DeepSpeed's exit would raise on this rank before broadcasting (a parameter left the accelerator), or None.

    Mirrors the device check of GatheredParameters._exit (deepspeed 0.19); unknown versions: None.
    """
    params = getattr(ds_ctx, "params", None)
    if not params:
        return None
    from deepspeed.accelerator import get_accelerator

    expected = torch.device(get_accelerator().current_device_name())
    moved = [p for p in params if p.data.device != expected]
    if not moved:
        return None
    return (f"{len(moved)} ZeRO parameter(s) were moved to {moved[0].data.device} in the body, but DeepSpeed "
            f"broadcasts them on {expected}")


_TABLES = ("_buffers", "_parameters", "_modules")


@dataclass
class _Snapshot:
    """What a rollback puts back: each module's registration tables as they were (buffers, parameters, submodules,
    the non-persistent set), and per tensor its data and a host copy (None: only ``.data`` is restored, for meta)."""

    tables: list[tuple[nn.Module, list[dict], set[str]]] = field(default_factory=list)
    values: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)


def _snapshot(box: nn.Module | None, held: list[torch.Tensor]) -> _Snapshot:
    """Registrations of every module of ``box``; host copies of its buffers and plain parameters and of the
    ``held`` ZeRO parameters (gathered by an outer context). Other ZeRO parameters need no copy: DeepSpeed keeps
    their shards."""
    snap = _Snapshot()
    if box is not None:
        snap.tables = [(m, [dict(getattr(m, name)) for name in _TABLES], set(m._non_persistent_buffers_set))
                       for m in box.modules()]
    tensors = [t for _, saved, _ in snap.tables for table in saved[:2] for t in table.values() if t is not None]
    held_ids = {id(p) for p in held}
    seen: set[int] = set()
    for t in tensors + held:
        if id(t) in seen or is_lazy(t) or (hasattr(t, "ds_id") and id(t) not in held_ids):
            continue
        seen.add(id(t))
        data = t.data
        snap.values.append((t, data, None if data.is_meta else data.to("cpu", copy=True)))
    return snap


def _restore(snap: _Snapshot, gathered: list[tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
    """Put back registrations, original data tensors (dtype, device, shape) and values. Returns the problems."""
    problems = []
    for module, saved, transient in snap.tables:  # undoes load_state_dict(assign=True), new names, new submodules
        for name, table in zip(_TABLES, saved):
            live = getattr(module, name)
            live.clear()
            live.update(table)
        module._non_persistent_buffers_set.clear()
        module._non_persistent_buffers_set.update(transient)
    for t, data in gathered:  # ZeRO parameters gathered here: their own data tensor back before DeepSpeed frees it
        t.data = data
    for t, data, copy in snap.values:
        try:
            t.data = data  # the body may have swapped .data (another dtype, device or shape)
            if copy is None:
                continue
            if data.shape == copy.shape:
                data.copy_(copy)
            else:  # resized in place
                t.data = copy.to(data.device)
        except Exception as e:  # noqa: BLE001 - keep restoring the others; reported together
            problems.append(f"{type(e).__name__}: {e}")
    return problems


class GatheredParametersAndBuffers:
    """A drop-in for ``deepspeed.zero.GatheredParameters`` that also handles the buffers of the modules given.

    ``target`` is what GatheredParameters accepts (a parameter, an iterable of parameters) and also a
    module or several. ZeRO parameters are gathered by DeepSpeed exactly as before (those an outer
    GatheredParameters already holds are left to it). For modules:

    * ``modifier_rank=r``: on exit, buffers and plain (non-ZeRO) parameters are broadcast from ``r``
      (a rank of ``group``, as in DeepSpeed) with one structure-checked coalesced sync, so DeepSpeed's
      loading pattern leaves every rank with the checkpoint's buffers.
    * ``modifier_rank=None``: on enter, buffers are checked to agree across ranks (one small collective)
      and :class:`BuffersOutOfSyncError` is raised on every rank naming them; ``check_buffers=False``
      opts out. Nothing is modified.

    All or nothing with ``modifier_rank=r``: if the body raised on any rank, a ZeRO parameter left its
    device (DeepSpeed would refuse to broadcast it), or the buffer sync fails (structure mismatch),
    nothing is committed on any rank: ZeRO parameters are re-partitioned without DeepSpeed's broadcast
    (each shard keeps its value from before the context); buffers, plain parameters and ZeRO
    parameters an outer context holds get back their values (and dtype, device, shape) from a host
    copy taken on enter, and every module its registrations (the original tensors after
    ``load_state_dict(assign=True)``, say; names and submodules the body added are dropped); every rank
    raises (the body's own exception where it raised,
    :class:`ZeroBuffersError` elsewhere). DeepSpeed's own context broadcasts whatever the modifier
    rank holds even then, leaving a half-loaded model. The copy costs host memory the size of those
    tensors (ZeRO-3 parameters gathered here need none) and one small collective on enter, so that a
    rank failing to take it makes every rank raise; ``snapshot=False`` skips it (for a large plain DDP
    model): a failure then still commits no ZeRO parameter and broadcasts nothing, but the rest stays
    as the body left it on each rank. Not atomic across ranks: a peer dying or timing out in the
    middle of the final broadcasts (the process group is unusable then anyway).

    With ``modifier_rank``, ``group`` must cover the ZeRO parameters' process groups (DeepSpeed
    broadcasts over those) and hold ``modifier_rank``; otherwise :class:`InvalidArgumentError` /
    :class:`InvalidSourceRankError` at construction, on every rank. Works without
    DeepSpeed and with plain (DDP) models: there is nothing to gather, buffers are still handled.
    DeepSpeed's context is always exited.

    Example::

        with GatheredParametersAndBuffers(model, modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                model.load_state_dict(torch.load("ckpt.pt"))
        # every rank now has the checkpoint's weights AND buffers
    """

    def __init__(self, target: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True, *, check_buffers: bool = True, atol: float = 0.0, group: Any = None,
                 timeout: _dist.Timeout = None, snapshot: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        self.modifier_rank = _dist.check_rank_arg(modifier_rank, "modifier_rank", "GatheredParametersAndBuffers",
                                                  optional=True)
        modules, loose = _split(target)
        self._params = loose + [p for m in modules for p in m.parameters()]
        self.fwd_module = fwd_module
        self.check_buffers, self.atol, self.group, self.snapshot = check_buffers, atol, group, snapshot
        self.timeout = _dist.check_timeout(timeout, "GatheredParametersAndBuffers")
        plain = [p for p in loose if not hasattr(p, "ds_id")]
        self._box = _dist.as_module(modules, plain) if modules or plain else None
        self._g = _dist.resolve_group(group) if self.modifier_rank is not None else None
        self._check_group()
        self._ds: Any = None
        self._saved = _Snapshot()
        self._gathered: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _check_group(self) -> None:
        """With ``modifier_rank``: ``group`` must cover every ZeRO parameter's process group (DeepSpeed broadcasts
        over those, after ranks agree over ``group``) and hold ``modifier_rank``. No collective: same on all ranks."""
        g = self._g
        if self.modifier_rank is None or not (dist.is_available() and dist.is_initialized()):
            return
        me = dist.get_rank()
        zero_ranks: set[int] = set()
        for pg in {id(p.ds_process_group): p.ds_process_group for p in self._params
                   if hasattr(p, "ds_process_group")}.values():
            zero_ranks.update(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD))
        ours = set(g.ranks) if g is not None else {me} if _dist.is_member(self.group) else set()
        if zero_ranks and not zero_ranks <= ours:
            raise InvalidArgumentError(
                f"GatheredParametersAndBuffers: group has ranks {sorted(ours)} (as seen on rank {me}) but the ZeRO "
                f"parameters' process groups span ranks {sorted(zero_ranks)}; DeepSpeed broadcasts over those, so "
                "pass a group that covers them (or none for the world)")
        if g is not None:
            try:
                src = self._src()
            except (ValueError, RuntimeError) as e:
                raise InvalidSourceRankError(f"GatheredParametersAndBuffers: modifier_rank={self.modifier_rank} is not "
                                             f"a rank of the group (ranks {list(g.ranks)}): {e}") from e
            _dist.check_src(g, src)

    def _src(self) -> int:
        """``modifier_rank`` as a global rank."""
        if self.group is None or not dist.is_initialized():
            return self.modifier_rank
        return dist.get_global_rank(self.group, self.modifier_rank)

    def __enter__(self) -> GatheredParametersAndBuffers:
        if not self.enabled:
            return self
        if self._box is not None and self.modifier_rank is None and self.check_buffers:
            assert_buffers_in_sync(self._box, group=self.group, atol=self.atol, timeout=self.timeout)
        if self.modifier_rank is not None and self.snapshot:
            self._take_snapshot()
        self._ds = _gathered_parameters(self._params, self.modifier_rank, self.fwd_module)
        if self._ds is not None:
            self._ds.__enter__()
            if self.modifier_rank is not None:  # references only: a rollback gives each its gathered data back
                self._gathered = [(p, p.data) for p in getattr(self._ds, "params", ())]
        return self

    def _take_snapshot(self) -> None:
        """The rollback copy; if it fails on any rank (out of memory, say), every rank raises before gathering."""
        held = [p for p in self._params if _held_outside(p)]
        error = None
        try:
            with torch.no_grad():
                self._saved = _snapshot(self._box, held)
        except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
            error = e
        g = self._g
        try:
            if g is not None:
                _dist.require_all_succeeded(g, error is not None, self.timeout, "GatheredParametersAndBuffers",
                                             "nothing was gathered", steps=("taking the rollback copy failed",))
        except ZeroBuffersError:
            if error is None:
                raise
        if error is not None:
            self._saved = _Snapshot()
            raise error

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if not self.enabled:
            return False
        committed = self.modifier_rank is None
        try:
            if not committed:
                self._commit(failed=exc_type is not None)
                committed = True
        except ZeroBuffersError:
            if exc_type is None:
                raise  # else: the body's own exception is the one to see
        finally:
            try:
                if not committed:
                    self._roll_back()
            finally:
                self._saved, self._gathered = _Snapshot(), []
                if self._ds is not None:
                    self._ds.__exit__(exc_type, exc, tb)
                    self._ds = None
        return False

    def _commit(self, failed: bool) -> None:
        """Unless a body raised or DeepSpeed would refuse on some rank (then every rank raises), broadcast buffers
        and plain parameters; DeepSpeed's exit then broadcasts the ZeRO parameters."""
        refusal = None if failed or self._ds is None else _deepspeed_would_refuse(self._ds)
        g = self._g
        if g is None:
            if failed or refusal:
                raise ZeroBuffersError(f"GatheredParametersAndBuffers: {refusal or 'the body raised'}; nothing was "
                                       "committed")
            return
        try:
            _dist.require_all_succeeded(g, 1 if failed else 2 if refusal else 0, self.timeout,
                                         "GatheredParametersAndBuffers",
                                         "nothing was committed: parameters and buffers are as before the context",
                                         steps=("the body raised", "DeepSpeed would refuse to broadcast"))
        except ZeroBuffersError as e:
            raise ZeroBuffersError(f"{e}. Here: {refusal}") if refusal else e
        if self._box is not None:
            broadcast_buffers(self._box, src=self._src(), group=self.group, include_parameters=True,
                              timeout=self.timeout)

    def _roll_back(self) -> None:
        """Discard the body's updates: DeepSpeed re-partitions without broadcasting; the rest get their copies back."""
        with torch.no_grad():
            problems = _restore(self._saved, self._gathered)
        if self._ds is not None:
            _discard_updates(self._ds)
        if problems:
            warnings.warn("GatheredParametersAndBuffers: could not restore " + "; ".join(problems), RuntimeWarning,
                          stacklevel=3)
