"""Sections ``check`` and ``report_diff``: what ``buffer_report`` costs, when the buffers agree and when they differ.

- ``check``: ``buffer_report`` of buffers identical on every rank (one all_gather of a few int64 digests) against
  one ``broadcast_buffers`` of the same buffer sets; the claim: checking costs no more than syncing.
- ``report_diff``: ``buffer_report`` of a large codebook that differs on every rank (per-buffer digests find it, the
  reference travels a slice at a time, each rank compares as it arrives) against all-gathering it to every rank and
  comparing there (what 0.1 did); the claim: it is no slower per call. The memory of the two is section ``memory``.

One file for both: they measure the same function, ``buffer_report``, on its two paths. Results: sections ``check``
and ``report_diff`` of ``results.json`` / ``results.md`` in the output folder (default ``benchmarks/results/``;
the runs the docs quote for ``report_diff`` are in ``benchmarks/results/report_diff/``).
"""
from __future__ import annotations

import torch
from torch import nn

import zero_buffers as zb
from harness import buffer_sets, naive_report, timed_together


def bench_check(ctx: dict) -> list[dict]:
    """Section 2: buffer_report when everything agrees, against one broadcast of the same buffers."""
    rows = []
    for name, builder in buffer_sets(ctx["quick"]).items():
        torch.manual_seed(0)
        model = builder().to(ctx["device"])  # identical on every rank
        report = zb.buffer_report(model)
        if not report.in_sync:
            raise AssertionError(f"{name}: identical buffers reported out of sync")
        t = timed_together({"report": lambda: zb.buffer_report(model), "bcast": lambda: zb.broadcast_buffers(model)},
                           ctx["repeats"], ctx["device"])
        t_report, t_bcast = t["report"], t["bcast"]
        rows.append({"set": name, "buffer_report": t_report, "broadcast_buffers": t_bcast,
                     "report_over_broadcast": t_report / t_bcast})
        ctx["log"](f"check {name}: report/broadcast {t_report / t_bcast:.2f}")
    return rows


def bench_report_diff(ctx: dict) -> list[dict]:
    """Section 6: buffer_report when a large buffer differs on every rank, against all-gathering it to every rank
    (what 0.1 did): time per call. The memory of the two is in section "memory"."""
    rows = []
    for mb in ((1, 4) if ctx["quick"] else (4, 32, 128)):
        model = nn.Module()
        model.register_buffer("codebook", torch.full((mb * 2 ** 18,), float(ctx["rank"]), device=ctx["device"]))
        report = zb.buffer_report(model)
        if report.in_sync or report.rows[0].max_abs_diff != ctx["world"] - 1:
            raise AssertionError("buffer_report missed the differing codebook")
        tensors = [model.codebook]
        t = timed_together({"zero_buffers.buffer_report": lambda: zb.buffer_report(model),
                            "naive_all_gather": lambda: naive_report(tensors)}, max(3, ctx["repeats"] // 3),
                           ctx["device"])
        rows.append({"buffer_MB": mb, **t,
                     "ours_over_naive": t["zero_buffers.buffer_report"] / t["naive_all_gather"]})
        ctx["log"](f"report_diff {mb} MB: ours/naive {rows[-1]['ours_over_naive']:.2f}x")
    return rows
