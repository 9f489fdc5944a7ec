"""Trainer integrations with the real libraries on 2 and 4 gloo ranks: every checkpoint the trainer writes carries
synced buffers, reloaded in this (single) process and compared with the merge of what the ranks held right before
the save (recorded by a callback that runs before ours)."""
from __future__ import annotations

import contextlib
import os
import tempfile

import torch
from torch import nn

from tests.helpers import bn_mixture

SAVE_STEPS, MAX_STEPS = 2, 4


class _Images(torch.utils.data.Dataset):
    """Images whose brightness depends on the index, so every rank's shard has its own statistics."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"pixel_values": torch.randn(3, 16, 16, generator=g) * (1 + i % 4) + 2.0 * (i % 4),
                "labels": torch.tensor(i % 3)}


def _stats(model: nn.Module) -> dict:
    return {n: (int(m.num_batches_tracked), m.running_mean.double().clone(), m.running_var.double().clone())
            for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}


def _trainer_run(rank, world, folder, synced, zero3=False):
    from accelerate.state import AcceleratorState, PartialState
    from transformers import ResNetConfig, ResNetForImageClassification, Trainer, TrainerCallback, TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from zero_buffers.integrations.transformers import BufferSyncCallback

    class Recorder(TrainerCallback):
        """What each rank holds right before a save (runs before BufferSyncCallback)."""

        def __init__(self):
            self.before: dict[int, dict] = {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if control.should_save:
                self.before[state.global_step] = _stats(model)

    env = dict(os.environ)
    if zero3:
        from tests.helpers import init_deepspeed
        init_deepspeed()
    try:
        torch.manual_seed(0)
        model = ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                                          depths=[1, 1], layer_type="basic", num_labels=3))
        args = TrainingArguments(output_dir=folder, per_device_train_batch_size=4, max_steps=MAX_STEPS,
                                 save_strategy="steps", save_steps=SAVE_STEPS, use_cpu=True, report_to=[],
                                 ddp_backend="gloo", ddp_broadcast_buffers=False, dataloader_num_workers=0,
                                 disable_tqdm=True, logging_strategy="no", save_only_model=True, seed=0,
                                 **({"deepspeed": {"train_micro_batch_size_per_gpu": 4,
                                                   "zero_optimization": {"stage": 3},
                                                   "zero_allow_untested_optimizer": True}} if zero3 else {}))
        recorder = Recorder()
        callback = BufferSyncCallback() if synced else None
        trainer = Trainer(model=model, args=args, train_dataset=_Images(),
                          callbacks=[recorder] + ([callback] if callback else []))
        trainer.train()
        out = {"kind": type(trainer.model_wrapped).__name__, "world": trainer.args.world_size}
        out["before"] = recorder.before
        out["syncs"] = callback.syncs if callback else 0
        return out
    finally:
        unset_hf_deepspeed_config()
        AcceleratorState._reset_state(True)
        PartialState._reset_state()
        os.environ.clear()
        os.environ.update(env)


def _merged(out: list, step: int, name: str) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The reference for what a save at ``step`` holds: the ranks' statistics before it, merged with weights = the
    batches each rank counted since the previous save (whose total every rank then held), the count the previous
    total plus those. The callbacks' repeated syncs never count a batch twice."""
    base = 0
    for earlier in sorted(s for s in out[0]["before"] if s < step):
        base += sum(o["before"][earlier][name][0] - base for o in out)
    locals_ = [{name: (o["before"][step][name][0] - base, *o["before"][step][name][1:])} for o in out]
    n, mean, var = bn_mixture(locals_, name)
    return base + int(n.sum()), mean, var


def _saved(folder: str, step: int) -> dict:
    from safetensors.torch import load_file
    sd = load_file(os.path.join(folder, f"checkpoint-{step}", "model.safetensors"))
    layers = {k.rsplit(".", 1)[0] for k in sd if k.endswith("running_mean")}
    return {n: (int(sd[f"{n}.num_batches_tracked"]), sd[f"{n}.running_mean"].double(), sd[f"{n}.running_var"].double())
            for n in layers}


def test_transformers_trainer_deepspeed_zero3_checkpoints_carry_the_merged_statistics_on_every_rank(ranks):
    with tempfile.TemporaryDirectory() as folder:
        out = ranks.run(_trainer_run, folder, True, True, timeout=300)
        states = [torch.load(os.path.join(folder, f"checkpoint-{MAX_STEPS}", f"global_step{MAX_STEPS}",
                                          f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"), weights_only=False)
                  for r in range(len(out))]
    assert [o["kind"] for o in out] == ["DeepSpeedEngine"] * len(out)
    for state in states:  # each rank wrote its own buffers: now every file holds the merge
        for name in out[0]["before"][MAX_STEPS]:
            count, mean, var = _merged(out, MAX_STEPS, name)
            assert int(state["module"][f"{name}.num_batches_tracked"]) == count
            torch.testing.assert_close(state["module"][f"{name}.running_mean"].double(), mean.float().double(),
                                       rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(state["module"][f"{name}.running_var"].double(), var.float().double(),
                                       rtol=1e-5, atol=1e-6)


def test_transformers_trainer_ddp_checkpoints_carry_the_merged_statistics(ranks):
    with tempfile.TemporaryDirectory() as bug_dir, tempfile.TemporaryDirectory() as fix_dir:
        bug = ranks.run(_trainer_run, bug_dir, False, timeout=300)
        out = ranks.run(_trainer_run, fix_dir, True, timeout=300)
        saved = {step: _saved(fix_dir, step) for step in (SAVE_STEPS, MAX_STEPS)}
        as_is = _saved(bug_dir, MAX_STEPS)
    assert [(o["kind"], o["world"]) for o in out] == [("DistributedDataParallel", len(out))] * len(out)
    assert all(o["syncs"] == MAX_STEPS // SAVE_STEPS for o in out)  # each save; the last step was one: none at the end
    for step, stats in saved.items():
        for name, (count, mean, var) in stats.items():
            ref_count, ref_mean, ref_var = _merged(out, step, name)
            assert count == ref_count
            torch.testing.assert_close(mean, ref_mean.float().double(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(var, ref_var.float().double(), rtol=1e-5, atol=1e-6)
    # without the callback the checkpoint holds rank 0's statistics
    for name, (_, mean, _) in as_is.items():
        assert torch.equal(mean, bug[0]["before"][MAX_STEPS][name][1].float().double())
        assert not torch.allclose(mean, bn_mixture([o["before"][MAX_STEPS] for o in bug], name)[1], atol=1e-4)


class _Tagged(nn.Module):
    """A BatchNorm net with an EMA buffer (a mean across ranks) and a per-rank cache (left alone)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
        self.register_buffer("ema", torch.zeros(3))
        self.register_buffer("cache", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@contextlib.contextmanager
def _accelerated():
    """A DDP Accelerator on CPU (broadcast_buffers off) and the prepared _Tagged net and optimizer; Accelerate's
    state and the environment are put back afterwards (the pool's workers live on)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    env = dict(os.environ)
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
        torch.manual_seed(0)
        net = _Tagged()
        model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        yield accelerator, net, model, opt
    finally:
        AcceleratorState._reset_state(True)
        os.environ.clear()
        os.environ.update(env)


def _accelerate_rules(rank, world, folder):
    import zero_buffers as zb
    with _accelerated() as (accelerator, net, model, opt):
        accelerator.backward(model(torch.randn(8, 4) * (1 + rank) + rank).sum())
        opt.step()
        with torch.no_grad():
            net.ema.copy_(torch.arange(3.0) + 10 * rank)
            net.cache.fill_(rank)
        before = {"bn": (int(net.net[1].num_batches_tracked), net.net[1].running_mean.double().clone(),
                         net.net[1].running_var.double().clone())}
        with zb.sync_buffers_on_save(accelerator, rules={"ema": "mean", "cache": "local"}):
            accelerator.save_state(folder)
        return before, net.cache.clone()


def test_accelerate_save_state_with_rules_carries_each_buffer_by_its_rule(ranks):
    with tempfile.TemporaryDirectory() as folder:
        out = ranks.run(_accelerate_rules, folder, timeout=180)
        from safetensors.torch import load_file
        saved = load_file(os.path.join(folder, "model.safetensors"))
    world = len(out)
    torch.testing.assert_close(saved["ema"], torch.arange(3.0) + 10 * (world - 1) / 2)  # the mean of the ranks'
    assert torch.equal(saved["cache"], torch.zeros(2))  # "local": rank 0's own, untouched by the sync
    assert all(torch.equal(o[1], torch.full((2,), float(r))) for r, o in enumerate(out))
    n, mean, var = bn_mixture([o[0] for o in out], "bn")
    torch.testing.assert_close(saved["net.1.running_mean"].double(), mean.float().double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(saved["net.1.running_var"].double(), var.float().double(), rtol=1e-5, atol=1e-6)
    assert int(saved["net.1.num_batches_tracked"]) == int(n.sum())


def _lightning_run(rank, world, folder, synced):
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.strategies import DDPStrategy
    from transformers import ResNetConfig, ResNetForImageClassification

    from zero_buffers.integrations.lightning import BufferSyncCallback

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                                                 depths=[1, 1], layer_type="basic", num_labels=3))

        def training_step(self, batch, batch_idx):
            return self.net(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Recorder(pl.Callback):
        """What each rank holds right before a checkpoint is built (runs before BufferSyncCallback)."""

        def __init__(self):
            self.before: dict[int, dict] = {}
            self.kind = ""

        def on_train_start(self, trainer, pl_module):
            self.kind = type(trainer.strategy.model).__name__  # what trains: DDP around the module

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            self.before[trainer.global_step] = _stats(pl_module)

    env = dict(os.environ)
    try:
        recorder, ours = Recorder(), BufferSyncCallback()
        saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=SAVE_STEPS, save_top_k=-1, filename="{step}")
        trainer = pl.Trainer(accelerator="cpu", devices=world, max_steps=MAX_STEPS, logger=False,
                             strategy=DDPStrategy(broadcast_buffers=False, process_group_backend="gloo"),
                             callbacks=[recorder, *([ours] if synced else []), saver], enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=folder, num_sanity_val_steps=0)
        trainer.fit(Classifier(), torch.utils.data.DataLoader(_Images(), batch_size=4))
        return {"before": recorder.before, "syncs": ours.syncs, "kind": recorder.kind}
    finally:
        os.environ.clear()
        os.environ.update(env)


def test_lightning_ddp_checkpoints_carry_the_merged_statistics(ranks):
    with tempfile.TemporaryDirectory() as bug_dir, tempfile.TemporaryDirectory() as fix_dir:
        bug = ranks.run(_lightning_run, bug_dir, False, timeout=300)
        out = ranks.run(_lightning_run, fix_dir, True, timeout=300)
        saved = {s: torch.load(os.path.join(fix_dir, f"step={s}.ckpt"), weights_only=False)["state_dict"]
                 for s in (SAVE_STEPS, MAX_STEPS)}
        as_is = torch.load(os.path.join(bug_dir, f"step={MAX_STEPS}.ckpt"), weights_only=False)["state_dict"]
    assert [o["kind"] for o in out] == ["DistributedDataParallel"] * len(out)
    assert all(o["syncs"] == MAX_STEPS // SAVE_STEPS for o in out)  # each checkpoint; none more at the end
    for step, state in saved.items():
        for name in out[0]["before"][step]:
            count, mean, var = _merged(out, step, name)
            assert int(state[f"{name}.num_batches_tracked"]) == count
            torch.testing.assert_close(state[f"{name}.running_mean"].double(), mean.float().double(), rtol=1e-5,
                                       atol=1e-6)
            torch.testing.assert_close(state[f"{name}.running_var"].double(), var.float().double(), rtol=1e-5,
                                       atol=1e-6)
    for name, stats in bug[0]["before"][MAX_STEPS].items():  # without it: rank 0's statistics
        assert torch.equal(as_is[f"{name}.running_mean"].double(), stats[1].float().double())


def _accelerate_two_saves(rank, world, folder):
    import zero_buffers as zb
    with _accelerated() as (accelerator, net, model, opt):
        before = []
        with zb.sync_buffers_on_save(accelerator, "average"):
            for save in range(2):
                accelerator.backward(model(torch.randn(8, 4) * (1 + rank) + rank + save).sum())
                opt.step()
                before.append({"bn": (int(net.net[1].num_batches_tracked), net.net[1].running_mean.double().clone(),
                                      net.net[1].running_var.double().clone())})
                accelerator.save_state(os.path.join(folder, f"save{save}"))
            accelerator.save_state(os.path.join(folder, "again"))  # no training since: nothing changes
        return before


def test_repeated_save_state_with_the_hook_counts_each_batch_once(ranks):
    with tempfile.TemporaryDirectory() as folder:
        out = ranks.run(_accelerate_two_saves, folder, timeout=180)
        from safetensors.torch import load_file
        saved = [load_file(os.path.join(folder, d, "model.safetensors")) for d in ("save0", "save1", "again")]
    world = len(out)
    first = [o[0] for o in out]
    n, mean, _ = bn_mixture(first, "bn")
    assert int(saved[0]["net.1.num_batches_tracked"]) == int(n.sum()) == world  # one batch per rank
    torch.testing.assert_close(saved[0]["net.1.running_mean"].double(), mean.float().double(), rtol=1e-5, atol=1e-6)
    # the second save: one more batch per rank, weighted as such; the count is a count of batches, not world**2
    deltas = [{"bn": (o[1]["bn"][0] - world, *o[1]["bn"][1:])} for o in out]
    _, mean2, var2 = bn_mixture(deltas, "bn")
    assert int(saved[1]["net.1.num_batches_tracked"]) == 2 * world
    torch.testing.assert_close(saved[1]["net.1.running_mean"].double(), mean2.float().double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(saved[1]["net.1.running_var"].double(), var2.float().double(), rtol=1e-5, atol=1e-6)
    assert all(torch.equal(saved[2][k], saved[1][k]) for k in saved[1])
