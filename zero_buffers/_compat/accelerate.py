"""Private Accelerate APIs: the list of prepared models an Accelerator keeps (``Accelerator._models``)."""
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
