"""The one transactional sync every tool uses: agree, prepare, exchange into scratch, vote, write.

[Note: the transaction]
Every public function that changes buffers runs through :func:`commit` (keep_in_sync's steady state keeps the same
phases in its own, leaner loop: [Note: steady state] in training/keep_in_sync.py). The phases, in order, and what each
guarantees (:class:`Phase`):

    PREPARE   each rank alone: checks its tensors can be sent and written (meta, non-strided, quantized, inference
              tensors; CPU tensors on nccl) and allocates what the exchange needs (receive space, staging). A
              failure here, or one the caller already knows of (a body that raised), is this rank's vote.
    AGREE     one all_gather of [structure digest, status, extra]: a structure mismatch raises BufferStructureError
              on every rank, a failed vote SyncAbortedError on every rank. No data has moved.
    EXCHANGE  the data collectives, into scratch only, and every value the writes will need computed into scratch
              (merged statistics, means, dtype conversions). Every rank issues every collective even after a local
              failure; any exception other than a failed collective (BaseException: KeyboardInterrupt too) is this
              rank's vote.
    RECEIVED  one all_gather of [failed]: any failure raises SyncAbortedError on every rank. Nothing was written.
    WRITE     copies from scratch into tensors whose dtype, shape, device and writability were agreed and checked
              before; nothing else runs here (no collective, no allocation of data, no user code).
    AFTER     only where a call has post-write steps that can fail (``after_sync`` hooks of registered rules): they
              run on every rank, one all_gather reports them, and any failure makes every rank put its buffers back
              as they were before the call and raise SyncAbortedError.

Every collective waits at most until the call's deadline. A peer that dies or stalls before RECEIVED raises
CollectiveError on the others with nothing written; one dying between RECEIVED and WRITE cannot stop the others
(they have all the data). WRITE is the one step that is not a vote: it only copies, so nothing but a device fault
can interrupt it.

[Note: rank convention] lives in group.py.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._compat import torch as torch_compat
from ..errors import CollectiveError, InvalidArgumentError, SyncAbortedError, UnsupportedDeviceError
from . import placement as _placement, structure as _structure, wire as _wire
from .group import Group
from .modules import Entry

Failure = BaseException | str | None
"""Why this rank cannot go on: an exception, a sentence, or None."""


class Phase(enum.Enum):
    """The phases of a transaction, in order ([Note: the transaction] says what each guarantees)."""

    PREPARE = "prepare"
    AGREE = "agree"
    EXCHANGE = "exchange"
    RECEIVED = "received"
    WRITE = "write"
    AFTER = "after"


def reached(phase: Phase, what: str) -> None:
    """Every transaction calls this at the start of each fallible phase's work (PREPARE, EXCHANGE, AFTER), inside the
    code whose failure that phase votes on. It does nothing; tests/core/test_rank_faults.py replaces it on one rank
    to raise there, which is how a failure on one rank is injected at every phase of every public function."""


def unsendable(g: Group, entries: Sequence[Entry], what: str) -> Exception | None:
    """The error for tensors no collective can carry or no write can change (meta, non-strided, inference, quantized;
    CPU tensors on nccl).
    It depends on dtype, device and layout only (an inference tensor's layout reads "inference" in its Spec), which
    structure agreement compares, so after agreeing every rank finds the same one."""
    distributed = [n for n, t in entries if torch_compat.is_dtensor(t)]
    if distributed:
        return InvalidArgumentError(
            f"{what}(): {len(distributed)} buffer(s) are DTensors, e.g. '{distributed[0]}', which this function does "
            "not take (broadcast_buffers, buffer_report, sync_buffers and keep_in_sync sync them by placement: "
            "docs/mesh.md). Pass ignore=(name,), or register buffer.full_tensor() / buffer.to_local()")
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
    frozen = [n for n, t in entries if t.is_inference() and not torch.is_inference_mode_enabled()]
    if frozen:
        return InvalidArgumentError(
            f"{what}(): {len(frozen)} tensor(s) are inference tensors (made under torch.inference_mode()), e.g. "
            f"'{frozen[0]}', which cannot be written outside it; clone them (t.clone()) into the module first")
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
    failed = tuple(r for r, s in zip(g.ranks, statuses) if s)  # errors name global ranks ([Note: rank convention])
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
           compute: Callable[[Any], None] | None = None, failure: Failure = None,
           unchanged: str = "nothing was changed", step: str = "a rank could not take part", digest: int | None = None,
           extra: int = 0, after: Sequence[Callable[[], None]] = (), keep: Sequence[torch.Tensor] = (),
           undo: Callable[[], None] | None = None) -> list[int]:
    """Run the phases ([Note: the transaction]) over ``entries``: ``prepare()`` allocates (PREPARE), ``exchange(space)``
    issues every collective (even after a local failure, as :func:`_wire.broadcast` does) and ``compute(space)``
    computes what will be written (EXCHANGE), ``apply(space)`` copies (WRITE), each of ``after`` runs then (AFTER; on
    failure anywhere, every rank puts back ``entries`` and ``keep``, what the hooks may change, calls ``undo`` for
    what WRITE changed besides values (placements), and raises).
    ``failure`` aborts on every rank after the structure check, with ``step`` saying what failed. ``extra`` rides
    along the first collective; returns every member's."""
    problem = unsendable(g, entries, what)
    space = None
    if failure is None and problem is None:
        try:
            reached(Phase.PREPARE, what)
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
    if failure is None:
        try:
            reached(Phase.EXCHANGE, what)
            if compute is not None:
                compute(space)
        except BaseException as e:  # noqa: BLE001 - a vote
            failure = e
    vote(g, failure, deadline, what, "receiving failed", unchanged)
    if after:
        saved = snapshot([t for _, t in entries] + list(keep))  # only where a post-write step can fail
        apply(space)

        def restore() -> None:
            saved()
            if undo is not None:
                undo()
        run_after(g, after, deadline, what, restore)
    else:
        apply(space)
    return [e for _, e in votes]


def vote(g: Group, failure: Failure, deadline: _wire.Deadline, what: str, step: str, unchanged: str,
         error: type[SyncAbortedError] = SyncAbortedError) -> None:
    """One all_gather of [failed]: if any member failed, every rank raises the same ``error`` (see abort_if_any)."""
    statuses = [v[0] for v in _wire.all_gather_values(g, [int(failure is not None)], deadline, what)]
    abort_if_any(g, statuses, failure, deadline, what, step, unchanged, error)


def snapshot(tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    """Copies of ``tensors`` (each once), and the callable that puts them back."""
    unique = list({id(t): t for t in tensors}.values())
    copies = [t.detach().clone() for t in unique]

    def restore() -> None:
        torch_compat.copy_all([t.data for t in unique], copies)
    return restore


def run_after(g: Group, steps: Sequence[Callable[[], None]], deadline: _wire.Deadline, what: str,
              restore: Callable[[], None]) -> None:
    """The AFTER phase: run ``steps`` here, learn with one all_gather whether every rank's ran; if any failed, every
    rank calls ``restore()`` (its buffers as before the call) and raises the same SyncAbortedError."""
    failure: BaseException | None = None
    try:
        reached(Phase.AFTER, what)
        for run in steps:
            run()
    except BaseException as e:  # noqa: BLE001 - reported to every rank below
        failure = e
    statuses = [v[0] for v in _wire.all_gather_values(g, [int(failure is not None)], deadline, what)]
    if any(statuses):
        restore()
    abort_if_any(g, statuses, failure, deadline, what, "an after_sync hook failed",
                 "every rank's buffers were put back as they were before the call")


def broadcast(g: Group, entries: Sequence[Entry], src: int, call: tuple, deadline: _wire.Deadline, what: str, *,
              failure: Failure = None, unchanged: str = "nothing was changed",
              step: str = "a rank could not take part", placed: _placement.Placed | None = None) -> int:
    """Every rank's ``entries`` take group rank ``src``'s values, all or nothing; returns how many. ``placed``: the
    entries over a mesh ([Note: placements]): each from ``src``'s coordinate over the dimensions it is replicated on
    (never along a Partial or Shard dimension)."""
    if placed is not None:
        return _placed_broadcast(placed, src, call, deadline, what, failure=failure, unchanged=unchanged, step=step)
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


def _placed_broadcast(placed: _placement.Placed, src: int, call: tuple, deadline: _wire.Deadline, what: str, *,
                      failure: Failure, unchanged: str, step: str) -> int:
    """:func:`broadcast` over a mesh: one bucket plan per class of replicated dimensions, each broadcast in its own
    group from ``src``'s coordinate there; the votes over the whole group ([Note: placements]: a broadcast copies,
    so Partial dimensions, whose summands it would change the value of, are left as they are)."""
    g, entries = placed.g, placed.entries
    call = ("broadcast", src, *call, "placements", placed.signature)
    sends = [(sub, [entries[i][1] for i in idx]) for sub, idx in placed.classes(range(len(entries)))
             if sub is not None]
    plans = [(sub, ts, _placement.source_in(g, sub, src), _wire.plan(ts)) for sub, ts in sends]

    def prepare() -> Any:
        return [_wire.send_space(ts, bs) if sub.me == s else _wire.receive_space(bs) for sub, ts, s, bs in plans]

    def exchange(spaces: Any) -> None:
        for (sub, ts, s, bs), space in zip(plans, spaces):
            _wire.broadcast(sub, ts, bs, s, space, deadline, what)

    def apply(spaces: Any) -> None:
        for (sub, ts, s, bs), space in zip(plans, spaces):
            if sub.me != s:
                _wire.write(ts, bs, space)

    commit(g, call, entries, deadline, what, prepare=prepare, exchange=exchange, apply=apply, failure=failure,
           unchanged=unchanged, step=step)
    return len(entries)
