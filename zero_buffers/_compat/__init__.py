"""Every private API of torch, DeepSpeed, transformers and Accelerate that zero_buffers touches, one file per library.

Each module checks, at import or first use, that the installed version has what we rely on and raises
:class:`~zero_buffers.errors.DependencyError` (naming the package, its version and the missing piece)
when it does not. Nothing here degrades to "warn and carry on".
"""
from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

from ..errors import DependencyError


def version(package: str) -> str | None:
    """The installed distribution version of ``package``, or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing(package: str, what: str, hint: str = "") -> DependencyError:
    """The error for an installed ``package`` that lacks ``what`` (or is not installed)."""
    found = version(package)
    where = f"{package} {found}" if found else f"{package} (not installed)"
    return DependencyError(f"zero_buffers needs {what} from {where}{': ' + hint if hint else ''}", package, found)


def replace(owner: type, name: str, make: Callable[[Any], Any]) -> Callable[[], None]:
    """Set ``owner.name = make(original)`` (the attribute as stored in the class dict); returns the undo, which
    puts the identical original object back. A class that does not define ``name`` itself (a version where it is
    inherited, or gone) is a DependencyError naming the package that defines ``owner``."""
    if name not in vars(owner):
        package = owner.__module__.split(".", 1)[0]
        where = owner.__module__.removeprefix(package + ".")
        raise missing(package, f"{where}.{owner.__qualname__}.{name} (defined on that class itself)")
    original = vars(owner)[name]
    setattr(owner, name, make(original))

    def undo() -> None:
        setattr(owner, name, original)
    return undo


def replace_global(module: Any, name: str, make: Callable[[Any], Any]) -> Callable[[], None]:
    """Set the module-level ``module.name = make(original)``; returns the undo, which puts the identical original
    back. A module without ``name`` (a version where it moved or is gone) is a DependencyError naming the package."""
    if name not in vars(module):
        raise missing(module.__name__.split(".", 1)[0], f"{module.__name__}.{name}")
    original = vars(module)[name]
    setattr(module, name, make(original))

    def undo() -> None:
        setattr(module, name, original)
    return undo


def signature_starts(func: Any, names: tuple[str, ...]) -> bool:
    """Whether ``func`` is a callable whose first parameters are named ``names``."""
    try:
        return tuple(inspect.signature(func).parameters)[:len(names)] == names
    except (TypeError, ValueError):
        return False
