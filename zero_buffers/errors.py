"""Exceptions raised by zero_buffers: one root class, a subclass wherever a caller must tell errors apart."""
from __future__ import annotations

from typing import Any


class ZeroBuffersError(RuntimeError):
    """Root of every error zero_buffers raises on purpose."""


class ZeroBuffersWarning(UserWarning):
    """A call did what was asked but probably not what was meant (a no-op in one process, an average of identical
    statistics, a save the hooks cannot cover). Filter with ``warnings.filterwarnings("ignore",
    category=zero_buffers.ZeroBuffersWarning)``."""


class InvalidArgumentError(ZeroBuffersError, TypeError):
    """An argument has the wrong type or value (not a module, a bad ``src``, a meta tensor ...)."""


class InvalidSourceRankError(InvalidArgumentError, ValueError):
    """A rank argument (``src``, ``modifier_rank``) is not a rank of the process group. Raised before any collective."""


class DistributedSetupError(ZeroBuffersError):
    """torch.distributed is not usable as the call needs (e.g. WORLD_SIZE > 1 but no process group)."""


class UnsupportedDeviceError(ZeroBuffersError):
    """A tensor lives on a device the process group's backend cannot carry (CPU tensors on nccl)."""


class BufferStructureError(ZeroBuffersError):
    """Ranks disagree on which buffers exist, their order, shapes, dtypes or devices.

    Raised identically on every rank before any data moves; no buffer is modified.
    ``name`` is the first differing buffer (or ``None`` when the call arguments differ) and
    ``details`` maps each global rank to its description of that buffer.
    """

    def __init__(self, message: str, name: str | None = None, details: dict[int, str] | None = None):
        super().__init__(message)
        self.name = name
        self.details = details or {}


class BuffersOutOfSyncError(ZeroBuffersError):
    """Buffers hold different values on different ranks. ``report`` is the full :class:`BufferReport`."""

    def __init__(self, message: str, report: Any = None):
        super().__init__(message)
        self.report = report


class CollectiveError(ZeroBuffersError):
    """A collective failed or timed out (a peer died or stalled). Buffers were left unchanged."""


class SyncAbortedError(ZeroBuffersError):
    """A step failed on some ranks; every rank of the group raised this and nothing was changed.

    ``ranks`` are the global ranks where the step failed and ``reasons`` maps each to its message.
    On a failing rank the original exception is chained (``__cause__``).
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = (), reasons: dict[int, str] | None = None):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.reasons = dict(reasons or {})


class RecomputeError(SyncAbortedError):
    """A rank's data or forward pass failed inside :func:`recompute_bn_stats`; raised identically on every rank.

    ``ranks`` lists the global ranks that failed; on those ranks the original exception is chained
    (``__cause__``). Every buffer, train/eval mode and momentum was restored to its state before the call.
    """


class DependencyError(ZeroBuffersError):
    """An optional dependency a feature needs is missing, or its installed version lacks what we rely on.

    ``package`` names it and ``version`` is the installed version (``None`` when it is not installed).
    """

    def __init__(self, message: str, package: str = "", version: str | None = None):
        super().__init__(message)
        self.package = package
        self.version = version


class DeepSpeedUnavailableError(DependencyError):
    """A ZeRO-3 feature was asked for but DeepSpeed cannot be imported."""


class CheckpointError(ZeroBuffersError):
    """A checkpoint on disk cannot be read, compared or repaired as asked. ``path`` names the file or folder at fault.

    Raised before anything is written, or after a failed write has been rolled back: the input is unchanged
    and no partial output is left behind.
    """

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path
