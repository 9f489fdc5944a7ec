"""FSDP2-era loads: buffers right where torch, DCP and Accelerate load a ``fully_shard`` model.

- ``loads``: what ``install()`` wraps besides DeepSpeed: ``set_model_state_dict`` / ``set_state_dict`` with
  ``broadcast_from_rank0``, ``dcp.load`` of a state dict ``get_model_state_dict`` / ``get_state_dict`` built, and
  Accelerate's FSDP2 full-state-dict load; after each, one sync from rank 0 ([Note: loads install() follows]).

Built on ``zero_buffers.broadcast``; torch and Accelerate only through ``zero_buffers._compat``.
"""
