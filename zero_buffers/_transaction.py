"""The one transactional sync every tool uses: agree, prepare, exchange into scratch, vote, write.

    1. Each rank checks its tensors can be sent and allocates what the exchange needs (receive space,
       staging); a failure there, or one the caller already knows of (a body that raised), is a vote.
    2. One all_gather of [structure digest, status, extra]: a structure mismatch raises
       BufferStructureError everywhere; a failed vote raises SyncAbortedError everywhere. No data has
       moved and nothing has been allocated on a rank that failed, so no rank waits on another.
    3. The data collectives, into scratch only. Any exception other than a failed collective is caught
       (BaseException, so KeyboardInterrupt too) and becomes this rank's vote.
    4. One all_gather of the "received OK" votes; any failure raises SyncAbortedError everywhere.
    5. Writes, with no further collective.

Every collective waits at most until the call's deadline. A peer that dies or stalls in step 3 or 4
raises CollectiveError on the others with nothing written; a peer dying between 4 and 5 cannot stop
the others (they have all the data). Nothing can make step 5 itself atomic across ranks; it only
copies into tensors whose dtype, shape and device were agreed in step 2.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _structure, _wire
from ._compat import torch as torch_compat
from ._group import Group
from ._modules import Entry
from .errors import CollectiveError, InvalidArgumentError, SyncAbortedError, UnsupportedDeviceError

Failure = BaseException | str | None
"""Why this rank cannot go on: an exception, a sentence, or None."""


def unsendable(g: Group, entries: Sequence[Entry], what: str) -> Exception | None:
    """The error for tensors no collective can carry (meta, non-strided, quantized; CPU tensors on nccl).
    It depends on dtype, device and layout only, which structure agreement compares, so after agreeing
    every rank finds the same one."""
    distributed = [n for n, t in entries if torch_compat.is_dtensor(t)]
    if distributed:
        return InvalidArgumentError(
            f"{what}(): {len(distributed)} buffer(s) are DTensors, e.g. '{distributed[0]}': their placements say how "
            "they are laid out over a mesh, and zero_buffers syncs replicated plain tensors only. Pass "
            "ignore=(name,), or register buffer.full_tensor() / buffer.to_local()")
    meta = [n for n, t in entries if t.is_meta]
    if meta:
        return InvalidArgumentError(
            f"{what}(): {len(meta)} tensor(s) are on the meta device and hold no data, e.g. '{meta[0]}'. "
            "Materialise the module (to_empty + load, or build it outside a meta-device context) first; "
            "broadcast_buffers(module, src, materialize=True) allocates them on the receivers")
    odd = [(n, t.layout) for n, t in entries if t.layout != torch.strided]
    if odd:
        return InvalidArgumentError(
            f"{what}(): {len(odd)} tensor(s) have a {str(odd[0][1]).replace('torch.', '')} layout, e.g. "
            f"'{odd[0][0]}'; only dense (strided) tensors are supported: register t.to_dense() or pass "
            "ignore=(name,)")
    quant = [n for n, t in entries if t.is_quantized]
    if quant:
        return InvalidArgumentError(
            f"{what}(): {len(quant)} quantized tensor(s), e.g. '{quant[0]}', cannot be sent by torch.distributed; "
            "pass ignore=(name,) or register the dequantized / int_repr() tensors")
    if g.backend == "nccl":
        cpu = [n for n, t in entries if t.device.type != "cuda"]
        if cpu:
            return UnsupportedDeviceError(
                f"{what}(): the process group's backend is nccl, which carries CUDA tensors only, but {len(cpu)} "
                f"tensor(s) are not on CUDA, e.g. '{cpu[0]}'. Move the module to the GPU or pass a gloo group "
                "(torch.distributed.new_group(backend='gloo'))")
    return None


def _text(failure: Failure) -> str:
    if isinstance(failure, BaseException):
        return f"{type(failure).__name__}: {failure}".strip()[:500]
    return str(failure)


def abort_if_any(g: Group, statuses: Sequence[int], failure: Failure, deadline: _wire.Deadline, what: str,
                 step: str, unchanged: str, error: type[SyncAbortedError] = SyncAbortedError) -> None:
    """If any member's status is non-zero, raise the same ``error`` on every rank (reasons included, gathered
    under the deadline), chained to this rank's own exception. ``step`` names what failed."""
    failed = tuple(r for r, s in zip(g.ranks, statuses) if s)
    if not failed:
        return
    try:  # a courtesy: a peer dying here leaves the reasons out, not the error
        texts = _wire.gather_objects(g, _text(failure) if failure is not None else None, deadline, what)
    except CollectiveError:
        texts = [None] * g.size
    reasons = {r: t for r, t in zip(g.ranks, texts) if r in failed and t}
    detail = "; ".join(f"rank {r}: {t}" for r, t in reasons.items())
    who = ("rank " if len(failed) == 1 else "ranks ") + ", ".join(map(str, failed))
    err = error(f"{what}: {step} on {who} ({detail or 'no message'}); {unchanged}", failed, reasons)
    raise err from failure if isinstance(failure, BaseException) else None


def commit(g: Group, call: tuple, entries: Sequence[Entry], deadline: _wire.Deadline, what: str, *,
           prepare: Callable[[], Any], exchange: Callable[[Any], None], apply: Callable[[Any], None],
           failure: Failure = None, unchanged: str = "nothing was changed",
           step: str = "a rank could not take part", digest: int | None = None, extra: int = 0) -> list[int]:
    """Run steps 1-5 (module docstring) over ``entries``: ``prepare()`` allocates, ``exchange(space)`` issues
    the collectives, ``apply(space)`` writes. ``failure`` aborts on every rank after the structure check, with
    ``step`` saying what failed. ``extra`` rides along the first collective; returns every member's."""
    problem = unsendable(g, entries, what)
    space = None
    if failure is None and problem is None:
        try:
            space = prepare()
        except BaseException as e:  # noqa: BLE001 - a vote; re-raised on every rank below
            failure = e
    votes = _structure.agree(g, call, entries, deadline, what, status=int(failure is not None), known=digest,
                             extra=extra)
    if problem is not None:
        raise problem
    abort_if_any(g, [s for s, _ in votes], failure, deadline, what, step, unchanged)
    try:
        exchange(space)
    except CollectiveError:
        raise
    except BaseException as e:  # noqa: BLE001 - a vote
        failure = e
    received = [v[0] for v in _wire.all_gather_values(g, [int(failure is not None)], deadline, what)]
    abort_if_any(g, received, failure, deadline, what, "receiving failed", unchanged)
    apply(space)
    return [e for _, e in votes]


def broadcast(g: Group, entries: Sequence[Entry], src: int, call: tuple, deadline: _wire.Deadline, what: str, *,
              failure: Failure = None, unchanged: str = "nothing was changed",
              step: str = "a rank could not take part") -> int:
    """Every rank's ``entries`` take group rank ``src``'s values, all or nothing; returns how many."""
    tensors = [t for _, t in entries]
    call = ("broadcast", src, *call)
    digest, buckets = _structure.digest_and_plan(call, entries)
    source = g.me == src

    def prepare() -> Any:
        return _wire.send_space(tensors, buckets) if source else _wire.receive_space(buckets)

    def exchange(space: Any) -> None:
        _wire.broadcast(g, tensors, buckets, src, space, deadline, what)

    def apply(space: Any) -> None:
        if not source:
            _wire.write(tensors, buckets, space)

    commit(g, call, entries, deadline, what, prepare=prepare, exchange=exchange, apply=apply, failure=failure,
           unchanged=unchanged, step=step, digest=digest)
    return len(entries)
