"""Training-time tools: the buffers a training job keeps, checkpoints and syncs as it goes.

- ``rules``: declared reductions (``"broadcast"``, ``"mean"``, ``"sum"``, ``"max"``, ``"min"``, ``"bn"``,
  ``"local"``) by name glob, module class or ``register_rules``, applied in one transaction.
- ``keep_in_sync``: ``keep_in_sync`` / ``KeepInSync``, the per-step or per-forward sync with its lean steady state
  ([Note: steady state]).
- ``save_hooks``: ``sync_buffers`` (one sync by policy or rules, before a plain ``torch.save``) and
  ``sync_buffers_on_save`` / ``SaveHook`` (Accelerate's and DeepSpeed's save methods wrapped, so every checkpoint
  carries synced buffers).

Built on ``zero_buffers._core``, ``zero_buffers.bn`` and ``zero_buffers.report``. The trainer callbacks
(``zero_buffers.integrations``) sync through these.
"""
