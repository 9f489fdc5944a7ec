"""no_zero_init on real DeepSpeed ZeRO-3, transformers and Accelerate ranks: modules built inside it are full, plain
replicas while partitioning is active (zero.Init, transformers' HfDeepSpeedConfig, Accelerate's DeepSpeed plugin,
nested inits, after deepspeed.initialize), and every context it suspended is restored, on exception too."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import (
    ZERO3_CONFIG,
    buffers,
    init_deepspeed,
)
from tests.zero3.models import Block, Tokenizer

# the tests of what DeepSpeed, transformers and Accelerate do: run on both dependency stacks (.ci/run)
pytestmark = pytest.mark.stack


def is_partitioned(module: nn.Module) -> bool:
    return all(hasattr(p, "ds_id") and p.numel() == 0 for p in module.parameters())


def is_plain(module: nn.Module) -> bool:
    return all(not hasattr(p, "ds_id") and p.numel() > 0 for p in module.parameters())


def _escape_init(rank, world, mode):
    deepspeed = init_deepspeed()
    pp = deepspeed.runtime.zero.partition_parameters
    seen = {}
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        seen["before"] = is_partitioned(Tokenizer())
        if mode == "disabled_init":  # what people try first: it does not escape
            with deepspeed.zero.Init(enabled=False):
                seen["inside"] = is_plain(Tokenizer())
        elif mode == "nested":
            with zb.no_zero_init():
                with zb.no_zero_init():
                    seen["inner"] = is_plain(Tokenizer())
                seen["inside"] = is_plain(Tokenizer())  # still escaped after the inner exit
        elif mode == "raises":
            try:
                with zb.no_zero_init():
                    seen["inside"] = is_plain(Tokenizer())
                    raise RuntimeError("boom")
            except RuntimeError:
                pass
        else:
            with zb.no_zero_init():
                seen["inside"] = is_plain(Tokenizer())
        seen["after"] = is_partitioned(Tokenizer())  # the Init context is active again
        seen["patched"] = pp.top_level_context.patched
    seen["closed"] = pp.top_level_context is None and pp.zero_init_context == 0
    return seen


@pytest.mark.parametrize("mode", ["plain", "nested", "raises", "disabled_init"])
def test_no_zero_init_escapes_an_active_init_and_restores_it(ranks, mode):
    for seen in ranks.run(_escape_init, mode, timeout=120):
        assert seen["before"] and seen["after"] and seen["patched"] and seen["closed"], seen
        assert seen["inside"] == (mode != "disabled_init"), seen
        if mode == "nested":
            assert seen["inner"]


def _hf(rank, world, path, mode):
    init_deepspeed()
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    from tests.hf_tiny import TinyModel, save_reference
    if rank == 0:
        save_reference(path)
    dist.barrier()
    torch.manual_seed(rank)
    acc = None
    if mode == "accelerate":
        from accelerate import Accelerator, DeepSpeedPlugin
        from accelerate.utils import InitProcessGroupKwargs
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True),
                          kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    else:
        keep = HfDeepSpeedConfig(ZERO3_CONFIG)  # noqa: F841
    try:
        default = is_partitioned(TinyModel.from_pretrained(path))
        plugin_ctx = None
        if acc is not None:  # Accelerate's own switch does not stop transformers from partitioning
            with acc.state.deepspeed_plugin.zero3_init_context_manager(enable=False):
                plugin_ctx = is_partitioned(TinyModel.from_pretrained(path))
        with zb.no_zero_init():
            flag_inside = is_deepspeed_zero3_enabled()
            model = TinyModel.from_pretrained(path)
        flag_after = is_deepspeed_zero3_enabled()
        again = is_partitioned(TinyModel.from_pretrained(path))
    finally:
        if acc is not None:
            from accelerate.state import AcceleratorState
            AcceleratorState._reset_state(True)
        unset_hf_deepspeed_config()
    before_align = buffers(model)["noise"]
    zb.broadcast_buffers(model, include_parameters=True)  # the one call that aligns random-init state
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(default=default, plugin_ctx=plugin_ctx, flag_inside=flag_inside, flag_after=flag_after, again=again,
                plain=is_plain(model), params=params, buffers=buffers(model), noise_before=before_align)


@pytest.mark.parametrize("mode", ["hf_config", "accelerate"])
def test_no_zero_init_escapes_transformers_and_accelerate(ranks, tmp_path, mode):
    from tests.hf_tiny import TinyConfig, TinyModel
    out = ranks.run(_hf, str(tmp_path), mode, timeout=180)
    torch.manual_seed(5)
    reference = TinyModel(TinyConfig())  # same seed as save_reference: the saved weights
    for r in out:
        assert r["default"] and r["again"] and r["flag_after"] and not r["flag_inside"]
        assert r["plugin_ctx"] is (True if mode == "accelerate" else None)
        assert r["plain"]  # a full replica ...
        for n, p in reference.named_parameters():  # ... that every rank loaded from the file itself
            assert torch.equal(r["params"][n], p.detach()), n
        assert r["buffers"]["bn.running_mean"].tolist() == list(range(8))
        assert torch.equal(r["buffers"]["noise"], out[0]["buffers"]["noise"])  # aligned by broadcast_buffers
    assert not torch.equal(out[0]["noise_before"], out[1]["noise_before"])  # random init differed per rank


def _hf_state(hf, pp, plugin) -> dict:
    """Everything no_zero_init touches or could touch: transformers' weakref, DeepSpeed's context, the plugin."""
    import os
    ref = hf._hf_deepspeed_config_weak_ref
    state = dict(ref=ref, obj=ref() if ref is not None else None, zero3=hf.is_deepspeed_zero3_enabled(),
                 config=hf.deepspeed_config(), ctx=pp.top_level_context,
                 patched=getattr(pp.top_level_context, "patched", None), env=dict(os.environ))
    if plugin is not None:
        state.update(dschf=plugin.dschf, flag=plugin.zero3_init_flag, config_dict=plugin.deepspeed_config)
    return state


def _raises_under_hf(rank, world, mode):
    import os

    deepspeed = init_deepspeed()
    import transformers.integrations.deepspeed as hf
    from transformers.integrations import HfDeepSpeedConfig

    pp = deepspeed.runtime.zero.partition_parameters
    env = dict(os.environ)
    plugin = keep = None
    if mode == "accelerate":
        from accelerate import Accelerator, DeepSpeedPlugin
        from accelerate.state import AcceleratorState
        from accelerate.utils import InitProcessGroupKwargs
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True),
                          kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
        plugin = acc.state.deepspeed_plugin
    else:
        keep = HfDeepSpeedConfig(ZERO3_CONFIG)
    try:
        with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
            before = _hf_state(hf, pp, plugin)
            try:
                with zb.no_zero_init():
                    inside = _hf_state(hf, pp, plugin)
                    inside_plain = is_plain(Tokenizer())
                    raise RuntimeError("boom")
            except RuntimeError as e:
                caught = str(e)
            after = _hf_state(hf, pp, plugin)
            partitioned_after = is_partitioned(Tokenizer())
        seen = dict(
            caught=caught == "boom",
            flag_before=before["zero3"] is True, escaped_inside=inside["zero3"] is False and inside["ref"] is None,
            inside_plain=inside_plain, flag_after=after["zero3"] is True,
            same_weakref=after["ref"] is before["ref"],  # the very weakref object, not a new one
            same_config_object=after["obj"] is before["obj"] and after["config"] is before["config"],
            owner=before["obj"] is (plugin.dschf if plugin is not None else keep),
            same_ds_context=after["ctx"] is before["ctx"] and after["patched"] is True,
            partitioned_after=partitioned_after, env=after["env"] == before["env"])
        if plugin is not None:  # Accelerate's plugin: same state object, same dschf, same flag and config
            seen.update(same_plugin=acc.state.deepspeed_plugin is plugin, same_dschf=after["dschf"] is before["dschf"],
                        plugin_flag=after["flag"] is True and plugin.is_zero3_init_enabled(),
                        plugin_config=after["config_dict"] is before["config_dict"])
        return seen
    finally:
        if mode == "accelerate":
            AcceleratorState._reset_state(True)
        hf.unset_hf_deepspeed_config()
        os.environ.clear()
        os.environ.update(env)


@pytest.mark.parametrize("mode", ["hf_config", "accelerate"])
def test_no_zero_init_restores_transformers_and_accelerate_state_on_exception(ranks, mode):
    out = ranks.run(_raises_under_hf, mode, timeout=180)
    for seen in out:
        assert all(seen.values()), [k for k, v in seen.items() if not v]
    assert all(seen.keys() == out[0].keys() for seen in out)


def _no_zero_init_nested_and_after_initialize(rank, world):
    deepspeed = init_deepspeed()
    import torch._dynamo  # noqa: F401 - its first import (by the optimizer) breaks under zero.Init's Tensor.__new__ patch
    pp = deepspeed.runtime.zero.partition_parameters
    seen = {}
    cfg = {**ZERO3_CONFIG, "zero_allow_untested_optimizer": True}
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        with deepspeed.zero.Init(config_dict_or_path=cfg):  # nested zero.Init
            with zb.no_zero_init():
                seen["nested"] = all(p.numel() > 0 and not hasattr(p, "ds_id") for p in Block().parameters())
            seen["inner_after"] = all(hasattr(p, "ds_id") for p in Block().parameters())
        seen["outer_after"] = all(hasattr(p, "ds_id") for p in Block().parameters())
        model = Block()
        # deepspeed.initialize inside an active Init does its own shutdown/restore of the context
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
        with zb.no_zero_init():
            seen["after_initialize"] = all(not hasattr(p, "ds_id") for p in Block().parameters())
        seen["still_active"] = all(hasattr(p, "ds_id") for p in Block().parameters())
    seen["closed"] = pp.top_level_context is None and pp.zero_init_context == 0
    return seen


def test_no_zero_init_in_nested_inits_and_after_deepspeed_initialize(ranks):
    for seen in ranks.run(_no_zero_init_nested_and_after_initialize, timeout=180):
        assert all(seen.values()), seen
