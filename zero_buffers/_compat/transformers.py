"""Private transformers APIs: the global ZeRO-3 flag (a weakref to an HfDeepSpeedConfig) that makes
``from_pretrained`` / ``from_config`` build under ``deepspeed.zero.Init``."""
from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

from . import missing, replace

_WEAKREF = "_hf_deepspeed_config_weak_ref"


def _deepspeed_integration() -> Any:
    """``transformers.integrations.deepspeed`` if transformers was imported already, else None."""
    return sys.modules.get("transformers.integrations.deepspeed")


def suspend_zero3_flag() -> tuple | None:
    """Unset transformers' global ZeRO-3 config if set; returns what :func:`restore_zero3_flag` needs."""
    hf = _deepspeed_integration()
    if hf is None:
        return None
    if not hasattr(hf, _WEAKREF) or not hasattr(hf, "unset_hf_deepspeed_config"):
        raise missing("transformers", f"integrations.deepspeed.{_WEAKREF} / unset_hf_deepspeed_config")
    ref = getattr(hf, _WEAKREF)
    if ref is None:
        return None
    state = (hf, ref, ref())  # the strong reference keeps the config alive while it is unset
    hf.unset_hf_deepspeed_config()
    return state


def restore_zero3_flag(state: tuple | None) -> None:
    """Undo :func:`suspend_zero3_flag`."""
    if state is not None:
        hf, ref, _ = state
        setattr(hf, _WEAKREF, ref)


def zero3_enabled() -> bool:
    """transformers' own ``is_deepspeed_zero3_enabled()`` (False when transformers was not imported)."""
    hf = _deepspeed_integration()
    if hf is None:
        return False
    check = getattr(hf, "is_deepspeed_zero3_enabled", None)
    if not callable(check):
        raise missing("transformers", "integrations.deepspeed.is_deepspeed_zero3_enabled")
    return bool(check())


def wrap_from_pretrained(after: Callable[[Any], None], loading: list[int],
                         failed: Callable[[BaseException], None]) -> Callable[[], None] | None:
    """Make ``PreTrainedModel.from_pretrained`` call ``after(model)`` before returning, and ``failed(error)`` before
    its error propagates (``loading[0]`` counts the calls in progress); returns the undo, or None when transformers
    cannot be imported."""
    try:
        from transformers import modeling_utils
    except ImportError:
        return None
    cls = modeling_utils.PreTrainedModel
    if not isinstance(vars(cls).get("from_pretrained"), classmethod):
        raise missing("transformers", "PreTrainedModel.from_pretrained as a classmethod")

    def make(original: classmethod) -> classmethod:
        func = original.__func__

        @functools.wraps(func)
        def from_pretrained(klass: Any, *args: Any, **kwargs: Any) -> Any:
            loading[0] += 1
            try:
                result = func(klass, *args, **kwargs)
            except BaseException as e:
                loading[0] -= 1
                failed(e)
                raise
            loading[0] -= 1
            after(result[0] if isinstance(result, tuple) else result)  # output_loading_info=True gives a tuple
            return result
        return classmethod(from_pretrained)

    return replace(cls, "from_pretrained", make)


def fsdp_rank0_loading() -> bool:
    """transformers' own ``is_fsdp_enabled()``: under Accelerate's FSDP with ``cpu_ram_efficient_loading``
    (``ACCELERATE_USE_FSDP`` and ``FSDP_CPU_RAM_EFFICIENT_LOADING`` set, a process group up), where 4.x loads the
    checkpoint on local rank 0 only (``integrations.fsdp``; 5.x: ``distributed.fsdp``). False when transformers was
    not imported."""
    if "transformers" not in sys.modules:
        return False
    for name in ("transformers.distributed.fsdp", "transformers.integrations.fsdp"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        check = getattr(module, "is_fsdp_enabled", None)
        if callable(check):
            return bool(check())
    raise missing("transformers", "is_fsdp_enabled in distributed.fsdp (5.x) or integrations.fsdp (4.x)")
