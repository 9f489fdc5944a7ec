"""no_zero_init: build modules as full, plain replicas even while ZeRO-3 partitioning is active."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_depth = 0  # only the outermost no_zero_init escapes and restores


def _escape() -> dict[str, Any]:
    """Suspend DeepSpeed's active zero.Init patches and transformers' ZeRO-3 flag; return what to restore."""
    state: dict[str, Any] = {}
    hf = sys.modules.get("transformers.integrations.deepspeed")
    if hf is not None and getattr(hf, "_hf_deepspeed_config_weak_ref", None) is not None:
        state["hf"] = (hf, hf._hf_deepspeed_config_weak_ref, hf._hf_deepspeed_config_weak_ref())  # keep it alive
        hf.unset_hf_deepspeed_config()
    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if pp is not None and pp.top_level_context is not None and getattr(pp.top_level_context, "patched", False):
        pp.shutdown_init_context()  # what deepspeed.initialize does; Init(enabled=False) would not escape
        state["ds"] = (pp, pp.top_level_context)
    return state


def _restore(state: dict[str, Any]) -> None:
    """Undo _escape: re-patch the same zero.Init context and put transformers' weakref back."""
    if "ds" in state:
        pp, ctx = state["ds"]
        if pp.top_level_context is ctx:
            pp.restore_init_context()
    if "hf" in state:
        hf, ref, _ = state["hf"]
        hf._hf_deepspeed_config_weak_ref = ref


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
    state = _escape() if _depth == 0 else {}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        _restore(state)
