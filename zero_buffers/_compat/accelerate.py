"""Private Accelerate APIs: the list of prepared models an Accelerator keeps (``Accelerator._models``), and the
save methods save hooks wrap."""
from __future__ import annotations

from typing import Any

from . import missing


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
