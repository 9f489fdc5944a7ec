"""broadcast_buffers and dtypes, on 2 and 4 real gloo ranks: ``materialize=True, adopt_dtype=True`` re-registers the
receivers' buffers (meta or materialized) in the source's dtype, values bit for bit, persistence and aliases kept,
parameters never re-typed; without it a dtype difference stays a BufferStructureError that names the option, and
every tool that syncs refuses one with the buffer, the ranks, the dtypes and what to do. A failure on one rank in the
adopt path raises on every rank and changes nothing. A tiny Llama built on meta in bfloat16 takes rank 0's fp32
``inv_freq`` and generates the same tokens as rank 0."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal, check_table, logged_call, run_table

# the float64 reference of the rotary table the source builds in fp32
INV_FREQ = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
TABLE = torch.linspace(0, 1, 5, dtype=torch.float64) / 3


class Rope(nn.Module):
    """A non-persistent rotary table (shared with a submodule), a persistent table, a bfloat16 projection."""

    def __init__(self, dtype: torch.dtype, param_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.proj = nn.Linear(4, 4, dtype=param_dtype)
        self.register_buffer("inv_freq", INV_FREQ.to(dtype), persistent=False)
        self.register_buffer("table", TABLE.to(dtype))
        self.shared = nn.Module()
        self.shared.register_buffer("inv_freq", self.inv_freq, persistent=False)  # an alias


def _build(rank: int, param_dtype: torch.dtype = torch.bfloat16) -> Rope:
    """Rank 0: real, fp32 buffers. Odd ranks: built on meta in bfloat16. Rank 2: materialized bfloat16 (to_empty's
    garbage: zeros)."""
    if rank == 0:
        torch.manual_seed(0)
        return Rope(torch.float32)
    if rank % 2:
        with torch.device("meta"):
            return Rope(torch.bfloat16, param_dtype)
    model = Rope(torch.bfloat16, param_dtype)
    with torch.no_grad():
        for t in [*model.buffers(), *model.parameters()]:
            t.zero_()
    return model


def _described(model: nn.Module) -> dict:
    """Every tensor's (dtype, device, values when real), the state_dict keys, whether the alias holds."""
    out = {n: (str(t.dtype), t.device.type, None if t.is_meta else t.detach().clone())
           for n, t in [*model.named_buffers(remove_duplicate=False), *model.named_parameters()]}
    out["keys"] = sorted(model.state_dict())
    out["alias"] = model.shared.inv_freq is model.inv_freq
    out["params"] = all(isinstance(p, nn.Parameter) for p in model.parameters())
    return out


def _fault(rank: int, world: int, phase: str):
    """``reached`` raising at ``phase`` on the last rank (a receiver)."""
    from zero_buffers._core import transaction as _transaction

    real = _transaction.reached

    def fail(at, what):
        if at.value == phase and rank == world - 1:
            raise RuntimeError(f"injected at {phase} on rank {rank}")
        real(at, what)
    return real, fail


def _bn_bf16_on_odd_ranks(rank: int) -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    if rank % 2:
        model[1].to(torch.bfloat16)
    return model


def _other_tool(rank: int, name: str) -> None:
    model = _bn_bf16_on_odd_ranks(rank)
    if name == "keep_in_sync":
        handle = zb.keep_in_sync(model)
        try:
            handle.sync()
        finally:
            handle.remove()
    elif name == "average_bn_stats":
        zb.average_bn_stats(model)
    else:
        zb.broadcast_buffers(model)


CASES = ["without adopt_dtype", "adopt_dtype without materialize", "adopt_dtype", "a parameter in another dtype",
         "fails at prepare", "fails at exchange", "keep_in_sync", "average_bn_stats", "broadcast_buffers"]


def _adopt_table(rank, world, names):
    from zero_buffers._core import transaction as _transaction

    def case(name):
        if name in ("keep_in_sync", "average_bn_stats", "broadcast_buffers"):
            out = logged_call(lambda: _other_tool(rank, name))
            out["log"] = None
            return out
        model = _build(rank, torch.float16 if name == "a parameter in another dtype" and rank else torch.bfloat16)
        before = _described(model)
        kwargs = {"materialize": name != "adopt_dtype without materialize",
                  "adopt_dtype": name != "without adopt_dtype"}
        if name.startswith("fails at"):
            real, fail = _fault(rank, world, name.split()[-1])
            _transaction.reached = fail
        try:
            out = logged_call(lambda: zb.broadcast_buffers(model, include_parameters=True, **kwargs))
        finally:
            if name.startswith("fails at"):
                _transaction.reached = real
        after = _described(model)
        out.update(before=before, after=after)
        if name == "adopt_dtype" or name.startswith("fails at"):
            with torch.no_grad():  # the module still works, in its parameters' dtype
                out["forward"] = None if any(p.is_meta for p in model.parameters()) else \
                    model.proj(torch.ones(1, 4, dtype=model.proj.weight.dtype)) * model.inv_freq.max()
        return out

    return run_table(world, names, case)


def _same(a: dict, b: dict) -> bool:
    def eq(x, y):
        if isinstance(x, tuple):
            return x[:2] == y[:2] and ((x[2] is None and y[2] is None) or bitwise_equal(x[2], y[2]))
        return x == y
    return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)


def _check(name: str, res: list) -> None:
    world = len(res)
    errors = [r["error"] for r in res]
    if name == "adopt_dtype":
        assert errors == [None] * world, errors
        source = res[0]["after"]
        for rank, r in enumerate(res):
            after = r["after"]
            for buf, ref in (("inv_freq", INV_FREQ), ("shared.inv_freq", INV_FREQ), ("table", TABLE)):
                dtype, device, values = after[buf]
                assert (dtype, device) == ("torch.float32", "cpu"), (rank, buf, dtype, device)
                assert torch.equal(values.double(), ref.float().double()), (rank, buf, values)  # fp32, not bf16
                assert bitwise_equal(values, source[buf][2]), (rank, buf)
            assert after["proj.weight"][0] == "torch.bfloat16" and bitwise_equal(after["proj.weight"][2],
                                                                                 source["proj.weight"][2]), rank
            assert after["keys"] == ["proj.bias", "proj.weight", "table"], after["keys"]  # inv_freq stays out of it
            assert after["alias"] and after["params"], rank
            assert bitwise_equal(r["forward"], res[0]["forward"]), rank
        assert r["value"] == 4  # inv_freq, table, the two parameters
        # the source's dtypes travel once (a word for 4 tensors), before the allocation is voted on
        assert all(r["log"][:2] == [("all_gather", "torch.int64", 4), ("broadcast", "torch.int64", 1)] for r in res)
        return
    assert errors[0] is not None and all(e[:2] == errors[0][:2] for e in errors), errors
    typ, message = errors[0][:2]
    if name == "adopt_dtype without materialize":
        assert typ == "InvalidArgumentError" and "pass materialize=True too" in message, message
        assert all(r["log"] == [] for r in res)  # before any collective
    elif name.startswith("fails at"):
        phase = name.split()[-1]
        assert typ == "SyncAbortedError" and f"injected at {phase} on rank {world - 1}" in message, message
        assert all(e[4] == (world - 1,) for e in errors), errors
    elif name in ("without adopt_dtype", "a parameter in another dtype"):
        what = "inv_freq" if name == "without adopt_dtype" else "proj.weight"
        theirs = "bfloat16" if name == "without adopt_dtype" else "float16"
        assert typ == "BufferStructureError" and f"at '{what}' (dtype differs)" in message, message
        assert "rank 0: float32[" in message or "rank 0: bfloat16[" in message, message
        assert f"{theirs}[" in message and "No buffer was modified" in message, message
        assert "adopt_dtype=True" in message and "Ranks hold it in different dtypes" in message, message
        if name == "a parameter in another dtype":
            assert "'proj.weight' is a parameter: adopt_dtype=True re-types buffers only" in message, message
    else:  # every other tool refuses a dtype difference, naming the buffer, the ranks, the dtypes, what to do
        assert typ == "BufferStructureError", errors[0]
        odd = ", ".join(str(r) for r in range(1, world, 2))
        assert "at '1.running_mean' (dtype differs)" in message, message
        assert f"{'rank' if world == 2 else 'ranks'} {odd}: bfloat16[4] cpu" in message, message
        assert "float32[4] cpu" in message and "give it one dtype on every rank first" in message, message
        assert "zb.keep_precision(model)" in message and "zb.buffer_report(module)" in message, message
        return
    for rank, r in enumerate(res):  # a refused or failed call changed nothing (meta stays meta, bf16 stays bf16)
        assert _same(r["before"], r["after"]), (name, rank)


def test_adopt_dtype_retypes_receivers_buffers_and_every_tool_refuses_a_dtype_difference_without_it(ranks):
    check_table(CASES, ranks.run(_adopt_table, CASES, timeout=120), _check)


# ---- a tiny Llama: meta ranks in bf16 take rank 0's fp32 inv_freq, then generate -----------------------------------
def _llama(rank, world):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    if rank == 0:  # loaded in bf16: transformers computes the rotary table in fp32 all the same
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(torch.float32)
    else:  # built on meta and cast to bf16: the rotary table too
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model.to(torch.bfloat16)
    model.eval()
    out = {"without": logged_call(lambda: zb.broadcast_buffers(model, materialize=True, include_parameters=True))}
    zb.broadcast_buffers(model, materialize=True, adopt_dtype=True, include_parameters=True)
    out["rotary"] = {n: b.clone() for n, b in model.named_buffers() if "inv_freq" in n}
    out["dims"] = model.config.hidden_size // model.config.num_attention_heads, model.config.rope_theta if hasattr(
        model.config, "rope_theta") else model.config.rope_parameters["rope_theta"]
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        out["tokens"] = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return out


@pytest.mark.stack
def test_llama_built_on_meta_in_bf16_adopts_rank0s_fp32_inv_freq_and_generates_rank0s_tokens(ranks2):
    out = ranks2.run(_llama, timeout=120)
    error = out[1]["without"]["error"]
    assert error is not None and error[0] == "BufferStructureError" and "inv_freq' (dtype differs)" in error[1], error
    assert "adopt_dtype=True" in error[1], error
    dim, theta = out[0]["dims"]
    reference = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # float64
    for rank, o in enumerate(out):
        assert o["rotary"], rank
        for name, t in o["rotary"].items():
            assert t.dtype == torch.float32 and bitwise_equal(t, out[0]["rotary"][name]), (rank, name, t.dtype)
            assert torch.allclose(t.double(), reference, rtol=1e-6, atol=0), (rank, name)  # bf16 is 4e-3 off
        assert o["tokens"].shape == (1, 10) and torch.equal(o["tokens"], out[0]["tokens"]), (rank, o["tokens"])
