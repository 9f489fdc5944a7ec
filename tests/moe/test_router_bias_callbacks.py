"""RouterBiasCallback in transformers' Trainer and in Lightning (DDP, 2 gloo ranks, gradient accumulation 2): one
update per optimizer step, each from the counts of every micro-batch of every rank, counted once; the biases equal
on every rank (DDP's own buffer broadcast off)."""
from __future__ import annotations

import os

import torch

from tests.moe.test_router_bias import GATES, _model

MAX_STEPS, ACCUM, BATCH, SEQ, TOP_K = 3, 2, 2, 8, 2


class _Tokens(torch.utils.data.Dataset):
    """Sequences whose tokens depend on the index (so each rank's shard prefers its own experts)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(8 * (i % 4), 8 * (i % 4) + 8, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _loads_and_biases(callback, model) -> dict:
    return {"loads": {n.removeprefix("net."): c.clone() for n, c in callback.handle.last_load.items()},
            "bias": {n: model.get_submodule(n).e_score_correction_bias.detach().clone() for n in GATES}}


def _trainer_run(rank, world, folder):
    from accelerate.state import AcceleratorState, PartialState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from zero_buffers.integrations.transformers import RouterBiasCallback

    ours = RouterBiasCallback(gamma=0.01)
    seen: list[dict] = []

    class Recorder(TrainerCallback):  # after ours: what the update used and wrote
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append(_loads_and_biases(ours, model))

    env = dict(os.environ)
    try:
        args = TrainingArguments(output_dir=folder, per_device_train_batch_size=BATCH, max_steps=MAX_STEPS,
                                 gradient_accumulation_steps=ACCUM, use_cpu=True, report_to=[], ddp_backend="gloo",
                                 ddp_broadcast_buffers=False, dataloader_num_workers=0, disable_tqdm=True,
                                 logging_strategy="no", save_strategy="no", seed=0)
        trainer = Trainer(model=_model(), args=args, train_dataset=_Tokens(), callbacks=[ours, Recorder()])
        trainer.train()
        return {"seen": seen, "updates": ours.updates, "hooked": ours.handle is not None}
    finally:
        AcceleratorState._reset_state(True)
        PartialState._reset_state()
        os.environ.clear()
        os.environ.update(env)


def _lightning_run(rank, world, folder):
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    from zero_buffers.integrations.lightning import RouterBiasCallback

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            return self.net(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    ours = RouterBiasCallback(gamma=0.01)
    seen: list[dict] = []

    class Recorder(pl.Callback):
        def __init__(self):
            self.step = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != self.step:  # after ours: an optimizer step just ran
                self.step = trainer.global_step
                seen.append(_loads_and_biases(ours, pl_module.net))

    env = dict(os.environ)
    try:
        trainer = pl.Trainer(accelerator="cpu", devices=world, max_steps=MAX_STEPS, logger=False,
                             accumulate_grad_batches=ACCUM, enable_checkpointing=False,
                             strategy=DDPStrategy(broadcast_buffers=False, process_group_backend="gloo"),
                             callbacks=[ours, Recorder()], enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=folder, num_sanity_val_steps=0)
        trainer.fit(LM(), torch.utils.data.DataLoader(_Tokens(), batch_size=BATCH))
        return {"seen": seen, "updates": ours.updates, "hooked": ours.handle is not None}
    finally:
        os.environ.clear()
        os.environ.update(env)


def _check(out: list[dict], world: int) -> None:
    tokens = world * ACCUM * BATCH * SEQ * TOP_K  # every micro-batch of every rank, each token's top-k choices
    for rank, o in enumerate(out):
        assert o["updates"] == MAX_STEPS and len(o["seen"]) == MAX_STEPS and not o["hooked"], (rank, o["updates"])
        for step, s in enumerate(o["seen"]):
            for n in GATES:
                assert int(s["loads"][n].sum()) == tokens, f"rank {rank} step {step} {n}: {s['loads'][n]}"
                assert torch.equal(s["loads"][n], out[0]["seen"][step]["loads"][n]), (rank, step, n)
                assert torch.equal(s["bias"][n], out[0]["seen"][step]["bias"][n]), f"rank {rank} step {step} {n}"
    assert any(float(b.abs().max()) > 0 for b in out[0]["seen"][-1]["bias"].values())


def test_transformers_trainer_callback_updates_once_per_optimizer_step_from_every_ranks_micro_batches(ranks2,
                                                                                                     tmp_path):
    _check(ranks2.run(_trainer_run, str(tmp_path), timeout=300), 2)


def test_lightning_callback_updates_once_per_optimizer_step_from_every_ranks_micro_batches(ranks2, tmp_path):
    _check(ranks2.run(_lightning_run, str(tmp_path), timeout=300), 2)
