"""keep_precision: declared buffers keep their dtype (and their fp32 values) through module casts, DeepSpeed's bf16
engine (ZeRO-3, built under zero.Init or outside it), Accelerate's bf16 + ZeRO-3 prepare and FSDP2's mixed precision;
a kept BatchNorm still runs with 16-bit weights and inputs, its statistics updated in fp32 (checked against float64).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal
from zero_buffers.precision import declared as _declared, keep as _keep

# values no 16-bit dtype holds: a round trip through bf16 or fp16 changes every one of them
VALUES = torch.tensor([1.0001, 2.0002, 3.0003, 1 / 3])
MOE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
           first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
           num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
           qk_nope_head_dim=8, v_head_dim=8)


class Stats(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("ema", VALUES.clone())
        self.register_buffer("other", VALUES.clone())
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), Stats())
    with torch.no_grad():
        net[1].running_mean.copy_(VALUES)
    return net


def _dtypes(m: nn.Module) -> dict[str, torch.dtype]:
    return {n: t.dtype for n, t in [*m.named_buffers(), *m.named_parameters()]}


@pytest.mark.torch_next  # torch internals: runs on the torch-next stack too (.ci/run)
def test_kept_buffers_keep_their_dtype_and_fp32_values_through_every_cast_and_still_move_devices():
    net = _net()
    kept = zb.keep_precision(net, {"*.ema": torch.float32})
    try:
        assert kept.names == ("1.running_mean", "1.running_var", "2.ema")
        casts = [lambda m: m.half(), lambda m: m.bfloat16(), lambda m: m.to(torch.float16),
                 lambda m: m.to("cpu", torch.bfloat16), lambda m: m.type(torch.float16), lambda m: m[1].half(),
                 lambda m: m[2].bfloat16()]
        for k, cast in enumerate(casts):
            cast(net)
            assert net[1].running_mean.dtype == net[2].ema.dtype == torch.float32, f"cast {k}"
            assert bitwise_equal(net[1].running_mean, VALUES) and bitwise_equal(net[2].ema, VALUES), f"cast {k}"
            assert net[2].other.dtype in (torch.float16, torch.bfloat16), f"cast {k}: an unkept buffer is cast"
        assert net[0].weight.dtype == torch.float16
        net.double()  # a cast that loses nothing goes through
        assert net[2].ema.dtype == torch.float64 and net[2].ema.tolist() == VALUES.tolist()
        net.to("meta", torch.bfloat16)  # a device move still moves them
        assert net[2].ema.device.type == "meta" and net[2].ema.dtype == torch.float32
        net.to_empty(device="cpu")
        assert net[2].ema.device.type == "cpu" and net[2].ema.dtype == torch.float32
        assert _declared.explicit(net[2]) == {"ema": (torch.float32, "keep_precision: pattern '*.ema'")}
    finally:
        kept.remove()
    assert _declared.explicit(net[2]) == {}  # remove() undeclares, and a later cast casts them
    net.bfloat16()
    assert net[2].ema.dtype == net[1].running_var.dtype == torch.bfloat16
    assert vars(nn.Module)["_apply"].__module__ == "torch.nn.modules.module" and _keep.handles_alive() == 0


def test_bad_specs_raise_naming_the_buffer_and_leave_the_model_unchanged():
    net = _net().bfloat16()
    before = _dtypes(net)
    cases = {
        "matches no buffer": {"*.nope": torch.float32},
        "'2.count' of Stats is int64, not floating point": {Stats: {"count": torch.float32}},
        "must be a floating torch.dtype": {"*.ema": torch.int32},
        "given two dtypes": {"*.ema": torch.float32, Stats: {"ema": torch.float64}},
        "Stats: {'gone': ...} matches no buffer": {Stats: {"gone": torch.float32}},
        "spec keys must be": {3: torch.float32},
    }
    for words, spec in cases.items():
        with pytest.raises(zb.InvalidArgumentError, match="No buffer was modified") as e:
            zb.keep_precision(net, spec)
        assert words in str(e.value), (words, str(e.value))
        assert _dtypes(net) == before and _keep.handles_alive() == 0 and _declared.explicit(net[2]) == {}
    with zb.keep_precision(net, {"*.ema": torch.float32}):
        with pytest.raises(zb.InvalidArgumentError, match=r"'2\.ema' is kept in float32 already"):
            zb.keep_precision(net, {"*.ema": torch.float64})
    assert _keep.handles_alive() == 0


def test_a_second_call_changes_nothing_and_each_handle_removes_only_its_own_claims():
    net = _net().bfloat16()
    first = zb.keep_precision(net)
    stats = net[1].running_mean
    second = zb.keep_precision(net)
    assert second.names == first.names == ("1.running_mean", "1.running_var")
    assert net[1].running_mean is stats  # nothing cast the second time
    first.remove()
    net.half()
    assert net[1].running_mean.dtype == torch.float32  # the second handle still keeps them
    second.remove()
    second.remove()
    net.half()
    assert net[1].running_mean.dtype == torch.float16 and _keep.handles_alive() == 0


def _bn_reference(batches: list[torch.Tensor], momentum: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    mean, var = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    for x in batches:
        x = x.double()
        mean = (1 - momentum) * mean + momentum * x.mean(0)
        var = (1 - momentum) * var + momentum * x.var(0, unbiased=True)
    return mean, var


def test_a_kept_batchnorm_with_bf16_weights_runs_and_updates_its_statistics_in_fp32():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 4, generator=g) * 0.01 + 100).bfloat16() for _ in range(30)]
    plain = nn.BatchNorm1d(4)
    plain.weight.data = plain.weight.data.bfloat16()  # what DeepSpeed's bf16 leaves: 16-bit weights, fp32 stats
    with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Float"):
        plain(batches[0])
    bn16 = nn.BatchNorm1d(4).bfloat16()  # everything bf16: runs, the statistics stagnate
    kept_bn = nn.BatchNorm1d(4)
    with zb.keep_precision(kept_bn):
        kept_bn.bfloat16()
        for x in batches:
            bn16(x)
            y = kept_bn(x)
            assert y.dtype == torch.bfloat16
        y.float().sum().backward()
        assert kept_bn.weight.grad is not None and kept_bn.weight.grad.dtype == torch.bfloat16
        kept_bn.eval()
        assert kept_bn(batches[0]).dtype == torch.bfloat16
    mean, var = _bn_reference(batches)
    assert kept_bn.running_mean.dtype == torch.float32 and int(kept_bn.num_batches_tracked) == 30
    err = (kept_bn.running_mean.double() - mean).abs().max().item()
    err16 = (bn16.running_mean.double() - mean).abs().max().item()
    assert err < 1e-4 < err16, (err, err16)  # fp32 follows float64; bf16 stalls a whole bf16 step away
    assert (kept_bn.running_var.double() - var).abs().max().item() < 1e-5


@pytest.mark.stack
def test_a_deepseek_v3_router_bias_stays_fp32_through_bfloat16_and_the_moe_forward_runs():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(0)
    bias = 5 + torch.arange(4) * 1e-3  # close values, as a trained bias holds: bf16 makes them one
    plain, moe = DeepseekV3MoE(DeepseekV3Config(**MOE)), DeepseekV3MoE(DeepseekV3Config(**MOE))
    for m in (plain, moe):
        m.gate.e_score_correction_bias.copy_(bias)
        with torch.no_grad():  # transformers 5.x leaves the experts torch.empty until a PreTrainedModel inits them
            for p in m.parameters():
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    plain.bfloat16()
    assert plain.gate.e_score_correction_bias.dtype == torch.bfloat16
    assert len(set(plain.gate.e_score_correction_bias.tolist())) == 1
    with zb.keep_precision(moe) as kept:
        assert "gate.e_score_correction_bias" in kept.names
        moe.bfloat16()
        assert moe.gate.weight.dtype == torch.bfloat16
        assert bitwise_equal(moe.gate.e_score_correction_bias, bias.float())
        out = moe(torch.randn(2, 6, 32).bfloat16())
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        assert torch.isfinite(out.float()).all() and moe.gate.weight.grad is not None


# -- DeepSpeed: deepspeed.initialize with bf16, ZeRO-3, built under zero.Init(dtype=bf16) or outside it ------------
class Combo(nn.Module):
    """A BatchNorm on the input (its statistics have a float64 reference) and a tiny DeepSeek-V3 MoE block."""

    def __init__(self, config, moe_class):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.up = nn.Linear(4, 32)
        self.moe = moe_class(config)

    def forward(self, x):
        out = self.moe(self.up(self.bn(x)).unsqueeze(0))
        return (out[0] if isinstance(out, tuple) else out).float().square().mean()


WATCHED = ("bn.running_mean", "bn.running_var", "moe.gate.e_score_correction_bias")


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 4, generator=g) * 3 + 1).bfloat16() for _ in range(2)]


def _trained(model_or_engine, step, rank: int) -> dict:
    """Two training steps on bf16 inputs; the watched buffers' dtypes and the statistics' error against float64."""
    module = getattr(model_or_engine, "module", model_or_engine)
    after = {n: b.dtype for n, b in module.named_buffers() if n in WATCHED}
    flagged = sorted(r.name for r in zb.buffer_report(module).degraded)  # a collective: every rank reaches it
    batches = _batches(rank)
    try:
        losses = [step(x) for x in batches]
    except RuntimeError as e:  # 16-bit weights with fp32 statistics: CPU batch_norm refuses them
        return {"after": after, "flagged": flagged, "error": str(e)}
    mean, var = _bn_reference(batches)
    return {"after": after, "flagged": flagged, "losses": losses, "error": None,
            "err": max((module.bn.running_mean.double() - mean).abs().max().item(),
                       (module.bn.running_var.double() - var).abs().max().item()),
            "trained": {n: b.dtype for n, b in module.named_buffers() if n in WATCHED}}


def _deepspeed_cases(rank, world, buffer_dtype, folder=None):
    from transformers import DeepseekV3Config  # imported before zero.Init: imports under it would be patched
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from tests.helpers import init_deepspeed
    deepspeed = init_deepspeed()
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    if buffer_dtype:
        config["data_types"] = {"buffer_dtype": "bf16"}
    out = {}
    for build in ("zero_init", "plain"):
        for keep in (None, "call", "install"):
            if keep == "install" and build == "plain" and buffer_dtype:
                continue
            installed = zb.install(keep_precision=True) if keep == "install" else None
            handle = None
            try:
                torch.manual_seed(0)
                if build == "zero_init":
                    with deepspeed.zero.Init(dtype=torch.bfloat16, config_dict_or_path=config):
                        model = Combo(DeepseekV3Config(**MOE), DeepseekV3MoE)
                else:
                    model = Combo(DeepseekV3Config(**MOE), DeepseekV3MoE)
                # transformers 5's experts are torch.empty until a PreTrainedModel initialises them: do it here
                with deepspeed.zero.GatheredParameters(list(model.moe.parameters()), modifier_rank=0):
                    g = torch.Generator().manual_seed(0)
                    with torch.no_grad():
                        for p in model.moe.parameters():
                            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                handle = zb.keep_precision(model) if keep == "call" else None
                engine, *_ = deepspeed.initialize(model=model, config=config,
                                                  optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))

                def step(x, engine=engine):
                    loss = engine(x)
                    engine.backward(loss)
                    engine.step()
                    return float(loss)
                out[build, keep] = _trained(engine, step, rank)
                if folder is not None and build == "zero_init" and keep != "install":  # what the doctor reads
                    engine.save_checkpoint(f"{folder}/{keep}", tag="t")
                    torch.distributed.barrier()
                    out[build, keep]["inspected"] = sorted(d.name for d in zb.checkpoint_report(f"{folder}/{keep}")
                                                           .degraded)
            finally:
                if handle is not None:
                    handle.remove()
                if installed is not None:
                    zb.uninstall()
    return out


def _check_cases(out: dict) -> None:
    for case, o in out.items():
        kept = case[1] is not None
        # buffer_report flags exactly the watched buffers an engine left in 16 bits (none once kept)
        assert o["flagged"] == sorted(n for n in WATCHED if o["after"][n] == torch.bfloat16), (case, o)
        assert kept or case[0] != "zero_init" or o["flagged"], (case, o)  # unprotected zero.Init: flagged
        if not kept and o["error"] is not None:
            assert "expected scalar type BFloat16 but found Float" in o["error"], (case, o)
            continue
        assert o["error"] is None, (case, o)
        want = torch.float32 if kept else torch.bfloat16
        for name in WATCHED:
            assert o["trained"][name] == (torch.float32 if kept else o["after"][name]), (case, name, o)
            if kept:
                assert o["after"][name] == want, (case, name, o["after"])
        assert all(torch.isfinite(torch.tensor(o["losses"]))), (case, o["losses"])
        if kept:
            assert o["err"] < 1e-5, (case, o["err"])


@pytest.mark.stack
def test_deepspeed_bf16_casts_the_statistics_and_router_bias_to_bf16_and_keep_precision_keeps_them_fp32(ranks2,
                                                                                                         tmp_path):
    import deepspeed
    from packaging.version import Version

    per_rank = ranks2.run(_deepspeed_cases, False, str(tmp_path), timeout=600)
    old = Version(deepspeed.__version__) < Version("0.19.2")
    for out in per_rank:
        # zero-buffers inspect of the ZeRO-3 checkpoint: the bf16 statistics and router bias flagged, none once kept
        assert out["zero_init", None]["inspected"] == sorted(WATCHED), out["zero_init", None]
        assert out["zero_init", "call"]["inspected"] == [], out["zero_init", "call"]
        # without the tool: zero.Init builds them in bf16 on every version; 0.16's engine casts a plain model too
        for name in WATCHED:
            assert out["zero_init", None]["after"][name] == torch.bfloat16, (name, out["zero_init", None]["after"])
            assert out["plain", None]["after"][name] == (torch.bfloat16 if old else torch.float32), name
        _check_cases(out)


@pytest.mark.stack
def test_deepspeed_buffer_dtype_bf16_casts_every_buffer_and_keep_precision_restores_the_fp32_values(ranks2):
    import deepspeed
    from packaging.version import Version

    if Version(deepspeed.__version__) < Version("0.19.2"):
        pytest.skip(f"data_types.buffer_dtype exists from DeepSpeed 0.19.2 on (this is {deepspeed.__version__})")
    for out in ranks2.run(_deepspeed_cases, True, timeout=600):
        for name in WATCHED:  # buffer_dtype casts by b.data = ..., outside nn.Module._apply
            assert out["plain", None]["after"][name] == torch.bfloat16, name
        _check_cases(out)



def _accelerate_cases(rank, world):
    import os

    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from tests.helpers import init_deepspeed
    init_deepspeed()
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    env, out = dict(os.environ), {}
    for keep in (None, "call"):
        AcceleratorState._reset_state(True)
        handle = None
        try:
            plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=False)
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 8
            acc = Accelerator(mixed_precision="bf16", deepspeed_plugin=plugin,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
            torch.manual_seed(0)
            model = Combo(DeepseekV3Config(**MOE), DeepseekV3MoE)
            with torch.no_grad():  # transformers 5's experts are torch.empty until a PreTrainedModel inits them
                g = torch.Generator().manual_seed(0)
                for p in model.moe.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            handle = zb.keep_precision(model) if keep else None
            engine, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))

            def step(x, engine=engine, opt=opt, acc=acc):
                loss = engine(x)
                acc.backward(loss)  # DeepSpeed: the engine's backward and step
                opt.step()
                opt.zero_grad()
                return float(loss)
            out["accelerate", keep] = _trained(engine, step, rank)
        finally:
            if handle is not None:
                handle.remove()
            AcceleratorState._reset_state(True)
            unset_hf_deepspeed_config()
            os.environ.clear()
            os.environ.update(env)
    return out


@pytest.mark.stack
def test_accelerate_bf16_zero3_prepare_casts_the_statistics_or_refuses_them_and_keep_precision_keeps_them_fp32(ranks2):
    import deepspeed
    from packaging.version import Version

    old = Version(deepspeed.__version__) < Version("0.19.2")
    for out in ranks2.run(_accelerate_cases, timeout=600):
        plain = out["accelerate", None]
        if old:  # DeepSpeed 0.16's engine calls module.bfloat16(): every floating buffer bf16
            assert all(plain["after"][n] == torch.bfloat16 for n in WATCHED), plain["after"]
        else:  # 0.19.8 casts parameters only: fp32 statistics beside bf16 weights, which CPU batch_norm refuses
            assert plain["after"]["bn.running_mean"] == torch.float32, plain["after"]
            assert plain["error"] is not None, plain
        _check_cases(out)


# -- FSDP2: fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=bf16)) casts parameters, never buffers ----------
def _fsdp2_mixed_precision(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {}
    for case in ("plain", "bfloat16", "kept"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 8))  # statistics of the inputs: a float64 reference
        handle = zb.keep_precision(model) if case == "kept" else None
        try:
            if case == "bfloat16":  # what a user does when the BatchNorm refuses: the statistics become bf16
                model.bfloat16()
            fully_shard(model[0], mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            batches = _batches(rank)
            try:
                for x in batches:
                    model(x).float().square().mean().backward()
                    opt.step()
                    opt.zero_grad()
            except RuntimeError as e:
                out[case] = {"error": str(e)}
                continue
            mean, _ = _bn_reference(batches)
            report = zb.buffer_report(model)
            out[case] = {"error": None, "dtype": model[0].running_mean.dtype,
                         "err": (model[0].running_mean.double() - mean).abs().max().item(),
                         "tracked": int(model[0].num_batches_tracked),
                         "degraded": sorted(r.name for r in report.degraded)}
        finally:
            if handle is not None:
                handle.remove()
    return out


@pytest.mark.torch_next  # torch internals: runs on the torch-next stack too (.ci/run)
def test_fsdp2_bf16_mixed_precision_refuses_a_batchnorm_on_cpu_and_keep_precision_runs_it_in_fp32(ranks2):
    for rank, out in enumerate(ranks2.run(_fsdp2_mixed_precision, timeout=240)):
        # the policy casts the unsharded parameters to bf16 and leaves the fp32 statistics: CPU batch_norm refuses
        assert "expected scalar type BFloat16 but found Float" in (out["plain"]["error"] or ""), out["plain"]
        cast = out["bfloat16"]  # runs with bf16 statistics, which buffer_report flags and which drift from float64
        assert cast["error"] is None and cast["dtype"] == torch.bfloat16, cast
        assert cast["degraded"] == ["0.running_mean", "0.running_var"], cast
        kept = out["kept"]  # fp32 statistics that follow the float64 reference; nothing flagged
        assert kept["error"] is None and kept["dtype"] == torch.float32 and kept["tracked"] == 2, (rank, kept)
        assert kept["err"] < 1e-5 < cast["err"], (rank, kept["err"], cast["err"])
        assert kept["degraded"] == [], kept
