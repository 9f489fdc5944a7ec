"""MoE buffers: the aux-loss-free router bias, updated from the expert load of the global batch.

- ``router_bias``: ``router_bias`` / ``RouterBias``, tokens per expert counted once per micro-batch in train-mode
  forwards ([Note: counted once]), summed over the data-parallel group in one transaction, the bias updated after
  optimizer steps identically on every rank, in fp32.
- ``gates``: which modules are gates and how each is read (the default for transformers' ``e_score_correction_bias``
  families, ``register_gate`` for any other router class).

Built on ``zero_buffers._core`` and ``zero_buffers.training.rules`` (the ``"sum"`` rule's transaction). The trainer
callbacks (``zero_buffers.integrations``: ``RouterBiasCallback``) drive it from transformers' Trainer and Lightning.
"""
