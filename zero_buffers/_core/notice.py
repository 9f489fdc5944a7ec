"""Private: what the library itself writes on stderr: its warnings (:class:`~zero_buffers.errors.ZeroBuffersWarning`),
once per job and some once per process, and its progress reports.

Warnings. Every rank of a group usually meets the same condition (the same model, the same rules, the same agreed
verdict), so a warning emitted wherever it arises would print once per rank: 64 copies in a 64-rank log. :func:`warn`
emits on the group's first rank only (group rank 0 of the call's group; of the default group when the call names
none; always when no process group is initialised). It decides from this process's own rank number and never
communicates, so it adds no collective and cannot hang. ``here=True`` is for what only this process knows or did
(a call that is not collective, a failure of this rank's own): emitted where it arises. ``once`` keeps the
once-per-process dedup; a key is only spent by a process that emitted it.

Progress. :func:`bar` and :func:`iterate` draw a tqdm bar when stderr is a terminal. Anywhere else (a log file, a
pipe, a notebook, a job scheduler's capture) they never write a carriage return: a plain line at most every
:data:`LINE_SECONDS` seconds and one final line, whatever ``progress=`` the caller passed. Whether to report at all
is the caller's decision (``_core/args.py``: ``progress``: ``None``, every function's default, reports only on a
terminal, so a log gets nothing unless ``progress=True`` asks for it).
"""
from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from ..errors import ZeroBuffersWarning
from . import group as _group

_SEEN: set[str] = set()

LINE_SECONDS = 10.0
"""Off a terminal, a progress report writes one line at most this often (and one line at the end)."""


def first_rank(group: Any = None) -> bool:
    """Whether this process is the first rank of ``group`` (a resolved :class:`~zero_buffers._core.group.Group`, a
    ProcessGroup, a DeviceMesh or ``(mesh, dim)``, or None for the default group); True without a process group.
    Local: it reads this process's rank, no collective."""
    if isinstance(group, _group.Group):
        return group.me == 0
    if not _group.initialized():
        return True
    import torch.distributed as dist

    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return False
    try:
        pg = _group._from_mesh(group, "warn")
        return bool(dist.get_rank(pg) == 0) if pg is not None else dist.get_rank() == 0
    except Exception:  # noqa: BLE001 - a group that cannot be read: say it here rather than nowhere
        return True


def warn(message: str, once: str | None = None, stacklevel: int = 3, *, group: Any = None, here: bool = False,
         category: type[Warning] = ZeroBuffersWarning) -> None:
    """Warn ``message`` on the first rank of ``group`` (see :func:`first_rank`), or on this process with
    ``here=True``; with ``once``, only the first time this process emits that key. Never communicates."""
    if not here and not first_rank(group):
        return
    if once is not None:
        if once in _SEEN:
            return
        _SEEN.add(once)
    warnings.warn(message, category, stacklevel=stacklevel)


def single_process(fn: str) -> None:
    """A sync called with no process group (one process): a no-op that deserves a word, once."""
    warn(f"{fn}() ran without a torch.distributed process group (a single process), so there was nothing to "
         "sync and it returned 0. To check or repair the buffers of a checkpoint written by several ranks, use "
         "`zero-buffers inspect | diff | repair` on the training checkpoint.", once=fn, stacklevel=4)


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` (a file object, possibly None) is a terminal."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed file
        return False


class Lines:
    """A progress report for logs: ``what: 120/500 batches (24%), 10 s`` at most every :data:`LINE_SECONDS` seconds,
    then ``what: 500 batches in 41.3 s`` (or ``stopped after ...``) at :meth:`close`. Never a carriage return."""

    def __init__(self, what: str, total: int | None, unit: str, stream: TextIO, every: float | None = None):
        self.what, self.total, self.unit, self.stream = what, total, unit, stream
        self.every = LINE_SECONDS if every is None else every
        self.n = 0
        self.start = self.last = time.monotonic()
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            of = f"/{self.total}" if self.total is not None else ""
            pct = f" ({100 * self.n // self.total}%)" if self.total else ""
            self._write(f"{self.what}: {self.n}{of} {self._units(self.n if self.total is None else self.total)}{pct}, "
                        f"{now - self.start:.0f} s")

    def close(self, ok: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        seconds = time.monotonic() - self.start
        if ok:
            self._write(f"{self.what}: {self.n} {self._units(self.n)} in {seconds:.1f} s")
        else:
            self._write(f"{self.what}: stopped after {self.n} {self._units(self.n)} ({seconds:.1f} s)")

    def _units(self, count: int) -> str:
        if count == 1:
            return self.unit
        return self.unit + ("es" if self.unit.endswith(("ch", "sh", "s", "x")) else "s")

    def _write(self, line: str) -> None:
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr never fails the work it reports on
            pass


@contextlib.contextmanager
def bar(what: str, total: int | None, unit: str, show: bool) -> Iterator[Any]:
    """A progress report on stderr when ``show`` (an object with ``update(n)``), else None: tqdm on a terminal,
    :class:`Lines` anywhere else."""
    stream = sys.stderr
    if not show or stream is None:
        yield None
        return
    if is_terminal(stream):
        from tqdm import tqdm

        drawn = tqdm(total=total, desc=what, unit=unit, leave=False, file=stream)
        try:
            yield drawn
        finally:
            drawn.close()
        return
    lines = Lines(what, total, unit, stream)
    ok = False
    try:
        yield lines
        ok = True
    finally:
        lines.close(ok)


def iterate(items: Iterable[Any], what: str, unit: str, show: bool) -> Iterator[Any]:
    """``items``, reported on as :func:`bar` does."""
    try:
        total: int | None = len(items)  # type: ignore[arg-type]
    except TypeError:
        total = None
    with bar(what, total, unit, show) as report:
        for item in items:
            yield item
            if report is not None:
                report.update(1)
