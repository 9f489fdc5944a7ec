"""Private: buffer dtypes offline, where there is no module to ask.

- Which buffers must be float32, by their names alone: the defaults of [Note: declared precision]
  (``precision/declared.py``) mirrored by name (a BatchNorm layer's ``running_mean`` / ``running_var``, an MoE
  gate's ``e_score_correction_bias``, a rotary table's ``inv_freq`` / ``original_inv_freq``); a checkpoint holds
  no classes and no ``_keep_in_fp32_modules`` lists, so every finding says it was made by name.
- Which buffers must be integers by their names (``num_batches_tracked``): a floating one is the mark of an export
  that cast every buffer with ``.float()`` (DeepSpeed 0.16's ``zero_to_fp32``).
- Casting a buffer back to the dtype a training checkpoint holds it in, exactly or not at all (:func:`cast_back`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..precision.declared import HALF, Declared

INTEGER_BY_NAME = ("num_batches_tracked",)


def declared_by_name(name: str) -> Declared | None:
    """The dtype ``name`` must keep by its last component, as ``precision.declared`` would declare it for the module
    that usually holds such a buffer (None for every other name)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("running_mean", "running_var"):
        return Declared(name, torch.float32, "BatchNorm statistics (recognised by the name)", HALF)
    if leaf == "e_score_correction_bias":
        return Declared(name, torch.float32, "an MoE gate's score-correction bias, which transformers keeps in fp32 "
                        "(_keep_in_fp32_modules_strict; recognised by the name)", HALF)
    if leaf in ("inv_freq", "original_inv_freq"):
        return Declared(name, torch.float32, "a rotary table (recognised by the name)", HALF)
    return None


def integer_by_name(name: str) -> bool:
    """Whether ``name`` is a buffer that is an integer counter wherever it exists (BatchNorm's)."""
    return name.rsplit(".", 1)[-1] in INTEGER_BY_NAME


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype | None:
    """The torch dtype spelled ``name`` ("int64"), None when there is none."""
    found = getattr(torch, name, None)
    return found if isinstance(found, torch.dtype) else None


@dataclass(frozen=True)
class Inexact:
    """Why a cast back is refused: the first element (flat index) whose value the target dtype cannot hold as it is."""

    index: int
    value: float | complex | bool | int
    why: str


def _exact_limit(dtype: torch.dtype) -> float:
    """Every integer of magnitude up to this is held exactly by the floating ``dtype`` (2**24 for float32)."""
    return 2.0 / torch.finfo(dtype).eps  # eps = 2**-mantissa bits: 2**24 for float32, 2**8 for bfloat16


def cast_back(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | Inexact:
    """``t`` in ``dtype`` when that cast loses nothing, else where and why it would.

    Floating to integer (an int64 counter an export stored as float32): every value finite, integral, within the
    range where ``t``'s dtype holds integers exactly (a float32 above 2**24 may already be a rounded count) and
    within ``dtype``'s range. To bool: every value 0 or 1. Anything else: the values cast and cast back equal the
    stored ones bit for bit (NaN for NaN)."""
    flat = t.detach().reshape(-1)
    if t.dtype.is_floating_point and not dtype.is_floating_point and not dtype.is_complex:
        wide = flat.double()
        if dtype == torch.bool:
            bad = ~((wide == 0) | (wide == 1))
            why = "not 0 or 1, so not a flag"
        else:
            limit = min(_exact_limit(t.dtype), float(torch.iinfo(dtype).max))
            low = max(-_exact_limit(t.dtype), float(torch.iinfo(dtype).min))
            fractional = ~torch.isfinite(wide) | (wide != torch.round(wide))
            bad = fractional | (wide > limit) | (wide < low)
            why = (f"not an integer, or beyond +-{limit:.0f} where {dtype_name(t.dtype)} holds every integer "
                   "exactly (the count may already be rounded)")
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            return Inexact(i, float(flat[i]), why)
        return t.to(dtype)
    out = t.to(dtype)
    back = out.reshape(-1).to(t.dtype)
    same = back == flat
    if t.dtype.is_floating_point or t.dtype.is_complex:
        same |= torch.isnan(back) & torch.isnan(flat)
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        value = flat[i].item()
        became = out.reshape(-1)[i].item()
        return Inexact(i, value, f"{dtype_name(dtype)} cannot hold it exactly (it would become {became!r})")
    return out
