"""Incident 2 scaled down: a DDP checkpoint carries rank 0's BatchNorm statistics; each fix closes the accuracy gap.

Run: zero-buffers repro ddp_bn_checkpoint --nproc 2   (or: torchrun --nproc-per-node 2 repro/ddp_bn_checkpoint.py)

A small ResNet-style CNN whose first layer is an input BatchNorm2d is trained with Accelerate (DDP)
to tell the orientation of noisy stripe images. Each image has three colour planes and a fourth
plane holding the camera's exposure value (constant over the image). The data is sharded by camera
and the cameras were set up differently: camera r's exposure is around 6 r. Labels never depend on
it. DDP runs with broadcast_buffers=False, as in the incident: every rank's running statistics come
from its own shard only.

The distributed eval during training (each rank scores its own shard's held-out images with its own
statistics) looks perfect. The checkpoint written the default way holds rank 0's statistics, so in
one process, on the union of the shards, the other cameras' exposure plane is normalised tens of
standard deviations off and many points are lost. The statistics of all ranks' data keep every
camera within the range the network saw in training, so each fix must land within 0.5 points of the
distributed eval: SyncBatchNorm (needs CUDA tensors: n/a on gloo/CPU), average_bn_stats,
recompute_bn_stats, sync_buffers_on_save(accelerator, ...) and, for plain torch, sync_buffers before
torch.save on rank 0. With DDP's default broadcast_buffers=True every rank would end with nearly
rank 0's statistics (DDP copies them before each forward), so the distributed eval would be just as
wrong there: only recompute_bn_stats recovers that case.
"""
from __future__ import annotations

import math
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zero_buffers as zb
from _common import Table, setup

EXPOSURE, EXPOSURE_SPREAD = 6.0, 0.15  # camera r's exposure plane: 6 r + N(0, 0.15^2) per image
STEPS, BATCH, EVAL_PER_SHARD, RECOMPUTE_BATCHES = 80, 32, 500, 10
CLEAR_GAP, CLOSED = 5.0, 0.5  # points


class Block(nn.Module):
    """Basic residual block: conv-BN-ReLU-conv-BN plus a (projected) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.skip(x))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         Block(16, 16, 1), Block(16, 32, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))


def images(n: int, shard: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` 16x16 stripe images of 4 orientations (the label): 3 colour planes and the camera's exposure plane."""
    y = torch.randint(0, 4, (n,), generator=g)
    theta = y.float() * math.pi / 4 + (torch.rand(n, generator=g) - 0.5) * 0.3
    freq = 0.6 + 0.5 * torch.rand(n, generator=g)
    phase = torch.rand(n, generator=g) * 2 * math.pi
    ii, jj = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    proj = ii * torch.cos(theta)[:, None, None] + jj * torch.sin(theta)[:, None, None]
    stripes = torch.sin(freq[:, None, None] * proj + phase[:, None, None])
    rgb = stripes[:, None].expand(n, 3, 16, 16) + 0.5 * torch.randn(n, 3, 16, 16, generator=g)
    exposure = EXPOSURE * shard + EXPOSURE_SPREAD * torch.randn(n, 1, 1, 1, generator=g)
    return torch.cat([rgb, exposure.expand(n, 1, 16, 16)], 1), y


def batches(shard: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed * 1000 + shard)
    return [images(BATCH, shard, g) for _ in range(n)]


def eval_set(shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    return images(EVAL_PER_SHARD, shard, torch.Generator().manual_seed(999_000 + shard))


def correct(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> int:
    """Number of right answers in eval mode (running statistics)."""
    was = model.training
    model.eval()
    with torch.no_grad():
        hits = sum(int((model(xb.to(device)).argmax(1).cpu() == yb).sum())
                   for xb, yb in zip(x.split(250), y.split(250)))
    model.train(was)
    return hits


def distributed_eval(model: nn.Module, rank: int, world: int, device: torch.device) -> float:
    """Each rank scores its own shard's held-out images with its own statistics; accuracy over all of them."""
    x, y = eval_set(rank)
    hits = torch.tensor([correct(model, x, y, device)], dtype=torch.float64, device=device)
    dist.all_reduce(hits)
    return 100.0 * float(hits) / (EVAL_PER_SHARD * world)


def one_process_accuracy(state: dict[str, torch.Tensor] | None, world: int, device: torch.device) -> float:
    """Rank 0 loads the saved weights into a fresh model and scores the union of all shards; every rank gets it."""
    result = torch.zeros(1, dtype=torch.float64, device=device)
    if dist.get_rank() == 0:
        model = make_model()
        model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
        xs, ys = zip(*(eval_set(r) for r in range(world)))
        result += 100.0 * correct(model, torch.cat(xs), torch.cat(ys), torch.device("cpu")) / (EVAL_PER_SHARD * world)
    dist.broadcast(result, 0)
    return float(result)


def load_saved(folder: str) -> dict[str, torch.Tensor] | None:
    """The weights ``accelerator.save_state`` wrote (rank 0 reads them)."""
    if dist.get_rank() != 0:
        return None
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "model.safetensors"))


def train(accelerator, model: nn.Module, opt, rank: int, world: int, device: torch.device, log: bool) -> float:
    """STEPS steps on this rank's shard; prints the distributed eval along the way and returns the last one."""
    model.train()
    acc = 0.0
    for step, (x, y) in enumerate(batches(rank, STEPS, seed=1), 1):
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        if step % 20 == 0:
            acc = distributed_eval(accelerator.unwrap_model(model), rank, world, device)
            if log and rank == 0:
                print(f"step {step:3d}  loss {loss.item():.3f}  distributed eval accuracy {acc:5.1f} %", flush=True)
    return acc


def main() -> None:
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*deprecated", category=FutureWarning)
    rank, world, device = setup()
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    accelerator = Accelerator(cpu=device.type == "cpu",
                              kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    model = make_model()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    inner = accelerator.unwrap_model(model)
    dist_acc = train(accelerator, model, opt, rank, world, device, log=True)

    table = Table(f"ddp_bn_checkpoint: {world} ranks, Accelerate DDP on {dist.get_backend()}, "
                  f"{EVAL_PER_SHARD * world} eval images (union of the shards)",
                  ["accuracy %", "gap to distributed eval"])
    table.add("REF", "distributed eval during training (own shard, own stats)", [f"{dist_acc:.1f}", "-"],
              dist_acc >= 90)
    trained = {k: v.clone() for k, v in inner.state_dict().items()}

    def fresh() -> None:
        """Back to the trained, per-rank statistics before each fix."""
        inner.load_state_dict(trained)

    def row(kind: str, case: str, acc: float) -> None:
        gap = dist_acc - acc
        ok = gap >= CLEAR_GAP if kind == "BUG" else gap <= CLOSED
        table.add(kind, case, [f"{acc:.1f}", f"{gap:+.1f}"], ok)

    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared, 0)  # one folder for all ranks (rank 0 writes)
        out = lambda name: os.path.join(shared[0], name)  # noqa: E731

        accelerator.save_state(out("default"))
        row("BUG", "accelerator.save_state, default (rank 0's BN stats)",
            one_process_accuracy(load_saved(out("default")), world, device))

        if dist.get_backend() == "nccl":
            sync_model = nn.SyncBatchNorm.convert_sync_batchnorm(make_model())
            sync_model, sync_opt = accelerator.prepare(sync_model, torch.optim.SGD(sync_model.parameters(), lr=0.05,
                                                                                   momentum=0.9))
            sync_ref = train(accelerator, sync_model, sync_opt, rank, world, device, log=False)
            state = accelerator.unwrap_model(sync_model).state_dict()
            state = {k: v.cpu() for k, v in state.items()}
            acc = one_process_accuracy(state if rank == 0 else None, world, device)
            table.add("FIX", "SyncBatchNorm during training", [f"{acc:.1f}", f"{sync_ref - acc:+.1f}"],
                      sync_ref - acc <= CLOSED)
        else:
            table.add("FIX", "SyncBatchNorm during training", ["n/a on gloo", "(needs CUDA tensors)"], None)

        fresh()
        zb.average_bn_stats(model)
        accelerator.save_state(out("average"))
        row("FIX", "average_bn_stats, then save_state", one_process_accuracy(load_saved(out("average")), world, device))

        fresh()
        own = [x for x, _ in batches(rank, RECOMPUTE_BATCHES, seed=2)]
        zb.recompute_bn_stats(model, own, device=device, progress=False)
        accelerator.save_state(out("recompute"))
        row("FIX", "recompute_bn_stats, then save_state",
            one_process_accuracy(load_saved(out("recompute")), world, device))

        fresh()
        with zb.sync_buffers_on_save(accelerator, "average"):
            accelerator.save_state(out("hooked"))
        row("FIX", "sync_buffers_on_save(accelerator, 'average')",
            one_process_accuracy(load_saved(out("hooked")), world, device))

        fresh()
        zb.sync_buffers(model, "recompute", data=own, device=device)
        state = {k: v.cpu() for k, v in inner.state_dict().items()} if rank == 0 else None
        if rank == 0:
            torch.save(state, out("plain.pt"))
            state = torch.load(out("plain.pt"))
        row("FIX", "sync_buffers(model, 'recompute') + torch.save",
            one_process_accuracy(state, world, device))
        dist.barrier()
    table.finish()


if __name__ == "__main__":
    main()
