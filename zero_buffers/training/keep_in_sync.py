"""keep_in_sync: the per-forward buffer sync DDP does, with declared rules, for what has none (DeepSpeed engines,
FSDP2 models, plain modules under a custom loop).

When it syncs: after every ``every``-th optimizer step of a DeepSpeed engine (``engine.step()`` at a gradient
accumulation boundary: between a backward and the next forward, so no autograd graph holds a buffer it writes), or
before every ``every``-th train-mode forward of a module (as DDP does; eval-mode forwards never sync, so an eval on
one rank alone cannot hang). ``handle.sync()`` syncs now.

[Note: steady state]
The structure is agreed once, at the first sync (one small all_gather naming any difference). Every later sync:

1. checks locally that the model still is what the plan was made from (:meth:`_Steady.current`: the very module
   objects under their parents, the very buffer tensors under their modules, over the same memory, no buffer or
   submodule more; C-level passes over kept lists). Tensors or modules replaced by ones of the same structure, on
   every rank or one, are taken up; a different structure is *announced*, not acted on alone (PREPARE);
2. packs every reduced kind (and, on the source, every broadcast bucket) into flat tensors kept between calls, and
   its BatchNorm contribution ([Note: the BatchNorm sums] in bn/average.py) into the check's tensor (PREPARE);
3. one collective per reduction kind and bucket, into those flats (int64 stays int64; 16-bit floats are reduced in
   float64 and rounded once). Every rank issues all of them whatever it found in steps 1-2 (EXCHANGE);
4. all-reduces ``[failed flag per member, changed flag per member]`` together with the BatchNorm sums: the vote.
   Any flag set: every rank raises the same error, having written nothing (a changed structure: the next sync
   agrees again, naming the difference) (RECEIVED);
5. writes: the BatchNorm merge from the reduced sums (small per-channel temporaries) and one fused copy per bucket;
   no collective, no user code (WRITE);
6. only where registered rules have ``after_sync`` hooks: runs them, and one all_gather makes a hook that failed on
   any rank put every rank's buffers back and raise on every rank (AFTER).

The phases are those of [Note: the transaction] (_core/transaction.py), with the vote moved after the data: one
collective fewer than a separate receive vote. The buffers stay ordinary tensors with their own memory (views into
the buckets would save both copies, but Accelerate's ``save_model`` keeps one tensor per shared storage and drops the
rest from the checkpoint).

Repeated syncs count nothing twice: ``"bn"`` as [Note: repeated merges] (bn/average.py) says; ``"sum"`` adds what
each rank added since the last sync, and the value every rank held then enters once, through the source. At the
first sync, history counts once only where every rank held the same value at the start (``start="installed"``,
decided per BatchNorm layer and per ``"sum"`` buffer by comparing digests); where the ranks already differed, every
rank's whole value counts (for ``"bn"``: exactly :func:`average_bn_stats`).

[Note: riders]
Another handle on the same module can have int64 counts summed in this sync instead of a transaction of its own
(``moe/router_bias.py``: the tokens per expert). It is a :class:`Rider`: listed on the module (:data:`RIDERS`), it is
offered every handle made there (and every handle already there is offered it); it joins by :meth:`KeepInSync.attach`
only when it is ticked by the very same events (the same DeepSpeed engine's optimizer steps), over the same ranks.
Its tensors enter the plan as ``"sum"`` entries that no module holds: not buffers, so ``state_dict`` and
``save_pretrained`` never see them, and ``current()`` does not check them. They are always counted from zero: a rider
joining or leaving re-agrees the structure at the next sync (one all_gather, every rank, as any structure change), its
names get no base from the former agreement (``_fresh``) nor from the start (never "shared" history), and
:meth:`rebase` leaves them alone. After every sync that stood on every rank the rider is told (:meth:`Rider.synced`:
its tensors now hold the global cumulative sums), and after every tick whether it synced (:meth:`Rider.ticked`); a
sync that raised tells it nothing, so what it counted carries over. ``remove()`` drops the riders (they go back to
their own transactions).
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from .._compat import deepspeed as ds_compat, torch as torch_compat
from .._core import (
    args as _args,
    digest as _digest,
    group as _group,
    modules as _modules,
    placement as _placement,
    structure as _structure,
    transaction as _transaction,
    wire as _wire,
)
from ..bn import average as bn_average
from ..errors import BufferStructureError, InvalidArgumentError, SyncAbortedError
from . import rules as rules_mod

_FN = "keep_in_sync"
_MARK = "_zero_buffers_keep_in_sync"  # on the module while a handle keeps it in sync
RIDERS = "_zero_buffers_keep_in_sync_riders"  # on the module: the handles that may ride along ([Note: riders])
Start = Literal["installed", "zero"]
"""What the first sync counts of the "sum" buffers and BatchNorm statistics: ``"installed"`` (keep_in_sync): what every
rank held when the handle was made counts once where every rank held the same, else every rank's whole value;
``"zero"`` (a save hook, a trainer callback that began late): every rank's whole value."""


class Rider(Protocol):
    """A handle whose int64 counts may be summed in keep_in_sync's own sync ([Note: riders])."""

    def join(self, kis: KeepInSync) -> None:
        """Offered ``kis``: call ``kis.attach(self)`` if its events and ranks are this rider's."""

    def entries(self) -> list[rules_mod.Assigned]:
        """The ``"sum"`` entries to carry (int64 tensors that no module holds), named as no buffer is."""

    def synced(self) -> None:
        """A sync including the entries stood on every rank: they hold the global cumulative sums."""

    def ticked(self, synced: bool) -> None:
        """One tick of ``kis`` (an optimizer step) passed, with or without a sync."""

    def dropped(self) -> None:
        """``kis`` was removed: the rider is on its own again."""


_CAT_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                         torch.int16, torch.int8, torch.uint8, torch.bool})  # torch.cat(out=) packs these in one op


@dataclass
class _Kind:
    """One reduction kind's tensors, their buckets and the flat tensors kept between syncs."""

    rule: str
    buckets: list[_wire.Bucket]
    flats: list[torch.Tensor]  # per bucket, in wire_dtype
    targets: list[list[torch.Tensor]]  # per bucket: its tensors
    names: list[list[str]]  # per bucket: its tensors' qualified names
    group: _group.Group  # the group it runs over: the call's, or a line of its mesh ([Note: placements])
    root: int  # "broadcast": the source's group rank in ``group``
    views: list[list[torch.Tensor]] = field(default_factory=list)  # per bucket: views of its flat shaped like them
    writes: list[list[torch.Tensor]] = field(default_factory=list)  # per bucket: ``t.data`` of its tensors
    sources: list[list[torch.Tensor] | None] = field(default_factory=list)  # per bucket: ``t.data.view(-1)`` of its
    # tensors when one torch.cat(out=) can pack them (contiguous, a dtype it takes, no conversion), else None
    sub: list[torch.Tensor] | None = None  # "sum": what this rank subtracts before the all-reduce, per bucket

    def __post_init__(self) -> None:
        self.views = [_views(f, t) for f, t in zip(self.flats, self.targets)]
        self.writes = [[t.data for t in part] for part in self.targets]
        self.sources = [[w.view(-1) for w in part]
                        if b.dtype in _CAT_DTYPES and rules_mod.wire_dtype(self.rule, b.dtype) in (b.dtype, torch.uint8)
                        and all(w.is_contiguous() for w in part) else None
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

    def unpack(self, i: int) -> None:
        """Write bucket ``i``'s flat into its tensors (converting back from the wire dtype: one rounding)."""
        torch_compat.copy_all(self.writes[i], self.views[i], self.buckets[i].dtype.is_complex)


def _flat_like(rule: str, b: _wire.Bucket) -> torch.Tensor:
    return torch.zeros(b.numel, dtype=rules_mod.wire_dtype(rule, b.dtype), device=b.device)


def _views(flat: torch.Tensor, ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` (as bools for a bool bucket) shaped like ``ts``."""
    typed = flat.view(torch.bool) if ts[0].dtype == torch.bool else flat
    out, offset = [], 0
    for t in ts:
        out.append(typed[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


@dataclass
class _Carry:
    """What one agreement hands to the next (by name): the base each "sum" buffer subtracts on a rank other than the
    source, and each BatchNorm layer's :class:`bn_average.Repeated` state."""

    sums: dict[str, torch.Tensor]
    bns: dict[str, tuple[torch.Tensor, ...]]


_CHILDREN = operator.attrgetter("_modules")
_BUFFERS = operator.attrgetter("_buffers")


class _Steady:
    """What one structure agreement settled: the plan, its digest, the kinds with their buckets, the check, the
    BatchNorm layout and this rank's side of the repeated merges, and what :meth:`current` compares."""

    def __init__(self, g: _group.Group, plan: rules_mod.Plan, src: int):
        entries = plan.synced()
        placed = _placement.place(g, entries, _FN)  # over a mesh: [Note: placements]
        if placed is not None:
            g = placed.g
        self.plan, self.g, self.src = plan, g, src
        self.entries = placed.entries if placed is not None else entries  # what travels: DTensors' local tensors
        local = {id(t): lt for (_, t), (_, lt) in zip(entries, self.entries)}
        index = {id(t): i for i, (_, t) in enumerate(entries)}
        mine = {id(t) for _, t in entries}
        owners = [(m._buffers, k, t) for m in plan.modules for k, t in m._buffers.items()
                  if t is not None and id(t) in mine]  # where each synced tensor is registered
        self.tables, self.keys = [o[0] for o in owners], [o[1] for o in owners]
        self.tensors = [o[2] for o in owners]
        self.ptrs = list(map(torch.Tensor.data_ptr, self.tensors))
        self.shapes = _shapes(self.tensors)  # sizes, strides, offsets: resize_(), t_(), unsqueeze_() change them
        self.modules = list(plan.modules)
        self.buffer_dicts = list(map(_BUFFERS, self.modules))
        self.child_dicts = list(map(_CHILDREN, self.modules))
        links = [(d, k, c) for d in self.child_dicts for k, c in d.items()]  # every parent -> child, by key
        self.link_dicts, self.link_keys, self.children = [x[0] for x in links], [x[1] for x in links], \
            [x[2] for x in links]
        self.sizes = list(map(len, self.buffer_dicts + self.child_dicts))  # a buffer or a submodule added?
        self.digest = _structure.digest(_call(src, plan), entries)
        self.call = (*_call(src, plan), *(("placements", placed.signature) if placed is not None else ()))
        name_of = {id(a.tensor): a.name for a in plan.assigned}
        self.kinds: list[_Kind] = []
        for rule in ("sum", "mean", "max", "min", "broadcast"):
            ids = [index[id(a.tensor)] for a in plan.of(rule)]
            classes = placed.classes(ids) if placed is not None else [(g, ids)]
            for sub, idx in classes:
                if sub is None:
                    continue  # sharded on every dimension: nothing to sync
                ts = [local[id(entries[i][1])] for i in idx]
                buckets = _wire.plan(ts)
                if buckets:
                    targets = [[ts[j] for j in b.indices] for b in buckets]
                    kind = _Kind(rule, buckets, [_flat_like(rule, b) for b in buckets], targets,
                                 [[entries[idx[j]][0] for j in b.indices] for b in buckets], sub,
                                 _placement.source_in(g, sub, src))
                    if rule == "sum":
                        kind.sub = [torch.zeros_like(f) for f in kind.flats]
                    self.kinds.append(kind)
        del name_of
        self.layout = bn_average.layout(plan.bns, g.device, untracked=True)  # kept: the plan's tensors are checked
        self.repeated: bn_average.Repeated | None = None  # set by begin()
        self.width = 2 * g.size  # the check: [failed flag per member, changed flag per member]
        self.combined = torch.zeros(self.width + self.layout.numel, dtype=torch.float64, device=g.device)
        self.check = torch.zeros(self.width, dtype=torch.float64)  # the check, on the host
        self.extras: list[int] = []  # every member's extra value in the agreement (the first sync: its start digest)

    @property
    def source(self) -> bool:
        return self.g.me == self.src

    def begin(self, carry: _Carry, shared: dict[str, bool] | None = None,
              at_start: dict[str, torch.Tensor] | None = None) -> None:
        """Set the bases: from ``carry`` (a former agreement), or at the first sync from what every rank held when the
        handle was made (``at_start``, by name), counted once where ``shared`` (by "sum" buffer and BatchNorm layer
        name) says every rank held the same."""
        shared = shared or {}
        for kind in self.kinds:
            if kind.sub is None:
                continue
            for sub, part, names in zip(kind.sub, kind.targets, kind.names):
                if kind.group.me == kind.root:
                    continue  # the source contributes its whole value: the shared part enters once, through it
                base = [carry.sums[n] if n in carry.sums else
                        at_start[n] if at_start is not None and shared.get(n) and n in at_start else torch.zeros_like(t)
                        for n, t in zip(names, part)]
                torch_compat.copy_all(_views(sub, part), base)
        lay = self.layout
        if not lay.bns:
            self.repeated = None
            return
        device = self.g.device
        flags = torch.tensor([bool(shared.get(bn.name)) for bn in lay.bns], dtype=torch.bool, device=device)
        start = None
        if at_start is not None:
            start = _layer_stats(lay, at_start, device)
        self.repeated = bn_average.Repeated.start(lay, device, self.source, flags, start)  # [Note: repeated merges]
        self.repeated.carry(carry.bns)

    def carry(self) -> _Carry:
        """The bases the last sync left, by name, for the next agreement (see :class:`_Carry`)."""
        sums: dict[str, torch.Tensor] = {}
        for kind in self.kinds:
            if kind.sub is not None and kind.group.me != kind.root:
                for sub, part, names in zip(kind.sub, kind.targets, kind.names):
                    sums.update({n: v.clone() for n, v in zip(names, _views(sub, part))})
        return _Carry(sums, self.repeated.by_layer() if self.repeated is not None else {})

    def current(self) -> bool:
        """Whether the model still is what the plan was made from ([Note: steady state], step 1): every module under
        its parent by the same key, the same buffer and submodule tables, every synced tensor where it was over the
        same memory (``buf.data = ...`` swaps it under the same tensor) with the same sizes and strides (``resize_``,
        ``t_`` and ``unsqueeze_`` change them in place), no buffer or submodule more."""
        return all(map(operator.is_, map(dict.get, self.link_dicts, self.link_keys), self.children)) and \
            all(map(operator.is_, map(_BUFFERS, self.modules), self.buffer_dicts)) and \
            all(map(operator.is_, map(_CHILDREN, self.modules), self.child_dicts)) and \
            all(map(operator.is_, map(dict.get, self.tables, self.keys), self.tensors)) and \
            list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs and \
            _shapes(self.tensors) == self.shapes and \
            list(map(len, self.buffer_dicts + self.child_dicts)) == self.sizes


def _local(t: torch.Tensor) -> torch.Tensor:
    return torch_compat.local_tensor(t) if torch_compat.is_dtensor(t) else t


def _partials_left(plan: rules_mod.Plan) -> rules_mod.Plan:
    """keep_in_sync leaves a Partial DTensor alone by default ([Note: placements]): its local values are this rank's
    summands, which a forward keeps adding to; ``sync_buffers`` reduces them when the value is needed (before the
    optimizer step)."""
    def partial(a: rules_mod.Assigned) -> bool:
        return a.source == "default" and torch_compat.is_dtensor(a.tensor) and \
            any(k == "P" for k, _ in torch_compat.placements(a.tensor))
    if not any(partial(a) for a in plan.assigned):
        return plan
    plan.assigned = [dataclasses.replace(a, rule="local", source="default (Partial: left to sync_buffers)")
                     if partial(a) else a for a in plan.assigned]
    return plan


def _shapes(tensors: list[torch.Tensor]) -> tuple[list[Any], list[Any], list[Any]]:
    """Every tensor's size, strides and storage offset (three C-level passes)."""
    return (list(map(torch.Tensor.size, tensors)), list(map(torch.Tensor.stride, tensors)),
            list(map(torch.Tensor.storage_offset, tensors)))


def _layer_stats(lay: bn_average.Layout, values: dict[str, torch.Tensor], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counter per layer, mean, var per channel) in float64 from ``values`` by qualified name, as Layout.read gives
    them (zeros for a layer ``values`` does not hold)."""
    n, means, vars_ = [], [], []
    for bn, channels in zip(lay.bns, lay.channels):
        got = [values.get(k) for k, _ in bn.entries()]
        if any(v is None for v in got):
            n.append(0.0)
            means.append(torch.zeros(channels, dtype=torch.float64, device=device))
            vars_.append(torch.zeros(channels, dtype=torch.float64, device=device))
            continue
        n.append(float(got[2]) if len(got) == 3 else 1.0)  # type: ignore[arg-type]
        means.append(got[0].reshape(-1).to(device, torch.float64))  # type: ignore[union-attr]
        vars_.append(got[1].reshape(-1).to(device, torch.float64))  # type: ignore[union-attr]
    return torch.tensor(n, dtype=torch.float64, device=device), torch.cat(means), torch.cat(vars_)


class KeepInSync:
    """Handle returned by :func:`keep_in_sync`: ``sync()`` syncs now (every rank), ``remove()`` stops it (also a
    context manager); ``syncs`` counts the syncs done."""

    def __init__(self, target: Any, module: nn.Module, plan: rules_mod.Plan, declared: tuple[Any, bool, str],
                 g: _group.Group | None, src: int, every: int, seconds: float | None, engine: bool,
                 start: Start = "installed", identical_warning: str | None = None):
        self.target, self.module, self.plan, self.g, self.src = target, module, plan, g, src
        self._declared = declared  # (rules, strict, BatchNorm default) as passed: every re-resolve uses them
        self.every, self.seconds = every, seconds
        self.syncs = 0
        self._ticks = 0
        self._steady: _Steady | None = None
        self._last: _Steady | None = None  # the last agreement that synced: its bases carry over to the next one
        self._start = start
        self._identical_warning = identical_warning  # start="zero": warn (this name) if every rank holds the same BN
        # what every rank holds now, by name: the "sum" buffers and BatchNorm statistics (start="installed" compares
        # them across ranks at the first sync)
        stats = {id(t) for bn in plan.bns for _, t in bn.entries()}
        self._at_start = {a.name: _local(a.tensor).detach().clone() for a in plan.assigned  # (a meta tensor: nothing to
                          if start == "installed" and not a.tensor.is_meta  # share: it counts as not shared)
                          and (a.rule == "sum" or id(a.tensor) in stats)}
        self.engine = engine
        self._riders: list[Rider] = []  # [Note: riders]
        self._fresh: set[str] = set()  # riders' names that take no base from a former agreement
        self._riding: set[str] = set()  # the names of the riders' entries in ``plan``
        self._undo: Callable[[], None]
        if engine:
            self._undo = ds_compat.after_optimizer_steps(target, self._tick)
        else:
            handle = module.register_forward_pre_hook(lambda m, args: self._tick() if m.training else None)
            self._undo = handle.remove
        module.__dict__[_MARK] = self  # a second handle would keep bases of its own: "sum" and "bn" would compound
        self._installed = True
        for rider in list(module.__dict__.get(RIDERS, ())):
            rider.join(self)

    def attach(self, rider: Rider) -> None:
        """Carry ``rider``'s entries from the next sync on ([Note: riders]); local, no collective."""
        if rider in self._riders:
            return
        self._riders.append(rider)
        self._changed_riders(rider)

    def detach(self, rider: Rider) -> None:
        """Stop carrying ``rider``'s entries (the next sync agrees again); local, no collective."""
        if rider in self._riders:
            self._riders.remove(rider)
            self._changed_riders(rider)

    def _changed_riders(self, rider: Rider) -> None:
        self._fresh.update(a.name for a in rider.entries())
        self.plan = self._with_riders(self.plan)
        self._steady = None  # the next sync agrees again: every rank attached alike, or the agreement names it

    def _with_riders(self, plan: rules_mod.Plan) -> rules_mod.Plan:
        """``plan`` with the entries of the riders attached now in place of those it carried."""
        ours = [a for r in self._riders for a in r.entries()]
        plan = dataclasses.replace(plan, assigned=[a for a in plan.assigned if a.name not in self._riding] + ours)
        self._riding = {a.name for a in ours}
        return plan

    def _resolve(self) -> rules_mod.Plan:
        rules, strict, bn_default = self._declared
        self._riding = set()  # the resolved plan carries none: _with_riders adds those attached now
        return self._with_riders(_partials_left(rules_mod.resolve(self.module, rules, _FN, strict=strict,
                                                                  bn_default=bn_default, group=self.g)))

    def _tick(self) -> None:
        self._ticks += 1
        due = self._ticks % self.every == 0
        if due:
            self.sync()
        for rider in list(self._riders):  # [Note: riders]
            rider.ticked(due)

    def sync(self) -> None:
        """Sync every buffer by its rule now; every rank of the group must call (a no-op without one)."""
        if self.g is None:
            return
        g, deadline = self.g, _wire.Deadline(self.seconds)
        steady = self._steady
        failure: BaseException | None = None
        agreed_now = steady is None
        if steady is None:  # an agreement (the first sync, or after a change every rank saw): named differences
            steady = self._agree(g, deadline)
            try:
                self._begin(steady, g, deadline)
            except BaseException as e:  # noqa: BLE001 - voted in the check below: every rank raises
                failure = e
            self._steady = steady
            self.plan = steady.plan
        announce, cause = steady.digest, None
        if failure is None and not steady.current():  # replaced here: the same structure carries on with them
            try:
                plan = self._resolve()
                announce = _structure.digest(_call(self.src, plan), plan.synced())
                if announce == steady.digest:  # else a new structure: this sync still runs the agreed collectives,
                    again = _Steady(g, plan, self.src)  # and every rank raises after the check, writing nothing
                    again.begin(steady.carry())
                    self._steady = steady = again
            except Exception as e:  # noqa: BLE001 - announced as a change: every rank raises
                announce, cause = steady.digest ^ 1, e
        try:
            _sync(steady, deadline, announce, failure)  # [Note: steady state], steps 2-6
        except _Changed as e:
            self._steady = None  # every rank raised: the next sync agrees again, naming the difference
            if cause is not None:
                raise e from cause
            raise
        except SyncAbortedError:
            if agreed_now:  # every rank aborted this agreement's first sync: the next one agrees again
                self._steady = None
            raise
        self._last = steady
        self.syncs += 1
        self._fresh -= self._riding
        for rider in list(self._riders):  # the sync stood on every rank ([Note: riders])
            rider.synced()

    def _agree(self, g: _group.Group, deadline: _wire.Deadline) -> _Steady:
        """Resolve the rules and agree on the structure (one all_gather; differences named on every rank); a rank
        whose model no longer takes its rules joins the agreement with its error, so every rank raises."""
        try:
            plan = self._resolve()
            steady = _Steady(g, plan, self.src)
        except Exception as e:  # noqa: BLE001 - this rank's model no longer takes its rules: every rank learns it here
            _structure.refuse(g, e, deadline, _FN)
        first = self._last is None
        extra = _start_digest(steady, self._at_start if self._start == "installed" else None) if first else 0
        votes = _structure.agree(g, steady.call, steady.entries, deadline, _FN, extra=extra)
        problem = _transaction.unsendable(g, steady.entries, _FN)
        if problem is not None:
            raise problem
        steady.extras = [e for _, e in votes]
        return steady

    def _begin(self, steady: _Steady, g: _group.Group, deadline: _wire.Deadline) -> None:
        """The bases of a new agreement: carried over from the last one, or at the first sync decided from what the
        ranks held at the start. Whether that costs a collective (one small all-reduce, when the ranks' start digests
        differ) is decided from the agreement's values alone, the same on every rank."""
        if self._last is not None:
            carry = self._last.carry()
            carry.sums = {n: v for n, v in carry.sums.items() if n not in self._fresh}  # [Note: riders]
            steady.begin(carry)
            return
        extras = steady.extras
        if self._start == "zero":
            steady.begin(_Carry({}, {}))
            if self._identical_warning and len(set(extras)) == 1 and extras[0] not in (0, 1) and _counted(steady):
                bn_average.warn_identical(self._identical_warning, g)
            return
        names = _start_names(steady)
        if len(set(extras)) == 1:  # every rank held the same at the start: all of it is shared
            shared = dict.fromkeys(names, True)
        else:
            local: BaseException | None = None
            try:
                digests = _start_digests(steady, self._at_start)
            except BaseException as e:  # noqa: BLE001 - still meets the others in the all-reduce, then raises
                digests, local = [g.rank + 1] * len(names), e
            shared = _shared(g, names, digests, deadline)
            if local is not None:
                raise local
        steady.begin(_Carry({}, {}), shared, self._at_start)

    def rebase(self) -> None:
        """Take what this rank holds now as the history every rank shares: call it on every rank right after you reset
        or load buffers the rules reduce (a ``"sum"`` counter zeroed after logging, statistics loaded from a
        checkpoint); the next sync counts only what the ranks add from here. Without it a ``"sum"`` counter zeroed on
        every rank counts as every rank having added minus the last total. Local: it issues no collective, so a rank
        that forgets it gets wrong sums, never a hang."""
        stats = {id(t) for bn in self.plan.bns for _, t in bn.entries()}
        steady = self._steady if self._steady is not None else self._last  # awaiting a new agreement (a rider
        # joined or left, the structure changed): the bases it will carry over are set here
        if steady is None:  # before the first sync: the first sync compares this across ranks
            self._at_start = {a.name: _local(a.tensor).detach().clone() for a in self.plan.assigned
                              if not a.tensor.is_meta and (a.rule == "sum" or id(a.tensor) in stats)
                              and a.name not in self._riding}  # riders are never shared history
            self._start = "installed"
            return
        for kind in steady.kinds:
            if kind.sub is not None and kind.group.me != kind.root:
                for sub, part, writes, names in zip(kind.sub, kind.targets, kind.writes, kind.names):
                    kept = [(v, w) for v, w, n in zip(_views(sub, part), writes, names) if n not in self._riding]
                    torch_compat.copy_all([v for v, _ in kept], [w for _, w in kept])  # riders: [Note: riders]
        lay = steady.layout
        if lay.bns:
            device = self.g.device if self.g is not None else torch.device("cpu")
            now = lay.read(device)
            shared = torch.ones(lay.layers, dtype=torch.bool, device=device)
            steady.repeated = bn_average.Repeated.start(lay, device, steady.source, shared, now)

    def remove(self) -> None:
        """Stop syncing (idempotent)."""
        if self._installed:
            self._undo()
            if self.module.__dict__.get(_MARK) is self:
                del self.module.__dict__[_MARK]
            self._installed = False
            riders, self._riders = self._riders, []
            if riders:
                self.plan = self._with_riders(self.plan)
                self._steady = None
            for rider in riders:  # on their own again ([Note: riders])
                rider.dropped()

    def __enter__(self) -> KeepInSync:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _start_names(s: _Steady) -> list[str]:
    """The names whose start is compared: every "sum" buffer, then every BatchNorm layer, in plan order."""
    return [n for kind in s.kinds if kind.sub is not None for part in kind.names for n in part] + \
        [bn.name for bn in s.layout.bns]


def _start_digests(s: _Steady, at_start: dict[str, torch.Tensor]) -> list[int]:
    """Per name of :func:`_start_names`, the digest of what this rank held at the start (0 for what it did not have
    then: added since, it is never shared)."""
    def one(names: list[str]) -> int:
        if not all(n in at_start for n in names):
            return 0
        return _digest.combined([at_start[n] for n in names]) or 1
    out = [one([n]) for kind in s.kinds if kind.sub is not None for part in kind.names for n in part]
    return out + [one([k for k, _ in bn.entries()]) for bn in s.layout.bns]


def _counted(s: _Steady) -> bool:
    """Whether some BatchNorm layer of the plan has counted a batch here."""
    lay = s.layout
    return bool(lay.bns) and bool((lay.read(s.g.device)[0] * lay.has_count).sum() > 0)


def _start_digest(s: _Steady, at_start: dict[str, torch.Tensor] | None) -> int:
    """One digest of the start (``at_start``, or with None the BatchNorm statistics now) for the first agreement:
    equal on every rank exactly when every rank held the same; 0 with nothing to compare, 1 when unreadable."""
    try:
        if at_start is None:
            return bn_average.stats_digest(s.g, [e for bn in s.layout.bns for e in bn.entries()], _FN)
        if not at_start:
            return 0
        return _structure.digest_bytes(repr(_start_digests(s, at_start)).encode()) or 1
    except (RuntimeError, KeyError, TypeError, ValueError):
        return 1


def _shared(g: _group.Group, names: list[str], digests: list[int], deadline: _wire.Deadline) -> dict[str, bool]:
    """By name, whether every rank's digest is the same: one all-reduce (MAX) of [d, ~d] (~max(~d) is min(d))."""
    if not names:
        return {}
    mine = torch.tensor(digests + [~d for d in digests], dtype=torch.int64, device=g.device)
    _wire.all_reduce(g, mine, deadline, _FN, op=dist.ReduceOp.MAX)
    top = mine.tolist()
    k = len(digests)
    return {n: top[i] == ~top[k + i] and top[i] != 0 for i, n in enumerate(names)}


def _call(src: int, plan: rules_mod.Plan) -> tuple:
    """What every rank's call must agree on besides the buffers: the source and each buffer's rule."""
    return (_FN, src, plan.signature)


class _Changed(BufferStructureError):
    """The structure changed on some ranks (``ranks``, global): every rank raised it, and every rank agrees again at
    the next sync, naming the difference."""

    def __init__(self, ranks: tuple[int, ...]):
        where = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        super().__init__(f"{_FN}(): the model's buffers, submodules or rules changed since the last sync on {where}; "
                         "the next sync names the difference. No buffer was modified")
        self.ranks = ranks


def _sync(s: _Steady, deadline: _wire.Deadline, announce: int, failure: BaseException | None = None) -> None:
    """One steady-state sync ([Note: steady state], steps 2-5). ``announce``: the structure digest this rank has now
    (when it is not the agreed one, every rank raises after the check, having written nothing); ``failure``: this rank
    already knows it cannot take part (it votes so, and every rank raises)."""
    g = s.g
    width, combined, check = s.width, s.combined, s.check
    check.zero_()
    check[g.size + g.me] = float(announce != s.digest)
    bns = s.plan.bns
    if failure is None:
        try:  # in place into space kept since the agreement: nothing here allocates what the failure path needs
            _transaction.reached(_transaction.Phase.PREPARE, _FN)
            # this rank's side of [Note: the BatchNorm sums], behind the check's flags
            bn_average._pack(bns, g.device, lay=s.layout, out=combined[width:], repeated=s.repeated)
            for kind in s.kinds:
                if kind.rule != "broadcast" or kind.group.me == kind.root:  # receivers take the broadcast buckets
                    for i in range(len(kind.flats)):
                        kind.pack(i)
        except BaseException as e:  # noqa: BLE001 - this rank's flag in the check: every rank raises
            failure = e
    works = []  # every rank issues every collective, whatever it found: the check comes last and decides
    for kind in s.kinds:
        for flat in kind.flats:
            if kind.rule == "broadcast":
                works.append(dist.broadcast(_wire.wire_view(flat), src=kind.group.global_rank(kind.root),
                                            group=kind.group.pg, async_op=True))
            else:
                works.append(dist.all_reduce(_wire.wire_view(flat), op=rules_mod.REDUCE_OPS[kind.rule],
                                             group=kind.group.pg, async_op=True))
    if failure is None:
        try:
            _transaction.reached(_transaction.Phase.EXCHANGE, _FN)
        except BaseException as e:  # noqa: BLE001 - as above
            failure = e
    if failure is not None:
        check[g.me] = 1.0
        combined[width:].zero_()
    combined[:width].copy_(check)
    # the check, with the BatchNorm sums: the vote, issued behind the data (it carries nothing the data changes), so
    # its latency overlaps theirs
    works.append(dist.all_reduce(_wire.wire_view(combined), group=g.pg, async_op=True))
    _wire.wait(works, deadline, _FN)
    check.copy_(combined[:width])
    values = check.tolist()
    if any(values[:g.size]):
        _transaction.abort_if_any(g, [int(f) for f in values[:g.size]], failure, deadline, f"{_FN}()",
                                  "packing or exchanging the buffers failed", "no buffer was modified",
                                  error=SyncAbortedError)
    changed = tuple(r for r, v in zip(g.ranks, values[g.size:]) if v)
    if changed:  # every rank sees it, and none has written anything
        raise _Changed(changed)
    hooks = s.plan.hooks()
    restore = _transaction.snapshot([t for _, t in s.plan.synced()] + s.plan.hooked()) if hooks else None
    with torch.no_grad():  # every rank voted: write (no collective below, no user code)
        merged = bn_average.merge(bns, combined[width:], lay=s.layout) if bns else None
        if merged is not None:
            bn_average.apply(merged)
        for kind in s.kinds:
            if kind.rule == "broadcast" and kind.group.me == kind.root:
                continue
            for i, flat in enumerate(kind.flats):
                if kind.rule == "mean":
                    flat.div_(kind.group.size)  # scratch: packed again at the next sync
                kind.unpack(i)
    if restore is not None:  # only where a hook can fail after the writes
        _transaction.run_after(g, hooks, deadline, f"{_FN}()", restore)
    if merged is not None:  # the sync stands on every rank: its bases are taken up for the next one
        assert s.repeated is not None
        s.repeated.commit(merged)
    for kind in s.kinds:
        if kind.sub is not None and kind.group.me != kind.root:
            for i, sub in enumerate(kind.sub):  # what every rank holds now, as written (a 16-bit sum was rounded
                torch_compat.copy_all(_views(sub, kind.targets[i]), kind.writes[i])  # into its dtype): subtracted
                # at the next sync, so a rounding is never counted as something a rank added


def hookless(model: Any, policy: str | None, start: Start, **options: Any) -> KeepInSync:
    """A :class:`KeepInSync` whose caller decides when it syncs (a save hook, a trainer callback): no hook, the same
    arithmetic; ``policy`` ``"broadcast"`` broadcasts BatchNorm statistics too. ``options``: keep_in_sync's, and
    ``identical_warning``: with ``start="zero"``, the name to warn under when every rank already holds the same
    BatchNorm statistics at the first sync (average_bn_stats' warning)."""
    warning = options.pop("identical_warning", None)
    handle = keep_in_sync(model, _bn_default="broadcast" if policy == "broadcast" else "bn", _start=start,
                          _identical_warning=warning if policy != "broadcast" else None, **options)
    handle.remove()
    return handle


def keep_in_sync(model_or_engine: Any, *, every: int = 1, rules: rules_mod.Rules | None = None, src: int = 0,
                 group: Any = None, timeout: _args.Timeout = None, strict: bool = False,
                 _bn_default: str = "bn", _start: Start = "installed", _identical_warning: str | None = None
                 ) -> KeepInSync:
    """Keep ``model_or_engine``'s buffers in sync during training, by their rules; returns a :class:`KeepInSync`.

    A DeepSpeed engine syncs after every ``every``-th optimizer step; a module (plain, FSDP2, DDP's inner
    module) before every ``every``-th train-mode forward (module docstring). ``rules`` as in
    :func:`sync_buffers` (default: BatchNorm statistics ``"bn"``, the rest ``"broadcast"`` from ``src``, or the
    rules classes registered); they are resolved and checked now, before any collective. Installing issues no
    collective; the first sync agrees on the structure (and compares what the ranks hold now, to count shared history
    once), every later one costs one small float64 all-reduce (the check, with the BatchNorm sums) plus one collective
    per reduction kind and bucket. ``timeout`` bounds each sync. One handle per module at a time.

    Example::

        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        with zero_buffers.keep_in_sync(engine, rules={"*.cluster_size": "mean"}):
            for batch in loader:
                engine.backward(engine(batch)); engine.step()   # buffers equal on every rank after each step
    """
    every = _args.every(every, _FN)
    src = _args.rank(src, "src", _FN)
    seconds = _args.timeout(timeout, _FN)
    engine = ds_compat.is_engine(model_or_engine)
    if engine:
        module = ds_compat.engine_module(model_or_engine)  # a second handle: refused by the module's mark below
    else:
        module = _modules.unwrap(_args.module(model_or_engine, _FN), _FN)
    if module.__dict__.get(_MARK) is not None:
        raise InvalidArgumentError(f"{_FN}(): this module is already kept in sync by another handle; remove() it "
                                   "first (two handles would each count what the ranks added, twice)")
    g = _group.resolve(group, _FN)
    _group.check_src(g, src, _FN)
    strict = _args.flag(strict, "strict", _FN)
    plan = _partials_left(rules_mod.resolve(module, rules, _FN, strict=strict, bn_default=_bn_default,
                                            group=group if g is None else g))
    return KeepInSync(model_or_engine, module, plan, (rules, strict, _bn_default), g, src, every, seconds, engine,
                      _start, _identical_warning)
