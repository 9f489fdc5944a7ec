"""Private torch APIs: ``torch._utils`` flat-tensor helpers, the fused ``torch._foreach_copy_``, DCP's file layout."""
from __future__ import annotations

import ctypes
import re
import warnings
from collections.abc import Sequence
from typing import Any

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


# -- torch.distributed.checkpoint (DCP), read offline --------------------------------------------------------------
_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # FileSystemWriter names each rank's file __{rank}_{n}.distcp


def dcp_metadata(path: str) -> Any:
    """The ``.metadata`` of a DCP folder (``FileSystemReader.read_metadata``)."""
    try:
        from torch.distributed.checkpoint import FileSystemReader
    except ImportError as e:  # pragma: no cover - every torch zero_buffers supports has it
        raise missing("torch", "torch.distributed.checkpoint.FileSystemReader", str(e)) from e
    return FileSystemReader(path).read_metadata()


def dcp_tensors(metadata: Any) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every plain tensor entry of a DCP checkpoint: name -> (dtype, shape)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {name: (m.properties.dtype, tuple(m.size)) for name, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}


def dcp_writers(metadata: Any) -> dict[str, set[int]]:
    """Which ranks' files hold each entry (from ``storage_data``' relative paths); empty when it cannot tell."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return {}
    out: dict[str, set[int]] = {}
    for index, info in storage.items():
        found = _DCP_FILE.search(str(getattr(info, "relative_path", "")))
        fqn = getattr(index, "fqn", None)
        if found is None or fqn is None:
            return {}
        out.setdefault(fqn, set()).add(int(found.group(1)))
    return out


def dcp_read(path: str, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Load ``entries`` of a DCP folder into fresh CPU tensors, in this process (``no_dist=True``)."""
    import torch.distributed.checkpoint as dcp

    out = {name: torch.empty(shape, dtype=dtype) for name, (dtype, shape) in entries.items()}
    if out:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled ... single process"
            dcp.load(out, checkpoint_id=path, no_dist=True)
    return out
