"""broadcast_buffers: every rank takes the source rank's buffers (and, on request, plain parameters)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ._core import (
    args as _args,
    group as _group,
    modules as _modules,
    placement as _placement,
    structure as _structure,
    transaction as _transaction,
    wire as _wire,
)
from .errors import BufferStructureError, InvalidArgumentError


def broadcast_buffers(module: nn.Module, src: int = 0, *, group: Any = None, include_parameters: bool = False,
                      ignore: Iterable[str] = (), timeout: _args.Timeout = None, materialize: bool = False,
                      adopt_dtype: bool = False) -> int:
    """Make every buffer of ``module`` on every rank of ``group`` equal, bit for bit, to rank ``src``'s.

    Persistent and non-persistent buffers are synchronised (``None`` buffers are skipped); with
    ``include_parameters=True`` also every parameter that neither ZeRO nor FSDP shards (no DTensor), for
    modules each rank built on its own. ``src`` is a rank *within* ``group`` (the default group: the
    global rank; a ``DeviceMesh`` or ``(mesh, "dim")`` stands for its group). ``ignore`` holds qualified
    buffer names or module paths to leave alone. Over a mesh, each buffer takes the value at ``src``'s coordinate
    along the dimensions it is replicated over; DTensor buffers are never moved along a ``Shard`` or ``Partial``
    dimension ([Note: placements]).

    ``materialize=True``: a receiver's buffers (and, with ``include_parameters``, parameters) on the
    ``meta`` device, which hold no data, are allocated like the source's (its dtype and shape) on the
    device of the owning module's other tensors (else of ``module``'s, else the source's device type) and
    registered in place of the meta ones once the data arrived: the one call after building on ``meta``
    while rank 0 loaded real weights (Accelerate's ``cpu_ram_efficient_loading``,
    ``set_model_state_dict(..., broadcast_from_rank0=True)``, which only carries persistent entries).
    Without it a meta tensor raises :class:`InvalidArgumentError` on every rank. The source itself must hold
    real data. After ``to_empty()`` non-persistent buffers hold whatever memory held: any call syncs them.

    ``adopt_dtype=True`` (with ``materialize=True``): a receiver's *buffer* held in another dtype than the source's
    (rank 0 loaded an fp32 rotary ``inv_freq`` while the others were built on ``meta`` in bfloat16, or
    ``to_empty()``-ed such a build) is re-registered as a fresh tensor in the source's dtype, shape and the
    device as above, once the data arrived: meta and materialized buffers alike, under the same name, persistent
    or not as before, every alias of it too. Parameters never change dtype: one held in another dtype than the
    source's stays a :class:`BufferStructureError`, as every dtype difference is without the option (its message
    names ``adopt_dtype=True``). Safe when nothing holds the old tensor itself (module code reading
    ``self.inv_freq`` sees the new one; a tensor computed from the old one beforehand does not change). Costs one
    more small collective (the source's dtypes, a byte per tensor). ``adopt_dtype=True`` without
    ``materialize=True`` raises :class:`InvalidArgumentError` before any collective.

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

        with torch.device("meta" if rank else "cpu"):
            model = build_model()             # rank 0 real, the others on meta
        zero_buffers.broadcast_buffers(model, materialize=True)

        # rank 0 built in fp32 and loaded; the others on meta in bf16 (the rotary inv_freq too)
        zero_buffers.broadcast_buffers(model, materialize=True, adopt_dtype=True, include_parameters=True)
    """
    fn = "broadcast_buffers"
    _args.module(module, fn)
    src = _args.rank(src, "src", fn)
    skip = _args.ignore(ignore, fn)
    materialize = _args.flag(materialize, "materialize", fn)
    adopt_dtype = _args.flag(adopt_dtype, "adopt_dtype", fn)
    if adopt_dtype and not materialize:
        raise InvalidArgumentError(
            f"{fn}(): adopt_dtype=True re-registers receivers' buffers in the source's dtype, which is part of "
            "materialize=True: pass materialize=True too (it leaves buffers that already match as they are)")
    deadline = _wire.Deadline(_args.timeout(timeout, fn))
    g = _group.resolve(group, fn)
    _group.check_src(g, src, fn)  # src counts within the group ([Note: rank convention])
    if g is None:
        return 0
    entries = _modules.named_buffers(module, ignore=skip, include_parameters=include_parameters, fn=fn)
    if materialize:
        return _materialize(module, g, entries, src, include_parameters, adopt_dtype, deadline, fn)
    placed = _placement.placed(g, entries, deadline, fn)  # over a mesh: [Note: placements]
    return _transaction.broadcast(g, entries, src, (fn, include_parameters), deadline, fn,  # [Note: the transaction]
                                  placed=placed)


_DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "npu", "mps", "mtia")  # a device type as a small int, for the vote


def _materialize(module: nn.Module, g: _group.Group, entries: list[_modules.Entry], src: int,
                 include_parameters: bool, adopt_dtype: bool, deadline: _wire.Deadline, fn: str) -> int:
    """materialize=True: one small all_gather (who holds meta tensors, the source's device type, how many tensors,
    adopt_dtype), with adopt_dtype a broadcast of the source's dtypes (a byte per tensor), receivers allocate fresh
    tensors for their meta ones (and buffers to re-type) and vote on it (a second small all_gather), one ordinary
    broadcast into those, then they replace the old tensors."""
    meta = [(n, t) for n, t in entries if t.is_meta]
    real = next((t for _, t in entries if not t.is_meta), None)
    kind = _DEVICE_TYPES.index(real.device.type) if real is not None and real.device.type in _DEVICE_TYPES else -1
    votes = _wire.all_gather_values(g, [len(meta), kind, len(entries), int(adopt_dtype)], deadline, fn)
    if any(v[3] != votes[0][3] for v in votes):
        raise BufferStructureError(
            f"{fn}: ranks called it with different arguments: "
            f"{_structure.by_value(g.ranks, [f'adopt_dtype={bool(v[3])}' for v in votes])}. No buffer was modified",
            None, {r: f"adopt_dtype={bool(v[3])}" for r, v in zip(g.ranks, votes)})
    if votes[src][0]:
        raise InvalidArgumentError(
            f"{fn}(materialize=True): the source, rank {g.global_rank(src)}, holds {votes[src][0]} meta tensor(s) "
            "itself: it has no data to send. Materialise and load the module on the source first. No buffer was "
            "modified")
    fallback = _DEVICE_TYPES[votes[src][1]] if votes[src][1] >= 0 else "cpu"
    wanted: dict[int, torch.dtype] = {}  # id of a receiver's buffer -> the source's dtype, where they differ
    if adopt_dtype and all(v[2] == votes[0][2] for v in votes):  # else the structure agreement below names it
        codes = _structure.pack_bytes([_structure.dtype_code(t.dtype) for _, t in entries])
        theirs = torch.tensor(codes, dtype=torch.int64, device=g.device)
        _wire.broadcast_flat(g, theirs, src, deadline, fn)
        source = _structure.unpack_bytes(theirs.tolist(), len(entries))
        buffers = {id(b) for b in module.buffers()}
        for (_, t), code in zip(entries, source):
            dtype = _structure.dtype_of(code)
            if g.me != src and dtype is not None and dtype != t.dtype and id(t) in buffers:
                wanted[id(t)] = dtype
    fresh: dict[int, torch.Tensor] = {}
    failure: BaseException | None = None
    try:
        for _, t in entries:
            if t.is_meta or id(t) in wanted:
                device = _home(module, t, fallback) if t.is_meta else t.device
                fresh[id(t)] = torch.empty(t.shape, dtype=wanted.get(id(t), t.dtype), device=device)
    except BaseException as e:  # noqa: BLE001 - a vote: every rank raises below, nothing was registered
        failure, fresh = e, {}
    allocated = [v[0] for v in _wire.all_gather_values(g, [int(failure is not None)], deadline, fn)]
    _transaction.abort_if_any(g, allocated, failure, deadline, f"{fn}(materialize=True)",
                              "allocating the meta tensors failed", "no buffer was modified")
    sending = [(n, fresh.get(id(t), t)) for n, t in entries]
    try:
        done = _transaction.broadcast(g, sending, src, (fn, include_parameters, "materialize"), deadline, fn)
    except BufferStructureError as e:
        parameters = {n for n, _ in module.named_parameters()}
        if adopt_dtype and e.name in parameters:  # the same on every rank: the error and the module's names
            raise BufferStructureError(
                f"{e} '{e.name}' is a parameter: adopt_dtype=True re-types buffers only, never parameters (an "
                "optimizer or an engine may hold them); cast it on the ranks that differ (module.to(dtype)) first",
                e.name, e.details) from None
        raise
    _register(module, fresh)
    return done


def _home(module: nn.Module, meta: torch.Tensor, fallback: str) -> torch.device:
    """Where a meta tensor goes: beside the owning module's other real tensors, else ``module``'s, else ``fallback``."""
    def first_real(tensors: Iterable[torch.Tensor | None]) -> torch.device | None:
        return next((t.device for t in tensors if t is not None and not t.is_meta), None)

    for m in module.modules():
        own = [*m._parameters.values(), *m._buffers.values()]
        if any(t is meta for t in own):
            device = first_real(own)
            if device is not None:
                return device
            break
    device = first_real([*module.parameters(), *module.buffers()])
    if device is not None:
        return device
    if fallback == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(fallback)


def _register(module: nn.Module, fresh: dict[int, torch.Tensor]) -> None:
    """Put each fresh tensor where its meta tensor was registered (every alias; parameters stay parameters)."""
    if not fresh:
        return
    params: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for key, t in list(m._buffers.items()):
            if t is not None and id(t) in fresh:
                m._buffers[key] = fresh[id(t)]
        for key, p in list(m._parameters.items()):
            if p is not None and id(p) in fresh:
                if id(p) not in params:
                    params[id(p)] = nn.Parameter(fresh[id(p)], requires_grad=p.requires_grad)
                m._parameters[key] = params[id(p)]
