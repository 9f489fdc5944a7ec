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

pytestmark = pytest.mark.stack  # transformers' and Accelerate's loads: both dependency stacks
TIMEOUT = 300
TOKENS = 8


# ============================================================================================ in-rank helpers

def _llama_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                       initializer_range=1.0)  # weights large enough that positions decide the greedy tokens


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
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]])
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
            # an empty model_state_dict means "optimizers only" to set_state_dict: the others pass their own
            set_state_dict(model, (), model_state_dict=full or model.state_dict(), optim_state_dict={},
                           options=options)
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


def _own_full_state_dict(rank, world):
    """Every rank loads a full state dict of its own (no broadcast_from_rank0): its own BatchNorm statistics."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    model = _shard(_resnet(True))
    own = _resnet(True).state_dict()
    for name, t in own.items():
        if "running_mean" in name:
            t.fill_(float(rank))
    with zb.install():
        set_model_state_dict(model, own, options=StateDictOptions(full_state_dict=True))
    return _buffers(model)


def test_a_full_state_dict_load_without_broadcast_from_rank0_keeps_what_each_rank_loaded(ranks2):
    out = ranks2.run(_own_full_state_dict, timeout=TIMEOUT)
    means = [n for n in out[0] if n.endswith("running_mean")]
    assert means and all(torch.equal(o[n], torch.full_like(o[n], float(r))) for r, o in enumerate(out) for n in means)


# ============================================================================================ dcp.load

def _dcp_load(rank, world, use_install, tmp):
    """Rank 0 builds the real model, the others on meta (to_empty after fully_shard); the sharded state dict of
    get_model_state_dict is loaded from a DCP checkpoint written by a model every rank built for real."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    saved = _shard(_llama(True))
    folder = f"{tmp}/dcp-{use_install}"
    dcp.save({"model": get_model_state_dict(saved)}, checkpoint_id=folder)
    model = _shard(_llama(rank == 0))
    if rank:
        model.to_empty(device="cpu")
    with _maybe_installed(use_install):
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=folder)
    out = {"buffers": _buffers(model), "saved": _buffers(saved)}
    out.update(_api(model, tmp, f"dcp-{use_install}"))
    return out


def test_dcp_load_of_get_model_state_dict_syncs_the_buffers_dcp_never_saved(ranks):
    without, with_ = _run_both(ranks, _dcp_load)
    _report("dcp.load", ranks.world_size, _damage(without), _damage(with_))
    inv = [n for n in without[0]["buffers"] if n.endswith("inv_freq")]
    for r, o in enumerate(without[1:], 1):  # DCP saved no non-persistent buffer: to_empty's memory stays
        assert all(not bitwise_equal(o["buffers"][n], without[0]["buffers"][n]) for n in inv), r
    _check_fixed(with_)
    assert all(bitwise_equal(b, with_[0]["saved"][n]) for n, b in with_[0]["buffers"].items())
    assert all(o["tokens"] == with_[0]["tokens"] and o["dcp_round_trip"] for o in with_)


# ============================================================================================ Accelerate's FSDP2 load

def _accelerator():
    """An Accelerator with Accelerate's own FSDP2 plugin (cpu_ram_efficient_loading) in its state: on CPU
    Accelerate runs MULTI_CPU and drops the plugin, so it is put back, as the GPU path holds it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin
    AcceleratorState._reset_state(True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)
    accelerator = Accelerator(cpu=True)
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def _accelerate_load(rank, world, use_install, model_kind, tmp):
    """Llama: Accelerate's fsdp2_prepare_model as Accelerator.prepare calls it (rank 0 real, the others
    torch.empty, as transformers leaves them under cpu_ram_efficient_loading). ResNet: fsdp2_load_full_state_dict
    as fsdp2_prepare_model calls it (its input-embeddings step fails on a ResNet: no embeddings)."""
    import accelerate.accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import fsdp_utils
    env = dict(os.environ)
    try:
        accelerator = _accelerator()
        model = _llama(True) if model_kind == "llama" else _resnet(True)
        if rank:
            model = model.to_empty(device="cpu")  # the other ranks' torch.empty weights
        out: dict = {}
        with _maybe_installed(use_install):
            if model_kind == "llama":
                model = accelerate.accelerator.fsdp2_prepare_model(accelerator, model)
            else:
                full = model.state_dict()
                model = _shard(model.to("meta"))
                try:
                    fsdp_utils.fsdp2_load_full_state_dict(accelerator, model, full)
                except AttributeError as e:  # accelerate#3898: a buffer is no DTensor
                    out["error"] = str(e)
                    return out
        out["buffers"] = _buffers(model)
        out.update(_api(model, tmp, f"acc-{model_kind}-{use_install}"))
        return out
    finally:
        AcceleratorState._reset_state(True)
        os.environ.clear()
        os.environ.update(env)


def test_accelerate_fsdp2_load_keeps_rank_local_rotary_tables_without_install_and_rank0s_with_it(ranks):
    pytest.importorskip("accelerate.utils.fsdp_utils").__dict__.get("fsdp2_load_full_state_dict") or pytest.skip(
        "this Accelerate has no FSDP2 (1.1.0): nothing to load through")
    without, with_ = _run_both(ranks, _accelerate_load, "llama")
    _report("accelerate fsdp2_prepare_model (Llama)", ranks.world_size, _damage(without), _damage(with_))
    inv = [n for n in without[0]["buffers"] if n.endswith("inv_freq")]
    for r, o in enumerate(without[1:], 1):  # re-registered as each rank's own copy: what torch.empty held
        assert all(not bitwise_equal(o["buffers"][n], without[0]["buffers"][n]) for n in inv), r
    _check_fixed(with_)
    assert all(o["tokens"] == with_[0]["tokens"] and o["dcp_round_trip"] for o in with_)


def test_accelerate_fsdp2_load_of_batchnorm_statistics_fails_without_install_and_loads_rank0s_with_it(ranks):
    pytest.importorskip("accelerate.utils.fsdp_utils").__dict__.get("fsdp2_load_full_state_dict") or pytest.skip(
        "this Accelerate has no FSDP2 (1.1.0): nothing to load through")
    without, with_ = _run_both(ranks, _accelerate_load, "resnet")
    print(f"\n[measured] accelerate fsdp2_load_full_state_dict (ResNet) world={ranks.world_size}: without install() "
          f"{[o['error'] for o in without]}")
    assert all("device_mesh" in o["error"] for o in without)  # accelerate#3898, on every rank
    _check_fixed(with_)
    src = _resnet(True)  # rank 0's model, rebuilt here: the loaded statistics are its own
    assert all(bitwise_equal(with_[0]["buffers"][n], b) for n, b in src.named_buffers())
    assert all(torch.equal(o["logits"], with_[0]["logits"]) and o["dcp_round_trip"] for o in with_)


# ============================================================================================ from_pretrained

def _from_pretrained(rank, world, use_install, tmp):
    """transformers' rank-0 loading for Accelerate's FSDP (ACCELERATE_USE_FSDP, FSDP_CPU_RAM_EFFICIENT_LOADING)."""
    from transformers import ResNetForImageClassification
    if rank == 0:
        _resnet(True).save_pretrained(f"{tmp}/src-{use_install}")
    dist.barrier()
    env = dict(os.environ)
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    try:
        with _maybe_installed(use_install):
            model = ResNetForImageClassification.from_pretrained(f"{tmp}/src-{use_install}")
    finally:
        os.environ.clear()
        os.environ.update(env)
    dist.barrier()
    return {"buffers": _buffers(model)}


def test_from_pretrained_under_accelerates_fsdp_loading_gives_every_rank_rank0s_buffers(ranks):
    from tests.helpers import package_major
    without, with_ = _run_both(ranks, _from_pretrained)
    _report("from_pretrained (FSDP cpu_ram_efficient_loading, ResNet)", ranks.world_size, _damage(without),
            _damage(with_))
    if package_major("transformers") < 5:  # 4.x: only local rank 0 loads; the others keep the constructor's values
        assert _damage(without)["buffers_differing"] > 0
    _check_fixed(with_)


# ============================================================================================ install / uninstall

def _patched() -> dict[str, object]:
    """Every function install() replaces for the FSDP2-era loads, by where it lives."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd, state_dict_loader
    found = {"dsd._load_model_state_dict": dsd._load_model_state_dict,
             "dsd._get_model_state_dict": dsd._get_model_state_dict,
             "dcp.load": dcp.load, "state_dict_loader.load": state_dict_loader.load}
    import accelerate.utils
    from accelerate.utils import fsdp_utils
    if "fsdp2_load_full_state_dict" in vars(fsdp_utils):  # Accelerate 1.1.0 has no FSDP2
        import accelerate.accelerator
        found["fsdp2_load_full_state_dict"] = fsdp_utils.fsdp2_load_full_state_dict
        found["accelerator.fsdp2_prepare_model"] = accelerate.accelerator.fsdp2_prepare_model
        # what `from accelerate.utils import fsdp2_load_full_state_dict` (after install()) gives a user
        found["utils.fsdp2_load_full_state_dict"] = accelerate.utils.fsdp2_load_full_state_dict
        found["utils.fsdp2_prepare_model"] = accelerate.utils.fsdp2_prepare_model
    return found


def test_install_replaces_every_load_and_uninstall_puts_the_identical_functions_back():
    before = _patched()
    with zb.install():
        during = _patched()
        assert all(during[k] is not before[k] for k in before), [k for k in before if during[k] is before[k]]
        assert not zb.install().owner and _patched() == during  # idempotent
    assert all(_patched()[k] is before[k] for k in before)


def test_a_torch_without_the_load_install_follows_is_a_dependency_error_and_nothing_stays_installed(monkeypatch):
    from torch.distributed.checkpoint import state_dict_loader
    before = _patched()
    monkeypatch.delattr(state_dict_loader, "load")  # a torch whose DCP loads elsewhere (patched after two others)
    with pytest.raises(zb.DependencyError, match=r"state_dict_loader\.load.* from torch 2"):
        zb.install()
    assert not zb.installed()
    monkeypatch.undo()
    assert all(_patched()[k] is before[k] for k in before)  # the two patched first were put back


# ============================================================================================ rank-local states

def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def _load_raising_on_rank0(rank, world):
    """A strict broadcast load whose state dict holds a key the model lacks on rank 0 only: torch's broadcasts
    complete on every rank, then rank 0's own ``load_state_dict`` raises (unexpected key) and the others' succeed."""
    import time

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    model = _tiny()
    full = dict(model.state_dict(), extra=torch.zeros(2)) if rank == 0 else {}
    with zb.install(timeout=60):
        start = time.monotonic()  # install() itself imports Accelerate and transformers: not timed
        try:
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                        broadcast_from_rank0=True))
        except Exception as e:
            return type(e).__name__, str(e), time.monotonic() - start
    return None, "", time.monotonic() - start


def test_a_broadcast_load_that_raises_on_rank0_only_raises_on_every_rank_without_waiting_for_it(ranks):
    out = ranks.run(_load_raising_on_rank0, timeout=TIMEOUT)
    assert out[0][0] == "RuntimeError" and "extra" in out[0][1], out[0]  # rank 0: torch's own error, unchanged
    for r, (kind, text, _) in enumerate(out[1:], 1):  # the others: the same agreed error naming rank 0
        assert kind == "SyncAbortedError" and "rank 0" in text and "extra" in text, (r, kind, text)
    assert max(seconds for *_, seconds in out) < 55, out  # nobody waited out the 60 s deadline for rank 0


def _dcp_load_of_a_rank0_only_full_state_dict(rank, world, tmp):
    """``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` is a full dict on rank 0 and an empty one on
    the others; every rank passes its own to ``dcp.load``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    model = _tiny()
    dcp.save(model.state_dict(), checkpoint_id=f"{tmp}/ck")
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank))
    with zb.install(timeout=60):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        try:
            dcp.load(full, checkpoint_id=f"{tmp}/ck")
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"[:300], "entries": len(full)}
    return {"buffers": _buffers(model), "entries": len(full)}


def test_dcp_load_of_a_full_state_dict_held_on_rank0_only_syncs_on_every_rank(ranks2, tmp_path):
    out = ranks2.run(_dcp_load_of_a_rank0_only_full_state_dict, str(tmp_path), timeout=TIMEOUT)
    assert out[0]["entries"] > 0 and out[1]["entries"] == 0  # the rank-local state: rank 0's dict alone is full
    assert not any("error" in o for o in out), [o.get("error") for o in out]
    _check_fixed(out)


def _dcp_load_after_rank0_alone_built_more_state_dicts(rank, world, tmp):
    """Every rank builds the state dict it passes to ``dcp.load`` while installed; in between, rank 0 alone (its
    logging, say) builds more sharded state dicts of another module than install() remembers, so it has forgotten
    the one it loads and the others have not."""
    import time

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    model = _tiny()
    dcp.save(model.state_dict(), checkpoint_id=f"{tmp}/ck")
    with zb.install(timeout=60):
        state = get_model_state_dict(model)
        if rank == 0:
            other = nn.Linear(2, 2)
            for _ in range(100):
                get_model_state_dict(other)  # no collective: any rank may call it alone
        start = time.monotonic()
        try:
            dcp.load(state, checkpoint_id=f"{tmp}/ck")
        except Exception as e:
            return type(e).__name__, str(e), time.monotonic() - start
    return None, "", time.monotonic() - start


def test_dcp_load_followed_on_some_ranks_only_raises_the_same_error_on_every_rank_without_waiting(ranks2, tmp_path):
    out = ranks2.run(_dcp_load_after_rank0_alone_built_more_state_dicts, str(tmp_path), timeout=TIMEOUT)
    assert [o[0] for o in out] == ["BufferStructureError"] * 2, out
    assert out[0][1] == out[1][1] and "rank 0" in out[0][1] and "rank 1" in out[0][1], out
    assert max(o[2] for o in out) < 55, out  # nobody waited out the 60 s deadline


def _from_pretrained_raising_on_rank0(rank, world, tmp):
    """transformers' FSDP rank-0 loading where rank 0's checkpoint is unreadable (a truncated weights file) and
    the others' is fine: rank 0's from_pretrained raises, the others' returns."""
    import time

    from transformers import ResNetForImageClassification
    if rank == 0:
        for r in range(world):
            _resnet(True).save_pretrained(f"{tmp}/ck-{r}")
        with open(f"{tmp}/ck-0/model.safetensors", "r+b") as f:
            f.truncate(64)
    dist.barrier()
    path = f"{tmp}/ck-{rank}"
    env = dict(os.environ)
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    try:
        with zb.install(timeout=60):
            start = time.monotonic()
            try:
                ResNetForImageClassification.from_pretrained(path)
            except Exception as e:
                return type(e).__name__, str(e)[:300], time.monotonic() - start
    finally:
        os.environ.clear()
        os.environ.update(env)
    return None, "", time.monotonic() - start


def test_from_pretrained_that_raises_on_rank0_only_raises_on_every_rank_without_waiting(ranks2, tmp_path):
    out = ranks2.run(_from_pretrained_raising_on_rank0, str(tmp_path), timeout=TIMEOUT)
    assert out[0][0] is not None and out[0][0] != "SyncAbortedError", out  # rank 0: transformers' own error
    assert out[1][0] == "SyncAbortedError" and "rank 0" in out[1][1], out
    assert max(o[2] for o in out) < 55, out  # nobody waited out the 60 s deadline
