"""average_bn_stats: exact mixture statistics across 2 and 4 real gloo ranks.

The float64 mixture reference over random layers, dtypes and counts is tests/test_properties.py; single-rank
groups and non-members are in tests/test_structure.py (the no-op table).
"""
from __future__ import annotations

import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import bn_mixture, log_collectives, restore_collectives


def _bn_zoo(dtype=torch.float32):
    return nn.ModuleDict({
        "b1": nn.BatchNorm1d(5), "b2": nn.BatchNorm2d(3), "b3": nn.BatchNorm3d(2), "sync": nn.SyncBatchNorm(4),
        "untracked": nn.BatchNorm1d(3, track_running_stats=False),
    }).to(dtype)


def _set_stats(rank, dtype):
    """Rank-specific running stats and counters; returns (model, per-layer (n, mean, var) in float64)."""
    model = _bn_zoo(dtype)
    g = torch.Generator().manual_seed(rank)
    local = {}
    with torch.no_grad():
        for name, m in model.items():
            if m.running_mean is None:
                continue
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 3 + rank)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) * 2 + 0.1)
            m.num_batches_tracked.fill_(rank + 1 + (name == "b2") * 10)
            local[name] = (int(m.num_batches_tracked), m.running_mean.double().clone(), m.running_var.double().clone())
    return model, local


def _shifted_shards(rank, world, n_samples):
    """Each rank: one forward, momentum=None, over n_samples drawn around a rank-specific mean."""
    torch.manual_seed(1234)
    data = [torch.randn(n_samples, 3) * (1 + r) + 4.0 * r for r in range(world)]  # every rank can rebuild all
    bn = nn.BatchNorm1d(3, momentum=None)
    bn.train()
    with torch.no_grad():
        bn(data[rank])
    naive_var = bn.running_var.clone()
    torch.distributed.all_reduce(naive_var)
    naive_var /= world  # what timm's distribute_bn(reduce=True) computes
    zb.average_bn_stats(bn)
    full = torch.cat(data)
    return bn.running_mean.clone(), bn.running_var.clone(), naive_var, full.mean(0), full.var(0)


def test_shifted_large_shards_exact_where_naive_average_is_far_off(ranks):
    for mean, var, naive, true_mean, true_var in ranks.run(_shifted_shards, 2000):
        torch.testing.assert_close(mean, true_mean, rtol=1e-4, atol=1e-4)
        assert ((var - true_var).abs() / true_var).max() < 0.02
        assert ((naive - true_var).abs() / true_var).min() > 0.4  # naive average ignores the spread of means


def _nothing_tracked(rank, world):
    bn = nn.BatchNorm1d(2)
    with torch.no_grad():
        bn.running_mean.fill_(rank)
    return zb.average_bn_stats(bn), bn.running_mean.clone()


def test_layers_no_rank_updated_are_left_alone(ranks2):
    (n0, m0), (n1, m1) = ranks2.run(_nothing_tracked)
    assert (n0, n1) == (0, 0) and m0.tolist() == [0, 0] and m1.tolist() == [1, 1]


def _average_in(rank, world, members):
    """average_bn_stats over the subgroup ``members``."""
    import torch.distributed as dist

    group = dist.new_group(members)
    model, local = _set_stats(rank, torch.float64)
    log: list = []
    real = log_collectives(log)
    try:
        merged = zb.average_bn_stats(model, group=group)
    finally:
        restore_collectives(real)
    out = {n: (int(m.num_batches_tracked), m.running_mean.clone(), m.running_var.clone())
           for n, m in model.items() if m.running_mean is not None}
    return local, out, merged, log


def _kept_own_stats(local, result) -> bool:
    return all(result[k][0] == local[k][0] and torch.equal(result[k][1], local[k][1])
               and torch.equal(result[k][2], local[k][2]) for k in local)


def test_average_on_a_process_group_subset_merges_members_only(ranks4):
    members = [0, 2]
    out = ranks4.run(_average_in, members)
    member_locals = [out[r][0] for r in members]
    for name in member_locals[0]:
        n, mean, var = bn_mixture(member_locals, name)
        _, world_mean, _ = bn_mixture([o[0] for o in out], name)
        assert not torch.allclose(mean, world_mean)  # the group's mixture is not the world's
        for r in members:
            count, got_mean, got_var = out[r][1][name]
            assert count == int(n.sum())
            torch.testing.assert_close(got_mean, mean, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got_var, var, rtol=1e-12, atol=1e-12)
            assert torch.equal(got_mean, out[0][1][name][1]) and torch.equal(got_var, out[0][1][name][2])
    for r in members:
        assert out[r][2] == 4 and out[r][3]  # merged, with collectives
    for r in (1, 3):  # not members: a no-op that keeps this rank's statistics and issues no collective
        local, result, merged, log = out[r]
        assert merged == 0 and log == [] and _kept_own_stats(local, result)


def _counter_shapes(rank, world):
    a, b = nn.BatchNorm1d(2), nn.BatchNorm1d(2)
    with torch.no_grad():
        for bn in (a, b):
            bn.running_mean.fill_(float(rank))
    a.num_batches_tracked.fill_(rank + 1)
    b.num_batches_tracked = torch.tensor([rank + 1])  # a (1,)-shaped counter, as some code leaves it
    model = nn.ModuleDict({"a": a, "b": b})
    zb.average_bn_stats(model)
    return [(bn.running_mean.clone(), bn.num_batches_tracked.clone()) for bn in (a, b)]


def test_counters_of_shape_one_merge_like_scalar_ones(ranks2):
    for out in ranks2.run(_counter_shapes):
        for mean, count in out:
            torch.testing.assert_close(mean, torch.full((2,), 2 / 3))  # ranks weighted 1 and 2: (0*1 + 1*2) / 3
            assert int(count.sum()) == 3
        assert out[1][1].shape == (1,)
