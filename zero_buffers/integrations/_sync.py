"""What both trainer callbacks take and do: a sync by policy / rules, at most once per global step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._core import args as _args, modules as _modules
from ..errors import InvalidArgumentError
from ..training.keep_in_sync import KeepInSync, hookless
from ..training.rules import Rules
from ..training.save_hooks import _check_policy, sync_buffers


@dataclass
class StepSync:
    """The callback's arguments, checked at construction; ``sync(model, step)`` counts and remembers the step."""

    policy: str | None
    rules: Rules | None
    strict: bool
    every_step: bool
    src: int
    timeout: _args.Timeout
    syncs: int = 0
    synced_at: int | None = None
    handle: KeepInSync | None = None

    @classmethod
    def checked(cls, fn: str, policy: str | None, rules: Rules | None, strict: bool, every_step: bool, src: int,
                timeout: _args.Timeout) -> StepSync:
        _check_policy(policy, None, fn, rules=rules)
        if policy == "recompute":
            raise InvalidArgumentError(f"{fn}(): policy 'recompute' needs each rank's data; call "
                                       "zero_buffers.sync_buffers(model, 'recompute', data=...) yourself")
        _args.timeout(timeout, fn)
        return cls(policy, rules, _args.flag(strict, "strict", fn), _args.flag(every_step, "every_step", fn),
                   _args.rank(src, "src", fn), timeout)

    def due(self, step: int) -> bool:
        """Whether ``step`` was not synced yet (every rank decides alike: the step counts are the same)."""
        return self.synced_at != step

    def sync(self, model: Any, step: int) -> None:
        """Sync now. Syncs repeat (every save, every step), so they go through a :func:`keep_in_sync` handle without
        its hook: counters and "sum" buffers add what the ranks added since the last sync, never compound."""
        if self.policy == "check":
            sync_buffers(model, "check", src=self.src, timeout=self.timeout)
        else:
            if self.handle is None or self.handle.module is not _modules.unwrap(model, "BufferSyncCallback"):
                self.begin(model, from_zero=True)  # not begun with training: the first sync merges whole values
            assert self.handle is not None
            self.handle.sync()
        self.syncs += 1
        self.synced_at = step

    def begin(self, model: Any, from_zero: bool = False) -> None:
        """At the start of training: what the ranks add from now on is what the syncs count."""
        if self.policy == "check" or model is None:
            return
        self.handle = hookless(model, self.policy, "zero" if from_zero else "installed", rules=self.rules,
                               src=self.src, timeout=self.timeout, strict=self.strict)


class SyncCallback:
    """The constructor and counter both trainer callbacks share (each also derives from its framework's class)."""

    NAME = "BufferSyncCallback"

    def __init__(self, policy: str | None = "average", *, rules: Rules | None = None, strict: bool = False,
                 every_step: bool = False, src: int = 0, timeout: _args.Timeout = None):
        self.options = StepSync.checked(self.NAME, policy, rules, strict, every_step, src, timeout)

    @property
    def syncs(self) -> int:
        """How many syncs this callback ran."""
        return self.options.syncs
