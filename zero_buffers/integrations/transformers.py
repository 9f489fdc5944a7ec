"""transformers' Trainer: ``BufferSyncCallback`` makes every checkpoint the Trainer writes carry synced buffers.

The Trainer asks its callbacks ``on_step_end`` whether to save, then writes the checkpoint, then calls ``on_save``
(too late: the files are written). This callback syncs in ``on_step_end`` when the step will be saved (every rank
runs it; the Trainer's own flow callback, which decides ``control.should_save``, runs before user callbacks), at
the end of an epoch that will be saved (``save_strategy="epoch"``), at every evaluation when
``save_strategy="best"`` (the Trainer decides after the evaluation, with no callback in between), at the end of
training unless the last step was just synced (so a ``trainer.save_model()`` after ``train()`` carries them), and,
with ``every_step=True``, after every optimizer step. Repeated syncs go through :func:`keep_in_sync`'s arithmetic:
counters and "sum" buffers never compound. On the DeepSpeed ZeRO-3 path each rank writes
its own ``zero_pp_rank_*_model_states.pt`` with its own buffers: after the sync they are equal.
``RouterBiasCallback`` runs :func:`zero_buffers.router_bias` from ``on_train_begin`` to ``on_train_end``, one update
per optimizer step (``on_step_end``).
"""
from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..errors import InvalidArgumentError
from ._router_bias import RouterBiasSteps
from ._sync import SyncCallback


class BufferSyncCallback(SyncCallback, TrainerCallback):
    """Sync the model's buffers by ``policy`` / ``rules`` (as :func:`zero_buffers.sync_buffers`) before each
    checkpoint the Trainer writes and when training ends; with ``every_step=True`` after every optimizer step too.

    Example::

        trainer = Trainer(model, args, train_dataset=ds,
                          callbacks=[BufferSyncCallback(rules={"*.cluster_size": "mean"})])
    """

    def _sync(self, model: Any, step: int) -> None:
        if model is None:
            raise InvalidArgumentError(f"{self.NAME}: the Trainer passed no model to its callbacks")
        self.options.sync(model, step)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.options.begin(model)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.options.every_step or control.should_save:
            self._sync(model, state.global_step)

    def on_epoch_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if control.should_save and self.options.due(state.global_step):  # save_strategy="epoch" decides here
            self._sync(model, state.global_step)

    def on_evaluate(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        # save_strategy="best" decides after the evaluation, with no callback in between: sync at every evaluation
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best" and self.options.due(
                state.global_step):
            self._sync(model, state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.options.due(state.global_step):  # nothing trained since the last sync: no second one
            self._sync(model, state.global_step)


class RouterBiasCallback(RouterBiasSteps, TrainerCallback):
    """Update the model's MoE router biases from the global expert load after every ``every``-th optimizer step, as
    :func:`zero_buffers.router_bias` (same arguments but ``optimizer``): the handle is made at ``on_train_begin``,
    stepped at ``on_step_end`` (once per optimizer step, after gradient accumulation) and removed at
    ``on_train_end``. Every rank runs the Trainer's callbacks, so every rank updates alike.

    Example::

        trainer = Trainer(model, args, train_dataset=ds, callbacks=[RouterBiasCallback(gamma=1e-3)])
    """

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.begin(model)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.after_step(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.end()
