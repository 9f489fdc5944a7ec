"""broadcast_buffers: every rank takes the source rank's buffers (and, on request, plain parameters)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from . import _dist


def broadcast_buffers(module: nn.Module, src: int = 0, *, group: Any = None, include_parameters: bool = False,
                      ignore: Iterable[str] = (), timeout: _dist.Timeout = None) -> int:
    """Make every buffer of ``module`` on every rank of ``group`` equal, bit for bit, to rank ``src``'s.

    Persistent and non-persistent buffers are synchronised (``None`` buffers are skipped); with
    ``include_parameters=True`` also every parameter that ZeRO does not manage, for modules each rank
    built on its own. ``src`` is a global rank and must belong to ``group``. ``ignore`` holds qualified
    buffer names or module paths to leave alone.

    Ranks first agree on the structure (names, order, dtypes, shapes, devices, ``src``) with one small
    collective; a mismatch raises :class:`BufferStructureError` on every rank and nothing is modified.
    Data moves with one broadcast per (device, dtype) bucket, received into scratch space and written
    into the buffers only once every bucket has arrived: a failed or timed-out call (``timeout``
    seconds, or a timedelta, for each of the two steps; :class:`CollectiveError`) leaves every buffer unchanged.
    A no-op when torch.distributed is not initialised, the group has one rank, or this rank is not in it.
    Returns the number of tensors synchronised (0 for a no-op).

    Example::

        model = build_model()                 # BatchNorm stats, codebooks ... differ per rank
        zero_buffers.broadcast_buffers(model) # now every rank holds rank 0's values
    """
    _dist.check_module(module, "broadcast_buffers")
    ignore = _dist.check_ignore(ignore, "broadcast_buffers")
    timeout = _dist.check_timeout(timeout, "broadcast_buffers")
    g = _dist.resolve_group(group)
    _dist.check_src(g, src)
    if g is None:
        return 0
    entries = _dist.named_buffers(module, ignore=ignore, include_parameters=include_parameters)
    return broadcast_entries(g, entries, src, timeout, "broadcast_buffers", include_parameters)


def broadcast_entries(g: _dist.Group, entries: list[tuple[str, torch.Tensor]], src: int, timeout: _dist.Timeout,
                      what: str, *call: object) -> int:
    """Structure-checked, transactional broadcast of named tensors from ``src`` (the core of every sync)."""
    _dist.agree_on_structure(g, (what, src, *call), entries, timeout, what)
    _dist.reject_unsupported(entries, what)
    _dist.check_backend_devices(g, entries, what)
    _dist.broadcast_coalesced(g, [t for _, t in entries], src, timeout, what)
    return len(entries)
