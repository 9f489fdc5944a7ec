"""Private Accelerate APIs: the list of prepared models an Accelerator keeps (``Accelerator._models``), and the
save methods save hooks wrap."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import missing, replace_global, signature_starts


def is_accelerator(obj: Any) -> bool:
    """True for an ``accelerate.Accelerator`` (checked by class, so Accelerate need not be imported)."""
    return any(c.__name__ == "Accelerator" and c.__module__.startswith("accelerate") for c in type(obj).__mro__)


def prepared_models(accelerator: Any) -> list[Any]:
    """The models ``accelerator.prepare`` returned, in order."""
    models = getattr(accelerator, "_models", None)
    if not isinstance(models, list):
        raise missing("accelerate", "Accelerator._models (the list of prepared models)")
    return models


SAVE_METHODS = ("save_state", "get_state_dict", "save_model")
"""Accelerator methods that write a checkpoint or build the state dict one is written from."""


def save_methods(accelerator: Any) -> tuple[str, ...]:
    """:data:`SAVE_METHODS`, once ``accelerator`` is checked to have each (DependencyError: the first it lacks)."""
    for name in SAVE_METHODS:
        if not callable(getattr(accelerator, name, None)):
            raise missing("accelerate", f"Accelerator.{name} (a method save hooks wrap)")
    return SAVE_METHODS


def _fsdp_utils() -> Any:
    """``accelerate.utils.fsdp_utils``, ``accelerate.accelerator`` and ``accelerate.utils`` (which re-exports the
    first's functions), or None when Accelerate is not installed."""
    try:
        import accelerate.utils as utils
        from accelerate import accelerator
        from accelerate.utils import fsdp_utils
    except ImportError:
        return None
    return fsdp_utils, accelerator, utils


def patch_fsdp2_loading(make_load: Callable[[Any], Any],
                        make_prepare: Callable[[Any], Any]) -> Callable[[], None] | None:
    """Replace Accelerate's FSDP2 full-state-dict load, ``utils.fsdp_utils.fsdp2_load_full_state_dict(accelerator,
    model, full_sd, ...)`` (what ``fsdp2_prepare_model`` calls, by its module global, under
    ``cpu_ram_efficient_loading``), by ``make_load(original)``, and the ``fsdp2_prepare_model(accelerator, model)``
    that ``Accelerator.prepare`` calls (bound by name in ``accelerate.accelerator``) by ``make_prepare(original)``;
    the same in ``accelerate.utils``, where both are re-exported (``from accelerate.utils import
    fsdp2_load_full_state_dict`` in user code is followed too, as long as it is imported after ``install()``).
    Returns the undo; None for an Accelerate without FSDP2 (1.1.0 has neither function: there is no FSDP2 load to
    follow) or not installed. A version with one and not the other, or other signatures, is a DependencyError."""
    found = _fsdp_utils()
    if found is None:
        return None
    fsdp_utils, accelerator, utils = found
    load, prepare = vars(fsdp_utils).get("fsdp2_load_full_state_dict"), vars(fsdp_utils).get("fsdp2_prepare_model")
    if load is None and prepare is None and "fsdp2_prepare_model" not in vars(accelerator):
        return None
    if not signature_starts(load, ("accelerator", "model", "full_sd")):
        raise missing("accelerate", "utils.fsdp_utils.fsdp2_load_full_state_dict(accelerator, model, full_sd)")
    bound = vars(accelerator).get("fsdp2_prepare_model")
    if not signature_starts(prepare, ("accelerator", "model")) or bound is not prepare:
        raise missing("accelerate", "accelerator.fsdp2_prepare_model(accelerator, model) from utils.fsdp_utils")
    undos = [replace_global(fsdp_utils, "fsdp2_load_full_state_dict", make_load),
             replace_global(accelerator, "fsdp2_prepare_model", make_prepare)]
    for name, original, make in (("fsdp2_load_full_state_dict", load, make_load),
                                 ("fsdp2_prepare_model", prepare, make_prepare)):
        if vars(utils).get(name) is original:  # the package's re-export of the same function
            undos.append(replace_global(utils, name, make))

    def undo() -> None:
        for u in reversed(undos):
            u()
    return undo


def is_main_process(accelerator: Any) -> bool:
    """``accelerator.is_main_process``: global rank 0, the rank Accelerate's FSDP2 load broadcasts from."""
    main = getattr(accelerator, "is_main_process", None)
    if not isinstance(main, bool):
        raise missing("accelerate", "Accelerator.is_main_process")
    return main
