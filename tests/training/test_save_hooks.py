"""Checkpoints carry synchronised buffers: plain torch (DDP), Accelerate (DDP and DeepSpeed ZeRO-3), DeepSpeed engines.

Every test trains on real gloo ranks with shard-dependent data, saves the default way and with the fix,
reloads the files here in one fresh process, and compares the BatchNorm buffers with the merged truth. The save
hooks refuse one-shot data (a callable recomputes at every save), and Accelerate's save_model / get_state_dict, which
run on the main process only and so cannot sync, warn once and do not hang."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.ckpt_kinds import Tag  # identity with a non-BatchNorm buffer (a step counter, a codebook ...)
from tests.helpers import (
    ZERO3_CONFIG,
    bn_net,
    init_deepspeed,
)
from zero_buffers._core import modules as _modules

STAT_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 3), nn.BatchNorm1d(3, momentum=None), Tag())


def shard(rank: int, n: int = 3, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank r's batches: brightness and contrast depend on the shard."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [(torch.randn(8, 3, 6, 6, generator=g) * (1 + rank) + 2.0 * rank, torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


def recompute_data(rank: int) -> list[torch.Tensor]:
    """Uneven numbers of batches per rank for the recompute policy."""
    return [x for x, _ in shard(rank, n=1 + rank % 3, seed=7)]


def bn_state(sd: dict) -> dict[str, torch.Tensor]:
    """The BatchNorm statistics of a state dict, keys without a 'module.' prefix."""
    return {k.removeprefix("module."): v.detach().cpu().clone() for k, v in sd.items() if k.endswith(STAT_SUFFIXES)}


def mixture(pres: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """average_bn_stats' definition: ranks weighted by their counters, spread of the means included."""
    out = {}
    for key in pres[0]:
        if not key.endswith("running_mean"):
            continue
        layer = key.removesuffix("running_mean")
        n = torch.tensor([float(p[layer + "num_batches_tracked"]) for p in pres], dtype=torch.float64)
        w = (n / n.sum())[:, None]
        means = torch.stack([p[key].double() for p in pres])
        vars_ = torch.stack([p[layer + "running_var"].double() for p in pres])
        mean = (w * means).sum(0)
        out[key] = mean
        out[layer + "running_var"] = (w * vars_).sum(0) + (w * (means - mean) ** 2).sum(0)
    return out


def population(params: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    """recompute's truth: every BN layer's input over all ranks' recompute batches, with the saved parameters."""
    model = make_net()
    model.load_state_dict({k.removeprefix("module."): v for k, v in params.items() if not k.endswith(STAT_SUFFIXES)},
                          strict=False)
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.setdefault(n, []).append(a[0].double()))
             for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    model.train()
    with torch.no_grad():
        for r in range(world):
            for x in recompute_data(r):
                model(x.float())
    for h in hooks:
        h.remove()
    out = {}
    for name, xs in inputs.items():
        x = torch.cat(xs)
        flat = x.transpose(0, 1).reshape(x.shape[1], -1)
        out[f"{name}.running_mean"], out[f"{name}.running_var"] = flat.mean(1), flat.var(1)
    return out


def assert_stats(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    for key, value in want.items():
        torch.testing.assert_close(got[key].double(), value.double(), rtol=tol, atol=tol, msg=key)


def differs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return any(not torch.allclose(got[k].double(), v.double(), rtol=1e-3, atol=1e-3) for k, v in want.items())


def train(step, model: nn.Module, rank: int) -> None:
    """Three steps on this rank's shard; ``step(loss)`` does backward and the optimizer step."""
    model.train()
    for x, y in shard(rank):
        step(nn.functional.cross_entropy(model(x), y))


def local_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    return bn_state(_modules.unwrap(model, "test").state_dict())


# -- plain torch: sync_buffers before torch.save on rank 0 ----------------------------------------------------------
def _plain_ddp(rank, world, folder, policy, src):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_net(), broadcast_buffers=False)
    model.module[7].tag.fill_(rank)  # a rank-local non-BatchNorm buffer
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(lambda loss: (opt.zero_grad(), loss.backward(), opt.step()), model, rank)
    pre = local_stats(model)
    if rank == 0:
        torch.save(model.module.state_dict(), Path(folder, "default.pt"))
    data = recompute_data(rank) if policy == "recompute" else None
    zb.sync_buffers(model, policy, src=src, data=data)
    if rank == 0:
        torch.save(model.module.state_dict(), Path(folder, "fixed.pt"))
    return pre, local_stats(model), model.module[7].tag.tolist()


@pytest.mark.stack
@pytest.mark.parametrize("policy", ["average", "recompute", "broadcast"])
def test_plain_torch_sync_buffers_then_save_on_rank_0(ranks, tmp_path, policy):
    world = ranks.world_size
    src = world - 1 if policy == "broadcast" else 0
    out = ranks.run(_plain_ddp, str(tmp_path), policy, src, timeout=60)
    pres = [o[0] for o in out]
    default = bn_state(torch.load(tmp_path / "default.pt"))
    fixed_sd = torch.load(tmp_path / "fixed.pt")
    fixed = bn_state(fixed_sd)
    truth = {"average": lambda: mixture(pres), "broadcast": lambda: pres[src],
             "recompute": lambda: population(fixed_sd, world)}[policy]()
    assert_stats(default, pres[0], tol=0)  # the default checkpoint: rank 0's statistics ...
    assert differs(default, truth)  # ... which are not those of all ranks
    assert_stats(fixed, truth)
    for _, post, tag in out:
        assert_stats(post, fixed, tol=0)  # every rank holds what was saved
        assert tag == [src, src]  # and every other buffer is src's
    if policy == "recompute":
        assert int(fixed["1.num_batches_tracked"]) == max(1, round(sum(1 + r % 3 for r in range(world)) / world))


def _check_policy(rank, world, folder):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_net(), broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(lambda loss: (opt.zero_grad(), loss.backward(), opt.step()), model, rank)
    with pytest.raises(zb.BuffersOutOfSyncError) as info:
        zb.sync_buffers(model, "check")
    zb.sync_buffers(model, "average")
    return str(info.value), zb.sync_buffers(model, "check")


@pytest.mark.stack
def test_check_policy_refuses_on_every_rank_until_synced(ranks, tmp_path):
    out = ranks.run(_check_policy, str(tmp_path), timeout=60)
    messages = [m for m, _ in out]
    assert all(m == messages[0] for m in messages) and "1.running_mean" in messages[0]
    assert [n for _, n in out] == [7] * ranks.world_size


# -- Accelerate: save_state on the DDP path and on the DeepSpeed ZeRO-3 path ----------------------------------------
def _accelerate(rank, world, folder, use_deepspeed, policy):
    from tests.helpers import init_deepspeed

    env = dict(os.environ)
    if use_deepspeed:
        init_deepspeed()
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    AcceleratorState._reset_state(True)
    try:
        if use_deepspeed:
            plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=False, zero3_save_16bit_model=True)
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 8
            accelerator = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
        else:
            accelerator = Accelerator(cpu=True,
                                      kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
        net = make_net()
        model, opt = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.05))
        kind = type(model).__name__

        def step(loss):
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()

        train(step, model, rank)
        pre = local_stats(model)
        accelerator.save_state(os.path.join(folder, "default"))
        if use_deepspeed:
            sd = accelerator.get_state_dict(model)
            if rank == 0:
                torch.save(sd, os.path.join(folder, "default_16bit.pt"))

        with zb.sync_buffers_on_save(accelerator, "check"):  # a check hook refuses to write a diverged checkpoint
            with pytest.raises(zb.BuffersOutOfSyncError):
                accelerator.save_state(os.path.join(folder, "refused"))

        data = recompute_data(rank) if policy == "recompute" else None
        hook = zb.sync_buffers_on_save(accelerator, policy, data=data)
        with pytest.raises(zb.InvalidArgumentError, match="already has a save hook"):
            zb.sync_buffers_on_save(accelerator, policy, data=data)
        if use_deepspeed:  # before save_state, so this file shows that get_state_dict itself syncs
            sd = accelerator.get_state_dict(model)
            if rank == 0:
                torch.save(sd, os.path.join(folder, "fixed_16bit.pt"))
        accelerator.save_state(os.path.join(folder, "fixed"))
        hook.remove()
        restored = "save_state" not in vars(accelerator) and "get_state_dict" not in vars(accelerator)
        return kind, pre, local_stats(model), restored
    finally:
        AcceleratorState._reset_state(True)
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()
        os.environ.clear()
        os.environ.update(env)


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


@pytest.mark.stack
@pytest.mark.parametrize("policy", ["average", "recompute"])
def test_accelerate_save_state_ddp_path(ranks, tmp_path, policy):
    world = ranks.world_size
    out = ranks.run(_accelerate, str(tmp_path), False, policy, timeout=120)
    assert all(o[0] == "DistributedDataParallel" and o[3] for o in out)
    pres = [o[1] for o in out]
    default = bn_state(_load_safetensors(tmp_path / "default" / "model.safetensors"))
    fixed_sd = _load_safetensors(tmp_path / "fixed" / "model.safetensors")
    truth = mixture(pres) if policy == "average" else population(fixed_sd, world)
    assert_stats(default, pres[0], tol=0)
    assert differs(default, truth)
    assert_stats(bn_state(fixed_sd), truth)
    assert not (tmp_path / "refused" / "model.safetensors").exists()
    for o in out:
        assert_stats(o[2], bn_state(fixed_sd), tol=0)


def _zero3_rank_files(folder: Path, world: int) -> list[dict[str, torch.Tensor]]:
    """Each ZeRO-3 rank's own model-states file: the buffers it wrote."""
    return [bn_state(torch.load(folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", weights_only=False)["module"])
            for r in range(world)]


def _zero_to_fp32(folder: Path, tag: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)


@pytest.mark.stack
def test_accelerate_save_state_deepspeed_zero3_path(ranks, tmp_path):
    world = ranks.world_size
    out = ranks.run(_accelerate, str(tmp_path), True, "average", timeout=180)
    assert all(o[0] == "DeepSpeedEngine" and o[3] for o in out)
    pres = [o[1] for o in out]
    truth = mixture(pres)

    default_files = _zero3_rank_files(tmp_path / "default" / "pytorch_model", world)
    for r in range(world):  # ZeRO-3 default: every rank wrote its own statistics, rank 0's is what tools read
        assert_stats(default_files[r], pres[r], tol=0)
    default_fp32 = bn_state(_zero_to_fp32(tmp_path / "default", "pytorch_model"))
    assert_stats(default_fp32, pres[0], tol=0)
    assert differs(default_fp32, truth)
    assert differs(bn_state(torch.load(tmp_path / "default_16bit.pt")), truth)

    for files in _zero3_rank_files(tmp_path / "fixed" / "pytorch_model", world):
        assert_stats(files, truth)
    assert_stats(bn_state(_zero_to_fp32(tmp_path / "fixed", "pytorch_model")), truth)
    assert_stats(bn_state(torch.load(tmp_path / "fixed_16bit.pt")), truth)
    assert not (tmp_path / "refused" / "pytorch_model").exists()


# -- DeepSpeed engine: save_checkpoint (+ zero_to_fp32) and save_16bit_model ----------------------------------------
def _engine(rank, world, folder):
    from tests.helpers import ZERO3_CONFIG, init_deepspeed

    deepspeed = init_deepspeed()
    config = {**ZERO3_CONFIG, "train_micro_batch_size_per_gpu": 8,
              "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    model = make_net()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                                      config=config)

    def step(loss):
        engine.backward(loss)
        engine.step()

    train(step, engine, rank)
    pre = local_stats(engine)
    engine.save_checkpoint(os.path.join(folder, "default"), tag="t")
    engine.save_16bit_model(os.path.join(folder, "default16"))
    with zb.sync_buffers_on_save(engine, "recompute", data=recompute_data(rank)):  # uneven batches: lockstep
        engine.save_checkpoint(os.path.join(folder, "fixed"), tag="t")
        engine.save_16bit_model(os.path.join(folder, "fixed16"))
    restored = not any(name in vars(engine) for name in ("save_checkpoint", "save_16bit_model"))
    return pre, local_stats(engine), restored


@pytest.mark.stack
def test_deepspeed_engine_save_checkpoint_zero_to_fp32_and_16bit_model(ranks, tmp_path):
    world = ranks.world_size
    out = ranks.run(_engine, str(tmp_path), timeout=180)
    pres = [o[0] for o in out]
    fp32 = _zero_to_fp32(tmp_path / "fixed", "t")
    truth = population(fp32, world)

    default_files = _zero3_rank_files(tmp_path / "default" / "t", world)
    for r in range(world):  # ZeRO-3 default: every rank wrote its own statistics
        assert_stats(default_files[r], pres[r], tol=0)
    assert differs(default_files[0], default_files[1])
    assert_stats(bn_state(_zero_to_fp32(tmp_path / "default", "t")), pres[0], tol=0)
    assert differs(bn_state(torch.load(tmp_path / "default16" / "pytorch_model.bin")), truth)

    for files in _zero3_rank_files(tmp_path / "fixed" / "t", world):
        assert_stats(files, truth)
    assert_stats(bn_state(fp32), truth)
    assert_stats(bn_state(torch.load(tmp_path / "fixed16" / "pytorch_model.bin")), truth)
    assert all(o[2] for o in out)
    for o in out[1:]:
        assert_stats(o[1], out[0][1], tol=0)


@pytest.mark.stack
def test_sync_buffers_on_save_rejects_other_targets_and_bad_policies():
    with pytest.raises(zb.InvalidArgumentError, match="Accelerator or a DeepSpeed engine"):
        zb.sync_buffers_on_save(make_net(), "average")
    with pytest.raises(zb.InvalidArgumentError, match="needs data"):
        zb.sync_buffers(make_net(), "recompute")
    with pytest.raises(zb.InvalidArgumentError, match="policy must be one of"):
        zb.sync_buffers(make_net(), "mean")


# -- one-shot inputs, and what the hooks cannot cover ------------------------------------------------------------------
def _engine_saves_twice(rank, world, tmp, reusable):
    deepspeed = init_deepspeed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config=ZERO3_CONFIG)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 3, generator=g) + 3 * rank for _ in range(2)]
    data = (lambda: iter(batches)) if reusable else (b for b in batches)
    try:
        hook = zb.sync_buffers_on_save(engine, "recompute", data=data)
    except zb.InvalidArgumentError as e:
        return str(e), None
    means = []
    try:
        for step in range(2):
            with torch.no_grad():
                engine.module[1].running_mean.fill_(float(rank + step))  # training moved them apart again
            engine.save_checkpoint(f"{tmp}/ckpt", tag=f"s{step}")
            means.append(engine.module[1].running_mean.clone())
    finally:
        hook.remove()
    return None, means


@pytest.mark.stack
def test_save_hooks_refuse_one_shot_data_and_recompute_at_every_save_with_a_callable(ranks2, tmp_path):
    refused = ranks2.run(_engine_saves_twice, str(tmp_path / "a"), False, timeout=120)
    assert all(msg is not None and "one-shot iterator" in msg for msg, _ in refused)
    out = ranks2.run(_engine_saves_twice, str(tmp_path / "b"), True, timeout=120)
    for _, means in out:
        assert torch.equal(means[0], means[1])  # both saves recomputed from the same data
        assert torch.equal(means[1], out[0][1][1])  # and every rank holds the same statistics
    assert not torch.equal(out[0][1][1], torch.zeros(3))


def _accelerate_save_model(rank, world, folder):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    env = dict(os.environ)
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
        model = accelerator.prepare(bn_net())
        model(torch.randn(8, 3) + 3 * rank)
        hook = zb.sync_buffers_on_save(accelerator, "average")
        messages = []
        if accelerator.is_main_process:  # the usual pattern: no collective may run here
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                for _ in range(2):  # once per method and process
                    accelerator.save_model(model, folder)
                    accelerator.get_state_dict(model)
            messages = [str(w.message) for w in seen if issubclass(w.category, zb.ZeroBuffersWarning)]
        accelerator.wait_for_everyone()
        hook.remove()
        return messages, accelerator.unwrap_model(model)[1].running_mean.clone()
    finally:
        AcceleratorState._reset_state(True)
        os.environ.clear()
        os.environ.update(env)


def test_accelerate_save_model_and_get_state_dict_on_the_main_process_warn_once_and_do_not_hang(ranks2, tmp_path):
    from safetensors.torch import load_file

    from zero_buffers._core import notice as _notice

    (m0, mean0), (m1, _) = ranks2.run(_accelerate_save_model, str(tmp_path), timeout=120)
    assert len(m0) == 2 and "accelerator.save_model() writes the model's buffers as this rank holds them" in m0[0]
    assert "accelerator.get_state_dict() writes" in m0[1] and m1 == []
    assert "sync_buffers(model, 'average') on every rank first" in m0[0]
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(saved["1.running_mean"], mean0)  # rank 0's statistics, as the warning says
    _notice._SEEN.clear()
