"""The six classes of defect the "no holes" work closed, one test (or more) each; every one failed on 0.1.0.

1. a rank with nothing to do skipped the collective its peers entered (hang with ``timeout=None``);
2. an exception that is not ours, after ranks had voted, split them (hang in DeepSpeed's broadcast);
3. a ZeRO-3 lockstep loop voted on fetching a batch but not on the forward (hang inside DeepSpeed's gather);
4. the structure digest left out what decides the collectives (full device, bucket cap);
5. one-shot inputs used twice (a second save recomputed nothing and reported success);
6. costs that grew with world size (the differing report all-gathered every differing buffer to every rank).

Tests of classes 1-3 run with ``timeout=None``: the pool's deadline is what a hang would hit.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import ZERO3_CONFIG, buffers, init_deepspeed, log_collectives, restore_collectives, same_state

# the tests of what DeepSpeed, transformers and Accelerate do: run on both dependency stacks (.ci/run)
pytestmark = pytest.mark.stack


# ---- 1. every rank reaches the same first collective whatever its module holds ------------------------------------
def _rank_without_batchnorm(rank, world):
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)) if rank != 1 else nn.Sequential(nn.Linear(3, 3))
    before = buffers(model)
    try:
        zb.average_bn_stats(model)  # timeout=None: before 0.2 rank 1 returned at once and its peers waited forever
    except zb.BufferStructureError as e:
        return str(e), same_state(before, buffers(model))
    return None, same_state(before, buffers(model))


def test_1_a_rank_without_batchnorm_still_meets_its_peers(ranks):
    out = ranks.run(_rank_without_batchnorm, timeout=60)
    assert all(err is not None and err == out[0][0] for err, _ in out), out
    assert "'0.running_mean'" in out[0][0] or "missing on some ranks" in out[0][0]
    assert all(unchanged for _, unchanged in out)


def _no_rank_has_batchnorm(rank, world):
    return zb.average_bn_stats(nn.Linear(2, 2))


def test_1_no_rank_with_batchnorm_agrees_on_nothing_to_do(ranks2):
    assert ranks2.run(_no_rank_has_batchnorm, timeout=60) == [0, 0]


# ---- 2. a failure after the vote is still agreed on ----------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)


def _fails_while_receiving(rank, world, where):
    """Rank 1 hits a RuntimeError that is not ours right after the data broadcast (an OOM, say) while rank 0 loads."""
    deepspeed = init_deepspeed()
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        model = Net()
    torch.manual_seed(0)
    reference = Net()
    with torch.no_grad():
        reference.bn.running_mean.fill_(7.0)
    real = dist.broadcast

    def failing_broadcast(*args, **kwargs):
        real(*args, **kwargs)  # the collective went out; then this rank fails
        raise RuntimeError("CUDA out of memory (simulated while receiving)")

    before = buffers(model)
    try:
        with zb.GatheredParametersAndBuffers(model, modifier_rank=0):
            if rank == 0:
                model.load_state_dict(reference.state_dict())
            if rank == 1 and where == "receive":
                dist.broadcast = failing_broadcast
    except zb.ZeroBuffersError as e:
        caught = (type(e).__name__, str(e))
    else:
        caught = None
    finally:
        dist.broadcast = real
    partitioned = all(p.numel() == 0 for p in model.parameters())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return caught, same_state(before, buffers(model)), partitioned, params


def test_2_a_foreign_exception_while_receiving_makes_every_rank_roll_back(ranks):
    out = ranks.run(_fails_while_receiving, "receive", timeout=90)
    for rank, (caught, unchanged, partitioned, params) in enumerate(out):
        assert caught is not None and caught[0] == "SyncAbortedError", (rank, caught)
        assert "receiving failed on rank 1" in caught[1] and "CUDA out of memory" in caught[1], caught
        assert unchanged and partitioned  # nothing committed, parameters re-partitioned
        assert same_state(params, out[0][3])  # ZeRO shards kept their values from before on every rank
    assert not torch.equal(out[0][3]["lin.weight"], torch.zeros(4, 4))


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


def test_2_a_rank_that_cannot_allocate_its_scratch_never_enters_the_broadcast(ranks):
    out = ranks.run(_cannot_allocate, timeout=60)
    last = ranks.world_size - 1
    for caught, unchanged, log in out:
        assert caught is not None and caught[1] == (last,), caught
        assert f"a rank could not take part on rank {last}" in caught[0] and "MemoryError" in caught[0]
        assert unchanged
        assert "broadcast" not in log  # the vote came first: no data moved on any rank


# ---- 3. a ZeRO-3 forward that raises half-way on one rank ----------------------------------------------------------
class Trips(nn.Module):
    """Raises on rank 1 at its second batch, after DeepSpeed gathered the layers before it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if dist.get_rank() == 1 and self.calls == 2:
            raise ValueError("bad batch on rank 1")
        return x


def _forward_raises_half_way(rank, world):
    deepspeed = init_deepspeed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 5), Trips(), nn.Linear(5, 5), nn.BatchNorm1d(5))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config=ZERO3_CONFIG)
    before = buffers(engine.module)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randn(6, 3, generator=g) for _ in range(3)]
    try:
        zb.recompute_bn_stats(engine, data, progress=False)  # timeout=None
        caught = None
    except zb.RecomputeError as e:
        caught = (str(e), e.ranks, type(e.__cause__).__name__ if e.__cause__ else None)
    return caught, same_state(before, buffers(engine.module))


def test_3_a_zero3_forward_raising_half_way_reaches_every_rank_as_recompute_error(ranks):
    out = ranks.run(_forward_raises_half_way, timeout=90)
    for rank, (caught, unchanged) in enumerate(out):
        assert caught is not None and caught[1] == (1,), caught
        assert "rank 1: ValueError: bad batch on rank 1" in caught[0], caught[0]
        assert caught[2] == ("ValueError" if rank == 1 else None)
        assert unchanged
    assert len({c[0] for c, _ in out}) == 1


def _zero3_rank_without_batches(rank, world):
    deepspeed = init_deepspeed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 5), nn.BatchNorm1d(5))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config=ZERO3_CONFIG)
    g = torch.Generator().manual_seed(rank)
    data = [] if rank == 1 else [torch.randn(6, 3, generator=g) * (1 + rank) for _ in range(rank + 1)]
    written = zb.recompute_bn_stats(engine, data, progress=False)
    return written, buffers(engine.module)


def test_3_under_zero3_a_rank_without_batches_takes_part(ranks):
    out = ranks.run(_zero3_rank_without_batches, timeout=90)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 5), nn.BatchNorm1d(5)).double().train()
    xs, hs = [], []
    for r in range(ranks.world_size):
        g = torch.Generator().manual_seed(r)
        for x in ([] if r == 1 else [torch.randn(6, 3, generator=g) * (1 + r) for _ in range(r + 1)]):
            xs.append(x.double())
            with torch.no_grad():
                hs.append(ref[1](ref[0](x.double())))  # the second BatchNorm sees batches the first normalised
    x, h = torch.cat(xs), torch.cat(hs)
    for written, bufs in out:
        assert written == 2
        torch.testing.assert_close(bufs["0.running_var"].double(), x.var(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bufs["2.running_mean"].double(), h.mean(0), rtol=1e-4, atol=1e-5)
        assert same_state(bufs, out[0][1])


# ---- 4. the digest holds what decides the collectives --------------------------------------------------------------
class _Placed:
    """A tensor's description as structure agreement reads it (dtype, shape, device, layout): lets this pure function
    see device ordinals that a CPU-only machine cannot make (tests/gpu/run.sh runs the real thing)."""

    def __init__(self, device: str, n: int = 4):
        self.dtype, self.shape, self.device, self.layout = torch.float32, torch.Size([n]), torch.device(device), \
            torch.strided


def test_4_device_ordinals_one_gpu_per_rank_agree_one_rank_on_two_gpus_does_not():
    from zero_buffers._core import structure as _structure

    one_gpu_rank0 = [("a", _Placed("cuda:0")), ("b", _Placed("cuda:0"))]
    one_gpu_rank1 = [("a", _Placed("cuda:1")), ("b", _Placed("cuda:1"))]
    two_gpus = [("a", _Placed("cuda:0")), ("b", _Placed("cuda:1"))]  # two buckets where the others have one
    call = ("broadcast_buffers",)
    assert _structure.digest(call, one_gpu_rank0) == _structure.digest(call, one_gpu_rank1)
    assert _structure.digest(call, one_gpu_rank0) != _structure.digest(call, two_gpus)
    assert [s.device for s in _structure.specs(two_gpus)] == ["cuda", "cuda#1"]


def test_4_the_bucket_cap_is_part_of_the_digest(monkeypatch):
    from zero_buffers._core import structure as _structure, wire as _wire

    entries = [("a", torch.zeros(4)), ("b", torch.zeros(4))]
    before = _structure.digest(("x",), entries)
    assert len(_wire.plan([t for _, t in entries])) == 1
    monkeypatch.setattr(_wire, "BUCKET_BYTES", 16)
    _structure._CACHE.clear()
    assert len(_wire.plan([t for _, t in entries])) == 2
    assert _structure.digest(("x",), entries) != before


# ---- 5. one-shot inputs ------------------------------------------------------------------------------------------
def _recompute_on_no_batch(rank, world):
    torch.manual_seed(rank)
    model = nn.Sequential(nn.BatchNorm1d(3))
    with torch.no_grad():
        model[0].running_mean.normal_()
    before = buffers(model)
    try:
        zb.sync_buffers(model, "recompute", data=iter([]))
        caught = None
    except zb.RecomputeError as e:
        caught = str(e)
    return caught, same_state(before, buffers(model))


def test_5_a_recompute_that_saw_no_batch_never_reports_success(ranks2):
    for caught, unchanged in ranks2.run(_recompute_on_no_batch, timeout=60):
        assert caught is not None and "no rank had a batch" in caught
        assert unchanged  # before 0.2: rank 0's statistics were broadcast and a count returned


def _engine_saves_twice(rank, world, tmp, reusable):
    deepspeed = init_deepspeed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config=ZERO3_CONFIG)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 3, generator=g) + 3 * rank for _ in range(2)]
    data = (lambda: iter(batches)) if reusable else (b for b in batches)
    try:
        hook = zb.sync_buffers_on_save(engine, "recompute", data=data)
    except zb.InvalidArgumentError as e:
        return str(e), None
    means = []
    try:
        for step in range(2):
            with torch.no_grad():
                engine.module[1].running_mean.fill_(float(rank + step))  # training moved them apart again
            engine.save_checkpoint(f"{tmp}/ckpt", tag=f"s{step}")
            means.append(engine.module[1].running_mean.clone())
    finally:
        hook.remove()
    return None, means


def test_5_save_hooks_refuse_one_shot_data_and_recompute_at_every_save_with_a_callable(ranks2, tmp_path):
    refused = ranks2.run(_engine_saves_twice, str(tmp_path / "a"), False, timeout=120)
    assert all(msg is not None and "one-shot iterator" in msg for msg, _ in refused)
    out = ranks2.run(_engine_saves_twice, str(tmp_path / "b"), True, timeout=120)
    for _, means in out:
        assert torch.equal(means[0], means[1])  # both saves recomputed from the same data
        assert torch.equal(means[1], out[0][1][1])  # and every rank holds the same statistics
    assert not torch.equal(out[0][1][1], torch.zeros(3))


# ---- 6. costs that need not grow with world size -------------------------------------------------------------------
def _report_cost(rank, world, n):
    model = nn.Module()
    model.register_buffer("codebook", torch.full((n,), float(rank)))  # differs on every rank
    model.register_buffer("same", torch.ones(8))
    log: list = []
    real = log_collectives(log)
    try:
        report = zb.buffer_report(model)
    finally:
        restore_collectives(real)
    received = 0
    for entry in log:
        if len(entry) < 3:
            continue
        name, dtype, numel = entry
        size = torch.empty((), dtype=getattr(torch, dtype.split(".")[1])).element_size()
        received += numel * size * (world if name == "all_gather" else 1)
    return received, [(r.name, r.in_sync, r.differing_ranks) for r in report.rows]


def test_6_a_differing_report_moves_the_buffer_once_not_once_per_rank(ranks):
    n = 1 << 18  # a 1 MiB codebook
    out = ranks.run(_report_cost, n, timeout=60)
    world = ranks.world_size
    for received, rows in out:
        assert rows == [("codebook", False, tuple(range(1, world))), ("same", True, ())]
        # the reference broadcast (n floats) plus a few scalars per rank; all-gathering it would be world * n floats
        assert n * 4 <= received < n * 4 + 4096 * world, received


def _capped_broadcast(rank, world, cap):
    from zero_buffers._core import wire as _wire

    _wire.BUCKET_BYTES = cap
    try:
        torch.manual_seed(rank)
        model = nn.Module()
        for i in range(5):
            model.register_buffer(f"b{i}", torch.randn(16))  # 64 bytes each
        log: list = []
        real = log_collectives(log)
        try:
            zb.broadcast_buffers(model)
        finally:
            restore_collectives(real)
        return sum(1 for e in log if e[0] == "broadcast"), buffers(model)
    finally:
        _wire.BUCKET_BYTES = 250 * 2 ** 20


def test_6_broadcasts_are_cut_at_the_bucket_cap(ranks2):
    out = ranks2.run(_capped_broadcast, 128, timeout=60)  # two 64-byte buffers per bucket: 3 buckets
    assert [n for n, _ in out] == [3, 3]
    assert same_state(out[0][1], out[1][1])
    assert [n for n, _ in ranks2.run(_capped_broadcast, 250 * 2 ** 20, timeout=60)] == [1, 1]


def test_6_device_fingerprint_is_layout_blind_and_sees_one_bit():
    from zero_buffers._core.digest import fingerprint

    x = torch.randn(300, 7, dtype=torch.float64)
    assert fingerprint(x) == fingerprint(x.t().contiguous().t())  # same values, other strides
    assert fingerprint(x.conj()) == fingerprint(x)
    flipped = x.clone()
    flipped.view(torch.int64)[123, 4] ^= 1  # one bit of one element
    assert fingerprint(flipped) != fingerprint(x)
    a, b = torch.zeros(3), torch.zeros(4)  # lengths count, even when the extra bytes are zeros
    assert fingerprint(a) != fingerprint(b)
    big = torch.arange(1 << 17, dtype=torch.int32)  # more than one 2**16-word chunk
    swapped = big.clone()
    swapped[[0, 1 << 16]] = swapped[[1 << 16, 0]]  # the same words, moved between chunks
    assert fingerprint(swapped) != fingerprint(big)


@pytest.mark.parametrize("n", [0, 1, 3, 1 << 16])
def test_6_device_fingerprint_is_deterministic(n):
    from zero_buffers._core.digest import fingerprint

    t = torch.arange(n, dtype=torch.uint8)
    assert fingerprint(t) == fingerprint(t.clone())
