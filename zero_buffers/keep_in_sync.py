"""keep_in_sync: the per-forward buffer sync DDP does, with declared rules, for what has none (DeepSpeed engines,
FSDP2 models, plain modules under a custom loop).

When it syncs: after every ``every``-th optimizer step of a DeepSpeed engine (``engine.step()`` at a gradient
accumulation boundary: between a backward and the next forward, so no autograd graph holds a buffer it writes), or
before every ``every``-th train-mode forward of a module (as DDP does; eval-mode forwards never sync, so an eval on
one rank alone cannot hang). ``handle.sync()`` syncs now.

Steady state, the hot path: the structure is agreed once, at the first sync (one small all_gather naming any
difference). Every later sync re-checks locally that the buffers are the same tensors and sends one float64 header
``[failed flag per member, d, d^2]`` (``d``: 20 bits of the structure digest) riding in front of the BatchNorm
all-reduce, or alone when no rule needs an all-reduce of float64: equal digests on every rank are exactly
``(sum d)^2 == n * sum d^2``. Then one collective per reduction kind and bucket (dtype within a kind: int64 stays
int64), into flat buckets kept between calls, and writes only once every collective completed. Repeated syncs do
not compound: ``"bn"`` weights and counts each rank's batches since the last sync (``num_batches_tracked`` stays
the count of all ranks' batches), ``"sum"`` adds what each rank added since the last sync.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _args, _group, _modules, _structure, _transaction, _wire, bn_average
from . import rules as rules_mod
from ._compat import deepspeed as ds_compat
from ._compat import torch as torch_compat
from .errors import BufferStructureError, InvalidArgumentError, SyncAbortedError

_FN = "keep_in_sync"
_DIGEST_BITS = 20  # n * d^2 stays exact in float64 for any n below 2**12
_REDUCE = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class _Kind:
    """One reduction kind's tensors, their buckets and the flat tensors kept between syncs."""

    rule: str
    tensors: list[torch.Tensor]
    buckets: list[_wire.Bucket]
    flats: list[torch.Tensor]
    sub: list[torch.Tensor] | None = None  # "sum": what each rank subtracts before the all-reduce, per bucket
    add: list[torch.Tensor] | None = None  # "sum": what is added back to the all-reduced deltas


def _flat_like(b: _wire.Bucket) -> torch.Tensor:
    return torch.zeros(b.numel, dtype=torch.uint8 if b.dtype == torch.bool else b.dtype, device=b.device)


class _Steady:
    """What the first sync agreed on: the plan, its digest, the kinds with their buckets."""

    def __init__(self, g: _group.Group, plan: rules_mod.Plan, src: int, start: dict[int, torch.Tensor]):
        """``start``: this rank's values of the "sum" buffers and BatchNorm counters when syncing began (by tensor
        id). The first sync sums the source's value and every other rank's additions since then; each later sync
        adds every rank's additions since the last one."""
        self.plan, self.g = plan, g
        entries = plan.synced()
        self.key = tuple((id(t), t.shape, t.dtype, t.device) for _, t in entries)
        self.call = (_FN, src, plan.signature)
        self.digest = _structure.digest(self.call, entries)
        self.d = float(self.digest % (1 << _DIGEST_BITS))
        self.kinds: list[_Kind] = []
        for rule in ("sum", "mean", "max", "min", "broadcast"):
            ts = [a.tensor for a in plan.of(rule)]
            buckets = _wire.plan(ts)
            if buckets:
                flats = [_flat_like(b) for b in buckets]
                kind = _Kind(rule, ts, buckets, flats)
                if rule == "sum":
                    kind.add = [torch.zeros_like(f) for f in flats]
                    kind.sub = [torch.zeros_like(f) for f in flats]
                    if g.me != src:
                        for b, sub in zip(buckets, kind.sub):
                            torch_compat.pack_into(sub, [start.get(id(ts[j]), ts[j]) for j in b.indices])
                self.kinds.append(kind)
        self.counted = [bn for bn in plan.bns if bn.count is not None]
        self.bn_add = torch.zeros(len(self.counted), dtype=torch.float64)
        self.bn_sub = torch.tensor([0.0 if g.me == src else float(start.get(id(bn.count), bn.count))  # type: ignore
                                    for bn in self.counted], dtype=torch.float64)

    def carry(self, old: _Steady) -> None:
        """The same structure with new tensors: keep what the last sync left."""
        for new, kind in zip(self.kinds, old.kinds):
            new.sub, new.add = kind.sub, kind.add
        self.bn_sub, self.bn_add = old.bn_sub, old.bn_add

    def current(self) -> bool:
        """Whether the model still has the very tensors the plan was made from (a cheap local check)."""
        return self.key == tuple((id(t), t.shape, t.dtype, t.device) for _, t in self.plan.synced())


class KeepInSync:
    """Handle returned by :func:`keep_in_sync`: ``sync()`` syncs now (every rank), ``remove()`` stops it (also a
    context manager); ``syncs`` counts the syncs done."""

    def __init__(self, target: Any, module: nn.Module, plan: rules_mod.Plan, declared: tuple[Any, bool],
                 g: _group.Group | None, src: int, every: int, seconds: float | None, engine: bool):
        self.target, self.module, self.plan, self.g, self.src = target, module, plan, g, src
        self._declared = declared  # (rules, strict) as passed: a re-resolve after tensors were swapped uses them
        self.every, self.seconds = every, seconds
        self.syncs = 0
        self._ticks = 0
        self._steady: _Steady | None = None
        self._start = {id(t): t.detach().clone() for t in
                       [a.tensor for a in plan.of("sum")] + [bn.count for bn in plan.bns if bn.count is not None]}
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
        self._installed = True

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
        if steady is None or not steady.current():
            plan = self.plan if steady is None else rules_mod.resolve(self.module, self._declared[0], _FN,
                                                                        strict=self._declared[1])
            fresh = _Steady(g, plan, self.src, self._start)
            if steady is None:  # the first sync: the full structure check, naming the first difference
                _structure.agree(g, fresh.call, fresh.plan.synced(), deadline, _FN)
            elif fresh.digest == steady.digest:  # the same structure, new tensors: carry the bases over
                fresh.carry(steady)
            self._steady = steady = fresh
        try:
            _sync(steady, self.src, deadline)
        except BufferStructureError:
            self._steady = None  # the next sync agrees again, naming the difference
            raise
        self.syncs += 1

    def remove(self) -> None:
        """Stop syncing (idempotent)."""
        if self._installed:
            self._undo()
            self._installed = False

    def __enter__(self) -> KeepInSync:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _sync(s: _Steady, src: int, deadline: _wire.Deadline) -> None:
    """One steady-state sync (module docstring): pack, header (+ BatchNorm sums), the kinds' collectives, writes."""
    g = s.g
    failure: BaseException | None = None
    pack = torch.zeros(0, dtype=torch.float64)
    try:
        pack = bn_average._pack(s.plan.bns, g.device, s.bn_sub) if s.plan.bns else pack.to(g.device)
        for kind in s.kinds:
            for i, b in enumerate(kind.buckets):
                ts = [kind.tensors[j] for j in b.indices]
                if kind.rule == "broadcast" and g.me != src:
                    continue  # receivers take the bucket as it comes
                flat = kind.flats[i]
                torch_compat.pack_into(flat.view(torch.bool) if b.dtype == torch.bool else flat, ts)
                if kind.sub is not None:
                    flat.sub_(kind.sub[i])  # "sum": what this rank added since the last sync
    except BaseException as e:  # noqa: BLE001 - sent as this rank's flag in the header: every rank raises
        failure = e
    header = torch.zeros(g.size + 2, dtype=torch.float64, device=g.device)
    header[g.me] = float(failure is not None)
    header[g.size], header[g.size + 1] = s.d, s.d * s.d
    if failure is not None:
        pack = torch.zeros_like(pack)
    combined = _wire.all_reduce(g, torch.cat([header, pack]), deadline, _FN)
    header, pack = combined[:g.size + 2].cpu(), combined[g.size + 2:]
    failed = tuple(r for r, f in zip(g.ranks, header[:g.size].tolist()) if f)
    if failed:
        _transaction.abort_if_any(g, [int(r in failed) for r in g.ranks], failure, deadline, f"{_FN}()",
                                  "packing the buffers failed", "no buffer was modified", error=SyncAbortedError)
    total, squares = float(header[g.size]), float(header[g.size + 1])
    if total * total != g.size * squares:
        raise BufferStructureError(f"{_FN}(): the model's buffers (or rules) changed since the last sync on some "
                                   "ranks and not on others; the next sync names the difference. No buffer was "
                                   "modified")
    for kind in s.kinds:
        for flat in kind.flats:
            if kind.rule == "broadcast":
                dist_flat = _wire.wire_view(flat)
                _wire.wait([dist.broadcast(dist_flat, src=g.global_rank(src), group=g.pg, async_op=True)], deadline,
                           _FN)
            else:
                _wire.all_reduce(g, flat, deadline, _FN, op=_REDUCE[kind.rule])
    with torch.no_grad():  # every collective completed: write (no collective below)
        if s.plan.bns:
            bn_average._write(s.plan.bns, pack, s.bn_add)
            s.bn_sub = s.bn_add = torch.tensor([float(bn.count) for bn in s.counted],  # type: ignore[arg-type]
                                               dtype=torch.float64)
        for kind in s.kinds:
            for i, b in enumerate(kind.buckets):
                if kind.rule == "broadcast" and g.me == src:
                    continue
                flat = kind.flats[i]
                if kind.sub is not None and kind.add is not None:
                    flat.add_(kind.add[i])
                    kind.add[i].copy_(flat)
                    kind.sub[i].copy_(flat)
                ts = [kind.tensors[j] for j in b.indices]
                out = flat / g.size if kind.rule == "mean" else flat
                torch_compat.unflatten_into(out.view(torch.bool) if b.dtype == torch.bool else out, ts)
    for module, hook in s.plan.after:
        hook(module)


def keep_in_sync(model_or_engine: Any, *, every: int = 1, rules: rules_mod.Rules | None = None, src: int = 0,
                 group: Any = None, timeout: _args.Timeout = None, strict: bool = False) -> KeepInSync:
    """Keep ``model_or_engine``'s buffers in sync during training, by their rules; returns a :class:`KeepInSync`.

    A DeepSpeed engine syncs after every ``every``-th optimizer step; a module (plain, FSDP2, DDP's inner
    module) before every ``every``-th train-mode forward (module docstring). ``rules`` as in
    :func:`sync_buffers` (default: BatchNorm statistics ``"bn"``, the rest ``"broadcast"`` from ``src``, or the
    rules classes registered); they are resolved and checked now, before any collective. Installing issues no
    collective; the first sync agrees on the structure, every later one costs one collective per reduction kind
    and bucket (plus a small header when no rule is ``"bn"``). ``timeout`` bounds each sync.

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
    g = _group.resolve(group, _FN)
    _group.check_src(g, src, _FN)
    strict = _args.flag(strict, "strict", _FN)
    plan = rules_mod.resolve(module, rules, _FN, strict=strict)
    return KeepInSync(model_or_engine, module, plan, (rules, strict), g, src, every, seconds, engine)
