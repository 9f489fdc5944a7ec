"""Structure faults for every public function: one small collective decides, every rank raises the same error.

Extends tests/test_structure.py (which covers broadcast_buffers/buffer_report with plain buffers) to
assert_buffers_in_sync and average_bn_stats, with BatchNorm layers as the disagreeing buffers (so every
function sees the fault), and proves "within one collective" by logging every torch.distributed
collective the call issues through counting wrappers around the real functions.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import ERROR_PATH, bitwise_equal, log_collectives, restore_collectives, scramble


class BNNet(nn.Module):
    """Two BatchNorms and a plain buffer; ``kind`` makes this rank's structure differ in one way."""

    def __init__(self, kind: str | None):
        super().__init__()
        for n in (["bn1", "bn2"] if kind != "order" else ["bn2", "bn1"]):
            setattr(self, n, nn.BatchNorm1d(3))
        self.register_buffer("codebook", torch.zeros(2, 4))
        if kind == "extra":
            self.bn3 = nn.BatchNorm1d(3)
        elif kind == "missing":
            del self.bn2
        elif kind == "name":
            self.renamed = self._modules.pop("bn2")
        elif kind == "shape":
            self.bn1 = nn.BatchNorm1d(4)
        elif kind == "dtype":
            self.bn1.double()
        elif kind == "device":
            self.bn1 = nn.BatchNorm1d(3, device="meta")
        elif kind == "counter":
            self.bn1.num_batches_tracked = None
        elif kind == "untracked":
            self.bn2 = nn.BatchNorm1d(3, track_running_stats=False)
        elif kind == "shape2d":
            self.codebook = torch.zeros(2, 5)
        elif kind == "device2d":
            self.codebook = torch.zeros(2, 4, device="meta")
        elif kind == "layout":
            self.codebook = torch.zeros(2, 4).to_sparse()


EXPECTED = {  # the same message for every function: the BatchNorm statistics are buffers for all of them
    "extra": r"at 'bn3.running_mean' \(missing on some ranks\)",
    "missing": r"at 'bn2.running_mean' \(missing on some ranks\)",
    "name": r"at 'bn2.running_mean' \(missing on some ranks\)",
    "shape": r"at 'bn1.running_mean' \(shape differs\): .*float32\[3\] cpu.*float32\[4\] cpu",
    "dtype": r"at 'bn1.running_mean' \(dtype differs\): .*float64\[3\] cpu",
    "device": r"at 'bn1.running_mean' \(device differs\): .*float32\[3\] meta",
    "order": r"register the same buffers in a different order",
    "counter": r"at 'bn1.num_batches_tracked' \(missing on some ranks\)",
    "untracked": r"at 'bn2.running_mean' \(missing on some ranks\)",
    # a plain 2-D buffer: average_bn_stats does not look at it (see test_average_ignores_plain_buffer_faults)
    "shape2d": r"at 'codebook' \(shape differs\): .*float32\[2, 4\] cpu.*float32\[2, 5\] cpu",
    "device2d": r"at 'codebook' \(device differs\): .*float32\[2, 4\] meta",
    "layout": r"at 'codebook' \(layout differs\): .*float32\[2, 4\] cpu sparse_coo",
}
PLAIN = ("shape2d", "device2d", "layout")
KINDS = list(EXPECTED)
FNS = {
    "broadcast_buffers": lambda m: zb.broadcast_buffers(m),
    "buffer_report": lambda m: zb.buffer_report(m),
    "assert_buffers_in_sync": lambda m: zb.assert_buffers_in_sync(m),
    "average_bn_stats": lambda m: zb.average_bn_stats(m),
}


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _unchanged(before: dict[str, torch.Tensor], model: nn.Module) -> bool:
    after = dict(model.named_buffers())

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.is_meta or b.is_meta:
            return a.is_meta and b.is_meta and a.shape == b.shape
        if a.layout != torch.strided or b.layout != torch.strided:
            return a.layout == b.layout and bitwise_equal(a.to_dense(), b.to_dense())
        return bitwise_equal(a, b)

    return before.keys() == after.keys() and all(same(before[n], after[n]) for n in before)


def _structure_fault(rank, world, kind, fn, odd_rank):
    model = BNNet(kind if rank == odd_rank else None)
    if not (kind in ("device", "device2d", "layout") and rank == odd_rank):
        scramble(model, rank)
    before = _snapshot(model)
    log: list = []
    real = log_collectives(log)
    try:
        FNS[fn](model)
        err = None
    except zb.ZeroBuffersError as e:
        err = (type(e).__name__, str(e), getattr(e, "name", None), getattr(e, "details", None))
    finally:
        restore_collectives(real)
    return err, log, _unchanged(before, model)


def _check(out, kind, odd_rank, fn):
    errors = [e for e, _, _ in out]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors  # the same error everywhere
    typ, message, name, details = errors[0]
    assert typ == "BufferStructureError"
    assert re.search(EXPECTED[kind], message), message
    assert re.search(rf"\branks? ([0-9, ]*, )?{odd_rank}\b", message), message  # names the odd rank
    assert "No buffer was modified" in message
    assert set(details) == set(range(len(out)))
    for _, log, unchanged in out:
        assert unchanged  # nothing changed on any rank
        # Within one collective: exactly one all_gather of two int64 (the structure digest and a slot the
        # report fills with its combined content digest) decides; the error path then only gathers the
        # structures (sizes, then bytes) to name the culprit. No data moves.
        assert log[:2] == [("all_gather", "torch.int64", 2), (ERROR_PATH,)]
        assert [e[:2] for e in log[2:]] == [("all_gather", "torch.int64"), ("all_gather", "torch.uint8")], log


FAULTS = [(fn, kind) for fn in FNS for kind in KINDS if not (fn == "average_bn_stats" and kind in PLAIN)]


@pytest.mark.parametrize("fn,kind", FAULTS)
def test_every_structure_fault_raises_the_same_error_within_one_collective(ranks2, fn, kind):
    _check(ranks2.run(_structure_fault, kind, fn, 1, timeout=30), kind, 1, fn)


@pytest.mark.parametrize("kind", PLAIN)
def test_average_ignores_plain_buffer_faults(ranks2, kind):
    # average_bn_stats agrees on (and touches) BatchNorm statistics only: a fault in another buffer is not its
    # business, so it merges as usual: the digest, then one all-reduce of 2 layers x (count + 2 x 3 channels)
    out = ranks2.run(_structure_fault, kind, "average_bn_stats", 1, timeout=30)
    assert [err for err, _, _ in out] == [None, None]
    assert all(log == [("all_gather", "torch.int64", 2), ("all_reduce", "torch.float64", 2 * (1 + 2 * 3))]
               for _, log, _ in out), out


@pytest.mark.parametrize("fn,kind", FAULTS)
def test_structure_fault_on_a_middle_rank_of_four(ranks4, fn, kind):
    _check(ranks4.run(_structure_fault, kind, fn, 2, timeout=60), kind, 2, fn)


def _agreeing(rank, world, fn):
    """The control: the same structure on every rank goes through with the one digest all_gather first."""
    model = scramble(BNNet(None), rank)
    log: list = []
    real = log_collectives(log)
    try:
        FNS[fn](model) if fn != "assert_buffers_in_sync" else zb.buffer_report(model)
    finally:
        restore_collectives(real)
    return log


@pytest.mark.parametrize("fn", list(FNS))
def test_agreeing_structure_costs_the_same_single_digest_gather(ranks2, fn):
    for log in ranks2.run(_agreeing, fn):
        assert log[0] == ("all_gather", "torch.int64", 2)
        assert not any(e[0].startswith("error path") for e in log)
        assert len(log) >= 2  # then the data moves


CALL_FAULTS = {  # ranks call with different arguments, or different functions altogether
    "atol": (lambda m: zb.buffer_report(m, atol=0.0), lambda m: zb.buffer_report(m, atol=0.5)),
    "include_parameters": (lambda m: zb.broadcast_buffers(m),
                           lambda m: zb.broadcast_buffers(m, include_parameters=True)),
    "function": (lambda m: zb.broadcast_buffers(m), lambda m: zb.buffer_report(m)),
    "average_vs_assert": (lambda m: zb.average_bn_stats(m), lambda m: zb.assert_buffers_in_sync(m)),
}


def _call_fault(rank, world, kind):
    model = scramble(BNNet(None), rank)
    before = _snapshot(model)
    log: list = []
    real = log_collectives(log)
    try:
        CALL_FAULTS[kind][rank == world - 1](model)
        err = None
    except zb.BufferStructureError as e:
        err = (str(e), e.details)
    finally:
        restore_collectives(real)
    return err, log, _unchanged(before, model)


@pytest.mark.parametrize("kind", list(CALL_FAULTS))
def test_ranks_calling_with_different_arguments_raise_the_same_error(ranks2, kind):
    out = ranks2.run(_call_fault, kind, timeout=30)
    # Every rank raises; the message starts with the function *this* rank called, the rest is identical.
    messages = [err[0].split(": ", 1) for err, _, _ in out]
    assert messages[0][1] == messages[1][1] and out[0][0][1] == out[1][0][1], messages
    assert messages[0][1].startswith("ranks called it with different arguments: rank 0: ("), messages[0][1]
    for err, log, unchanged in out:
        assert unchanged and log[0] == ("all_gather", "torch.int64", 2) and log[1][0].startswith("error path")
