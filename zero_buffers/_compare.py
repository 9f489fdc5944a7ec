"""Private: element-wise comparisons in float64, a chunk at a time (report and checkpoint doctor)."""
from __future__ import annotations

import math

import torch

_CHUNK = 1 << 17  # elements compared at a time: the float64 temporaries stay a few MiB whatever the buffer size


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def max_abs_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| in float64; equal values (NaN and NaN, inf and inf) count 0, NaN against a number inf."""
    worst = 0.0
    a_all, b_all = x.reshape(-1), ref.reshape(-1)
    for start in range(0, a_all.numel(), _CHUNK):
        a, b = _wide(a_all[start:start + _CHUNK]), _wide(b_all[start:start + _CHUNK])
        diff = (a - b).abs()
        top = float(diff.max()) if diff.numel() else 0.0
        if math.isnan(top) or math.isinf(top):  # only then look at which non-finite values match
            same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # inf - inf is NaN, but inf equals inf
            diff = torch.where(same, torch.zeros_like(diff), torch.nan_to_num(diff, nan=math.inf))
            top = float(diff.max())
        worst = max(worst, top)
    return worst


def max_abs(ref: torch.Tensor) -> float:
    """The largest finite magnitude in ``ref`` (0 when empty or all non-finite)."""
    worst = 0.0
    flat = ref.reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):
        wide = _wide(flat[start:start + _CHUNK]).abs()
        top = float(wide.max()) if wide.numel() else 0.0
        if not math.isfinite(top):
            wide = torch.where(torch.isfinite(wide), wide, torch.zeros_like(wide))
            top = float(wide.max())
        worst = max(worst, top)
    return worst


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
