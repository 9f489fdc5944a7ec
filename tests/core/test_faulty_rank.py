"""One faulty rank per phase: for every public function that syncs, a failure raised on one rank at each phase of its
transaction ([Note: the transaction]: PREPARE, before the vote; EXCHANGE, in the exchange; AFTER, the post-write
hooks, where a call has them) makes every rank raise the same typed error naming that rank, within seconds under the
default ``timeout=None`` (a rank left waiting would sit 300 s in a collective), with nothing changed anywhere (every
buffer and parameter, the module's class), and the next call works.

The failure is injected by replacing ``zero_buffers._core.transaction.reached`` on the faulty rank only: every
transaction calls it at the start of each fallible phase's work. Real gloo ranks at world 2 and 4; the faulty rank is
the last (a receiver) and, separately, rank 0 (the source of every broadcast).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal, scramble
from zero_buffers.training import rules as rules_mod


class Hooked(nn.Module):
    """An EMA codebook whose registered rules recompute a derived buffer after every sync (an after_sync hook)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("derived", torch.zeros(4))

    def refresh(self) -> None:
        self.derived.copy_(self.ema * 2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.codebook = Hooked()
        self.register_buffer("table", torch.zeros(6))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).mean((2, 3))


def _model(rank: int) -> Net:
    torch.manual_seed(0)
    model = scramble(Net(), rank)
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


CALLS = {  # name -> (call(model, rank), the phases it has, the error every rank raises)
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


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] if isinstance(a[k], str) else bitwise_equal(a[k], b[k])
                                        for k in a)


def _fault_case(rank, world, name, phase, faulty):
    from zero_buffers._core import transaction as _transaction
    call, _, error = CALLS[name]
    zb.register_rules(Hooked, {"ema": "mean", "derived": "local"}, after_sync=Hooked.refresh)
    real = _transaction.reached
    try:
        model = _model(rank)
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
    unchanged = _same(before, _state(model))
    try:
        call(model, rank)  # and the next call works
    except zb.BuffersOutOfSyncError:
        pass  # assert_buffers_in_sync on buffers that differ: what it is for
    return {"raised": raised, "seconds": seconds, "unchanged": unchanged, "after": _state(model)}


REPORTS = ("buffer_report", "assert_buffers_in_sync")  # they change nothing, so the call after syncs nothing
CASES = [(name, phase) for name, (_, phases, _) in CALLS.items() for phase in phases]


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
