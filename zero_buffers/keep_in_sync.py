"""keep_in_sync: the per-forward buffer sync DDP does, with declared rules, for what has none (DeepSpeed engines,
FSDP2 models, plain modules under a custom loop).

When it syncs: after every ``every``-th optimizer step of a DeepSpeed engine (``engine.step()`` at a gradient
accumulation boundary: between a backward and the next forward, so no autograd graph holds a buffer it writes), or
before every ``every``-th train-mode forward of a module (as DDP does; eval-mode forwards never sync, so an eval on
one rank alone cannot hang). ``handle.sync()`` syncs now.

Steady state, the hot path: the structure is agreed once, at the first sync (one small all_gather naming any
difference). Every later sync re-checks locally that the buffers are the tensors it planned for (one dict lookup
each; replaced tensors of the same structure are taken up) and then pays one collective per reduction kind and
bucket (dtype within a kind: int64 stays int64), into flat buckets and views kept between calls, writing only once
every collective completed. The cross-rank check rides along: ``[failed flag per member, d, d^2]`` (``d``: 20 bits
of the structure digest: the ranks' ``d`` are all equal exactly when ``(sum d)^2 == n * sum d^2``; two different
structures share their 20 bits about once in a million) in front of the BatchNorm all-reduce, or alone when there
is none; for a plan that only broadcasts, the source's ``[failed, full digest]`` in the last 16 bytes of its first
bucket (then a receiver whose own structure changed raises alone, after the collectives, having written nothing,
while the others take the source's values).

Repeated syncs do not compound: ``"bn"`` weights and counts each rank's batches since the last sync
(``num_batches_tracked`` stays the count of all ranks' batches), ``"sum"`` adds what each rank added since the last
sync (the first sync: the source's value plus what every other rank added since ``keep_in_sync`` was called).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
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
_DIGEST_BITS = 20  # n * d^2 stays exact in float64 for any n below 2**12


@dataclass
class _Kind:
    """One reduction kind's tensors, their buckets and the flat tensors kept between syncs."""

    rule: str
    tensors: list[torch.Tensor]
    buckets: list[_wire.Bucket]
    flats: list[torch.Tensor]
    targets: list[list[torch.Tensor]]  # per bucket: its tensors
    views: list[list[torch.Tensor]]  # per bucket: views of its flat shaped like them (made once)
    names: list[list[str]]  # per bucket: its tensors' qualified names
    writes: list[list[torch.Tensor]]  # per bucket: ``t.data`` of its tensors (writes autograd does not track)
    sub: list[torch.Tensor] | None = None  # "sum": what each rank subtracts before the all-reduce, per bucket
    add: list[torch.Tensor] | None = None  # "sum": what is added back to the all-reduced deltas


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
        self.owners = [(m._buffers, k, t) for m in plan.modules for k, t in m._buffers.items()
                       if t is not None and id(t) in mine]  # where each synced tensor is registered
        self.sizes = [(len(m._buffers), len(m._modules)) for m in plan.modules]  # buffers or modules added?
        self.call = (_FN, src, plan.signature)
        self.digest = _structure.digest(self.call, entries)
        name_of = {id(a.tensor): a.name for a in plan.assigned}
        counts_from_src = first and g.me == src
        self.kinds: list[_Kind] = []
        for rule in ("sum", "mean", "max", "min", "broadcast"):
            ts = [a.tensor for a in plan.of(rule)]
            buckets = _wire.plan(ts)
            if buckets:
                flats = [_flat_like(b) for b in buckets]
                targets = [[ts[j] for j in b.indices] for b in buckets]
                kind = _Kind(rule, ts, buckets, flats, targets, [_views(f, t) for f, t in zip(flats, targets)],
                             [[name_of[id(t)] for t in part] for part in targets],
                             [[t.data for t in part] for part in targets])
                if rule == "sum":
                    kind.sub = [torch.zeros_like(f) for f in flats]
                    kind.add = [torch.zeros_like(f) for f in flats]
                    for sub, add, part, names in zip(kind.sub, kind.add, targets, kind.names):
                        base = [bases.get(n, t) for n, t in zip(names, part)]
                        if not counts_from_src:
                            torch_compat.copy_all(_views(sub, part), base)
                        if not first:
                            torch_compat.copy_all(_views(add, part), base)
                self.kinds.append(kind)
        self.head: torch.Tensor | None = None  # the first broadcast bucket's bytes plus 16: the source's check
        self.tail = torch.zeros(2, dtype=torch.int64)
        first_bcast = next((k for k in self.kinds if k.rule == "broadcast"), None)
        if first_bcast is not None and len(self.kinds) == 1 and not plan.bns:  # broadcast only: receivers pack nothing
            b0 = first_bcast.buckets[0]
            size = first_bcast.flats[0].numel() * first_bcast.flats[0].element_size()
            padded = -(-size // 8) * 8
            self.head = torch.zeros(padded + 16, dtype=torch.uint8, device=b0.device)
            first_bcast.flats[0] = self.head[:size].view(first_bcast.flats[0].dtype)
            first_bcast.views[0] = _views(first_bcast.flats[0], first_bcast.targets[0])
            self.tail = self.head[padded:].view(torch.int64)
        self.counted = [bn for bn in plan.bns if bn.count is not None]
        self.count_names = [f"{bn.name}.num_batches_tracked" if bn.name else "num_batches_tracked"
                            for bn in self.counted]
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
        """Whether the model still has the very tensors the plan was made from, where they were, and no buffer or
        submodule more (a cheap local check: one dict lookup per buffer, two lengths per module)."""
        return all(table.get(k) is t for table, k, t in self.owners) and \
            self.sizes == [(len(m._buffers), len(m._modules)) for m in self.plan.modules]


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
            plan = self._resolve()
            steady = _Steady(g, plan, self.src, self._last.bases() if self._last else self._start, self._first)
            _structure.agree(g, steady.call, plan.synced(), deadline, _FN)
            problem = _transaction.unsendable(g, plan.synced(), _FN)
            if problem is not None:
                raise problem
            self._steady = steady
            self.plan = plan
        announce = steady.digest
        if not steady.current():  # tensors were replaced here: the same structure carries on with them
            fresh = _Steady(g, self._resolve(), self.src, steady.bases(), self._first)
            if fresh.digest == steady.digest:
                self._steady = steady = fresh
            else:  # a new structure: this sync still runs the agreed collectives, announcing it, and writes nothing
                announce = fresh.digest
        try:
            _sync(steady, self.src, deadline, announce)
        except _Changed as e:
            if e.everyone:
                self._steady = None  # every rank raised: the next sync agrees again, naming the difference
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


class _Changed(BufferStructureError):
    """The structure changed on some ranks. ``everyone``: every rank raised it (then every rank agrees again at the
    next sync, naming the difference); else only this rank knows (a receiver whose own buffers changed, when only the
    source's check travels), and it keeps running the agreed collectives, raising each time, while the others sync."""

    def __init__(self, everyone: bool):
        super().__init__(f"{_FN}(): the model's buffers (or rules) changed since the last sync on some ranks and not "
                         "on others" + ("; the next sync names the difference" if everyone else
                                        " (here, not on the source)") + ". No buffer was modified here")
        self.everyone = everyone


def _sync(s: _Steady, src: int, deadline: _wire.Deadline, announce: int) -> None:
    """One steady-state sync (module docstring): pack, the check (riding on the BatchNorm all-reduce, or in the
    source's first broadcast bucket, or alone), the kinds' collectives, writes. ``announce``: the structure digest
    this rank has now (not the agreed one: it raises after the collectives, and so does every rank that can tell)."""
    g = s.g
    failure: BaseException | None = None
    pack = torch.zeros(0, dtype=torch.float64, device=g.device)
    try:
        if s.plan.bns:
            pack = bn_average._pack(s.plan.bns, g.device, s.bn_sub)
        for kind in s.kinds:
            if kind.rule == "broadcast" and g.me != src:
                continue  # receivers take the buckets as they come
            for i, flat in enumerate(kind.flats):
                torch_compat.copy_all(kind.views[i], kind.targets[i], kind.buckets[i].dtype.is_complex)
                if kind.sub is not None:
                    flat.sub_(kind.sub[i])  # "sum": what this rank added since the last sync
    except BaseException as e:  # noqa: BLE001 - sent as this rank's flag: every rank raises
        failure = e
    broadcast = next((k for k in s.kinds if k.rule == "broadcast"), None)
    if s.plan.bns or broadcast is None:  # the all-reduce check: [failed per member, d, d^2]
        header = torch.zeros(g.size + 2, dtype=torch.float64, device=g.device)
        header[g.me] = float(failure is not None)
        d = float(announce % (1 << _DIGEST_BITS))
        header[g.size], header[g.size + 1] = d, d * d
        if failure is not None:
            pack = torch.zeros_like(pack)
        combined = _wire.all_reduce(g, torch.cat([header, pack]), deadline, _FN)
        header, pack = combined[:g.size + 2].cpu(), combined[g.size + 2:]
        flags = header[:g.size].tolist()
        if any(flags):
            _transaction.abort_if_any(g, [int(f) for f in flags], failure, deadline, f"{_FN}()",
                                      "packing the buffers failed", "no buffer was modified", error=SyncAbortedError)
        total, squares = float(header[g.size]), float(header[g.size + 1])
        if total * total != g.size * squares:
            raise _Changed(everyone=True)
    else:  # the source's check travels in its first broadcast bucket: [failed, digest]
        tail = s.tail
        tail[0], tail[1] = (int(failure is not None), announce) if g.me == src else (0, 0)
    for kind in s.kinds:
        for i, flat in enumerate(kind.flats):
            if kind.rule == "broadcast":
                wire = s.head if kind is broadcast and i == 0 and s.head is not None else _wire.wire_view(flat)
                _wire.wait([dist.broadcast(wire, src=g.global_rank(src), group=g.pg, async_op=True)], deadline, _FN)
            else:
                _wire.all_reduce(g, flat, deadline, _FN, op=rules_mod.REDUCE_OPS[kind.rule])
    if not s.plan.bns and broadcast is not None:
        failed, theirs = (int(v) for v in s.tail.tolist())
        if failed:
            raise SyncAbortedError(f"{_FN}(): packing the buffers failed on the source, rank {g.global_rank(src)}; "
                                   "no buffer was modified", (g.global_rank(src),), {})
        if theirs != s.digest:  # the source changed: it raises too, and so does every receiver
            raise _Changed(everyone=True)
        if announce != s.digest:  # only this receiver changed
            raise _Changed(everyone=False)
    if announce != s.digest:
        raise _Changed(everyone=True)
    with torch.no_grad():  # every collective completed: write (no collective below)
        if s.plan.bns:
            bn_average._write(s.plan.bns, pack, s.bn_add, untracked=True)
            s.bn_sub = s.bn_add = torch.tensor([float(bn.count) for bn in s.counted],  # type: ignore[arg-type]
                                               dtype=torch.float64)
        for kind in s.kinds:
            if kind.rule == "broadcast" and g.me == src:
                continue
            for i, flat in enumerate(kind.flats):
                if kind.sub is not None and kind.add is not None:
                    flat.add_(kind.add[i])
                    kind.add[i].copy_(flat)
                    kind.sub[i].copy_(flat)
                if kind.rule == "mean":
                    flat.div_(g.size)  # scratch: packed again at the next sync
                torch_compat.copy_all(kind.writes[i], kind.views[i], kind.buckets[i].dtype.is_complex)
    for module, hook in s.plan.after:
        hook(module)


def keep_in_sync(model_or_engine: Any, *, every: int = 1, rules: rules_mod.Rules | None = None, src: int = 0,
                 group: Any = None, timeout: _args.Timeout = None, strict: bool = False,
                 _bn_default: str = "bn", _start: Start = "installed") -> KeepInSync:
    """Keep ``model_or_engine``'s buffers in sync during training, by their rules; returns a :class:`KeepInSync`.

    A DeepSpeed engine syncs after every ``every``-th optimizer step; a module (plain, FSDP2, DDP's inner
    module) before every ``every``-th train-mode forward (module docstring). ``rules`` as in
    :func:`sync_buffers` (default: BatchNorm statistics ``"bn"``, the rest ``"broadcast"`` from ``src``, or the
    rules classes registered); they are resolved and checked now, before any collective. Installing issues no
    collective; the first sync agrees on the structure, every later one costs one collective per reduction kind
    and bucket (plus one small all-reduce when rules reduce but none is ``"bn"``). ``timeout`` bounds each sync.
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
        module = model_or_engine.module
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
