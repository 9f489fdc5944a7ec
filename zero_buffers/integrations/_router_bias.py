"""What both trainer callbacks' ``RouterBiasCallback`` do: a :func:`zero_buffers.router_bias` handle made when
training starts, stepped once per optimizer step (the trainers' global step), removed when training ends."""
from __future__ import annotations

from typing import Any

from .._core import args as _args
from ..errors import InvalidArgumentError
from ..moe.router_bias import RouterBias, check, router_bias


class RouterBiasSteps:
    """The callback's arguments, checked at construction, and its handle."""

    NAME = "RouterBiasCallback"

    def __init__(self, *, gamma: float = 1e-3, rule: str = "sign", every: int = 1, src: int = 0, group: Any = None,
                 timeout: _args.Timeout = None):
        check(self.NAME, gamma, rule, every, src, timeout)
        self.options = dict(gamma=gamma, rule=rule, every=every, src=src, group=group, timeout=timeout)
        self.handle: RouterBias | None = None
        self.stepped_at: int | None = None
        self._last_updates = 0  # the updates of the last handle, once end() removed it

    def begin(self, model: Any) -> None:
        if model is None:
            raise InvalidArgumentError(f"{self.NAME}: the trainer passed no model to its callbacks")
        self.end()
        self.handle = router_bias(model, **self.options)

    def after_step(self, step: int) -> None:
        """The optimizer stepped to global step ``step``: update once per step (every rank alike)."""
        if self.handle is not None and step != self.stepped_at:
            self.stepped_at = step
            self.handle.step()

    def end(self) -> None:
        if self.handle is not None:
            self._last_updates = self.handle.updates
            self.handle.remove()
            self.handle = None

    @property
    def updates(self) -> int:
        """Bias updates run by this callback's current (or last) handle."""
        return self.handle.updates if self.handle is not None else self._last_updates
