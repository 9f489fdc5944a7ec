"""The quiet ways a sync goes wrong, each made loud: a call on rank 0 only, an average of statistics every rank
already shares, a call in one process, an Accelerate save the hooks cannot cover, a report of hundreds of
buffers, progress bars in logs."""
from __future__ import annotations

import io
import os
import time
import warnings
from contextlib import redirect_stderr

import pytest
import torch
from torch import nn

import zero_buffers as zb
from zero_buffers._core import args as _args, wire as _wire


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


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
    for first, second in ranks.run(_average_identical, timeout=60):
        assert len(first) == 1 and "already held the same BatchNorm statistics" in first[0]
        assert "recompute_bn_stats" in first[0] and "broadcast_buffers=True" in first[0]
        assert second == []  # diverged statistics: a real merge, no warning


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


def _accelerate_save_model(rank, world, folder):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    env = dict(os.environ)
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
        model = accelerator.prepare(bn_net())
        model(torch.randn(8, 3) + 3 * rank)
        hook = zb.sync_buffers_on_save(accelerator, "average")
        messages = []
        if accelerator.is_main_process:  # the usual pattern: no collective may run here
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                for _ in range(2):  # once per method and process
                    accelerator.save_model(model, folder)
                    accelerator.get_state_dict(model)
            messages = [str(w.message) for w in seen if issubclass(w.category, zb.ZeroBuffersWarning)]
        accelerator.wait_for_everyone()
        hook.remove()
        return messages, accelerator.unwrap_model(model)[1].running_mean.clone()
    finally:
        AcceleratorState._reset_state(True)
        os.environ.clear()
        os.environ.update(env)


def test_accelerate_save_model_and_get_state_dict_on_the_main_process_warn_once_and_do_not_hang(ranks2, tmp_path):
    from safetensors.torch import load_file

    from zero_buffers._core import notice as _notice

    (m0, mean0), (m1, _) = ranks2.run(_accelerate_save_model, str(tmp_path), timeout=120)
    assert len(m0) == 2 and "accelerator.save_model() writes the model's buffers as this rank holds them" in m0[0]
    assert "accelerator.get_state_dict() writes" in m0[1] and m1 == []
    assert "sync_buffers(model, 'average') on every rank first" in m0[0]
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(saved["1.running_mean"], mean0)  # rank 0's statistics, as the warning says
    _notice._SEEN.clear()


def test_a_report_of_hundreds_of_buffers_is_short_unless_asked():
    model = nn.Sequential(*[nn.BatchNorm1d(2) for _ in range(50)])
    report = zb.buffer_report(model)
    short, full = report.format(), report.format(full=True)
    assert len(short.splitlines()) == 3 and "150 buffers in sync not shown" in short and str(report) == short
    assert len(full.splitlines()) == 2 + 150
    small = zb.buffer_report(bn_net())
    assert len(small.format().splitlines()) == 2 + 3  # a small model: every row


def test_progress_defaults_to_a_terminal_and_never_writes_carriage_returns_into_logs():
    data = [torch.randn(8, 3) for _ in range(3)]
    for call in (lambda p: zb.recompute_bn_stats(bn_net(), data, **p),
                 lambda p: zb.sync_buffers(bn_net(), "recompute", data=data, **p)):
        log = io.StringIO()  # not a terminal
        with redirect_stderr(log), warnings.catch_warnings():
            warnings.simplefilter("ignore", zb.ZeroBuffersWarning)
            call({})
        assert "\r" not in log.getvalue() and "recompute_bn_stats" not in log.getvalue()
        forced = io.StringIO()
        with redirect_stderr(forced), warnings.catch_warnings():
            warnings.simplefilter("ignore", zb.ZeroBuffersWarning)
            call({"progress": True})
        assert "recompute_bn_stats" in forced.getvalue()
    with pytest.raises(zb.InvalidArgumentError, match="progress"):
        zb.recompute_bn_stats(bn_net(), data, progress="yes")
