"""install() follows the FSDP2-era loads: set_model_state_dict / set_state_dict with broadcast_from_rank0, dcp.load,
Accelerate's FSDP2 full-state-dict load, transformers' from_pretrained under Accelerate's FSDP loading; real gloo
ranks (2 and 4, and a 2x2 HSDP mesh), real fully_shard, a tiny transformers LlamaForCausalLM (rotary inv_freq,
non-persistent) and a tiny transformers ResNet (BatchNorm statistics, persistent).

Each body runs the load twice in the same ranks, without and with install(), and returns every buffer, the greedy
tokens and what the model's own API gave; the tests show the wrong buffers without install() (rank 0's values are the
reference: the loading source) and rank 0's values bit for bit with it.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal

TIMEOUT = 300
TOKENS = 8


# ============================================================================================ in-rank helpers

def _llama_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)


def _llama(real: bool):
    """Rank 0's model: real and seeded; the others' on meta (what the broadcast loads expect)."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    if real:
        return LlamaForCausalLM(_llama_config())
    with torch.device("meta"):
        return LlamaForCausalLM(_llama_config())


def _resnet(real: bool):
    from transformers import ResNetConfig, ResNetForImageClassification
    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                          num_labels=3)
    if not real:
        with torch.device("meta"):
            return ResNetForImageClassification(config)
    model = ResNetForImageClassification(config)
    with torch.no_grad():  # statistics a trained model would have: none of them the constructor's
        for k, m in enumerate(model.modules()):
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.num_batches_tracked.fill_(100 + k)
    return model


def _shard(model: nn.Module, mesh=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    blocks = model.model.layers if hasattr(model, "model") else model.resnet.encoder.stages
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _tokens(model: nn.Module) -> list[int]:
    """Greedy decoding, exactly TOKENS new tokens (min_new_tokens: no rank stops early at an EOS)."""
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(pixel_values=torch.linspace(-1, 1, 3 * 16 * 16).reshape(1, 3, 16, 16)).logits


def _api(model: nn.Module, tmp: str, tag: str) -> dict:
    """The model's own API after the load: its output, .device / .dtype, a full state dict written with
    save_pretrained on rank 0, a DCP save and load round trip of its sharded state dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    out = {"tokens": _tokens(model)} if hasattr(model, "generate") and hasattr(model, "lm_head") else {
        "logits": _logits(model)}
    out["api"] = (str(model.device), str(model.dtype))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(f"{tmp}/{tag}", state_dict=full)
    sharded = get_model_state_dict(model)
    dcp.save(sharded, checkpoint_id=f"{tmp}/{tag}-dcp")
    before = _buffers(model)
    dcp.load(sharded, checkpoint_id=f"{tmp}/{tag}-dcp")
    out["dcp_round_trip"] = all(bitwise_equal(before[n], b) for n, b in model.named_buffers())
    dist.barrier()
    return out


def _maybe_installed(use_install: bool):
    if use_install:
        return zb.install()
    import contextlib
    return contextlib.nullcontext()


# ============================================================================================ measured, in the test

def _damage(out: list[dict], key: str = "buffers") -> dict[str, float]:
    """Against rank 0 (the loading source): the largest difference of any buffer on any rank, how many values are
    NaN, how many buffers differ bit for bit; generated tokens that differ from rank 0's."""
    ref = out[0][key]
    diff, nan, differ = 0.0, 0, 0
    for o in out[1:]:
        for name, b in o[key].items():
            r = ref[name]
            nan += int(torch.isnan(b).sum()) if b.is_floating_point() else 0
            if not bitwise_equal(b, r):
                differ += 1
                d = (b.double() - r.double()).abs()
                diff = max(diff, float("inf") if torch.isnan(d).any() else float(d.max()))
    tokens = sum(sum(a != b for a, b in zip(o["tokens"], out[0]["tokens"])) for o in out[1:]) if "tokens" in ref or (
        "tokens" in out[0]) else 0
    return {"max_abs_diff": diff, "nan": nan, "buffers_differing": differ, "tokens_differing": tokens}


def _report(what: str, world: int, without: dict, with_: dict) -> None:
    import transformers
    print(f"\n[measured] {what} world={world} torch={torch.__version__} transformers={transformers.__version__}: "
          f"without install() {without}; with install() {with_}")


def _check_fixed(out: list[dict], key: str = "buffers") -> None:
    for r, o in enumerate(out):
        assert o[key].keys() == out[0][key].keys(), r
        for name, b in o[key].items():
            assert bitwise_equal(b, out[0][key][name]), f"rank {r}: {name} is not rank 0's after install()"
            assert b.device.type == "cpu", f"rank {r}: {name} on {b.device}"


# ============================================================================================ set_model_state_dict

def _set_state_dict(rank, world, use_install, how, layout, tmp):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict
    mesh = None
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _llama(rank == 0)
    full = model.state_dict() if rank == 0 else {}
    _shard(model, mesh)
    if rank and layout != "meta":
        model.to_empty(device="cpu")  # rank 0 keeps what it loaded; "meta": the others keep meta buffers
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with _maybe_installed(use_install):
        if how == "set_model_state_dict":
            set_model_state_dict(model, full, options=options)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            set_state_dict(model, opt, model_state_dict=full, optim_state_dict={}, options=options)
    out = {"buffers": _buffers(model), "installed_after": zb.installed()}
    if not use_install and layout == "meta":
        out["devices"] = sorted({b.device.type for b in model.buffers()})
        return out  # a meta buffer: the model cannot run
    out.update(_api(model, tmp, f"{how}-{layout}-{use_install}"))
    return out


def _run_both(pool, body, *args):
    with tempfile.TemporaryDirectory() as tmp:
        without = pool.run(body, False, *args, tmp, timeout=TIMEOUT)
        with_ = pool.run(body, True, *args, tmp, timeout=TIMEOUT)
    return without, with_


@pytest.mark.parametrize("how", ["set_model_state_dict", "set_state_dict"])
def test_broadcast_from_rank0_load_leaves_rotary_tables_garbage_without_install_and_rank0s_with_it(ranks, how):
    without, with_ = _run_both(ranks, _set_state_dict, how, "flat")
    bad = _damage(without)
    _report(how, ranks.world_size, bad, _damage(with_))
    inv = [n for n in without[0]["buffers"] if n.endswith("inv_freq")]
    assert inv, "the tiny Llama has a rotary table"
    for r, o in enumerate(without[1:], 1):  # the bug: the non-persistent tables are what to_empty left
        assert all(not bitwise_equal(o["buffers"][n], without[0]["buffers"][n]) for n in inv), r
    _check_fixed(with_)
    assert all(o["tokens"] == with_[0]["tokens"] and len(o["tokens"]) == TOKENS for o in with_)
    assert all(o["api"] == ("cpu", "torch.float32") and o["dcp_round_trip"] for o in with_)
    assert not any(o["installed_after"] for o in with_)  # the context manager uninstalled


def test_broadcast_from_rank0_load_into_a_2x2_hsdp_mesh_syncs_over_the_whole_mesh(ranks4):
    without, with_ = _run_both(ranks4, _set_state_dict, "set_model_state_dict", "hsdp")
    _report("set_model_state_dict HSDP 2x2", 4, _damage(without), _damage(with_))
    inv = [n for n in without[0]["buffers"] if n.endswith("inv_freq")]
    for r in (1, 2, 3):  # the other shard of the source's replica and both ranks of the other replica
        assert all(not bitwise_equal(without[r]["buffers"][n], without[0]["buffers"][n]) for n in inv), r
    _check_fixed(with_)
    assert all(o["tokens"] == with_[0]["tokens"] for o in with_)


def test_fully_shard_of_a_model_left_on_meta_is_materialized_by_the_first_broadcast_load(ranks):
    without, with_ = _run_both(ranks, _set_state_dict, "set_model_state_dict", "meta")
    for o in without[1:]:  # the bug: the non-persistent buffers never left meta
        assert o["devices"] == ["cpu", "meta"] or o["devices"] == ["meta"], o["devices"]
    _check_fixed(with_)
    assert all(o["tokens"] == with_[0]["tokens"] for o in with_)
