"""keep_in_sync: the per-forward buffer sync DDP does, with declared rules, for what has none (DeepSpeed engines,
FSDP2 models, plain modules under a custom loop).

When it syncs: after every ``every``-th optimizer step of a DeepSpeed engine (``engine.step()`` at a gradient
accumulation boundary: between a backward and the next forward, so no autograd graph holds a buffer it writes), or
before every ``every``-th train-mode forward of a module (as DDP does; eval-mode forwards never sync, so an eval on
one rank alone cannot hang). ``handle.sync()`` syncs now.

Steady state, the hot path: the structure is agreed once, at the first sync (one small all_gather naming any
difference). Every later sync re-checks locally that the buffers are the tensors it planned for, over the same
memory (three C-level passes over kept lists: identity, address, dict sizes; tensors replaced by ones of the same
structure, or given new memory by ``buf.data = ...``, are taken up), then pays one collective per reduction kind and
bucket (dtype within a kind: int64 stays int64), packing each bucket into flat tensors kept between calls (one
``torch.cat(out=)`` for a contiguous bucket of a dtype it takes, else one fused copy) and unpacking with one fused
copy, writing only once every collective completed. The buffers
stay ordinary tensors with their own memory (views into the buckets would save both copies, but Accelerate's
``save_model`` keeps one tensor per shared storage and drops the rest from the checkpoint). The cross-rank check
rides along: ``[failed flag per member, changed flag per member]`` (changed: this rank's structure digest now is
not the agreed one, an exact local comparison) in front of the BatchNorm all-reduce, or alone when any rule reduces
and none is ``"bn"``; for a plan that
only broadcasts, the source's ``[failed, full digest]`` rides in the last 16 bytes of its last bucket (it packs and
sends bucket by bucket; then a receiver whose own structure changed raises alone, after the collectives, having
written nothing, while the others take the source's values).

Repeated syncs do not compound: ``"bn"`` weights and counts each rank's batches since the last sync
(``num_batches_tracked`` stays the count of all ranks' batches), ``"sum"`` adds what each rank added since the last
sync (the first sync: the source's value plus what every other rank added since ``keep_in_sync`` was called).
"""
from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from . import _args, _group, _modules, _structure, _transaction, _wire, bn_average
from . import rules as rules_mod
from ._compat import deepspeed as ds_compat
from ._compat import torch as torch_compat
from .errors import BufferStructureError, InvalidArgumentError, SyncAbortedError

_FN = "keep_in_sync"
_MARK = "_zero_buffers_keep_in_sync"  # on the module while a handle keeps it in sync
Start = Literal["installed", "zero", "synced"]
"""What the first sync counts of the "sum" buffers and BatchNorm counters: ``"installed"`` (keep_in_sync): the
source's whole value plus what every other rank added since the handle was made; ``"zero"`` (a trainer callback
that began late): every rank's whole value; ``"synced"`` (a save hook, right after a sync left every rank equal):
what every rank added since."""


_CAT_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                         torch.int16, torch.int8, torch.uint8, torch.bool})  # torch.cat(out=) packs these in one op


@dataclass
class _Kind:
    """One reduction kind's tensors, their buckets and the flat tensors kept between syncs."""

    rule: str
    buckets: list[_wire.Bucket]
    flats: list[torch.Tensor]
    targets: list[list[torch.Tensor]]  # per bucket: its tensors
    names: list[list[str]]  # per bucket: its tensors' qualified names
    views: list[list[torch.Tensor]] = field(default_factory=list)  # per bucket: views of its flat shaped like them
    writes: list[list[torch.Tensor]] = field(default_factory=list)  # per bucket: ``t.data`` of its tensors
    sources: list[list[torch.Tensor] | None] = field(default_factory=list)  # per bucket: ``t.data.view(-1)`` of its
    # tensors when one torch.cat(out=) can pack them (contiguous, a dtype it takes), else None
    sub: list[torch.Tensor] | None = None  # "sum": what each rank subtracts before the all-reduce, per bucket
    add: list[torch.Tensor] | None = None  # "sum": what is added back to the all-reduced deltas

    def __post_init__(self) -> None:
        self.views = [_views(f, t) for f, t in zip(self.flats, self.targets)]
        self.writes = [[t.data for t in part] for part in self.targets]
        self.sources = [[w.view(-1) for w in part]
                        if b.dtype in _CAT_DTYPES and all(w.is_contiguous() for w in part) else None
                        for b, part in zip(self.buckets, self.writes)]

    def pack(self, i: int) -> None:
        """Copy bucket ``i``'s tensors into its flat (one op where torch.cat can; "sum": less the base)."""
        flat, sources = self.flats[i], self.sources[i]
        if sources is not None:
            torch.cat(sources, out=flat.view(torch.bool) if self.buckets[i].dtype == torch.bool else flat)
        else:
            torch_compat.copy_all(self.views[i], self.targets[i], self.buckets[i].dtype.is_complex)
        if self.sub is not None:
            flat.sub_(self.sub[i])  # "sum": what this rank added since the last sync

    def rebind(self, i: int, flat: torch.Tensor) -> None:
        """Bucket ``i`` now lives in ``flat`` (a view into a larger tensor)."""
        self.flats[i] = flat
        self.views[i] = _views(flat, self.targets[i])


def _flat_like(b: _wire.Bucket) -> torch.Tensor:
    return torch.zeros(b.numel, dtype=torch.uint8 if b.dtype == torch.bool else b.dtype, device=b.device)


def _views(flat: torch.Tensor, ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` (as bools for a bool bucket) shaped like ``ts``."""
    typed = flat.view(torch.bool) if ts[0].dtype == torch.bool else flat
    out, offset = [], 0
    for t in ts:
        out.append(typed[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


class _Steady:
    """What one structure agreement settled: the plan, its digest, the kinds with their buckets, and the bases of
    the "sum" buffers and BatchNorm counters (what each rank subtracts before, and what is added back after, the
    all-reduce)."""

    def __init__(self, g: _group.Group, plan: rules_mod.Plan, src: int, bases: dict[str, torch.Tensor],
                 first: bool):
        """``bases``: by name, the values the last sync left (the same on every rank), or, at the ``first`` sync,
        this rank's values when keep_in_sync was called: then the source's whole value counts (it subtracts nothing,
        nothing is added back) and every other rank's additions since."""
        self.plan, self.g = plan, g
        entries = plan.synced()
        mine = {id(t) for _, t in entries}
        owners = [(m._buffers, k, t) for m in plan.modules for k, t in m._buffers.items()
                  if t is not None and id(t) in mine]  # where each synced tensor is registered
        self.tables, self.keys = [o[0] for o in owners], [o[1] for o in owners]
        self.tensors = [o[2] for o in owners]
        self.ptrs = list(map(torch.Tensor.data_ptr, self.tensors))
        self.dicts = [m._buffers for m in plan.modules] + [m._modules for m in plan.modules]
        self.sizes = list(map(len, self.dicts))  # a buffer or a submodule added?
        self.call = _call(src, plan)
        self.digest = _structure.digest(self.call, entries)
        name_of = {id(a.tensor): a.name for a in plan.assigned}
        counts_from_src = first and g.me == src
        self.kinds: list[_Kind] = []
        for rule in ("sum", "mean", "max", "min", "broadcast"):
            ts = [a.tensor for a in plan.of(rule)]
            buckets = _wire.plan(ts)
            if buckets:
                targets = [[ts[j] for j in b.indices] for b in buckets]
                kind = _Kind(rule, buckets, [_flat_like(b) for b in buckets], targets,
                             [[name_of[id(t)] for t in part] for part in targets])
                if rule == "sum":
                    kind.sub = [torch.zeros_like(f) for f in kind.flats]
                    kind.add = [torch.zeros_like(f) for f in kind.flats]
                    for sub, add, part, names in zip(kind.sub, kind.add, targets, kind.names):
                        base = [bases.get(n, t) for n, t in zip(names, part)]
                        if not counts_from_src:
                            torch_compat.copy_all(_views(sub, part), base)
                        if not first:
                            torch_compat.copy_all(_views(add, part), base)
                self.kinds.append(kind)
        self.broadcast = next((k for k in self.kinds if k.rule == "broadcast"), None)
        # the check: [failed flag per member, changed flag per member] all-reduced before the BatchNorm sums (or
        # alone), unless the plan only broadcasts: then the source's [failed, digest] rides in its last bucket's tail
        self.reduced_check = bool(plan.bns) or self.broadcast is None or len(self.kinds) > 1
        self.head: torch.Tensor | None = None  # the last broadcast bucket's bytes plus 16
        self.tail = torch.zeros(2, dtype=torch.int64)
        if not self.reduced_check and self.broadcast is not None:  # broadcast only: receivers pack nothing
            last = self.broadcast
            j = len(last.flats) - 1
            size = last.flats[j].numel() * last.flats[j].element_size()
            padded = -(-size // 8) * 8
            self.head = torch.zeros(padded + 16, dtype=torch.uint8, device=last.buckets[j].device)
            last.rebind(j, self.head[:size].view(last.flats[j].dtype))
            self.tail = self.head[padded:].view(torch.int64)
        self.counted = [bn for bn in plan.bns if bn.count is not None]
        self.count_names = [name for bn in self.counted for name, t in bn.entries() if t is bn.count]
        self.layout = bn_average.layout(plan.bns, g.device, untracked=True)  # kept: the plan's tensors are checked
        self.width = 2 * g.size  # the check: [failed flag per member, changed flag per member]
        self.combined = torch.zeros(self.width + self.layout.numel, dtype=torch.float64, device=g.device)
        self.check = torch.zeros(self.width, dtype=torch.float64)  # the check, on the host
        base_counts = [float(bases.get(n, bn.count)) for n, bn in zip(self.count_names, self.counted)]  # type: ignore
        self.bn_sub = torch.tensor([0.0] * len(base_counts) if counts_from_src else base_counts, dtype=torch.float64)
        self.bn_add = torch.tensor([0.0] * len(base_counts) if first else base_counts, dtype=torch.float64)

    def bases(self) -> dict[str, torch.Tensor]:
        """By name, what the last sync left of the "sum" buffers and BatchNorm counters (for a new agreement)."""
        out: dict[str, torch.Tensor] = {}
        for kind in self.kinds:
            if kind.add is not None:
                for add, part, names in zip(kind.add, kind.targets, kind.names):
                    out.update({n: v.clone() for n, v in zip(names, _views(add, part))})
        out.update({n: torch.tensor(v) for n, v in zip(self.count_names, self.bn_add.tolist())})
        return out

    def current(self) -> bool:
        """Whether the model still has the very tensors the plan was made from, where they were, over the same
        memory (``buf.data = ...`` swaps it under the same tensor), and no buffer or submodule more: a cheap local
        check, three C-level passes over lists."""
        return all(map(operator.is_, map(dict.get, self.tables, self.keys), self.tensors)) and \
            list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs and list(map(len, self.dicts)) == self.sizes


class KeepInSync:
    """Handle returned by :func:`keep_in_sync`: ``sync()`` syncs now (every rank), ``remove()`` stops it (also a
    context manager); ``syncs`` counts the syncs done."""

    def __init__(self, target: Any, module: nn.Module, plan: rules_mod.Plan, declared: tuple[Any, bool, str],
                 g: _group.Group | None, src: int, every: int, seconds: float | None, engine: bool,
                 start: Start = "installed"):
        self.target, self.module, self.plan, self.g, self.src = target, module, plan, g, src
        self._declared = declared  # (rules, strict, BatchNorm default) as passed: every re-resolve uses them
        self.every, self.seconds = every, seconds
        self.syncs = 0
        self._ticks = 0
        self._steady: _Steady | None = None
        self._last: _Steady | None = None  # the last agreement that synced: its bases carry over to the next one
        # what the first sync counts (see Start): only "installed" treats the source apart
        self._source_whole = start == "installed"
        counters = {id(bn.count) for bn in plan.bns if bn.count is not None}
        self._start = {a.name: torch.zeros_like(a.tensor) if start == "zero" else a.tensor.detach().clone()
                       for a in plan.assigned if a.rule == "sum" or id(a.tensor) in counters}
        self._undo: Callable[[], None]
        if engine:
            original = target.step

            @functools.wraps(original)
            def step(*args: Any, **kwargs: Any) -> Any:
                boundary = bool(target.is_gradient_accumulation_boundary())
                out = original(*args, **kwargs)
                if boundary:
                    self._tick()
                return out
            object.__setattr__(target, "step", step)
            self._undo = lambda: object.__delattr__(target, "step")
        else:
            handle = module.register_forward_pre_hook(lambda m, args: self._tick() if m.training else None)
            self._undo = handle.remove
        module.__dict__[_MARK] = self  # a second handle would keep bases of its own: "sum" and "bn" would compound
        self._installed = True

    def _resolve(self) -> rules_mod.Plan:
        rules, strict, bn_default = self._declared
        return rules_mod.resolve(self.module, rules, _FN, strict=strict, bn_default=bn_default)

    @property
    def _first(self) -> bool:
        """Whether the next sync is the first and counts the source's whole value (``start="installed"``)."""
        return self._last is None and self._source_whole

    def _tick(self) -> None:
        self._ticks += 1
        if self._ticks % self.every == 0:
            self.sync()

    def sync(self) -> None:
        """Sync every buffer by its rule now; every rank of the group must call (a no-op without one)."""
        if self.g is None:
            return
        g, deadline = self.g, _wire.Deadline(self.seconds)
        steady = self._steady
        if steady is None:  # an agreement (the first sync, or after a change every rank saw): named differences
            try:
                plan = self._resolve()
                steady = _Steady(g, plan, self.src, self._last.bases() if self._last else self._start, self._first)
            except Exception as e:  # this rank's model no longer takes its rules: every rank learns it here
                try:
                    _structure.agree(g, (_FN, "could not plan its buffers here", f"{type(e).__name__}: {e}"), [],
                                     deadline, _FN)
                except BufferStructureError as mismatch:
                    raise mismatch from e
                raise  # every rank failed alike
            _structure.agree(g, steady.call, plan.synced(), deadline, _FN)
            problem = _transaction.unsendable(g, plan.synced(), _FN)
            if problem is not None:
                raise problem
            self._steady = steady
            self.plan = plan
        announce, cause = steady.digest, None
        if not steady.current():  # tensors were replaced here: the same structure carries on with them
            try:
                plan = self._resolve()
                announce = _structure.digest(_call(self.src, plan), plan.synced())
                if announce == steady.digest:  # else a new structure: this sync still runs the agreed collectives,
                    self._steady = steady = _Steady(g, plan, self.src, steady.bases(), self._first)  # writing nothing
            except Exception as e:  # noqa: BLE001 - announced as a change: every rank that can tell raises
                announce, cause = steady.digest ^ 1, e
        try:
            _sync(steady, self.src, deadline, announce)
        except _Changed as e:
            if e.everyone:
                self._steady = None  # every rank raised: the next sync agrees again, naming the difference
            if cause is not None:
                raise e from cause
            raise
        self._last = steady
        self.syncs += 1

    def remove(self) -> None:
        """Stop syncing (idempotent)."""
        if self._installed:
            self._undo()
            if self.module.__dict__.get(_MARK) is self:
                del self.module.__dict__[_MARK]
            self._installed = False

    def __enter__(self) -> KeepInSync:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _call(src: int, plan: rules_mod.Plan) -> tuple:
    """What every rank's call must agree on besides the buffers: the source and each buffer's rule."""
    return (_FN, src, plan.signature)


class _Changed(BufferStructureError):
    """The structure changed on some ranks (``ranks``, global, when known). ``everyone``: every rank raised it (then
    every rank agrees again at the next sync, naming the difference); else only this rank knows (a receiver whose own
    buffers changed, when only the source's check travels), and it keeps running the agreed collectives, raising
    each time, while the others sync."""

    def __init__(self, everyone: bool, ranks: tuple[int, ...] = ()):
        where = (("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))) if ranks else "some ranks"
        super().__init__(f"{_FN}(): the model's buffers (or rules) changed since the last sync on {where}"
                         + ("; the next sync names the difference" if everyone else " (here, not on the source)")
                         + ". No buffer was modified here")
        self.everyone, self.ranks = everyone, ranks


def _sync(s: _Steady, src: int, deadline: _wire.Deadline, announce: int) -> None:
    """One steady-state sync (module docstring): pack, the check (riding on the BatchNorm all-reduce, or alone, or
    in the source's last broadcast bucket), the kinds' collectives, writes. ``announce``: the structure digest this
    rank has now (when it is not the agreed one, every rank raises after the check's all-reduce, before the kinds'
    collectives; in a broadcast-only plan a receiver's own change raises there alone, after the broadcasts)."""
    if not s.reduced_check:
        _sync_broadcast(s, src, deadline, announce)
        return
    g = s.g
    source = g.me == src
    width, combined, check = s.width, s.combined, s.check
    check.zero_()
    check[g.size + g.me] = float(announce != s.digest)
    failure: BaseException | None = None
    try:  # in place into space kept since the agreement: nothing here allocates what the failure path needs
        combined[:width].copy_(check)
        bn_average._pack(s.plan.bns, g.device, s.bn_sub, lay=s.layout, out=combined[width:])
        for kind in s.kinds:
            if kind.rule != "broadcast" or source:  # receivers take the broadcast buckets as they come
                for i in range(len(kind.flats)):
                    kind.pack(i)
    except BaseException as e:  # noqa: BLE001 - sent as this rank's flag: every rank raises
        failure = e
        check[g.me] = 1.0
        combined.zero_()
        combined[:width].copy_(check)
    _wire.all_reduce(g, combined, deadline, _FN)
    check.copy_(combined[:width])
    values = check.tolist()
    if any(values[:g.size]):
        _transaction.abort_if_any(g, [int(f) for f in values[:g.size]], failure, deadline, f"{_FN}()",
                                  "packing the buffers failed", "no buffer was modified", error=SyncAbortedError)
    changed = tuple(r for r, v in zip(g.ranks, values[g.size:]) if v)
    if changed:  # every rank sees it: none runs the kinds' collectives
        raise _Changed(everyone=True, ranks=changed)
    works = []
    for kind in s.kinds:
        for flat in kind.flats:
            if kind.rule == "broadcast":
                works.append(dist.broadcast(_wire.wire_view(flat), src=g.global_rank(src), group=g.pg,
                                            async_op=True))
            else:
                works.append(dist.all_reduce(_wire.wire_view(flat), op=rules_mod.REDUCE_OPS[kind.rule], group=g.pg,
                                             async_op=True))
    _wire.wait(works, deadline, _FN)
    with torch.no_grad():  # every collective completed: write (no collective below)
        if s.plan.bns:
            s.bn_sub = s.bn_add = bn_average._write(s.plan.bns, combined[width:], s.bn_add, lay=s.layout).counts
        for kind in s.kinds:
            if kind.rule == "broadcast" and source:
                continue
            for i, flat in enumerate(kind.flats):
                if kind.sub is not None and kind.add is not None:
                    flat.add_(kind.add[i])
                    kind.add[i].copy_(flat)
                    kind.sub[i].copy_(flat)
                if kind.rule == "mean":
                    flat.div_(g.size)  # scratch: packed again at the next sync
                torch_compat.copy_all(kind.writes[i], kind.views[i], kind.buckets[i].dtype.is_complex)
    _after(s)


def _sync_broadcast(s: _Steady, src: int, deadline: _wire.Deadline, announce: int) -> None:
    """The steady state of a plan that only broadcasts: the source packs each bucket and sends it at once (packing
    the next while it travels), its [failed, digest] in the last bucket's tail; receivers pack nothing, wait for
    every bucket, check the tail, then unpack."""
    g, kind, head = s.g, s.broadcast, s.head
    assert kind is not None and head is not None
    root = g.global_rank(src)
    last = len(kind.flats) - 1
    works = []

    def send(i: int) -> None:  # the last bucket travels with the source's check in its tail
        works.append(dist.broadcast(head if i == last else _wire.wire_view(kind.flats[i]), src=root, group=g.pg,
                                    async_op=True))
    failed_text = f"{_FN}(): packing the buffers failed on the source, rank {root}; no buffer was modified"
    if g.me == src:
        failure: BaseException | None = None
        for i in range(len(kind.flats)):
            if failure is None:
                try:
                    kind.pack(i)
                except BaseException as e:  # noqa: BLE001 - sent in the tail: every rank raises
                    failure = e
            if i == last:
                s.tail[0], s.tail[1] = int(failure is not None), announce
            send(i)
        _wire.wait(works, deadline, _FN)
        if failure is not None:
            raise SyncAbortedError(failed_text, (root,), {}) from failure
        if announce != s.digest:  # the source changed: every receiver raises too
            raise _Changed(everyone=True, ranks=(root,))
        _after(s)
        return
    for i in range(len(kind.flats)):
        send(i)
    _wire.wait(works, deadline, _FN)
    failed, theirs = s.tail.tolist()
    if failed:
        raise SyncAbortedError(failed_text, (root,), {})
    if theirs != s.digest:  # the source changed: it raises too, and so does every receiver
        raise _Changed(everyone=True, ranks=(root,))
    if announce != s.digest:  # only this receiver changed
        raise _Changed(everyone=False, ranks=(g.ranks[g.me],))
    with torch.no_grad():
        for i in range(len(kind.flats)):
            torch_compat.copy_all(kind.writes[i], kind.views[i], kind.buckets[i].dtype.is_complex)
    _after(s)


def _after(s: _Steady) -> None:
    """The registered after_sync hooks, once every buffer is written."""
    for module, hook in s.plan.after:
        hook(module)


def hookless(model: Any, policy: str | None, start: Start, **options: Any) -> KeepInSync:
    """A :class:`KeepInSync` whose caller decides when it syncs (a save hook, a trainer callback): no hook, the same
    arithmetic; ``policy`` ``"broadcast"`` broadcasts BatchNorm statistics too. ``options``: keep_in_sync's."""
    handle = keep_in_sync(model, _bn_default="broadcast" if policy == "broadcast" else "bn", _start=start, **options)
    handle.remove()
    return handle


def keep_in_sync(model_or_engine: Any, *, every: int = 1, rules: rules_mod.Rules | None = None, src: int = 0,
                 group: Any = None, timeout: _args.Timeout = None, strict: bool = False,
                 _bn_default: str = "bn", _start: Start = "installed") -> KeepInSync:
    """Keep ``model_or_engine``'s buffers in sync during training, by their rules; returns a :class:`KeepInSync`.

    A DeepSpeed engine syncs after every ``every``-th optimizer step; a module (plain, FSDP2, DDP's inner
    module) before every ``every``-th train-mode forward (module docstring). ``rules`` as in
    :func:`sync_buffers` (default: BatchNorm statistics ``"bn"``, the rest ``"broadcast"`` from ``src``, or the
    rules classes registered); they are resolved and checked now, before any collective. Installing issues no
    collective; the first sync agrees on the structure, every later one costs one collective per reduction kind
    and bucket, plus the check: in the source's last bucket when every buffer is broadcast, in front of the
    ``"bn"`` all-reduce when there is one, else one small all-reduce. ``timeout`` bounds each sync.
    One handle per module at a time.

    Example::

        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        with zero_buffers.keep_in_sync(engine, rules={"*.cluster_size": "mean"}):
            for batch in loader:
                engine.backward(engine(batch)); engine.step()   # buffers equal on every rank after each step
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise InvalidArgumentError(f"{_FN}(): every must be an int >= 1, got {every!r}")
    src = _args.rank(src, "src", _FN)
    seconds = _args.timeout(timeout, _FN)
    engine = ds_compat.is_engine(model_or_engine)
    if engine:
        module = ds_compat.engine_module(model_or_engine)
        if "step" in vars(model_or_engine):
            raise InvalidArgumentError(f"{_FN}(): this engine's step() is already wrapped (keep_in_sync twice?); "
                                       "remove() the first handle")
    else:
        module = _modules.unwrap(_args.module(model_or_engine, _FN), _FN)
    if module.__dict__.get(_MARK) is not None:
        raise InvalidArgumentError(f"{_FN}(): this module is already kept in sync by another handle; remove() it "
                                   "first (two handles would each count what the ranks added, twice)")
    g = _group.resolve(group, _FN)
    _group.check_src(g, src, _FN)
    strict = _args.flag(strict, "strict", _FN)
    plan = rules_mod.resolve(module, rules, _FN, strict=strict, bn_default=_bn_default)
    return KeepInSync(model_or_engine, module, plan, (rules, strict, _bn_default), g, src, every, seconds, engine,
                      _start)
