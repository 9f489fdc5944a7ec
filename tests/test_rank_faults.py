"""Rank faults: a peer that dies (os._exit) or stalls mid-call makes the survivors raise CollectiveError
within the timeout, and no buffer is left half-written; a rank that fails locally (no memory, a packing error)
makes every rank raise SyncAbortedError, with nothing written anywhere.

Faults are injected on one rank by wrapping the real torch.distributed collectives *on that rank only*:
just before its ``at``-th collective call of the sync it exits or blocks for good (``at=2`` is right after
the structure check; the digest all_gather is collective 1). The harness's ``allow_dead`` returns the
survivors' results, kills the faulty rank if it still runs and rebuilds the pool (its process group is
broken). gloo notices a dead peer at once (connection reset); only the timeout ends a stall.
"""
from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal, scramble

WRAPPED = ("all_gather", "broadcast", "all_reduce")
# gloo's words for a vanished peer: "Connection reset by peer", "Connection closed by peer", or a write's
# "Broken pipe"; its messages also say "remote worker".
PEER_GONE = r"by peer|Broken pipe|remote worker"
SLACK = 8.0  # seconds of scheduling slack on 2 shared cores; the timeouts themselves are 2 s
EARLY = 0.05  # c10d's wait timer may fire a fraction of a millisecond before the 2 s (seen: 1.99989 s)


class Mixed(nn.Module):
    """Buffers in four dtype buckets (float32, float64, int64, bfloat16) plus BatchNorms with counters."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.bn64 = nn.BatchNorm1d(3).double()
        self.register_buffer("codebook", torch.zeros(8, 4))
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("rope", torch.zeros(6, dtype=torch.bfloat16), persistent=False)


def _model(rank: int) -> nn.Module:
    model = scramble(Mixed(), rank)  # every buffer differs across ranks (the report has values to gather)
    with torch.no_grad():
        model.bn.num_batches_tracked.fill_(rank + 1)
        model.bn64.num_batches_tracked.fill_(2)
    return model


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)


def _stall_forever() -> None:
    threading.Event().wait()  # never set: this rank stalls until the harness kills it


def _inject(how: str, at: int, handshake: bool = False) -> None:
    """On this rank, exit or stall just before the ``at``-th collective call (after the peers' signal if asked)."""
    count = [0]
    real = {name: getattr(dist, name) for name in WRAPPED}

    def wrap(name):
        def faulty(*args, **kwargs):
            count[0] += 1
            if count[0] == at:
                if handshake:  # wait until the survivor has received everything this rank sent so far
                    dist.distributed_c10d._get_default_store().wait(["zb_previous_collective_arrived"])
                if how == "die":
                    os._exit(3)
                _stall_forever()
            return real[name](*args, **kwargs)
        return faulty

    for name in WRAPPED:
        setattr(dist, name, wrap(name))


def _confirm_buckets(n: int, arrived: list):
    """On a survivor: complete the first ``n`` broadcasts at once, then tell the faulty rank they arrived. Returns an
    undo callable (the pool fails a task that leaves torch.distributed patched)."""
    real = dist.broadcast

    def confirming(*args, **kwargs):
        work = real(*args, **kwargs)
        if len(arrived) < n:
            work.wait()
            arrived.append(True)
            if len(arrived) == n:
                dist.distributed_c10d._get_default_store().set("zb_previous_collective_arrived", "1")
        return work

    dist.broadcast = confirming

    def undo():
        dist.broadcast = real
    return undo


CALLS = {
    "broadcast_buffers": lambda m, src, t: zb.broadcast_buffers(m, src=src, timeout=t),
    "buffer_report": lambda m, src, t: zb.buffer_report(m, timeout=t),
    "assert_buffers_in_sync": lambda m, src, t: zb.assert_buffers_in_sync(m, timeout=t),
    "average_bn_stats": lambda m, src, t: zb.average_bn_stats(m, timeout=t),
}


def _rank_fault(rank, world, fn, faulty, how, at, timeout, src=0, confirm=0):
    """``fn`` on every rank; rank ``faulty`` exits or stalls before its ``at``-th collective (with ``confirm``: only
    once the survivors have received that many broadcast buckets)."""
    model = _model(rank)
    before = _snapshot(model)
    arrived: list = []
    undo = None
    if rank == faulty:
        _inject(how, at, handshake=bool(confirm))
    elif confirm:
        undo = _confirm_buckets(confirm, arrived)
    started = time.monotonic()
    try:
        CALLS[fn](model, src, timeout)
        err = None
    except zb.ZeroBuffersError as e:
        err = (type(e).__name__, str(e))
    finally:
        if undo is not None:
            undo()
    return err, time.monotonic() - started, _same(before, _snapshot(model)), _snapshot(model), before, arrived


def _check_survivors(out, fn, faulty):
    assert out[faulty] is None  # the faulty rank never answered
    for rank, res in enumerate(out):
        if rank == faulty:
            continue
        err, _, unchanged, _, _, _ = res
        assert err is not None and err[0] == "CollectiveError", (rank, err)
        assert f"{fn} failed on rank {rank}" in err[1] and "No buffer was modified" in err[1], err[1]
        assert unchanged, rank  # nothing half-written
    return [res for r, res in enumerate(out) if r != faulty]


@pytest.mark.parametrize("fn,at", [("broadcast_buffers", 2), ("buffer_report", 3), ("assert_buffers_in_sync", 2),
                                   ("average_bn_stats", 2)])
def test_dead_peer_mid_call_fails_fast_and_changes_nothing(ranks2, fn, at):
    # at=2: right after the structure check; buffer_report dies later, while it gathers the differing values.
    # timeout=None: detecting a dead peer does not depend on our timeout (gloo sees the connection drop).
    out = ranks2.run(_rank_fault, fn, 1, "die", at, None, 1, allow_dead=[1], timeout=60)
    for err, elapsed, *_ in _check_survivors(out, fn, 1):
        assert re.search(PEER_GONE, err[1]) and elapsed < SLACK, (err, elapsed)


@pytest.mark.parametrize("fn", list(CALLS))
def test_stalled_peer_after_the_structure_check_times_out_and_changes_nothing(ranks2, fn):
    out = ranks2.run(_rank_fault, fn, 1, "stall", 2, 2.0, 1, allow_dead=[1], timeout=60)
    for err, elapsed, *_ in _check_survivors(out, fn, 1):
        assert "did not complete within timeout=2 s" in err[1], err[1]
        assert 2.0 - EARLY <= elapsed < 2.0 + SLACK, elapsed  # it waited for the timeout, and not much longer


def test_peer_that_never_calls_times_out_in_the_structure_check(ranks2):
    # the structure check is shared code: one function stands for all four here
    out = ranks2.run(_rank_fault, "broadcast_buffers", 1, "stall", 1, 2.0, 0, allow_dead=[1], timeout=60)
    for err, elapsed, *_ in _check_survivors(out, "broadcast_buffers", 1):
        assert "did not complete within timeout=2 s" in err[1] and 2.0 - EARLY <= elapsed < 2.0 + SLACK, (err, elapsed)


@pytest.mark.parametrize("when,at,received", [("between buckets", 3, 1), ("before the received vote", 6, 4)])
@pytest.mark.parametrize("how", ["die", "stall"])
def test_no_partial_write_when_the_source_fails_between_buckets(ranks2, how, when, at, received):
    # src=1 sends four dtype buckets (collectives 2-5, after the agreement), then every rank votes that it
    # received them (collective 6). It fails after rank 0 has *received* bucket 1 (float32: codebook and bn stats),
    # or every bucket: a per-bucket write would leave those new and the rest old, a write before the vote would
    # commit what the source may not have committed. Rank 0 must keep all old values.
    out = ranks2.run(_rank_fault, "broadcast_buffers", 1, how, at, 2.0, 1, received, allow_dead=[1], timeout=60)
    (err, elapsed, _, _, _, arrived), = _check_survivors(out, "broadcast_buffers", 1)
    assert arrived == [True] * received  # those buckets really reached rank 0 before the fault
    assert elapsed < 2.0 + SLACK
    assert re.search(PEER_GONE, err[1]) if how == "die" else ("timeout=2 s" in err[1]), err



def test_four_ranks_no_survivor_is_half_written(ranks4):
    # Rank 2 dies inside the data transfer (before bucket 2 of 4) of a broadcast from rank 0. Depending on
    # gloo's broadcast tree a survivor may or may not need rank 2: each either raises CollectiveError with
    # every buffer unchanged, or completes with every buffer equal to rank 0's. Never a mix.
    out = ranks4.run(_rank_fault, "broadcast_buffers", 2, "die", 3, 10.0, 0, allow_dead=[2], timeout=90)
    assert out[2] is None
    src_before = out[0][4]
    for rank in (1, 3):
        err, elapsed, unchanged, after, before, _ = out[rank]
        assert not _same(before, src_before)  # the rank started apart from the source
        if err is None:
            assert _same(after, src_before), rank
        else:
            assert err[0] == "CollectiveError" and unchanged, (rank, err)
        assert elapsed < 10.0 + SLACK
    assert out[0][2]  # the source never changes its own buffers


def _gathered_noop(m: nn.Module, src: int, t: float | None) -> None:
    with zb.GatheredParametersAndBuffers(m, modifier_rank=src, timeout=t):
        pass


# The entry points built on the core: each must turn a peer's death or stall into CollectiveError and change nothing.
# (sync_buffers("check") is assert_buffers_in_sync itself, covered by the core tests above)
BUILT_ON_THE_CORE = {
    "sync_buffers(average)": lambda m, src, t: zb.sync_buffers(m, "average", src=src, timeout=t),
    "frozen_replica": lambda m, src, t: zb.frozen_replica(m, src=src, timeout=t),
    "GatheredParametersAndBuffers": _gathered_noop,
}


def _built_on_core_fault(rank, world, fn, how, at, timeout):
    model = _model(rank)
    before = {**_snapshot(model), **{n: p.detach().clone() for n, p in model.named_parameters()}}
    if rank == 1:
        _inject(how, at)
    started = time.monotonic()
    try:
        BUILT_ON_THE_CORE[fn](model, 0, timeout)
        err = None
    except zb.ZeroBuffersError as e:
        err = (type(e).__name__, str(e))
    after = {**_snapshot(model), **{n: p.detach().clone() for n, p in model.named_parameters()}}
    return err, time.monotonic() - started, _same(before, after), type(model).__name__


@pytest.mark.parametrize("how", ["die", "stall"])
@pytest.mark.parametrize("fn", list(BUILT_ON_THE_CORE))
def test_functions_built_on_the_core_fail_cleanly_when_a_peer_fails(ranks2, fn, how):
    # at=2: the peer goes away after the first collective (a structure check or an agreement on enter)
    out = ranks2.run(_built_on_core_fault, fn, how, 2, 2.0, allow_dead=[1], timeout=60)
    assert out[1] is None
    err, elapsed, unchanged, cls = out[0]
    assert err is not None and err[0] == "CollectiveError", err
    assert unchanged and cls == "Mixed", (fn, cls)  # values, parameters and the class itself as before
    assert elapsed < 2.0 + SLACK, elapsed
    if how == "stall":
        assert "did not complete within timeout=2 s" in err[1] and elapsed >= 2.0 - EARLY, (err, elapsed)
    else:
        assert re.search(PEER_GONE, err[1]), err


# ---- a rank that fails locally: every rank raises SyncAbortedError, nothing is written anywhere -----------------
def _raise(exc: BaseException):
    def fail(*args, **kwargs):
        raise exc
    return fail


def _after_issuing(name: str, exc: BaseException):
    """torch.distributed.<name> that issues the collective, then raises ``exc`` (a local failure after the send)."""
    real = getattr(dist, name)

    def fail(*args, **kwargs):
        real(*args, **kwargs)
        raise exc
    return fail


def _gathered_commit(m: nn.Module, src: int, t: float | None) -> None:
    with zb.GatheredParametersAndBuffers(m, modifier_rank=src, timeout=t):
        pass


# name -> (call, failing rank, (module, attribute, replacement factory), step, error text, data collectives first)
LOCAL_FAILURES = {
    "broadcast_buffers: a receiver cannot allocate": (
        CALLS["broadcast_buffers"], 1,
        ("zero_buffers._core.wire", "receive_space", lambda: _raise(MemoryError("no room"))),
        "a rank could not take part", "MemoryError: no room", False),
    "broadcast_buffers: the source cannot pack a bucket": (
        CALLS["broadcast_buffers"], 0,
        ("zero_buffers._compat.torch", "pack_into", lambda: _raise(RuntimeError("pack failed"))),
        "receiving failed", "RuntimeError: pack failed", True),
    "broadcast_buffers: a receiver fails after a bucket went out": (
        CALLS["broadcast_buffers"], 1, ("torch.distributed", "broadcast",
                                        lambda: _after_issuing("broadcast", ValueError("disk"))),
        "receiving failed", "ValueError: disk", True),
    "average_bn_stats: a rank cannot pack its sums": (
        CALLS["average_bn_stats"], 1, ("zero_buffers.bn.average", "_pack", lambda: _raise(MemoryError("no room"))),
        "a rank could not take part", "MemoryError: no room", False),
    "average_bn_stats: a rank fails after the all-reduce went out": (
        CALLS["average_bn_stats"], 1, ("torch.distributed", "all_reduce",
                                       lambda: _after_issuing("all_reduce", ValueError("glitch"))),
        "receiving failed", "ValueError: glitch", True),
    "frozen_replica: a receiver cannot allocate": (
        BUILT_ON_THE_CORE["frozen_replica"], 1,
        ("zero_buffers._core.wire", "receive_space", lambda: _raise(MemoryError("no room"))),
        "a rank could not take part", "MemoryError: no room", False),
    "GatheredParametersAndBuffers: a receiver cannot allocate on exit": (
        _gathered_commit, 1, ("zero_buffers._core.wire", "receive_space", lambda: _raise(MemoryError("no room"))),
        "the body raised, or the commit could not start,", "MemoryError: no room", False),
}
DIGEST = ("all_gather", "torch.int64", 3)
ERROR_PATH = "error path: gather the structures to build the message"


def _local_failures(rank, world, names):
    import importlib

    from tests.helpers import logged_call, run_table

    def case(name):
        call, failing, (module, attr, make), *_ = LOCAL_FAILURES[name]
        model = _model(rank)
        before = {**_snapshot(model), **{n: p.detach().clone() for n, p in model.named_parameters()}}
        target = importlib.import_module(module)
        real = getattr(target, attr)
        if rank == failing:
            setattr(target, attr, make())
        try:
            out = logged_call(lambda: call(model, 0, 10.0))
        finally:
            setattr(target, attr, real)
        after = {**_snapshot(model), **{n: p.detach().clone() for n, p in model.named_parameters()}}
        out["unchanged"] = _same(before, after) and type(model).__name__ == "Mixed"
        return out

    return run_table(world, names, case)


def test_a_rank_that_fails_locally_makes_every_rank_raise_sync_aborted_and_nothing_changes(ranks2):
    from tests.helpers import check_table

    def check(name, res):
        _, failing, _, step, text, after_data = LOCAL_FAILURES[name]
        fn = name.split(":")[0]
        errors = [r["error"] for r in res]
        assert all(e is not None and e[0] == "SyncAbortedError" for e in errors), errors
        assert all(e[:2] == errors[0][:2] and e[4:6] == errors[0][4:6] for e in errors), errors  # the same everywhere
        _, message, _, _, failed, reasons, _ = errors[0]
        assert message.startswith(f"{fn}: {step} on rank {failing} (rank {failing}: {text}); "), message
        assert failed == (failing,) and reasons == {failing: text}, (failed, reasons)
        for rank, (r, e) in enumerate(zip(res, errors)):
            assert e[6] == (text.split(":")[0] if rank == failing else None), e  # the failing rank chains its own
            assert r["unchanged"], f"rank {rank} changed"
            log = r["log"]
            agreements = {"frozen_replica": [DIGEST, ("all_gather", "torch.int64", 1), DIGEST],  # gather, convert, send
                          "GatheredParametersAndBuffers": [DIGEST, DIGEST]}.get(fn, [DIGEST])
            assert log[:len(agreements)] == agreements, log
            rest = log[len(agreements):]
            if after_data:  # the data went out into scratch, then the "received" vote failed: nothing written
                data = [x for x in rest if x[0] in ("broadcast", "all_reduce")]
                assert data and rest[:len(data)] == data, log
                rest = rest[len(data):]
                assert rest[:1] == [("all_gather", "torch.int64", 1)], log
                rest = rest[1:]
            # the vote failed: only the failing ranks' messages are gathered (sizes, then bytes)
            assert [x[:2] for x in rest] == [(ERROR_PATH,), ("all_gather", "torch.int64"),
                                             ("all_gather", "torch.uint8")], log

    names = list(LOCAL_FAILURES)
    check_table(names, ranks2.run(_local_failures, names, timeout=120), check)


def _interrupted_receiver(rank, world):
    undo = None
    if rank == 1:
        real = dist.broadcast
        dist.broadcast = _after_issuing("broadcast", KeyboardInterrupt())

        def undo():
            dist.broadcast = real
    model = _model(rank)
    before = _snapshot(model)
    try:
        zb.broadcast_buffers(model, timeout=2.0)
        err = None
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt included
        err = (type(e).__name__, str(e), type(e.__cause__).__name__)
    finally:
        if undo is not None:
            undo()
    return err, _same(before, _snapshot(model))


def test_a_keyboard_interrupt_while_receiving_is_a_vote_like_any_other_failure(ranks2):
    # _transaction: "Any exception other than a failed collective is caught (BaseException, so KeyboardInterrupt
    # too) and becomes this rank's vote." Both ranks answer (the call has a 2 s timeout if they did not).
    out = ranks2.run(_interrupted_receiver, timeout=60)
    assert out[0] is not None and out[1] is not None, out
    for rank, (err, unchanged) in enumerate(out):
        assert err is not None and err[0] == "SyncAbortedError", (rank, err)
        assert "receiving failed on rank 1 (rank 1: KeyboardInterrupt" in err[1] and unchanged, err
    assert out[1][0][2] == "KeyboardInterrupt"
