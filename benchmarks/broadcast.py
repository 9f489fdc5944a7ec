"""Sections ``broadcast`` and ``scaling``: ``broadcast_buffers`` against the ways people sync buffers without it.

The claim: ``broadcast_buffers`` (a transaction: structure vote, the broadcasts, a second vote, then the writes) is
many times faster than the usual hand fix, one ``dist.broadcast`` per buffer, and stays within a small factor of
what DDP/FSDP use (torch's private ``_broadcast_coalesced``, which checks nothing) and of the floor (the same bytes
already flat, one broadcast per dtype, nothing copied). Every method's result is checked equal to rank 0's.

- ``broadcast``: the buffer sets of real architectures (ResNet-50/101 BatchNorm, a ViT's non-persistent tables,
  ResNet-50 in bf16), four ways;
- ``scaling``: the same three synchronising methods against the number of buffers (10 to 2000); the world-size
  axis comes from running at several world sizes.

One file for both: they time the same methods (defined here) on different buffer sets, and one figure,
``scaling.png`` (time against the number of buffers, and ResNet-50's set against the world size), draws both.
Results: sections ``broadcast`` and ``scaling`` of ``results.json`` / ``results.md``, and ``scaling.png``, in the
output folder (default ``benchmarks/results/``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from harness import buffer_sets, check_equal_to_src, flat_by_dtype, raw_flat, scrambled, timed_together


def many_buffers(n: int) -> nn.Module:
    """``n`` float buffers of 64..1024 elements (the scaling sweep)."""
    m = nn.Module()
    for i in range(n):
        m.register_buffer(f"b{i}", torch.rand(64 * (1 + i % 16)))
    return m


def torch_broadcast_coalesced(tensors: list[torch.Tensor], src: int) -> None:
    """What DDP/FSDP use (private torch API, wrapped here with a public fallback)."""
    fn = getattr(dist, "_broadcast_coalesced", None)
    if fn is not None:
        fn(dist.group.WORLD, tensors, 250 * 1024 * 1024, src)
        return
    for dtype in dict.fromkeys(t.dtype for t in tensors):  # fallback: one flat broadcast per dtype
        ts = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.broadcast(flat, src)
        for t, v in zip(ts, torch._utils._unflatten_dense_tensors(flat, ts)):
            t.copy_(v)


def per_buffer_loop(tensors: list[torch.Tensor], src: int) -> None:
    """The usual hand fix: one dist.broadcast per buffer."""
    for t in tensors:
        dist.broadcast(t, src)


def bench_broadcast(ctx: dict) -> list[dict]:
    """Section 1: buffer broadcast on architectures' buffer sets, four ways."""
    rank, dev, reps = ctx["rank"], ctx["device"], ctx["repeats"]
    rows = []
    for name, builder in buffer_sets(ctx["quick"]).items():
        model = scrambled(builder, rank, dev)
        tensors = [b for b in model.buffers()]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        flats = flat_by_dtype(tensors)
        res = {"set": name, "buffers": len(tensors), "bytes": nbytes}
        methods = {"per_buffer_loop": lambda: per_buffer_loop(tensors, 0),
                   "torch_broadcast_coalesced": lambda: torch_broadcast_coalesced(tensors, 0),
                   "zero_buffers.broadcast_buffers": lambda: zb.broadcast_buffers(model, 0),
                   "raw_flat_broadcast": lambda: raw_flat(flats, 0)}
        for method, fn in methods.items():
            if method != "raw_flat_broadcast":
                fresh = scrambled(builder, rank, dev)  # correctness: each method on rank-specific values
                with torch.no_grad():
                    for t, v in zip(tensors, fresh.buffers()):
                        t.copy_(v)
                fn()
                check_equal_to_src(model)
        res.update(timed_together(methods, reps, dev))
        res["speedup_vs_loop"] = res["per_buffer_loop"] / res["zero_buffers.broadcast_buffers"]
        res["ratio_vs_raw"] = res["zero_buffers.broadcast_buffers"] / res["raw_flat_broadcast"]
        res["ratio_vs_torch_coalesced"] = res["zero_buffers.broadcast_buffers"] / res["torch_broadcast_coalesced"]
        res["MB_per_s_ours"] = nbytes / res["zero_buffers.broadcast_buffers"] / 1e6
        res["MB_per_s_raw"] = nbytes / res["raw_flat_broadcast"] / 1e6
        rows.append(res)
        ctx["log"](f"broadcast {name}: {len(tensors)} buffers, {nbytes / 1e6:.2f} MB, "
                   f"loop/ours {res['speedup_vs_loop']:.1f}x, ours/raw {res['ratio_vs_raw']:.2f}x")
    return rows


def bench_scaling(ctx: dict) -> list[dict]:
    """Section 5: time vs number of buffers, three ways (the world-size axis comes from running at several N)."""
    counts = (10, 50) if ctx["quick"] else (10, 50, 200, 1000, 2000)
    rows = []
    for n in counts:
        model = scrambled(lambda: many_buffers(n), ctx["rank"], ctx["device"])
        tensors = list(model.buffers())
        reps = max(3, ctx["repeats"] // (1 + n // 500))
        rows.append({"buffers": n, **timed_together(
            {"per_buffer_loop": lambda: per_buffer_loop(tensors, 0),
             "torch_broadcast_coalesced": lambda: torch_broadcast_coalesced(tensors, 0),
             "zero_buffers.broadcast_buffers": lambda: zb.broadcast_buffers(model, 0)}, reps, ctx["device"])})
        check_equal_to_src(model)
        ctx["log"](f"scaling {n} buffers done")
    return rows


def plot_scaling(all_results: list[dict], path: Path, plt: Any) -> None:
    """scaling.png: time vs number of buffers per method, one line style per world size."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"per_buffer_loop": "tab:red", "torch_broadcast_coalesced": "tab:blue",
              "zero_buffers.broadcast_buffers": "tab:green"}
    styles = {2: "-o", 4: "--s", 8: ":^"}
    for res in all_results:
        rows = res["results"].get("scaling", [])
        if not rows:
            continue
        xs = [r["buffers"] for r in rows]
        for method, color in colors.items():
            axes[0].plot(xs, [r[method] * 1e3 for r in rows], styles.get(res["world"], "-"), color=color,
                         label=f"{method} (world {res['world']})")
    axes[0].set(xscale="log", yscale="log", xlabel="number of buffers", ylabel="ms per sync (median)",
                title="Buffer broadcast vs number of buffers")
    axes[0].legend(fontsize=7)
    worlds = [r["world"] for r in all_results if r["results"].get("broadcast")]
    for method, color in colors.items():
        ys = [next(r for r in res["results"]["broadcast"] if r["set"].startswith("resnet"))[method] * 1e3
              for res in all_results if res["results"].get("broadcast")]
        if ys:
            axes[1].plot(worlds, ys, "-o", color=color, label=method)
    axes[1].set(xlabel="world size (ranks)", ylabel="ms per sync (median)", yscale="log",
                title="ResNet-50 BN buffers vs world size")
    axes[1].set_xticks(worlds or [2])
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
