"""Rules reduce 16-bit floats exactly: ``"mean"`` and ``"sum"`` of float16 / bfloat16 buffers accumulate in float64
and round once into the buffer's dtype, through ``sync_buffers(rules=)`` and ``keep_in_sync`` alike: float16 40000
and 30000 average to 35000, float16 35008 (their float16 sum is inf), bfloat16 255, 255, 256, 255 to 255 (in
bfloat16 the sum rounds to 1024, and 256 comes out). Real gloo ranks at world 2 and 4."""
from __future__ import annotations

import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal

F16 = (40000.0, 30000.0)
BF16 = (255.0, 255.0, 256.0, 255.0)


def _model(rank: int) -> nn.Module:
    model = nn.Module()
    model.register_buffer("h16", torch.full((3,), F16[rank % 2], dtype=torch.float16))
    model.register_buffer("b16", torch.full((3,), BF16[rank % 4], dtype=torch.bfloat16))
    model.register_buffer("count", torch.full((2,), 60000.0 + rank, dtype=torch.float16))
    return model


RULES = {"h16": "mean", "b16": "mean", "count": "sum"}


def _sync_both_ways(rank, world):
    one_shot = _model(rank)
    zb.sync_buffers(one_shot, rules=RULES)
    kept = _model(rank)
    handle = zb.keep_in_sync(kept, rules={"h16": "mean", "b16": "mean", "count": "local"})
    handle.sync()
    handle.remove()
    return {"one_shot": dict(one_shot.named_buffers()), "kept": dict(kept.named_buffers())}


def _expected(world: int, name: str, dtype: torch.dtype) -> torch.Tensor:
    values = F16 if name == "h16" else BF16
    mean = sum(values[r % len(values)] for r in range(world)) / world  # float64
    return torch.full((3,), mean, dtype=torch.float64).to(dtype)


def test_16_bit_means_and_sums_accumulate_in_float64_and_round_once(ranks):
    out = ranks.run(_sync_both_ways, timeout=120)
    world = len(out)
    half, brain = _expected(world, "h16", torch.float16), _expected(world, "b16", torch.bfloat16)
    assert float(half[0]) == 35008.0 and float(brain[0]) == 255.0  # 35000 rounded once: float16 steps by 32 there
    counts = torch.full((2,), sum(60000.0 + r for r in range(world)), dtype=torch.float64).half()  # inf: it is
    for o in out:
        for way in ("one_shot", "kept"):
            assert bitwise_equal(o[way]["h16"], half), (way, o[way]["h16"])
            assert bitwise_equal(o[way]["b16"], brain), (way, o[way]["b16"])
        assert bitwise_equal(o["one_shot"]["count"], counts)  # the float64 sum past float16's range, rounded once
