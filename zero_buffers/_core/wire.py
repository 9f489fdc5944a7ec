"""Collectives under one deadline: control messages, the bucket plan, and the coalesced data collectives.

Tensors travel in buckets: one flat tensor per (device, dtype), cut at :data:`BUCKET_BYTES` (torch's DDP
uses the same 250 MiB). The plan depends on the structure only, which ranks agree on first, so every rank
issues the same collectives in the same order.
"""
from __future__ import annotations

import datetime
import math
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._compat import torch as torch_compat
from ..errors import CollectiveError
from . import args as _args
from .group import Group

BUCKET_BYTES = 250 * 2 ** 20


class Deadline:
    """The time left for one call. ``seconds``: every collective it issues waits at most until that long after the
    start (``math.inf``: no bound). None, the default: each collective waits at most ``_args.default_wait()``
    seconds for its peers, so a call made on some ranks only ends in a clear error instead of waiting forever."""

    def __init__(self, seconds: float | None):
        self.default = seconds is None
        self.seconds = _args.default_wait() if seconds is None else seconds
        self._end = None if self.default or math.isinf(self.seconds) else time.monotonic() + self.seconds

    def remaining(self) -> datetime.timedelta | None:
        """What the next wait may take (at least 1 ms), or None for no bound."""
        if math.isinf(self.seconds):
            return None
        if self._end is None:
            return datetime.timedelta(seconds=self.seconds)
        return datetime.timedelta(seconds=max(self._end - time.monotonic(), 0.001))


# [Note: the last works are held]
# A gloo collective runs on one of the process group's worker threads ("pt_gloo_runloop"). The thread marks the work
# done (our wait() returns) and only then drops its reference to it. If that is the last reference, the work's
# tensors die on the worker thread, which takes the GIL to free their Python objects. While the interpreter is
# shutting down, taking the GIL ends the thread inside C++ code that may not be unwound: the process aborts with
# "terminate called without an active exception" (torch 2.13, gloo; torchrun then reports a ChildFailedError). The
# README example, whose last collective is ours, hit this after printing every result in 4 runs of 25 under torchrun
# on a loaded 2-core machine. destroy_process_group() does not prevent it while anything (a DDP model) still holds
# the group: the worker threads stop only when the group is freed.
# So wait() keeps the Python objects of the works it waited for in _HELD until the next wait() ends: the calling
# thread, holding the GIL, drops them later (at the next call, or when this module is torn down at exit), by which
# time the worker has long dropped its reference. What stays alive between calls is the last wait's tensors only:
# every transaction ends with a vote of a few bytes, and keep_in_sync keeps its buffers for the next step anyway.
_HELD: list[Any] = []


def wait(works: Sequence[Any], deadline: Deadline, what: str) -> None:
    """Wait for async collectives within the deadline; a failure or timeout becomes CollectiveError. The works are
    held until the next wait ([Note: the last works are held])."""
    try:
        for w in works:
            left = deadline.remaining()
            if left is None:
                w.wait()
            else:
                w.wait(timeout=left)
    except RuntimeError as e:
        timed_out = not math.isinf(deadline.seconds) and "timed out" in str(e).lower()
        if timed_out and deadline.default:
            cause = (f"the other ranks did not join within {deadline.seconds:g} s (the default bound on each "
                     f"collective): most likely they never called {what}. Every rank of the group must call it; a "
                     "call under `if rank == 0:` / `accelerator.is_main_process` waits for peers that never come "
                     "(a stalled or dead peer ends here too). Pass timeout= (seconds, or float('inf')) or set "
                     "ZERO_BUFFERS_TIMEOUT to wait longer")
        elif timed_out:
            cause = (f"the collective did not complete within timeout={deadline.seconds:g} s (a peer stalled, died or "
                     f"never called {what})")
        else:
            cause = str(e)
        raise CollectiveError(
            f"{what} failed on rank {dist.get_rank()}: {cause}. No buffer was modified; the process group may be "
            "unusable now (a peer died or stalled)") from e
    finally:
        _HELD[:] = works  # the previous wait's works are dropped here, on this thread


def all_gather_values(g: Group, values: Sequence[int], deadline: Deadline, what: str,
                     dtype: torch.dtype = torch.int64) -> list[list[Any]]:
    """Every member's ``values`` (same length everywhere, int64 or ``dtype``), in group order."""
    mine = torch.tensor(list(values), dtype=dtype, device=g.device)
    out = [torch.empty_like(mine) for _ in range(g.size)]
    wait([dist.all_gather(out, mine, group=g.pg, async_op=True)], deadline, what)
    return [o.tolist() for o in out]


def gather_objects(g: Group, obj: Any, deadline: Deadline, what: str) -> list[Any]:
    """all_gather a picklable object under the deadline (sizes, then padded bytes); only on error paths."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [s[0] for s in all_gather_values(g, [data.numel()], deadline, what)]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=g.device)
    padded[:data.numel()] = data.to(g.device)
    blobs = [torch.empty_like(padded) for _ in range(g.size)]
    wait([dist.all_gather(blobs, padded, group=g.pg, async_op=True)], deadline, what)
    return [pickle.loads(torch_compat.to_bytes(b[:n])) for b, n in zip(blobs, sizes)]


def all_reduce(g: Group, t: torch.Tensor, deadline: Deadline, what: str,
               op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce ``t`` across the group in place (one collective) and return it."""
    wait([dist.all_reduce(wire_view(t), op=op, group=g.pg, async_op=True)], deadline, what)
    return t


@dataclass(frozen=True)
class Bucket:
    """Consecutive same-(device, dtype) tensors sent as one flat tensor."""

    device: torch.device
    dtype: torch.dtype
    indices: tuple[int, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def plan(tensors: Sequence[torch.Tensor], cap: int | None = None) -> list[Bucket]:
    """Buckets by (device, dtype) in first-seen order, each cut before it would pass ``cap`` bytes (default
    :data:`BUCKET_BYTES`; a tensor larger than that travels alone). Empty tensors are left out."""
    cap = BUCKET_BYTES if cap is None else cap
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(i)
    out = []
    for (device, dtype), idx in groups.items():
        size = torch.empty((), dtype=dtype).element_size()
        current: list[int] = []
        numel = 0
        for i in idx:
            n = tensors[i].numel()
            if current and (numel + n) * size > cap:
                out.append(Bucket(device, dtype, tuple(current), numel))
                current, numel = [], 0
            current.append(i)
            numel += n
        if current:
            out.append(Bucket(device, dtype, tuple(current), numel))
    return out


def wire_view(flat: torch.Tensor) -> torch.Tensor:
    """A bit-exact view of a flat tensor in a dtype every backend carries."""
    if flat.is_complex():
        return torch.view_as_real(flat)
    if flat.element_size() == 1 and flat.dtype not in (torch.uint8, torch.int8, torch.bool):
        return flat.view(torch.uint8)  # float8 and friends
    if flat.dtype in (torch.uint16, torch.uint32, torch.uint64, torch.int16):
        return flat.view(torch.uint8)
    return flat


def receive_space(buckets: Sequence[Bucket]) -> list[torch.Tensor]:
    """One fresh flat tensor per bucket: where a receiver takes the data before anything is written."""
    return [torch.empty(b.numel, dtype=b.dtype, device=b.device) for b in buckets]


def send_space(tensors: Sequence[torch.Tensor], buckets: Sequence[Bucket], cap: int | None = None
               ) -> dict[torch.device, torch.Tensor]:
    """The source's staging bytes per device: buckets that are one contiguous tensor are sent from the tensor
    itself; the others are packed into staging, reused once ``cap`` bytes are in flight."""
    cap = BUCKET_BYTES if cap is None else cap
    need: dict[torch.device, int] = {}
    total: dict[torch.device, int] = {}
    for b in buckets:
        if not _sent_in_place(tensors, b):
            need[b.device] = max(need.get(b.device, 0), _aligned(b.nbytes))
            total[b.device] = total.get(b.device, 0) + _aligned(b.nbytes)
    return {d: torch.empty(min(total[d], max(n, cap)), dtype=torch.uint8, device=d) for d, n in need.items()}


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to 64, so every bucket in the staging bytes starts aligned for its dtype."""
    return -(-nbytes // 64) * 64


def _sent_in_place(tensors: Sequence[torch.Tensor], b: Bucket) -> bool:
    t = tensors[b.indices[0]]
    return len(b.indices) == 1 and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def broadcast(g: Group, tensors: Sequence[torch.Tensor], buckets: Sequence[Bucket], src: int,
              space: Any, deadline: Deadline, what: str) -> None:
    """Broadcast the buckets from group rank ``src``. ``space`` is :func:`send_space` on the source (nothing is
    written to ``tensors`` there) and :func:`receive_space` elsewhere (filled; ``tensors`` untouched).

    Every rank issues every bucket's collective even after a local step failed (a packing error on the source,
    an exception from the call that issued a collective): peers never wait for a collective this rank skipped.
    The first such failure is raised once all collectives were waited for (it becomes this rank's vote); a
    failed or timed-out wait raises CollectiveError at once."""
    root = g.global_rank(src)
    works: list[Any] = []
    failure: BaseException | None = None

    def issue(flat: torch.Tensor) -> None:
        nonlocal failure
        try:
            works.append(dist.broadcast(wire_view(flat), src=root, group=g.pg, async_op=True))
        except BaseException as e:  # noqa: BLE001 - raised after the other buckets went out
            failure = failure or e

    if g.me != src:
        for flat in space:
            issue(flat)
    else:
        offsets = {d: 0 for d in space}
        for b in buckets:
            ts = [tensors[i] for i in b.indices]
            if _sent_in_place(tensors, b):
                flat = ts[0].detach().reshape(-1)
            else:
                staging = space[b.device]
                if offsets[b.device] + _aligned(b.nbytes) > staging.numel():  # staging full: let in-flight land
                    wait(works, deadline, what)
                    works, offsets = [], {d: 0 for d in space}
                start = offsets[b.device]
                flat = staging[start:start + b.nbytes].view(b.dtype)
                offsets[b.device] = start + _aligned(b.nbytes)
                try:
                    torch_compat.pack_into(flat, ts)
                except BaseException as e:  # noqa: BLE001 - the bucket still goes out; the vote aborts
                    failure = failure or e
            issue(flat)
    wait(works, deadline, what)
    if failure is not None:
        raise failure


def broadcast_flat(g: Group, flat: torch.Tensor, src: int, deadline: Deadline, what: str) -> None:
    """Broadcast one contiguous tensor from group rank ``src``: sent from it there, received into it elsewhere."""
    wait([dist.broadcast(wire_view(flat), src=g.global_rank(src), group=g.pg, async_op=True)], deadline, what)


def write(tensors: Sequence[torch.Tensor], buckets: Sequence[Bucket], space: Sequence[torch.Tensor]) -> None:
    """Copy received buckets into their tensors (no collective)."""
    for b, flat in zip(buckets, space):
        torch_compat.unflatten_into(flat, [tensors[i] for i in b.indices])
