"""A VQ EMA codebook on data sharded by source: rank 0's copy loses the others' updates; "mean" rules are exact.

vector-quantize-pytorch's VectorQuantize: without a sync every rank learns its own codebook; broadcasting rank 0's
every step throws the others' updates away; "mean" rules on its EMA statistics every step (keep_in_sync) equal a
codebook whose statistics are mean-all-reduced before each update.

Run: zero-buffers repro ema_codebook --nproc 2   (or: torchrun --nproc-per-node 2 repro/ema_codebook.py)
Quick and full (ZB_FULL=1) are the same run: its 30 steps are a second of its wall time, the rest is start-up.
"""
from __future__ import annotations

# _common first: it quiets other libraries' noise before they are imported (ZB_VERBOSE=1 keeps it)
from _common import Table, setup

import torch
import torch.distributed as dist
from vector_quantize_pytorch import VectorQuantize
from vector_quantize_pytorch.vector_quantize_pytorch import Codebook

import zero_buffers as zb

# Wall seconds under torchrun --nproc-per-node=2 on an idle 2-core machine, about 1.5x measured (the CLI's timeout).
NEEDS = ("vector_quantize",)  # zero-buffers repro skips it, saying why, where it is not installed (_compat/versions.py)
BUDGET_SECONDS = {"quick": 20, "full": 20}
DIM, CODES, STEPS = 8, 32, 30
# The recipe for this library's EMA codebook: its EMA statistics average exactly; ``embed`` is derived from them in
# every forward, so it is left alone and recomputed from the synced statistics (the library's own update_ema); the
# bool ``initted`` is "any rank" (kmeans init is off here, so it is True everywhere).
VQ_RULES = {"cluster_size": "mean", "embed_avg": "mean", "embed": "local", "initted": "max"}


def vq(device: torch.device, sync: bool = False) -> VectorQuantize:
    torch.manual_seed(0)  # the same initial codebook on every rank
    return VectorQuantize(dim=DIM, codebook_size=CODES, decay=0.9, sync_codebook=sync, kmeans_init=False,
                          threshold_ema_dead_code=0).to(device)


def centres(world: int) -> torch.Tensor:
    """Four clusters per rank: each rank's data comes from its own sources."""
    return torch.randn(4 * world, DIM, generator=torch.Generator().manual_seed(7)) * 3


def batch(rank: int, world: int, step: int, device: torch.device, n: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    mine = centres(world)[4 * rank:4 * rank + 4]
    x = mine[torch.randint(0, 4, (n,), generator=g)] + 0.3 * torch.randn(n, DIM, generator=g)
    return x.view(1, n, DIM).to(device)


def evaluate(model: VectorQuantize, world: int, device: torch.device) -> tuple[float, float]:
    """(reconstruction MSE, fraction of codes used) on held-out data from every rank's sources."""
    model.eval()
    x = torch.cat([batch(r, world, 10_000, device, 256) for r in range(world)], dim=1)
    with torch.no_grad():
        quantized, indices, _ = model(x)
    model.train()
    return float((quantized - x).square().mean()), indices.unique().numel() / CODES


def spread(model: VectorQuantize) -> float:
    """Largest difference between any rank's codebook and rank 0's."""
    embed = model._codebook.embed.detach().clone()
    ref = embed.clone()
    dist.broadcast(ref, 0)
    diff = torch.tensor([float((embed - ref).abs().max())], device=embed.device)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def main() -> None:
    rank, world, device = setup()
    zb.register_rules(Codebook, VQ_RULES, after_sync=lambda codebook: codebook.update_ema())
    alone, broadcast, ours, reference = vq(device), vq(device), vq(device), vq(device, sync=True)

    def mean_all_reduce(t: torch.Tensor) -> None:  # what an implementation that averages its statistics does
        dist.all_reduce(t)
        t /= world
    reference._codebook.all_reduce_fn = mean_all_reduce
    handle = zb.keep_in_sync(ours._codebook)  # the registered rules, before every train-mode forward
    for step in range(STEPS):
        x = batch(rank, world, step, device)
        for model in (alone, broadcast, ours, reference):
            model(x)
        zb.sync_buffers(broadcast, rules={Codebook: "broadcast"})  # rank 0's codebook everywhere
    handle.sync()  # the last step's statistics too
    handle.remove()
    ref_mse, ref_used = evaluate(reference, world, device)
    table = Table(f"ema_codebook: {world} ranks, VectorQuantize(codebook_size={CODES}, decay=0.9), {STEPS} steps, "
                  "data sharded by source", ["codebook spread", "recon MSE (all sources)", "codes used",
                                             "max |embed - REF|"])
    for kind, case, model in (("BUG", "no sync: each rank its own codebook (rank 0 scored)", alone),
                              ("BUG", "broadcast rank 0's codebook every step", broadcast),
                              ("FIX", "keep_in_sync: 'mean' rules on the EMA statistics", ours)):
        mse, used = evaluate(model, world, device)
        diff = float((model._codebook.embed - reference._codebook.embed).abs().max())
        ok = spread(model) == 0 and diff < 1e-4 if kind == "FIX" else diff > 1e-3
        table.add(kind, case, [spread(model), mse, f"{used:.0%}", diff], ok)
    table.add("REF", "statistics mean-all-reduced before each EMA update", [spread(reference), ref_mse,
              f"{ref_used:.0%}", 0.0], None)
    table.finish()


if __name__ == "__main__":
    main()
