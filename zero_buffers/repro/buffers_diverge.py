"""Ranks' BatchNorm statistics diverge on sharded data; buffer_report shows it, broadcast_buffers and average_bn_stats fix it.

Run: zero-buffers repro buffers_diverge --nproc 2   (or: torchrun --nproc-per-node 2 repro/buffers_diverge.py)
Quick and full (ZB_FULL=1) are the same run: it is all start-up.
"""
from __future__ import annotations

# _common first: it quiets other libraries' noise before they are imported (ZB_VERBOSE=1 keeps it)
from _common import Table, setup

import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb

# Wall seconds under torchrun --nproc-per-node=2 on an idle 2-core machine, about 1.5x measured (the CLI's timeout).
BUDGET_SECONDS = {"quick": 15, "full": 15}


def make_model() -> nn.Module:
    torch.manual_seed(0)  # identical parameters on every rank, as after DDP's broadcast
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def shard(rank: int, batches: int = 8, batch: int = 32) -> list[torch.Tensor]:
    """Rank r's data: images whose brightness and contrast depend on the shard (as when data is split by source)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(batch, 3, 16, 16, generator=g) * (1 + 0.5 * rank) + rank for _ in range(batches)]


def population_stats(model: nn.Module, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Exact per-channel mean / variance of every BN layer's input over all ranks' data (float64)."""
    inputs: dict[int, list[torch.Tensor]] = {}
    bns = [m for m in model if isinstance(m, nn.BatchNorm2d)]
    hooks = [m.register_forward_pre_hook(lambda m, a, i=i: inputs.setdefault(i, []).append(a[0].double()))
             for i, m in enumerate(bns)]
    with torch.no_grad():
        model.train()
        for r in range(world):
            for x in shard(r):
                model(x)
    for h in hooks:
        h.remove()
    out = []
    for i in range(len(bns)):
        x = torch.cat(inputs[i]).transpose(0, 1).reshape(bns[i].num_features, -1)
        out.append((x.mean(1), x.var(1)))
    return out


def train_bn(model: nn.Module, rank: int) -> None:
    model.train()
    with torch.no_grad():
        for x in shard(rank):
            model(x)


def rel_error(model: nn.Module, truth) -> float:
    bns = [m for m in model if isinstance(m, nn.BatchNorm2d)]
    return max(float(((m.running_var.double() - v).abs() / v).max()) for m, (_, v) in zip(bns, truth))


def main() -> None:
    rank, world, device = setup()
    table = Table(f"buffers_diverge: {world} ranks, BatchNorm2d stats from sharded data",
                  ["buffers differing", "max cross-rank diff", "var error vs all data"])
    truth = population_stats(make_model(), world)

    model = make_model()
    train_bn(model, rank)
    model.to(device)
    report = zb.buffer_report(model)
    table.add("BUG", "each rank keeps its own BN stats", [f"{len(report.out_of_sync)}/{len(report.rows)}",
              max(r.max_abs_diff for r in report.rows), rel_error(model.cpu(), truth)], not report.in_sync)
    if not report.in_sync:
        table.note("buffer_report of the BUG case (rank 0's view), as zb.buffer_report(model).format() prints it:")
        table.note(report.format(only_out_of_sync=True, limit=6))

    fixed = make_model()
    train_bn(fixed, rank)
    fixed.to(device)
    zb.broadcast_buffers(fixed, src=0)
    report = zb.buffer_report(fixed)
    table.add("FIX", "broadcast_buffers (rank 0's stats)", [f"{len(report.out_of_sync)}/{len(report.rows)}",
              max(r.max_abs_diff for r in report.rows), rel_error(fixed.cpu(), truth)], report.in_sync)

    merged = make_model()
    train_bn(merged, rank)
    merged.to(device)
    zb.average_bn_stats(merged)
    report = zb.buffer_report(merged)
    err = rel_error(merged.cpu(), truth)
    table.add("FIX", "average_bn_stats (exact merge)", [f"{len(report.out_of_sync)}/{len(report.rows)}",
              max(r.max_abs_diff for r in report.rows), err], report.in_sync and err < 0.02)
    dist.barrier()
    table.finish()


if __name__ == "__main__":
    main()
