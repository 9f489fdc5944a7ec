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
import os

import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "int64": torch.int64, "bool": torch.bool}
FLOATS = ("float16", "bfloat16", "float32", "float64")
SPECIALS = (None, "nan", "nan_payload", "inf", "-inf", "-0.0")
INT_RANGE = 2 ** 50  # report property: integer differences stay exact in float64 (see README Guarantees)


def _settings(n: int):
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if os.environ.get("ZB_HYPOTHESIS_SHRINK") else [])
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, phases=phases,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------------------------
# Specs: random module trees with buffers (tensor / None / alias), parameters and an ignore list
# ---------------------------------------------------------------------------------------------------------
@st.composite
def tree_specs(draw, world: int):
    """A random module tree: modules, buffers (every dtype, 0-dim, empty, non-contiguous, specials), aliases."""
    n_mod = draw(st.integers(1, 5))
    modules = [{"parent": -1}] + [{"parent": draw(st.integers(0, i - 1))} for i in range(1, n_mod)]
    parents = {m["parent"] for m in modules}
    leaves = [i for i in range(1, n_mod) if i not in parents]
    share = None
    if leaves and draw(st.booleans()):  # one leaf module registered under a second parent too
        share = (draw(st.sampled_from(leaves)), draw(st.integers(0, n_mod - 1)))
    buffers: list[dict] = []
    for k in range(draw(st.integers(1, 9))):
        b = {"module": draw(st.integers(0, n_mod - 1)), "name": f"b{k}", "persistent": draw(st.booleans())}
        tensors = [j for j, x in enumerate(buffers) if x["kind"] == "tensor"]
        kind = draw(st.sampled_from(["tensor"] * 6 + ["none"] + (["alias"] * 2 if tensors else [])))
        b["kind"] = kind
        if kind == "alias":
            b["of"] = draw(st.sampled_from(tensors))
        elif kind == "tensor":
            dtype = draw(st.sampled_from(list(DTYPES)))
            shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
            numel = math.prod(shape)
            b.update(dtype=dtype, shape=shape,
                     noncontig=len(shape) == 2 and draw(st.booleans()),
                     special=draw(st.sampled_from(SPECIALS)) if dtype in FLOATS and numel >= 2 else None,
                     differ=tuple(draw(st.sets(st.integers(0, world - 1), max_size=world))) if numel else (),
                     diff_kind=draw(st.sampled_from(["value", "signed_zero"])) if dtype in FLOATS else "value")
        buffers.append(b)
    params = [{"module": draw(st.integers(0, n_mod - 1)), "name": f"p{k}",
               "dtype": draw(st.sampled_from(FLOATS)), "shape": tuple(draw(st.lists(st.integers(0, 3), max_size=2)))}
              for k in range(draw(st.integers(0, 2)))]
    spec = {"seed": draw(st.integers(0, 2 ** 20)), "modules": modules, "share": share, "buffers": buffers,
            "params": params, "src": draw(st.integers(0, world - 1)),
            "include_parameters": draw(st.booleans()), "atol": draw(st.sampled_from([0.0, 0.0, 0.5, 100.0]))}
    names = [n for n, _ in _expected_entries({**spec, "ignore": ()})[1]]
    spec["ignore"] = tuple(draw(st.lists(st.sampled_from(names + _paths(spec)[1:]), max_size=2, unique=True))
                           if names else [])
    return spec


def _paths(spec: dict) -> list[str]:
    """Module paths in named_modules() order (index = position), as torch visits them."""
    return [p for p, _ in _preorder(spec)]


def _preorder(spec: dict) -> list[tuple[str, int]]:
    """(path, module index) in the order nn.Module.named_modules() yields them (shared modules once)."""
    children: dict[int, list[tuple[str, int]]] = {i: [] for i in range(len(spec["modules"]))}
    for i, m in enumerate(spec["modules"][1:], 1):
        children[m["parent"]].append((f"m{i}", i))
    if spec["share"]:
        leaf, parent = spec["share"]
        children[parent].append((f"s{leaf}", leaf))
    out, seen = [], set()

    def visit(i: int, path: str) -> None:
        if i in seen:
            return
        seen.add(i)
        out.append((path, i))
        for attr, c in children[i]:
            visit(c, f"{path}.{attr}" if path else attr)

    visit(0, "")
    return out


def _root(spec: dict, k: int) -> int:
    """Index of the buffer that owns the tensor registered at ``k`` (aliases point at it)."""
    b = spec["buffers"][k]
    return b["of"] if b["kind"] == "alias" else k


def _ignored(name: str, ignore) -> bool:
    return any(name == i or name.startswith(i + ".") for i in ignore)


def _expected_entries(spec: dict) -> tuple[dict[int, str], list[tuple[str, int]]]:
    """Every registration's qualified name, and the (name, tensor) entries the library must synchronise.

    A tensor appears once, under its first name in named_modules() order that is not ignored.
    """
    path_of = {i: p for p, i in _preorder(spec)}
    qual = {k: (f"{path_of[b['module']]}.{b['name']}" if path_of[b["module"]] else b["name"])
            for k, b in enumerate(spec["buffers"])}
    entries, seen = [], set()
    for _, i in _preorder(spec):
        for k, b in enumerate(spec["buffers"]):
            if b["module"] != i or b["kind"] == "none" or _root(spec, k) in seen or _ignored(qual[k], spec["ignore"]):
                continue
            seen.add(_root(spec, k))
            entries.append((qual[k], k))
    return qual, entries


# ---------------------------------------------------------------------------------------------------------
# Building the spec on a rank
# ---------------------------------------------------------------------------------------------------------
def _gen(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) & 0x7FFFFFFF)


def _special(v: torch.Tensor, special: str | None, salt: int) -> None:
    """Put a special float (NaN with a ``salt``-dependent payload, inf, -0.0) into the last element of ``v``."""
    if special is None:
        return
    flat = v.view(-1)
    if special == "nan_payload":
        bits = {torch.float16: (torch.int16, 0x7C00), torch.bfloat16: (torch.int16, 0x7F80),
                torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}
        idt, exp = bits[v.dtype]
        flat[-1:].view(idt).fill_(exp | (1 + salt % 60))
    else:
        flat[-1] = float(special)


def _value(b: dict, gen: torch.Generator, int_range: int) -> torch.Tensor:
    """A random contiguous tensor of the buffer's dtype and shape."""
    dtype, shape = DTYPES[b["dtype"]], b["shape"]
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype == torch.int64:
        return torch.randint(-int_range, int_range, shape, generator=gen)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)


def _store(b: dict, v: torch.Tensor) -> torch.Tensor:
    """The buffer tensor: ``v`` itself, or a non-contiguous (transposed) tensor holding ``v``."""
    if not b["noncontig"]:
        return v
    t = torch.empty(b["shape"][::-1], dtype=v.dtype).t()
    t.copy_(v)
    return t


def _build(spec: dict, values, rank: int) -> tuple[nn.Module, dict[int, nn.Module]]:
    """The module tree of ``spec``; ``values(k, b)`` gives buffer k's tensor; parameters differ per rank."""
    mods = {i: nn.Module() for i in range(len(spec["modules"]))}
    for i, m in enumerate(spec["modules"][1:], 1):
        mods[m["parent"]].add_module(f"m{i}", mods[i])
    if spec["share"]:
        leaf, parent = spec["share"]
        mods[parent].add_module(f"s{leaf}", mods[leaf])
    tensors: dict[int, torch.Tensor] = {}
    for k, b in enumerate(spec["buffers"]):
        if b["kind"] == "none":
            t = None
        elif b["kind"] == "alias":
            t = tensors[b["of"]]
        else:
            t = tensors[k] = values(k, b)
        mods[b["module"]].register_buffer(b["name"], t, persistent=b["persistent"])
    for k, p in enumerate(spec["params"]):
        g = _gen(spec["seed"], 1000 + k, rank)
        mods[p["module"]].register_parameter(p["name"], nn.Parameter(torch.randn(p["shape"], generator=g).to(
            DTYPES[p["dtype"]])))
    return mods[0], mods


def _registered(spec: dict, mods: dict[int, nn.Module]) -> dict[int, torch.Tensor | None]:
    return {k: mods[b["module"]]._buffers[b["name"]] for k, b in enumerate(spec["buffers"])}


def _clone(ts: dict) -> dict:
    return {k: (None if t is None else t.detach().clone()) for k, t in ts.items()}


# ---------------------------------------------------------------------------------------------------------
# Property 1: broadcast_buffers makes every rank equal the source bit for bit
# ---------------------------------------------------------------------------------------------------------
def _broadcast_body(rank, world, spec):
    def values(k, b):
        v = _value(b, _gen(spec["seed"], k, rank), 2 ** 62)
        if v.numel() and b["dtype"] != "bool":
            v.view(-1)[0] = rank + 0.5 if v.is_floating_point() else rank  # ranks start apart, always
        _special(v, b["special"], spec["seed"] + rank)  # NaN payloads differ per rank too
        return _store(b, v)

    model, mods = _build(spec, values, rank)
    before = _clone(_registered(spec, mods))
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    n = zb.broadcast_buffers(model, src=spec["src"], include_parameters=spec["include_parameters"],
                             ignore=spec["ignore"])
    after = _registered(spec, mods)
    aliases_kept = all(after[k] is after[b["of"]] for k, b in enumerate(spec["buffers"]) if b["kind"] == "alias")
    return before, _clone(after), params_before, {n: p.detach().clone() for n, p in model.named_parameters()}, \
        n, aliases_kept


def _check_broadcast(spec, out):
    src = spec["src"]
    qual, entries = _expected_entries(spec)
    synced = {_root(spec, k) for _, k in entries}
    param_names = [n for n in out[0][2] if not _ignored(n, spec["ignore"])]
    for rank, (before, after, p_before, p_after, n, aliases_kept) in enumerate(out):
        assert n == len(entries) + (len(param_names) if spec["include_parameters"] else 0), (rank, n)
        assert aliases_kept, rank
        for k, b in enumerate(spec["buffers"]):
            if b["kind"] == "none":
                assert after[k] is None
                continue
            root = _root(spec, k)
            expect = out[src][0][root] if root in synced else before[root]
            assert bitwise_equal(after[k], expect), (rank, qual[k], b)
            if root in synced and rank != src and b.get("dtype", "bool") != "bool" and after[k].numel():
                assert not bitwise_equal(before[root], expect)  # this rank really started apart
        for name, p in p_after.items():
            take = spec["include_parameters"] and name in param_names
            assert bitwise_equal(p, out[src][2][name] if take else p_before[name]), (rank, name)


@_settings(25)
@given(spec=tree_specs(2))
def test_broadcast_makes_every_rank_equal_the_source_bit_for_bit(ranks2, spec):
    _check_broadcast(spec, ranks2.run(_broadcast_body, spec, timeout=60))


@_settings(6)
@given(spec=tree_specs(4))
def test_broadcast_makes_every_rank_equal_the_source_bit_for_bit_world4(ranks4, spec):
    _check_broadcast(spec, ranks4.run(_broadcast_body, spec, timeout=60))


# ---------------------------------------------------------------------------------------------------------
# Property 2: buffer_report flags exactly the buffers (and ranks) that differ
# ---------------------------------------------------------------------------------------------------------
def _report_body(rank, world, spec):
    def values(k, b):
        v = _value(b, _gen(spec["seed"], k), INT_RANGE)  # the same on every rank ...
        _special(v, b["special"], spec["seed"])
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
        return _store(b, v)

    model, mods = _build(spec, values, rank)
    before = _clone(_registered(spec, mods))
    report = zb.buffer_report(model, atol=spec["atol"], ignore=spec["ignore"])
    try:
        zb.assert_buffers_in_sync(model, atol=spec["atol"], ignore=spec["ignore"])
        raised = None
    except zb.BuffersOutOfSyncError as e:
        raised = (str(e), e.report)
    return report, raised, before, same_after(before, _registered(spec, mods))


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
    _, entries = _expected_entries(spec)
    assert [row.name for row in report.rows] == [name for name, _ in entries]
    for row, (name, k) in zip(report.rows, entries):
        b = spec["buffers"][_root(spec, k)]
        reg = spec["buffers"][k]
        assert (row.dtype, row.shape, row.persistent) == (b["dtype"], b["shape"], reg["persistent"]), name
        values = [o[2][_root(spec, k)] for o in out]
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


@_settings(25)
@given(spec=tree_specs(2))
def test_report_flags_exactly_the_buffers_that_differ(ranks2, spec):
    _check_report(spec, ranks2.run(_report_body, spec, timeout=60))


@_settings(6)
@given(spec=tree_specs(4))
def test_report_flags_exactly_the_buffers_that_differ_world4(ranks4, spec):
    _check_report(spec, ranks4.run(_report_body, spec, timeout=60))


# ---------------------------------------------------------------------------------------------------------
# Property 3: average_bn_stats equals a float64 reference computed from all ranks' statistics
# ---------------------------------------------------------------------------------------------------------
BN_KINDS = {"1d": nn.BatchNorm1d, "2d": nn.BatchNorm2d, "3d": nn.BatchNorm3d, "sync": nn.SyncBatchNorm}
BN_DTYPES = ("float32", "float64", "bfloat16", "float16")


@st.composite
def bn_specs(draw, world: int):
    """Random BatchNorm layers (kinds, widths, dtypes, untracked, no counter) and per-rank counts (0 included)."""
    layers = []
    for _ in range(draw(st.integers(1, 5))):
        layers.append({
            "kind": draw(st.sampled_from(list(BN_KINDS))), "features": draw(st.integers(1, 5)),
            "dtype": draw(st.sampled_from(BN_DTYPES)), "track": draw(st.sampled_from([True, True, True, False])),
            "counter": draw(st.sampled_from([True, True, True, False])), "nested": draw(st.booleans()),
            "counts": tuple(draw(st.lists(st.sampled_from([0, 0, 1, 2, 3, 7, 50, 1000]), min_size=world,
                                          max_size=world))),
        })
    return {"seed": draw(st.integers(0, 2 ** 20)), "layers": layers}


def _bn_body(rank, world, spec):
    model = nn.Module()
    model.block = nn.Sequential()
    model.register_buffer("codebook", torch.randn(3, generator=_gen(spec["seed"], rank)))
    layers = []
    for i, s in enumerate(spec["layers"]):
        m = BN_KINDS[s["kind"]](s["features"], track_running_stats=s["track"]).to(DTYPES[s["dtype"]])
        (model.block if s["nested"] else model).add_module(f"bn{i}", m)
        layers.append(m)
        if not s["track"]:
            continue
        g = _gen(spec["seed"], i, rank)
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


@_settings(25)
@given(spec=bn_specs(2))
def test_average_bn_stats_equals_the_float64_mixture_reference(ranks2, spec):
    _check_bn(spec, ranks2.run(_bn_body, spec, timeout=60))


@_settings(6)
@given(spec=bn_specs(4))
def test_average_bn_stats_equals_the_float64_mixture_reference_world4(ranks4, spec):
    _check_bn(spec, ranks4.run(_bn_body, spec, timeout=60))


def test_the_strategies_can_produce_every_case():
    """The strategies can produce every case the properties claim to cover (guards against a silent narrowing)."""
    seen: set = set()

    @_settings(150)
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

    @_settings(150)
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
