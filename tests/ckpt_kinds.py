"""Real checkpoints of every kind the checkpoint doctor reads, written by the real tools on gloo ranks.

``write_all(rank, world, folder)`` runs on every rank of a pool: it trains a small site-shifted BatchNorm
network (each rank's data is a different "site": its own per-channel gain and offset) under DeepSpeed
ZeRO-3, ZeRO-1 and ZeRO-2 and under DDP, and saves it the ways people do:

    zero3/            engine.save_checkpoint (tag "step8"): one model-states file per rank
    zero3_averaged/   the same engine after average_bn_stats: what a fixed run would have saved
    zero1/, zero2/    engine.save_checkpoint under ZeRO-1 / ZeRO-2: one model file, from rank 0
    pt/               torch.save(model.state_dict(), f"rank{r}.pt") on every rank (DDP, broadcast_buffers=False)
    safetensors/      safetensors.torch.save_file(..., f"model-rank{r}.safetensors") on every rank
    accelerate/       Accelerator.save_state (DDP path): rank 0's model only
    dcp/              torch.distributed.checkpoint.save of get_model_state_dict: one copy per key, spread over ranks

It returns each rank's BatchNorm statistics before any fix (ZeRO-3 run, DDP run).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

STEPS = 8
CLASSES = 4


class Tag(nn.Module):
    """Identity with a non-BatchNorm buffer that each rank sets to its own rank (a rank-local counter)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("tag", torch.zeros(2))

    def forward(self, x):
        return x


def site_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm2d(3, momentum=None), nn.Conv2d(3, 8, 3, padding=1, bias=False),
                         nn.BatchNorm2d(8, momentum=None), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, CLASSES), Tag())


def site_batch(site: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images of site ``site``: class prototypes plus noise, then the site's per-channel gain and offset."""
    protos = torch.Generator().manual_seed(12345)
    prototypes = torch.randn(CLASSES, 3, 1, 1, generator=protos)
    g = torch.Generator().manual_seed(1000 * seed + site)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = prototypes[y] + torch.randn(n, 3, 6, 6, generator=g)
    gain = torch.tensor([1.0 + 0.5 * site, 1.0, 1.0 - 0.2 * site]).view(1, 3, 1, 1)
    offset = torch.tensor([3.0 * site, -2.0 * site, 1.5 * site]).view(1, 3, 1, 1)
    return x * gain + offset, y


def accuracy(model: nn.Module, world: int) -> float:
    """Eval-mode accuracy over every site's held-out data, in one process."""
    model.eval()
    hits = total = 0
    with torch.no_grad():
        for site in range(world):
            x, y = site_batch(site, 256, seed=99)
            hits += int((model(x).argmax(1) == y).sum())
            total += len(y)
    return 100.0 * hits / total


def bn_stats(module: nn.Module) -> dict[str, torch.Tensor]:
    suffixes = ("running_mean", "running_var", "num_batches_tracked")
    return {k: v.detach().clone() for k, v in module.state_dict().items() if k.endswith(suffixes)}


def _train(model: nn.Module, step, rank: int) -> None:
    model.train()
    for i in range(STEPS):
        x, y = site_batch(rank, 16, seed=i)
        step(nn.functional.cross_entropy(model(x), y))


def _deepspeed(rank: int, folder: Path, stage: int, averaged: bool) -> dict[str, torch.Tensor]:
    import zero_buffers as zb
    from tests.helpers import init_deepspeed

    deepspeed = init_deepspeed()
    model = site_net()
    model[7].tag.fill_(rank)
    config = {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                                      config=config)

    def step(loss):
        engine.backward(loss)
        engine.step()

    _train(engine, step, rank)
    pre = bn_stats(engine.module)
    engine.save_checkpoint(str(folder / f"zero{stage}"), tag=f"step{STEPS}")
    if averaged:
        zb.average_bn_stats(engine)
        engine.save_checkpoint(str(folder / f"zero{stage}_averaged"), tag=f"step{STEPS}")
    engine.destroy()
    return pre


def _ddp(rank: int, world: int, folder: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = site_net()
    net[7].tag.fill_(rank)
    model = DDP(net, broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, lambda loss: (opt.zero_grad(), loss.backward(), opt.step()), rank)
    pre = bn_stats(net)
    for sub in ("pt", "safetensors"):
        (folder / sub).mkdir(exist_ok=True)
    torch.save(net.state_dict(), folder / "pt" / f"rank{rank}.pt")
    save_file({k: v.contiguous() for k, v in net.state_dict().items()},
              str(folder / "safetensors" / f"model-rank{rank}.safetensors"), metadata={"format": "pt"})
    dcp.save(get_model_state_dict(model), checkpoint_id=str(folder / "dcp"))
    return pre


def _accelerate(rank: int, folder: Path) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    env = dict(os.environ)
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
        net = site_net()
        net[7].tag.fill_(rank)
        model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

        def step(loss):
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()

        _train(model, step, rank)
        accelerator.save_state(str(folder / "accelerate"))
    finally:
        AcceleratorState._reset_state(True)
        os.environ.clear()
        os.environ.update(env)


def write_all(rank: int, world: int, folder: str) -> dict[str, dict[str, torch.Tensor]]:
    """Write every kind under ``folder``; return this rank's statistics before any fix, by run."""
    root = Path(folder)
    out = {"zero3": _deepspeed(rank, root, 3, averaged=True)}
    for stage in (1, 2):
        _deepspeed(rank, root, stage, averaged=False)
    out["ddp"] = _ddp(rank, world, root)
    _accelerate(rank, root)
    return out
