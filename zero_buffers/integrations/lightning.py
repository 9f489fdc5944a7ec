"""PyTorch Lightning: ``BufferSyncCallback`` makes every checkpoint the Trainer writes carry synced buffers.

Lightning builds a checkpoint on every rank (``Trainer.save_checkpoint`` -> ``dump_checkpoint``, whatever calls it:
``ModelCheckpoint``, the user) and hands it to every callback's ``on_save_checkpoint`` before the strategy writes it
(rank 0). This callback syncs there, on every rank, and puts the synced buffers into the checkpoint's
``state_dict``; also at the end of training and, with ``every_step=True``, after every training batch. Lightning's
own ``sync_batchnorm`` converts layers to SyncBatchNorm (DDP only; its DeepSpeed strategy ignores it).
``RouterBiasCallback`` runs :func:`zero_buffers.router_bias` from ``on_train_start`` to ``on_train_end``, one update
per optimizer step (the first ``on_train_batch_end`` of each new ``global_step``).
"""
from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

from .._core import modules as _modules
from ._router_bias import RouterBiasSteps
from ._sync import SyncCallback


class BufferSyncCallback(SyncCallback, pl.Callback):
    """Sync the LightningModule's buffers by ``policy`` / ``rules`` (as :func:`zero_buffers.sync_buffers`) in every
    checkpoint Lightning writes and when training ends; with ``every_step=True`` after every training batch too.

    Example::

        trainer = pl.Trainer(strategy="ddp", callbacks=[BufferSyncCallback(rules={"*.cluster_size": "mean"})])
    """

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.options.begin(pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.options.every_step:
            self.options.sync(pl_module, trainer.global_step)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.options.due(trainer.global_step):  # a second checkpoint of the same step needs no second sync
            self.options.sync(pl_module, trainer.global_step)
        state = checkpoint.get("state_dict")
        if isinstance(state, dict):  # the dict was built before this hook: put the synced values in
            for name, buf in _modules.named_buffers(pl_module):
                if name in state:
                    state[name] = buf.detach().clone()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.options.due(trainer.global_step):
            self.options.sync(pl_module, trainer.global_step)


class RouterBiasCallback(RouterBiasSteps, pl.Callback):
    """Update the LightningModule's MoE router biases from the global expert load after every ``every``-th
    optimizer step, as :func:`zero_buffers.router_bias` (same arguments but ``optimizer``): made at
    ``on_train_start``, stepped at the first ``on_train_batch_end`` of each new ``trainer.global_step`` (Lightning
    counts optimizer steps there, so gradient accumulation updates once per step), removed at ``on_train_end``.

    Example::

        trainer = pl.Trainer(strategy="ddp", callbacks=[RouterBiasCallback(gamma=1e-3)])
    """

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.begin(pl_module)
        self.stepped_at = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after_step(trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.end()
