"""no_zero_init: build modules as full, plain replicas even while ZeRO-3 partitioning is active."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .._compat import deepspeed as ds_compat, transformers as hf_compat

_depth = 0  # only the outermost no_zero_init escapes and restores


@contextmanager
def no_zero_init() -> Iterator[None]:
    """Modules built inside are full, plain (unpartitioned) replicas, whatever ZeRO-3 machinery is active.

    Escapes (a) an active ``deepspeed.zero.Init`` context (with DeepSpeed's own shutdown/restore of the
    top-level context, as ``deepspeed.initialize`` does), (b) transformers' global ``HfDeepSpeedConfig``
    (so ``from_pretrained`` / ``from_config`` do not partition and every rank loads the weights itself),
    and so (c) an ``Accelerator`` whose ZeRO-3 ``DeepSpeedPlugin`` set that flag. Everything is restored
    on exit, also on exception; nesting works (only the outermost context escapes and restores).

    Modules built here from random initialisation differ per rank. Align them with one call:
    ``zero_buffers.broadcast_buffers(module, include_parameters=True)`` (or use :func:`frozen_replica`
    for frozen inference-only modules).

    Example::

        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = Trainable()                      # partitioned
            with zero_buffers.no_zero_init():
                tokenizer = VideoTokenizer.from_pretrained(path)   # full replica, loaded on every rank
    """
    global _depth
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    flag = hf_compat.suspend_zero3_flag()
    try:
        ctx = ds_compat.suspend_init_context()
    except BaseException:
        hf_compat.restore_zero3_flag(flag)
        raise
    stale: list = []
    _depth += 1
    try:
        stale = ds_compat.suspend_stale_init_patches()  # DeepSpeed < 0.15 leaves some behind (see there)
        yield
    finally:
        _depth -= 1
        ds_compat.restore_stale_init_patches(stale)
        ds_compat.resume_init_context(ctx)
        hf_compat.restore_zero3_flag(flag)
