"""Differential oracle: every reduction path against a float64 single-process reference, over random sequences.

Hypothesis draws a *scenario* (plain data): a world of 2, 3 or 4 ranks, a path (``keep_in_sync`` with ``every`` 1
or 3, the save hooks' repeated syncs, the trainer callbacks' syncs begun at train start or late, one-shot
``sync_buffers(rules=)``), a BatchNorm momentum (0.1 or None), how the ranks start (fresh, loaded alike, BatchNorm
statistics or counters already diverged), the source rank, and per step how many batches each rank runs (0 to 3:
uneven, and ranks that never run one). Every rank drives real buffers: a BatchNorm1d (rule ``"bn"``), ``"mean"``
buffers in float16 (values near 35 000: their sum overflows float16), bfloat16 (near 255) and float32, ``"sum"``
counters in int64 and float16, ``"max"`` over bools, ``"min"`` over int64, a broadcast float32 buffer, a ``"local"``
one.

The reference is computed here, in float64, from the scenario and the data alone where a closed form exists: the
BatchNorm statistics of a ``momentum=None`` layer are the mixture of the shared start and every rank's batches (one
``average_bn_stats`` at the end, however often the ranks synced), the ``"sum"`` counters are the start (once where
shared) plus every increment; for the other rules from what the ranks held right before each sync: ``"mean"`` is the
float64 mean rounded once into the buffer's dtype (bitwise for 16-bit floats), ``"max"``/``"min"``/broadcast are
exact, an EMA layer's merge is weighted by the batches since the last sync (and, when every rank ran as many, its
mean equals the float64 EMA of the rank-averaged batch means). After every sync every rank must hold bitwise the
same buffers. Bounded: ``derandomize=True``, a fixed number of examples, no shrinking unless ZB_HYPOTHESIS_SHRINK=1.
"""
from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from torch import nn

from tests.helpers import bitwise_equal

C = 3  # BatchNorm channels
B = 5  # rows per batch
RULES = {"m_*": "mean", "s_*": "sum", "x_*": "max", "n_*": "min", "l_*": "local"}
MEANS = {"m_f16": (torch.float16, 30000.0, 10000.0), "m_bf16": (torch.bfloat16, 200.0, 60.0),
         "m_f32": (torch.float32, -3.0, 7.0)}  # dtype, offset, spread of the values a rank writes
PATHS = ("keep_in_sync", "save_hook", "trainer_begun", "trainer_late", "one_shot")
STARTS = ("fresh", "loaded", "bn_diverged", "sum_diverged")


def _settings(n: int):
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if os.environ.get("ZB_HYPOTHESIS_SHRINK") else [])
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, phases=phases,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Bank(nn.Module):
    """The buffers a scenario drives; its own forward does nothing (a tick: keep_in_sync's hook syncs before it)."""

    def __init__(self, momentum: float | None):
        super().__init__()
        self.bn = nn.BatchNorm1d(C, momentum=momentum, affine=False)
        for name, (dtype, _, _) in MEANS.items():
            self.register_buffer(name, torch.zeros(4, dtype=dtype))
        self.register_buffer("s_i64", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("s_f16", torch.zeros(2, dtype=torch.float16))
        self.register_buffer("x_flag", torch.zeros(4, dtype=torch.bool))
        self.register_buffer("n_low", torch.full((3,), 10 ** 6, dtype=torch.int64))
        self.register_buffer("b_f32", torch.zeros(2))
        self.register_buffer("l_f32", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


# ---- the data: one deterministic function both the ranks and the reference call ---------------------------------
def _gen(seed: int, *key: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(hash((seed, *key)) % 2 ** 62)
    return g


def start_state(scn: dict, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` holds before the first step."""
    world, kind = scn["world"], scn["start"]
    g = _gen(scn["seed"], 7, rank if kind == "bn_diverged" else 0)
    out = {"bn.num_batches_tracked": torch.tensor(0), "bn.running_mean": torch.zeros(C, dtype=torch.float64),
           "bn.running_var": torch.ones(C, dtype=torch.float64)}
    if kind in ("loaded", "bn_diverged"):
        out["bn.num_batches_tracked"] = torch.tensor(3 + (rank if kind == "bn_diverged" else 0))
        out["bn.running_mean"] = torch.randn(C, generator=g, dtype=torch.float64) * 2
        out["bn.running_var"] = torch.rand(C, generator=g, dtype=torch.float64) + 0.5
    base = 1000 if kind == "loaded" else 0
    out["s_i64"] = torch.full((3,), base + (17 * rank + 5 if kind == "sum_diverged" else 0), dtype=torch.int64)
    out["s_f16"] = torch.full((2,), float(base // 8 + (3 * rank + 1 if kind == "sum_diverged" else 0)),
                              dtype=torch.float16)
    assert world >= 1
    return out


def batch(scn: dict, rank: int, step: int, j: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s ``j``-th batch of ``step``: BatchNorm input and what it adds to / writes into the buffers."""
    g = _gen(scn["seed"], 11, rank, step, j)
    x = torch.randn(B, C, generator=g, dtype=torch.float64) * (1 + rank) + 2.0 * rank - step * 0.3
    out = {"x": x, "s_i64": torch.randint(0, 10 ** 6, (3,), generator=g),
           "s_f16": torch.randint(0, 17, (2,), generator=g).double() / 2,  # exact in float16 for every sum here
           "x_flag": torch.rand(4, generator=g) < 0.15, "n_low": torch.randint(0, 10 ** 6, (3,), generator=g),
           "b_f32": torch.randn(2, generator=g), "l_f32": torch.randn(2, generator=g)}
    for name, (_, offset, spread) in MEANS.items():
        out[name] = torch.rand(4, generator=g, dtype=torch.float64) * spread + offset
    return out


def _apply(model: Bank, b: dict[str, torch.Tensor]) -> None:
    """What one batch does to the buffers, in their own dtypes (the user's arithmetic, not ours)."""
    model.bn(b["x"].float())
    with torch.no_grad():
        for name, (dtype, _, _) in MEANS.items():
            buf = getattr(model, name)
            buf.copy_(b[name].to(dtype))
        model.s_i64.add_(b["s_i64"])
        model.s_f16.add_(b["s_f16"].half())
        model.x_flag.logical_or_(b["x_flag"])
        torch.minimum(model.n_low, b["n_low"], out=model.n_low)
        model.b_f32.copy_(b["b_f32"])
        model.l_f32.copy_(b["l_f32"])


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def run_scenario(rank: int, world: int, scn: dict) -> list[tuple[dict, dict]]:
    """Drive the scenario on this rank; per sync, (what this rank held right before it, what it held after)."""
    import zero_buffers as zb
    from zero_buffers.integrations._sync import StepSync
    from zero_buffers.training.save_hooks import _RepeatedSaves

    model = Bank(scn["momentum"])
    with torch.no_grad():
        for name, value in start_state(scn, rank).items():
            model.get_buffer(name).copy_(value)
    src, path = scn["src"], scn["path"]
    handle = zb.keep_in_sync(model, rules=RULES, every=scn["every"], src=src) if path == "keep_in_sync" else None
    saves = _RepeatedSaves("average", dict(rules=RULES, strict=False, src=src, group=None, timeout=None))
    callback = StepSync.checked("BufferSyncCallback", "average", RULES, False, False, src, None)
    if path == "trainer_begun":
        callback.begin(model)
    syncs = []

    def sync(step: int) -> None:
        before = _snapshot(model)
        if path == "keep_in_sync":
            handle.sync()
        elif path == "save_hook":
            saves.sync(model)
        elif path.startswith("trainer"):
            callback.sync(model, step)
        else:
            zb.sync_buffers(model, rules=RULES, src=src)
        syncs.append((before, _snapshot(model)))

    for step, counts in enumerate(scn["steps"], 1):
        for j in range(counts[rank]):
            _apply(model, batch(scn, rank, step, j))
        if path == "keep_in_sync":
            before = _snapshot(model)
            synced = handle.syncs
            model(torch.zeros(1))  # a train-mode forward: the hook syncs before every every-th one
            if handle.syncs != synced:
                syncs.append((before, _snapshot(model)))
        elif step in scn["sync_at"]:
            sync(step)
    sync(len(scn["steps"]) + 1)  # a last sync, as before a save
    if handle is not None:
        handle.remove()
    return syncs


# ---- the reference ---------------------------------------------------------------------------------------------
def _batch_stats(scn: dict, rank: int, upto: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(batches, sum of batch means, sum of unbiased batch variances) of rank ``rank``'s first ``upto`` steps."""
    k, a, v = 0, torch.zeros(C, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
    for step, counts in enumerate(scn["steps"][:upto], 1):
        for j in range(counts[rank]):
            x = batch(scn, rank, step, j)["x"].float().double()
            k, a, v = k + 1, a + x.mean(0), v + x.var(0, unbiased=True)
    return k, a, v


def _history(scn: dict) -> bool:
    """Whether the path counts history once (keep_in_sync, the callback begun at train start) or every rank's whole
    value at its first sync (the save hooks, a callback begun late); the one-shot path has no history at all."""
    return scn["path"] in ("keep_in_sync", "trainer_begun")


def _cumulative_reference(scn: dict, upto: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(count, mean, var) a momentum=None layer must hold after a sync at step ``upto``: the mixture of the shared
    start (once) and every rank's own data, or with nothing shared of every rank's start and data."""
    world = scn["world"]
    starts = [start_state(scn, r) for r in range(world)]
    shared = _history(scn) and scn["start"] != "bn_diverged"
    comps = []
    if shared:
        s = starts[0]
        n0 = int(s["bn.num_batches_tracked"])
        comps.append((n0, n0 * s["bn.running_mean"], n0 * s["bn.running_var"]))
    for r in range(world):
        k, a, v = _batch_stats(scn, r, upto)
        if not shared:
            s = starts[r]
            n0 = int(s["bn.num_batches_tracked"])
            k, a, v = k + n0, a + n0 * s["bn.running_mean"], v + n0 * s["bn.running_var"]
        comps.append((k, a, v))
    total = sum(k for k, _, _ in comps)
    mean = sum(a for _, a, _ in comps) / total
    second = sum(v + (a * a / k if k else 0) for k, a, v in comps) / total
    return total, mean, second - mean * mean


def _ema_merge(pres: list[dict], last: list[float], src: int) -> tuple[float, int, torch.Tensor, torch.Tensor]:
    """The documented merge of what the ranks held, weighted by the batches since the last sync (``last``: each
    rank's counter then; zeros where every rank's whole value counts): (total weight, counter, mean, var)."""
    counts = [float(p["bn.num_batches_tracked"]) for p in pres]
    k = [c - b for c, b in zip(counts, last)]
    means = [p["bn.running_mean"].double() for p in pres]
    var = [p["bn.running_var"].double() for p in pres]
    total = sum(k)
    mean = sum(w * m for w, m in zip(k, means)) / max(total, 1e-300)
    second = sum(w * (v + m * m) for w, v, m in zip(k, var, means)) / max(total, 1e-300)
    return total, round(last[src] + total), mean, (second - mean * mean).clamp_min(0)


def _ema_independent(scn: dict, upto: int) -> torch.Tensor | None:
    """Where every rank ran as many batches in every step so far from the same start: the float64 EMA of the
    rank-averaged batch means, the value an EMA merge of equal-started ranks must equal (the update is linear)."""
    world, m = scn["world"], scn["momentum"]
    if scn["start"] == "bn_diverged" or any(len(set(c)) > 1 for c in scn["steps"][:upto]):
        return None
    mean = start_state(scn, 0)["bn.running_mean"].float().double()
    for step, counts in enumerate(scn["steps"][:upto], 1):
        for j in range(counts[0]):
            avg = sum(batch(scn, r, step, j)["x"].float().double().mean(0) for r in range(world)) / world
            mean = (1 - m) * mean + m * avg
    return mean


def check(scn: dict, out: list[list[tuple[dict, dict]]]) -> None:
    world, src = scn["world"], scn["src"]
    syncs = len(out[0])
    assert all(len(o) == syncs for o in out) and syncs >= 1
    sync_steps = _sync_steps(scn)
    assert len(sync_steps) == syncs, (sync_steps, syncs)
    starts = [start_state(scn, r) for r in range(world)]
    sums_shared = _history(scn) and scn["start"] != "sum_diverged"
    last_count = [float(s["bn.num_batches_tracked"]) for s in starts]
    history = _history(scn) and scn["start"] != "bn_diverged"
    for i, step in enumerate(sync_steps):
        pres = [o[i][0] for o in out]
        post = out[0][i][1]
        for o in out[1:]:  # every rank holds bitwise the same after every sync ("local": its own, untouched)
            differ = [n for n in post if n != "l_f32" and not bitwise_equal(o[i][1][n], post[n])]
            assert not differ, (i, differ)
        assert all(bitwise_equal(o[i][1]["l_f32"], o[i][0]["l_f32"]) for o in out)
        for name, (dtype, _, _) in MEANS.items():  # the float64 mean, rounded once
            want = (sum(p[name].double() for p in pres) / world).to(dtype)
            if dtype == torch.float32:  # summed in float32 on the wire: within an ulp or two of the inputs' magnitude
                scale = max(float(p[name].abs().max()) for p in pres)
                torch.testing.assert_close(post[name], want, rtol=0, atol=world * scale * 2 ** -23)
            else:
                assert bitwise_equal(post[name], want), (name, post[name], want)
        assert torch.equal(post["x_flag"], torch.stack([p["x_flag"] for p in pres]).any(0))
        assert torch.equal(post["n_low"], torch.stack([p["n_low"] for p in pres]).amin(0))
        assert bitwise_equal(post["b_f32"], pres[src]["b_f32"])
        upto = min(step, len(scn["steps"]))
        if scn["path"] == "one_shot":  # every sync merges whole values: no history by definition
            want_i64 = sum(p["s_i64"] for p in pres)
            want_f16 = sum(p["s_f16"].double() for p in pres)
        else:
            inc = [sum((batch(scn, r, s, j)["s_i64"] for s, c in enumerate(scn["steps"][:upto], 1)
                        for j in range(c[r])), torch.zeros(3, dtype=torch.int64)) for r in range(world)]
            inc16 = [sum((batch(scn, r, s, j)["s_f16"] for s, c in enumerate(scn["steps"][:upto], 1)
                          for j in range(c[r])), torch.zeros(2, dtype=torch.float64)) for r in range(world)]
            if sums_shared:
                want_i64 = starts[0]["s_i64"] + sum(inc)
                want_f16 = starts[0]["s_f16"].double() + sum(inc16)
            else:
                want_i64 = sum(s["s_i64"] for s in starts) + sum(inc)
                want_f16 = sum(s["s_f16"].double() for s in starts) + sum(inc16)
        assert torch.equal(post["s_i64"], want_i64), (post["s_i64"], want_i64)
        assert bitwise_equal(post["s_f16"], want_f16.half()), (post["s_f16"], want_f16)
        count, mean, var = post["bn.num_batches_tracked"], post["bn.running_mean"], post["bn.running_var"]
        if scn["path"] == "one_shot":  # average_bn_stats of what the ranks hold
            total, want_count, want_mean, want_var = _ema_merge(pres, [0.0] * world, src)
        elif scn["momentum"] is None:  # closed form: the data alone
            want_count, want_mean, want_var = _cumulative_reference(scn, upto)
            total = want_count
        else:
            total, want_count, want_mean, want_var = _ema_merge(pres, last_count if history or i else [0.0] * world,
                                                                src)
            independent = _ema_independent(scn, upto)
            if independent is not None and total > 0:
                torch.testing.assert_close(mean.double(), independent, rtol=1e-5, atol=1e-5)
        if total > 0:
            assert int(count) == want_count, (i, int(count), want_count)
            torch.testing.assert_close(mean.double(), want_mean, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(var.double(), want_var, rtol=1e-4, atol=1e-5)
        else:  # no rank counted a batch: the layer is left as it was
            assert all(bitwise_equal(post[n], pres[0][n]) for n in post if n.startswith("bn."))
        last_count = [float(count)] * world


def _sync_steps(scn: dict) -> list[int]:
    """The steps after which the path synced (the last one: after every step)."""
    n = len(scn["steps"])
    if scn["path"] == "keep_in_sync":
        ticks = [t for t in range(1, n + 1) if t % scn["every"] == 0]
    else:
        ticks = sorted(scn["sync_at"])
    return [*ticks, n + 1]


@st.composite
def scenarios(draw, world: int):
    n = draw(st.integers(1, 6))
    steps = [tuple(draw(st.integers(0, 3)) for _ in range(world)) for _ in range(n)]
    if draw(st.booleans()):  # a rank that never runs a batch
        idle = draw(st.integers(0, world - 1))
        steps = [tuple(0 if r == idle else c for r, c in enumerate(s)) for s in steps]
    if draw(st.booleans()):  # every rank as many batches in each step (the EMA's independent check applies)
        steps = [(s[0],) * world for s in steps]
    return {"world": world, "seed": draw(st.integers(0, 2 ** 20)), "path": draw(st.sampled_from(PATHS)),
            "every": draw(st.sampled_from([1, 3])), "momentum": draw(st.sampled_from([None, 0.1])),
            "start": draw(st.sampled_from(STARTS)), "src": draw(st.integers(0, world - 1)), "steps": steps,
            "sync_at": sorted(draw(st.sets(st.integers(1, n), max_size=n)))}


def _check_world(pool, scn: dict) -> None:
    out = pool.run(run_scenario, scn, timeout=120)
    check(scn, out)


@_settings(40)
@given(data=st.data())
def test_every_reduction_path_equals_the_float64_reference_world2(ranks2, data):
    _check_world(ranks2, data.draw(scenarios(2)))


@_settings(15)
@given(data=st.data())
def test_every_reduction_path_equals_the_float64_reference_world3(pools, data):
    _check_world(pools(3), data.draw(scenarios(3)))


@_settings(15)
@given(data=st.data())
def test_every_reduction_path_equals_the_float64_reference_world4(ranks4, data):
    _check_world(ranks4, data.draw(scenarios(4)))
