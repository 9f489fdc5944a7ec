"""Incident 2 on the incident's own model: torchvision's ResNet-34 fine-tuned under Accelerate DDP on 2 gloo ranks.

Each rank trains on its own "site" (rank-shifted images), so every BatchNorm layer's running statistics differ
across ranks; ``accelerator.save_state`` writes rank 0's. The checkpoint must differ from the ranks' merged
statistics (the exact mixture, computed here in float64 from each rank's own statistics) and, once
``zb.sync_buffers_on_save(accelerator, "average")`` is installed, or ``zb.average_bn_stats`` ran before a rank-0
save, hold that mixture. torchvision imports only beside a torch it was built for: on the CI stack with torch
2.14.1 and torchvision 0.29.1 this runs (``.ci/run``, marker ``torch_next``); beside torch 2.13.0+cpu it skips.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.training.test_save_hooks import assert_stats, bn_state, differs, mixture

pytestmark = pytest.mark.torch_next

IMAGE = 32  # small images: the incident's architecture, not its resolution
STEPS = 2


def _torchvision_or_skip():
    try:
        import torchvision
    except Exception as e:  # a torchvision built for another torch fails with RuntimeError / OSError, not ImportError
        pytest.skip(f"torchvision does not import beside torch {torch.__version__}: {type(e).__name__}: {e}")
    return torchvision


def _resnet34() -> nn.Module:
    torchvision = _torchvision_or_skip()
    torch.manual_seed(0)
    return torchvision.models.resnet34(weights=None, num_classes=10)  # random init, no download


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 3, IMAGE, IMAGE, generator=g) * (1 + rank) + 2.0 * rank  # each rank its own site
    return x, torch.randint(0, 10, (4,), generator=g)


def _fine_tune(rank, world, folder):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    env = dict(os.environ)
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True)  # Accelerate's defaults: DDP over the workers' gloo group
        net = _resnet34()
        model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
        kind = type(model).__name__
        model.train()
        for step in range(STEPS):
            x, y = _batch(rank, step)
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        own = bn_state(accelerator.unwrap_model(model).state_dict())
        accelerator.save_state(os.path.join(folder, "default"))  # rank 0's statistics
        hook = zb.sync_buffers_on_save(accelerator, "average")
        accelerator.save_state(os.path.join(folder, "fixed"))
        hook.remove()
        synced = bn_state(accelerator.unwrap_model(model).state_dict())
        return kind, own, synced
    finally:
        AcceleratorState._reset_state(True)
        os.environ.clear()
        os.environ.update(env)


def _average_then_save(rank, world, folder):
    """The hand-written loop: train the plain DDP way, zb.average_bn_stats, torch.save on rank 0."""
    net = _resnet34()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    for step in range(STEPS):
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    own = bn_state(net.state_dict())
    zb.average_bn_stats(model)
    if rank == 0:
        torch.save(net.state_dict(), os.path.join(folder, "averaged.pt"))
    torch.distributed.barrier()
    return own


def _load(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


def _logits(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    model = _resnet34()
    model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    model.eval()
    with torch.no_grad():
        return model(x)


def test_resnet34_under_accelerate_ddp_saves_rank_0_statistics_and_the_average_hook_saves_the_mixture(ranks2,
                                                                                                     tmp_path):
    _torchvision_or_skip()
    out = ranks2.run(_fine_tune, str(tmp_path), timeout=600)
    assert all(o[0] == "DistributedDataParallel" for o in out)
    own = [o[1] for o in out]
    truth = mixture(own)  # float64, from each rank's own statistics
    assert len(truth) == 2 * 36  # running_mean and running_var of ResNet-34's 36 BatchNorm layers
    assert differs(own[0], own[1])  # the ranks saw different sites
    default = _load(tmp_path / "default" / "model.safetensors")
    fixed = _load(tmp_path / "fixed" / "model.safetensors")
    assert_stats(bn_state(default), own[0], tol=0)  # the incident: rank 0's shard statistics, as they were
    assert differs(bn_state(default), truth)
    assert_stats(bn_state(fixed), truth)  # the fix: the ranks' merged statistics
    for o in out:  # and every rank now holds what was written
        assert_stats(o[2], bn_state(fixed), tol=0)
    pooled = torch.cat([_batch(r, s)[0] for r in range(2) for s in range(STEPS)])
    assert not torch.allclose(_logits(default, pooled), _logits(fixed, pooled), atol=1e-4)  # what eval sees


def test_resnet34_statistics_averaged_by_hand_before_a_rank_0_save_are_the_mixture(ranks2, tmp_path):
    _torchvision_or_skip()
    own = ranks2.run(_average_then_save, str(tmp_path), timeout=600)
    truth = mixture(own)
    saved = bn_state(torch.load(tmp_path / "averaged.pt", weights_only=True))
    assert differs(own[0], truth)
    assert_stats(saved, truth)
