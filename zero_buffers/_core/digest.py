"""Content digests: 64-bit values that are equal exactly when buffers are bitwise equal (up to a stated bound).

Host tensors are hashed with SHA-1 over their bytes in logical order (hardware-accelerated on current
CPUs). Tensors on an accelerator are fingerprinted where they are (:func:`fingerprint`): a few kernels and
a copy of a few bytes per 128 KiB to the host, never the tensor itself. Which method a tensor gets
depends on its device type, which structure agreement has already compared, so every rank feeds the
same method the same byte stream for equal values.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .._compat import torch as torch_compat
from . import compare as _compare, wire as _wire

_IN_PLACE_BYTES = 1 << 16  # host tensors this large are hashed where they are; smaller ones are packed together
_PIECE_BYTES = 4 << 20  # a non-contiguous host tensor is hashed through copies of at most this many bytes

# fingerprint(): words of 16 bits, chunks of 2**16 words, two tables of multipliers below 2**31
_CHUNK = 1 << 16
_SLAB = 1 << 22  # words converted to int64 at a time (bounds the temporary memory to 64 MiB)
_TABLES: dict[torch.device, torch.Tensor] = {}


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in logical order as a flat uint8 tensor (conj/neg views resolved, layout ignored)."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def _table(device: torch.device) -> torch.Tensor:
    """Two fixed rows of 2**16 multipliers in [0, 2**31), made once per device from a fixed seed."""
    table = _TABLES.get(device)
    if table is None:
        g = torch.Generator().manual_seed(0x5EED_B0FF)
        table = _TABLES[device] = torch.randint(0, 2 ** 31, (2, _CHUNK), generator=g, dtype=torch.int64).to(device)
    return table


def fingerprint(t: torch.Tensor) -> int:
    """64-bit fingerprint of ``t``'s bytes, computed on ``t``'s device.

    The bytes are read as 16-bit words w; per chunk c of 2**16 words and per table row k, the exact
    integer h[c, k] = sum_j w[c, j] * A[k, j] (below 2**63, so no overflow and no dependence on the
    reduction order). SHA-1 of the byte length and all h gives the result. For two different inputs,
    some chunk differs, and h agrees for that chunk and one row with probability at most 2**-31 over the
    choice of A (fix all but one differing word: at most one multiplier value cancels it); with two
    independent rows, 2**-62, plus 2**-64 from truncating SHA-1. A is fixed (seeded), so the bound holds
    for inputs not chosen with knowledge of A.
    """
    raw = _raw(t)
    n = raw.numel()
    if n % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    words = raw.view(torch.int16)
    table = _table(t.device)
    parts = []
    for start in range(0, words.numel(), _SLAB):
        w = words[start:start + _SLAB].to(torch.int64) & 0xFFFF
        if w.numel() % _CHUNK:
            w = torch.cat([w, w.new_zeros(_CHUNK - w.numel() % _CHUNK)])
        w = w.view(-1, _CHUNK)
        parts.append(torch.stack([(w * table[0]).sum(1), (w * table[1]).sum(1)], 1))
    h = hashlib.sha1(n.to_bytes(8, "little"), usedforsecurity=False)
    if parts:
        h.update(torch_compat.to_bytes(torch.cat(parts)))
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def _feed_host(h: Any, t: torch.Tensor) -> None:
    """Add a host tensor's bytes to ``h`` in logical order: no copy when it is contiguous, else a copy of one piece
    of at most :data:`_PIECE_BYTES` at a time (the digest is that of the whole byte stream either way)."""
    t = t.detach()
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        raw = _raw(t)  # host_bytes is a view of its memory: keep the tensor alive while it is read
        h.update(torch_compat.host_bytes(raw))
        return
    for part in _compare.pieces(t, max(1, _PIECE_BYTES // t.element_size())):
        raw = _raw(part)
        h.update(torch_compat.host_bytes(raw))
        del part, raw  # before the next piece is made: one piece alive at a time


def _chunks(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[list[int], torch.Tensor]]:
    """(indices, tensor whose bytes stand for them), in an order that depends on the structure only: per
    (device, dtype) bucket, each large tensor on its own, then the rest packed together."""
    for b in _wire.plan(tensors, cap=1 << 62):
        packed = []
        for i in b.indices:
            t = tensors[i]
            if t.numel() * t.element_size() >= _IN_PLACE_BYTES:
                yield [i], t
            else:
                packed.append(i)
        if packed:
            yield packed, torch_compat.flatten([tensors[i] for i in packed])


def _feed(h: Any, t: torch.Tensor) -> None:
    """Add ``t``'s bytes (host) or its fingerprint (accelerator) to ``h``."""
    if t.device.type == "cpu":
        _feed_host(h, t)
    else:
        h.update(fingerprint(t).to_bytes(8, "little", signed=True))


def _one(t: torch.Tensor) -> int:
    """The 64-bit digest of one tensor (0 when empty)."""
    if not t.numel():
        return 0
    h = hashlib.sha1(usedforsecurity=False)
    _feed(h, t)
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def combined(tensors: Sequence[torch.Tensor], known: dict[int, int] | None = None) -> int:
    """One 64-bit digest over all ``tensors`` (empty ones contribute nothing, their shape is in the structure).
    A large tensor enters through its own digest, which goes into ``known`` (index -> digest) for
    :func:`per_tensor`, so a report that finds differences does not hash it twice."""
    h = hashlib.sha1(usedforsecurity=False)
    for idx, t in _chunks(tensors):
        if len(idx) == 1 and t is tensors[idx[0]]:
            d = _one(t)
            if known is not None:
                known[idx[0]] = d
            h.update(d.to_bytes(8, "little", signed=True))
        else:
            _feed(h, t)
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def per_tensor(tensors: Sequence[torch.Tensor], known: dict[int, int] | None = None) -> list[int]:
    """One 64-bit digest per tensor (0 for an empty one); ``known`` ones are not hashed again."""
    known = known or {}
    return [known[i] if i in known else _one(t) for i, t in enumerate(tensors)]
