"""Declared reductions (sync_buffers(model, rules=...)) on 2 and 4 real gloo ranks: every rule kind against a float64
(or exact integer) reference computed here from the ranks' own values, the exactness of "mean" on a real EMA codebook
(vector-quantize-pytorch), and bad rules refused by name on every rank with nothing changed.

16-bit floats: ``"mean"`` and ``"sum"`` of float16 / bfloat16 buffers accumulate in float64 and round once into the
buffer's dtype, through ``sync_buffers(rules=)`` and ``keep_in_sync`` alike (float16 40000 and 30000 average to
35000, float16 35008 where their float16 sum is inf; bfloat16 255, 255, 256, 255 to 255, where the bfloat16 sum rounds
to 1024 and 256 comes out). A rule only one rank's model refuses (an integer buffer under ``"mean"`` where the others'
are floats) stops every rank within seconds with the same BufferStructureError naming it, nothing changed; refused
alike everywhere, every rank raises the InvalidArgumentError itself. ``sync_buffers(model)`` with neither a policy
nor rules (and with ``rules=None``) applies the default rules, the ``"average"`` preset, bit for bit what
``sync_buffers(model, "average")`` gives."""
from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import Toy, bitwise_equal, bn_mixture, messages, scramble
from zero_buffers.training import rules as rules_mod

BIG = 2 ** 60  # int64 values past 2**53: a float64 bucket would round them


class Counter(nn.Module):
    """A router-like module: token counts per expert (sum), a step (max), a bool flag pair, a per-rank cache."""

    def __init__(self):
        super().__init__()
        self.register_buffer("tokens_per_expert", torch.zeros(4, dtype=torch.int64))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("low", torch.zeros(3, dtype=torch.int32))
        self.register_buffer("seen", torch.zeros(2, dtype=torch.bool))
        self.register_buffer("all_seen", torch.zeros(2, dtype=torch.bool))
        self.register_buffer("rng_offset", torch.zeros(1, dtype=torch.int64))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.router = Counter()
        self.register_buffer("ema", torch.zeros(5))
        self.register_buffer("ema64", torch.zeros(5, dtype=torch.float64))
        self.register_buffer("projection", torch.zeros(2, 2))


RULES = {"*.tokens_per_expert": "sum", Counter: {"step": "max", "low": "min", "seen": "max", "all_seen": "min",
                                                 "rng_offset": "local"},
         "ema*": "mean"}


def _values(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {"bn.running_mean": torch.randn(3, generator=g) + rank, "bn.running_var": torch.rand(3, generator=g) + 0.5,
            "bn.num_batches_tracked": torch.tensor(rank + 1),
            "router.tokens_per_expert": torch.tensor([BIG + rank, 3 * rank, -rank, 1], dtype=torch.int64),
            "router.step": torch.tensor(10 * rank + 3), "router.low": torch.tensor([rank, -rank, 5], dtype=torch.int32),
            "router.seen": torch.tensor([rank == 1, False]), "router.all_seen": torch.tensor([True, rank != 1]),
            "router.rng_offset": torch.tensor([1000 + rank]),
            "ema": torch.randn(5, generator=g), "ema64": torch.randn(5, generator=g, dtype=torch.float64),
            "projection": torch.randn(2, 2, generator=g)}


def _model(rank: int) -> Model:
    model = Model()
    with torch.no_grad():
        for name, value in _values(rank).items():
            model.get_buffer(name).copy_(value)
    return model


def _every_rule(rank, world):
    model = _model(rank)
    count = zb.sync_buffers(model, rules=RULES, src=world - 1)
    return count, {n: b.clone() for n, b in model.named_buffers()}


def test_every_rule_kind_matches_its_float64_or_exact_integer_reference(ranks):
    out = ranks.run(_every_rule)
    world = len(out)
    mine = [_values(r) for r in range(world)]
    stack = {n: torch.stack([v[n] for v in mine]) for n in mine[0]}
    want = {"router.tokens_per_expert": stack["router.tokens_per_expert"].sum(0),  # exact: int64 kept as int64
            "router.step": stack["router.step"].max(0).values, "router.low": stack["router.low"].min(0).values,
            "router.seen": stack["router.seen"].any(0), "router.all_seen": stack["router.all_seen"].all(0),
            "projection": mine[-1]["projection"]}
    locals_ = [{"bn": (int(v["bn.num_batches_tracked"]), v["bn.running_mean"].double(), v["bn.running_var"].double())}
               for v in mine]
    n, mean, var = bn_mixture(locals_, "bn")
    for r, (count, got) in enumerate(out):
        assert count == len(got) - 1  # every buffer but the "local" one
        for name, value in want.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
        assert int(got["router.tokens_per_expert"][0]) == world * BIG + world * (world - 1) // 2
        torch.testing.assert_close(got["ema"].double(), stack["ema"].double().mean(0), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["ema64"], stack["ema64"].mean(0), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got["bn.running_mean"].double(), mean, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["bn.running_var"].double(), var, rtol=1e-6, atol=1e-7)
        assert int(got["bn.num_batches_tracked"]) == int(n.sum())
        assert torch.equal(got["router.rng_offset"], torch.tensor([1000 + r]))  # local: untouched
        assert all(bitwise_equal(got[k], out[0][1][k]) for k in got if k != "router.rng_offset")


def _presets(rank, world):
    out = {}
    for policy in ("broadcast", "average"):
        model = _model(rank)
        zb.sync_buffers(model, policy, rules={"ema*": "mean"})
        out[policy] = {n: b.clone() for n, b in model.named_buffers()}
    return out


def test_policies_are_presets_that_rules_refine(ranks2):
    out = ranks2.run(_presets)
    mine = [_values(r) for r in range(2)]
    for o in out:
        assert torch.equal(o["broadcast"]["bn.running_mean"], mine[0]["bn.running_mean"])  # broadcast: rank 0's
        assert not torch.equal(o["average"]["bn.running_mean"], mine[0]["bn.running_mean"])  # average: the merge
        assert int(o["average"]["bn.num_batches_tracked"]) == 3
        for policy in o:
            torch.testing.assert_close(o[policy]["ema"], (mine[0]["ema"] + mine[1]["ema"]) / 2)
            assert torch.equal(o[policy]["router.step"], mine[0]["router.step"])  # default: broadcast


# ============================================================================================ bad rules
BAD = {
    "unknown rule": ({"ema": "avg"}, "unknown rule 'avg' for pattern 'ema'"),
    "two patterns": ({"ema*": "mean", "*ma": "max"}, "buffer 'ema' is claimed by two rules: pattern '*ma' says 'max', "
                                                     "pattern 'ema*' says 'mean'"),
    "bn elsewhere": ({"ema": "bn"}, "'bn' applies to a tracking BatchNorm's"),
    "mean of int": ({"router.step": "mean"}, "buffer 'router.step' (int64) has rule 'mean' (pattern 'router.step')"),
    "mean of bool": ({Counter: {"seen": "mean"}}, "buffer 'router.seen' (bool) has rule 'mean' (class Counter)"),
    "sum of bool": ({"*.seen": "sum"}, "'sum' of bool flags is not a bool"),
    "half a bn layer": ({"bn.running_var": "broadcast"}, "BatchNorm 'bn': 'bn' merges a layer's statistics together"),
    "strict, matching nothing": ({"*.nothing": "max"}, "rule '*.nothing' matches no buffer of the model (strict=True)"),
    "bad key": ({3: "max"}, "rules keys must be qualified-name globs (str) or nn.Module classes, got 3"),
}


def _bad_rules(rank, world):
    out = {}
    for case, (rules, _) in BAD.items():
        model = _model(rank)
        out.update(messages({case: lambda: zb.sync_buffers(model, rules=rules, strict=True)},  # noqa: B023
                            zb.InvalidArgumentError))
        assert all(torch.equal(model.get_buffer(n), v) for n, v in _values(rank).items())
    with warnings.catch_warnings(record=True) as caught:  # not strict: a warning, and the sync happens
        warnings.simplefilter("always")
        out["warned"] = zb.sync_buffers(_model(rank), rules={"*.nowhere": "max"})
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, zb.ZeroBuffersWarning)]
    model = _model(rank)  # rules that differ across ranks: a structure mismatch, named, on every rank
    try:
        zb.sync_buffers(model, rules={"ema": "mean" if rank == 0 else "max"})
        out["differ"] = None
    except zb.BufferStructureError as e:
        out["differ"] = str(e)
    out["differ_unchanged"] = torch.equal(model.ema, _values(rank)["ema"])
    out.update(messages({"check with rules": lambda: zb.sync_buffers(_model(rank), "check", rules={"ema": "mean"})},
                        zb.InvalidArgumentError))
    return out


def test_bad_rules_raise_the_same_named_error_on_every_rank_and_change_nothing(ranks2):
    out = ranks2.run(_bad_rules)
    for case, (_, text) in BAD.items():
        assert out[0][case] is not None and text in out[0][case], (case, out[0][case])
        assert out[1][case] == out[0][case]
    for rank, o in enumerate(out):  # the warning once per job: on the first rank only
        assert o["warned"] == 12
        assert any("'*.nowhere' matches no buffer" in w for w in o["warnings"]) == (rank == 0), (rank, o["warnings"])
        assert "ranks called it with different arguments: rank 0: rule 'mean' for buffer 'ema'; rank 1: rule 'max' " \
            "for buffer 'ema'" in o["differ"] and o["differ_unchanged"]
        assert "takes no rules" in o["check with rules"]


def test_register_rules_checks_its_arguments():
    with pytest.raises(zb.InvalidArgumentError, match="unknown rule 'avg'"):
        zb.register_rules(Counter, {"step": "avg"})
    with pytest.raises(zb.InvalidArgumentError, match="must be a module class"):
        zb.register_rules(3, "max")  # type: ignore[arg-type]


# ============================================================================================ EMA codebook exactness
STEPS = 6


def _vq(seed: int = 0, sync: bool = False):
    from vector_quantize_pytorch import VectorQuantize
    torch.manual_seed(seed)
    return VectorQuantize(dim=8, codebook_size=16, decay=0.8, sync_codebook=sync, kmeans_init=False,
                          threshold_ema_dead_code=0)


def _tokens(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 12, 8, generator=g) * (1 + 0.5 * rank) + rank  # each rank its own data



VQ_RULES = {"cluster_size": "mean", "embed_avg": "mean", "embed": "local", "initted": "max"}


def _ema_exactness(rank, world):
    from vector_quantize_pytorch.vector_quantize_pytorch import Codebook
    zb.register_rules(Codebook, VQ_RULES, after_sync=lambda codebook: codebook.update_ema())
    try:
        ours, default = _vq(), _vq()
        reference, library = _vq(sync=True), _vq(sync=True)

        def mean_all_reduce(t: torch.Tensor) -> None:  # what an implementation that averages its statistics does
            dist.all_reduce(t)
            t /= world
        reference._codebook.all_reduce_fn = mean_all_reduce  # library keeps its own: an all-reduce SUM
        diffs = []
        for step in range(STEPS):
            x = _tokens(rank, step)
            for model in (ours, default, reference, library):
                model.train()
                model(x)
            zb.sync_buffers(ours, "average")  # the registered rules: mean of the EMA statistics, embed recomputed
            zb.sync_buffers(default, rules={Codebook: "broadcast"})  # rank 0's codebook: the bug
            cb = {k: m._codebook for k, m in (("ours", ours), ("ref", reference), ("default", default),
                                               ("library", library))}
            diffs.append({k: float((cb[k].embed - cb["ref"].embed).abs().max()) for k in cb})
        state = {k: {n: b.clone() for n, b in m._codebook.named_buffers()} for k, m in
                 (("ours", ours), ("ref", reference))}
        return diffs, state
    finally:
        rules_mod._REGISTRY.pop(Codebook, None)


def test_mean_rules_after_every_step_equal_a_vq_codebook_whose_statistics_are_mean_all_reduced(ranks):
    out = ranks.run(_ema_exactness)
    for diffs, state in out:
        assert all(d["ours"] < 1e-5 for d in diffs), diffs  # exact up to float32 summation order
        assert all(d["ref"] == 0 for d in diffs)
        for name in ("cluster_size", "embed_avg", "embed"):
            torch.testing.assert_close(state["ours"][name], state["ref"][name], rtol=1e-5, atol=1e-6)
        assert max(d["default"] for d in diffs) > 1e-2  # rank 0's codebook: every other rank's updates lost
        assert max(d["library"] for d in diffs) > 1e-4  # its own sync sums: a different EMA (laplace smoothing)
    for k in ("cluster_size", "embed_avg", "embed"):  # and every rank holds the same codebook
        assert all(bitwise_equal(o[1]["ours"][k], out[0][1]["ours"][k]) for o in out)


# ============================================================================================ 16-bit floats
F16 = (40000.0, 30000.0)
BF16 = (255.0, 255.0, 256.0, 255.0)


def _half_model(rank: int) -> nn.Module:
    model = nn.Module()
    model.register_buffer("h16", torch.full((3,), F16[rank % 2], dtype=torch.float16))
    model.register_buffer("b16", torch.full((3,), BF16[rank % 4], dtype=torch.bfloat16))
    model.register_buffer("count", torch.full((2,), 60000.0 + rank, dtype=torch.float16))
    return model


HALF_RULES = {"h16": "mean", "b16": "mean", "count": "sum"}


def _sync_both_ways(rank, world):
    one_shot = _half_model(rank)
    zb.sync_buffers(one_shot, rules=HALF_RULES)
    kept = _half_model(rank)
    handle = zb.keep_in_sync(kept, rules={"h16": "mean", "b16": "mean", "count": "local"})
    handle.sync()
    handle.remove()
    return {"one_shot": dict(one_shot.named_buffers()), "kept": dict(kept.named_buffers())}


def _expected(world: int, name: str, dtype: torch.dtype) -> torch.Tensor:
    values = F16 if name == "h16" else BF16
    mean = sum(values[r % len(values)] for r in range(world)) / world  # float64
    return torch.full((3,), mean, dtype=torch.float64).to(dtype)


def test_16_bit_means_and_sums_accumulate_in_float64_and_round_once(ranks):
    out = ranks.run(_sync_both_ways, timeout=120)
    world = len(out)
    half, brain = _expected(world, "h16", torch.float16), _expected(world, "b16", torch.bfloat16)
    assert float(half[0]) == 35008.0 and float(brain[0]) == 255.0  # 35000 rounded once: float16 steps by 32 there
    counts = torch.full((2,), sum(60000.0 + r for r in range(world)), dtype=torch.float64).half()  # inf: it is
    for o in out:
        for way in ("one_shot", "kept"):
            assert bitwise_equal(o[way]["h16"], half), (way, o[way]["h16"])
            assert bitwise_equal(o[way]["b16"], brain), (way, o[way]["b16"])
        assert bitwise_equal(o["one_shot"]["count"], counts)  # the float64 sum past float16's range, rounded once


# ============================================================================================ a rule one rank refuses
def _ema_model(rank: int, odd: int | str | None) -> nn.Module:
    model = nn.Module()
    dtype = torch.int64 if odd in (rank, "all") else torch.float32
    model.register_buffer("ema", torch.full((3,), rank, dtype=dtype))
    return model


def _rank_dependent(rank, world):
    out = {}
    for odd in (world - 1, "all", None):
        model = _ema_model(rank, odd)
        started = time.monotonic()
        error = messages({"sync": lambda: zb.sync_buffers(model, rules={"ema": "mean"})}, zb.ZeroBuffersError)
        out[odd] = (error["sync"], time.monotonic() - started, model.ema.clone())
    return out


def test_a_rule_one_ranks_model_refuses_stops_every_rank_naming_it(ranks):
    out = ranks.run(_rank_dependent, timeout=120)
    world = len(out)
    for r, o in enumerate(out):
        message, seconds, ema = o[world - 1]
        assert message is not None and "could not plan its buffers here" in message, message
        assert "'mean' of int64 values is not exact" in message and f"rank {world - 1}" in message, message
        assert seconds < 20
        assert torch.equal(ema, torch.full((3,), r, dtype=ema.dtype))  # nothing changed
        message, _, _ = o["all"]  # every rank's model refuses it: the rule error itself, everywhere
        assert message == out[0]["all"][0] and message.startswith("sync_buffers(): buffer 'ema' (int64) has rule")
        message, _, _ = o[None]  # every rank's model is fine: they sync
        assert message is None
    assert all(torch.equal(o[None][2], out[0][None][2]) for o in out)


# ============================================================================================ the default rules
def _toy_model(rank: int) -> Toy:
    torch.manual_seed(0)
    model = scramble(Toy(), rank)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.num_batches_tracked.fill_(rank + 1)
    return model


def _defaults(rank, world):
    out = {}
    for how, call in {"bare": lambda m: zb.sync_buffers(m), "rules=None": lambda m: zb.sync_buffers(m, rules=None),
                      "average": lambda m: zb.sync_buffers(m, "average")}.items():
        model = _toy_model(rank)
        returned = call(model)
        out[how] = (returned, {n: b.clone() for n, b in model.named_buffers()})
    out["rank0"] = {n: b.clone() for n, b in _toy_model(0).named_buffers()}
    out["own"] = {n: b.clone() for n, b in _toy_model(rank).named_buffers()}
    return out


def test_sync_buffers_without_policy_or_rules_applies_the_default_rules(ranks):
    out = ranks.run(_defaults, timeout=120)
    stats = ("running_mean", "running_var", "num_batches_tracked")
    for o in out:
        for how in ("bare", "rules=None"):
            returned, got = o[how]
            assert returned == o["average"][0] > 0
            assert all(bitwise_equal(got[n], o["average"][1][n]) for n in got), how  # the "average" preset
            assert all(bitwise_equal(got[n], out[0][how][1][n]) for n in got)  # the same on every rank
            for n, b in got.items():
                if not n.endswith(stats):
                    assert bitwise_equal(b, o["rank0"][n]), n  # every other buffer: rank 0's
            assert int(got["bn.num_batches_tracked"]) == sum(r + 1 for r in range(len(out)))  # merged, counted
            if len(out) > 1:
                assert not bitwise_equal(got["bn.running_mean"], o["own"]["bn.running_mean"])


def _sum16_with_nothing_added(rank, world):
    model = nn.Module()
    model.register_buffer("b16", torch.full((2,), (257.0, 256.0, 255.0, 254.0)[rank % 4], dtype=torch.bfloat16))
    model.register_buffer("h16", torch.full((2,), 1024.0 + rank * 0.5, dtype=torch.float16))
    handle = zb.keep_in_sync(model, rules={"b16": "sum", "h16": "sum"})
    seen = []
    for _ in range(6):  # nothing is added between the syncs: the sums must stay what the first one wrote
        handle.sync()
        seen.append((model.b16.clone(), model.h16.clone()))
    handle.remove()
    return seen


def test_16_bit_sums_kept_in_sync_do_not_drift_when_nothing_is_added(ranks):
    out = ranks.run(_sum16_with_nothing_added, timeout=120)
    first = out[0][0]
    for seen in out:
        for b16, h16 in seen:  # the base subtracted next time is the rounded value written, not the float64 sum
            assert torch.equal(b16, first[0]) and torch.equal(h16, first[1]), (b16, h16, first)
