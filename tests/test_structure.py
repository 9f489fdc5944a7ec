"""Structure safety: ranks that disagree raise the same error everywhere, before data moves, changing nothing."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import buffers, log_collectives, restore_collectives, same_state, scramble


class Net(nn.Module):
    def __init__(self, kind: str | None):
        super().__init__()
        self.bn = nn.BatchNorm1d(4 if kind != "bn_shape" else 5)
        names = ["a", "b"] if kind != "order" else ["b", "a"]
        for n in names:
            self.register_buffer(n, torch.zeros(3))
        if kind == "extra":
            self.register_buffer("extra", torch.zeros(2))
        if kind == "missing":
            del self._buffers["b"]
        if kind == "name":
            self._buffers["renamed"] = self._buffers.pop("b")
        if kind == "shape":
            self.a = torch.zeros(4)
        if kind == "dtype":
            self.a = torch.zeros(3, dtype=torch.float64)
        if kind == "device":
            self.a = torch.zeros(3, device="meta")


EXPECTED = {
    "extra": r"at 'extra' \(missing on some ranks\)",
    "missing": r"at 'b' \(missing on some ranks\)",
    "name": r"at 'b' \(missing on some ranks\)",
    "shape": r"at 'a' \(shape differs\): .*float32\[3\] cpu.*float32\[4\] cpu",
    "dtype": r"at 'a' \(dtype differs\): .*float64\[3\] cpu",
    "device": r"at 'a' \(device differs\): .*float32\[3\] meta",
    "order": r"different order",
    "bn_shape": r"at 'bn.running_mean' \(shape differs\)",
}


def _mismatch(rank, world, kind, fn):
    odd = rank == world - 1
    model = Net(kind if odd else None)
    scramble(model, rank) if kind != "device" or not odd else None
    with torch.no_grad():
        model.bn.num_batches_tracked.fill_(1)
    before = buffers(model) if not (odd and kind == "device") else None
    calls = {"broadcast": lambda: zb.broadcast_buffers(model), "report": lambda: zb.buffer_report(model),
             "average": lambda: zb.average_bn_stats(model)}
    try:
        calls[fn]()
    except zb.BufferStructureError as e:
        err = (str(e), e.name, e.details)
    else:
        err = None
    unchanged = before is None or same_state(before, buffers(model))
    return err, unchanged


KINDS = list(EXPECTED)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fn", ["broadcast", "report"])
def test_every_mismatch_kind_raises_the_same_error_on_every_rank(ranks, kind, fn):
    out = ranks.run(_mismatch, kind, fn)
    errors = [e for e, _ in out]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    message, name, details = errors[0]
    assert __import__("re").search(EXPECTED[kind], message), message
    last = ranks.world_size - 1
    assert f"rank {last}" in message or f"ranks {last}" in message or f", {last}" in message
    assert set(details) == set(range(ranks.world_size)) and name is not None
    assert all(unchanged for _, unchanged in out)


@pytest.mark.parametrize("kind", ["bn_shape", "order"])
def test_average_bn_stats_checks_structure_too(ranks2, kind):
    out = ranks2.run(_mismatch, kind, "average")
    if kind == "order":  # a/b are not BN statistics: BN-only structure agrees, the merge goes ahead
        assert out[0][0] is None and out[1][0] is None
        return
    assert out[0][0] is not None and out[0][0] == out[1][0] and all(u for _, u in out)


def _different_src(rank, world):
    model = scramble(Net(None), rank)
    before = buffers(model)
    try:
        zb.broadcast_buffers(model, src=rank)  # every rank thinks it is the source
    except zb.BufferStructureError as e:
        return str(e), same_state(before, buffers(model))
    return None, False


def test_ranks_passing_different_src_raise_instead_of_corrupting(ranks):
    out = ranks.run(_different_src)
    assert out[0][0] is not None and all(m == out[0][0] for m, _ in out) and all(u for _, u in out)
    assert "different arguments" in out[0][0]


def _bad_src(rank, world, src, subgroup):
    import torch.distributed as dist
    group = dist.new_group([0, 1]) if subgroup else None  # new_group is collective itself: before the log starts
    log: list = []
    real = log_collectives(log)
    try:
        zb.broadcast_buffers(Net(None), src=src, group=group)
        err = None
    except zb.InvalidSourceRankError as e:
        err = str(e)
    finally:
        restore_collectives(real)
    return err, log


@pytest.mark.parametrize("src,subgroup,match", [(-1, False, "out of range"), (99, False, "out of range for world"),
                                                 ("0", False, "must be an int"), (3, True, r"not in the group \[0, 1\]")])
def test_invalid_src_raises_before_any_collective(ranks4, src, subgroup, match):
    out = ranks4.run(_bad_src, src, subgroup, timeout=20)
    members = [0, 1] if subgroup else range(4)
    for r in members:
        assert out[r][0] is not None and __import__("re").search(match, out[r][0]), out[r]
    for r in range(4):
        assert out[r][1] == [], (r, out[r][1])  # no collective issued, not even the structure digest
    if subgroup:  # non-members: a no-op
        assert out[2][0] is None and out[3][0] is None


def _meta(rank, world):
    with torch.device("meta"):
        model = nn.BatchNorm1d(3)
    try:
        zb.broadcast_buffers(model)
    except zb.InvalidArgumentError as e:
        return str(e)


def test_meta_buffers_raise_a_clear_error(ranks):
    out = ranks.run(_meta)
    assert out[0] is not None and all(m == out[0] for m in out)
    assert "meta device" in out[0] and "running_mean" in out[0]


def test_bad_arguments_are_typed_errors():
    with pytest.raises(zb.InvalidArgumentError, match="expects a torch.nn.Module, got Parameter"):
        zb.broadcast_buffers(nn.Parameter(torch.zeros(2)))
    with pytest.raises(zb.InvalidArgumentError, match="got list"):
        zb.buffer_report([nn.Linear(2, 2)])
    with pytest.raises(zb.InvalidArgumentError, match="atol"):
        zb.buffer_report(nn.Linear(2, 2), atol=-1)
    assert issubclass(zb.BufferStructureError, zb.ZeroBuffersError)
