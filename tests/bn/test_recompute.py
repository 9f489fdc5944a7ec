"""recompute_bn_stats: exact population statistics across 2 and 4 real gloo ranks, uneven data, wrappers, restore.

Under ZeRO-3 too: a forward that raises half-way on one rank reaches every rank as RecomputeError, and a rank
without batches still takes part. A recompute that saw no batch never reports success; progress goes to a
terminal by default, and off a terminal (progress=True) as plain lines, never a carriage return (tests/core/
test_output.py: a file, a pipe and a pseudo-terminal)."""
from __future__ import annotations

import contextlib
import io
import threading
import time
import warnings
from contextlib import redirect_stderr

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm

import zero_buffers as zb
from tests.helpers import (
    ZERO3_CONFIG,
    bn_net,
    buffers,
    init_deepspeed,
    same_state,
)

N_BATCHES = [3, 1, 4, 2]  # per rank: uneven on purpose


class Zoo(nn.Module):
    """BatchNorm 1d/2d/3d, SyncBatchNorm and a tracking InstanceNorm, fed by keyword arguments (a dict batch)."""

    def __init__(self):
        super().__init__()
        self.bn1 = nn.BatchNorm1d(3)
        self.lin = nn.Linear(3, 4)
        self.bn1b = nn.BatchNorm1d(4, momentum=None)
        self.bn2 = nn.BatchNorm2d(2)
        self.conv = nn.Conv2d(2, 3, 3)
        self.sync = nn.SyncBatchNorm(3)
        self.inorm = nn.InstanceNorm2d(2, track_running_stats=True)
        self.bn3 = nn.BatchNorm3d(2)

    def forward(self, a, b, c):
        x = self.bn1b(self.lin(self.bn1(a)))
        y = self.sync(self.conv(self.bn2(b))) + self.inorm(b).mean()
        return x.sum() + y.sum() + self.bn3(c).sum()


def make_zoo() -> Zoo:
    torch.manual_seed(0)  # identical parameters on every rank
    return Zoo()


def rank_batches(rank: int, n: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Rank r's batches: sizes 5..9, a distribution shifted and scaled by the rank."""
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for i in range(N_BATCHES[rank] if n is None else n):
        bs = 5 + (i + rank) % 5
        s, m = 1.0 + rank, 3.0 * rank
        out.append({"a": torch.randn(bs, 3, generator=g) * s + m, "b": torch.randn(bs, 2, 6, 6, generator=g) * s + m,
                    "c": torch.randn(bs, 2, 3, 3, 3, generator=g) * s - m})
    return out


def population_stats(model: nn.Module, batches: list, call=lambda m, b: m(**b)) -> dict[str, tuple]:
    """Reference, one process, float64: every tracking norm layer's input over all batches (train mode, no grad)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, _NormBase) and m.track_running_stats}
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in layers}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: seen[n].append(a[0].detach().double()))
             for n, m in layers.items()]
    model.train()
    with torch.no_grad():
        for b in batches:
            call(model, b)
    for h in hooks:
        h.remove()
    out = {}
    for n, m in layers.items():
        x = torch.cat(seen[n])
        if isinstance(m, _InstanceNorm):
            flat = x.flatten(2)
            out[n] = (flat.mean(2).mean(0), flat.var(2).mean(0))
        else:
            flat = x.transpose(0, 1).reshape(x.shape[1], -1)
            out[n] = (flat.mean(1), flat.var(1))
    return out


def stats_of(model: nn.Module) -> dict[str, tuple]:
    return {n: (m.running_mean.clone(), m.running_var.clone(), int(m.num_batches_tracked))
            for n, m in model.named_modules() if isinstance(m, _NormBase) and m.track_running_stats}


def _recompute_zoo(rank, world):
    model = make_zoo()
    data = rank_batches(rank, N_BATCHES[rank] + 2)
    written = zb.recompute_bn_stats(model, data, num_batches=N_BATCHES[rank], progress=False)
    return written, stats_of(model)


def test_exact_population_stats_uneven_batches_bn_1d_2d_3d_sync_instance(ranks):
    out = ranks.run(_recompute_zoo, timeout=120)
    world = len(out)
    all_batches = [b for r in range(world) for b in rank_batches(r)]
    truth = population_stats(make_zoo(), all_batches)
    total = sum(N_BATCHES[:world])
    for written, stats in out:
        assert written == 6
        for name, (mean, var) in truth.items():
            got_mean, got_var, count = stats[name]
            torch.testing.assert_close(got_mean.double(), mean, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_var.double(), var, rtol=1e-5, atol=1e-5)
            assert count == max(1, round(total / world))
    # first layer is BN: exactly the statistics of all ranks' data concatenated
    a = torch.cat([b["a"] for b in all_batches]).double()
    torch.testing.assert_close(out[0][1]["bn1"][0].double(), a.mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[0][1]["bn1"][1].double(), a.var(0), rtol=1e-6, atol=1e-6)
    for _, stats in out[1:]:  # bitwise identical on every rank
        assert all(torch.equal(stats[n][i], out[0][1][n][i]) for n in stats for i in (0, 1))


def _ddp_zero_batches(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3), nn.BatchNorm1d(3)))
    data = [b["a"] for b in rank_batches(rank)] if rank != 1 else []  # rank 1 has no batch at all
    written = zb.recompute_bn_stats(model, data, timeout=30)
    return written, stats_of(model.module)


def test_ddp_wrapped_model_and_a_rank_without_batches_do_not_hang(ranks):
    # DDP's forward broadcasts buffers from rank 0 on its first pass: run on the wrapper it would wait for rank 1
    out = ranks.run(_ddp_zero_batches, timeout=60)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3), nn.BatchNorm1d(3))
    batches = [b["a"] for r in range(len(out)) if r != 1 for b in rank_batches(r)]
    truth = population_stats(ref, batches, call=lambda m, b: m(b))
    for written, stats in out:
        assert written == 2
        for name, (mean, var) in truth.items():
            name = f"module.{name}" if f"module.{name}" in stats else name
            torch.testing.assert_close(stats[name][0].double(), mean, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(stats[name][1].double(), var, rtol=1e-5, atol=1e-5)


class Counter(nn.Module):
    """A train-mode side effect besides BatchNorm: an EMA-like buffer updated on every training forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        if self.training:
            self.steps += 1
            self.ema.mul_(0.5).add_(x.detach().mean(0))
        return x


def _restores_everything(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=0.3), nn.Dropout(0.5), Counter(),
                          nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None)))
    model.train()
    model[4].eval()  # a frozen-looking submodule stays in eval mode afterwards
    modes = {n: m.training for n, m in model.named_modules()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    other = {n: b.clone() for n, b in model[3].named_buffers()}
    torch.manual_seed(1234 + rank)
    rng = torch.get_rng_state()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        zb.recompute_bn_stats(model, [(b["a"], None) for b in rank_batches(rank)], progress=True)
    return dict(
        modes=modes == {n: m.training for n, m in model.named_modules()},
        momentum=(model[1].momentum, model[4][1].momentum),
        params=all(torch.equal(p, params[n]) for n, p in model.named_parameters()),
        other=all(torch.equal(b, other[n]) for n, b in model[3].named_buffers()),
        rng=torch.equal(rng, torch.get_rng_state()),
        bar="recompute_bn_stats" in err.getvalue(), no_cr="\r" not in err.getvalue(),
        stats=stats_of(model))


def test_restores_modes_momentum_params_other_buffers_and_rng_bar_on_main_rank_only(ranks):
    out = ranks.run(_restores_everything, timeout=60)
    for rank, o in enumerate(out):
        assert o["modes"] and o["momentum"] == (0.3, None) and o["params"] and o["other"] and o["rng"]
        assert o["bar"] == (rank == 0) and o["no_cr"]  # stderr is no terminal here: plain lines, no "\r"
        assert all(torch.equal(o["stats"][n][1], out[0]["stats"][n][1]) for n in o["stats"])  # dropout included
    assert not torch.equal(out[0]["stats"]["1"][0], torch.zeros(4))


def _fails(rank, world):
    model = make_zoo()
    model.eval()
    before = stats_of(model)
    data = rank_batches(rank)
    if rank == 0:
        data = [data[0], {k: v[:1] for k, v in data[0].items()}]  # batch of one: BatchNorm raises in train mode

    def broken():
        yield data[0]
        raise OSError("disk went away")

    source = broken() if rank == world - 1 else data
    try:
        zb.recompute_bn_stats(model, source, progress=False)
    except zb.RecomputeError as e:
        caught = (str(e), e.ranks, type(e.__cause__).__name__ if e.__cause__ else None)
    after = stats_of(model)
    same = all(torch.equal(before[n][i], after[n][i]) for n in before for i in range(2)) and \
        all(before[n][2] == after[n][2] for n in before)
    return caught, same, model.training


def test_a_failing_rank_raises_the_same_error_everywhere_and_nothing_changes(ranks):
    out = ranks.run(_fails, timeout=60)
    world = len(out)
    messages = {o[0][0] for o in out}
    assert len(messages) == 1
    message = messages.pop()
    assert "rank 0: ValueError" in message and f"rank {world - 1}: OSError: disk went away" in message
    for rank, (caught, same, training) in enumerate(out):
        assert caught[1] == (0, world - 1)
        assert caught[2] == {0: "ValueError", world - 1: "OSError"}.get(rank)
        assert same and training is False


class _SilentFailure(OSError):
    """A data failure whose message never comes: the failing rank stalls for good in str() of it, i.e. right
    after the all-reduce that told every rank about the failure and before the exchange of the messages."""

    def __str__(self):
        threading.Event().wait()  # never set: the harness kills this rank
        return "unreachable"


def _failure_message_exchange_stalls(rank, world, timeout):
    model = make_zoo()
    before = stats_of(model)

    def broken():
        yield rank_batches(rank)[0]
        raise _SilentFailure()

    started = time.monotonic()
    try:
        zb.recompute_bn_stats(model, broken() if rank == world - 1 else rank_batches(rank), progress=False,
                              timeout=timeout)
        caught = None
    except zb.RecomputeError as e:
        caught = (str(e), e.ranks)
    after = stats_of(model)
    same = all(torch.equal(before[n][i], after[n][i]) for n in before for i in range(2))
    return caught, time.monotonic() - started, same


def test_a_peer_stalling_in_the_failure_message_exchange_is_bounded_by_timeout(ranks2):
    # The messages travel through the library's timed gather: without it (dist.all_gather_object) rank 0 would
    # wait for the process group's own 120 s timeout, past this call's deadline.
    out = ranks2.run(_failure_message_exchange_stalls, 2.0, allow_dead=[1], timeout=60)
    assert out[1] is None  # the stalled rank never answered
    caught, elapsed, same = out[0]
    assert caught is not None and caught[1] == (1,), caught
    assert "failed on rank 1 (no message)" in caught[0] and "no buffer was modified" in caught[0], caught[0]
    assert 1.95 <= elapsed < 2.0 + 8.0, elapsed  # the timeout (c10d may fire <1 ms early), plus slack
    assert same


def _structure_mismatch(rank, world):
    model = make_zoo()
    if rank == 1:
        model.extra = nn.BatchNorm1d(2)
    before = stats_of(model)
    with pytest.raises(zb.BufferStructureError) as info:
        zb.recompute_bn_stats(model, rank_batches(rank), progress=False)
    return str(info.value), all(torch.equal(before[n][0], m[0]) for n, m in stats_of(model).items())


def test_structure_mismatch_raises_on_every_rank_before_any_pass(ranks2):
    (m0, same0), (m1, same1) = ranks2.run(_structure_mismatch, timeout=60)
    assert m0 == m1 and "extra.running_mean" in m0 and same0 and same1


def _zero3(rank, world):
    from tests.helpers import ZERO3_CONFIG, init_deepspeed

    deepspeed = init_deepspeed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 5), nn.BatchNorm1d(5))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config=ZERO3_CONFIG)
    assert all(hasattr(p, "ds_id") for p in engine.module.parameters())
    written = zb.recompute_bn_stats(engine, [b["a"] for b in rank_batches(rank)], progress=False, timeout=30)
    stats = stats_of(engine.module)
    return written, stats


def test_zero3_partitioned_model_gives_population_stats_with_uneven_batches(ranks2):
    out = ranks2.run(_zero3, timeout=120)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 5), nn.BatchNorm1d(5))
    truth = population_stats(ref, [b["a"] for r in range(2) for b in rank_batches(r)], call=lambda m, b: m(b))
    for written, stats in out:
        assert written == 2
        for name, (mean, var) in truth.items():
            torch.testing.assert_close(stats[name][0].double(), mean, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(stats[name][1].double(), var, rtol=1e-5, atol=1e-5)


def test_single_process_tensor_tuple_and_generator_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(2), nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2))
    xs = [b["b"] for b in rank_batches(2)]
    truth = population_stats(model, xs, call=lambda m, b: m(b))
    for data in (xs, [(x, torch.zeros(len(x))) for x in xs], (x for x in xs)):
        model.apply(lambda m: m.reset_running_stats() if isinstance(m, nn.BatchNorm2d) else None)
        assert zb.recompute_bn_stats(model, data, progress=False) == 2
        torch.testing.assert_close(model[2].running_var.double(), truth["2"][1], rtol=1e-5, atol=1e-5)
        assert int(model[0].num_batches_tracked) == len(xs)
    assert zb.recompute_bn_stats(model, xs[0], progress=False) == 2  # a lone tensor is one batch
    torch.testing.assert_close(model[0].running_mean.double(), xs[0].double().mean((0, 2, 3)), rtol=1e-6, atol=1e-6)
    with pytest.raises(zb.InvalidArgumentError, match="num_batches"):
        zb.recompute_bn_stats(model, xs, num_batches=-1)


def test_single_process_details_device_lazy_layers_and_layers_no_batch_reached():
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3))
    x = torch.randn(8, 3, dtype=torch.float64)
    assert zb.recompute_bn_stats(model.double(), [x.float()], device="cpu", progress=False,
                                 forward=lambda m, b: m(b.double())) == 1  # device= moves, forward= feeds
    torch.testing.assert_close(model[0].running_mean, x.mean(0))
    lazy = nn.Sequential(nn.LazyBatchNorm1d())
    with pytest.raises(zb.InvalidArgumentError, match=r"lazy BatchNorm '0\.running_mean' is not initialised"):
        zb.recompute_bn_stats(lazy, [torch.randn(4, 3)], progress=False)

    class Branch(nn.Module):  # the second BatchNorm is never reached by this data
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.BatchNorm1d(2), nn.BatchNorm1d(2)

        def forward(self, x):
            return self.used(x)

    branch = Branch()
    with torch.no_grad():
        branch.unused.running_mean.fill_(5.0)
    assert zb.recompute_bn_stats(branch, [torch.randn(6, 2)], progress=False) == 1
    assert torch.equal(branch.unused.running_mean, torch.full((2,), 5.0))  # kept, not zeroed


# ---- a ZeRO-3 forward that raises half-way on one rank -------------------------------------------------------------
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


@pytest.mark.stack
def test_a_zero3_forward_raising_half_way_reaches_every_rank_as_recompute_error(ranks):
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


@pytest.mark.stack
def test_under_zero3_a_rank_without_batches_takes_part(ranks):
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


# ---- one-shot inputs ---------------------------------------------------------------------------------------------
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


@pytest.mark.stack
def test_a_recompute_that_saw_no_batch_never_reports_success(ranks2):
    for caught, unchanged in ranks2.run(_recompute_on_no_batch, timeout=60):
        assert caught is not None and "no rank had a batch" in caught
        assert unchanged  # before 0.2: rank 0's statistics were broadcast and a count returned


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
        assert "\r" not in forced.getvalue()  # progress=True off a terminal: plain lines, the last one always
        assert forced.getvalue().splitlines()[-1].startswith("recompute_bn_stats: 3 batches in "), forced.getvalue()
    with pytest.raises(zb.InvalidArgumentError, match="progress"):
        zb.recompute_bn_stats(bn_net(), data, progress="yes")
