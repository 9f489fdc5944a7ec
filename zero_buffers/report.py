"""buffer_report / assert_buffers_in_sync: which buffers differ across ranks, by how much, and where."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import _dist
from .errors import BuffersOutOfSyncError, InvalidArgumentError


@dataclass(frozen=True)
class BufferRow:
    """One buffer's cross-rank verdict. ``differing_ranks`` are global ranks whose value differs from the reference."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    persistent: bool
    in_sync: bool
    max_abs_diff: float
    differing_ranks: tuple[int, ...]


@dataclass(frozen=True)
class BufferReport:
    """Rows for every buffer, identical on every rank. ``reference_rank`` is the rank others are compared with."""

    rows: tuple[BufferRow, ...]
    ranks: tuple[int, ...]
    reference_rank: int
    atol: float
    checked: bool = field(default=True)

    @property
    def in_sync(self) -> bool:
        return all(r.in_sync for r in self.rows)

    @property
    def out_of_sync(self) -> list[BufferRow]:
        return [r for r in self.rows if not r.in_sync]

    def __str__(self) -> str:
        return self.format()

    def format(self, only_out_of_sync: bool = False, limit: int | None = None) -> str:
        """A plain-text table (``limit`` rows at most)."""
        rows = self.out_of_sync if only_out_of_sync else list(self.rows)
        head = (f"{len(self.out_of_sync)} of {len(self.rows)} buffers differ across ranks {list(self.ranks)} "
                f"(reference rank {self.reference_rank}, atol={self.atol:g})")
        if not self.checked:
            head = f"{len(self.rows)} buffers, not compared: no process group with more than one rank"
        shown = rows if limit is None else rows[:limit]
        lines = [head, f"{'buffer':<40} {'dtype':<9} {'shape':<14} {'in sync':<7} {'max |diff|':>11}  differing ranks"]
        for r in shown:
            lines.append(f"{r.name:<40} {r.dtype:<9} {str(list(r.shape)):<14} {'yes' if r.in_sync else 'NO':<7} "
                         f"{r.max_abs_diff:>11.4g}  {', '.join(map(str, r.differing_ranks)) or '-'}")
        if len(shown) < len(rows):
            lines.append(f"... and {len(rows) - len(shown)} more")
        return "\n".join(lines)


def _max_abs_diff(values: list[torch.Tensor], ref: int) -> list[float]:
    """Per rank, max |x_r - x_ref| in float64; equal values (NaN and NaN, inf and inf) count 0, NaN vs a number inf."""
    base = values[ref].to(torch.float64) if not values[ref].is_complex() else values[ref].to(torch.complex128)
    out = []
    for v in values:
        x = v.to(base.dtype)
        if x.numel() == 0:
            out.append(0.0)
            continue
        diff = (x - base).abs()
        same = (x == base) | (torch.isnan(x) & torch.isnan(base))  # inf - inf is NaN, but inf equals inf
        diff = torch.where(same, torch.zeros_like(diff), torch.nan_to_num(diff, nan=math.inf))
        out.append(float(diff.max()))
    return out


def buffer_report(module: nn.Module, *, group: Any = None, atol: float = 0.0, ignore: Iterable[str] = (),
                  include_parameters: bool = False, timeout: _dist.Timeout = None) -> BufferReport:
    """Compare every buffer of ``module`` across the ranks of ``group``; return the same report on every rank.

    With ``atol == 0`` a buffer is in sync when it is bitwise identical on every rank; with ``atol > 0``
    when every rank is within ``atol`` of the reference rank (the group's first rank; NaN equals NaN).
    Agreement is decided by one all_gather of a 64-bit digest per buffer (after the structure check);
    only buffers whose digests differ are gathered to compute ``max_abs_diff`` and ``differing_ranks``.
    Without a process group (or with world 1) every row is in sync and ``checked`` is False.
    ``timeout`` (seconds or a timedelta) bounds each collective step; past it, or when a peer dies,
    :class:`CollectiveError` is raised.

    Example::

        report = zero_buffers.buffer_report(model)
        if not report.in_sync:
            print(report.format(only_out_of_sync=True))
    """
    return _report("buffer_report", module, group, atol, ignore, include_parameters, timeout)


_IN_SYNC: dict[Any, BufferReport] = {}  # (structure, non-persistent names, ranks) -> the all-agree report (immutable)


def _report(fn: str, module: nn.Module, group: Any, atol: float, ignore: Iterable[str], include_parameters: bool,
            timeout: _dist.Timeout) -> BufferReport:
    """buffer_report's body; ``fn`` names the public function in errors."""
    _dist.check_module(module, fn)
    if not isinstance(atol, (int, float)) or isinstance(atol, bool) or not atol >= 0:
        raise InvalidArgumentError(f"{fn}(): atol must be a number >= 0, got {atol!r}")
    ignore = _dist.check_ignore(ignore, fn)
    timeout = _dist.check_timeout(timeout, fn)
    g = _dist.resolve_group(group)
    entries = _dist.named_buffers(module, ignore=ignore, include_parameters=include_parameters)

    transient = _dist.non_persistent_names(module)

    def row(name: str, t: torch.Tensor, in_sync: bool = True, diff: float = 0.0, ranks: tuple[int, ...] = ()):
        return BufferRow(name, str(t.dtype)[6:], tuple(t.shape), name not in transient, in_sync, diff, ranks)

    if g is None:
        me = 0 if not torch.distributed.is_initialized() else torch.distributed.get_rank()
        return BufferReport(tuple(row(n, t) for n, t in entries), (me,), me, float(atol), checked=False)

    try:  # unsendable tensors cannot be hashed either; the error is raised after the structure agreement
        _dist.reject_unsupported(entries, fn)
        unsendable = None
    except InvalidArgumentError as e:
        unsendable = e
    tensors = [t for _, t in entries]
    # one collective decides the common case: the structure digest travels with a digest of all buffer bytes
    key = _dist.structure_key(("buffer_report", float(atol), include_parameters), entries)
    combined = _dist.agree_on_structure(g, key[0], entries, timeout, fn, key=key,
                                        extra=0 if unsendable else _dist.combined_digest(tensors))
    if unsendable is not None:
        raise unsendable  # structure agreed (it includes device, layout, dtype): every rank raises this
    _dist.check_backend_devices(g, entries, fn)
    if all(c == combined[0] for c in combined):  # all agree: the rows depend on the structure alone
        cache_key = (key, frozenset(transient), g.ranks)
        report = _IN_SYNC.get(cache_key)
        if report is None:
            if len(_IN_SYNC) > 64:
                _IN_SYNC.clear()
            report = _IN_SYNC[cache_key] = BufferReport(tuple(row(n, t) for n, t in entries), g.ranks, g.ranks[0],
                                                        float(atol))
        return report
    # only now per-buffer digests, then the values of those that differ
    mine = _dist.content_digests(tensors).to(g.device)
    digests = torch.stack([d.cpu() for d in _dist.all_gather_tensor(g, mine, timeout, fn)])
    differ: list[int] = (digests != digests[0]).any(0).nonzero().flatten().tolist()

    rows = {i: row(n, t) for i, (n, t) in enumerate(entries)}
    if differ:
        gathered = _dist.all_gather_coalesced(g, [entries[i][1].detach() for i in differ], timeout, fn)
        for i, values in zip(differ, gathered):
            diffs = _max_abs_diff([v.cpu() for v in values], 0)
            if atol == 0:
                bad = tuple(r for j, r in enumerate(g.ranks) if digests[j, i] != digests[0, i])
            else:
                bad = tuple(r for r, d in zip(g.ranks, diffs) if not d <= atol)
            name, t = entries[i]
            rows[i] = row(name, t, not bad, max(diffs), bad)
    return BufferReport(tuple(rows[i] for i in range(len(entries))), g.ranks, g.ranks[0], float(atol))


def assert_buffers_in_sync(module: nn.Module, *, group: Any = None, atol: float = 0.0, ignore: Iterable[str] = (),
                           include_parameters: bool = False, timeout: _dist.Timeout = None) -> BufferReport:
    """Raise :class:`BuffersOutOfSyncError` on every rank if any buffer differs across ranks; else return the report.

    The message lists each offending buffer with its max abs difference and the ranks that differ.

    Example::

        zero_buffers.assert_buffers_in_sync(model)   # before torch.save(model.state_dict()) on rank 0
    """
    report = _report("assert_buffers_in_sync", module, group, atol, ignore, include_parameters, timeout)
    if not report.in_sync:
        raise BuffersOutOfSyncError(
            f"{type(module).__name__}: buffers out of sync across ranks.\n{report.format(only_out_of_sync=True, limit=50)}"
            "\nFix: zero_buffers.broadcast_buffers(module) to take one rank's values, or "
            "zero_buffers.average_bn_stats(module) to merge BatchNorm statistics.",
            report)
    return report
