"""recompute_bn_stats(global_batch=True): every BatchNorm normalises by the batch of all ranks together, and the
statistics written are those of a single process running the same global batches, at every layer.

The reference is computed here, in one process: at step k it concatenates the k-th batch of every rank that has
one, runs the model in train mode (torch's own BatchNorm normalising by that batch) and collects every BatchNorm
layer's input; the population mean and unbiased variance of those inputs are the truth. Shards are uneven and,
at world 4, one is empty.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_buffers as zb
from zero_buffers._core import modules as _modules

STATS = ("running_mean", "running_var")


def tiny_resnet() -> nn.Module:
    """transformers' ResNet (basic blocks, a shortcut with BatchNorm), 6 BatchNorm layers."""
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    return ResNetModel(config)


def counts(world: int) -> list[int]:
    """Batches per rank: uneven; at world 4 rank 3 has none."""
    return [2, 3] if world == 2 else [2, 3, 1, 0]


def shard(rank: int, n: int) -> list[torch.Tensor]:
    """Rank r's images: its own brightness and contrast (a different "site" per rank)."""
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(3 + rank, 3, 16, 16, generator=g) * (1 + 0.5 * rank) + rank for _ in range(n)]


def reference(world: int, make=tiny_resnet) -> dict[str, torch.Tensor]:
    model = make()
    inputs: dict[str, list[torch.Tensor]] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.BatchNorm2d):
            m.register_forward_pre_hook(lambda m, a, name=name: inputs.setdefault(name, []).append(a[0].double()))
    shards = [shard(r, n) for r, n in enumerate(counts(world))]
    model.train()
    with torch.no_grad():
        for k in range(max(counts(world))):
            model(torch.cat([s[k] for s in shards if len(s) > k]))
    out = {}
    for name, xs in inputs.items():
        flat = torch.cat([x.transpose(0, 1).reshape(x.shape[1], -1) for x in xs], 1)
        out[f"{name}.running_mean"], out[f"{name}.running_var"] = flat.mean(1), flat.var(1)
    return out


def stats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith(STATS)}


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest relative error over every BatchNorm layer."""
    return max(float((got[k].double() - v).abs().max() / v.abs().max()) for k, v in want.items())


def _recompute(rank, world, wrap, global_batch):
    model = tiny_resnet()
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        target = DDP(model, broadcast_buffers=False)
    elif wrap == "zero3":
        from tests.helpers import ZERO3_CONFIG, init_deepspeed
        deepspeed = init_deepspeed()
        target, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                          config=ZERO3_CONFIG)
        assert all(hasattr(p, "ds_id") for p in target.module.parameters())
    else:
        target = model
    data = shard(rank, counts(world)[rank])
    written = zb.recompute_bn_stats(target, data, global_batch=global_batch, progress=False, timeout=60)
    got = stats(_modules.unwrap(target, "test"))
    if wrap == "plain":  # the model's own API afterwards: dtype, device, its forward, save_pretrained, pickling
        import pickle
        import tempfile

        from transformers import ResNetModel
        assert model.dtype == torch.float32 and model.device.type == "cpu" and model.training  # mode restored
        with torch.no_grad():
            out = model.eval()(pixel_values=torch.randn(2, 3, 16, 16)).pooler_output  # eval: statistics untouched
        assert out.shape == (2, 16, 1, 1) and torch.isfinite(out).all()
        if rank == 0:  # under a process group transformers 5 writes on rank 0 only
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp)
                reloaded = stats(ResNetModel.from_pretrained(tmp))
            assert all(torch.equal(reloaded[k], v) for k, v in got.items())
        assert all(torch.equal(v, got[k]) for k, v in stats(pickle.loads(pickle.dumps(model))).items())
    return written, got


@pytest.mark.parametrize("wrap", ["plain", "ddp"])
def test_every_layer_matches_one_process_running_the_same_global_batches(ranks, wrap):
    world = ranks.world_size
    truth = reference(world)
    out = ranks.run(_recompute, wrap, True, timeout=120)
    for written, got in out:
        assert written == len(truth) // 2 == 6
        assert worst(got, truth) < 1e-5
        assert all(torch.equal(got[k], out[0][1][k]) for k in got)  # identical on every rank
    plain = ranks.run(_recompute, wrap, False, timeout=120)[0][1]
    assert worst(plain, truth) > 1e-2  # per-rank normalisation: right at the first layer only
    first = [k for k in truth if k.startswith("embedder.")][:2]
    assert worst({k: plain[k] for k in first}, {k: truth[k] for k in first}) < 1e-5


@pytest.mark.stack
def test_zero3_partitioned_model(ranks):
    truth = reference(ranks.world_size)
    for written, got in ranks.run(_recompute, "zero3", True, timeout=180):
        assert written == 6 and worst(got, truth) < 1e-5


def _policy(rank, world):
    model = tiny_resnet()
    zb.sync_buffers(model, "recompute", data=shard(rank, counts(world)[rank]), global_batch=True)
    return stats(model)


def test_the_recompute_policy_takes_global_batch(ranks2):
    truth = reference(2)
    for got in ranks2.run(_policy, timeout=120):
        assert worst(got, truth) < 1e-5


class Skipper(nn.Module):
    """Rank 1 skips its second BatchNorm: the ranks call different layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.BatchNorm1d(3), nn.BatchNorm1d(3), nn.BatchNorm1d(3)

    def forward(self, x):
        import torch.distributed as dist
        x = self.a(x)
        if dist.get_rank() != 1:
            x = self.b(x)
        return self.c(x)


class Breaks(nn.Module):
    """Rank 1's forward raises between two BatchNorm layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.BatchNorm1d(3), nn.BatchNorm1d(3)

    def forward(self, x):
        import torch.distributed as dist
        x = self.a(x)
        if dist.get_rank() == 1:
            raise ValueError("bad batch on rank 1")
        return self.b(x)


def _fails(rank, world, kind):
    torch.manual_seed(0)
    model = {"skip": Skipper, "raise": Breaks}[kind]()
    before = stats(model)
    data = [torch.randn(4, 3) for _ in range(2)]
    with pytest.raises(zb.RecomputeError) as info:
        zb.recompute_bn_stats(model, data, global_batch=True, progress=False, timeout=30)
    return str(info.value), all(torch.equal(v, before[k]) for k, v in stats(model).items())


@pytest.mark.parametrize("kind,message", [("skip", "different BatchNorm layers"), ("raise", "bad batch on rank 1")])
def test_ranks_that_cannot_step_together_raise_the_same_error_everywhere(ranks, kind, message):
    out = ranks.run(_fails, kind, timeout=60)
    assert all(m == out[0][0] for m, _ in out) and message in out[0][0]
    assert all(unchanged for _, unchanged in out)


def first_bn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4))


def _first_bn(rank, world):
    model = first_bn()
    zb.recompute_bn_stats(model, shard(rank, counts(world)[rank]), global_batch=True, progress=False)
    return stats(model)


def test_a_model_whose_first_layer_is_batchnorm_gets_the_statistics_of_all_data_there(ranks):
    world = ranks.world_size
    everything = torch.cat([x for r, n in enumerate(counts(world)) for x in shard(r, n)]).double()
    truth = reference(world, make=first_bn)
    for got in ranks.run(_first_bn, timeout=60):
        torch.testing.assert_close(got["0.running_mean"].double(), everything.mean((0, 2, 3)), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["0.running_var"].double(), everything.transpose(0, 1).reshape(3, -1).var(1),
                                   rtol=1e-5, atol=1e-6)
        assert worst(got, truth) < 1e-5  # and the layer after it, against one process on the same global batches


def test_global_batch_must_be_a_bool():
    with pytest.raises(zb.InvalidArgumentError, match="global_batch"):
        zb.recompute_bn_stats(nn.BatchNorm1d(2), [torch.randn(3, 2)], global_batch="yes")
