"""Section ``keep_in_sync``: the steady-state cost of ``keep_in_sync``, against the floors any sync must pay.

(a) One sync of ResNet-50's BatchNorm buffers (every buffer "broadcast", and with the default rules' "bn" merge)
and of four 1 MB buffers, against one raw broadcast of the same flat bytes, against the copy floor (that broadcast
plus the one-op pack and fused copy-out any sync keeping each buffer in its own memory must add), that floor plus
the vote (one raw all-reduce of 2 x world floats), the transactional ``sync_buffers``, and for the "bn" merge one
raw all-reduce of the float64 sums it moves; the claim: within a small factor of the copy floor plus the vote.
(b) A training step of transformers' ResNet-18 (DDP with ``broadcast_buffers=False``) with and without the sync
before every forward, steps alternating, and the sync alone; the claim: a small share of a step.

Results: section ``keep_in_sync`` of ``results.json`` / ``results.md`` in the output folder (the runs
docs/rules.md quotes are in ``benchmarks/results/keep_in_sync/`` and its ``run2/``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from harness import flat_by_dtype, raw_flat, resnet_bn_net, scrambled, timed_together


class Codebooks(nn.Module):
    """Four large buffers (a VQ codebook's embed, embed_avg, and two more of its size): bytes without tensor count."""

    def __init__(self, size: int = 1024, dim: int = 256):
        super().__init__()
        for name in ("embed", "embed_avg", "embed_ema", "embed_prev"):
            self.register_buffer(name, torch.rand(size, dim))


def copy_floor(tensors: list[torch.Tensor], flats: list[torch.Tensor], src: int) -> Callable[[], None]:
    """The least any sync that keeps the buffers in their own memory must do: the source packs each dtype with one
    torch.cat(out=), one broadcast per dtype, receivers copy out with one fused _foreach_copy_ per dtype."""
    groups = [[t for t in tensors if t.dtype == f.dtype] for f in flats]
    sources = [[t.view(-1) for t in g] for g in groups]
    views = [list(f.split([t.numel() for t in g])) for f, g in zip(flats, groups)]
    targets = [[t.view(-1) for t in g] for g in groups]
    source = dist.get_rank() == src

    def run() -> None:
        with torch.no_grad():
            for f, srcs in zip(flats, sources):
                if source:
                    torch.cat(srcs, out=f)
                dist.broadcast(f, src)
            if not source:
                for dst, v in zip(targets, views):
                    torch._foreach_copy_(dst, v)
    return run


def bench_keep_in_sync(ctx: dict) -> list[dict]:
    """Section 11: keep_in_sync's steady state. (a) One sync of ResNet-50's BatchNorm buffers (159 tensors) and of
    four 1 MB buffers, against one raw broadcast of the same flat bytes (the floor), against the copy floor (the
    same broadcast plus the one-op pack and fused copy-out that any sync keeping each buffer in its own memory must
    add), that floor plus the vote (one raw all-reduce of 2 x world floats, what every plan's check costs), and against
    the transactional sync_buffers, with every buffer "broadcast"; with the default rules ("bn"
    merge) also against one raw all-reduce of the float64 sums the merge moves; (b) a training step of
    transformers' ResNet-18 (batch 32, DDP with broadcast_buffers=False) with and without keep_in_sync before every
    forward, steps alternating."""
    from transformers import ResNetConfig, ResNetModel

    rows = []
    blocks = (1, 1, 1, 1) if ctx["quick"] else (3, 4, 6, 3)
    cases = (("ResNet-50 BatchNorm, every buffer 'broadcast'", lambda: resnet_bn_net(blocks),
              {nn.BatchNorm2d: "broadcast"}),
             ("ResNet-50 BatchNorm, default rules ('bn')", lambda: resnet_bn_net(blocks), None),
             ("4 buffers of 1 MB, 'broadcast'", lambda: Codebooks(64 if ctx["quick"] else 1024), None))
    for label, builder, rules in cases:
        model = scrambled(builder, ctx["rank"], ctx["device"])
        handle = zb.keep_in_sync(model, rules=rules)
        handle.sync()  # the first sync agrees on the structure; the steady state is what follows
        tensors = list(model.buffers())
        flats = flat_by_dtype(tensors)
        vote = torch.zeros(2 * ctx["world"], dtype=torch.float64, device=ctx["device"])  # [failed, changed] per rank
        fns = {"keep_in_sync": handle.sync, "raw_flat_broadcast": lambda: raw_flat(flats, 0),
               "copy_floor": copy_floor(tensors, [f.clone() for f in flats], 0),
               "raw_vote_all_reduce": lambda: dist.all_reduce(vote),
               "sync_buffers": lambda: zb.sync_buffers(model, rules=rules or {})}
        merge = None
        if rules is None and any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):
            bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
            merge = torch.rand(sum(2 + 2 * m.num_features for m in bns), dtype=torch.float64, device=ctx["device"])
            fns = {"keep_in_sync": handle.sync, "raw_flat_broadcast": fns["raw_flat_broadcast"],
                   "raw_merge_all_reduce": lambda: dist.all_reduce(merge), "sync_buffers": fns["sync_buffers"]}
        t = timed_together(fns, ctx["repeats"] * 3, ctx["device"])
        handle.remove()
        row = {"what": f"sync, {label}", "tensors": len(tensors),
               "bytes": sum(f.numel() * f.element_size() for f in flats), **t,
               "steady_over_raw": t["keep_in_sync"] / t["raw_flat_broadcast"]}
        if merge is None:
            row["steady_over_copy_floor"] = t["keep_in_sync"] / t["copy_floor"]
            row["steady_over_copy_floor_and_vote"] = t["keep_in_sync"] / (t["copy_floor"] + t["raw_vote_all_reduce"])
        else:
            row["steady_over_merge_all_reduce"] = t["keep_in_sync"] / t["raw_merge_all_reduce"]
        row["transactional_over_steady"] = t["sync_buffers"] / t["keep_in_sync"]
        rows.append(row)
        ctx["log"](f"keep_in_sync {label}: steady/raw {row['steady_over_raw']:.2f}x, "
                   + (f"steady/copy floor {row['steady_over_copy_floor']:.2f}x, " if merge is None else
                      f"steady/merge all-reduce {row['steady_over_merge_all_reduce']:.2f}x, ")
                   + f"sync_buffers/steady {row['transactional_over_steady']:.2f}x")

    torch.manual_seed(0)
    width = (8, 16, 16, 16) if ctx["quick"] else (64, 128, 256, 512)
    net = ResNetModel(ResNetConfig(num_channels=3, embedding_size=width[0], hidden_sizes=list(width),
                                   depths=[2, 2, 2, 2], layer_type="basic")).to(ctx["device"])
    ddp = nn.parallel.DistributedDataParallel(net, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    batch, size = (4, 32) if ctx["quick"] else (32, 64)
    x = torch.randn(batch, 3, size, size, device=ctx["device"]) + ctx["rank"]

    def step() -> None:
        ddp(pixel_values=x).pooler_output.square().mean().backward()
        opt.step()
        opt.zero_grad()

    handle = zb.keep_in_sync(ddp)  # on DDP's inner module, default rules
    handle.sync()  # the first sync agrees on the structure
    handle.remove()  # the hook is gone; handle.sync() does what it did before every forward

    def plain_step() -> None:
        step()

    def synced_step() -> None:
        handle.sync()
        step()

    t = timed_together({"step": plain_step, "step + keep_in_sync": synced_step}, ctx["repeats"], ctx["device"])
    alone = timed_together({"sync": handle.sync}, ctx["repeats"] * 3, ctx["device"])["sync"]  # the sync it adds
    rows.append({"what": f"ResNet-18 train step, batch {batch}, {size}x{size}", **t,
                 "overhead_pct": 100 * (t["step + keep_in_sync"] / t["step"] - 1), "sync_alone": alone,
                 "sync_share_pct": 100 * alone / t["step"]})
    ctx["log"](f"keep_in_sync train step overhead {rows[-1]['overhead_pct']:.1f}% (the sync alone: "
               f"{rows[-1]['sync_share_pct']:.2f}% of a step)")
    return rows
