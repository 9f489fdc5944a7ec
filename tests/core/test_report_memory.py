"""buffer_report sends a large differing buffer's reference in bounded slices and still reports it exactly.

A receiver needs the reference rank's copy to compare with; holding the whole of it at once (plus packed and
contiguous copies of a strided buffer) peaked at several times the buffer's size. The reference now travels in
slices of at most ``report.SLICE_BYTES``, cut where the buffer's shape alone decides, so ranks holding it in
different layouts issue the same broadcasts. Proven on real gloo ranks (world 2 and 4), with every collective
logged: the slices' count and sizes, the same log on every rank, and exact ``max_abs_diff``, ``max_rel_diff``
and ``differing_ranks`` (the difference sits in the last slice). The memory itself is measured in
``benchmarks/bench.py`` (section "memory"), not asserted here.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import logged_call

MiB = 2 ** 20


def _model(rank: int, shape: tuple[int, ...]) -> nn.Module:
    """A float32 ``big`` buffer of ``shape``, the same on every rank except one element of the last slice (+0.5 *
    rank), held transposed (strided) on odd ranks; as large a buffer equal everywhere, strided on odd ranks (its
    digest is taken a piece at a time there); a small buffer that differs (+rank) and one that agrees."""
    numel = math.prod(shape)
    values = torch.arange(numel, dtype=torch.float32).reshape(shape) / numel
    values.view(-1)[numel - 3] += 0.5 * rank
    big = values.t().contiguous().t() if rank % 2 else values  # same values, other strides
    m = nn.Module()
    m.register_buffer("big", big)
    agree = torch.arange(numel, dtype=torch.float32).reshape(shape)  # equal values, strided on odd ranks
    m.register_buffer("agree", agree.t().contiguous().t() if rank % 2 else agree)
    m.register_buffer("small", torch.full((6,), float(rank)))
    m.register_buffer("same", torch.ones(3, dtype=torch.int64))
    return m


def _report(rank, world, shape, slice_bytes):
    from zero_buffers import report as report_mod
    from zero_buffers._core import digest as _digest

    defaults = getattr(report_mod, "SLICE_BYTES", None), getattr(_digest, "_PIECE_BYTES", None)
    report_mod.SLICE_BYTES = _digest._PIECE_BYTES = slice_bytes
    try:
        return logged_call(lambda: zb.buffer_report(_model(rank, shape)))
    finally:
        report_mod.SLICE_BYTES, _digest._PIECE_BYTES = defaults


@pytest.mark.parametrize("shape,slice_kib,slices", [((640, 1024), 1024, [1 << 18, 1 << 18, 1 << 17]),
                                                   ((2, 3 << 17), 512, [1 << 17] * 6)],
                         ids=["rows", "a-row-larger-than-a-slice"])
def test_a_large_differing_buffer_is_compared_in_bounded_slices_exactly(ranks, shape, slice_kib, slices):
    """Slices smaller than the default (4 MiB, a few MiB) keep the test small; the cut is the same at any size."""
    world = ranks.world_size
    out = ranks.run(_report, shape, slice_kib * 1024, timeout=120)
    logs = [o["log"] for o in out]
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    assert logs == [logs[0]] * world  # the same collectives on every rank, whatever its layout
    broadcasts = [(dtype, n) for name, dtype, n in (e for e in logs[0] if len(e) == 3) if name == "broadcast"]
    # the big buffer in slices of at most slice_kib (cut by shape), then the small differing one in its bucket
    assert broadcasts == [("torch.float32", n) for n in slices] + [("torch.float32", 6)], broadcasts
    assert max(n for _, n in broadcasts) * 4 <= slice_kib * 1024 and sum(slices) == math.prod(shape)
    report = out[0]["value"]
    assert all(o["value"] == report for o in out)
    rows = {r.name: r for r in report.rows}
    numel = math.prod(shape)
    assert rows["big"].differing_ranks == tuple(range(1, world)) and rows["same"].in_sync and rows["agree"].in_sync
    assert rows["big"].max_abs_diff == pytest.approx(0.5 * (world - 1), abs=1e-6)
    assert rows["big"].max_rel_diff == pytest.approx(0.5 * (world - 1) / ((numel - 1) / numel), rel=1e-6)
    assert rows["small"].max_abs_diff == world - 1 and rows["small"].differing_ranks == tuple(range(1, world))
    from zero_buffers import report as report_mod

    assert report_mod.SLICE_BYTES // MiB == 4  # the default: a few MiB
