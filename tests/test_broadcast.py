"""broadcast_buffers on 2 and 4 real gloo ranks."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import Toy, bitwise_equal, buffers, params, same_state, scramble


def _broadcast(rank, world, src, include_parameters=False, ignore=()):
    torch.manual_seed(rank)
    model = scramble(Toy(), rank)
    before_b, before_p = buffers(model), params(model)
    n = zb.broadcast_buffers(model, src=src, include_parameters=include_parameters, ignore=ignore)
    return before_b, before_p, buffers(model), params(model), n


@pytest.mark.parametrize("src_kind", ["first", "last"])
def test_every_buffer_takes_src_values_bit_for_bit(ranks, src_kind):
    src = 0 if src_kind == "first" else ranks.world_size - 1
    out = ranks.run(_broadcast, src)
    src_before = out[src][0]
    assert {"rope", "steps", "bf16", "f16", "mask", "codebook", "bn.running_mean"} <= src_before.keys()
    assert not same_state(out[0][0], out[1][0])  # ranks really started apart
    for rank, (_, before_p, after_b, after_p, n) in enumerate(out):
        assert same_state(after_b, src_before), rank  # bf16, f16, int64, bool, non-persistent: bit for bit
        assert same_state(after_p, before_p)  # parameters untouched by default
        assert n == len(src_before)


def test_include_parameters_syncs_plain_parameters(ranks):
    out = ranks.run(_broadcast, 0, True)
    assert not same_state(out[0][1], out[1][1])
    for _, _, after_b, after_p, n in out:
        assert same_state(after_p, out[0][1]) and same_state(after_b, out[0][0])
        assert n == len(out[0][0]) + len(out[0][1])


def test_ignore_leaves_named_buffers_and_module_paths_alone(ranks):
    out = ranks.run(_broadcast, 0, False, ("codebook", "head"))
    b0, a0 = out[0][0], out[0][2]
    for b, _, a, _, n in out[1:]:
        assert bitwise_equal(a["codebook"], b["codebook"]) and not bitwise_equal(a["codebook"], a0["codebook"])
        assert bitwise_equal(a["head.1.running_mean"], b["head.1.running_mean"])
        assert not bitwise_equal(a["head.1.running_mean"], a0["head.1.running_mean"])
        assert bitwise_equal(a["bn.running_var"], b0["bn.running_var"])
        assert n == len(b0) - 1 - 3


def _count_broadcasts(rank, world):
    import torch.distributed as dist

    calls = []
    real = dist.broadcast

    def counting(tensor, *a, **k):
        calls.append((tensor.dtype, tensor.numel()))
        return real(tensor, *a, **k)

    model = scramble(nn.Sequential(*[nn.BatchNorm1d(3) for _ in range(50)]), rank)
    dist.broadcast = counting
    try:
        zb.broadcast_buffers(model)
    finally:
        dist.broadcast = real
    return calls, buffers(model)


def test_one_collective_per_dtype_bucket_not_per_tensor(ranks):
    out = ranks.run(_count_broadcasts)
    for calls, b in out:
        # 150 buffers in two dtypes (float32 stats, int64 counters) -> exactly two broadcasts, on every rank
        assert sorted(calls, key=str) == sorted([(torch.float32, 50 * 6), (torch.int64, 50)], key=str)
        assert same_state(b, out[0][1])


def _subgroup(rank, world):
    import torch.distributed as dist

    members = [1, world - 1]
    group = dist.new_group(members)
    model = scramble(Toy(), rank)
    before = buffers(model)
    n = zb.broadcast_buffers(model, src=world - 1, group=group)
    return before, buffers(model), n


def test_process_group_subset(ranks4):
    out = ranks4.run(_subgroup)
    src_before = out[3][0]
    assert same_state(out[1][1], src_before) and same_state(out[3][1], src_before)
    for r in (0, 2):  # not members: untouched, and the call was a no-op
        assert same_state(out[r][1], out[r][0]) and out[r][2] == 0
    assert not same_state(out[0][1], src_before)


def test_no_process_group_is_a_no_op(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = scramble(Toy(), 3)
    before = buffers(model)
    assert zb.broadcast_buffers(model) == 0
    assert same_state(buffers(model), before)
    assert zb.average_bn_stats(model) == 0
    report = zb.buffer_report(model)
    assert report.in_sync and not report.checked and len(report.rows) == len(before)
    with pytest.raises(zb.InvalidSourceRankError):
        zb.broadcast_buffers(model, src=1)


def test_world_size_in_env_without_process_group_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(zb.DistributedSetupError, match="WORLD_SIZE=2 is set but torch.distributed has no process"):
        zb.broadcast_buffers(Toy())


def _world1(rank, world):
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(world)]
    model = scramble(Toy(), rank)
    before = buffers(model)
    n = zb.broadcast_buffers(model, src=rank, group=groups[rank])
    return n, same_state(before, buffers(model)), zb.buffer_report(model, group=groups[rank]).checked


def test_single_rank_group_is_a_no_op(ranks2):
    assert ranks2.run(_world1) == [(0, True, False), (0, True, False)]
