"""buffer_report / assert_buffers_in_sync on 2 and 4 real gloo ranks: exactly the differing buffers and ranks, the
same report on every rank, advice by situation, and what it costs.

An in-sync report costs one all_gather of three int64; a differing one moves each differing buffer once (the
reference rank's copy, broadcast in slices of at most ``report.SLICE_BYTES`` cut where the shape alone decides, so
ranks holding it in different layouts issue the same broadcasts), not once per rank; content digests depend on
values, not layout (the on-device fingerprint sees one bit). The memory itself is measured in
``benchmarks/bench.py`` (section "memory"), not asserted here. A property test (hypothesis, tests/strategies.py) draws
random module trees and per-rank differences (signed zeros, NaN payloads, atol) and checks every row."""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from torch import nn

import zero_buffers as zb
from tests.helpers import (
    Toy,
    bitwise_equal,
    bn_net,
    buffers,
    check_table,
    log_collectives,
    logged_call,
    restore_collectives,
    run_table,
    same_state,
    scramble,
)
from tests.strategies import (
    INT_RANGE,
    bounded,
    build_tree,
    clone_all,
    expected_entries,
    gen,
    put_special,
    random_value,
    registered,
    root_of,
    store,
    tree_specs,
)


def _report(rank, world, differ_on, atol=0.0):
    """Identical buffers except: 'codebook' +0.5*rank on ``differ_on`` ranks, 'steps' +rank, bf16 NaN on rank 1."""
    model = scramble(Toy(), 0)
    with torch.no_grad():
        if rank in differ_on:
            model.codebook[2, 1] += 0.5 * rank
            model.steps += rank
        if rank == 1:
            model.bf16[0] = float("nan")
    return logged_call(lambda: zb.buffer_report(model, atol=atol))


def test_report_flags_exactly_the_differing_buffers_identically_on_every_rank(ranks):
    world = ranks.world_size
    differ_on = [r for r in range(1, world) if r != 2]  # rank 2 (when present) agrees with rank 0
    out = ranks.run(_report, differ_on)
    reports = [o["value"] for o in out]
    assert all(r == reports[0] for r in reports)  # the same report on every rank
    rows = {row.name: row for row in reports[0].rows}
    assert {n for n, r in rows.items() if not r.in_sync} == {"codebook", "steps", "bf16"}
    assert rows["codebook"].differing_ranks == tuple(differ_on)
    assert rows["codebook"].max_abs_diff == pytest.approx(0.5 * max(differ_on))
    reference = scramble(Toy(), 0)
    assert rows["codebook"].max_rel_diff == pytest.approx(0.5 * max(differ_on) / float(reference.codebook.abs().max()))
    assert rows["steps"].max_abs_diff == max(differ_on) and rows["steps"].dtype == "int64"
    assert rows["bf16"].differing_ranks == (1,) and math.isinf(rows["bf16"].max_abs_diff)
    assert rows["rope"].in_sync and not rows["rope"].persistent and rows["codebook"].persistent
    assert rows["bn.running_mean"].in_sync and rows["bn.running_mean"].max_abs_diff == 0
    assert all(row.untrained_ranks == () for row in rows.values())  # scrambled statistics are not initial ones
    assert reports[0].ranks == tuple(range(world)) and not reports[0].in_sync and reports[0].training
    # The differing path: the structure + content digest, then one 64-bit digest per buffer (12), their dtypes and
    # degraded-precision flags a byte each (2 words), the declarations' digest and the failed vote, then the
    # reference rank broadcasts only the differing buffers, one dtype bucket at a time (float32
    # codebook, int64 steps, bfloat16), then one all_gather of 4 floats per differing buffer (max |diff|, scale,
    # untrained, uninitialised) + the train/eval flag + the failed vote.
    want = [("all_gather", "torch.int64", 3), ("all_gather", "torch.int64", 16), ("broadcast", "torch.float32", 32),
            ("broadcast", "torch.int64", 1), ("broadcast", "torch.bfloat16", 5), ("all_gather", "torch.float64", 14)]
    assert [o["log"] for o in out] == [want] * world


def _in_sync_report(rank, world):
    model = scramble(Toy(), 0)  # identical on every rank
    return [logged_call(lambda: zb.buffer_report(model)) for _ in range(2)]  # the second one hits the cache


def test_in_sync_report_costs_one_all_gather_of_three_int64(ranks):
    # structure digest, status and a digest of all contents travel together: agreeing ranks stop right there
    for first, second in ranks.run(_in_sync_report):
        for out in (first, second):
            report = out["value"]
            assert out["error"] is None and out["log"] == [("all_gather", "torch.int64", 3)], out["log"]
            assert report.in_sync and report.checked and len(report.rows) == 12
            assert all(row.in_sync and row.max_abs_diff == 0 and row.differing_ranks == () for row in report.rows)
        assert first["value"] == second["value"]


def _situation_model(rank: int, name: str) -> nn.Module:
    model = scramble(Toy(), 0)  # the same everywhere, then each situation makes ranks differ
    with torch.no_grad():
        if name == "atol":
            if rank == 1:
                model.codebook[0, 0] += 0.5
                model.steps += 1
        elif name in ("trained per rank", "eval mode"):
            model.bn.running_var += rank  # incident 2: each rank's own statistics
        elif name == "untrained on rank 0":
            if rank == 0:
                model.bn.reset_running_stats()  # incident 1: only the other ranks loaded the checkpoint
        elif name == "plain buffer":
            model.codebook[1, 1] += rank
    if name == "eval mode":
        model.eval()
    return model


ADVICE = {  # situation -> (flagged buffers, the advice after "Fix: ")
    "atol": (["steps"], r"Take one rank's values with zero_buffers.broadcast_buffers\(module\)"),
    "trained per rank": (["bn.running_var"], r"BatchNorm statistics were updated on each rank's own data: merge them "
                                             r"with zero_buffers.average_bn_stats\(module\) \(exact mixture\), or "
                                             r"recompute them .*zero_buffers.recompute_bn_stats\(module, loader\)"),
    "eval mode": (["bn.running_var"], r"The module is in eval mode \(frozen or loaded\) but its BatchNorm statistics "
                                      r"differ: take one rank's with zero_buffers.broadcast_buffers\(module\)"),
    "untrained on rank 0": (["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"],
                            r"BatchNorm statistics on rank\(s\) \[0\] are still at their initial values \(mean 0, "
                            r"var 1, count 0\).*zero_buffers.broadcast_buffers\(module, src=1\)"),
    "plain buffer": (["codebook"], r"Take one rank's values with zero_buffers.broadcast_buffers\(module\) \(for "
                                   r"statistics that each rank updates, merge them instead\)"),
}


def _situations(rank, world, names):
    def case(name):
        model = _situation_model(rank, name)
        before = buffers(model)
        atol = 0.75 if name == "atol" else 0.0
        report = zb.buffer_report(model, atol=atol)
        out = logged_call(lambda: zb.assert_buffers_in_sync(model, atol=atol))
        out.update(report=report, unchanged=same_state(before, buffers(model)))
        zb.broadcast_buffers(model)  # the simplest fix: afterwards the check passes
        out["fixed"] = zb.assert_buffers_in_sync(model, atol=atol).in_sync
        return out

    return run_table(world, names, case)


def _check_situation(name, res):
    flagged, advice = ADVICE[name]
    world = len(res)
    errors = [r["error"] for r in res]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors  # the same error on every rank
    message = errors[0][1]
    assert errors[0][0] == "BuffersOutOfSyncError" and message.startswith("Toy: buffers out of sync across ranks.")
    assert f"{len(flagged)} of 12 buffers differ across ranks {list(range(world))}" in message, message
    assert all(f"\n{n} " in message for n in flagged), message  # one table line per flagged buffer
    assert re.search(r"\nFix: " + advice, message), message
    report = res[0]["report"]
    assert all(r["report"] == report for r in res) and [row.name for row in report.out_of_sync] == flagged
    rows = {row.name: row for row in report.rows}
    if name == "atol":  # within atol of the reference: in sync, but its difference is still measured
        assert rows["codebook"].in_sync and rows["codebook"].max_abs_diff == pytest.approx(0.5)
        assert rows["steps"].max_abs_diff == 1 and rows["steps"].differing_ranks == (1,)
    if name == "untrained on rank 0":
        assert all(rows[n].untrained_ranks == (0,) and rows[n].differing_ranks == tuple(range(1, world))
                   for n in flagged)
    else:
        assert all(row.untrained_ranks == () for row in report.rows)
    if name in ("trained per rank", "eval mode"):
        var = rows["bn.running_var"]
        assert var.differing_ranks == tuple(range(1, world))
        assert var.max_abs_diff == pytest.approx(world - 1, rel=1e-6)  # float32 sums
        reference = float(scramble(Toy(), 0).bn.running_var.abs().max())
        assert var.max_rel_diff == pytest.approx((world - 1) / reference, rel=1e-6)
    assert report.training == (name != "eval mode")
    assert all(r["unchanged"] and r["fixed"] for r in res)  # the check writes nothing; the fix makes it pass


def test_assert_raises_on_every_rank_names_the_buffers_and_advises_by_situation(ranks):
    names = list(ADVICE)
    check_table(names, ranks.run(_situations, names), _check_situation)


def _report_subgroup(rank, world, members):
    """'codebook' differs on every rank; 'steps' differs only between the non-members."""

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
        assert rows["codebook"].differing_ranks == (3,)
        assert rows["codebook"].max_abs_diff == pytest.approx(2.0, abs=1e-5)
        assert err is not None and "1 of 12 buffers differ across ranks [1, 3]" in err and "codebook" in err
        assert ok.in_sync and ok.checked and ok.ranks == (1, 3)
        assert unchanged and log  # members really communicated
    for r in (0, 2):  # not members: no-ops that keep their values and issue no collective
        report, err, ok, log, unchanged = out[r]
        assert not report.checked and report.in_sync and report.ranks == (r,) and err is None and not ok.checked
        assert log == [] and unchanged


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


def _layout_pair(rank, world):
    return _layouts(rank, world, False), _layouts(rank, world, True)


def test_digests_depend_on_values_not_layout(ranks):
    out = ranks.run(_layout_pair, timeout=60)
    for differ, want_window in ((0, True), (1, False)):  # equal values in other layouts agree; one element differs
        want = [("spectrum", True), ("neg", True), ("weights", True), ("window", want_window)]
        assert [o[differ] for o in out] == [want] * ranks.world_size, differ


def test_the_table_lines_up_for_names_longer_than_forty_characters():
    long = "encoder.layers.11.attention.self.rotary_embedding.inv_freq_table"  # 64 characters
    rows = (zb.BufferRow(long, "float32", (64,), False, False, 0.5, (1, 3), 0.25),
            zb.BufferRow("bn.running_var", "float32", (8,), True, True, 0.0, ()))
    text = zb.BufferReport(rows, (0, 1, 2, 3), 0, 0.0).format()
    header, *lines = text.splitlines()[1:]
    starts = [header.index(title) for title in ("dtype", "shape", "in sync", "differing ranks")]
    for line in lines:
        cells = [line[s:].split()[0] for s in starts]
        assert cells[0] == "float32" and cells[1].startswith("[") and cells[2] in ("yes", "NO"), (line, starts)
    assert lines[0].startswith(long + "  ") and lines[0].endswith("1, 3") and lines[1].endswith("-")


def _many_small_differing(rank, world, n, size):
    """``n`` float32 buffers of ``size`` elements, each differing by (k + 1) * rank in element k % size."""
    model = nn.Module()
    for k in range(n):
        b = torch.arange(size, dtype=torch.float32)
        b[k % size] += (k + 1) * rank
        model.register_buffer(f"b{k}", b)
    return zb.buffer_report(model)


def test_small_differing_buffers_packed_into_one_slice_are_each_measured(ranks):
    # Twenty 64-element buffers travel as one 5 KiB slice though each is 256 bytes: the comparison's scratch holds
    # the packed slice, not just the largest buffer (it was sized by the largest one and the report raised).
    world = ranks.world_size
    reports = ranks.run(_many_small_differing, 20, 64)
    assert all(r == reports[0] for r in reports)
    for k, row in enumerate(reports[0].rows):
        assert row.name == f"b{k}" and not row.in_sync and row.differing_ranks == tuple(range(1, world))
        assert row.max_abs_diff == (k + 1) * (world - 1), row


# ---- costs that need not grow with world size; digests --------------------------------------------------------------
def _report_cost(rank, world, n):
    model = nn.Module()
    model.register_buffer("codebook", torch.full((n,), float(rank)))  # differs on every rank
    model.register_buffer("same", torch.ones(8))
    log: list = []
    real = log_collectives(log)
    try:
        report = zb.buffer_report(model)
    finally:
        restore_collectives(real)
    received = 0
    for entry in log:
        if len(entry) < 3:
            continue
        name, dtype, numel = entry
        size = torch.empty((), dtype=getattr(torch, dtype.split(".")[1])).element_size()
        received += numel * size * (world if name == "all_gather" else 1)
    return received, [(r.name, r.in_sync, r.differing_ranks) for r in report.rows]


@pytest.mark.stack
def test_a_differing_report_moves_the_buffer_once_not_once_per_rank(ranks):
    n = 1 << 18  # a 1 MiB codebook
    out = ranks.run(_report_cost, n, timeout=60)
    world = ranks.world_size
    for received, rows in out:
        assert rows == [("codebook", False, tuple(range(1, world))), ("same", True, ())]
        # the reference broadcast (n floats) plus a few scalars per rank; all-gathering it would be world * n floats
        assert n * 4 <= received < n * 4 + 4096 * world, received


@pytest.mark.stack
def test_device_fingerprint_is_layout_blind_and_sees_one_bit():
    from zero_buffers._core.digest import fingerprint

    x = torch.randn(300, 7, dtype=torch.float64)
    assert fingerprint(x) == fingerprint(x.t().contiguous().t())  # same values, other strides
    assert fingerprint(x.conj()) == fingerprint(x)
    flipped = x.clone()
    flipped.view(torch.int64)[123, 4] ^= 1  # one bit of one element
    assert fingerprint(flipped) != fingerprint(x)
    a, b = torch.zeros(3), torch.zeros(4)  # lengths count, even when the extra bytes are zeros
    assert fingerprint(a) != fingerprint(b)
    big = torch.arange(1 << 17, dtype=torch.int32)  # more than one 2**16-word chunk
    swapped = big.clone()
    swapped[[0, 1 << 16]] = swapped[[1 << 16, 0]]  # the same words, moved between chunks
    assert fingerprint(swapped) != fingerprint(big)


@pytest.mark.stack
@pytest.mark.parametrize("n", [0, 1, 3, 1 << 16])
def test_device_fingerprint_is_deterministic(n):
    from zero_buffers._core.digest import fingerprint

    t = torch.arange(n, dtype=torch.uint8)
    assert fingerprint(t) == fingerprint(t.clone())


def test_a_report_of_hundreds_of_buffers_is_short_unless_asked():
    model = nn.Sequential(*[nn.BatchNorm1d(2) for _ in range(50)])
    report = zb.buffer_report(model)
    short, full = report.format(), report.format(full=True)
    assert len(short.splitlines()) == 3 and "150 buffers in sync not shown" in short and str(report) == short
    assert len(full.splitlines()) == 2 + 150
    small = zb.buffer_report(bn_net())
    assert len(small.format().splitlines()) == 2 + 3  # a small model: every row


def _tree(n_differ: int, rank: int) -> nn.Module:
    """A model of 4 stages x 11 blocks x 4 layers with 3 float buffers each (528), a head (2) and a root 'step':
    531 buffers. Buffer k of a seeded shuffle differs on this rank by rank * (k + 1) / 1000 for k < n_differ, so
    relative differences are distinct and the worst is the last one chosen, wherever the shuffle put it."""
    model = nn.Module()
    model.register_buffer("step", torch.full((1,), 2.0))
    stages = nn.ModuleList()
    for _ in range(4):
        blocks = nn.ModuleList()
        for _ in range(11):
            layers = nn.ModuleList()
            for _ in range(4):
                layer = nn.Module()
                for name in ("mean", "var", "count"):
                    layer.register_buffer(name, torch.full((4,), 2.0))
                layers.append(layer)
            blocks.append(layers)
        stages.append(blocks)
    model.stages = stages
    model.head = nn.Module()
    model.head.register_buffer("codebook", torch.full((4,), 2.0))
    model.head.register_buffer("cluster_size", torch.full((4,), 2.0))
    names = [n for n, _ in model.named_buffers()]
    order = torch.randperm(len(names), generator=torch.Generator().manual_seed(n_differ))
    with torch.no_grad():
        for k, i in enumerate(order[:n_differ].tolist()):
            b = model.get_buffer(names[i])
            b[k % b.numel()] += rank * (k + 1) / 1000
    return model


SIZES = (0, 1, 30, 120, 500)
TOTAL = 531


def _reports_of_many_sizes(rank, world):
    out = {}
    for n in SIZES:
        model = _tree(n, rank)
        report = zb.buffer_report(model)
        try:
            zb.assert_buffers_in_sync(model)
            message = None
        except zb.BuffersOutOfSyncError as e:
            message = str(e)
        out[n] = (report, message)
    return out


def _worst(report):
    return max(report.out_of_sync, key=lambda r: (r.max_rel_diff, r.max_abs_diff))


def test_a_report_stays_under_40_lines_lists_the_worst_and_counts_the_rest(ranks):
    out = ranks.run(_reports_of_many_sizes, timeout=180)
    for n in SIZES:
        report, message = out[0][n]
        assert all(o[n] == (report, message) for o in out), n  # the same report and message on every rank
        assert len(report.rows) == TOTAL and len(report.out_of_sync) == n
        text = str(report)
        lines = text.splitlines()
        assert len(lines) < 40, (n, len(lines), text)
        assert lines[0].startswith(f"{n} of {TOTAL} buffers differ across ranks {list(range(ranks.world_size))}")
        listed = [line.split()[0] for line in lines[2:] if line.split()[0] in {r.name for r in report.rows}]
        bad = {r.name for r in report.out_of_sync}
        in_sync = TOTAL - n
        if n == 0:
            assert len(lines) == 3 and f"({in_sync} buffers in sync not shown; format(full=True)" in lines[-1]
            assert message is None
            continue
        assert lines[0].endswith(f"; differing ranks: {', '.join(map(str, range(1, ranks.world_size)))}")
        assert _worst(report).name in listed, (n, text)  # the worst buffer by relative difference, always
        assert set(listed) <= bad  # in a large model, in-sync rows are counted, not listed
        if n <= 30:  # every differing buffer, in model order, and the in-sync ones counted
            assert listed == [r.name for r in report.out_of_sync]
            assert lines[-1] == f"({in_sync} buffers in sync not shown; format(full=True) shows every row)"
        else:  # the 20 worst, worst first, the other differing buffers by module, every count adding up
            by_rel = sorted(report.out_of_sync, key=lambda r: -r.max_rel_diff)
            assert listed == [r.name for r in by_rel[:20]]
            more = re.fullmatch(r"\(the 20 worst of (\d+) differing buffers listed, (\d+) more by module, (\d+) in "
                                r"sync not shown; format\(full=True\) shows every row\)", lines[-1])
            assert more is not None, lines[-1]
            assert [int(g) for g in more.groups()] == [n, n - 20, in_sync]
            title = next(i for i, line in enumerate(lines) if line.startswith("module "))
            cut = [re.fullmatch(r"\.\.\. and (\d+) more modules, (\d+) differing buffers not listed", line)
                   for line in lines[title + 1:-1] if line.startswith("...")]
            modules = [re.match(r"(\S.*?)  +(\d+) of (\d+)  +(\d+)  ", line) for line in lines[title + 1:-1]
                       if not line.startswith("...")]
            assert all(cut) and all(modules), text
            not_listed = sum(int(m[4]) for m in modules) + sum(int(c[2]) for c in cut)
            assert not_listed == n - 20, (not_listed, text)
            for m in modules:  # "stages.0  30 of 120  25  ..."
                path = m[1]
                inside = [r for r in report.rows if r.name.startswith(path + ".")
                          or (path == "(top level)" and "." not in r.name)]
                assert int(m[2]) == sum(not r.in_sync for r in inside) and int(m[3]) == len(inside), (path, text)
        full = report.format(full=True).splitlines()
        assert len(full) == 2 + TOTAL and [line.split()[0] for line in full[2:]] == [r.name for r in report.rows]
        # assert_buffers_in_sync embeds the short table of the differing buffers: short, naming the worst
        assert message is not None and len(message.splitlines()) < 40, (n, message)
        assert f"\n{_worst(report).name} " in message and f"{n} of {TOTAL} buffers differ across ranks" in message
        assert message.rsplit("\n", 1)[-1].startswith("Fix: ")


def _row(name, rel, in_sync=False):
    return zb.BufferRow(name, "float32", (4,), True, in_sync, 0.0 if in_sync else rel * 2, () if in_sync else (1,),
                        0.0 if in_sync else rel)


def test_the_short_form_sums_up_by_module_at_the_deepest_level_that_fits():
    # 40 leaf modules under one parent: the level that fits (one module) says nothing, so one level deeper, cut
    rows = [_row(f"encoder.layers.{i}.norm.running_var", 0.001 * (i + 1)) for i in range(40)]
    rows += [_row("step", 5.0), _row("head.scale", 0.0, in_sync=True)]
    report = zb.BufferReport(tuple(rows), (0, 1), 0, 0.0)
    pick = zb.report._select(report, False, None, False)
    assert [r.name for r in pick.rows][:2] == ["step", "encoder.layers.39.norm.running_var"]
    assert len(pick.rows) == 20 and pick.differing_hidden == 21
    assert [m.path for m in pick.modules] == [f"encoder.layers.{i}" for i in range(20, 9, -1)]
    assert pick.more_modules == 10 and pick.more_buffers == 10 and pick.in_sync_hidden == 1
    assert sum(m.not_listed for m in pick.modules) + pick.more_buffers + 20 == 41
    text = report.format()
    assert "... and 10 more modules, 10 differing buffers not listed" in text and len(text.splitlines()) < 40
    # a few modules: the deepest level, the model's own buffers as '(top level)'
    rows = [_row(f"a.b{i % 3}.c{i}", 0.01 * (i + 1)) for i in range(40)] + [_row("x", 0.0001), _row("y", 0.0002)]
    pick = zb.report._select(zb.BufferReport(tuple(rows), (0, 1), 0, 0.0), False, None, False)
    assert {m.path for m in pick.modules} == {"a.b0", "a.b1", "a.b2", ""} and pick.more_modules == 0
    assert "(top level)  2 of 2 " in zb.BufferReport(tuple(rows), (0, 1), 0, 0.0).format()
    # limit: that many rows, the worst, the rest by module
    small = zb.BufferReport(tuple(rows[:6]), (0, 1), 0, 0.0)
    lines = small.format(limit=2).splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["a.b2.c5", "a.b1.c4"]
    assert lines[-1] == ("(the 2 worst of 6 differing buffers listed, 4 more by module; format(full=True) shows "
                         "every row)")


# ---- property: buffer_report flags exactly the buffers (and ranks) that differ ------------------------------------
def _report_property_body(rank, world, spec):
    def values(k, b):
        v = random_value(b, gen(spec["seed"], k), INT_RANGE)  # the same on every rank ...
        put_special(v, b["special"], spec["seed"])
        flat = v.view(-1)
        if b["diff_kind"] == "signed_zero" and flat.numel():
            flat[0] = 0.0
        if rank in b["differ"]:  # ... except element 0 on the ranks the spec names
            if v.dtype == torch.bool:
                flat[0] = ~flat[0]
            elif b["diff_kind"] == "signed_zero":
                flat[0] = -0.0
            else:
                flat[0] = flat[0] + (rank + 1)
        return store(b, v)

    model, mods = build_tree(spec, values, rank)
    before = clone_all(registered(spec, mods))
    report = zb.buffer_report(model, atol=spec["atol"], ignore=spec["ignore"])
    try:
        zb.assert_buffers_in_sync(model, atol=spec["atol"], ignore=spec["ignore"])
        raised = None
    except zb.BuffersOutOfSyncError as e:
        raised = (str(e), e.report)
    return report, raised, before, same_after(before, registered(spec, mods))


def same_after(before, after) -> bool:
    return all((before[k] is None and after[k] is None) or bitwise_equal(before[k], after[k]) for k in before)


def _symbol(b: dict, rank: int):
    """What rank ``rank`` holds in buffer ``b``, symbolically (decided by the spec alone)."""
    if rank not in b["differ"]:
        return "base"
    return "flip" if b["dtype"] == "bool" or b["diff_kind"] == "signed_zero" else ("plus", rank)


def _elementwise_max_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| in float64; equal values (NaN with NaN, -0.0 with 0.0, inf with inf) count 0, NaN vs x inf."""
    x, y = a.double().reshape(-1), ref.double().reshape(-1)
    out = 0.0
    for xi, yi in zip(x.tolist(), y.tolist()):
        if xi == yi or (math.isnan(xi) and math.isnan(yi)):
            continue
        d = abs(xi - yi)
        out = max(out, math.inf if math.isnan(d) else d)
    return out


def _check_report_property(spec, out):
    world, atol = len(out), spec["atol"]
    reports = [r for r, _, _, _ in out]
    assert all(r == reports[0] for r in reports)  # identical on every rank
    report = reports[0]
    _, entries = expected_entries(spec)
    assert [row.name for row in report.rows] == [name for name, _ in entries]
    for row, (name, k) in zip(report.rows, entries):
        b = spec["buffers"][root_of(spec, k)]
        reg = spec["buffers"][k]
        assert (row.dtype, row.shape, row.persistent) == (b["dtype"], b["shape"], reg["persistent"]), name
        values = [o[2][root_of(spec, k)] for o in out]
        bitwise_bad = tuple(r for r in range(world) if _symbol(b, r) != _symbol(b, 0))
        assert bitwise_bad == tuple(r for r in range(world) if not bitwise_equal(values[r], values[0])), name
        diffs = [_elementwise_max_diff(v, values[0]) for v in values]
        if not bitwise_bad:
            assert row.in_sync and row.differing_ranks == () and row.max_abs_diff == 0.0, row
            continue
        bad = bitwise_bad if atol == 0 else tuple(r for r in range(world) if not diffs[r] <= atol)
        assert row.differing_ranks == bad and row.in_sync == (not bad), (row, diffs)
        assert row.max_abs_diff == max(diffs), (row, diffs)
    flagged = [row.name for row in report.rows if not row.in_sync]
    for _, raised, _, unchanged in out:
        assert unchanged  # a report never writes
        if flagged:
            assert raised is not None and raised[1] == report
            assert all(f"{name} " in raised[0] for name in flagged), raised[0]
        else:
            assert raised is None


@bounded(25)
@given(spec=tree_specs(2))
def test_report_flags_exactly_the_buffers_that_differ(ranks2, spec):
    _check_report_property(spec, ranks2.run(_report_property_body, spec, timeout=60))


@bounded(6)
@given(spec=tree_specs(4))
def test_report_flags_exactly_the_buffers_that_differ_world4(ranks4, spec):
    _check_report_property(spec, ranks4.run(_report_property_body, spec, timeout=60))


MiB = 2 ** 20


def _model(rank: int, shape: tuple[int, ...]) -> nn.Module:
    """A float32 ``big`` buffer of ``shape``, the same on every rank except one element of the last slice (+0.5 *
    rank), held transposed (strided) on odd ranks; as large a buffer equal everywhere, strided on odd ranks (its
    digest is taken a piece at a time there); a small buffer that differs (+rank) and one that agrees."""
    numel = math.prod(shape)
    values = torch.arange(numel, dtype=torch.float32).reshape(shape) / numel
    values.view(-1)[numel - 3] += 0.5 * rank
    big = values.t().contiguous().t() if rank % 2 else values  # same values, other strides
    m = nn.Module()
    m.register_buffer("big", big)
    agree = torch.arange(numel, dtype=torch.float32).reshape(shape)  # equal values, strided on odd ranks
    m.register_buffer("agree", agree.t().contiguous().t() if rank % 2 else agree)
    m.register_buffer("small", torch.full((6,), float(rank)))
    m.register_buffer("same", torch.ones(3, dtype=torch.int64))
    return m


def _sliced_report(rank, world, shape, slice_bytes):
    from zero_buffers import report as report_mod
    from zero_buffers._core import digest as _digest

    defaults = getattr(report_mod, "SLICE_BYTES", None), getattr(_digest, "_PIECE_BYTES", None)
    report_mod.SLICE_BYTES = _digest._PIECE_BYTES = slice_bytes
    try:
        return logged_call(lambda: zb.buffer_report(_model(rank, shape)))
    finally:
        report_mod.SLICE_BYTES, _digest._PIECE_BYTES = defaults


@pytest.mark.parametrize("shape,slice_kib,slices", [((640, 1024), 1024, [1 << 18, 1 << 18, 1 << 17]),
                                                   ((2, 3 << 17), 512, [1 << 17] * 6)],
                         ids=["rows", "a-row-larger-than-a-slice"])
def test_a_large_differing_buffer_is_compared_in_bounded_slices_exactly(ranks, shape, slice_kib, slices):
    """Slices smaller than the default (4 MiB, a few MiB) keep the test small; the cut is the same at any size."""
    world = ranks.world_size
    out = ranks.run(_sliced_report, shape, slice_kib * 1024, timeout=120)
    logs = [o["log"] for o in out]
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    assert logs == [logs[0]] * world  # the same collectives on every rank, whatever its layout
    broadcasts = [(dtype, n) for name, dtype, n in (e for e in logs[0] if len(e) == 3) if name == "broadcast"]
    # the big buffer in slices of at most slice_kib (cut by shape), then the small differing one in its bucket
    assert broadcasts == [("torch.float32", n) for n in slices] + [("torch.float32", 6)], broadcasts
    assert max(n for _, n in broadcasts) * 4 <= slice_kib * 1024 and sum(slices) == math.prod(shape)
    report = out[0]["value"]
    assert all(o["value"] == report for o in out)
    rows = {r.name: r for r in report.rows}
    numel = math.prod(shape)
    assert rows["big"].differing_ranks == tuple(range(1, world)) and rows["same"].in_sync and rows["agree"].in_sync
    assert rows["big"].max_abs_diff == pytest.approx(0.5 * (world - 1), abs=1e-6)
    assert rows["big"].max_rel_diff == pytest.approx(0.5 * (world - 1) / ((numel - 1) / numel), rel=1e-6)
    assert rows["small"].max_abs_diff == world - 1 and rows["small"].differing_ranks == tuple(range(1, world))
    from zero_buffers import report as report_mod

    assert report_mod.SLICE_BYTES // MiB == 4  # the default: a few MiB


def _outer_buffers_differ(rank, world):
    """float32 buffers of 2, 2.5 and 2 KiB under a 4 KiB slice: only the outer two differ, and they travel packed
    together (4 KiB) though no bucket of all three buffers is larger than 2.5 KiB."""
    from zero_buffers import report as report_mod

    model = nn.Module()
    model.register_buffer("a", torch.full((512,), float(rank)))
    model.register_buffer("same", torch.ones(640))
    model.register_buffer("b", torch.full((512,), 2.0 * rank))
    real = report_mod.SLICE_BYTES
    report_mod.SLICE_BYTES = 4096
    try:
        return zb.buffer_report(model)
    finally:
        report_mod.SLICE_BYTES = real


def test_the_scratch_holds_what_the_differing_buffers_pack_not_what_all_of_them_do(ranks):
    world = ranks.world_size
    reports = ranks.run(_outer_buffers_differ)
    assert all(r == reports[0] for r in reports)
    rows = {row.name: row for row in reports[0].rows}
    assert rows["same"].in_sync and rows["a"].max_abs_diff == world - 1 and rows["b"].max_abs_diff == 2 * (world - 1)
