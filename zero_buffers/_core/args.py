"""Argument checks every public function runs at the call, before any collective (one validator per kind)."""
from __future__ import annotations

import datetime
import math
import operator
import os
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..errors import InvalidArgumentError, InvalidSourceRankError

Timeout = float | datetime.timedelta | None
"""Seconds (> 0) or a timedelta for the whole call; ``float("inf")`` for no bound; None (the default) for at most
:data:`DEFAULT_WAIT_S` seconds in each collective (``$ZERO_BUFFERS_TIMEOUT`` overrides it)."""

DEFAULT_WAIT_S = 300.0

# c10d adds a wait's timeout to a nanosecond steady clock, which overflows (and then "times out" at
# once) from about 1e10 s; timeouts of this many seconds (11.6 days) or more mean no bound.
MAX_WAIT_S = 1e6


def module(value: Any, fn: str) -> nn.Module:
    """``value`` if it is an nn.Module, else InvalidArgumentError with a hint for the usual mistakes."""
    if isinstance(value, nn.Module):
        return value
    if isinstance(value, torch.Tensor):
        hint = " (pass the module that owns it, not a parameter or tensor)"
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        hint = " (pass the module itself, not module.parameters()/buffers() or a list; wrap several in nn.ModuleList)"
    else:
        hint = ""
    raise InvalidArgumentError(f"{fn}() expects a torch.nn.Module, got {type(value).__name__}{hint}")


def ignore(value: Any, fn: str) -> tuple[str, ...]:
    """``value`` as a tuple of buffer names or module paths (a bare str is refused, not split into letters)."""
    if isinstance(value, (str, bytes)):
        raise InvalidArgumentError(
            f"{fn}(): ignore must be a collection of buffer names or module paths, got the bare string {value!r}; "
            f"write ignore=({value!r},)")
    if not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{fn}(): ignore must be a collection of str, got {type(value).__name__}")
    names = tuple(value)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise InvalidArgumentError(f"{fn}(): ignore must hold str names, got {type(bad[0]).__name__} {bad[0]!r}")
    return names


def timeout(value: Any, fn: str) -> float | None:
    """``value`` in seconds (``math.inf`` for no bound: inf and >= MAX_WAIT_S; None stays None, the default
    bound per collective), else InvalidArgumentError."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise InvalidArgumentError(
            f"{fn}(): timeout must be seconds (a number > 0), a datetime.timedelta or None, got "
            f"{type(value).__name__} {value!r:.40}")
    if math.isnan(seconds) or seconds <= 0:
        raise InvalidArgumentError(f"{fn}(): timeout must be > 0 seconds (float('inf') waits forever), got {value!r}")
    return math.inf if seconds >= MAX_WAIT_S else seconds


def default_wait() -> float:
    """Seconds each collective waits under the default ``timeout=None``: ``$ZERO_BUFFERS_TIMEOUT`` (a number, or
    ``inf``) or :data:`DEFAULT_WAIT_S`."""
    text = os.environ.get("ZERO_BUFFERS_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_WAIT_S
    try:
        seconds = float(text)
    except ValueError:
        raise InvalidArgumentError(f"ZERO_BUFFERS_TIMEOUT must be seconds (a number > 0) or inf, got {text!r}") \
            from None
    if not seconds > 0:
        raise InvalidArgumentError(f"ZERO_BUFFERS_TIMEOUT must be > 0, got {text!r}")
    return math.inf if seconds >= MAX_WAIT_S else seconds


def atol(value: Any, fn: str) -> float:
    """``value`` as a float >= 0, else InvalidArgumentError."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise InvalidArgumentError(f"{fn}(): atol must be a number >= 0, got {value!r}")
    return float(value)


def rank(value: Any, name: str, fn: str) -> int:
    """Every rank argument (``src``, ``modifier_rank``): an int >= 0 (NumPy ints and 0-dim integer tensors too),
    else InvalidSourceRankError. Whether it is in the group is checked later, with the group (``group.check_src``;
    [Note: rank convention] in group.py)."""
    try:
        r = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        r = None
    if r is None or r < 0:
        raise InvalidSourceRankError(f"{fn}(): {name} must be a non-negative int rank, got {value!r:.40}")
    return r


def optional_rank(value: Any, name: str, fn: str) -> int | None:
    """:func:`rank`, or None (``modifier_rank=None``)."""
    if value is None:
        return None
    try:
        return rank(value, name, fn)
    except InvalidSourceRankError:
        raise InvalidSourceRankError(f"{fn}(): {name} must be a non-negative int rank or None, got "
                                     f"{value!r:.40}") from None


def flag(value: Any, name: str, fn: str) -> bool:
    """``value`` when it is a bool, else InvalidArgumentError."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{fn}(): {name} must be True or False, got {value!r}")
    return value


def every(value: Any, fn: str) -> int:
    """A period in steps (``every=``): an int >= 1, else InvalidArgumentError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{fn}(): every must be an int >= 1, got {value!r}")
    return value


def progress(value: Any, fn: str) -> bool:
    """Whether to draw a progress bar: ``value`` when a bool; None (every function's default) draws one only when
    stderr is a terminal, so logs get no carriage returns."""
    if value is None:
        stream = sys.stderr
        return bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{fn}(): progress must be True, False or None (a terminal), got {value!r}")
    return value
