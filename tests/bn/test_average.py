"""average_bn_stats: exact mixture statistics across 2 and 4 real gloo ranks.

Shifted shards where the naive average is far off, layers no rank updated, subgroups, counters of shape one; a rank
without BatchNorm still meets its peers in the first collective (and ranks with none agree on nothing to do), and an
average of statistics every rank already shares says so. A property test (hypothesis, tests/strategies.py) checks
random layers, dtypes and counts against the float64 mixture reference. Single-rank groups and non-members are in
tests/core/test_groups.py (the no-op table)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from torch import nn

import zero_buffers as zb
from tests.helpers import (
    bitwise_equal,
    bn_mixture,
    bn_net,
    buffers,
    log_collectives,
    restore_collectives,
    same_state,
)
from tests.strategies import (
    BN_KINDS,
    DTYPES,
    bn_specs,
    bounded,
    gen,
)


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


# ---- every rank reaches the same first collective whatever its module holds ---------------------------------------
def _rank_without_batchnorm(rank, world):
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)) if rank != 1 else nn.Sequential(nn.Linear(3, 3))
    before = buffers(model)
    try:
        zb.average_bn_stats(model)  # timeout=None: before 0.2 rank 1 returned at once and its peers waited forever
    except zb.BufferStructureError as e:
        return str(e), same_state(before, buffers(model))
    return None, same_state(before, buffers(model))


@pytest.mark.stack
def test_a_rank_without_batchnorm_still_meets_its_peers(ranks):
    out = ranks.run(_rank_without_batchnorm, timeout=60)
    assert all(err is not None and err == out[0][0] for err, _ in out), out
    assert "'0.running_mean'" in out[0][0] or "missing on some ranks" in out[0][0]
    assert all(unchanged for _, unchanged in out)


def _no_rank_has_batchnorm(rank, world):
    return zb.average_bn_stats(nn.Linear(2, 2))


@pytest.mark.stack
def test_no_rank_with_batchnorm_agrees_on_nothing_to_do(ranks2):
    assert ranks2.run(_no_rank_has_batchnorm, timeout=60) == [0, 0]


def _average_identical(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(bn_net())  # broadcast_buffers=True: every forward starts from rank 0's buffers
    for _ in range(3):
        model(torch.randn(8, 3) + rank)
    model.eval()
    model(torch.randn(8, 3))  # a distributed eval: rank 0's buffers broadcast, not updated
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        zb.average_bn_stats(model)
    first = [str(w.message) for w in seen if issubclass(w.category, zb.ZeroBuffersWarning)]
    diverged = DDP(bn_net(), broadcast_buffers=False)
    for _ in range(3):
        diverged(torch.randn(8, 3) + rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        zb.average_bn_stats(diverged)
    second = [str(w.message) for w in seen if issubclass(w.category, zb.ZeroBuffersWarning)]
    return first, second


def test_averaging_statistics_every_rank_already_shares_says_so_and_points_to_recompute(ranks):
    for rank, (first, second) in enumerate(ranks.run(_average_identical, timeout=60)):
        if rank == 0:  # said once per job, by the group's first rank
            assert len(first) == 1 and "already held the same BatchNorm statistics" in first[0]
            assert "recompute_bn_stats" in first[0] and "broadcast_buffers=True" in first[0]
        else:
            assert first == [], (rank, first)
        assert second == []  # diverged statistics: a real merge, no warning


# ---- property: average_bn_stats equals a float64 reference computed from all ranks' statistics ------------------
def _average_property_body(rank, world, spec):
    model = nn.Module()
    model.block = nn.Sequential()
    model.register_buffer("codebook", torch.randn(3, generator=gen(spec["seed"], rank)))
    layers = []
    for i, s in enumerate(spec["layers"]):
        m = BN_KINDS[s["kind"]](s["features"], track_running_stats=s["track"]).to(DTYPES[s["dtype"]])
        (model.block if s["nested"] else model).add_module(f"bn{i}", m)
        layers.append(m)
        if not s["track"]:
            continue
        g = gen(spec["seed"], i, rank)
        with torch.no_grad():
            m.running_mean.copy_(torch.randn(s["features"], generator=g, dtype=torch.float64) * 3 + rank)
            m.running_var.copy_(torch.rand(s["features"], generator=g, dtype=torch.float64) * 4 + 0.1)
            m.num_batches_tracked.fill_(s["counts"][rank])
        if not s["counter"]:
            m.num_batches_tracked = None

    def stats():
        return [None if m.running_mean is None else
                (m.running_mean.clone(), m.running_var.clone(),
                 None if m.num_batches_tracked is None else int(m.num_batches_tracked)) for m in layers]

    before, codebook = stats(), model.codebook.clone()
    merged = zb.average_bn_stats(model)
    return before, stats(), merged, bitwise_equal(codebook, model.codebook)


RTOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def _check_average_property(spec, out):
    world = len(out)
    afters = [o[1] for o in out]
    for i, s in enumerate(spec["layers"]):
        if not s["track"]:
            assert all(a[i] is None for a in afters)
            continue
        stats = [o[0][i] for o in out]
        n = [float(s["counts"][r]) if s["counter"] else 1.0 for r in range(world)]
        total = sum(n)
        if total == 0:  # nobody updated this layer: every rank keeps its own statistics
            for r in range(world):
                assert all(bitwise_equal(afters[r][i][j], stats[r][j]) for j in (0, 1)) and afters[r][i][2] == 0
            continue
        for r in range(1, world):  # the same statistics on every rank, bit for bit
            assert bitwise_equal(afters[r][i][0], afters[0][i][0]) and bitwise_equal(afters[r][i][1], afters[0][i][1])
            assert afters[r][i][2] == afters[0][i][2]
        means = [st_[0].double() for st_ in stats]
        varis = [st_[1].double() for st_ in stats]
        mean = sum(n[r] * means[r] for r in range(world)) / total
        var = sum(n[r] * varis[r] for r in range(world)) / total + \
            sum(n[r] * (means[r] - mean) ** 2 for r in range(world)) / total
        dtype = DTYPES[s["dtype"]]
        got_mean, got_var, got_n = afters[0][i]
        assert got_mean.dtype == dtype and got_var.dtype == dtype
        scale = max(float(m.abs().max()) for m in means) + 1
        tol = RTOL[dtype]
        assert torch.allclose(got_mean.double(), mean, rtol=tol, atol=tol * scale), (s, got_mean, mean)
        assert torch.allclose(got_var.double(), var, rtol=tol, atol=tol * scale), (s, got_var, var)
        assert got_n == (int(total) if s["counter"] else None)
    merged = sum(1 for s in spec["layers"] if s["track"] and
                 sum(s["counts"][r] if s["counter"] else 1 for r in range(world)) > 0)
    assert all(o[2] == merged for o in out)
    assert all(o[3] for o in out)  # other buffers untouched


@bounded(25)
@given(spec=bn_specs(2))
def test_average_bn_stats_equals_the_float64_mixture_reference(ranks2, spec):
    _check_average_property(spec, ranks2.run(_average_property_body, spec, timeout=60))


@bounded(6)
@given(spec=bn_specs(4))
def test_average_bn_stats_equals_the_float64_mixture_reference_world4(ranks4, spec):
    _check_average_property(spec, ranks4.run(_average_property_body, spec, timeout=60))
