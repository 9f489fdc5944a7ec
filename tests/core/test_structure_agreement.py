"""Structure agreement, the first collective of every call: for every public function that agrees on structure,
every rank raises the same error, decided by one all_gather of three int64 before any data moves, and nothing
changes; the digest holds everything that decides the collectives (device ordinals, the bucket cap).

Table-driven: one rank body runs every (function, fault kind) case inside ONE pool task, logging every
torch.distributed collective each call issues (tests.helpers.log_collectives); the parent checks every case and
reports all failing ones by name in one message. Run at world 2 (odd rank 1) and world 4 (odd rank 2, a middle rank)."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

import zero_buffers as zb
from tests.helpers import (
    ERROR_PATH,
    bitwise_equal,
    check_table,
    logged_call,
    run_table,
    scramble,
)

DIGEST = ("all_gather", "torch.int64", 3)  # [structure digest, status, extra]: the first collective of every call
DATA = ("broadcast", "all_reduce")
VOTE = ("all_gather", "torch.int64", 1)  # [failed]: a vote on a local step


class BNNet(nn.Module):
    """Two BatchNorms and two plain buffers; ``kind`` makes this rank's structure differ in one way."""

    def __init__(self, kind: str | None):
        super().__init__()
        if kind == "plain_order":
            self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("codebook", torch.zeros(2, 4))
        if kind != "plain_order":
            self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        for n in (["bn1", "bn2"] if kind != "order" else ["bn2", "bn1"]):
            setattr(self, n, nn.BatchNorm1d(3))
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
        elif kind == "plain_extra":
            self.register_buffer("extra", torch.zeros(2))
        elif kind == "plain_missing":
            del self._buffers["steps"]
        elif kind == "plain_name":
            self._buffers["renamed"] = self._buffers.pop("steps")
        elif kind == "shape2d":
            self.codebook = torch.zeros(2, 5)
        elif kind == "dtype2d":
            self.codebook = torch.zeros(2, 4, dtype=torch.float64)
        elif kind == "device2d":
            self.codebook = torch.zeros(2, 4, device="meta")
        elif kind == "layout":
            self.codebook = torch.zeros(2, 4).to_sparse()

    def forward(self, x):
        for m in self.children():
            if isinstance(m, _NormBase) and m.num_features == x.shape[1]:
                x = m(x)
        return x


# The same message from every function: BatchNorm statistics are buffers for all of them.
EXPECTED = {
    "extra": r"at 'bn3.running_mean' \(missing on some ranks\)",
    "missing": r"at 'bn2.running_mean' \(missing on some ranks\)",
    "name": r"at 'bn2.running_mean' \(missing on some ranks\)",
    "shape": r"at 'bn1.running_mean' \(shape differs\): .*float32\[3\] cpu.*float32\[4\] cpu",
    "dtype": r"at 'bn1.running_mean' \(dtype differs\): .*float64\[3\] cpu",
    "device": r"at 'bn1.running_mean' \(device differs\): .*float32\[3\] meta",
    "order": r"register the same buffers in a different order: ranks? 0[0-9, ]*: 'bn1.running_mean' at position "
             r"(0|2);.*"
             r"rank \d: 'bn2.running_mean' at position (0|2)",
    "counter": r"at 'bn1.num_batches_tracked' \(missing on some ranks\)",
    "untracked": r"at 'bn2.running_mean' \(missing on some ranks\)",
    # plain buffers: average_bn_stats and recompute_bn_stats do not look at them (they merge as usual)
    "plain_extra": r"at 'extra' \(missing on some ranks\)",
    "plain_missing": r"at 'steps' \(missing on some ranks\)",
    "plain_name": r"at 'steps' \(missing on some ranks\)",
    "shape2d": r"at 'codebook' \(shape differs\): .*float32\[2, 4\] cpu.*float32\[2, 5\] cpu",
    "dtype2d": r"at 'codebook' \(dtype differs\): .*float64\[2, 4\] cpu",
    "device2d": r"at 'codebook' \(device differs\): .*float32\[2, 4\] meta",
    "layout": r"at 'codebook' \(layout differs\): .*float32\[2, 4\] cpu sparse_coo",
    "plain_order": r"register the same buffers in a different order: ranks? 0[0-9, ]*: 'codebook' at position 0;.*"
                   r"rank \d: 'steps' at position 0",
}
PLAIN = ("plain_extra", "plain_missing", "plain_name", "shape2d", "dtype2d", "device2d", "layout", "plain_order")
KINDS = [*EXPECTED, "none"]  # "none": the control, every rank agrees
UNFILLED = ("device", "device2d", "layout")  # meta and sparse tensors: not scrambled
# frozen_replica's structure has the weights first in each layer (they become buffers)
FROZEN_EXPECTED = {k: EXPECTED[k].replace("running_mean", "weight") for k in
                   ("extra", "missing", "name", "shape", "dtype", "device")}
FROZEN_EXPECTED["order"] = (r"different order: ranks? 0[0-9, ]*: 'bn1.weight' at position 2;.*"
                            r"rank \d: 'bn2.weight' at position 2")


def _batch():
    return [torch.randn(6, 3, generator=torch.Generator().manual_seed(0))]


def _gathered(model):
    with zb.GatheredParametersAndBuffers(model, modifier_rank=0):
        pass


FNS = {
    "broadcast_buffers": lambda m: zb.broadcast_buffers(m),
    "buffer_report": lambda m: zb.buffer_report(m).in_sync,
    "assert_buffers_in_sync": lambda m: zb.assert_buffers_in_sync(m).in_sync,
    "average_bn_stats": lambda m: zb.average_bn_stats(m),
    "recompute_bn_stats": lambda m: zb.recompute_bn_stats(m, _batch(), progress=False),
    "sync_buffers(broadcast)": lambda m: zb.sync_buffers(m, "broadcast"),
    "sync_buffers(average)": lambda m: zb.sync_buffers(m, "average"),
    "sync_buffers(recompute)": lambda m: zb.sync_buffers(m, "recompute", data=_batch()),
    "sync_buffers(check)": lambda m: zb.sync_buffers(m, "check"),
    "frozen_replica": lambda m: zb.is_frozen_replica(zb.frozen_replica(m)),
    "GatheredParametersAndBuffers": _gathered,
}
BN_ONLY = ("average_bn_stats", "recompute_bn_stats")  # agree on (and touch) BatchNorm statistics only
# one agreement on enter (the ZeRO parameters: none here), then the buffers' own, before anything moves
AGREEMENTS = {"frozen_replica": [DIGEST, VOTE, DIGEST], "GatheredParametersAndBuffers": [DIGEST, DIGEST]}
"""The collectives before the one that finds a fault: frozen_replica agrees on what to gather, votes on converting,
then agrees on what it sends; GatheredParametersAndBuffers agrees on enter and on exit. Every other call: one."""
CHECKS = ("assert_buffers_in_sync", "sync_buffers(check)")  # the control's scrambled values are out of sync
# Package bugs (see the report): sync_buffers("average" / "recompute") merges the BatchNorm statistics (collectives
# and writes) before broadcast_buffers finds a plain-buffer fault, then says "No buffer was modified".
KNOWN_BUGS: set[str] = set()
CASES = [f"{fn}/{kind}" for fn in FNS for kind in KINDS]


def _state(model: nn.Module) -> dict:
    """Every buffer and parameter (meta: shape only; sparse: dense values), plus the module's class name."""
    def keep(t):
        if t.is_meta:
            return ("meta", tuple(t.shape))
        return t.detach().to_dense().clone() if t.layout != torch.strided else t.detach().clone()
    return {"class": type(model).__name__, **{f"b:{n}": keep(b) for n, b in model.named_buffers()},
            **{f"p:{n}": keep(p) for n, p in model.named_parameters()}}


def _same(a: dict, b: dict) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return bitwise_equal(x, y)
        return x == y
    return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)


def _fault_case(rank, world, odd, name):
    fn, kind = name.split("/")
    model = BNNet(kind if rank == odd and kind != "none" else None)
    if not (kind in UNFILLED and rank == odd):
        scramble(model, rank)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _NormBase) and m.num_batches_tracked is not None and not m.num_batches_tracked.is_meta:
                m.num_batches_tracked.fill_(rank + 1)
    before = _state(model)
    out = logged_call(lambda: FNS[fn](model))
    after = _state(model)
    out["unchanged"] = _same(before, after)
    out["stats"] = {k: v for k, v in after.items() if "running_" in k or "num_batches" in k}
    return out


def _fault_table(rank, world, odd, names):
    return run_table(world, names, lambda name: _fault_case(rank, world, odd, name))


DTYPE_KINDS = ("dtype", "dtype2d")
REPORTS = ("buffer_report", "assert_buffers_in_sync", "sync_buffers(check)")  # dtypes are values there, not structure
DTYPE_HINT = r"Ranks hold it in different dtypes .*adopt_dtype=True\); zb\.buffer_report\(module\) lists every buffer"


def _expected_message(fn: str, kind: str) -> str | None:
    if kind == "none" or (fn in BN_ONLY and kind in PLAIN) or (fn in REPORTS and kind in DTYPE_KINDS):
        return None
    return FROZEN_EXPECTED.get(kind, EXPECTED[kind]) if fn == "frozen_replica" else EXPECTED[kind]


def _check_error_within_one_collective(results, pattern: str, odd: int, agreements: list) -> None:
    """Every rank: the same BufferStructureError, after the ``agreements`` collectives, then the error path only."""
    world = len(results)
    errors = [r["error"] for r in results]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors  # the same error everywhere
    typ, message, name, details = errors[0][:4]
    assert typ == "BufferStructureError", errors[0]
    assert re.search(pattern, message), message
    assert re.search(rf"\branks? ([0-9, ]*, )?{odd}\b", message), message  # names the odd rank
    if "(dtype differs)" in pattern:  # and says what to do
        assert re.search(DTYPE_HINT, message), message
    assert "No buffer was modified" in message, message
    assert set(details) == set(range(world)) and name is not None, details
    # One all_gather of three int64 decides; the error path then gathers the structures (sizes, then bytes) to name
    # the culprit. No data collective anywhere.
    _assert_only_the_error_path(results, agreements)


def _assert_only_the_error_path(results: list, agreements: list) -> None:
    """Nothing changed anywhere, and each rank's log is the ``agreements``, then the error path (the structures'
    sizes, then their bytes): no data collective."""
    k = len(agreements)
    for rank, r in enumerate(results):
        assert r["unchanged"], f"rank {rank} changed"
        log = r["log"]
        assert log[:k] == agreements and log[k:k + 1] == [(ERROR_PATH,)], (rank, log)
        assert [e[:2] for e in log[k + 1:]] == [("all_gather", "torch.int64"), ("all_gather", "torch.uint8")], \
            (rank, log)


def _check_fault(name: str, results: list, odd: int) -> None:
    fn, kind = name.split("/")
    world = len(results)
    pattern = _expected_message(fn, kind)
    if pattern is not None:
        _check_error_within_one_collective(results, pattern, odd, AGREEMENTS.get(fn, [DIGEST]))
        return
    logs = [r["log"] for r in results]
    if fn in REPORTS and kind in DTYPE_KINDS:  # a row out of sync naming both dtypes, compared, nothing changed
        name = "bn1.running_mean" if kind == "dtype" else "codebook"
        for r in results:
            assert r["unchanged"] and (ERROR_PATH,) not in r["log"] and r["log"][0] == DIGEST, r["log"]
        if fn == "buffer_report":
            assert all(r["error"] is None and r["value"] is False for r in results), [r["error"] for r in results]
        else:
            errors = [r["error"] for r in results]
            assert all(e is not None and e[0] == "BuffersOutOfSyncError" for e in errors), errors
            assert all(re.search(rf"\n{re.escape(name)} +float32 \(rank {odd}: float64\) ", e[1]) for e in errors), \
                errors[0][1]
        return
    if fn == "average_bn_stats":  # the digest, one all-reduce of 2 layers x (weight, count + 2 x 3 channels), the vote
        assert all(r["error"] is None for r in results), [r["error"] for r in results]
        assert logs == [[DIGEST, ("all_reduce", "torch.float64", 16), VOTE]] * world, logs
    elif fn == "recompute_bn_stats":  # the digest, one all-reduce: [failed per rank][batches][2 x (calls, n, s1, s2)],
        assert all(r["error"] is None for r in results), [r["error"] for r in results]  # the vote on computing
        assert logs == [[DIGEST, ("all_reduce", "torch.float64", world + 1 + 16), VOTE]] * world, logs
    else:  # the control: agreement first, then the data; never the error path
        want = "BuffersOutOfSyncError" if fn in CHECKS else None
        assert all((r["error"] or [None])[0] == want for r in results), [r["error"] for r in results]
        agreements = AGREEMENTS.get(fn, [DIGEST])
        for log in logs:
            assert log[:len(agreements)] == agreements and (ERROR_PATH,) not in log, log
            assert any(e[0] in DATA for e in log), log
    if fn in BN_ONLY or (fn.startswith("sync_buffers(") and fn not in ("sync_buffers(check)",)):
        assert all(_same(r["stats"], results[0]["stats"]) for r in results)  # the same statistics everywhere now


_RESULTS: dict[int, list] = {}


def _results(pool, odd: int) -> list:
    """Every case on every rank, once per world size (the known-bug cases ride along in the same task)."""
    if pool.world_size not in _RESULTS:
        _RESULTS[pool.world_size] = pool.run(_fault_table, odd, CASES, timeout=240)
    return _RESULTS[pool.world_size]


def _odd(pool) -> int:
    return 1 if pool.world_size == 2 else 2


def test_every_structure_fault_raises_the_same_error_within_one_collective(ranks):
    odd = _odd(ranks)
    names = [c for c in CASES if c not in KNOWN_BUGS]
    check_table(names, _results(ranks, odd), lambda name, res: _check_fault(name, res, odd))


# ---- ranks that call with different arguments, or different functions ------------------------------------------
DIFFERENT_ARGUMENTS = r"^ranks called it with different arguments: ranks? 0[,:]"
CALL_FAULTS = {  # name -> (call on the other ranks, call on the odd rank, message pattern, agreement gathers first)
    "report atol": (lambda m, r: zb.buffer_report(m, atol=0.0), lambda m, r: zb.buffer_report(m, atol=0.5),
                    DIFFERENT_ARGUMENTS, 1),
    "include_parameters": (lambda m, r: zb.broadcast_buffers(m),
                           lambda m, r: zb.broadcast_buffers(m, include_parameters=True), DIFFERENT_ARGUMENTS, 1),
    "src": (lambda m, r: zb.broadcast_buffers(m, src=0), lambda m, r: zb.broadcast_buffers(m, src=1),
            DIFFERENT_ARGUMENTS, 1),
    "every rank its own src": (lambda m, r: zb.broadcast_buffers(m, src=r), lambda m, r: zb.broadcast_buffers(m, src=r),
                               DIFFERENT_ARGUMENTS, 1),
    "ignore": (lambda m, r: zb.broadcast_buffers(m), lambda m, r: zb.broadcast_buffers(m, ignore=("codebook",)),
               r"^buffer structure differs across ranks at 'codebook' \(missing on some ranks\)", 1),
    "broadcast vs report": (lambda m, r: zb.broadcast_buffers(m), lambda m, r: zb.buffer_report(m),
                            DIFFERENT_ARGUMENTS, 1),
    "report vs assert": (lambda m, r: zb.buffer_report(m), lambda m, r: zb.assert_buffers_in_sync(m),
                         DIFFERENT_ARGUMENTS, 1),
    "average vs assert": (lambda m, r: zb.average_bn_stats(m), lambda m, r: zb.assert_buffers_in_sync(m),
                          DIFFERENT_ARGUMENTS, 1),
    "recompute vs average": (lambda m, r: zb.recompute_bn_stats(m, _batch(), progress=False),
                             lambda m, r: zb.average_bn_stats(m), DIFFERENT_ARGUMENTS, 1),
    "sync_buffers policies": (lambda m, r: zb.sync_buffers(m, "broadcast"), lambda m, r: zb.sync_buffers(m, "check"),
                              DIFFERENT_ARGUMENTS, 1),
    "sync_buffers src": (lambda m, r: zb.sync_buffers(m, "broadcast", src=0),
                         lambda m, r: zb.sync_buffers(m, "broadcast", src=1), DIFFERENT_ARGUMENTS, 1),
    "frozen_replica vs broadcast": (lambda m, r: zb.frozen_replica(m), lambda m, r: zb.broadcast_buffers(m),
                                    DIFFERENT_ARGUMENTS, 1),
    "frozen_replica src": (lambda m, r: zb.frozen_replica(m, src=0), lambda m, r: zb.frozen_replica(m, src=1),
                           DIFFERENT_ARGUMENTS, AGREEMENTS["frozen_replica"]),
    "gathered modifier_rank": (lambda m, r: _gathered_from(m, 0), lambda m, r: _gathered_from(m, 1),
                               DIFFERENT_ARGUMENTS, 1),
    "gathered modifier_rank vs None": (lambda m, r: _gathered_from(m, 0), lambda m, r: _gathered_from(m, None),
                                       DIFFERENT_ARGUMENTS, 1),
}


def _gathered_from(model, modifier_rank):
    with zb.GatheredParametersAndBuffers(model, modifier_rank=modifier_rank):
        pass


def _call_fault_case(rank, world, odd, name):
    normal, other, _, _ = CALL_FAULTS[name]
    model = scramble(BNNet(None), rank)
    before = _state(model)
    out = logged_call(lambda: (other if rank == odd else normal)(model, rank))
    out["unchanged"] = _same(before, _state(model))
    return out


def _call_fault_table(rank, world, odd, names):
    return run_table(world, names, lambda name: _call_fault_case(rank, world, odd, name))


def _check_call_fault(name: str, results: list) -> None:
    _, _, pattern, digests = CALL_FAULTS[name]
    world = len(results)
    errors = [r["error"] for r in results]
    assert all(e is not None and e[0] == "BufferStructureError" for e in errors), errors
    # The message starts with the function *this* rank called; the rest, and the details, are identical.
    tails = [e[1].split(": ", 1)[1] for e in errors]
    assert all(t == tails[0] for t in tails) and all(e[3] == errors[0][3] for e in errors), errors
    assert re.search(pattern, tails[0]), tails[0]
    assert set(errors[0][3]) == set(range(world)), errors[0][3]
    if pattern == DIFFERENT_ARGUMENTS:
        assert errors[0][2] is None  # no buffer to blame: the calls differ
    _assert_only_the_error_path(results, digests if isinstance(digests, list) else [DIGEST] * digests)


def test_ranks_calling_with_different_arguments_raise_the_same_error(ranks):
    names = list(CALL_FAULTS)
    check_table(names, ranks.run(_call_fault_table, _odd(ranks), names, timeout=120), _check_call_fault)


# ---- the digest holds what decides the collectives -----------------------------------------------------------------
class _Placed:
    """A tensor's description as structure agreement reads it (dtype, shape, device, layout, inference mode): lets
    this pure function see device ordinals that a CPU-only machine cannot make (tests/gpu/run.sh runs the real
    thing)."""

    def __init__(self, device: str, n: int = 4):
        self.dtype, self.shape, self.device, self.layout = torch.float32, torch.Size([n]), torch.device(device), \
            torch.strided

    def is_inference(self) -> bool:
        return False


@pytest.mark.stack
def test_device_ordinals_one_gpu_per_rank_agree_one_rank_on_two_gpus_does_not():
    from zero_buffers._core import structure as _structure

    one_gpu_rank0 = [("a", _Placed("cuda:0")), ("b", _Placed("cuda:0"))]
    one_gpu_rank1 = [("a", _Placed("cuda:1")), ("b", _Placed("cuda:1"))]
    two_gpus = [("a", _Placed("cuda:0")), ("b", _Placed("cuda:1"))]  # two buckets where the others have one
    call = ("broadcast_buffers",)
    assert _structure.digest(call, one_gpu_rank0) == _structure.digest(call, one_gpu_rank1)
    assert _structure.digest(call, one_gpu_rank0) != _structure.digest(call, two_gpus)
    assert [s.device for s in _structure.specs(two_gpus)] == ["cuda", "cuda#1"]


@pytest.mark.stack
def test_the_bucket_cap_is_part_of_the_digest(monkeypatch):
    from zero_buffers._core import structure as _structure, wire as _wire

    entries = [("a", torch.zeros(4)), ("b", torch.zeros(4))]
    before = _structure.digest(("x",), entries)
    assert len(_wire.plan([t for _, t in entries])) == 1
    monkeypatch.setattr(_wire, "BUCKET_BYTES", 16)
    _structure._CACHE.clear()
    assert len(_wire.plan([t for _, t in entries])) == 2
    assert _structure.digest(("x",), entries) != before
