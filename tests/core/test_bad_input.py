"""Bad input: every public function answers a wrong argument with a typed error that names the problem.

Table-driven: every (public function, bad-argument kind) case runs in one go, without a process group in the
pytest process and on 2 real ranks inside ONE pool task (every torch.distributed collective logged: none may be
issued, and every rank must raise the same error). Tensors that cannot be sent (meta, sparse, quantized) or written
(inference tensors, made under ``torch.inference_mode()``) are refused right after the structure agreement,
identically on every rank, naming them, before any data moves: the writes after the vote only copy, so whatever
could make one fail is found before it."""
from __future__ import annotations

import datetime
import math
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import ZERO3_CONFIG, bitwise_equal, check_table, logged_call, messages, run_table, scramble
from zero_buffers._core import args as _args, group as _group, modules as _modules, transaction as _transaction

DIGEST = ("all_gather", "torch.int64", 3)


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model.register_buffer("codebook", torch.zeros(4))
    return model


def _gathered_with(target, **kw):
    """GatheredParametersAndBuffers(modifier_rank=0) (its rank argument is modifier_rank)."""
    kw = {("modifier_rank" if k == "src" else k): v for k, v in kw.items()}
    return zb.GatheredParametersAndBuffers(target, **{"modifier_rank": 0, **kw})


def _sync(fn):
    def call(target, **kw):
        return fn(target, kw.pop("policy", "broadcast"), **kw)
    return call


# name -> (call(target, **kwargs), the argument kinds it takes)
PUBLIC = {
    "broadcast_buffers": (zb.broadcast_buffers, ("module", "src", "ignore", "timeout", "group")),
    "buffer_report": (zb.buffer_report, ("module", "atol", "ignore", "timeout", "group")),
    "assert_buffers_in_sync": (zb.assert_buffers_in_sync, ("module", "atol", "ignore", "timeout", "group")),
    "average_bn_stats": (zb.average_bn_stats, ("module", "timeout", "group")),
    "recompute_bn_stats": (lambda m, **kw: zb.recompute_bn_stats(m, torch.zeros(2, 3), progress=False, **kw),
                           ("module", "timeout", "group", "num_batches", "forward")),
    "sync_buffers": (_sync(zb.sync_buffers), ("module", "src", "timeout", "group", "policy")),
    "sync_buffers_on_save": (_sync(zb.sync_buffers_on_save), ("target", "src", "timeout", "policy", "reused data")),
    "frozen_replica": (zb.frozen_replica, ("module", "src", "timeout", "group")),
    "GatheredParametersAndBuffers": (_gathered_with, ("params", "src", "atol", "timeout", "group")),
    # DeepSpeed's Init and install() take ranks and timeouts too; they need DeepSpeed, so only without a process group
    "zero_buffers.Init": (lambda t, **kw: zb.Init(config_dict_or_path=ZERO3_CONFIG, enabled=False, **kw),
                          ("src", "timeout")),
    "install": (lambda t, **kw: zb.install(**kw), ("src", "timeout")),
}
RANKS_SKIP = ("zero_buffers.Init", "install")
RANK_NAME = {"GatheredParametersAndBuffers": "modifier_rank"}
OPTIONAL = {"GatheredParametersAndBuffers": " or None"}  # modifier_rank=None is valid
DELEGATED: dict[tuple[str, str], str] = {}  # (function, kind) -> the name its error carries, when not its own
NOT_A_MODULE = r"^{fn}\(\) expects a torch.nn.Module, got "

# label -> (argument kind, target (or a factory), kwargs, error type, message pattern ({fn}, {name}, {opt}))
CASES: dict[str, tuple] = {
    "module=None": ("module", None, {}, zb.InvalidArgumentError, NOT_A_MODULE + "NoneType$"),
    "module=str": ("module", "model", {}, zb.InvalidArgumentError, NOT_A_MODULE + "str$"),
    "module=int": ("module", 3, {}, zb.InvalidArgumentError, NOT_A_MODULE + "int$"),
    "module=state_dict": ("module", lambda: _model().state_dict(), {}, zb.InvalidArgumentError,
                          NOT_A_MODULE + r"OrderedDict \(pass the module itself"),
    "module=list of modules": ("module", lambda: [_model()], {}, zb.InvalidArgumentError,
                               NOT_A_MODULE + r"list \(.*wrap several in nn.ModuleList"),
    "module=a parameter": ("module", lambda: _model()[0].weight, {}, zb.InvalidArgumentError,
                           NOT_A_MODULE + r"Parameter \(pass the module that owns it"),
    "module=parameters()": ("module", lambda: _model().parameters(), {}, zb.InvalidArgumentError,
                            NOT_A_MODULE + r"generator \(pass the module itself, not module.parameters\(\)"),
    "module=a buffer": ("module", lambda: _model().codebook, {}, zb.InvalidArgumentError,
                        NOT_A_MODULE + r"Tensor \(pass the module that owns it"),
    # GatheredParametersAndBuffers takes what GatheredParameters takes (None, tensors, iterables) plus modules
    "params=str": ("params", "model", {}, zb.InvalidArgumentError,
                   r"^{fn}: expected a module, a parameter, or an iterable of them, got str 'model'"),
    "params=int": ("params", 3, {}, zb.InvalidArgumentError,
                   r"^{fn}: expected a module, a parameter, or an iterable of them, got int 3"),
    "params=state_dict": ("params", lambda: _model().state_dict(), {}, zb.InvalidArgumentError,
                          r"^{fn}: item 0 is a str; expected modules, parameters, None"),
    "params=set of modules": ("params", lambda: {_model(), _model()}, {}, zb.InvalidArgumentError,
                              r"^{fn}: modules are matched across ranks by their position, and a set has no order"),
    "target=a module": ("target", _model, {}, zb.InvalidArgumentError,
                        r"^{fn}\(\) expects an accelerate.Accelerator or a DeepSpeed engine, got Sequential"),
    "src=bool": ("src", _model, {"src": True}, zb.InvalidSourceRankError,
                 r"^{fn}\(\): {name} must be a non-negative int rank{opt}, got True$"),
    "src=str": ("src", _model, {"src": "0"}, zb.InvalidSourceRankError,
                r"^{fn}\(\): {name} must be a non-negative int rank{opt}, got '0'$"),
    "src=float": ("src", _model, {"src": 1.0}, zb.InvalidSourceRankError,
                  r"^{fn}\(\): {name} must be a non-negative int rank{opt}, got 1.0$"),
    "src=float tensor": ("src", _model, {"src": torch.tensor(1.0)}, zb.InvalidSourceRankError,
                         r"^{fn}\(\): {name} must be a non-negative int rank{opt}, got tensor\(1.\)$"),
    "src=None": ("src", _model, {"src": None}, zb.InvalidSourceRankError,
                 r"^{fn}\(\): {name} must be a non-negative int rank, got None$"),
    "src=-1": ("src", _model, {"src": -1}, zb.InvalidSourceRankError,
               r"^{fn}\(\): {name} must be a non-negative int rank{opt}, got -1$"),
    # outside the world: only a process group knows (without one, only rank 0 exists)
    "src=2": ("src range", _model, {"src": 2}, zb.InvalidSourceRankError,
              r"^{fn}\(\): {name}=2 is not a rank of the world: ranks are counted within the group, 0 to 1 "
              r"\(rank [01]\)$"),
    "src=99": ("src range", _model, {"src": np.int64(99)}, zb.InvalidSourceRankError,
               r"^{fn}\(\): {name}=99 is not a rank of the world: ranks are counted within the group, 0 to 1"),
    "atol=-1": ("atol", _model, {"atol": -1}, zb.InvalidArgumentError,
                r"^{fn}\(\): atol must be a number >= 0, got -1$"),
    "atol=nan": ("atol", _model, {"atol": math.nan}, zb.InvalidArgumentError, r"^{fn}\(\): atol must be a number >= 0"),
    "atol=str": ("atol", _model, {"atol": "0.1"}, zb.InvalidArgumentError, r"^{fn}\(\): atol must be a number >= 0"),
    "atol=bool": ("atol", _model, {"atol": True}, zb.InvalidArgumentError, r"^{fn}\(\): atol must be a number >= 0"),
    "atol=None": ("atol", _model, {"atol": None}, zb.InvalidArgumentError, r"^{fn}\(\): atol must be a number >= 0"),
    "timeout=0": ("timeout", _model, {"timeout": 0}, zb.InvalidArgumentError,
                  r"^{fn}\(\): timeout must be > 0 seconds \(float\('inf'\) waits forever\), got 0$"),
    "timeout=-1": ("timeout", _model, {"timeout": -1}, zb.InvalidArgumentError,
                   r"^{fn}\(\): timeout must be > 0 seconds"),
    "timeout=nan": ("timeout", _model, {"timeout": math.nan}, zb.InvalidArgumentError,
                    r"^{fn}\(\): timeout must be > 0 seconds"),
    "timeout=timedelta(0)": ("timeout", _model, {"timeout": datetime.timedelta(0)}, zb.InvalidArgumentError,
                             r"^{fn}\(\): timeout must be > 0 seconds"),
    "timeout=str": ("timeout", _model, {"timeout": "5"}, zb.InvalidArgumentError,
                    r"^{fn}\(\): timeout must be seconds \(a number > 0\), a datetime.timedelta or None, got str"),
    "timeout=bool": ("timeout", _model, {"timeout": True}, zb.InvalidArgumentError,
                     r"^{fn}\(\): timeout must be seconds.*got bool"),
    "timeout=list": ("timeout", _model, {"timeout": [1]}, zb.InvalidArgumentError,
                     r"^{fn}\(\): timeout must be seconds.*got list"),
    "ignore=bare str": ("ignore", _model, {"ignore": "codebook"}, zb.InvalidArgumentError,
                        r"^{fn}\(\): ignore must be a collection .* got the bare string 'codebook'; "
                        r"write ignore=\('codebook',\)$"),
    "ignore=bytes": ("ignore", _model, {"ignore": b"codebook"}, zb.InvalidArgumentError,
                     r"^{fn}\(\): ignore must be a collection .*bare string"),
    "ignore=[int]": ("ignore", _model, {"ignore": ["codebook", 1]}, zb.InvalidArgumentError,
                     r"^{fn}\(\): ignore must hold str names, got int 1$"),
    "ignore=None": ("ignore", _model, {"ignore": None}, zb.InvalidArgumentError,
                    r"^{fn}\(\): ignore must be a collection of str, got NoneType$"),
    "group=int": ("group", _model, {"group": 5}, zb.InvalidArgumentError,
                  r"^{fn}\(\): group must be a torch.distributed ProcessGroup, a DeviceMesh, \(DeviceMesh, dimension "
                  r"name\) or None for the default group, got int 5$"),
    "group=list of ranks": ("group", _model, {"group": [0, 1]}, zb.InvalidArgumentError,
                            r"^{fn}\(\): group must be a torch.distributed ProcessGroup, .*got list \[0, 1\]$"),
    "num_batches=-1": ("num_batches", _model, {"num_batches": -1}, zb.InvalidArgumentError,
                       r"^{fn}\(\): num_batches must be None or an int >= 0, got -1$"),
    "num_batches=1.5": ("num_batches", _model, {"num_batches": 1.5}, zb.InvalidArgumentError,
                        r"^{fn}\(\): num_batches must be None or an int >= 0, got 1.5$"),
    "num_batches=bool": ("num_batches", _model, {"num_batches": True}, zb.InvalidArgumentError,
                         r"^{fn}\(\): num_batches must be None or an int >= 0, got True$"),
    "forward=int": ("forward", _model, {"forward": 3}, zb.InvalidArgumentError,
                    r"^{fn}\(\): forward must be a callable \(model, batch\) -> output, got 3$"),
    "policy=unknown": ("policy", _model, {"policy": "mean"}, zb.InvalidArgumentError,
                       r"^{fn}\(\): policy must be one of 'broadcast', 'average', 'recompute', 'check', got 'mean'$"),
    "policy=recompute without data": ("policy", _model, {"policy": "recompute"}, zb.InvalidArgumentError,
                                      r"^{fn}\(\): policy 'recompute' needs data="),
    "data without recompute": ("policy", _model, {"data": [torch.zeros(2, 3)]}, zb.InvalidArgumentError,
                               r"^{fn}\(\): data= is only used by policy 'recompute', not 'broadcast'$"),
    "data=one-shot iterator": ("reused data", _model, {"policy": "recompute", "data": iter([torch.zeros(2, 3)])},
                               zb.InvalidArgumentError, r"^{fn}\(\): data is a one-shot iterator \(list_iterator\)"),
}
NO_PROCESS_GROUP = {  # what the same calls say when there is no process group at all
    "src=2": r"^{fn}\(\): {name}=2 but torch.distributed is not initialised \(the only rank is 0\)$",
    "src=99": r"^{fn}\(\): {name}=99 but torch.distributed is not initialised \(the only rank is 0\)$",
}
RANGE_CHECKED = ("broadcast_buffers", "sync_buffers", "frozen_replica", "GatheredParametersAndBuffers")


def _calls(on_ranks: bool) -> list[str]:
    out = []
    for label, (kind, *_) in CASES.items():
        for fn, (_, kinds) in PUBLIC.items():
            if kind not in kinds or (on_ranks and fn in RANKS_SKIP):
                continue
            if kind == "src range" and fn not in RANGE_CHECKED:
                continue  # the rank is checked against the group at the save (on_save) or exit (Init, install)
            if label == "src=None" and fn in OPTIONAL:
                continue  # modifier_rank=None is DeepSpeed's read-only gather
            out.append(f"{fn}/{label}")
    return out


def _call(name: str):
    """Run one bad call; return (error type name, message), or None if it did not raise (and undo its effect)."""
    fn, label = name.split("/")
    call = PUBLIC[fn][0]
    _, target, kwargs, _, _ = CASES[label]
    target = target() if callable(target) and not isinstance(target, nn.Module) else target
    try:
        result = call(target, **dict(kwargs))
    except zb.ZeroBuffersError as e:
        return type(e).__name__, str(e)
    if hasattr(result, "remove"):
        result.remove()
    if zb.installed():
        zb.uninstall()
    return None


def _expected(name: str, with_group: bool) -> tuple[type, str]:
    fn, label = name.split("/")
    kind, _, _, etype, pattern = CASES[label]
    if not with_group:
        pattern = NO_PROCESS_GROUP.get(label, pattern)
    shown = DELEGATED.get((fn, "src range" if kind == "src range" else kind), fn)
    return etype, pattern.format(fn=re.escape(shown), name=RANK_NAME.get(fn, "src"), opt=OPTIONAL.get(fn, ""))


def _check(name: str, got, with_group: bool) -> None:
    etype, pattern = _expected(name, with_group)
    assert got is not None, "accepted"
    assert got[0] == etype.__name__, got
    assert re.search(pattern, got[1]), (pattern, got[1])


def test_bad_argument_without_a_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    names = _calls(on_ranks=False)
    results = {name: _call(name) for name in names}
    assert not zb.installed()
    check_table(names, [{n: {"got": g} for n, g in results.items()}], lambda n, res: _check(n, res[0]["got"], False))


def _bad_calls_on_ranks(rank, world, names):
    import torch.distributed as dist

    def case(name):
        out = logged_call(lambda: _call(name))
        return {"got": out["value"], "log": out["log"], "crash": out["error"]}

    results = run_table(world, names, case)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group is still healthy after all of that
    return results, t.item()


def test_bad_arguments_on_two_ranks_raise_before_any_collective_the_same_everywhere(ranks2):
    names = _calls(on_ranks=True)
    out = ranks2.run(_bad_calls_on_ranks, names, timeout=120)
    assert [healthy for _, healthy in out] == [2.0, 2.0]

    def check(name, res):
        assert all(r["crash"] is None for r in res), [r["crash"] for r in res]  # only our own errors
        _check(name, res[0]["got"], True)
        if CASES[name.split("/")[1]][0] == "src range":  # each rank names itself
            assert all(r["got"][1].endswith(f"(rank {rank})") for rank, r in enumerate(res)), res
        same = [re.sub(r"\(rank \d\)$", "(rank R)", r["got"][1]) for r in res]
        assert all(s == same[0] for s in same) and res[0]["got"][0] == res[1]["got"][0], same
        assert all(r["log"] == [] for r in res), [r["log"] for r in res]  # not a single collective

    check_table(names, [r for r, _ in out], check)


# sync_buffers checks src against the group at the call, before any collective, whatever the policy
SYNC_SRC_BUGS = ("average", "recompute", "check")


def _sync_src_out_of_range(rank, world, names):
    import torch.distributed as dist

    def case(policy):
        model = scramble(_model(), rank)
        before = {n: b.clone() for n, b in model.named_buffers()}
        data = [torch.randn(4, 3)] if policy == "recompute" else None
        out = logged_call(lambda: zb.sync_buffers(model, policy, src=2, data=data))
        out["unchanged"] = all(bitwise_equal(b, before[n]) for n, b in model.named_buffers())
        return out

    results = run_table(world, names, case)
    dist.all_reduce(torch.ones(1))
    return results


def test_sync_buffers_refuses_a_src_outside_the_group_before_any_collective(ranks2):
    def check(policy, res):
        for r in res:
            assert r["error"] is not None and r["error"][0] == "InvalidSourceRankError", r["error"]
            message = r["error"][1]
            assert re.match(r"(sync|broadcast)_buffers\(\): src=2 is not a rank of the world", message), message
            assert r["log"] == [] and r["unchanged"], r["log"]

    check_table(SYNC_SRC_BUGS, ranks2.run(_sync_src_out_of_range, SYNC_SRC_BUGS, timeout=60), check)


# Functions that need a process group for their work; without one, WORLD_SIZE > 1 is a setup error.
NEEDS_A_GROUP = {
    "broadcast_buffers": lambda m: zb.broadcast_buffers(m),
    "buffer_report": lambda m: zb.buffer_report(m),
    "assert_buffers_in_sync": lambda m: zb.assert_buffers_in_sync(m),
    "average_bn_stats": lambda m: zb.average_bn_stats(m),
    "recompute_bn_stats": lambda m: zb.recompute_bn_stats(m, torch.randn(4, 3), progress=False),
    "sync_buffers": lambda m: zb.sync_buffers(m, "average"),
    "frozen_replica": lambda m: zb.frozen_replica(m),
    "GatheredParametersAndBuffers": lambda m: zb.GatheredParametersAndBuffers(m, modifier_rank=0),
}


def test_uninitialised_process_group_with_world_size_in_the_environment(monkeypatch):
    failures = []
    for fn, call in NEEDS_A_GROUP.items():
        monkeypatch.setenv("WORLD_SIZE", "2")
        model = scramble(_model(), 0)
        before = {n: b.clone() for n, b in model.named_buffers()}
        with pytest.raises(zb.DistributedSetupError) as info:
            call(model)
        shown = fn
        if not re.search(rf"^{shown}\(\): WORLD_SIZE=2 is set but torch.distributed has no process group; call "
                         r"torch.distributed.init_process_group", str(info.value)):
            failures.append(f"{fn}: {info.value}")
        if not all(bitwise_equal(b, before[n]) for n, b in model.named_buffers()):
            failures.append(f"{fn}: changed buffers")
        monkeypatch.setenv("WORLD_SIZE", "1")  # a single process works alone: no error
        call(model)
    assert not failures, failures


def _unsendable_model(rank: int, kind: str) -> nn.Module:
    model = nn.Module()
    model.block = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(3, device="meta" if kind == "meta" else None))
    if kind != "meta":
        scramble(model.block, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensor factories
        if kind == "sparse":
            model.block[0].register_buffer("mask", torch.eye(2).to_sparse())
        if kind == "quantized":
            model.block[0].register_buffer("mask", torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8))
    return model


def _gathered(model):
    with zb.GatheredParametersAndBuffers(model, modifier_rank=0):
        pass


UNSENDABLE_FNS = {  # name -> (call, the function named in the message, agreement gathers first, kinds it sees)
    "broadcast_buffers": (zb.broadcast_buffers, "broadcast_buffers", 1, ("meta", "sparse", "quantized")),
    "buffer_report": (zb.buffer_report, "buffer_report", 1, ("meta", "sparse", "quantized")),
    "assert_buffers_in_sync": (zb.assert_buffers_in_sync, "assert_buffers_in_sync", 1, ("meta", "sparse", "quantized")),
    "average_bn_stats": (zb.average_bn_stats, "average_bn_stats", 1, ("meta",)),
    "recompute_bn_stats": (lambda m: zb.recompute_bn_stats(m, torch.zeros(2, 3), progress=False),
                           "recompute_bn_stats", 1, ("meta",)),
    "sync_buffers(broadcast)": (lambda m: zb.sync_buffers(m, "broadcast"), "sync_buffers", 1,
                                ("meta", "sparse", "quantized")),
    "sync_buffers(average)": (lambda m: zb.sync_buffers(m, "average"), "sync_buffers", 1,
                              ("meta", "sparse", "quantized")),
    "sync_buffers(check)": (lambda m: zb.sync_buffers(m, "check"), "assert_buffers_in_sync", 1,
                            ("meta", "sparse", "quantized")),
    # an agreement on enter (ZeRO parameters: none), then the buffers'; the weights count as tensors here
    "frozen_replica": (zb.frozen_replica, "frozen_replica", [DIGEST, ("all_gather", "torch.int64", 1), DIGEST],
                       ("meta", "sparse", "quantized")),  # what to gather, the vote on converting, what to send
    "GatheredParametersAndBuffers": (_gathered, "GatheredParametersAndBuffers", 2, ("meta", "sparse", "quantized")),
}
UNSENDABLE = {
    "meta": r"^{fn}\(\): {n} tensor\(s\) are on the meta device and hold no data, e.g. '{first}'. Materialise",
    "sparse": r"^{fn}\(\): 1 tensor\(s\) have a sparse_coo layout, e.g. 'block.0.mask'; only dense",
    "quantized": r"^{fn}\(\): 1 quantized tensor\(s\), e.g. 'block.0.mask', cannot be sent by torch.distributed",
}
META = {"frozen_replica": (5, "block.1.weight"), "GatheredParametersAndBuffers": (5, "block.1.running_mean")}
UNSENDABLE_CASES = [f"{fn}/{kind}" for fn, (*_, kinds) in UNSENDABLE_FNS.items() for kind in kinds]


def _unsendable(rank, world, names):
    def case(name):
        fn, kind = name.split("/")
        model = _unsendable_model(rank, kind)
        before = (type(model.block[1]).__name__, None if kind == "meta" else model.block[1].running_mean.clone(),
                  [n for n, _ in model.named_parameters()])
        out = logged_call(lambda: UNSENDABLE_FNS[fn][0](model))
        after = (type(model.block[1]).__name__, None if kind == "meta" else model.block[1].running_mean.clone(),
                 [n for n, _ in model.named_parameters()])
        out["unchanged"] = before[0] == after[0] and before[2] == after[2] and (
            kind == "meta" or bitwise_equal(before[1], after[1]))
        return out

    return run_table(world, names, case)


def test_unsendable_tensors_are_refused_on_every_rank_after_the_structure_check(ranks2):
    def check(name, res):
        fn, kind = name.split("/")
        _, shown, digests, _ = UNSENDABLE_FNS[fn]
        n, first = META.get(fn, (3, "block.1.running_mean"))
        pattern = UNSENDABLE[kind].format(fn=re.escape(shown), n=n, first=re.escape(first))
        errors = [r["error"] for r in res]
        assert errors[0] is not None and all(e == errors[0] for e in errors), errors
        assert errors[0][0] == "InvalidArgumentError" and re.search(pattern, errors[0][1]), (pattern, errors[0])
        agreements = digests if isinstance(digests, list) else [DIGEST] * digests
        for r in res:  # the structure agreement, then nothing; the module as it was (frozen_replica rolled back)
            assert r["log"] == agreements and r["unchanged"], r["log"]

    check_table(UNSENDABLE_CASES, ranks2.run(_unsendable, UNSENDABLE_CASES, timeout=60), check)


def test_nccl_with_cpu_buffers_is_refused_naming_the_buffer():
    # No nccl process group can be made here (and one GPU cannot hold two nccl ranks), so the check that every
    # public function runs right after the structure agreement is called directly, on hand-made groups.
    entries = _modules.named_buffers(_model())
    nccl = _group.Group(pg=None, ranks=(0, 1), me=0, backend="nccl")
    err = _transaction.unsendable(nccl, entries, "broadcast_buffers")
    assert isinstance(err, zb.UnsupportedDeviceError), err
    assert re.search(r"^broadcast_buffers\(\): the process group's backend is nccl, which carries CUDA tensors only, "
                     r"but 4 tensor\(s\) are not on CUDA, e.g. 'codebook'. Move the module to the GPU", str(err)), err
    assert _transaction.unsendable(_group.Group(pg=None, ranks=(0, 1), me=0, backend="gloo"), entries, "x") is None
    assert _transaction.unsendable(nccl, [], "x") is None  # nothing to send: nothing to refuse


def _edge_but_valid(rank, world):
    model = scramble(_model(), rank)
    n = zb.broadcast_buffers(model, timeout=1e10, ignore=iter(["0"]))  # 1e10 s used to "time out" at once
    report = zb.buffer_report(model, timeout=math.inf, atol=math.inf, ignore=set())
    merged = zb.average_bn_stats(model, timeout=datetime.timedelta(seconds=60))
    zb.assert_buffers_in_sync(model, timeout=30, ignore=())
    # rank arguments: NumPy ints and 0-dim integer tensors are ranks too
    by_numpy, by_tensor = scramble(_model(), rank), scramble(_model(), rank)
    zb.broadcast_buffers(by_numpy, src=np.int64(1))
    zb.frozen_replica(by_tensor, src=torch.tensor(1))
    return n, report.in_sync, merged, model.codebook.clone(), by_numpy.codebook.clone(), by_tensor.codebook.clone()


def test_edge_values_that_are_valid_are_accepted(ranks2):
    out = ranks2.run(_edge_but_valid, timeout=60)
    assert [o[:3] for o in out] == [(4, True, 1)] * 2
    assert bitwise_equal(out[0][3], out[1][3])
    rank1 = scramble(_model(), 1).codebook
    assert not bitwise_equal(scramble(_model(), 0).codebook, rank1)
    for o in out:
        assert bitwise_equal(o[4], rank1) and bitwise_equal(o[5], rank1)  # src=1 in either spelling: rank 1's values


def test_timeout_normalises_to_seconds_inf_or_the_default():
    assert _args.timeout(None, "f") is None  # the default: a bound per collective (tests/core/test_rank_faults.py)
    assert _args.timeout(math.inf, "f") == math.inf
    assert _args.timeout(1e10, "f") == math.inf  # beyond what c10d's clock can add: wait without a limit
    assert _args.timeout(2, "f") == 2.0 and isinstance(_args.timeout(2, "f"), float)
    assert _args.timeout(datetime.timedelta(seconds=3), "f") == 3.0
    assert _args.timeout(0.25, "f") == 0.25


def test_unbounded_timeouts_are_accepted_by_every_public_function(monkeypatch):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    acc = Accelerator(cpu=True)
    try:
        for timeout in (math.inf, 1e10, None):
            zb.broadcast_buffers(_model(), timeout=timeout)
            zb.buffer_report(_model(), timeout=timeout)
            zb.assert_buffers_in_sync(_model(), timeout=timeout)
            zb.average_bn_stats(_model(), timeout=timeout)
            zb.recompute_bn_stats(_model(), torch.randn(8, 3), timeout=timeout, progress=False)
            zb.sync_buffers(_model(), "average", timeout=timeout)
            zb.sync_buffers_on_save(acc, "broadcast", timeout=timeout).remove()
            zb.frozen_replica(_model(), timeout=timeout)
            with zb.GatheredParametersAndBuffers(_model(), modifier_rank=0, timeout=timeout):
                pass
            with zb.install(timeout=timeout):
                assert zb.installed()
            assert not zb.installed()
    finally:
        AcceleratorState._reset_state(True)


def test_error_classes_derive_from_the_root():
    for cls in (zb.InvalidArgumentError, zb.InvalidSourceRankError, zb.BufferStructureError, zb.CollectiveError,
                zb.SyncAbortedError, zb.RecomputeError, zb.DistributedSetupError, zb.UnsupportedDeviceError):
        assert issubclass(cls, zb.ZeroBuffersError), cls
    assert issubclass(zb.RecomputeError, zb.SyncAbortedError) and issubclass(zb.InvalidSourceRankError, ValueError)


def test_a_missing_private_api_names_the_package_its_version_and_what_is_missing():
    from zero_buffers._compat import missing

    err = missing("torch", "torch._utils._flatten_dense_tensors", "renamed")
    assert isinstance(err, zb.DependencyError) and isinstance(err, zb.ZeroBuffersError)
    assert err.package == "torch" and err.version == torch.__version__
    assert str(err) == (f"zero_buffers needs torch._utils._flatten_dense_tensors from torch {torch.__version__}: "
                        "renamed")
    absent = missing("no-such-package-zb", "its API")
    assert absent.version is None and "no-such-package-zb (not installed)" in str(absent)


def _inference_buffer(rank, world):
    model = nn.Module()
    with torch.inference_mode():
        frozen = torch.full((3,), float(rank))
    model.register_buffer("table", frozen)
    model.register_buffer("plain", torch.full((2,), float(rank)))
    errors = messages({"broadcast": lambda: zb.broadcast_buffers(model),
                       "average": lambda: zb.sync_buffers(model, "average")}, zb.InvalidArgumentError)
    return errors, model.table.clone(), model.plain.clone()


def test_an_inference_tensor_buffer_is_refused_on_every_rank_before_any_data_moves(ranks):
    out = ranks.run(_inference_buffer, timeout=60)
    for r, (errors, table, plain) in enumerate(out):
        for message in errors.values():
            assert message is not None and "inference tensors" in message and "'table'" in message, message
        assert errors == out[0][0]
        assert torch.equal(table, torch.full((3,), float(r))) and torch.equal(plain, torch.full((2,), float(r)))


def _inference_buffer_on_one_rank(rank, world):
    """Rank 0 re-registers a buffer under inference mode (as a dynamic rotary embedding does inside a rank-0-only
    generate()); every call then meets a structure that differs on one rank."""
    import time
    model = nn.Module()
    model.register_buffer("inv_freq", torch.full((3,), float(rank)))
    if rank == 0:
        with torch.inference_mode():
            model.register_buffer("inv_freq", torch.full((3,), 9.0))
    out = {}
    for name, call in {"broadcast": lambda: zb.broadcast_buffers(model),
                       "average": lambda: zb.sync_buffers(model, "average"),
                       "report": lambda: zb.buffer_report(model),
                       "keep_in_sync": lambda: zb.keep_in_sync(model).sync()}.items():
        started = time.monotonic()
        out[name] = (messages({name: call}, zb.BufferStructureError)[name], time.monotonic() - started)
        model.__dict__.pop("_zero_buffers_keep_in_sync", None)
    return out, model.inv_freq.clone()


def test_an_inference_tensor_on_one_rank_only_stops_every_rank_naming_it(ranks):
    out = ranks.run(_inference_buffer_on_one_rank, timeout=90)
    for r, (calls, inv_freq) in enumerate(out):
        for name, (message, seconds) in calls.items():
            assert message is not None and "'inv_freq'" in message and "inference" in message, (name, message)
            assert seconds < 20, (name, seconds)  # nobody waited for the deadline (300 s)
        assert torch.equal(inv_freq, torch.full((3,), 9.0 if r == 0 else float(r)))  # nothing changed
