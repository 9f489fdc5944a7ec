"""buffer_report / assert_buffers_in_sync on 2 and 4 real gloo ranks."""
from __future__ import annotations

import math

import pytest
import torch

import zero_buffers as zb
from tests.helpers import Toy, buffers, log_collectives, restore_collectives, same_state, scramble


def _gathers_during(fn):
    """Run ``fn()``; return its result and how many all_gathers it issued."""
    log: list = []
    real = log_collectives(log)
    try:
        result = fn()
    finally:
        restore_collectives(real)
    return result, sum(1 for entry in log if entry[0] == "all_gather")


def _report(rank, world, differ_on, atol=0.0):
    """Identical buffers except: 'codebook' +0.5*rank on ``differ_on`` ranks, 'steps' +rank, bf16 NaN on rank 1."""
    torch.manual_seed(0)
    model = scramble(Toy(), 0)
    with torch.no_grad():
        if rank in differ_on:
            model.codebook[2, 1] += 0.5 * rank
            model.steps += rank
        if rank == 1:
            model.bf16[0] = float("nan")
    return _gathers_during(lambda: zb.buffer_report(model, atol=atol))


def test_report_flags_exactly_the_differing_buffers_identically_on_every_rank(ranks):
    world = ranks.world_size
    differ_on = [r for r in range(1, world) if r != 2]  # rank 2 (when present) agrees with rank 0
    out = ranks.run(_report, differ_on)
    reports = [r for r, _ in out]
    assert all(r == reports[0] for r in reports)  # the same report on every rank
    rows = {row.name: row for row in reports[0].rows}
    assert {n for n, r in rows.items() if not r.in_sync} == {"codebook", "steps", "bf16"}
    assert rows["codebook"].differing_ranks == tuple(differ_on)
    assert rows["codebook"].max_abs_diff == pytest.approx(0.5 * max(differ_on))
    assert rows["steps"].max_abs_diff == max(differ_on) and rows["steps"].dtype == "int64"
    assert rows["bf16"].differing_ranks == (1,) and math.isinf(rows["bf16"].max_abs_diff)
    assert rows["rope"].in_sync and not rows["rope"].persistent and rows["codebook"].persistent
    assert rows["bn.running_mean"].in_sync and rows["bn.running_mean"].max_abs_diff == 0
    assert reports[0].ranks == tuple(range(world)) and not reports[0].in_sync
    # structure digest, content digests, then one gather per differing dtype bucket (float32, int64, bf16)
    assert [n for _, n in out] == [2 + 3] * world


def test_in_sync_model_costs_two_small_collectives(ranks2):
    out = ranks2.run(_report, [])
    reports = [r for r, _ in out if r.in_sync is False]
    assert len(reports) == 2  # only the bf16 NaN on rank 1 differs
    (r0, n0), _ = out
    assert [row.name for row in r0.out_of_sync] == ["bf16"] and n0 == 3


def test_atol_accepts_small_differences(ranks2):
    (report, _), _ = ranks2.run(_report, [1], 0.75)
    rows = {row.name: row for row in report.rows}
    assert rows["codebook"].in_sync and rows["codebook"].max_abs_diff == pytest.approx(0.5)
    assert not rows["steps"].in_sync  # off by 1 > 0.75


def _assert(rank, world):
    model = scramble(Toy(), 0)
    with torch.no_grad():
        model.bn.running_var += rank  # incident 2: each rank's own statistics
    try:
        zb.assert_buffers_in_sync(model)
    except zb.BuffersOutOfSyncError as e:
        first = str(e)
    else:
        first = None
    zb.broadcast_buffers(model)
    return first, zb.assert_buffers_in_sync(model).in_sync


def test_assert_raises_on_every_rank_and_names_the_buffers(ranks):
    out = ranks.run(_assert)
    messages = [m for m, _ in out]
    assert all(m == messages[0] for m in messages) and messages[0] is not None
    assert "1 of 12 buffers differ" in messages[0] and "bn.running_var" in messages[0]
    assert "broadcast_buffers" in messages[0]
    assert all(ok for _, ok in out)  # and passes once synchronised


def _in_sync_report(rank, world):
    model = scramble(Toy(), 0)  # identical on every rank
    report, gathers = _gathers_during(lambda: zb.buffer_report(model))
    return report.in_sync, gathers


def test_agreeing_buffers_cost_one_collective(ranks):
    # structure digest and a digest of all content digests travel together: the common case is one gather
    assert ranks.run(_in_sync_report) == [(True, 1)] * ranks.world_size


def _report_subgroup(rank, world, members):
    """'codebook' differs on every rank; 'steps' differs only between the non-members."""
    import torch.distributed as dist

    group = dist.new_group(members)  # every rank calls new_group; only members then take part
    model = scramble(Toy(), 0)
    with torch.no_grad():
        model.codebook[0, 0] += rank
        model.steps += 7 * (rank not in members) * rank
    before = buffers(model)
    log: list = []
    real = log_collectives(log)
    try:
        report = zb.buffer_report(model, group=group)
        try:
            zb.assert_buffers_in_sync(model, group=group)
            err = None
        except zb.BuffersOutOfSyncError as e:
            err = str(e)
        ok = zb.assert_buffers_in_sync(model, group=group, ignore=("codebook",))  # steps differ outside only
    finally:
        restore_collectives(real)
    return report, err, ok, log, same_state(before, buffers(model))


def test_report_and_assert_on_a_process_group_subset(ranks4):
    members = [1, 3]
    out = ranks4.run(_report_subgroup, members)
    for r in members:
        report, err, ok, log, unchanged = out[r]
        assert report == out[members[0]][0] and err == out[members[0]][1]  # the same on both members
        assert report.checked and report.ranks == (1, 3) and report.reference_rank == 1
        rows = {row.name: row for row in report.rows}
        assert [row.name for row in report.out_of_sync] == ["codebook"]  # not 'steps': it differs outside only
        assert rows["codebook"].differing_ranks == (3,) and rows["codebook"].max_abs_diff == pytest.approx(2.0, abs=1e-5)
        assert err is not None and "1 of 12 buffers differ across ranks [1, 3]" in err and "codebook" in err
        assert ok.in_sync and ok.checked and ok.ranks == (1, 3)
        assert unchanged and log  # members really communicated
    for r in (0, 2):  # not members: no-ops that keep their values and issue no collective
        report, err, ok, log, unchanged = out[r]
        assert not report.checked and report.in_sync and report.ranks == (r,) and err is None and not ok.checked
        assert log == [] and unchanged


def _single_rank_group_assert(rank, world):
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(world)]
    model = scramble(Toy(), rank)  # every buffer differs across ranks
    before = buffers(model)
    log: list = []
    real = log_collectives(log)
    try:
        report = zb.assert_buffers_in_sync(model, group=groups[rank])  # a group of one: nothing to compare
    finally:
        restore_collectives(real)
    return report.checked, report.in_sync, report.ranks, log, same_state(before, buffers(model))


def test_assert_on_a_single_rank_group_is_a_no_op(ranks):
    assert ranks.run(_single_rank_group_assert) == [(False, True, (r,), [], True) for r in range(ranks.world_size)]


def _layouts(rank, world, differ):
    """The same values held as different layouts per rank: conj/neg views, transposes, offsets, large and small."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(128, 128, dtype=torch.complex64, generator=g)  # 128 KiB: hashed in place
    small = torch.randn(4, 4, generator=g)
    m = torch.nn.Module()
    if rank % 2 == 0:
        m.register_buffer("spectrum", big.conj())  # a lazy conjugate view
        m.register_buffer("neg", torch._neg_view(big))  # a lazy negative view
        m.register_buffer("weights", small.t())  # non-contiguous
        m.register_buffer("window", torch.arange(40000.0)[7:30007])  # storage offset, in place
    else:
        m.register_buffer("spectrum", big.conj().resolve_conj())
        m.register_buffer("neg", -big)
        m.register_buffer("weights", small.t().contiguous())
        m.register_buffer("window", torch.arange(7.0, 30007.0))
    if differ and rank == world - 1:
        with torch.no_grad():
            m.window[12345] += 1
    report = zb.buffer_report(m)
    return [(r.name, r.in_sync) for r in report.rows]


@pytest.mark.parametrize("differ", [False, True])
def test_digests_depend_on_values_not_layout(ranks, differ):
    out = ranks.run(_layouts, differ, timeout=60)
    want = [("spectrum", True), ("neg", True), ("weights", True), ("window", not differ)]
    assert out == [want] * ranks.world_size
