"""Rank faults: whatever one rank suffers, every rank ends the call the same way and no buffer is left half-written.

- A peer that dies (os._exit) or stalls mid-call, or never calls: the survivors raise CollectiveError within the
  timeout (under the default ``timeout=None``, a bound per collective), nothing changed.
- A rank that fails locally (no memory, a packing error, a foreign exception or KeyboardInterrupt after a
  collective went out): every rank raises SyncAbortedError naming it, nothing written anywhere; a rank that cannot
  allocate its scratch never enters the data collectives.
- One faulty rank per phase: for every public function that syncs, a failure raised on one rank at each phase of
  its transaction ([Note: the transaction]: PREPARE, before the vote; EXCHANGE, in the exchange; AFTER, the
  post-write hooks, where a call has them) makes every rank raise the same typed error naming that rank, within
  seconds under ``timeout=None``, with nothing changed anywhere (every buffer and parameter, the module's class),
  and the next call works.

Dying and stalling peers are injected by wrapping the real torch.distributed collectives *on that rank only*: just
before its ``at``-th collective call of the sync it exits or blocks for good (``at=2`` is right after the structure
check; the digest all_gather is collective 1). The harness's ``allow_dead`` returns the survivors' results, kills the
faulty rank if it still runs and rebuilds the pool (its process group is broken). gloo notices a dead peer at once
(connection reset); only the timeout ends a stall. Phase failures are injected by replacing
``zero_buffers._core.transaction.reached`` on the faulty rank only: every transaction calls it at the start of each
fallible phase's work; the faulty rank is the last (a receiver) and, separately, rank 0 (the source of every
broadcast). Real gloo ranks at world 2 and 4."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import (
    bitwise_equal,
    bn_net,
    buffers,
    log_collectives,
    restore_collectives,
    same_state,
    scramble,
)
from zero_buffers._core import args as _args, wire as _wire
from zero_buffers.training import rules as rules_mod

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


# ---- a failure before the vote keeps every rank out of the data ----------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)


def _cannot_allocate(rank, world):
    import zero_buffers._core.wire as wire

    model = Net()
    torch.manual_seed(rank)
    with torch.no_grad():
        model.bn.running_mean.normal_()
    before = buffers(model)
    real = wire.receive_space

    def out_of_memory(buckets):
        raise MemoryError("cannot allocate the receive space (simulated)")

    log: list = []
    if rank == world - 1:
        wire.receive_space = out_of_memory
    collectives = log_collectives(log)
    try:
        zb.broadcast_buffers(model)
        caught = None
    except zb.SyncAbortedError as e:
        caught = (str(e), e.ranks)
    finally:
        restore_collectives(collectives)
        wire.receive_space = real
    return caught, same_state(before, buffers(model)), [entry[0] for entry in log]


@pytest.mark.stack
def test_a_rank_that_cannot_allocate_its_scratch_never_enters_the_broadcast(ranks):
    out = ranks.run(_cannot_allocate, timeout=60)
    last = ranks.world_size - 1
    for caught, unchanged, log in out:
        assert caught is not None and caught[1] == (last,), caught
        assert f"a rank could not take part on rank {last}" in caught[0] and "MemoryError" in caught[0]
        assert unchanged
        assert "broadcast" not in log  # the vote came first: no data moved on any rank


# ---- a call on some ranks only: the default bound ends it with a clear error -----------------------------------------
def _only_rank0_calls(rank, world, fn):
    """The ``if is_main_process: recompute_bn_stats(...)`` habit, with the default timeout (shortened by env)."""
    os.environ["ZERO_BUFFERS_TIMEOUT"] = "2"
    try:
        if rank != 0:
            return None
        model = bn_net()
        started = time.monotonic()
        with pytest.raises(zb.CollectiveError) as info:
            if fn == "recompute":
                zb.recompute_bn_stats(model, [torch.randn(8, 3)])
            else:
                zb.average_bn_stats(model)
        return str(info.value), time.monotonic() - started
    finally:
        del os.environ["ZERO_BUFFERS_TIMEOUT"]


@pytest.mark.parametrize("fn", ["recompute", "average"])
def test_a_call_on_rank_0_only_ends_with_a_clear_error_under_the_default_timeout(ranks2, fn):
    message, elapsed = ranks2.run(_only_rank0_calls, fn, allow_dead=[1], timeout=60)[0]
    assert "most likely they never called" in message and "is_main_process" in message
    assert "within 2 s (the default bound on each collective)" in message
    assert 1.5 < elapsed < 20


def test_the_default_bound_is_five_minutes_per_collective_and_explicit_timeouts_still_bound_the_call(monkeypatch):
    monkeypatch.delenv("ZERO_BUFFERS_TIMEOUT", raising=False)
    default = _wire.Deadline(_args.timeout(None, "f"))
    assert default.default and default.remaining().total_seconds() == _args.DEFAULT_WAIT_S == 300
    time.sleep(0.05)
    assert default.remaining().total_seconds() == 300  # per collective, not for the whole call
    explicit = _wire.Deadline(_args.timeout(10, "f"))
    time.sleep(0.05)
    assert not explicit.default and explicit.remaining().total_seconds() < 10
    assert _wire.Deadline(_args.timeout(float("inf"), "f")).remaining() is None
    monkeypatch.setenv("ZERO_BUFFERS_TIMEOUT", "inf")
    assert _wire.Deadline(None).remaining() is None
    monkeypatch.setenv("ZERO_BUFFERS_TIMEOUT", "soon")
    with pytest.raises(zb.InvalidArgumentError, match="ZERO_BUFFERS_TIMEOUT"):
        _wire.Deadline(None)


# ---- one faulty rank per phase of the transaction ([Note: the transaction]) ------------------------------------------
class Hooked(nn.Module):
    """An EMA codebook whose registered rules recompute a derived buffer and its codebook, kept as a parameter (as
    taming-transformers' EmbeddingEMA does), after every sync: an after_sync hook."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("derived", torch.zeros(4))
        self.weight = nn.Parameter(torch.zeros(4), requires_grad=False)

    def refresh(self) -> None:
        with torch.no_grad():
            self.derived.copy_(self.ema * 2)
            self.weight.copy_(self.ema * 3)


class PhaseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.codebook = Hooked()
        self.register_buffer("table", torch.zeros(6))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).mean((2, 3))


def _phase_model(rank: int) -> PhaseNet:
    torch.manual_seed(0)
    model = scramble(PhaseNet(), rank)
    with torch.no_grad():
        model.bn.num_batches_tracked.fill_(rank + 1)
    return model


def _images(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(2, 3, 4, 4, generator=g) + rank for _ in range(2)]


def _keep_in_sync(model: nn.Module, rank: int) -> None:
    handle = zb.keep_in_sync(model, rules={"codebook.ema": "mean"})
    try:
        handle.sync()
    finally:
        handle.remove()


def _callback(model: nn.Module, rank: int) -> None:
    from zero_buffers.integrations._sync import StepSync
    StepSync.checked("BufferSyncCallback", "average", None, False, False, 0, None).sync(model, 1)


def _broadcast_only(model: nn.Module, rank: int) -> None:
    handle = zb.keep_in_sync(model, rules={"*": "broadcast"})  # a plan that only broadcasts
    try:
        handle.sync()
    finally:
        handle.remove()


@contextlib.contextmanager
def _accelerator(model: nn.Module, rank: int):
    """A real DDP Accelerator on CPU around the model (its buffers are not broadcast at construction); the call saves
    with the save hook in place; Accelerate's state and the environment are put back afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    env = dict(os.environ)
    AcceleratorState._reset_state(True)
    folder = tempfile.mkdtemp(prefix=f"zb_fault{rank}_")
    try:
        accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
        accelerator.prepare(model)

        def save(m: nn.Module, r: int) -> None:
            target = os.path.join(folder, "ckpt")
            with zb.sync_buffers_on_save(accelerator, "average"):
                accelerator.save_state(target)
            shutil.rmtree(target, ignore_errors=True)
        yield save
        assert not os.path.exists(os.path.join(folder, "ckpt"))  # a failed sync wrote no checkpoint
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        AcceleratorState._reset_state(True)
        os.environ.clear()
        os.environ.update(env)


@contextlib.contextmanager
def _plain(call):
    yield call


def _gathered(model: nn.Module, rank: int) -> None:
    with zb.GatheredParametersAndBuffers(model, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.table.fill_(7.0)


def _report_of_differing(model: nn.Module, rank: int) -> None:
    zb.buffer_report(model)  # the model's buffers differ across ranks: the differing path, every collective of it


PHASE_CALLS = {  # name -> (call(model, rank), the phases it has, the error every rank raises)
    "buffer_report": (_report_of_differing, ("prepare", "exchange"), zb.SyncAbortedError),
    "assert_buffers_in_sync": (lambda m, r: zb.assert_buffers_in_sync(m), ("prepare", "exchange"),
                               zb.SyncAbortedError),
    "broadcast_buffers": (lambda m, r: zb.broadcast_buffers(m), ("prepare", "exchange"), zb.SyncAbortedError),
    "average_bn_stats": (lambda m, r: zb.average_bn_stats(m), ("prepare", "exchange"), zb.SyncAbortedError),
    "recompute_bn_stats": (lambda m, r: zb.recompute_bn_stats(m, _images(r)), ("prepare", "exchange"),
                           zb.RecomputeError),
    "sync_buffers(average)": (lambda m, r: zb.sync_buffers(m, "average"), ("prepare", "exchange"),
                              zb.SyncAbortedError),
    "sync_buffers(broadcast)": (lambda m, r: zb.sync_buffers(m, "broadcast"), ("prepare", "exchange"),
                                zb.SyncAbortedError),
    "sync_buffers(recompute)": (lambda m, r: zb.sync_buffers(m, "recompute", data=_images(r)),
                                ("prepare", "exchange"), zb.SyncAbortedError),
    "sync_buffers(rules)": (lambda m, r: zb.sync_buffers(m, rules={"codebook.ema": "mean"}),
                            ("prepare", "exchange", "after"), zb.SyncAbortedError),
    "keep_in_sync": (_keep_in_sync, ("prepare", "exchange", "after"), zb.SyncAbortedError),
    "keep_in_sync(broadcast only)": (_broadcast_only, ("prepare", "exchange"), zb.SyncAbortedError),
    "sync_buffers_on_save(Accelerator)": (_accelerator, ("prepare", "exchange", "after"), zb.SyncAbortedError),
    "BufferSyncCallback": (_callback, ("prepare", "exchange", "after"), zb.SyncAbortedError),
    "frozen_replica": (lambda m, r: zb.frozen_replica(m), ("prepare", "exchange"), zb.SyncAbortedError),
    "GatheredParametersAndBuffers": (_gathered, ("prepare", "exchange"), zb.SyncAbortedError),
}


def _state(model: nn.Module) -> dict:
    out = {f"b:{n}": b.detach().clone() for n, b in model.named_buffers()}
    out.update({f"p:{n}": p.detach().clone() for n, p in model.named_parameters()})
    out["class"] = type(model).__name__ + "/" + type(model).__module__
    return out


def _same_values(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] if isinstance(a[k], str) else bitwise_equal(a[k], b[k])
                                        for k in a)


def _fault_case(rank, world, name, phase, faulty):
    from zero_buffers._core import transaction as _transaction
    call, _, error = PHASE_CALLS[name]
    zb.register_rules(Hooked, {"ema": "mean", "derived": "local"}, after_sync=Hooked.refresh)
    real = _transaction.reached
    try:
        model = _phase_model(rank)
        with (call(model, rank) if name in SETUP else _plain(call)) as run:
            return _faulty_call(rank, run, model, phase, faulty, error, real)
    finally:
        _transaction.reached = real
        rules_mod._REGISTRY.pop(Hooked, None)


SETUP = {"sync_buffers_on_save(Accelerator)"}  # calls that build their target first (a context manager)


def _faulty_call(rank, call, model, phase, faulty, error, real):
    """``call`` on this rank, failing at ``phase`` here if this is the faulty rank; then once more, fault-free."""
    from zero_buffers._core import transaction as _transaction
    before = _state(model)

    def fail(at: _transaction.Phase, what: str) -> None:
        if at.value == phase:
            raise RuntimeError(f"injected at {phase} on rank {rank}")
        real(at, what)
    if rank == faulty:
        _transaction.reached = fail
    started = time.monotonic()
    try:
        call(model, rank)
        raised = None
    except BaseException as e:  # noqa: BLE001 - compared across ranks below
        raised = (type(e).__name__, isinstance(e, error), str(e), getattr(e, "ranks", None))
    seconds = time.monotonic() - started
    _transaction.reached = real
    unchanged = _same_values(before, _state(model))
    try:
        call(model, rank)  # and the next call works
    except zb.BuffersOutOfSyncError:
        pass  # assert_buffers_in_sync on buffers that differ: what it is for
    return {"raised": raised, "seconds": seconds, "unchanged": unchanged, "after": _state(model)}


REPORTS = ("buffer_report", "assert_buffers_in_sync")  # they change nothing, so the call after syncs nothing
CASES = [(name, phase) for name, (_, phases, _) in PHASE_CALLS.items() for phase in phases]


@pytest.mark.parametrize(("name", "phase"), CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_a_failure_on_one_rank_at_each_phase_raises_the_same_error_everywhere_and_changes_nothing(ranks, name,
                                                                                                    phase):
    world = ranks.world_size
    for faulty in sorted({world - 1, 0}):
        out = ranks.run(_fault_case, name, phase, faulty, timeout=90)
        first = out[0]["raised"]
        for r, o in enumerate(out):
            assert o["raised"] is not None, (r, name, phase, "returned normally")
            typ, typed, message, ranks_ = o["raised"]
            assert typed, (r, typ, message)  # the documented error class (or a subclass)
            assert typ == first[0] and message.split(": ", 1)[-1] == first[2].split(": ", 1)[-1], (r, o["raised"])
            assert f"injected at {phase} on rank {faulty}" in message, message  # names the rank and its reason
            assert ranks_ == (faulty,), ranks_
            assert o["seconds"] < 20, o["seconds"]  # nobody waited for a deadline
            assert o["unchanged"], (r, name, phase)  # every buffer, parameter and the class as before
        for o in out[1:] if name not in REPORTS else ():  # the call after it synced: every rank's statistics alike
            assert all(bitwise_equal(v, out[0]["after"][k]) for k, v in o["after"].items() if k.startswith("b:bn."))


def _report_cannot_allocate(rank, world):
    import time

    from zero_buffers import report as report_mod
    model = _model(rank)  # its buffers differ across ranks: the report takes its differing path
    real = report_mod._slabs
    def no_room(tensors):
        raise MemoryError("no room for a slice")
    if rank == world - 1:
        report_mod._slabs = no_room
    started = time.monotonic()
    try:
        zb.buffer_report(model)
        error = None
    except zb.SyncAbortedError as e:
        error = (str(e), e.ranks)
    finally:
        report_mod._slabs = real
    return error, time.monotonic() - started


def test_a_rank_that_cannot_allocate_the_reports_scratch_stops_every_rank_before_the_broadcasts(ranks):
    out = ranks.run(_report_cannot_allocate, timeout=60)
    last = len(out) - 1
    for error, seconds in out:
        assert error is not None and error[1] == (last,) and "MemoryError: no room for a slice" in error[0], error
        assert seconds < 20
