"""Property tests (hypothesis) on real gloo ranks: random module trees, dtypes, shapes and per-rank values.

Hypothesis runs in the pytest process and draws a *spec* (plain data); every rank builds the same module
tree from the spec and fills rank-specific values; the expected outcome is computed here, in the
parent, from the spec and from the values the ranks report before the call.

Bounded and reproducible: ``derandomize=True`` (a fixed sequence of examples), no example database,
no deadline, a fixed ``max_examples`` per property, and no shrinking unless ``ZB_HYPOTHESIS_SHRINK=1``
(shrinking re-runs the ranks hundreds of times; turn it on locally to minimise a failure).
"""
from __future__ import annotations

import math

import torch
from hypothesis import given
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal
from tests.strategies import (
    BN_DTYPES,
    BN_KINDS,
    DTYPES,
    INT_RANGE,
    SPECIALS,
    bn_specs,
    bounded,
    build_tree,
    clone_all,
    expected_entries,
    gen,
    ignored,
    put_special,
    random_value,
    registered,
    root_of,
    store,
    tree_specs,
)


# ---------------------------------------------------------------------------------------------------------
# Property 1: broadcast_buffers makes every rank equal the source bit for bit
# ---------------------------------------------------------------------------------------------------------
def _broadcast_body(rank, world, spec):
    def values(k, b):
        v = random_value(b, gen(spec["seed"], k, rank), 2 ** 62)
        if v.numel() and b["dtype"] != "bool":
            v.view(-1)[0] = rank + 0.5 if v.is_floating_point() else rank  # ranks start apart, always
        put_special(v, b["special"], spec["seed"] + rank)  # NaN payloads differ per rank too
        return store(b, v)

    model, mods = build_tree(spec, values, rank)
    before = clone_all(registered(spec, mods))
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    n = zb.broadcast_buffers(model, src=spec["src"], include_parameters=spec["include_parameters"],
                             ignore=spec["ignore"])
    after = registered(spec, mods)
    aliases_kept = all(after[k] is after[b["of"]] for k, b in enumerate(spec["buffers"]) if b["kind"] == "alias")
    return before, clone_all(after), params_before, {n: p.detach().clone() for n, p in model.named_parameters()}, \
        n, aliases_kept


def _check_broadcast(spec, out):
    src = spec["src"]
    qual, entries = expected_entries(spec)
    synced = {root_of(spec, k) for _, k in entries}
    param_names = [n for n in out[0][2] if not ignored(n, spec["ignore"])]
    for rank, (before, after, p_before, p_after, n, aliases_kept) in enumerate(out):
        assert n == len(entries) + (len(param_names) if spec["include_parameters"] else 0), (rank, n)
        assert aliases_kept, rank
        for k, b in enumerate(spec["buffers"]):
            if b["kind"] == "none":
                assert after[k] is None
                continue
            root = root_of(spec, k)
            expect = out[src][0][root] if root in synced else before[root]
            assert bitwise_equal(after[k], expect), (rank, qual[k], b)
            if root in synced and rank != src and b.get("dtype", "bool") != "bool" and after[k].numel():
                assert not bitwise_equal(before[root], expect)  # this rank really started apart
        for name, p in p_after.items():
            take = spec["include_parameters"] and name in param_names
            assert bitwise_equal(p, out[src][2][name] if take else p_before[name]), (rank, name)


@bounded(25)
@given(spec=tree_specs(2))
def test_broadcast_makes_every_rank_equal_the_source_bit_for_bit(ranks2, spec):
    _check_broadcast(spec, ranks2.run(_broadcast_body, spec, timeout=60))


@bounded(6)
@given(spec=tree_specs(4))
def test_broadcast_makes_every_rank_equal_the_source_bit_for_bit_world4(ranks4, spec):
    _check_broadcast(spec, ranks4.run(_broadcast_body, spec, timeout=60))


# ---------------------------------------------------------------------------------------------------------
# Property 2: buffer_report flags exactly the buffers (and ranks) that differ
# ---------------------------------------------------------------------------------------------------------
def _report_body(rank, world, spec):
    def values(k, b):
        v = random_value(b, gen(spec["seed"], k), INT_RANGE)  # the same on every rank ...
        put_special(v, b["special"], spec["seed"])
        flat = v.view(-1)
        if b["diff_kind"] == "signed_zero" and flat.numel():
            flat[0] = 0.0
        if rank in b["differ"]:  # ... except element 0 on the ranks the spec names
            if v.dtype == torch.bool:
                flat[0] = ~flat[0]
            elif b["diff_kind"] == "signed_zero":
                flat[0] = -0.0
            else:
                flat[0] = flat[0] + (rank + 1)
        return store(b, v)

    model, mods = build_tree(spec, values, rank)
    before = clone_all(registered(spec, mods))
    report = zb.buffer_report(model, atol=spec["atol"], ignore=spec["ignore"])
    try:
        zb.assert_buffers_in_sync(model, atol=spec["atol"], ignore=spec["ignore"])
        raised = None
    except zb.BuffersOutOfSyncError as e:
        raised = (str(e), e.report)
    return report, raised, before, same_after(before, registered(spec, mods))


def same_after(before, after) -> bool:
    return all((before[k] is None and after[k] is None) or bitwise_equal(before[k], after[k]) for k in before)


def _symbol(b: dict, rank: int):
    """What rank ``rank`` holds in buffer ``b``, symbolically (decided by the spec alone)."""
    if rank not in b["differ"]:
        return "base"
    return "flip" if b["dtype"] == "bool" or b["diff_kind"] == "signed_zero" else ("plus", rank)


def _elementwise_max_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| in float64; equal values (NaN with NaN, -0.0 with 0.0, inf with inf) count 0, NaN vs x inf."""
    x, y = a.double().reshape(-1), ref.double().reshape(-1)
    out = 0.0
    for xi, yi in zip(x.tolist(), y.tolist()):
        if xi == yi or (math.isnan(xi) and math.isnan(yi)):
            continue
        d = abs(xi - yi)
        out = max(out, math.inf if math.isnan(d) else d)
    return out


def _check_report(spec, out):
    world, atol = len(out), spec["atol"]
    reports = [r for r, _, _, _ in out]
    assert all(r == reports[0] for r in reports)  # identical on every rank
    report = reports[0]
    _, entries = expected_entries(spec)
    assert [row.name for row in report.rows] == [name for name, _ in entries]
    for row, (name, k) in zip(report.rows, entries):
        b = spec["buffers"][root_of(spec, k)]
        reg = spec["buffers"][k]
        assert (row.dtype, row.shape, row.persistent) == (b["dtype"], b["shape"], reg["persistent"]), name
        values = [o[2][root_of(spec, k)] for o in out]
        bitwise_bad = tuple(r for r in range(world) if _symbol(b, r) != _symbol(b, 0))
        assert bitwise_bad == tuple(r for r in range(world) if not bitwise_equal(values[r], values[0])), name
        diffs = [_elementwise_max_diff(v, values[0]) for v in values]
        if not bitwise_bad:
            assert row.in_sync and row.differing_ranks == () and row.max_abs_diff == 0.0, row
            continue
        bad = bitwise_bad if atol == 0 else tuple(r for r in range(world) if not diffs[r] <= atol)
        assert row.differing_ranks == bad and row.in_sync == (not bad), (row, diffs)
        assert row.max_abs_diff == max(diffs), (row, diffs)
    flagged = [row.name for row in report.rows if not row.in_sync]
    for _, raised, _, unchanged in out:
        assert unchanged  # a report never writes
        if flagged:
            assert raised is not None and raised[1] == report
            assert all(f"{name} " in raised[0] for name in flagged), raised[0]
        else:
            assert raised is None


@bounded(25)
@given(spec=tree_specs(2))
def test_report_flags_exactly_the_buffers_that_differ(ranks2, spec):
    _check_report(spec, ranks2.run(_report_body, spec, timeout=60))


@bounded(6)
@given(spec=tree_specs(4))
def test_report_flags_exactly_the_buffers_that_differ_world4(ranks4, spec):
    _check_report(spec, ranks4.run(_report_body, spec, timeout=60))


# ---------------------------------------------------------------------------------------------------------
# Property 3: average_bn_stats equals a float64 reference computed from all ranks' statistics
# ---------------------------------------------------------------------------------------------------------
def _bn_body(rank, world, spec):
    model = nn.Module()
    model.block = nn.Sequential()
    model.register_buffer("codebook", torch.randn(3, generator=gen(spec["seed"], rank)))
    layers = []
    for i, s in enumerate(spec["layers"]):
        m = BN_KINDS[s["kind"]](s["features"], track_running_stats=s["track"]).to(DTYPES[s["dtype"]])
        (model.block if s["nested"] else model).add_module(f"bn{i}", m)
        layers.append(m)
        if not s["track"]:
            continue
        g = gen(spec["seed"], i, rank)
        with torch.no_grad():
            m.running_mean.copy_(torch.randn(s["features"], generator=g, dtype=torch.float64) * 3 + rank)
            m.running_var.copy_(torch.rand(s["features"], generator=g, dtype=torch.float64) * 4 + 0.1)
            m.num_batches_tracked.fill_(s["counts"][rank])
        if not s["counter"]:
            m.num_batches_tracked = None

    def stats():
        return [None if m.running_mean is None else
                (m.running_mean.clone(), m.running_var.clone(),
                 None if m.num_batches_tracked is None else int(m.num_batches_tracked)) for m in layers]

    before, codebook = stats(), model.codebook.clone()
    merged = zb.average_bn_stats(model)
    return before, stats(), merged, bitwise_equal(codebook, model.codebook)


RTOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def _check_bn(spec, out):
    world = len(out)
    afters = [o[1] for o in out]
    for i, s in enumerate(spec["layers"]):
        if not s["track"]:
            assert all(a[i] is None for a in afters)
            continue
        stats = [o[0][i] for o in out]
        n = [float(s["counts"][r]) if s["counter"] else 1.0 for r in range(world)]
        total = sum(n)
        if total == 0:  # nobody updated this layer: every rank keeps its own statistics
            for r in range(world):
                assert all(bitwise_equal(afters[r][i][j], stats[r][j]) for j in (0, 1)) and afters[r][i][2] == 0
            continue
        for r in range(1, world):  # the same statistics on every rank, bit for bit
            assert bitwise_equal(afters[r][i][0], afters[0][i][0]) and bitwise_equal(afters[r][i][1], afters[0][i][1])
            assert afters[r][i][2] == afters[0][i][2]
        means = [st_[0].double() for st_ in stats]
        varis = [st_[1].double() for st_ in stats]
        mean = sum(n[r] * means[r] for r in range(world)) / total
        var = sum(n[r] * varis[r] for r in range(world)) / total + \
            sum(n[r] * (means[r] - mean) ** 2 for r in range(world)) / total
        dtype = DTYPES[s["dtype"]]
        got_mean, got_var, got_n = afters[0][i]
        assert got_mean.dtype == dtype and got_var.dtype == dtype
        scale = max(float(m.abs().max()) for m in means) + 1
        tol = RTOL[dtype]
        assert torch.allclose(got_mean.double(), mean, rtol=tol, atol=tol * scale), (s, got_mean, mean)
        assert torch.allclose(got_var.double(), var, rtol=tol, atol=tol * scale), (s, got_var, var)
        assert got_n == (int(total) if s["counter"] else None)
    merged = sum(1 for s in spec["layers"] if s["track"] and
                 sum(s["counts"][r] if s["counter"] else 1 for r in range(world)) > 0)
    assert all(o[2] == merged for o in out)
    assert all(o[3] for o in out)  # other buffers untouched


@bounded(25)
@given(spec=bn_specs(2))
def test_average_bn_stats_equals_the_float64_mixture_reference(ranks2, spec):
    _check_bn(spec, ranks2.run(_bn_body, spec, timeout=60))


@bounded(6)
@given(spec=bn_specs(4))
def test_average_bn_stats_equals_the_float64_mixture_reference_world4(ranks4, spec):
    _check_bn(spec, ranks4.run(_bn_body, spec, timeout=60))


def test_the_strategies_can_produce_every_case():
    """The strategies can produce every case the properties claim to cover (guards against a silent narrowing)."""
    seen: set = set()

    @bounded(150)
    @given(spec=tree_specs(2))
    def collect(spec):
        for b in spec["buffers"]:
            seen.add(b["kind"])
            if b["kind"] == "tensor":
                seen.update({b["dtype"], ("persistent", b["persistent"]), ("ndim", len(b["shape"])),
                             ("empty", math.prod(b["shape"]) == 0), ("noncontig", b["noncontig"]),
                             ("special", b["special"]), ("differs", bool(b["differ"])), b["diff_kind"]})
        seen.update({("share", spec["share"] is not None), ("ignore", bool(spec["ignore"])),
                     ("atol", spec["atol"]), ("params", bool(spec["params"]))})

    collect()
    expected = set(DTYPES) | {"tensor", "none", "alias", "value", "signed_zero"} | \
        {("persistent", True), ("persistent", False), ("ndim", 0), ("ndim", 1), ("ndim", 2), ("ndim", 3),
         ("empty", True), ("empty", False), ("noncontig", True), ("share", True), ("ignore", True),
         ("atol", 0.0), ("atol", 0.5), ("atol", 100.0), ("params", True), ("differs", True),
         ("differs", False)} | {("special", s) for s in SPECIALS}
    assert expected <= seen, expected - seen

    bn_seen: set = set()

    @bounded(150)
    @given(spec=bn_specs(2))
    def collect_bn(spec):
        for s in spec["layers"]:
            bn_seen.update({("kind", s["kind"]), ("dtype", s["dtype"]), ("track", s["track"]),
                            ("counter", s["counter"]), ("nested", s["nested"])})
            if s["track"] and s["counter"]:
                bn_seen.add(("all counts 0", sum(s["counts"]) == 0))
                bn_seen.add(("uneven counts", len(set(s["counts"])) > 1))

    collect_bn()
    bn_expected = {("kind", k) for k in BN_KINDS} | {("dtype", d) for d in BN_DTYPES} | \
        {(f, v) for f in ("track", "counter", "nested", "all counts 0", "uneven counts") for v in (True, False)}
    assert bn_expected <= bn_seen, bn_expected - bn_seen
