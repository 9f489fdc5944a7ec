"""Private: the library's warnings (:class:`~zero_buffers.errors.ZeroBuffersWarning`), some once per process."""
from __future__ import annotations

import warnings

from ..errors import ZeroBuffersWarning

_SEEN: set[str] = set()


def warn(message: str, once: str | None = None, stacklevel: int = 3) -> None:
    """Warn ``message``; with ``once``, only the first time this process meets that key."""
    if once is not None:
        if once in _SEEN:
            return
        _SEEN.add(once)
    warnings.warn(message, ZeroBuffersWarning, stacklevel=stacklevel)


def single_process(fn: str) -> None:
    """A sync called with no process group (one process): a no-op that deserves a word, once."""
    warn(f"{fn}() ran without a torch.distributed process group (a single process), so there was nothing to "
         "sync and it returned 0. To check or repair the buffers of a checkpoint written by several ranks, use "
         "`zero-buffers inspect | diff | repair` on the training checkpoint.", once=fn, stacklevel=4)
