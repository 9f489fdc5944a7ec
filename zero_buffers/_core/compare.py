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


# [Note: uninitialised buffers]
# A rank's copy of a buffer is reported *uninitialised* (``BufferRow.uninitialised_ranks``) when all of these hold:
#
# 1. it differs from the reference rank's copy (the report's own comparison; the reference is never uninitialised);
# 2. it is a floating-point or complex tensor that has not been written in place since it was made: its version
#    counter is 0 (``torch_compat.never_written``). ``to_empty()``, ``torch.empty``, ``torch.zeros`` and a fresh
#    assignment make such tensors; ``copy_``, ``load_state_dict``, ``fill_``, a BatchNorm forward and a collective
#    into it all count as writes;
# 3. its values show what memory nobody wrote looks like (:class:`Leftover`), against the reference's copy:
#    - some element is NaN, +-inf, subnormal (non-zero, smaller in magnitude than its dtype's smallest normal) or
#      above 2**64 in magnitude where the reference's element is none of these (the words glibc keeps in freed
#      chunks are heap and library addresses, whose top bits are zero: read as float32 or float64 they are
#      subnormals; random bits are huge or not finite a quarter of the time);
#    - or every element is zero while the reference's copy is not all zero (fresh pages from the allocator);
# 4. the layer is not an untrained BatchNorm on that rank (mean 0, var 1, count 0: ``untrained_ranks`` says so).
#
# What this misses: leftover memory that holds plausible numbers (an earlier tensor's data, which CUDA's caching
# allocator hands back as it was, and a CPU allocator does for larger buffers), a to_empty buffer that something
# filled in place afterwards (transformers 5's zero-filling of meta leftovers is a write), integer and bool buffers
# (never flagged). What it may call uninitialised that was made on purpose: a buffer assigned anew on some ranks,
# never written in place since, holding NaN, subnormal, huge or only zero values where the reference does not.
# Either way the row still says the buffer differs; this only picks the advice (take the loaded rank's values with
# ``broadcast_buffers(materialize=True)`` after the load). Only the report's differing path computes it: it rides the
# all_gather of the per-buffer floats, so a report of agreeing ranks costs what it did.
_HUGE = 2.0 ** 64


def _leftover_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element (float64 ``t`` of original ``dtype``): NaN, +-inf, subnormal in ``dtype`` or above 2**64. An
    integer or bool ``dtype`` (a reference held so) has plain numbers only."""
    if not dtype.is_floating_point:
        return torch.zeros(t.shape, dtype=torch.bool, device=t.device)
    tiny = torch.finfo(dtype).tiny
    a = t.abs()
    return ~torch.isfinite(t) | ((a < tiny) & (a != 0)) | (a > _HUGE)


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.empty((), dtype=dtype).real.dtype if dtype.is_complex else dtype


def _real_view(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


class Leftover:
    """Point 3 of [Note: uninitialised buffers] for one tensor, fed in aligned blocks (:meth:`add`)."""

    __slots__ = ("garbage", "mine_zero", "ref_nonzero")

    def __init__(self) -> None:
        self.garbage = False  # a leftover-looking element where the reference holds a plain number
        self.mine_zero = True
        self.ref_nonzero = False

    def add(self, x: torch.Tensor, ref: torch.Tensor) -> bool:
        """Take in the next block of the tensor (``x``) and the same block of the reference (``ref``); return
        :attr:`found` so far. A complex tensor counts its real and imaginary parts as elements; a complex one
        against a real one is not judged."""
        if x.is_complex() != ref.is_complex():
            self.mine_zero = False
            return self.found
        dx, dr = _real_dtype(x.dtype), _real_dtype(ref.dtype)
        for x_part, ref_part in _aligned(x.detach(), ref.detach()):
            a, b = _real_view(x_part).to(torch.float64), _real_view(ref_part).to(torch.float64)
            if not self.garbage:
                self.garbage = bool((_leftover_like(a, dx) & ~_leftover_like(b, dr)).any())
            self.mine_zero = self.mine_zero and not bool(a.any())
            self.ref_nonzero = self.ref_nonzero or bool(b.any())
            del a, b
        return self.found

    @property
    def found(self) -> bool:
        return self.garbage or (self.mine_zero and self.ref_nonzero)
