"""broadcast_buffers: every rank takes the source rank's buffers (and, on request, plain parameters)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ._core import args as _args, group as _group, modules as _modules, transaction as _transaction, wire as _wire
from .errors import InvalidArgumentError


def broadcast_buffers(module: nn.Module, src: int = 0, *, group: Any = None, include_parameters: bool = False,
                      ignore: Iterable[str] = (), timeout: _args.Timeout = None, materialize: bool = False) -> int:
    """Make every buffer of ``module`` on every rank of ``group`` equal, bit for bit, to rank ``src``'s.

    Persistent and non-persistent buffers are synchronised (``None`` buffers are skipped); with
    ``include_parameters=True`` also every parameter that neither ZeRO nor FSDP shards (no DTensor), for
    modules each rank built on its own. ``src`` is a rank *within* ``group`` (the default group: the
    global rank; a ``DeviceMesh`` or ``(mesh, "dim")`` stands for its group). ``ignore`` holds qualified
    buffer names or module paths to leave alone.

    ``materialize=True``: a receiver's buffers (and, with ``include_parameters``, parameters) on the
    ``meta`` device, which hold no data, are allocated like the source's (its dtype and shape) on the
    device of the owning module's other tensors (else of ``module``'s, else the source's device type) and
    registered in place of the meta ones once the data arrived: the one call after building on ``meta``
    while rank 0 loaded real weights (Accelerate's ``cpu_ram_efficient_loading``,
    ``set_model_state_dict(..., broadcast_from_rank0=True)``, which only carries persistent entries).
    Without it a meta tensor raises :class:`InvalidArgumentError` on every rank. The source itself must hold
    real data. After ``to_empty()`` non-persistent buffers hold whatever memory held: any call syncs them.

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
    """
    fn = "broadcast_buffers"
    _args.module(module, fn)
    src = _args.rank(src, "src", fn)
    skip = _args.ignore(ignore, fn)
    materialize = _args.flag(materialize, "materialize", fn)
    deadline = _wire.Deadline(_args.timeout(timeout, fn))
    g = _group.resolve(group, fn)
    _group.check_src(g, src, fn)  # src counts within the group ([Note: rank convention])
    if g is None:
        return 0
    entries = _modules.named_buffers(module, ignore=skip, include_parameters=include_parameters, fn=fn)
    if materialize:
        return _materialize(module, g, entries, src, include_parameters, deadline, fn)
    return _transaction.broadcast(g, entries, src, (fn, include_parameters), deadline, fn)  # [Note: the transaction]


_DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "npu", "mps", "mtia")  # a device type as a small int, for the vote


def _materialize(module: nn.Module, g: _group.Group, entries: list[_modules.Entry], src: int,
                 include_parameters: bool, deadline: _wire.Deadline, fn: str) -> int:
    """materialize=True: one small all_gather (who holds meta tensors, the source's device type), receivers allocate
    fresh tensors for their meta ones and vote on it (a second small all_gather), one ordinary broadcast into
    those, then they replace the meta tensors."""
    meta = [(n, t) for n, t in entries if t.is_meta]
    real = next((t for _, t in entries if not t.is_meta), None)
    kind = _DEVICE_TYPES.index(real.device.type) if real is not None and real.device.type in _DEVICE_TYPES else -1
    votes = _wire.all_gather_values(g, [len(meta), kind], deadline, fn)
    if votes[src][0]:
        raise InvalidArgumentError(
            f"{fn}(materialize=True): the source, rank {g.global_rank(src)}, holds {votes[src][0]} meta tensor(s) "
            "itself: it has no data to send. Materialise and load the module on the source first. No buffer was "
            "modified")
    fallback = _DEVICE_TYPES[votes[src][1]] if votes[src][1] >= 0 else "cpu"
    fresh: dict[int, torch.Tensor] = {}
    failure: BaseException | None = None
    try:
        for _, t in meta:
            fresh[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=_home(module, t, fallback))
    except BaseException as e:  # noqa: BLE001 - a vote: every rank raises below, nothing was registered
        failure, fresh = e, {}
    allocated = [v[0] for v in _wire.all_gather_values(g, [int(failure is not None)], deadline, fn)]
    _transaction.abort_if_any(g, allocated, failure, deadline, f"{fn}(materialize=True)",
                              "allocating the meta tensors failed", "no buffer was modified")
    sending = [(n, fresh.get(id(t), t)) for n, t in entries]
    done = _transaction.broadcast(g, sending, src, (fn, include_parameters, "materialize"), deadline, fn)
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
