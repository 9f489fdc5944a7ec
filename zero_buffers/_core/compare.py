"""Private: element-wise comparisons in float64, a chunk at a time (report and checkpoint doctor), and the walk in
logical order that lets them (and the digests) read a tensor of any layout without a whole contiguous copy."""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch

_CHUNK = 1 << 15  # elements compared at a time: the float64 temporaries stay under 1 MiB whatever the buffer size


def blocks(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views of consecutive parts of ``t`` in logical (row-major) order, each of at most ``limit`` elements
    (``limit`` >= 1): runs of whole rows, or parts of one row when a row is larger.

    Where the blocks start depends on the shape alone, so tensors of one shape give aligned blocks whatever their
    strides (ranks holding one buffer transposed and one not cut it alike)."""
    n = t.numel()
    if n == 0:
        return
    if n <= limit or t.dim() == 0:
        yield t
        return
    rows = t.shape[0]
    row = n // rows
    if row > limit:
        for i in range(rows):
            yield from blocks(t[i], limit)
        return
    step = max(1, limit // row)
    for start in range(0, rows, step):
        yield t[start:start + step]


def pieces(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """:func:`blocks` flattened: a view of a contiguous tensor, else a copy of that block only (never of the whole
    tensor)."""
    for block in blocks(t, limit):
        yield block.reshape(-1)


def _aligned(x: torch.Tensor, ref: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, ref) chunk pairs of at most :data:`_CHUNK` elements in logical order."""
    if x.shape == ref.shape:
        yield from zip(pieces(x, _CHUNK), pieces(ref, _CHUNK))
        return
    a_all, b_all = x.reshape(-1), ref.reshape(-1)  # same count, other shapes (the doctor's flat entries)
    for start in range(0, a_all.numel(), _CHUNK):
        yield a_all[start:start + _CHUNK], b_all[start:start + _CHUNK]


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def max_abs_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| in float64; equal values (NaN and NaN, inf and inf) count 0, NaN against a number inf."""
    worst = 0.0
    for x_part, ref_part in _aligned(x.detach(), ref.detach()):
        a, b = _wide(x_part), _wide(ref_part)  # views when already float64: never written to
        diff = a - b
        diff = diff.abs() if diff.is_complex() else diff.abs_()
        top = float(diff.max()) if diff.numel() else 0.0
        if math.isnan(top) or math.isinf(top):  # only then look at which non-finite values match
            same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # inf - inf is NaN, but inf equals inf
            diff = torch.where(same, torch.zeros_like(diff), torch.nan_to_num(diff, nan=math.inf))
            top = float(diff.max())
        worst = max(worst, top)
        del x_part, ref_part, a, b, diff  # before the next pair is made
    return worst


def max_abs(ref: torch.Tensor) -> float:
    """The largest finite magnitude in ``ref`` (0 when empty or all non-finite)."""
    worst = 0.0
    for part in pieces(ref.detach(), _CHUNK):
        wide = _wide(part)
        wide = wide.abs() if wide.is_complex() or wide is part else wide.abs_()
        top = float(wide.max()) if wide.numel() else 0.0
        if not math.isfinite(top):
            wide = torch.where(torch.isfinite(wide), wide, torch.zeros_like(wide))
            top = float(wide.max())
        worst = max(worst, top)
        del part, wide
    return worst


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
