"""broadcast_buffers: every rank takes the source rank's buffers (and, on request, plain parameters)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from . import _args, _group, _modules, _transaction, _wire


def broadcast_buffers(module: nn.Module, src: int = 0, *, group: Any = None, include_parameters: bool = False,
                      ignore: Iterable[str] = (), timeout: _args.Timeout = None) -> int:
    """Make every buffer of ``module`` on every rank of ``group`` equal, bit for bit, to rank ``src``'s.

    Persistent and non-persistent buffers are synchronised (``None`` buffers are skipped); with
    ``include_parameters=True`` also every parameter that ZeRO does not manage, for modules each rank
    built on its own. ``src`` is a rank *within* ``group`` (the default group: the global rank).
    ``ignore`` holds qualified buffer names or module paths to leave alone.

    All or nothing: ranks first agree on the structure (names, order, dtypes, shapes, devices, ``src``)
    and on having the memory to receive, in one small collective; a mismatch raises
    :class:`BufferStructureError` on every rank. Data then moves in one broadcast per (device, dtype)
    bucket of at most 250 MiB, into scratch space, and is written only after every rank confirmed it
    arrived. A failure anywhere raises on every rank and leaves every buffer unchanged; ``timeout``
    (seconds or a timedelta) bounds the whole call (:class:`CollectiveError` past it). Extra memory: a
    receiver holds a copy of what it receives; the source stages at most one bucket of non-contiguous
    or packed buffers. A no-op when torch.distributed is not initialised, the group has one rank, or
    this rank is not in it. Returns the number of tensors synchronised (0 for a no-op).

    Example::

        model = build_model()                 # BatchNorm stats, codebooks ... differ per rank
        zero_buffers.broadcast_buffers(model) # now every rank holds rank 0's values
    """
    fn = "broadcast_buffers"
    _args.module(module, fn)
    src = _args.rank(src, "src", fn)
    skip = _args.ignore(ignore, fn)
    deadline = _wire.Deadline(_args.timeout(timeout, fn))
    g = _group.resolve(group, fn)
    _group.check_src(g, src, fn)
    if g is None:
        return 0
    entries = _modules.named_buffers(module, ignore=skip, include_parameters=include_parameters)
    return _transaction.broadcast(g, entries, src, (fn, include_parameters), deadline, fn)
