"""The group a call runs over ([Note: rank convention]): rank arguments count within it, and ranks outside it (or
alone in it, or without a process group at all) do nothing.

Structure faults are in tests/core/test_structure_agreement.py, bad arguments in tests/core/test_bad_input.py.
Table-driven, at world 4 with the subgroup of global ranks [1, 3]: one pool task per table, every collective
logged, every failing case named."""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal, bn_net, check_table, logged_call, run_table, scramble

MEMBERS = (1, 3)  # the subgroup: group rank 0 is global rank 1, group rank 1 is global rank 3


def _model(rank: int) -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model.register_buffer("codebook", torch.zeros(4))
    scramble(model, rank)  # every buffer and weight differs across ranks
    with torch.no_grad():
        model[1].num_batches_tracked.fill_(rank + 1)
    return model


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)


def _gathered(model, modifier_rank, group, scale=1.0):
    with zb.GatheredParametersAndBuffers(model, modifier_rank=modifier_rank, group=group):
        with torch.no_grad():
            model.codebook.mul_(scale)  # the body's change (exact) on every rank; on exit only the modifier's counts


# name -> (call(model, group), the group rank whose values every member ends with, or an error pattern)
RANK_CASES = {
    "broadcast_buffers src=1": (lambda m, g: zb.broadcast_buffers(m, src=1, group=g), 1),
    "broadcast_buffers src=0": (lambda m, g: zb.broadcast_buffers(m, src=0, group=g), 0),
    "broadcast_buffers src=np.int64(1)": (lambda m, g: zb.broadcast_buffers(m, src=np.int64(1), group=g), 1),
    "broadcast_buffers src=tensor(1)": (lambda m, g: zb.broadcast_buffers(m, src=torch.tensor(1), group=g), 1),
    "sync_buffers src=1": (lambda m, g: zb.sync_buffers(m, "broadcast", src=1, group=g), 1),
    "sync_buffers(average) src=1": (lambda m, g: zb.sync_buffers(m, "average", src=1, group=g), 1),
    "frozen_replica src=1": (lambda m, g: zb.frozen_replica(m, src=1, group=g), 1),
    "GatheredParametersAndBuffers modifier_rank=1": (lambda m, g: _gathered(m, 1, g, 2.0), 1),
    "GatheredParametersAndBuffers modifier_rank=0": (lambda m, g: _gathered(m, 0, g, 2.0), 0),
    "broadcast_buffers src=2": (lambda m, g: zb.broadcast_buffers(m, src=2, group=g), "broadcast_buffers(): src=2"),
    "sync_buffers src=2": (lambda m, g: zb.sync_buffers(m, "broadcast", src=2, group=g), "sync_buffers(): src=2"),
    "frozen_replica src=3": (lambda m, g: zb.frozen_replica(m, src=3, group=g), "frozen_replica(): src=3"),
    "GatheredParametersAndBuffers modifier_rank=3": (lambda m, g: _gathered(m, 3, g, 2.0),
                                                     "GatheredParametersAndBuffers(): modifier_rank=3"),
}
# a rank argument outside the group, on a member: named with the group's global ranks, before any collective
NOT_IN_GROUP = r"^{start} is not a rank of the group \(global ranks \[1, 3\]\): ranks are counted within the group, " \
               r"0 to 1 \(rank {rank}\)$"


def _rank_table(rank, world, names):
    import torch.distributed as dist

    group = dist.new_group(list(MEMBERS))  # collective itself: every rank, before the table

    def case(name):
        model = _model(rank)
        before = _state(model)
        out = logged_call(lambda: RANK_CASES[name][0](model, group))
        out.update(before=before, after=_state(model))
        return out

    return run_table(world, names, case)


def _check_rank_case(name: str, res: list) -> None:
    _, want = RANK_CASES[name]
    doubled = name.startswith("GatheredParametersAndBuffers")  # its body doubled the codebook on every rank
    for r in res:
        if doubled and r["error"] is None:
            r["after"]["codebook"] /= 2
    for rank in (0, 2):  # outside the group: a no-op, no collective (frozen_replica still converts, locally)
        r = res[rank]
        assert r["error"] is None and r["log"] == [] and _same(r["before"], r["after"]), (rank, r["error"], r["log"])
    if isinstance(want, str):
        for rank in MEMBERS:
            r = res[rank]
            assert r["error"] is not None and r["error"][0] == "InvalidSourceRankError", r["error"]
            assert re.search(NOT_IN_GROUP.format(start=re.escape(want), rank=rank), r["error"][1]), r["error"][1]
            assert r["log"] == [] and _same(r["before"], r["after"]), r["log"]
        return
    source = res[MEMBERS[want]]["before"]  # group rank ``want`` is this global rank
    for rank in MEMBERS:
        r = res[rank]
        assert r["error"] is None, r["error"]
        after = dict(r["after"])
        if name.startswith("sync_buffers(average)"):  # merged statistics first, then the rest from src
            after = {k: v for k, v in after.items() if not k.startswith("1.running") and "num_batches" not in k}
            source = {k: v for k, v in source.items() if k in after}
        if name.startswith(("broadcast_buffers", "sync_buffers")):  # buffers only: weights keep their own values
            assert all(bitwise_equal(after[k], r["before"][k]) for k in ("0.weight", "0.bias", "1.weight")), name
            after = {k: v for k, v in after.items() if k not in ("0.weight", "0.bias", "1.weight", "1.bias")}
            source = {k: v for k, v in source.items() if k in after}
        assert _same(after, source), f"global rank {rank} did not end with global rank {MEMBERS[want]}'s values"
        if rank != MEMBERS[want]:
            assert not _same(r["before"], res[MEMBERS[want]]["before"])  # it started apart


def test_rank_arguments_are_ranks_within_the_group(ranks4):
    names = list(RANK_CASES)
    check_table(names, ranks4.run(_rank_table, names, timeout=120), _check_rank_case)


# ---- ranks outside the group, or alone in it, do nothing --------------------------------------------------------
NO_OP = {  # name -> call(model, group)
    "broadcast_buffers": lambda m, g: zb.broadcast_buffers(m, group=g),
    "buffer_report": lambda m, g: zb.buffer_report(m, group=g),
    "assert_buffers_in_sync": lambda m, g: zb.assert_buffers_in_sync(m, group=g),
    "average_bn_stats": lambda m, g: zb.average_bn_stats(m, group=g),
    "recompute_bn_stats": lambda m, g: zb.recompute_bn_stats(m, torch.randn(4, 3), group=g, progress=False),
    "sync_buffers(broadcast)": lambda m, g: zb.sync_buffers(m, "broadcast", group=g),
    "sync_buffers(average)": lambda m, g: zb.sync_buffers(m, "average", group=g),
    "sync_buffers(recompute)": lambda m, g: zb.sync_buffers(m, "recompute", data=[torch.randn(4, 3)], group=g),
    "sync_buffers(check)": lambda m, g: zb.sync_buffers(m, "check", group=g),
    "frozen_replica": lambda m, g: zb.frozen_replica(m, group=g),
    "GatheredParametersAndBuffers": lambda m, g: _gathered(m, 0, g),
}
SETUPS = ("alone", "outside")  # a group of one rank each; the group [1, 3] seen from ranks 0 and 2
NO_OP_CASES = [f"{fn}/{setup}" for setup in SETUPS for fn in NO_OP]
RETURNS = {"broadcast_buffers": 0, "average_bn_stats": 0, "recompute_bn_stats": 0, "sync_buffers(broadcast)": 0,
           "sync_buffers(average)": 0, "sync_buffers(recompute)": 0, "sync_buffers(check)": 0, "frozen_replica": True,
           "GatheredParametersAndBuffers": None}


def _no_op_table(rank, world, names):
    import torch.distributed as dist

    alone = [dist.new_group([r]) for r in range(world)][rank]
    outside = dist.new_group(list(MEMBERS))

    def case(name):
        fn, setup = name.split("/")
        model = _model(rank)
        before = _state(model)
        out = logged_call(lambda: _summary(NO_OP[fn](model, alone if setup == "alone" else outside)))
        out.update(unchanged=_same(before, _state(model)), frozen=zb.is_frozen_replica(model))
        return out

    return run_table(world, names, case)


def _summary(result):
    if isinstance(result, zb.BufferReport):
        return ("report", result.checked, result.in_sync, result.ranks)
    if isinstance(result, nn.Module):
        return zb.is_frozen_replica(result)
    return result


def _check_no_op(name: str, res: list) -> None:
    fn, setup = name.split("/")
    idle = range(4) if setup == "alone" else (0, 2)
    for rank in idle:
        r = res[rank]
        assert r["error"] is None and r["log"] == [] and r["unchanged"], (rank, r["error"], r["log"])
        want = ("report", False, True, (rank,)) if fn in ("buffer_report", "assert_buffers_in_sync") else RETURNS[fn]
        assert r["value"] == want, (rank, r["value"])
        assert r["frozen"] == (fn == "frozen_replica"), rank  # frozen_replica converts locally, with nothing to sync
    if setup == "outside":  # the members really ran it (the scrambled buffers differ: the check raises)
        for rank in MEMBERS:
            r = res[rank]
            want = "BuffersOutOfSyncError" if fn in ("assert_buffers_in_sync", "sync_buffers(check)") else None
            assert (r["error"] or [None])[0] == want and r["log"], (rank, r["error"])


def test_ranks_outside_the_group_or_alone_in_it_do_nothing(ranks4):
    check_table(NO_OP_CASES, ranks4.run(_no_op_table, NO_OP_CASES, timeout=120), _check_no_op)


def test_a_single_process_call_warns_once_that_it_did_nothing():
    from zero_buffers._core import notice as _notice

    _notice._SEEN.clear()
    model = bn_net()
    with pytest.warns(zb.ZeroBuffersWarning, match="without a torch.distributed process group"):
        assert zb.average_bn_stats(model) == 0
    with pytest.warns(zb.ZeroBuffersWarning, match=r"sync_buffers\(\) ran without"):
        assert zb.sync_buffers(model, "average") == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zb.average_bn_stats(model) == 0  # once per process
    _notice._SEEN.clear()
