"""broadcast_buffers: every rank ends with the source's tensors bit for bit, at the cost of one agreement, one
broadcast per dtype bucket and one received vote, on 2 and 4 real gloo ranks.

Table-driven (one pool task per table, failing cases named): sources, parameters, ignore lists, subgroups, no process
group; buckets cut at the bucket cap. A property test (hypothesis, tests/strategies.py) draws random module trees
(every dtype, 0-dim, empty, non-contiguous, aliased and shared buffers, NaN payloads) and checks every registered
tensor against the source's."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from torch import nn

import zero_buffers as zb
from tests.helpers import (
    Toy,
    bitwise_equal,
    buffers,
    check_table,
    log_collectives,
    logged_call,
    params,
    restore_collectives,
    run_table,
    same_state,
    scramble,
)
from tests.strategies import (
    bounded,
    build_tree,
    clone_all,
    expected_entries,
    gen,
    ignored,
    put_special,
    random_value,
    registered,
    root_of,
    store,
    tree_specs,
)

BROADCASTS = {  # name -> (src as a function of the world size, include_parameters, ignore)
    "src=first": (lambda world: 0, False, ()),
    "src=last": (lambda world: world - 1, False, ()),
    "include_parameters": (lambda world: 0, True, ()),
    "ignore names and module paths": (lambda world: 0, False, ("codebook", "head")),
}


def _broadcasts(rank, world, names):
    def case(name):
        src, include_parameters, ignore = BROADCASTS[name]
        torch.manual_seed(rank)
        model = scramble(Toy(), rank)
        before_b, before_p = buffers(model), params(model)
        n = zb.broadcast_buffers(model, src=src(world), include_parameters=include_parameters, ignore=ignore)
        return before_b, before_p, buffers(model), params(model), n

    return run_table(world, names, case)


def _check_broadcast(name, out):
    src, include_parameters, ignore = BROADCASTS[name]
    src = src(len(out))
    src_b, src_p = out[src][0], out[src][1]
    assert {"rope", "steps", "bf16", "f16", "mask", "codebook", "bn.running_mean"} <= src_b.keys()
    assert not same_state(out[0][0], out[1][0]) and not same_state(out[0][1], out[1][1])  # ranks really started apart
    for rank, (before_b, before_p, after_b, after_p, n) in enumerate(out):
        if not ignore:  # bf16, f16, int64, bool, non-persistent: bit for bit
            assert same_state(after_b, src_b), rank
            assert n == len(src_b) + (len(src_p) if include_parameters else 0), (rank, n)
        else:  # ignored buffers (by name, or everything under a module path) keep this rank's values
            kept = [k for k in after_b if k == "codebook" or k.startswith("head.")]
            assert kept == ["codebook", "head.1.running_mean", "head.1.running_var", "head.1.num_batches_tracked"]
            assert all(bitwise_equal(after_b[k], before_b[k] if k in kept else src_b[k]) for k in after_b), rank
            assert n == len(src_b) - len(kept), (rank, n)
        # parameters untouched by default; with include_parameters=True the source's too
        assert same_state(after_p, src_p if include_parameters else before_p), rank


def test_every_buffer_takes_src_values_bit_for_bit(ranks):
    names = list(BROADCASTS)
    check_table(names, ranks.run(_broadcasts, names), _check_broadcast)


def _costs(rank, world, names):
    import zero_buffers._core.wire as wire

    def case(name):
        model = scramble(nn.Sequential(*[nn.BatchNorm1d(3) for _ in range(50)]), rank)
        cap = wire.BUCKET_BYTES
        if name == "buckets cut at BUCKET_BYTES":
            wire.BUCKET_BYTES = 256  # 21 float32 stats of 3 (252 bytes) or 32 int64 counters per bucket
        try:
            out = logged_call(lambda: zb.broadcast_buffers(model))
        finally:
            wire.BUCKET_BYTES = cap
        out["after"] = buffers(model)
        return out

    return run_table(world, names, case)


COSTS = {  # 150 buffers in two dtypes: float32 statistics (50 x 6 values) and int64 counters (50)
    "one broadcast per dtype bucket": [("broadcast", "torch.float32", 300), ("broadcast", "torch.int64", 50)],
    "buckets cut at BUCKET_BYTES": [("broadcast", "torch.float32", 63)] * 4 + [("broadcast", "torch.float32", 48),
                                    ("broadcast", "torch.int64", 32), ("broadcast", "torch.int64", 18)],
}


def test_costs_one_agreement_one_broadcast_per_dtype_bucket_and_one_received_vote(ranks):
    def check(name, res):
        for r in res:  # the structure agreement, the buckets (not one collective per tensor), the "received" vote
            assert r["error"] is None and r["value"] == 150, r["error"]
            assert r["log"] == [("all_gather", "torch.int64", 3), *COSTS[name], ("all_gather", "torch.int64", 1)], \
                r["log"]
            assert same_state(r["after"], res[0]["after"])

    check_table(list(COSTS), ranks.run(_costs, list(COSTS)), check)


def _subgroup(rank, world):

    group = dist.new_group([1, world - 1])
    model = scramble(Toy(), rank)
    before = buffers(model)
    n = zb.broadcast_buffers(model, src=1, group=group)  # group rank 1: global rank world - 1
    return before, buffers(model), n


def test_process_group_subset(ranks4):
    out = ranks4.run(_subgroup)
    src_before = out[3][0]
    assert same_state(out[1][1], src_before) and same_state(out[3][1], src_before)
    assert not same_state(out[1][0], src_before) and out[1][2] == out[3][2] == len(src_before)
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
    assert same_state(buffers(model), before)
    with pytest.raises(zb.InvalidSourceRankError, match=r"src=1 but torch\.distributed is not initialised"):
        zb.broadcast_buffers(model, src=1)


def _capped_broadcast(rank, world, cap):
    from zero_buffers._core import wire as _wire

    _wire.BUCKET_BYTES = cap
    try:
        torch.manual_seed(rank)
        model = nn.Module()
        for i in range(5):
            model.register_buffer(f"b{i}", torch.randn(16))  # 64 bytes each
        log: list = []
        real = log_collectives(log)
        try:
            zb.broadcast_buffers(model)
        finally:
            restore_collectives(real)
        return sum(1 for e in log if e[0] == "broadcast"), buffers(model)
    finally:
        _wire.BUCKET_BYTES = 250 * 2 ** 20


@pytest.mark.stack
def test_broadcasts_are_cut_at_the_bucket_cap(ranks2):
    out = ranks2.run(_capped_broadcast, 128, timeout=60)  # two 64-byte buffers per bucket: 3 buckets
    assert [n for n, _ in out] == [3, 3]
    assert same_state(out[0][1], out[1][1])
    assert [n for n, _ in ranks2.run(_capped_broadcast, 250 * 2 ** 20, timeout=60)] == [1, 1]


# ---- property: broadcast_buffers makes every rank equal the source bit for bit ------------------------------------
def _broadcast_property_body(rank, world, spec):
    def values(k, b):
        v = random_value(b, gen(spec["seed"], k, rank), 2 ** 62)
        if v.numel() and b["dtype"] != "bool":
            v.view(-1)[0] = rank + 0.5 if v.is_floating_point() else rank  # ranks start apart, always
        put_special(v, b["special"], spec["seed"] + rank)  # NaN payloads differ per rank too
        return store(b, v)

    model, mods = build_tree(spec, values, rank)
    before = clone_all(registered(spec, mods))
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    n = zb.broadcast_buffers(model, src=spec["src"], include_parameters=spec["include_parameters"],
                             ignore=spec["ignore"])
    after = registered(spec, mods)
    aliases_kept = all(after[k] is after[b["of"]] for k, b in enumerate(spec["buffers"]) if b["kind"] == "alias")
    return before, clone_all(after), params_before, {n: p.detach().clone() for n, p in model.named_parameters()}, \
        n, aliases_kept


def _check_broadcast_property(spec, out):
    src = spec["src"]
    qual, entries = expected_entries(spec)
    synced = {root_of(spec, k) for _, k in entries}
    param_names = [n for n in out[0][2] if not ignored(n, spec["ignore"])]
    for rank, (before, after, p_before, p_after, n, aliases_kept) in enumerate(out):
        assert n == len(entries) + (len(param_names) if spec["include_parameters"] else 0), (rank, n)
        assert aliases_kept, rank
        for k, b in enumerate(spec["buffers"]):
            if b["kind"] == "none":
                assert after[k] is None
                continue
            root = root_of(spec, k)
            expect = out[src][0][root] if root in synced else before[root]
            assert bitwise_equal(after[k], expect), (rank, qual[k], b)
            if root in synced and rank != src and b.get("dtype", "bool") != "bool" and after[k].numel():
                assert not bitwise_equal(before[root], expect)  # this rank really started apart
        for name, p in p_after.items():
            take = spec["include_parameters"] and name in param_names
            assert bitwise_equal(p, out[src][2][name] if take else p_before[name]), (rank, name)


@bounded(25)
@given(spec=tree_specs(2))
def test_broadcast_makes_every_rank_equal_the_source_bit_for_bit(ranks2, spec):
    _check_broadcast_property(spec, ranks2.run(_broadcast_property_body, spec, timeout=60))


@bounded(6)
@given(spec=tree_specs(4))
def test_broadcast_makes_every_rank_equal_the_source_bit_for_bit_world4(ranks4, spec):
    _check_broadcast_property(spec, ranks4.run(_broadcast_property_body, spec, timeout=60))
