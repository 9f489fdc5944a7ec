"""Bad input: every public function answers a wrong argument with a typed error that names the problem.

Argument errors are raised before any collective (shown by logging every torch.distributed collective
on real ranks) and identically on every rank; tensors that cannot be sent (meta, sparse, quantized) are
refused right after the structure check, again identically on every rank, before any data moves.
"""
from __future__ import annotations

import datetime
import math
import re
import warnings

import pytest
import torch
from torch import nn

import zero_buffers as zb
from zero_buffers import _dist
from tests.helpers import bitwise_equal, log_collectives, restore_collectives, scramble

FNS = ("broadcast_buffers", "buffer_report", "assert_buffers_in_sync", "average_bn_stats")
WITH_IGNORE = FNS[:3]
WITH_ATOL = ("buffer_report", "assert_buffers_in_sync")
NOT_A_MODULE = r"{fn}\(\) expects a torch.nn.Module, got "


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model.register_buffer("codebook", torch.zeros(4))
    return model


# label -> (functions it applies to, (module or factory, kwargs), error type, message regex with {fn})
CASES: dict[str, tuple] = {
    "module=None": (FNS, (None, {}), zb.InvalidArgumentError, NOT_A_MODULE + "NoneType$"),
    "module=str": (FNS, ("model", {}), zb.InvalidArgumentError, NOT_A_MODULE + "str$"),
    "module=int": (FNS, (3, {}), zb.InvalidArgumentError, NOT_A_MODULE + "int$"),
    "module=state_dict": (FNS, (lambda: _model().state_dict(), {}), zb.InvalidArgumentError,
                          NOT_A_MODULE + r"OrderedDict \(pass the module itself"),
    "module=list of modules": (FNS, (lambda: [_model()], {}), zb.InvalidArgumentError,
                               NOT_A_MODULE + r"list \(.*wrap several in nn.ModuleList"),
    "module=a parameter": (FNS, (lambda: _model()[0].weight, {}), zb.InvalidArgumentError,
                           NOT_A_MODULE + r"Parameter \(pass the module that owns it"),
    "module=parameters()": (FNS, (lambda: _model().parameters(), {}), zb.InvalidArgumentError,
                            NOT_A_MODULE + r"generator \(pass the module itself, not module.parameters\(\)"),
    "module=a buffer": (FNS, (lambda: _model().codebook, {}), zb.InvalidArgumentError,
                        NOT_A_MODULE + r"Tensor \(pass the module that owns it"),
    "src=bool": (("broadcast_buffers",), (_model, {"src": True}), zb.InvalidSourceRankError,
                 r"src must be an int global rank, got True"),
    "src=str": (("broadcast_buffers",), (_model, {"src": "0"}), zb.InvalidSourceRankError,
                r"src must be an int global rank, got '0'"),
    "src=float": (("broadcast_buffers",), (_model, {"src": 1.0}), zb.InvalidSourceRankError,
                  r"src must be an int global rank, got 1.0"),
    "src=None": (("broadcast_buffers",), (_model, {"src": None}), zb.InvalidSourceRankError,
                 r"src must be an int global rank, got None"),
    "atol=-1": (WITH_ATOL, (_model, {"atol": -1}), zb.InvalidArgumentError, r"{fn}\(\): atol must be a number >= 0"),
    "atol=nan": (WITH_ATOL, (_model, {"atol": math.nan}), zb.InvalidArgumentError, r"atol must be a number >= 0"),
    "atol=str": (WITH_ATOL, (_model, {"atol": "0.1"}), zb.InvalidArgumentError, r"atol must be a number >= 0"),
    "atol=bool": (WITH_ATOL, (_model, {"atol": True}), zb.InvalidArgumentError, r"atol must be a number >= 0"),
    "atol=None": (WITH_ATOL, (_model, {"atol": None}), zb.InvalidArgumentError, r"atol must be a number >= 0"),
    "timeout=0": (FNS, (_model, {"timeout": 0}), zb.InvalidArgumentError, r"{fn}\(\): timeout must be > 0 seconds"),
    "timeout=-1": (FNS, (_model, {"timeout": -1}), zb.InvalidArgumentError, r"timeout must be > 0 seconds"),
    "timeout=nan": (FNS, (_model, {"timeout": math.nan}), zb.InvalidArgumentError, r"timeout must be > 0 seconds"),
    "timeout=timedelta(0)": (FNS, (_model, {"timeout": datetime.timedelta(0)}), zb.InvalidArgumentError,
                             r"timeout must be > 0 seconds"),
    "timeout=str": (FNS, (_model, {"timeout": "5"}), zb.InvalidArgumentError,
                    r"{fn}\(\): timeout must be seconds \(a number > 0\), a datetime.timedelta or None, got str"),
    "timeout=bool": (FNS, (_model, {"timeout": True}), zb.InvalidArgumentError, r"timeout must be seconds.*got bool"),
    "timeout=list": (FNS, (_model, {"timeout": [1]}), zb.InvalidArgumentError, r"timeout must be seconds.*got list"),
    "ignore=bare str": (WITH_IGNORE, (_model, {"ignore": "codebook"}), zb.InvalidArgumentError,
                        r"{fn}\(\): ignore must be a collection .* got the bare string 'codebook'; "
                        r"write ignore=\('codebook',\)"),
    "ignore=bytes": (WITH_IGNORE, (_model, {"ignore": b"codebook"}), zb.InvalidArgumentError, r"bare string"),
    "ignore=[int]": (WITH_IGNORE, (_model, {"ignore": ["codebook", 1]}), zb.InvalidArgumentError,
                     r"ignore must hold str names, got int 1"),
    "ignore=None": (WITH_IGNORE, (_model, {"ignore": None}), zb.InvalidArgumentError,
                    r"ignore must be a collection of str, got NoneType"),
    "group=int": (FNS, (_model, {"group": 5}), zb.InvalidArgumentError,
                  r"group must be a torch.distributed ProcessGroup \(or None for the default group\), got int 5"),
    "group=list of ranks": (FNS, (_model, {"group": [0, 1]}), zb.InvalidArgumentError,
                            r"group must be a torch.distributed ProcessGroup .*got list \[0, 1\]"),
}
CALLS = [(label, fn) for label, (fns, *_) in CASES.items() for fn in fns]


def _call(label: str, fn: str):
    """Run one bad call; return (error type name, message) or None if it did not raise."""
    _, (module, kwargs), _, _ = CASES[label]
    module = module() if callable(module) and not isinstance(module, nn.Module) else module
    try:
        getattr(zb, fn)(module, **kwargs)
    except zb.ZeroBuffersError as e:
        return type(e).__name__, str(e)
    return None


def _check(label: str, fn: str, got) -> None:
    _, _, etype, pattern = CASES[label]
    assert got is not None, f"{fn} accepted {label}"
    assert got[0] == etype.__name__, (label, fn, got)
    assert re.search(pattern.format(fn=fn), got[1]), (label, fn, got[1])


@pytest.mark.parametrize("label,fn", CALLS)
def test_bad_argument_without_a_process_group(monkeypatch, label, fn):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _check(label, fn, _call(label, fn))


def _bad_calls_on_ranks(rank, world):
    import torch.distributed as dist

    out = {}
    for label, fn in CALLS:
        log: list = []
        real = log_collectives(log)
        try:
            out[(label, fn)] = _call(label, fn), len(log)
        finally:
            restore_collectives(real)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group is still healthy after all of that
    return out, t.item()


def test_bad_arguments_on_two_ranks_raise_before_any_collective_the_same_everywhere(ranks2):
    out = ranks2.run(_bad_calls_on_ranks, timeout=120)
    assert out[0][0] == out[1][0] and out[0][1] == out[1][1] == 2.0  # identical on both ranks; group usable
    for (label, fn), (got, n_collectives) in out[0][0].items():
        _check(label, fn, got)
        assert n_collectives == 0, (label, fn)


def _src_out_of_range(rank, world, src):
    log: list = []
    real = log_collectives(log)
    try:
        zb.broadcast_buffers(_model(), src=src)
    except zb.InvalidSourceRankError as e:
        return str(e), log
    finally:
        restore_collectives(real)
    return None, log


@pytest.mark.parametrize("src", [2, -1, 99])
def test_src_outside_the_world_names_src_world_and_rank(ranks2, src):
    out = ranks2.run(_src_out_of_range, src)
    for rank, (message, log) in enumerate(out):
        assert message == f"src={src} is out of range for world size 2 (rank {rank})"
        assert log == [], log  # raised before any collective


@pytest.mark.parametrize("fn", FNS)
def test_uninitialised_process_group_with_world_size_in_the_environment(monkeypatch, fn):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(zb.DistributedSetupError, match=r"WORLD_SIZE=2 is set but torch.distributed has no process "
                                                       r"group; call torch.distributed.init_process_group"):
        getattr(zb, fn)(_model())
    monkeypatch.setenv("WORLD_SIZE", "1")  # a single process is a no-op, not an error
    result = getattr(zb, fn)(_model())
    assert result == 0 if fn in ("broadcast_buffers", "average_bn_stats") else not result.checked


def _unsendable(rank, world, kind, fn):
    model = nn.Module()
    model.block = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(3, device="meta" if kind == "meta" else None))
    scramble(model.block[1], rank) if kind != "meta" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensor factories
        if kind == "sparse":
            model.block[0].register_buffer("mask", torch.eye(2).to_sparse())
        if kind == "quantized":
            model.block[0].register_buffer("mask", torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8))
    log: list = []
    real = log_collectives(log)
    try:
        getattr(zb, fn)(model)
        err = None
    except zb.ZeroBuffersError as e:
        err = type(e).__name__, str(e)
    finally:
        restore_collectives(real)
    unchanged = kind == "meta" or bitwise_equal(model.block[1].running_mean, scramble(
        nn.BatchNorm1d(3), rank).running_mean)
    return err, log, unchanged


UNSENDABLE = {
    "meta": r"{fn}\(\): 3 tensor\(s\) are on the meta device and hold no data, e.g. 'block.1.running_mean'",
    "sparse": r"{fn}\(\): 1 tensor\(s\) have a sparse_coo layout, e.g. 'block.0.mask'; only dense",
    "quantized": r"{fn}\(\): 1 quantized tensor\(s\), e.g. 'block.0.mask', cannot be sent",
}


@pytest.mark.parametrize("kind,fn", [("meta", fn) for fn in FNS] + [(k, fn) for k in ("sparse", "quantized")
                                                                      for fn in WITH_IGNORE])
def test_unsendable_tensors_are_refused_on_every_rank_after_the_structure_check(ranks2, kind, fn):
    out = ranks2.run(_unsendable, kind, fn, timeout=30)  # a sparse buffer used to hang broadcast_buffers here
    assert out[0][0] == out[1][0] and out[0][0] is not None, out
    assert out[0][0][0] == "InvalidArgumentError" and re.search(UNSENDABLE[kind].format(fn=fn), out[0][0][1]), out
    for _, log, unchanged in out:
        assert log == [("all_gather", "torch.int64", 2)] and unchanged  # the structure digest, then nothing


def test_nccl_with_cpu_buffers_is_refused_naming_the_buffer():
    # No GPU here, so no nccl process group can be created: check_backend_devices (which every public
    # function calls after the structure check) is tested directly with a hand-made Group.
    entries = _dist.named_buffers(_model())
    nccl = _dist.Group(pg=None, rank=0, ranks=(0, 1), backend="nccl")
    with pytest.raises(zb.UnsupportedDeviceError, match=r"broadcast_buffers\(\): the process group's backend is "
                                                        r"nccl, which carries CUDA tensors only, but 4 tensor\(s\) "
                                                        r"are not on CUDA, e.g. 'codebook'"):
        _dist.check_backend_devices(nccl, entries, "broadcast_buffers")
    _dist.check_backend_devices(_dist.Group(pg=None, rank=0, ranks=(0, 1), backend="gloo"), entries, "x")
    _dist.check_backend_devices(nccl, [], "x")  # nothing to send: nothing to refuse


def _edge_but_valid(rank, world):
    model = scramble(_model(), rank)
    n = zb.broadcast_buffers(model, timeout=1e10, ignore=iter(["0"]))  # 1e10 s used to "time out" at once
    report = zb.buffer_report(model, timeout=math.inf, atol=math.inf, ignore=set())
    merged = zb.average_bn_stats(model, timeout=datetime.timedelta(seconds=60))
    zb.assert_buffers_in_sync(model, timeout=30, ignore=())
    return n, report.in_sync, merged, model.codebook.clone()


def test_edge_values_that_are_valid_are_accepted(ranks2):
    out = ranks2.run(_edge_but_valid, timeout=60)
    assert [o[:3] for o in out] == [(4, True, 1)] * 2
    assert bitwise_equal(out[0][3], out[1][3])


def test_check_timeout_normalises():
    assert _dist.check_timeout(None, "f") is None and _dist.check_timeout(math.inf, "f") is None
    assert _dist.check_timeout(1e10, "f") is None  # beyond what c10d's clock can add: wait without a limit
    assert _dist.check_timeout(2, "f") == datetime.timedelta(seconds=2)
    assert _dist.check_timeout(datetime.timedelta(seconds=3), "f") == datetime.timedelta(seconds=3)


def _timeout_calls(timeout):
    """Every public entry point that takes ``timeout``, called with it (no process group)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from tests.helpers import ZERO3_CONFIG
    x = torch.randn(8, 3)
    acc = Accelerator(cpu=True)
    try:
        yield "broadcast_buffers", lambda: zb.broadcast_buffers(_model(), timeout=timeout)
        yield "buffer_report", lambda: zb.buffer_report(_model(), timeout=timeout)
        yield "assert_buffers_in_sync", lambda: zb.assert_buffers_in_sync(_model(), timeout=timeout)
        yield "average_bn_stats", lambda: zb.average_bn_stats(_model(), timeout=timeout)
        yield "recompute_bn_stats", lambda: zb.recompute_bn_stats(_model(), x, timeout=timeout, progress=False)
        yield "sync_buffers", lambda: zb.sync_buffers(_model(), "average", timeout=timeout)
        yield "sync_buffers_on_save", lambda: zb.sync_buffers_on_save(acc, "broadcast", timeout=timeout).remove()
        yield "frozen_replica", lambda: zb.frozen_replica(_model(), timeout=timeout)
        yield "GatheredParametersAndBuffers", lambda: zb.GatheredParametersAndBuffers(_model(), timeout=timeout)
        yield "zero_buffers.Init", lambda: zb.Init(config_dict_or_path=ZERO3_CONFIG, timeout=timeout, enabled=False)
        yield "install", lambda: zb.install(timeout=timeout).__exit__(None, None, None)
    finally:
        AcceleratorState._reset_state(True)


@pytest.mark.parametrize("timeout", [0, -1, "5", math.nan])
def test_every_public_timeout_is_validated_at_the_call(monkeypatch, timeout):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for fn, call in _timeout_calls(timeout):
        with pytest.raises(zb.InvalidArgumentError, match=re.escape(f"{fn}(): timeout must be")):
            call()
        assert not zb.installed()
    for fn, call in _timeout_calls(math.inf):  # "no limit" is accepted everywhere (a real zero.Init needs ranks)
        if fn != "zero_buffers.Init":
            call()
