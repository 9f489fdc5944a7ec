"""The dtype each buffer must keep, as data: :class:`Declared`, one per buffer, and where it comes from.

[Note: declared precision]
A buffer is *declared* to need a dtype when one of these says so, the first that applies winning:

1. an explicit declaration on its module (:func:`declare`, what ``keep_precision`` records);
2. transformers' ``_keep_in_fp32_modules_strict`` of the model (fp32 whenever the model would be cast to
   float16 or bfloat16: DeepSeek-V3's ``e_score_correction_bias``, ...), matched as transformers does, a dotted
   component sequence of the buffer's qualified name;
3. transformers' ``_keep_in_fp32_modules`` (fp32 when the model would be cast to float16 only: bfloat16 is fine);
4. the statistics of a BatchNorm layer (``running_mean`` / ``running_var``: fp32, under either 16-bit dtype: an EMA
   update in 16 bits drops every increment below half a step of the value, so the statistics stagnate);
5. a rotary table (``inv_freq`` / ``original_inv_freq`` of a module whose class name ends in ``RotaryEmbedding``:
   fp32 under either 16-bit dtype; the positions times ``inv_freq`` lose whole radians in 16 bits, transformers
   #28596);
6. an aux-loss-free MoE router bias (``e_score_correction_bias``, the buffer of 34 model families in transformers 5.24:
   DeepSeek-V3, GLM-4 MoE, ...): fp32 under either 16-bit dtype, where the model's own lists do not say it (transformers
   4.x's DeepSeek-V3 has no ``_keep_in_fp32_modules_strict``); its per-step updates are far below a 16-bit step.

``unsafe_in`` says which held dtypes break the need: a buffer declared fp32 held in one of them is *degraded*.
Integer buffers (``num_batches_tracked``) are never declared: a cast of them is a dtype change the report and the
doctor flag on its own.
"""
from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .._core import modules as _modules

HALF = frozenset({torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class Declared:
    """One buffer's declared dtype. ``name``: its qualified name in the module it was asked of; ``why``: the source,
    in words, for messages; ``unsafe_in``: the held dtypes that break it (see [Note: declared precision])."""

    name: str
    dtype: torch.dtype
    why: str
    unsafe_in: frozenset[torch.dtype] = HALF

    def degraded(self, held: torch.dtype) -> bool:
        """Whether a buffer held in ``held`` falls short of this declaration."""
        return held != self.dtype and held in self.unsafe_in


def coarser_than(dtype: torch.dtype) -> frozenset[torch.dtype]:
    """The floating dtypes with fewer significant bits than ``dtype`` (none for a non-floating one)."""
    if not dtype.is_floating_point:
        return frozenset()
    eps = torch.finfo(dtype).eps
    return frozenset(d for d in (torch.float16, torch.bfloat16, torch.float32) if torch.finfo(d).eps > eps)


# module -> {local buffer name: (dtype, why)}: explicit declarations (keep_precision), kept with the module's life
_EXPLICIT: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[torch.dtype, str]]] = weakref.WeakKeyDictionary()


def declare(module: nn.Module, buffer: str, dtype: torch.dtype, why: str = "keep_precision") -> None:
    """Declare that ``module``'s own buffer ``buffer`` must stay in ``dtype`` (overrides any default)."""
    _EXPLICIT.setdefault(module, {})[buffer] = (dtype, why)


def undeclare(module: nn.Module, buffer: str | None = None) -> None:
    """Drop ``module``'s explicit declaration of ``buffer`` (all of them when ``None``)."""
    own = _EXPLICIT.get(module)
    if own is None:
        return
    if buffer is None:
        own.clear()
    else:
        own.pop(buffer, None)
    if not own:
        del _EXPLICIT[module]


def explicit(module: nn.Module) -> dict[str, tuple[torch.dtype, str]]:
    """``module``'s own explicit declarations (a copy)."""
    return dict(_EXPLICIT.get(module, {}))


def _patterns(model: nn.Module, attr: str) -> list[tuple[re.Pattern[str], str]]:
    """Every ``attr`` list (transformers' fp32 lists) of ``model`` and its submodules, as a regex each, with the
    class that declared it: the lists of sub-models count too, as transformers gathers them."""
    out = []
    for sub in model.modules():
        for pattern in getattr(type(sub), attr, None) or ():
            if isinstance(pattern, str):
                out.append((re.compile(rf"(^|\.){re.escape(pattern)}($|\.)"), f"{type(sub).__name__}.{attr}"))
    return out


def _paths(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every (path, module) of ``root``'s tree, a module shared under several paths under each of them (as
    ``named_modules(remove_duplicate=False)``), but never descending into a module already on the path: a tree in
    which a module holds one of its ancestors ends instead of recursing forever."""
    stack: list[tuple[str, nn.Module, frozenset[int]]] = [("", root, frozenset({id(root)}))]
    while stack:
        path, m, above = stack.pop()
        yield path, m
        children = [(f"{path}.{k}" if path else k, c) for k, c in m._modules.items() if c is not None]
        stack.extend((p, c, above | {id(c)}) for p, c in reversed(children) if id(c) not in above)


def declared(module: nn.Module) -> Iterator[Declared]:
    """The declared dtype of every floating buffer of ``module`` that has one ([Note: declared precision]), by
    qualified name as ``module.named_buffers()`` gives it (engines and wrappers unwrapped first)."""
    root = _modules.unwrap(module, "declared")
    strict = _patterns(root, "_keep_in_fp32_modules_strict")
    loose = _patterns(root, "_keep_in_fp32_modules")
    owners = dict(_paths(root))
    named = ((f"{path}.{key}" if path else key, buf) for path, m in owners.items() for key, buf in m._buffers.items())
    for name, buf in named:
        if buf is None or not torch.is_floating_point(buf):
            continue
        owner_name, _, local = name.rpartition(".")
        owner = owners.get(owner_name)
        mine = _EXPLICIT.get(owner, {}).get(local) if owner is not None else None
        if mine is not None:
            yield Declared(name, mine[0], mine[1], coarser_than(mine[0]))
            continue
        hit = next((why for rx, why in strict if rx.search(name)), None)
        if hit is not None:
            yield Declared(name, torch.float32, f"transformers {hit}", HALF)
            continue
        hit = next((why for rx, why in loose if rx.search(name)), None)
        if hit is not None:
            yield Declared(name, torch.float32, f"transformers {hit}", frozenset({torch.float16}))
            continue
        if isinstance(owner, nn.modules.batchnorm._BatchNorm) and local in ("running_mean", "running_var"):
            yield Declared(name, torch.float32, "BatchNorm statistics", HALF)
        elif type(owner).__name__.endswith("RotaryEmbedding") and local in ("inv_freq", "original_inv_freq"):
            yield Declared(name, torch.float32, "a rotary table", HALF)
        elif local == "e_score_correction_bias":
            yield Declared(name, torch.float32, "an aux-loss-free MoE router bias", HALF)
