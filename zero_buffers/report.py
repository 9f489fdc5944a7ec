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
    placement as _placement,
    structure as _structure,
    transaction as _transaction,
    wire as _wire,
)
from .errors import BuffersOutOfSyncError, CollectiveError
from .precision import declared as _declared

SHORT_ROWS = 30  # a report of at most this many buffers (or differing buffers) lists them all, in model order
WORST_ROWS = 20  # past that, a short report lists the worst this many differing buffers ...
MODULE_LINES = 12  # ... and sums up the other differing ones by module in at most this many lines
SLICE_BYTES = 4 * 2 ** 20  # a differing buffer's reference travels in slices of at most this many bytes
PRECISION_LINES = 3  # the lines a report's text gives buffers held below their declared dtype, at most
_WIDEST = 16  # bytes per element of the widest dtype (complex128): what a reference in another rank's dtype may take


@dataclass(frozen=True)
class BufferRow:
    """One buffer's cross-rank verdict. ``differing_ranks`` are global ranks whose value differs from the reference;
    ``max_rel_diff`` is ``max_abs_diff`` over the largest magnitude in the reference; ``untrained_ranks`` are
    the ranks where this BatchNorm statistic is still at its initial value (mean 0, var 1, count 0).

    ``dtype`` is the reference rank's; ``rank_dtypes`` the ranks that hold the buffer in another dtype, with theirs
    (``((1, "bfloat16"),)``): such a row is out of sync, those ranks are among ``differing_ranks``, and its values
    were still compared (in float64). ``degraded_ranks``: the ranks holding it in a dtype its declaration says is
    too coarse ([Note: declared precision]: BatchNorm statistics or transformers' fp32 buffers in 16 bits), with the
    declared dtype (``declared``) and the declaration's reason (``why``); those are empty when no rank does.

    Over a DeviceMesh ([Note: placements]): ``mesh_dims`` names the dimensions along which some line of ranks holds
    different values (of those the buffer is replicated over), ``coordinates`` the mesh coordinates of
    ``differing_ranks`` (in that order), and ``placement`` the buffer's placements (``dp:R,tp:S(0)``); each rank is
    compared with the reference of its own class (the rank at coordinate 0 of the replicated dimensions, its own
    coordinates elsewhere).
    ``uninitialised_ranks``: the differing ranks whose copy looks never written since it was allocated (memory
    ``to_empty()`` left as it was; the rule: [Note: uninitialised buffers] in ``_core/compare.py``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    persistent: bool
    in_sync: bool
    max_abs_diff: float
    differing_ranks: tuple[int, ...]
    max_rel_diff: float = 0.0
    untrained_ranks: tuple[int, ...] = ()
    rank_dtypes: tuple[tuple[int, str], ...] = ()
    degraded_ranks: tuple[int, ...] = ()
    declared: str = ""
    why: str = ""
    mesh_dims: tuple[str, ...] = ()
    coordinates: tuple[tuple[int, ...], ...] = ()
    placement: str = ""
    uninitialised_ranks: tuple[int, ...] = ()

    @property
    def dtype_text(self) -> str:
        """``float32``; when ranks hold it in other dtypes, ``float32 (rank 1: bfloat16)``."""
        if not self.rank_dtypes:
            return self.dtype
        groups: dict[str, list[int]] = {}
        for r, d in self.rank_dtypes:
            groups.setdefault(d, []).append(r)
        inner = "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {_ranks(rs)}: {d}" for d, rs in groups.items())
        return f"{self.dtype} ({inner})"

    def held_by(self, rank: int) -> str:
        """The dtype ``rank`` holds this buffer in."""
        return dict(self.rank_dtypes).get(rank, self.dtype)


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
    mesh: tuple[str, ...] = ()

    @property
    def in_sync(self) -> bool:
        return all(r.in_sync for r in self.rows)

    @property
    def out_of_sync(self) -> list[BufferRow]:
        return [r for r in self.rows if not r.in_sync]

    @property
    def degraded(self) -> list[BufferRow]:
        """The rows some rank holds below their declared dtype."""
        return [r for r in self.rows if r.degraded_ranks]

    @property
    def advice(self) -> str:
        """What to do, in lines ("" when nothing): for buffers out of sync, what to call given what they look like;
        for buffers held below their declared dtype, each kind named (buffer, held and declared dtype, reason) and
        ``zb.keep_precision(model)``."""
        lines = [_sync_advice(self)] if not self.in_sync else []
        return "\n".join(lines + _precision_lines(self.degraded, self.ranks))

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
        summed up by module. A buffer some rank holds in another dtype shows each rank's (``float32 (rank 1:
        bfloat16)``); buffers held below their declared dtype get a ``precision`` column, a count in the head and at
        most :data:`PRECISION_LINES` lines of advice at the end."""
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


def _render(report: BufferReport, pick: _Selection, head: str | None, precision: bool = True) -> str:
    """The text of a selection (``precision=False``: without what concerns declared dtypes)."""
    bad = report.out_of_sync
    if not report.checked:
        default = f"{len(report.rows)} buffers, not compared: no process group with more than one rank"
    else:
        default = (f"{len(bad)} of {len(report.rows)} buffers differ across ranks {_group_text(report.ranks)} "
                   f"(reference rank {report.reference_rank}, atol={report.atol:g})")
        if bad:
            default += f"; differing ranks: {_ranks(sorted({k for r in bad for k in r.differing_ranks}))}"
        empty = [r for r in bad if r.uninitialised_ranks]
        if empty:
            default += f"; {len(empty)} look uninitialised"
    degraded = report.degraded if precision else []
    if degraded:
        default += f"; {len(degraded)} held below their declared dtype"
    cells: list[tuple[str, ...]] = [
        (r.name, r.dtype_text, str(list(r.shape)), "yes" if r.in_sync else "NO", f"{r.max_abs_diff:.4g}",
         f"{r.max_rel_diff:.3g}", _ranks(r.differing_ranks) or "-") for r in pick.rows]
    titles: tuple[str, ...] = ("buffer", "dtype", "shape", "in sync", "max |diff|", "rel", "differing ranks")
    if any(r.mesh_dims for r in pick.rows):
        titles += ("mesh",)
        cells = [(*c, _mesh_cell(r, report.mesh)) for c, r in zip(cells, pick.rows)]
    if any(r.uninitialised_ranks for r in pick.rows):
        titles += ("uninitialised on",)
        cells = [(*c, _ranks(r.uninitialised_ranks) or "-") for c, r in zip(cells, pick.rows)]
    if any(r.degraded_ranks for r in pick.rows) and precision:
        titles += ("precision",)
        cells = [(*c, _precision_cell(r, report.ranks)) for c, r in zip(cells, pick.rows)]
    lines = [default if head is None else head, *_table(titles, cells, {4, 5})]
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
    return "\n".join(lines + _precision_lines(degraded, report.ranks))


def _mesh_cell(row: BufferRow, names: Sequence[str]) -> str:
    """``along tp at (dp=0, tp=1), (dp=1, tp=1)``."""
    if not row.mesh_dims:
        return ""
    at = ", ".join("(" + ", ".join(f"{n}={c}" for n, c in zip(names, cs)) + ")" for cs in row.coordinates[:4])
    more = f" and {len(row.coordinates) - 4} more" if len(row.coordinates) > 4 else ""
    return f"along {'+'.join(row.mesh_dims)} at {at}{more}"


def _precision_cell(row: BufferRow, ranks: Sequence[int]) -> str:
    """``below float32`` (on every rank), ``below float32 on 1`` (on some)."""
    if not row.degraded_ranks:
        return ""
    where = "" if set(row.degraded_ranks) >= set(ranks) else f" on {_ranks(row.degraded_ranks)}"
    return f"below {row.declared or 'declared'}{where}"


def _precision_lines(rows: Sequence[BufferRow], ranks: Sequence[int]) -> list[str]:
    """At most :data:`PRECISION_LINES` lines for the rows held below their declared dtype: the kinds (held dtype,
    declared dtype, reason), the largest first, each naming its first buffer and how many more; then the fix."""
    if not rows:
        return []
    kinds: dict[tuple[str, str, str], list[BufferRow]] = {}
    for r in rows:
        kinds.setdefault((r.held_by(r.degraded_ranks[0]), r.declared, r.why), []).append(r)
    order = sorted(kinds.items(), key=lambda kv: -len(kv[1]))  # stable: ties in model order
    shown = order if len(order) <= PRECISION_LINES else order[:PRECISION_LINES - 1]
    lines = []
    for (held, declared, why), group in shown:
        first = group[0]
        where = "" if set(first.degraded_ranks) >= set(ranks) else f" on rank(s) {_ranks(first.degraded_ranks)}"
        more = f" (and {len(group) - 1} more like it)" if len(group) > 1 else ""
        lines.append(f"Precision: '{first.name}'{more} is held in {held}{where} but declared "
                     f"{declared or 'in a finer dtype'} ({why}).")
    rest = order[len(shown):]
    if rest:
        lines.append(f"Precision: {sum(len(g) for _, g in rest)} more buffers of {len(rest)} other kinds are held "
                     "below their declared dtype (format(full=True) lists them).")
    lines[-1] += (" Keep declared dtypes with zb.keep_precision(model) (BatchNorm statistics, transformers' fp32 "
                  "lists and rotary tables by default) before anything casts the model.")
    return lines


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

    ``group=mesh`` (a multi-dimensional DeviceMesh), or DTensor buffers: each buffer is compared along the mesh
    dimensions it is replicated over only, and rows name the dimensions and coordinates that disagree
    ([Note: placements]).

    Example::

        report = zero_buffers.buffer_report(model)
        if not report.in_sync:
            print(report.format(only_out_of_sync=True))
    """
    return _report("buffer_report", module, group, atol, ignore, include_parameters, timeout)


_PER_BUFFER = 4  # floats per differing buffer in the comparison's all_gather: diff, scale, untrained, uninitialised
_IN_SYNC: dict[Any, BufferReport] = {}  # (structure, non-persistent names, ranks, ...) -> the all-agree report


def _declarations(module: nn.Module, entries: Sequence[tuple[str, torch.Tensor]]) -> dict[int, _declared.Declared]:
    """Entry index -> its declared dtype ([Note: declared precision]), matched by tensor (names in ``entries`` may
    carry a wrapper's prefix)."""
    root = _modules.unwrap(module, "buffer_report")
    by_tensor: dict[int, _declared.Declared] = {}
    for d in _declared.declared(module):
        try:
            by_tensor.setdefault(id(root.get_buffer(d.name)), d)
        except AttributeError:
            continue
    return {i: by_tensor[id(t)] for i, (_, t) in enumerate(entries) if id(t) in by_tensor}


def _precision_of(entries: Sequence[tuple[str, torch.Tensor]], decl: dict[int, _declared.Declared]
                  ) -> tuple[list[int], int]:
    """Per entry, its dtype code with bit 7 set where it is held degraded; and a digest of the declarations (which
    the rows' ``declared`` / ``why`` come from)."""
    codes = [_structure.dtype_code(t.dtype) | (0x80 if i in decl and decl[i].degraded(t.dtype) else 0)
             for i, (_, t) in enumerate(entries)]
    texts = sorted((i, str(d.dtype), d.why) for i, d in decl.items())
    return codes, _structure.digest_bytes(repr(texts).encode())


def _report(fn: str, module: nn.Module, group: Any, atol: float, ignore: Iterable[str], include_parameters: bool,
            timeout: _args.Timeout) -> BufferReport:
    """buffer_report's body; ``fn`` names the public function in errors.

    Dtypes are values here, not structure: ranks agree on a dtype-blind structure (names, shapes, devices, layouts),
    each rank's dtypes (and its degraded-precision flags) ride along the content digest in the first collective
    and, on the differing path, one byte per buffer in the per-buffer digests' all_gather; the reference rank's
    copy of a buffer travels in its own dtype and every rank compares its copy with it in float64."""
    _args.module(module, fn)
    atol = _args.atol(atol, fn)
    skip = _args.ignore(ignore, fn)
    deadline = _wire.Deadline(_args.timeout(timeout, fn))
    g = _group.resolve(group, fn)
    entries = _modules.named_buffers(module, ignore=skip, include_parameters=include_parameters, fn=fn)
    transient = _modules.non_persistent_names(module)
    decl: dict[int, _declared.Declared] = {}
    placed = _placement.placed(g, entries, deadline, fn) if g is not None else None
    texts: list[str] = [""] * len(entries)
    if placed is not None:  # over a mesh, DTensors by their local tensors ([Note: placements])
        g, entries = placed.g, placed.entries
        texts = [lay.text if i in placed.dtensors else "" for i, lay in enumerate(placed.layouts)]

    def row(i: int, degraded: Sequence[int] = (), same_declarations: bool = True, **verdict: Any) -> BufferRow:
        name, t = entries[i]
        d = decl.get(i) if degraded else None
        declared = (str(d.dtype).removeprefix("torch.") if d is not None else "") if same_declarations else ""
        why = (d.why if d is not None else "") if same_declarations else "declared differently across ranks"
        return BufferRow(name, str(t.dtype).removeprefix("torch.") if "dtype" not in verdict else verdict["dtype"],
                         tuple(t.shape), name not in transient, verdict.get("in_sync", True), verdict.get("diff", 0.0),
                         verdict.get("ranks", ()), verdict.get("rel", 0.0), verdict.get("untrained", ()),
                         verdict.get("rank_dtypes", ()), tuple(degraded), declared if degraded else "",
                         why if degraded else "", verdict.get("mesh_dims", ()), verdict.get("coordinates", ()),
                         texts[i], verdict.get("uninitialised", ()))

    if g is None:
        me = _group.global_rank()
        decl = _declarations(module, entries)
        codes, _ = _precision_of(entries, decl)
        return BufferReport(tuple(row(i, (me,) if codes[i] & 0x80 else ()) for i in range(len(entries))), (me,), me,
                            atol, checked=False, training=module.training)
    tensors = [t for _, t in entries]
    call = (fn, atol, include_parameters, *(("placements", placed.signature) if placed is not None else ()))
    names = g.mesh.names if g.mesh is not None else ()
    problem = _transaction.unsendable(g, entries, fn)  # such tensors cannot be hashed either
    known: dict[int, int] = {}  # digests of the large buffers, hashed once for both uses
    failure: BaseException | None = None  # this rank's, voted on: every rank raises the same SyncAbortedError
    extra = 0
    codes, declarations = [0] * len(entries), 0
    if problem is None:
        try:
            _transaction.reached(_transaction.Phase.PREPARE, fn)
            decl = _declarations(module, entries)
            codes, declarations = _precision_of(entries, decl)
            extra = _structure.digest_bytes(repr((_digest.combined(tensors, known), codes, declarations)).encode())
        except BaseException as e:  # noqa: BLE001 - a vote in the first collective
            failure = e
    # dtype-blind: a buffer held in other dtypes on some ranks is a row of the report, not a structure error
    votes = _structure.agree(g, call, entries, deadline, fn, status=int(failure is not None), extra=extra,
                             dtypes=False)
    if problem is not None:
        raise problem  # structure agreed (device, layout, quantized or not): every rank raises this
    _transaction.abort_if_any(g, [s for s, _ in votes], failure, deadline, fn, "hashing the buffers failed",
                              "nothing was changed")
    if all(v[1] == votes[0][1] for v in votes):  # all agree (dtypes and declarations too): the rows need no more
        key = (call, _structure.digest(call, entries), frozenset(transient), g.ranks, module.training, tuple(codes),
               declarations)
        report = _IN_SYNC.get(key)
        if report is None:
            if len(_IN_SYNC) > 64:
                _IN_SYNC.clear()
            report = _IN_SYNC[key] = BufferReport(
                tuple(row(i, g.ranks if codes[i] & 0x80 else ()) for i in range(len(entries))), g.ranks, g.ranks[0],
                atol, training=module.training, mesh=names)
        return report
    # The differing path: a rank that fails from here on still takes part in every collective (zeros where its
    # values would be) and says so in the last one, so every rank raises the same error instead of waiting for it.
    n = len(entries)
    mine_digests, slabs = [0] * n, {}
    try:  # the digests, and every scratch the comparison needs (one slice per device), before the next collective
        _transaction.reached(_transaction.Phase.EXCHANGE, fn)
        mine_digests = _digest.per_tensor(tensors, known)
        slabs = _slabs(tensors)
    except BaseException as e:  # noqa: BLE001 - voted on in the digests' all_gather
        failure = e
    packed = _structure.pack_bytes(codes)
    # per buffer a digest; then its dtype and degraded flag, a byte each; the declarations' digest; failed or not
    digests = _wire.all_gather_values(g, [*mine_digests, *packed, declarations, int(failure is not None)], deadline, fn)
    _transaction.abort_if_any(g, [d[-1] for d in digests], failure, deadline, fn, "hashing the buffers failed",
                              "nothing was changed")
    held = [_structure.unpack_bytes(d[n:n + len(packed)], n) for d in digests]  # per member, per buffer
    kinds = [[c & 0x7F for c in h] for h in held]
    same_declarations = all(d[-2] == digests[0][-2] for d in digests)
    refs = _references(g, placed, n)  # per buffer, per member: the member it is compared with
    differ = [i for i in range(n) if any(digests[j][i] != digests[refs[i][j]][i] or kinds[j][i] != kinds[refs[i][j]][i]
                                         for j in range(g.size))]
    fresh_of: dict[int, bool] = {}
    try:  # [Note: uninitialised buffers], point 2: read before anything of this call could write them
        fresh_of = {i: (tensors[i].is_floating_point() or tensors[i].is_complex())
                    and torch_compat.never_written(tensors[i]) for i in differ}
    except BaseException as e:  # noqa: BLE001 - as above
        failure = failure or e
    measured_of: dict[int, tuple[float, float, bool]] = {}
    for sub, idx in (placed.classes(differ) if placed is not None else [(g, differ)]):
        if sub is None:
            continue  # sharded or partial on every dimension: nothing to compare with
        first = refs[idx[0]][g.me] if idx else 0
        reference = [_structure.dtype_of(kinds[first][i]) or tensors[i].dtype for i in idx]  # the line's first's
        measured, compare_failure = _compare_with_reference(sub, [tensors[i] for i in idx], reference, deadline, fn,
                                                            slabs, [fresh_of.get(i, False) for i in idx])
        measured_of.update(zip(idx, measured))
        failure = failure or compare_failure
    measured = [measured_of.get(i, (0.0, 0.0, False)) for i in differ]
    untrained = [False] * len(differ)
    try:
        untrained = _untrained_flags(module, [entries[i][0] for i in differ])
    except BaseException as e:  # noqa: BLE001 - as above
        failure = failure or e
    # one all_gather: per differing buffer, this rank's max |x - ref|, the reference's max |ref|, untrained flag,
    # looks-uninitialised flag; then the module's train/eval mode and whether this rank failed
    mine = [v for (d, m, f), u in zip(measured, untrained) for v in (d, m, float(u), float(f and not u))] + [
        float(module.training), float(failure is not None)]
    table = _wire.all_gather_values(g, mine, deadline, fn, dtype=torch.float64)  # type: ignore[arg-type]
    _transaction.abort_if_any(g, [int(t[-1]) for t in table], failure, deadline, fn, "comparing the buffers failed",
                              "nothing was changed")

    def name_of(code: int) -> str:
        dtype = _structure.dtype_of(code)
        return str(dtype).removeprefix("torch.") if dtype is not None else "another dtype"

    def common(i: int) -> dict[str, Any]:
        """What a row says of dtypes and precision, from every member's bytes."""
        others = tuple((r, name_of(kinds[j][i])) for j, r in enumerate(g.ranks) if kinds[j][i] != kinds[0][i])
        degraded = tuple(r for j, r in enumerate(g.ranks) if held[j][i] & 0x80)
        return {"dtype": name_of(kinds[0][i]), "rank_dtypes": others, "degraded": degraded,
                "same_declarations": same_declarations}

    rows = {i: row(i, **common(i)) for i in range(n)}
    for k, i in enumerate(differ):
        ref = refs[i]
        diffs = [table[j][_PER_BUFFER * k] for j in range(g.size)]
        # another dtype than its reference's: out of sync, whatever atol
        retyped = {j for j in range(g.size) if kinds[j][i] != kinds[ref[j]][i]}
        if atol == 0:
            bad_j = [j for j in range(g.size) if digests[j][i] != digests[ref[j]][i] or j in retyped]
        else:
            bad_j = [j for j, d in enumerate(diffs) if not d <= atol or j in retyped]
        bad = tuple(g.ranks[j] for j in bad_j)
        worst = max(diffs)
        scale = max(table[ref[j]][_PER_BUFFER * k + 1] for j in bad_j) if bad_j else table[0][_PER_BUFFER * k + 1]
        rel = 0.0 if worst == 0 else math.inf if scale == 0 else worst / scale
        untrained_here = tuple(r for j, r in enumerate(g.ranks) if table[j][_PER_BUFFER * k + 2])
        empty = tuple(r for j, r in enumerate(g.ranks) if table[j][_PER_BUFFER * k + 3] and r in bad)
        where: dict[str, Any] = {}
        if g.mesh is not None and bad_j:
            where = {"mesh_dims": _disagreeing(g, placed, i, [d[i] for d in digests], set(bad_j)),
                     "coordinates": tuple(g.mesh.coords[j] for j in bad_j)}
        rows[i] = row(i, in_sync=not bad, diff=worst, ranks=bad, rel=rel, untrained=untrained_here,
                      uninitialised=empty, **common(i), **where)
    return BufferReport(tuple(rows[i] for i in range(n)), g.ranks, g.ranks[0], atol, training=bool(table[0][-2]),
                        mesh=names)


def _references(g: _group.Group, placed: _placement.Placed | None, n: int) -> list[list[int]]:
    """Per buffer, per member (group order): the member it is compared with. Without a mesh, group rank 0; over a
    mesh ([Note: placements]), the member at coordinate 0 of the dimensions the buffer is replicated over and at the
    member's own coordinates on the others (the first of its line; itself where it is replicated nowhere)."""
    if placed is None or g.mesh is None:
        return [[0] * g.size] * n
    m = g.mesh
    at = {c: j for j, c in enumerate(m.coords)}
    out = []
    for lay in placed.layouts:
        if set(lay.replicate) == set(m.dims):
            out.append([0] * g.size)
            continue
        out.append([at[tuple(0 if d in lay.replicate else x for d, x in enumerate(c))] for c in m.coords])
    return out


def _disagreeing(g: _group.Group, placed: _placement.Placed | None, i: int, digests: Sequence[int],
                 bad: set[int]) -> tuple[str, ...]:
    """The mesh dimensions (of those buffer ``i`` is replicated over) along which two members that differ in that
    coordinate alone hold different values, one of them out of sync."""
    assert g.mesh is not None
    m = g.mesh
    dims = placed.layouts[i].replicate if placed is not None else m.dims
    out = []
    for d in dims:  # the members by line along d (their coordinates elsewhere): one pass, not one per pair
        lines: dict[tuple[int, ...], list[int]] = {}
        for j, c in enumerate(m.coords):
            lines.setdefault(c[:d] + c[d + 1:], []).append(j)
        if any(len({digests[j] for j in line}) > 1 and bad.intersection(line) for line in lines.values()):
            out.append(m.names[d])
    return tuple(out)


def _slabs(tensors: Sequence[torch.Tensor]) -> dict[torch.device, torch.Tensor]:
    """Per device, the bytes one slice of the comparison needs (at most :data:`SLICE_BYTES`, allocated once). Which
    buffers differ, and the reference rank's dtype of each, are known only after this allocation has been voted
    on, and the slices of any subset pack up to the whole of one (device, dtype) in the reference's dtypes: so the
    bound is every element of the device at the widest element size, capped by the slice size."""
    need: dict[torch.device, int] = {}
    for t in tensors:
        need[t.device] = need.get(t.device, 0) + t.numel() * _WIDEST
    return {d: torch.empty(-(-min(n, SLICE_BYTES) // 64) * 64 + 64, dtype=torch.uint8, device=d)
            for d, n in need.items() if n}


def _in_slab(slab: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over the start of ``slab`` (no allocation)."""
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return slab[:n].view(dtype).view(tuple(shape))


def _as_reference(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` itself when it has the reference's ``dtype``; else a tensor of its shape and device in that dtype that
    takes no memory (an expanded scalar): what the bucket plan and the slices are cut by, the same on every rank."""
    return t if t.dtype == dtype else torch.empty((), dtype=dtype, device=t.device).expand(t.shape)


def _compare_with_reference(g: _group.Group, tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype],
                            deadline: _wire.Deadline, what: str, slabs: dict[torch.device, torch.Tensor],
                            fresh: Sequence[bool]) -> tuple[list[tuple[float, float, bool]], BaseException | None]:
    """Per tensor, (max |mine - reference|, max |reference|, looks uninitialised) against group rank 0's copy, which
    travels in its own dtype (``dtypes``: rank 0's, known on every rank) in slices of at most :data:`SLICE_BYTES`:
    small tensors packed together per (device, dtype), a larger one cut in logical order (where it is cut depends on
    its shape and the reference's dtype alone, so every rank issues the same broadcasts whatever its strides or its
    own dtype). Each slice is compared in float64 as it arrives, in ``slabs`` (allocated and voted on before the
    first broadcast): the extra memory is one slice and the comparison's temporaries, whatever the buffer's size.
    The reference rank compares nothing (its difference with itself is 0). A comparison that fails here is returned
    (the first), after every broadcast was issued. ``fresh``: per tensor, whether it was never written here (point 2
    of [Note: uninitialised buffers]); only those are looked at for leftover memory (point 3), on the other ranks."""
    out: list[tuple[float, float, bool]] = [(0.0, 0.0, False)] * len(tensors)
    reference = g.me == 0
    failure: BaseException | None = None
    shadows = [_as_reference(t, d) for t, d in zip(tensors, dtypes)]  # on the reference rank: the tensors

    def measure(fn: Any, *args: Any) -> float:
        nonlocal failure
        try:
            return float(fn(*args))
        except CollectiveError:
            raise
        except BaseException as e:  # noqa: BLE001 - reported with the table; the broadcasts go on
            failure = failure or e
            return 0.0

    def leftover(i: int) -> _compare.Leftover | None:
        return _compare.Leftover() if fresh[i] and not reference else None

    def look(found: _compare.Leftover | None, mine: torch.Tensor, ref: torch.Tensor) -> None:
        if found is not None:
            measure(found.add, mine, ref)

    for bucket in _wire.plan(shadows, cap=SLICE_BYTES):
        first = tensors[bucket.indices[0]].detach()
        size = shadows[bucket.indices[0]].element_size()
        slab = slabs[bucket.device]
        if len(bucket.indices) == 1 and first.numel() * size > SLICE_BYTES:
            worst = scale = 0.0
            found = leftover(bucket.indices[0])
            for block in _compare.blocks(first, max(1, SLICE_BYTES // size)):
                ref = _in_slab(slab, bucket.dtype, block.shape)
                if reference:  # a copy of the block (conj/neg views resolved), sent from the slab
                    torch_compat.copy_all([ref], [block.resolve_conj().resolve_neg()])
                _wire.broadcast_flat(g, ref, 0, deadline, what)
                if not reference:
                    worst = max(worst, measure(_compare.max_abs_diff, block, ref))
                    look(found, block, ref)
                scale = max(scale, measure(_compare.max_abs, ref))
            out[bucket.indices[0]] = (worst, scale, found is not None and found.found)
            continue
        space: Any = {bucket.device: slab} if reference else [_in_slab(slab, bucket.dtype, (bucket.numel,))]
        try:
            _wire.broadcast(g, shadows, [bucket], 0, space, deadline, what)
        except CollectiveError:
            raise
        except BaseException as e:  # noqa: BLE001 - the source could not pack: every collective was still issued
            failure = failure or e
        offset = 0
        for i in bucket.indices:
            mine = tensors[i].detach()
            n = mine.numel()
            if reference:
                out[i] = (0.0, measure(_compare.max_abs, mine), False)
            else:
                ref = space[0][offset:offset + n].view(mine.shape)
                found = leftover(i)
                look(found, mine, ref)
                out[i] = (measure(_compare.max_abs_diff, mine, ref), measure(_compare.max_abs, ref),
                          found is not None and found.found)
            offset += n
    return out, failure


def _untrained_flags(module: nn.Module, names: Sequence[str]) -> list[bool]:
    """For each name, whether it is a BatchNorm statistic whose layer still holds its initial state here."""
    fresh: set[str] = set()
    for bn in _modules.tracking_bn(module):
        if (bn.count is None or int(bn.count) == 0) and not bn.mean.any() and bool((bn.var == 1).all()):
            fresh.update(name for name, _ in bn.entries())
    return [n in fresh for n in names]


def _sync_advice(report: BufferReport) -> str:
    """What to call, given what the differing buffers look like (dtype drift first, then the values)."""
    bad = report.out_of_sync
    retyped = [r for r in bad if r.rank_dtypes]
    first = ""
    if retyped:
        more = f" (and {len(retyped) - 1} more buffers)" if len(retyped) > 1 else ""
        first = (f"'{retyped[0].name}'{more} is held in different dtypes across ranks "
                 f"({_by_dtype(retyped[0], report.ranks)}): a cast, an engine or a meta build in another dtype "
                 "changed it on some ranks. Give it one dtype "
                 "everywhere (module.to(dtype) on those ranks, or zb.keep_precision(model) before the engine casts), "
                 "or take the source's with zero_buffers.broadcast_buffers(module, materialize=True, "
                 "adopt_dtype=True). ")
        if len(retyped) == len(bad):
            return first.rstrip()
    return first + _value_advice(report, [r for r in bad if not r.rank_dtypes])


def _by_dtype(row: BufferRow, ranks: Sequence[int]) -> str:
    """``float32 on ranks 0, 2; bfloat16 on rank 1``."""
    groups: dict[str, list[int]] = {}
    for r in ranks:
        groups.setdefault(row.held_by(r), []).append(r)
    return "; ".join(f"{d} on {'rank' if len(rs) == 1 else 'ranks'} {_ranks(rs)}" for d, rs in groups.items())


def _value_advice(report: BufferReport, bad: Sequence[BufferRow]) -> str:
    """What to call, given what the buffers whose values differ look like: uninitialised ones first (then the
    advice for the others, if any)."""
    empty = [r for r in bad if r.uninitialised_ranks]
    if empty:
        on = sorted({u for r in empty for u in r.uninitialised_ranks})
        loaded = [r for r in report.ranks if r not in on]
        src = report.ranks.index(loaded[0]) if loaded else 0
        more = f" (and {len(empty) - 1} more: {_names(empty[1:])})" if len(empty) > 1 else ""
        text = (f"'{empty[0].name}'{more} looks uninitialised on {'rank' if len(on) == 1 else 'ranks'} "
                f"{_ranks(on)}: never written since it was allocated and holding leftover memory (NaN, subnormal, "
                "huge or all-zero values where the reference has none), as to_empty() leaves buffers that a load "
                "did not carry (non-persistent ones: set_model_state_dict, dcp.load). After the load, take the "
                f"loaded values: zero_buffers.broadcast_buffers(module, materialize=True{_src_arg(src)}).")
        rest = [r for r in bad if not r.uninitialised_ranks]
        return text + (" Other buffers: " + _value_advice(report, rest) if rest else "")
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


def _names(rows: Sequence[BufferRow], limit: int = 3) -> str:
    """``'a', 'b', 'c' ...``: the first ``limit`` names."""
    shown = ", ".join(f"'{r.name}'" for r in rows[:limit])
    return shown + (" ..." if len(rows) > limit else "")


def _src_arg(src: int) -> str:
    return f", src={src}" if src else ""


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
            f"{_render(report, _select(report, True, None, False), None, precision=False)}\n"
            f"Fix: {_sync_advice(report)}", report)
    return report
