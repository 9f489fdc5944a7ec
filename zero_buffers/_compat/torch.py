"""Private torch APIs: the flat-tensor helpers of ``torch._utils`` and the fused ``torch._foreach_copy_``."""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from . import missing

try:
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    _foreach_copy = torch._foreach_copy_
except (ImportError, AttributeError) as e:  # pragma: no cover - every torch zero_buffers supports has them
    raise missing("torch", "torch._utils._flatten_dense_tensors / torch._foreach_copy_", str(e)) from e


def flatten(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate same-dtype, same-device tensors into one new flat tensor."""
    with torch.no_grad():
        if any(t.is_complex() for t in ts):  # the C++ helper refuses complex tensors
            return torch.cat([t.reshape(-1) for t in ts])
        return _flatten_dense_tensors(list(ts))


def unflatten_into(flat: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``ts`` (the inverse of :func:`flatten`) with one fused kernel."""
    with torch.no_grad():
        if flat.is_complex():
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
            return
        _foreach_copy(list(ts), list(_unflatten_dense_tensors(flat, list(ts))))


FSDP_CLASSES = frozenset({"FullyShardedDataParallel", "FSDPModule"})
"""Class names (anywhere in the MRO) of torch's FSDP1 wrapper and the FSDP2 mixin."""


def pack_into(flat: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
    """Copy ``ts`` into consecutive slices of the preallocated ``flat`` (:func:`flatten` without allocating)."""
    with torch.no_grad():
        if any(t.is_complex() for t in ts):
            offset = 0
            for t in ts:
                flat[offset:offset + t.numel()].view(t.shape).copy_(t)
                offset += t.numel()
            return
        _foreach_copy(list(_unflatten_dense_tensors(flat, list(ts))), [t.detach() for t in ts])


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy and without NumPy (``pip install torch`` does not bring
    it): a ctypes view of the tensor's memory. The caller must keep ``t`` alive while the view is used (or use
    :func:`to_bytes`)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("host_bytes needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def to_bytes(t: torch.Tensor) -> bytes:
    """A copy of a tensor's bytes (moved to the host, made contiguous first)."""
    host = t.detach().cpu().contiguous()
    return bytes(host_bytes(host))
