"""Hypothesis strategies for the property tests, and what a rank builds from what they draw.

A strategy draws a *spec* (plain data) in the pytest process; every rank builds the same module tree (or BatchNorm
layers) from it and fills rank-specific values, and the expected outcome is computed in the parent from the spec and
from what the ranks report. Used by tests/core/test_broadcast.py, tests/core/test_report.py and
tests/bn/test_average.py; tests/harness/test_strategies.py proves the strategies reach every case they claim.

Bounded and reproducible (:func:`bounded`): ``derandomize=True`` (a fixed sequence of examples), no example database,
no deadline, a fixed ``max_examples`` per property, and no shrinking unless ``ZB_HYPOTHESIS_SHRINK=1`` (shrinking
re-runs the ranks hundreds of times; turn it on locally to minimise a failure).
"""
from __future__ import annotations

import math
import os

import torch
from hypothesis import HealthCheck, Phase, settings, strategies as st
from torch import nn

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "int64": torch.int64, "bool": torch.bool}
FLOATS = ("float16", "bfloat16", "float32", "float64")
SPECIALS = (None, "nan", "nan_payload", "inf", "-inf", "-0.0")
INT_RANGE = 2 ** 50  # report property: integer differences stay exact in float64 (see README Guarantees)


def bounded(n: int):
    """Hypothesis settings for a property: ``n`` examples, derandomized, no database, no deadline."""
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
    names = [n for n, _ in expected_entries({**spec, "ignore": ()})[1]]
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


def root_of(spec: dict, k: int) -> int:
    """Index of the buffer that owns the tensor registered at ``k`` (aliases point at it)."""
    b = spec["buffers"][k]
    return b["of"] if b["kind"] == "alias" else k


def ignored(name: str, ignore) -> bool:
    return any(name == i or name.startswith(i + ".") for i in ignore)


def expected_entries(spec: dict) -> tuple[dict[int, str], list[tuple[str, int]]]:
    """Every registration's qualified name, and the (name, tensor) entries the library must synchronise.

    A tensor appears once, under its first name in named_modules() order that is not ignored.
    """
    path_of = {i: p for p, i in _preorder(spec)}
    qual = {k: (f"{path_of[b['module']]}.{b['name']}" if path_of[b["module"]] else b["name"])
            for k, b in enumerate(spec["buffers"])}
    entries, seen = [], set()
    for _, i in _preorder(spec):
        for k, b in enumerate(spec["buffers"]):
            if b["module"] != i or b["kind"] == "none" or root_of(spec, k) in seen or ignored(qual[k], spec["ignore"]):
                continue
            seen.add(root_of(spec, k))
            entries.append((qual[k], k))
    return qual, entries


# ---------------------------------------------------------------------------------------------------------
# Building the spec on a rank
# ---------------------------------------------------------------------------------------------------------
def gen(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) & 0x7FFFFFFF)


def put_special(v: torch.Tensor, special: str | None, salt: int) -> None:
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


def random_value(b: dict, gen: torch.Generator, int_range: int) -> torch.Tensor:
    """A random contiguous tensor of the buffer's dtype and shape."""
    dtype, shape = DTYPES[b["dtype"]], b["shape"]
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype == torch.int64:
        return torch.randint(-int_range, int_range, shape, generator=gen)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)


def store(b: dict, v: torch.Tensor) -> torch.Tensor:
    """The buffer tensor: ``v`` itself, or a non-contiguous (transposed) tensor holding ``v``."""
    if not b["noncontig"]:
        return v
    t = torch.empty(b["shape"][::-1], dtype=v.dtype).t()
    t.copy_(v)
    return t


def build_tree(spec: dict, values, rank: int) -> tuple[nn.Module, dict[int, nn.Module]]:
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
        g = gen(spec["seed"], 1000 + k, rank)
        mods[p["module"]].register_parameter(p["name"], nn.Parameter(torch.randn(p["shape"], generator=g).to(
            DTYPES[p["dtype"]])))
    return mods[0], mods


def registered(spec: dict, mods: dict[int, nn.Module]) -> dict[int, torch.Tensor | None]:
    return {k: mods[b["module"]]._buffers[b["name"]] for k, b in enumerate(spec["buffers"])}


def clone_all(ts: dict) -> dict:
    return {k: (None if t is None else t.detach().clone()) for k, t in ts.items()}


# ---------------------------------------------------------------------------------------------------------
# Specs: random BatchNorm layers and per-rank counts
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
