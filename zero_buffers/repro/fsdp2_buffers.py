"""FSDP2 never syncs buffers: random init, meta init + to_empty, DCP saves, frozen modules; each BUG and its FIX.

fully_shard keeps every buffer a plain per-rank tensor: random initial values differ, meta init + to_empty leaves
garbage or meta buffers, dcp.save writes one rank's diverged BatchNorm statistics, a frozen module is all-gathered
in every forward.

Run: zero-buffers repro fsdp2_buffers --nproc 2   (or: torchrun --nproc-per-node 2 repro/fsdp2_buffers.py)
Quick and full (ZB_FULL=1) are the same run: it is all start-up.
"""
from __future__ import annotations

# _common first: it quiets other libraries' noise before they are imported (ZB_VERBOSE=1 keeps it)
from _common import Table, setup

import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard

import zero_buffers as zb

# Wall seconds under torchrun --nproc-per-node=2 on an idle 2-core machine, about 1.5x measured (the CLI's timeout).
NEEDS = ("fsdp2",)  # [Note: capabilities by presence]: skipped, saying why, where torch lacks it
BUDGET_SECONDS = {"quick": 20, "full": 20}

DEVICE = torch.device("cpu")  # set by main(): CPU with gloo, one GPU per rank with nccl


class Net(nn.Module):
    """Conv + BatchNorm layers, a random projection (persistent) and a rotary-style table (non-persistent)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                                    for c in (3, 8))
        self.head = nn.Linear(8, 4)
        self.register_buffer("projection", torch.randn(8, 8))
        self.register_buffer("table", 1.0 / 500.0 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        feats = x.mean((2, 3)) @ self.projection
        return self.head(feats * torch.cos(self.table).repeat(2))


def sharded(model: nn.Module) -> nn.Module:
    if not any(t.is_meta for t in model.parameters()):
        model.to(DEVICE)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def images(rank: int, n: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(n, 3, 8, 8, generator=g) * (1 + rank) + 2.0 * rank).to(DEVICE)  # each rank its own site


def outputs_differ(model: nn.Module) -> float:
    """Largest difference between any rank's eval output on the same input and rank 0's."""
    model.eval()
    with torch.no_grad():
        out = model(torch.ones(2, 3, 8, 8, device=DEVICE))
    ref = out.clone()
    dist.broadcast(ref, 0)
    diff = torch.tensor([float((out - ref).abs().max())], device=DEVICE)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def on_every_rank(flag: bool) -> bool:
    """True when ``flag`` holds on every rank."""
    t = torch.tensor([int(flag)], device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def differing(model: nn.Module) -> int:
    return len(zb.buffer_report(model).out_of_sync)


def init_rows(table: Table, rank: int) -> None:
    torch.manual_seed(rank)  # every rank builds its own model: no sync_module_states in fully_shard
    model = sharded(Net())
    n, diff = differing(model), outputs_differ(model)
    table.add("BUG", "init: fully_shard keeps each rank's random buffers", [n, diff], n > 0 and diff > 0)
    zb.broadcast_buffers(model)
    n, diff = differing(model), outputs_differ(model)
    table.add("FIX", "broadcast_buffers(model)", [n, diff], n == 0 and diff == 0)


def meta_rows(table: Table, rank: int) -> None:
    torch.manual_seed(0)
    if rank == 0:
        model = Net().to(DEVICE)
        full = model.state_dict()
    else:
        with torch.device("meta"):
            model = Net()
        full = {}
    sharded(model)
    if rank:
        model.to_empty(device=DEVICE)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    ok = on_every_rank(rank == 0 or not torch.equal(model.table, Net().table.to(DEVICE)))
    n = differing(model)
    table.add("BUG", "meta init + to_empty + set_model_state_dict(rank 0)", [n, "garbage table"], ok and n > 0)
    zb.broadcast_buffers(model)
    n, diff = differing(model), outputs_differ(model)
    table.add("FIX", "broadcast_buffers(model)", [n, diff], n == 0 and diff == 0)

    torch.manual_seed(0)
    with torch.device(DEVICE if rank == 0 else "meta"):
        plain = Net()
    on_meta = sum(b.is_meta for b in plain.buffers())
    metas = torch.tensor([on_meta], device=DEVICE)
    dist.all_reduce(metas)
    table.add("BUG", "buffers left on meta (rank 0 real)", [f"{int(metas)} on meta", "no data"], int(metas) > 0)
    zb.broadcast_buffers(plain, materialize=True, include_parameters=True)
    n, diff = differing(plain), outputs_differ(plain)
    table.add("FIX", "broadcast_buffers(materialize=True)", [n, diff],
              n == 0 and diff == 0 and on_every_rank(not any(b.is_meta for b in plain.buffers())))


def dcp_rows(table: Table, rank: int, world: int) -> None:
    folder = [tempfile.mkdtemp(prefix="zb_fsdp2_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(folder, 0)
    torch.manual_seed(0)
    model = sharded(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        model(images(rank, seed=step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    local = [(m.num_batches_tracked.item(), m.running_mean.double().cpu(), m.running_var.double().cpu())
             for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, local)
    merged = [_mixture([g[i] for g in gathered]) for i in range(len(local))]
    dcp.save(get_model_state_dict(model), checkpoint_id=f"{folder[0]}/as_is")
    zb.sync_buffers(model, "average")
    dcp.save(get_model_state_dict(model), checkpoint_id=f"{folder[0]}/synced")
    errors = [_saved_error(f"{folder[0]}/{name}", merged) if rank == 0 else 0.0 for name in ("as_is", "synced")]
    err = torch.tensor(errors, device=DEVICE)
    dist.broadcast(err, 0)
    table.add("BUG", "dcp.save of diverged BN stats (one rank's per entry)", [f"{world} ranks", float(err[0])],
              float(err[0]) > 1e-3)
    table.add("FIX", "sync_buffers(model, 'average') before dcp.save", [f"{world} ranks", float(err[1])],
              float(err[1]) < 1e-5)


def _mixture(stats: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of per-rank (count, mean, var): the count-weighted mean and the law of total variance."""
    w = torch.tensor([float(c) for c, _, _ in stats], dtype=torch.float64)
    w = (w / w.sum())[:, None]
    means, variances = torch.stack([m for _, m, _ in stats]), torch.stack([v for _, _, v in stats])
    mean = (w * means).sum(0)
    return mean, (w * variances).sum(0) + (w * (means - mean) ** 2).sum(0)


def _saved_error(path: str, merged: list) -> float:
    """Largest relative error of the statistics in a DCP folder (loaded in this process alone) against ``merged``."""
    fresh = Net()
    sd = fresh.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=path, no_dist=True)
    fresh.load_state_dict(sd)
    bns = [m for m in fresh.modules() if isinstance(m, nn.BatchNorm2d)]
    return max(float(((t.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max())
               for m, (mean, var) in zip(bns, merged) for t, ref in ((m.running_mean, mean), (m.running_var, var)))


def frozen_rows(table: Table, rank: int) -> None:
    torch.manual_seed(0)
    teacher = sharded(Net())  # frozen, but fully_shard'ed with the model: all-gathers in every forward
    with torch.no_grad():
        for m in teacher.modules():
            if isinstance(m, nn.BatchNorm2d):  # statistics as each rank's data left them
                m.running_mean.copy_(images(rank, 8).mean((0, 2, 3)).repeat(3)[:8])
    gathers, diff = _counted(teacher), outputs_differ(teacher)
    table.add("BUG", "frozen teacher under fully_shard", [f"{gathers} all-gathers/forward", diff],
              gathers > 0 and diff > 0)
    zb.frozen_replica(teacher)
    gathers, diff = _counted(teacher), outputs_differ(teacher)
    table.add("FIX", "frozen_replica(teacher)", [f"{gathers} all-gathers/forward", diff], gathers == 0 and diff == 0)


def _counted(model: nn.Module) -> int:
    """All-gathers issued by one eval forward (FSDP2 calls torch.distributed.all_gather_single on torch 2.13,
    all_gather_into_tensor before)."""
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    real, calls = {n: getattr(dist, n) for n in names}, [0]

    def counting(name: str):
        def call(*args, **kwargs):
            calls[0] += 1
            return real[name](*args, **kwargs)
        return call
    for n in names:
        setattr(dist, n, counting(n))
    try:
        model.eval()
        with torch.no_grad():
            model(torch.ones(1, 3, 8, 8, device=DEVICE))
    finally:
        for n in names:
            setattr(dist, n, real[n])
    return calls[0]


def main() -> None:
    global DEVICE
    rank, world, DEVICE = setup()
    table = Table(f"fsdp2_buffers: {world} ranks, fully_shard on {dist.get_backend()}/{DEVICE.type} "
                  f"(torch {torch.__version__})",
                  ["buffers differing / what", "max diff across ranks (DCP: vs the merge)"])
    init_rows(table, rank)
    meta_rows(table, rank)
    dcp_rows(table, rank, world)
    frozen_rows(table, rank)
    dist.barrier()
    table.finish()


if __name__ == "__main__":
    main()
