"""Section ``memory``: peak extra memory per rank of ``buffer_report`` and ``broadcast_buffers``.

Peak extra memory: a rank's resident set above its level before the call (``harness.peak_extra_bytes``), every
rank's gathered. The section runs in processes of its own whose allocator hands every freed block of 64 KiB or more
back at once (``MEMORY_ENV``, which ``bench.py`` adds to their environment), so the resident set follows the live
tensors.

- (a) ``buffer_report`` of a codebook that differs on every rank against all-gathering it to every rank (what 0.1
  did); the claim: ours stays at one slice plus under 1 MiB of temporaries whatever the size, the all-gather's grows
  as world size times the buffer;
- (a') per rank, the peak over the buffer's size for one 8 MiB differing buffer, contiguous and strided, for
  ``buffer_report`` and the all-gather (the bound docs/benchmarks.md states);
- (b) ``broadcast_buffers`` of buffers the source must pack (transposed views) with the 250 MiB bucket cap, a
  64 MiB cap and no cap: the source stages at most one cap's worth, a receiver holds all it receives until the vote.

Results: section ``memory`` of ``results.json`` / ``results.md`` in the output folder (the runs the docs quote are
in ``benchmarks/results/memory/``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import zero_buffers as zb
from harness import check_equal_to_src, naive_report, peaks_by_rank
from zero_buffers._core import wire as _wire

MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}  # glibc: free hands big blocks back


def bench_memory(ctx: dict) -> list[dict]:
    """Section 7: peak extra memory per rank (its resident set above the level before the call; this section runs in
    processes whose allocator hands every freed block >= 64 KiB back at once, so the resident set follows the live
    tensors). (a) buffer_report of a differing codebook vs all-gathering it; (a') per rank, the peak over the buffer's
    size for an 8 MiB differing buffer, contiguous and strided, for buffer_report and the all-gather; (b)
    broadcast_buffers of buffers the source must pack (transposed views), with the 250 MiB bucket cap, a 64 MiB cap
    and no cap."""
    rows = []
    for mb in ((4,) if ctx["quick"] else (32, 128)):
        model = nn.Module()
        model.register_buffer("codebook", torch.full((mb * 2 ** 18,), float(ctx["rank"])))
        tensors = [model.codebook]
        ours = peaks_by_rank(ctx, lambda: zb.buffer_report(model))
        naive = peaks_by_rank(ctx, lambda: naive_report(tensors))
        rows.append({"what": f"report, {mb} MiB codebook differing", "data_MB": mb,
                     "ours_max_rank_MB": max(ours), "naive_max_rank_MB": max(naive)})
        ctx["log"](f"memory report {mb} MiB: ours {max(ours):.0f} MiB, naive {max(naive):.0f} MiB")
    rows += report_memory_ratios(ctx)
    n, mb = (4, 2) if ctx["quick"] else (12, 32)
    model = nn.Module()
    g = torch.Generator().manual_seed(ctx["rank"])
    for i in range(n):
        model.register_buffer(f"b{i}", torch.rand(512, mb * 512, generator=g).t())
    total = sum(b.numel() * b.element_size() for b in model.buffers()) / 2 ** 20
    for label, cap in (("cap 250 MiB", 250 * 2 ** 20), ("cap 64 MiB", 64 * 2 ** 20), ("no cap", 1 << 62)):
        _wire.BUCKET_BYTES = cap
        try:
            peaks = peaks_by_rank(ctx, lambda: zb.broadcast_buffers(model))
            check_equal_to_src(model)
        finally:
            _wire.BUCKET_BYTES = 250 * 2 ** 20
        rows.append({"what": f"broadcast, {label}", "data_MB": total, "source_MB": peaks[0],
                     "receiver_max_MB": max(peaks[1:])})
        ctx["log"](f"memory broadcast {label}: source {peaks[0]:.0f} MiB, receivers {max(peaks[1:]):.0f} MiB "
                   f"of {total:.0f} MiB")
    return rows


def report_memory_ratios(ctx: dict, mb: int = 8) -> list[dict]:
    """buffer_report of one differing ``mb`` MiB buffer (rank r holds r everywhere), held contiguous and strided
    (same shape, transposed storage): each rank's peak extra memory over the buffer's size, side by side, for
    buffer_report and the all-gather (contiguous only: gloo gathers contiguous tensors). Measured after the
    section's first report, so a process's one-time pages (about 5 MiB on the first call) are not counted."""
    rows = []
    for layout in ("contiguous", "strided"):
        values = torch.full((512, mb * 512), float(ctx["rank"]))
        buf = values if layout == "contiguous" else values.t().contiguous().t()
        del values
        model = nn.Module()
        model.register_buffer("codebook", buf)
        size = buf.numel() * buf.element_size() / 2 ** 20
        methods: dict[str, Callable[[], Any]] = {"zero_buffers.buffer_report": lambda: zb.buffer_report(model)}
        if layout == "contiguous":
            methods["all-gather (0.1)"] = lambda: naive_report([buf])
        if zb.buffer_report(model).rows[0].max_abs_diff != ctx["world"] - 1:
            raise AssertionError("buffer_report missed the differing buffer")
        for method, fn in methods.items():
            peaks = peaks_by_rank(ctx, fn)
            rows.append({"what": f"report, {mb} MiB differing, {layout}", "method": method,
                         **{f"rank{r}_ratio": p / size for r, p in enumerate(peaks)},
                         "max_rank_ratio": max(peaks) / size})
            ctx["log"](f"memory report {mb} MiB {layout}, {method}: "
                       + " / ".join(f"{p / size:.2f}x" for p in peaks))
    return rows

