"""buffer_report / assert_buffers_in_sync: which buffers differ across ranks, by how much, and where."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._compat import torch as torch_compat
from ._core import (
    args as _args,
    compare as _compare,
    digest as _digest,
    group as _group,
    modules as _modules,
    structure as _structure,
    transaction as _transaction,
    wire as _wire,
)
from .errors import BuffersOutOfSyncError, CollectiveError

SHORT_ROWS = 30  # a report of at most this many buffers (or differing buffers) lists them all, in model order
WORST_ROWS = 20  # past that, a short report lists the worst this many differing buffers ...
MODULE_LINES = 12  # ... and sums up the other differing ones by module in at most this many lines
SLICE_BYTES = 4 * 2 ** 20  # a differing buffer's reference travels in slices of at most this many bytes


@dataclass(frozen=True)
class BufferRow:
    """One buffer's cross-rank verdict. ``differing_ranks`` are global ranks whose value differs from the reference;
    ``max_rel_diff`` is ``max_abs_diff`` over the largest magnitude in the reference; ``untrained_ranks`` are
    the ranks where this BatchNorm statistic is still at its initial value (mean 0, var 1, count 0)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    persistent: bool
    in_sync: bool
    max_abs_diff: float
    differing_ranks: tuple[int, ...]
    max_rel_diff: float = 0.0
    untrained_ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class BufferReport:
    """Rows for every buffer, identical on every rank. ``reference_rank`` (global) is the rank others are compared
    with; ``training`` is the module's train/eval mode on the reference rank."""

    rows: tuple[BufferRow, ...]
    ranks: tuple[int, ...]
    reference_rank: int
    atol: float
    checked: bool = field(default=True)
    training: bool = True

    @property
    def in_sync(self) -> bool:
        return all(r.in_sync for r in self.rows)

    @property
    def out_of_sync(self) -> list[BufferRow]:
        return [r for r in self.rows if not r.in_sync]

    def __str__(self) -> str:
        return self.format()

    def format(self, only_out_of_sync: bool = False, limit: int | None = None, head: str | None = None,
               full: bool = False) -> str:
        """A plain-text table under ``head`` (default: how many buffers differ, across which ranks, and which ranks
        differ); columns fit the longest name. Under 40 lines whatever the model, unless ``full=True``:

        - up to :data:`SHORT_ROWS` buffers (or differing buffers), every one of them, in model order; in-sync rows
          of a larger model are counted, not listed;
        - more differing buffers than that: the :data:`WORST_ROWS` worst (by relative difference, then absolute),
          worst first, then the others summed up by module (its path, how many of its buffers differ, the worst
          difference among them, the ranks), at most :data:`MODULE_LINES` modules, the worst first;
        - a last line counting what is not listed, and naming ``format(full=True)``, which lists every row.

        ``only_out_of_sync``: the differing rows only. ``limit``: at most that many rows, the worst ones, the rest
        summed up by module."""
        pick = _select(self, only_out_of_sync, limit, full)
        return _render(self, pick, head)

@dataclass(frozen=True)
class _Module:
    """A module path ('' for the model's own buffers) holding differing buffers that are not listed: how many of its
    buffers differ (of how many), how many of those are not listed, the worst difference among them all."""

    path: str
    differing: int
    buffers: int
    not_listed: int
    max_abs_diff: float
    max_rel_diff: float
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class _Selection:
    """What a report's text shows, decided from its rows before anything is formatted: the rows listed (in the
    order shown), the differing rows not listed summed up by module (``modules``, then ``more_modules`` modules
    holding ``more_buffers`` differing buffers past :data:`MODULE_LINES`), and the counts of what is not listed."""

    rows: tuple[BufferRow, ...]
    worst_first: bool
    modules: tuple[_Module, ...]
    more_modules: int
    more_buffers: int
    differing_hidden: int
    in_sync_hidden: int  # 0 when only_out_of_sync left them out by request


def _severity(row: BufferRow) -> tuple[bool, float, float]:
    """Sort key, worst first: differing before in sync, then the relative difference, then the absolute (NaN as
    the worst)."""
    def worse(x: float) -> float:
        return -math.inf if math.isnan(x) else -x
    return (row.in_sync, worse(row.max_rel_diff), worse(row.max_abs_diff))


def _select(report: BufferReport, only_out_of_sync: bool, limit: int | None, full: bool) -> _Selection:
    """The rows to list and the summary of the rest (see :meth:`BufferReport.format`)."""
    rows = list(report.rows)
    differing = [i for i, r in enumerate(rows) if not r.in_sync]
    candidates = differing if only_out_of_sync else list(range(len(rows)))

    def worst(ids: list[int]) -> list[int]:
        return sorted(ids, key=lambda i: _severity(rows[i]))  # stable: ties in model order

    if full or len(candidates) <= SHORT_ROWS:
        listed = candidates
    elif len(differing) <= SHORT_ROWS:
        listed = differing
    else:
        listed = worst(differing)[:WORST_ROWS]
    if limit is not None and len(listed) > max(limit, 0):
        listed = worst(listed)[:max(limit, 0)]
    shown = set(listed)
    hidden = [rows[i] for i in differing if i not in shown]
    listed = worst(listed) if hidden else sorted(listed)
    modules, more_modules, more_buffers = _by_module(hidden, rows)
    in_sync_hidden = 0 if only_out_of_sync else sum(1 for i, r in enumerate(rows) if r.in_sync and i not in shown)
    return _Selection(tuple(rows[i] for i in listed), bool(hidden), modules, more_modules, more_buffers, len(hidden),
                      in_sync_hidden)


def _module_path(name: str) -> list[str]:
    return name.split(".")[:-1]


def _by_module(hidden: list[BufferRow], rows: list[BufferRow]) -> tuple[tuple[_Module, ...], int, int]:
    """The modules holding the hidden differing rows, at the deepest level of their paths that fits
    :data:`MODULE_LINES` lines (one level deeper, cut, when that level would put them all under one module), the
    worst first; then how many modules, and hidden differing rows, did not fit."""
    if not hidden:
        return (), 0, 0
    paths = [_module_path(r.name) for r in hidden]
    deepest = max(len(p) for p in paths)

    def keys(depth: int) -> list[str]:
        return [".".join(p[:depth]) for p in paths]

    depth = deepest
    while depth > 1 and len(set(keys(depth))) > MODULE_LINES:
        depth -= 1
    if len(set(keys(depth))) == 1 and depth < deepest:
        depth += 1
    groups: dict[str, list[BufferRow]] = {}
    for key, r in zip(keys(depth), hidden):
        groups.setdefault(key, []).append(r)

    def members(key: str) -> list[BufferRow]:
        if not key:
            return [r for r in rows if "." not in r.name]
        return [r for r in rows if r.name.startswith(key + ".")]

    summary = []
    for key, group in groups.items():
        inside = members(key)
        bad = [r for r in inside if not r.in_sync]
        worst = min(bad, key=_severity)
        ranks = tuple(sorted({k for r in bad for k in r.differing_ranks}))
        summary.append((_severity(worst), _Module(key, len(bad), len(inside), len(group),
                                                   max(r.max_abs_diff for r in bad), worst.max_rel_diff, ranks)))
    summary.sort(key=lambda kv: kv[0])
    fits = MODULE_LINES if len(summary) <= MODULE_LINES else MODULE_LINES - 1
    shown = tuple(m for _, m in summary[:fits])
    rest = [m for _, m in summary[fits:]]
    return shown, len(rest), sum(m.not_listed for m in rest)


def _ranks(ranks: Sequence[int]) -> str:
    """``1, 2, 3``; runs of four or more as ``4-63`` once the plain list would be long."""
    plain = ", ".join(map(str, ranks))
    if len(plain) <= 24:
        return plain
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out += [f"{ranks[i]}-{ranks[j]}"] if j - i >= 3 else [str(r) for r in ranks[i:j + 1]]
        i = j + 1
    return ", ".join(out)


def _group_text(ranks: Sequence[int]) -> str:
    return str(list(ranks)) if len(ranks) <= 16 else f"[{_ranks(ranks)}]"


def _table(titles: Sequence[str], cells: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max([len(t)] + [len(c[i]) for c in cells]) for i, t in enumerate(titles)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if i in right else v.ljust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    return [line(titles), *(line(c) for c in cells)]


def _render(report: BufferReport, pick: _Selection, head: str | None) -> str:
    """The text of a selection."""
    bad = report.out_of_sync
    if not report.checked:
        default = f"{len(report.rows)} buffers, not compared: no process group with more than one rank"
    else:
        default = (f"{len(bad)} of {len(report.rows)} buffers differ across ranks {_group_text(report.ranks)} "
                   f"(reference rank {report.reference_rank}, atol={report.atol:g})")
        if bad:
            default += f"; differing ranks: {_ranks(sorted({k for r in bad for k in r.differing_ranks}))}"
    cells = [(r.name, r.dtype, str(list(r.shape)), "yes" if r.in_sync else "NO", f"{r.max_abs_diff:.4g}",
              f"{r.max_rel_diff:.3g}", _ranks(r.differing_ranks) or "-") for r in pick.rows]
    lines = [default if head is None else head,
             *_table(("buffer", "dtype", "shape", "in sync", "max |diff|", "rel", "differing ranks"), cells, {4, 5})]
    if pick.modules:
        mods = [(m.path or "(top level)", f"{m.differing} of {m.buffers}", str(m.not_listed), f"{m.max_abs_diff:.4g}",
                 f"{m.max_rel_diff:.3g}", _ranks(m.ranks) or "-") for m in pick.modules]
        lines += _table(("module", "differing", "not listed", "max |diff|", "rel", "differing ranks"), mods, {2, 3, 4})
        if pick.more_modules:
            lines.append(f"... and {pick.more_modules} more modules, {pick.more_buffers} differing buffers not listed")
    listed_bad = sum(1 for r in pick.rows if not r.in_sync)
    if pick.differing_hidden:
        tail = f"(the {listed_bad} worst of {len(bad)} differing buffers listed, {pick.differing_hidden} more by module"
        tail += f", {pick.in_sync_hidden} in sync not shown" if pick.in_sync_hidden else ""
        lines.append(tail + "; format(full=True) shows every row)")
    elif pick.in_sync_hidden:
        lines.append(f"({pick.in_sync_hidden} buffers in sync not shown; format(full=True) shows every row)")
    return "\n".join(lines)


def buffer_report(module: nn.Module, *, group: Any = None, atol: float = 0.0, ignore: Iterable[str] = (),
                  include_parameters: bool = False, timeout: _args.Timeout = None) -> BufferReport:
    """Compare every buffer of ``module`` across the ranks of ``group``; return the same report on every rank.

    With ``atol == 0`` a buffer is in sync when it is bitwise identical on every rank; with ``atol > 0``
    when every rank is within ``atol`` of the reference rank (the group's first; NaN equals NaN).
    When everything agrees this costs one all_gather of three int64 (structure and content digests).
    Otherwise one all_gather of a 64-bit digest per buffer finds the differing ones; the reference
    rank broadcasts only those, one bucket at a time (so the extra memory is one bucket, not the
    world size times the buffers), every rank compares its own copy, and one all_gather of a few floats
    per differing buffer gives ``max_abs_diff`` and ``differing_ranks``. Without a process group (or
    with world 1) every row is in sync and ``checked`` is False. ``timeout`` (seconds or a timedelta)
    bounds the whole call; past it, or when a peer dies, :class:`CollectiveError` is raised.

    Example::

        report = zero_buffers.buffer_report(model)
        if not report.in_sync:
            print(report.format(only_out_of_sync=True))
    """
    return _report("buffer_report", module, group, atol, ignore, include_parameters, timeout)


_IN_SYNC: dict[Any, BufferReport] = {}  # (structure, non-persistent names, ranks) -> the all-agree report (immutable)


def _report(fn: str, module: nn.Module, group: Any, atol: float, ignore: Iterable[str], include_parameters: bool,
            timeout: _args.Timeout) -> BufferReport:
    """buffer_report's body; ``fn`` names the public function in errors."""
    _args.module(module, fn)
    atol = _args.atol(atol, fn)
    skip = _args.ignore(ignore, fn)
    deadline = _wire.Deadline(_args.timeout(timeout, fn))
    g = _group.resolve(group, fn)
    entries = _modules.named_buffers(module, ignore=skip, include_parameters=include_parameters, fn=fn)
    transient = _modules.non_persistent_names(module)

    def row(name: str, t: torch.Tensor, **verdict: Any) -> BufferRow:
        return BufferRow(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), name not in transient,
                         verdict.get("in_sync", True), verdict.get("diff", 0.0), verdict.get("ranks", ()),
                         verdict.get("rel", 0.0), verdict.get("untrained", ()))

    if g is None:
        me = _group.global_rank()
        return BufferReport(tuple(row(n, t) for n, t in entries), (me,), me, atol, checked=False,
                            training=module.training)
    tensors = [t for _, t in entries]
    call = (fn, atol, include_parameters)
    problem = _transaction.unsendable(g, entries, fn)  # such tensors cannot be hashed either
    known: dict[int, int] = {}  # digests of the large buffers, hashed once for both uses
    failure: BaseException | None = None  # this rank's, voted on: every rank raises the same SyncAbortedError
    extra = 0
    if problem is None:
        try:
            _transaction.reached(_transaction.Phase.PREPARE, fn)
            extra = _digest.combined(tensors, known)
        except BaseException as e:  # noqa: BLE001 - a vote in the first collective
            failure = e
    votes = _structure.agree(g, call, entries, deadline, fn, status=int(failure is not None), extra=extra)
    if problem is not None:
        raise problem  # structure agreed (it includes device, layout, dtype): every rank raises this
    _transaction.abort_if_any(g, [s for s, _ in votes], failure, deadline, fn, "hashing the buffers failed",
                              "nothing was changed")
    if all(v[1] == votes[0][1] for v in votes):  # all agree: the rows depend on the structure alone
        key = (call, _structure.digest(call, entries), frozenset(transient), g.ranks, module.training)
        report = _IN_SYNC.get(key)
        if report is None:
            if len(_IN_SYNC) > 64:
                _IN_SYNC.clear()
            report = _IN_SYNC[key] = BufferReport(tuple(row(n, t) for n, t in entries), g.ranks, g.ranks[0], atol,
                                                  training=module.training)
        return report
    # The differing path: a rank that fails from here on still takes part in every collective (zeros where its
    # values would be) and says so in the last one, so every rank raises the same error instead of waiting for it.
    mine_digests, slabs = [0] * len(tensors), {}
    try:  # the digests, and every scratch the comparison needs (one slice per device), before the next collective
        _transaction.reached(_transaction.Phase.EXCHANGE, fn)
        mine_digests = _digest.per_tensor(tensors, known)
        slabs = _slabs(tensors)
    except BaseException as e:  # noqa: BLE001 - voted on in the digests' all_gather
        failure = e
    digests = _wire.all_gather_values(g, [*mine_digests, int(failure is not None)], deadline, fn)
    _transaction.abort_if_any(g, [d[-1] for d in digests], failure, deadline, fn, "hashing the buffers failed",
                              "nothing was changed")
    differ = [i for i in range(len(entries)) if any(d[i] != digests[0][i] for d in digests)]
    measured, compare_failure = _compare_with_reference(g, [tensors[i] for i in differ], deadline, fn, slabs)
    failure = failure or compare_failure
    untrained = [False] * len(differ)
    try:
        untrained = _untrained_flags(module, [entries[i][0] for i in differ])
    except BaseException as e:  # noqa: BLE001 - as above
        failure = failure or e
    # one all_gather: per differing buffer, this rank's max |x - ref|, the reference's max |ref|, untrained flag;
    # then the module's train/eval mode and whether this rank failed
    mine = [v for (d, m), u in zip(measured, untrained) for v in (d, m, float(u))] + [float(module.training),
                                                                                    float(failure is not None)]
    table = _wire.all_gather_values(g, mine, deadline, fn, dtype=torch.float64)  # type: ignore[arg-type]
    _transaction.abort_if_any(g, [int(t[-1]) for t in table], failure, deadline, fn, "comparing the buffers failed",
                              "nothing was changed")
    rows = {i: row(n, t) for i, (n, t) in enumerate(entries)}
    for k, i in enumerate(differ):
        diffs = [table[j][3 * k] for j in range(g.size)]
        if atol == 0:
            bad = tuple(r for j, r in enumerate(g.ranks) if digests[j][i] != digests[0][i])
        else:
            bad = tuple(r for r, d in zip(g.ranks, diffs) if not d <= atol)
        worst = max(diffs)
        scale = table[0][3 * k + 1]
        rel = 0.0 if worst == 0 else math.inf if scale == 0 else worst / scale
        fresh = tuple(r for j, r in enumerate(g.ranks) if table[j][3 * k + 2])
        rows[i] = row(entries[i][0], entries[i][1], in_sync=not bad, diff=worst, ranks=bad, rel=rel, untrained=fresh)
    return BufferReport(tuple(rows[i] for i in range(len(entries))), g.ranks, g.ranks[0], atol,
                        training=bool(table[0][-2]))


def _slabs(tensors: Sequence[torch.Tensor]) -> dict[torch.device, torch.Tensor]:
    """Per device, the bytes one slice of the comparison needs (at most :data:`SLICE_BYTES`, allocated once). Which
    buffers differ is known only after this allocation has been voted on, and the slices of any subset pack up to
    the whole of one (device, dtype): so the bound is that total, capped by the slice size."""
    total: dict[tuple[torch.device, torch.dtype], int] = {}
    for t in tensors:
        total[t.device, t.dtype] = total.get((t.device, t.dtype), 0) + t.numel() * t.element_size()
    need: dict[torch.device, int] = {}
    for (device, _), n in total.items():
        need[device] = max(need.get(device, 0), min(n, SLICE_BYTES))
    return {d: torch.empty(-(-n // 64) * 64 + 64, dtype=torch.uint8, device=d) for d, n in need.items() if n}


def _in_slab(slab: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over the start of ``slab`` (no allocation)."""
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return slab[:n].view(dtype).view(tuple(shape))


def _compare_with_reference(g: _group.Group, tensors: Sequence[torch.Tensor], deadline: _wire.Deadline,
                            what: str, slabs: dict[torch.device, torch.Tensor]
                            ) -> tuple[list[tuple[float, float]], BaseException | None]:
    """Per tensor, (max |mine - reference|, max |reference|) against group rank 0's copy, which travels in slices of
    at most :data:`SLICE_BYTES`: small tensors packed together per (device, dtype), a larger one cut in logical
    order (where it is cut depends on its shape alone, so every rank issues the same broadcasts whatever its
    strides). Each slice is compared as it arrives, in ``slabs`` (allocated and voted on before the first
    broadcast): the extra memory is one slice and the comparison's temporaries, whatever the buffer's size. The
    reference rank compares nothing (its difference with itself is 0). A comparison that fails here is returned (the
    first), after every broadcast was issued."""
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(tensors)
    reference = g.me == 0
    failure: BaseException | None = None

    def measure(fn: Any, *args: Any) -> float:
        nonlocal failure
        try:
            return float(fn(*args))
        except CollectiveError:
            raise
        except BaseException as e:  # noqa: BLE001 - reported with the table; the broadcasts go on
            failure = failure or e
            return 0.0

    for bucket in _wire.plan(tensors, cap=SLICE_BYTES):
        first = tensors[bucket.indices[0]].detach()
        slab = slabs[bucket.device]
        if len(bucket.indices) == 1 and first.numel() * first.element_size() > SLICE_BYTES:
            worst = scale = 0.0
            for block in _compare.blocks(first, max(1, SLICE_BYTES // first.element_size())):
                ref = _in_slab(slab, block.dtype, block.shape)
                if reference:  # a copy of the block (conj/neg views resolved), sent from the slab
                    torch_compat.copy_all([ref], [block.resolve_conj().resolve_neg()])
                _wire.broadcast_flat(g, ref, 0, deadline, what)
                if not reference:
                    worst = max(worst, measure(_compare.max_abs_diff, block, ref))
                scale = max(scale, measure(_compare.max_abs, ref))
            out[bucket.indices[0]] = (worst, scale)
            continue
        space: Any = {bucket.device: slab} if reference else [_in_slab(slab, bucket.dtype, (bucket.numel,))]
        try:
            _wire.broadcast(g, tensors, [bucket], 0, space, deadline, what)
        except CollectiveError:
            raise
        except BaseException as e:  # noqa: BLE001 - the source could not pack: every collective was still issued
            failure = failure or e
        offset = 0
        for i in bucket.indices:
            mine = tensors[i].detach()
            n = mine.numel()
            if reference:
                out[i] = (0.0, measure(_compare.max_abs, mine))
            else:
                ref = space[0][offset:offset + n].view(mine.shape)
                out[i] = (measure(_compare.max_abs_diff, mine, ref), measure(_compare.max_abs, ref))
            offset += n
    return out, failure


def _untrained_flags(module: nn.Module, names: Sequence[str]) -> list[bool]:
    """For each name, whether it is a BatchNorm statistic whose layer still holds its initial state here."""
    fresh: set[str] = set()
    for bn in _modules.tracking_bn(module):
        if (bn.count is None or int(bn.count) == 0) and not bn.mean.any() and bool((bn.var == 1).all()):
            fresh.update(name for name, _ in bn.entries())
    return [n in fresh for n in names]


def advice(report: BufferReport) -> str:
    """What to call, given what the differing buffers look like."""
    bad = report.out_of_sync
    stats = [r for r in bad if r.name.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")]
    untrained = sorted({u for r in stats for u in r.untrained_ranks})
    if untrained:
        loaded = [r for r in report.ranks if r not in untrained]
        src = loaded[0] if loaded else report.reference_rank
        return (f"BatchNorm statistics on rank(s) {untrained} are still at their initial values (mean 0, var 1, "
                "count 0): they were loaded on some ranks only (a rank-0 load under ZeRO-3, say). Take the loaded "
                f"values: zero_buffers.broadcast_buffers(module, src={report.ranks.index(src)}), or "
                "zero_buffers.frozen_replica(module) for a frozen module; merging statistics would be wrong.")
    if stats and not report.training:
        return ("The module is in eval mode (frozen or loaded) but its BatchNorm statistics differ: take one "
                "rank's with zero_buffers.broadcast_buffers(module) (or zero_buffers.frozen_replica(module)); "
                "average_bn_stats would blend statistics that were never meant to differ.")
    if stats:
        return ("BatchNorm statistics were updated on each rank's own data: merge them with "
                "zero_buffers.average_bn_stats(module) (exact mixture), or recompute them over every rank's data "
                "with zero_buffers.recompute_bn_stats(module, loader); then every rank holds the same values.")
    return ("Take one rank's values with zero_buffers.broadcast_buffers(module) (for statistics that each rank "
            "updates, merge them instead).")


def assert_buffers_in_sync(module: nn.Module, *, group: Any = None, atol: float = 0.0, ignore: Iterable[str] = (),
                           include_parameters: bool = False, timeout: _args.Timeout = None) -> BufferReport:
    """Raise :class:`BuffersOutOfSyncError` on every rank if any buffer differs across ranks; else return the report.

    The message lists the offending buffers with their max abs difference and the ranks that differ (all of them
    up to 30; past that the 20 worst, the others summed up by module, so it stays under 40 lines), and
    advises by situation: statistics loaded on some ranks only or a frozen module (take one rank's values)
    versus statistics trained per rank (merge or recompute them).

    Example::

        zero_buffers.assert_buffers_in_sync(model)   # before torch.save(model.state_dict()) on rank 0
    """
    report = _report("assert_buffers_in_sync", module, group, atol, ignore, include_parameters, timeout)
    if not report.in_sync:
        raise BuffersOutOfSyncError(
            f"{type(module).__name__}: buffers out of sync across ranks.\n"
            f"{report.format(only_out_of_sync=True)}\nFix: {advice(report)}", report)
    return report
