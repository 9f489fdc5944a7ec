"""Every private API of torch, DeepSpeed, transformers and Accelerate that zero_buffers touches, one file per library.

Each module checks, at import or first use, that the installed version has what we rely on and raises
:class:`~zero_buffers.errors.DependencyError` (naming the package, its version and the missing piece)
when it does not. Nothing here degrades to "warn and carry on".
"""
from __future__ import annotations

import importlib.metadata
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
