"""Section ``bn``: merging and recomputing BatchNorm statistics across ranks.

- merge: ``average_bn_stats`` of a ResNet-101 BatchNorm set whose statistics differ on every rank, against what
  timm's ``distribute_bn(reduce=True)`` does (one all_reduce per running-stat tensor, a naive average); the claim:
  one bucketed merge is many times faster than the per-tensor loop. The time to restore the statistics before each
  call is timed beside them and taken off both.
- recompute: ``recompute_bn_stats`` over a few batches per rank against one plain train-mode pass over the same
  batches: its throughput (samples per second per rank) and its overhead over the pass it replaces.

The recompute modes side by side on a real model are section ``recompute_modes`` (``recompute_modes.py``). Results:
section ``bn`` of ``results.json`` / ``results.md`` in the output folder (default ``benchmarks/results/``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from harness import resnet_bn_net, scrambled, timed_together


def timm_distribute_bn(model: nn.Module, world: int) -> None:
    """timm.utils.distribute_bn(reduce=True): one all_reduce per running stat tensor, naive average."""
    for name, buf in model.named_buffers():
        if "running_mean" in name or "running_var" in name:
            dist.all_reduce(buf)
            buf /= world



def bench_bn(ctx: dict) -> list[dict]:
    """Section 4: average_bn_stats vs a timm-style per-tensor all-reduce loop; recompute_bn_stats throughput."""
    rows = []
    blocks = (1, 1, 1, 1) if ctx["quick"] else (3, 4, 23, 3)
    model = scrambled(lambda: resnet_bn_net(blocks), ctx["rank"], ctx["device"])
    snapshot = [b.clone() for b in model.buffers()]

    def reset() -> None:
        with torch.no_grad():
            for b, s in zip(model.buffers(), snapshot):
                b.copy_(s)

    def ours() -> None:
        reset()
        zb.average_bn_stats(model)

    def timm() -> None:
        reset()
        timm_distribute_bn(model, ctx["world"])

    t = timed_together({"ours": ours, "timm": timm, "reset": reset}, ctx["repeats"], ctx["device"])
    t_ours, t_timm, t_reset = t["ours"], t["timm"], t["reset"]
    rows.append({"what": "merge BN stats (ResNet-101 BN set)" if not ctx["quick"] else "merge BN stats",
                 "zero_buffers.average_bn_stats": t_ours - t_reset, "timm_style_loop": t_timm - t_reset,
                 "speedup": (t_timm - t_reset) / max(t_ours - t_reset, 1e-9)})
    ctx["log"](f"bn merge: timm-loop/ours {rows[-1]['speedup']:.1f}x")

    recompute = getattr(zb, "recompute_bn_stats", None)
    if recompute is not None:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)).to(ctx["device"])
        n_batches = 4 if ctx["quick"] else 16
        data = [torch.randn(32, 3, 32, 32, device=ctx["device"]) for _ in range(n_batches)]

        def single_pass() -> None:
            net.train()
            with torch.no_grad():
                for x in data:
                    net(x)

        t = timed_together({"recompute": lambda: recompute(net, data, progress=False), "one": single_pass},
                           ctx["repeats"], ctx["device"])
        t_rec, t_one = t["recompute"], t["one"]
        samples = n_batches * 32
        rows.append({"what": f"recompute_bn_stats (per rank: {n_batches} batches of 32x3x32x32)",
                     "zero_buffers.recompute_bn_stats": t_rec, "single_process_pass": t_one,
                     "speedup": t_one / t_rec, "samples_per_s_per_rank": samples / t_rec})
        ctx["log"](f"recompute: {samples / t_rec:.0f} samples/s per rank, overhead {t_rec / t_one:.2f}x a plain pass")
    return rows
