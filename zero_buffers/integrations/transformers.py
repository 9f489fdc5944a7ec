"""transformers' Trainer: ``BufferSyncCallback`` makes every checkpoint the Trainer writes carry synced buffers.

The Trainer asks its callbacks ``on_step_end`` whether to save, then writes the checkpoint, then calls ``on_save``
(too late: the files are written). This callback syncs in ``on_step_end`` when the step will be saved (every rank
runs it; the Trainer's own flow callback, which decides ``control.should_save``, runs before user callbacks), at
the end of training unless the last step was just synced (so a ``trainer.save_model()`` after ``train()`` carries
them), and, with ``every_step=True``, after every optimizer step. On the DeepSpeed ZeRO-3 path each rank writes
its own ``zero_pp_rank_*_model_states.pt`` with its own buffers: after the sync they are equal.
"""
from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from .. import _args
from ..checkpoint import _check_policy, sync_buffers
from ..errors import InvalidArgumentError
from ..rules import Rules

_FN = "BufferSyncCallback"


class BufferSyncCallback(TrainerCallback):
    """Sync the model's buffers by ``policy`` / ``rules`` (as :func:`zero_buffers.sync_buffers`) before each
    checkpoint the Trainer writes and when training ends; with ``every_step=True`` after every optimizer step too.

    Example::

        trainer = Trainer(model, args, train_dataset=ds,
                          callbacks=[BufferSyncCallback(rules={"*.cluster_size": "mean"})])
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
        self._synced_at: int | None = None  # the global step of the last sync

    def _sync(self, model: Any, step: int) -> None:
        if model is None:
            raise InvalidArgumentError(f"{_FN}: the Trainer passed no model to its callbacks")
        sync_buffers(model, self.policy, rules=self.rules, strict=self.strict, src=self.src,  # type: ignore[arg-type]
                     timeout=self.timeout)
        self.syncs += 1
        self._synced_at = step

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.every_step or control.should_save:
            self._sync(model, state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._synced_at != state.global_step:  # nothing trained since the last sync: every rank decides alike
            self._sync(model, state.global_step)
