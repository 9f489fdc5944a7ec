"""PyTorch Lightning: ``BufferSyncCallback`` makes every checkpoint the Trainer writes carry synced buffers.

Lightning builds a checkpoint on every rank (``Trainer.save_checkpoint`` -> ``dump_checkpoint``, whatever calls it:
``ModelCheckpoint``, the user) and hands it to every callback's ``on_save_checkpoint`` before the strategy writes it
(rank 0). This callback syncs there, on every rank, and puts the synced buffers into the checkpoint's
``state_dict``; also at the end of training and, with ``every_step=True``, after every training batch. Lightning's
own ``sync_batchnorm`` converts layers to SyncBatchNorm (DDP only; its DeepSpeed strategy ignores it).
"""
from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

from .. import _args, _modules
from ..checkpoint import _check_policy, sync_buffers
from ..errors import InvalidArgumentError
from ..rules import Rules

_FN = "BufferSyncCallback"


class BufferSyncCallback(pl.Callback):
    """Sync the LightningModule's buffers by ``policy`` / ``rules`` (as :func:`zero_buffers.sync_buffers`) in every
    checkpoint Lightning writes and when training ends; with ``every_step=True`` after every training batch too.

    Example::

        trainer = pl.Trainer(strategy="ddp", callbacks=[BufferSyncCallback(rules={"*.cluster_size": "mean"})])
    """

    def __init__(self, policy: str | None = "average", *, rules: Rules | None = None, strict: bool = False,
                 every_step: bool = False, src: int = 0, timeout: _args.Timeout = None):
        _check_policy(policy, None, _FN, rules=rules)
        if policy == "recompute":
            raise InvalidArgumentError(f"{_FN}(): policy 'recompute' needs each rank's data; call "
                                       "zero_buffers.sync_buffers(model, 'recompute', data=...) yourself")
        self.policy, self.rules, self.strict = policy, rules, _args.flag(strict, "strict", _FN)
        self.every_step = _args.flag(every_step, "every_step", _FN)
        self.src = _args.rank(src, "src", _FN)
        self.timeout = timeout
        _args.timeout(timeout, _FN)
        self.syncs = 0
        self._synced_at: int | None = None

    def _sync(self, trainer: Any, module: Any) -> None:
        sync_buffers(module, self.policy, rules=self.rules, strict=self.strict, src=self.src,  # type: ignore[arg-type]
                     timeout=self.timeout)
        self.syncs += 1
        self._synced_at = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.every_step:
            self._sync(trainer, pl_module)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self._synced_at != trainer.global_step:  # a second checkpoint of the same step needs no second sync
            self._sync(trainer, pl_module)
        state = checkpoint.get("state_dict")
        if isinstance(state, dict):  # the dict was built before this hook: put the synced values in
            for name, buf in _modules.named_buffers(pl_module):
                if name in state:
                    state[name] = buf.detach().clone()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._synced_at != trainer.global_step:
            self._sync(trainer, pl_module)
