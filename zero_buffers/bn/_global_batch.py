"""Private: recompute passes in which every BatchNorm normalises by the batch of all ranks together (global_batch).

The ranks step in lockstep. Each step starts with one all-reduce, ``[failed per member] [has a batch]``: the
loop ends on every rank at once when some rank failed or no rank has a batch left. Ranks with a batch run
the forward; each BatchNorm call all-reduces one fixed-size float64 payload

    [present, index, index^2, done, n, sum x (C, padded to the widest layer), sum x^2 (padded)]

and normalises by the mean and (biased) variance of the step's global batch, as ``SyncBatchNorm`` would. At
the end of its forward a rank sends ``done``. Ranks without a batch (run out, or an empty shard) send zeros
until a round shows ``done`` or nobody present, so they join every per-layer all-reduce with nothing. Every
rank ends the step on the same round because it decides from the same all-reduced sums; ``index`` and
``index^2`` tell, on every rank alike, when the ranks called different layers (dynamic control flow).
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .._core import group as _group, modules as _modules, wire as _wire

_HEAD = 5  # present, index, index^2, done, n


class ScheduleMismatch(RuntimeError):
    """The ranks' forwards called different BatchNorm layers in the same round, or ended at different rounds."""


def _ended_apart() -> ScheduleMismatch:
    return ScheduleMismatch("the ranks' forwards ended after different numbers of BatchNorm calls "
                            "(data-dependent control flow is not supported with global_batch=True)")


class _StepOver(Exception):
    """This rank's forward was cut short: the round showed the step is over (raised inside the forward)."""


class Lockstep:
    """The protocol for one recompute: patched BatchNorm forwards and the per-step loop."""

    def __init__(self, g: _group.Group, layers: list[_modules.BatchNorm], deadline: _wire.Deadline, fn: str):
        self.g, self.layers, self.deadline, self.fn = g, layers, deadline, fn
        self.width = max(bn.mean.numel() for bn in layers)
        self.size = _HEAD + 2 * self.width

    def _reduce(self, payload: torch.Tensor) -> torch.Tensor:
        return _wire.all_reduce(self.g, payload.to(self.g.device, copy=True), self.deadline, self.fn).cpu()

    def _over(self, total: torch.Tensor) -> bool:
        """Whether this round ends the step: somebody finished its forward, or nobody is in one."""
        return float(total[3]) > 0 or float(total[0]) == 0

    def _layer_forward(self, i: int) -> Callable[..., torch.Tensor]:
        width, lockstep = self.width, self

        def forward(module: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
            c = x.shape[1]
            xd = x.detach().to(torch.float64)
            dims = [0, *range(2, x.dim())]
            payload = torch.zeros(lockstep.size, dtype=torch.float64)
            payload[:_HEAD] = torch.tensor([1.0, i + 1.0, (i + 1.0) ** 2, 0.0, float(x.numel() // max(c, 1))])
            payload[_HEAD:_HEAD + c] = xd.sum(dims).cpu()
            payload[_HEAD + width:_HEAD + width + c] = (xd * xd).sum(dims).cpu()
            total = lockstep._reduce(payload)
            if lockstep._over(total):
                raise _StepOver
            present, index, square = (float(v) for v in total[:3])
            if index * index != present * square:  # not every present rank called layer i
                raise ScheduleMismatch(f"BatchNorm layer {lockstep.layers[i].name!r}: the ranks' forwards called "
                                       "different BatchNorm layers at the same point (data-dependent control flow "
                                       "is not supported with global_batch=True)")
            n = float(total[4])
            mean = total[_HEAD:_HEAD + c] / n
            var = (total[_HEAD + width:_HEAD + width + c] / n - mean * mean).clamp_min(0)
            return F.batch_norm(x, mean.to(x.device, x.dtype), var.to(x.device, x.dtype), module.weight, module.bias,
                                False, 0.0, module.eps)
        return forward

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Every layer's forward replaced by the global-batch one, for the passes."""
        saved = []
        for i, bn in enumerate(self.layers):
            m = bn.module
            saved.append((m, m.__dict__.get("forward")))
            m.__dict__["forward"] = types.MethodType(self._layer_forward(i), m)
        try:
            yield
        finally:
            for m, old in saved:
                if old is None:
                    del m.__dict__["forward"]
                else:
                    m.__dict__["forward"] = old

    def vote(self, has_batch: bool, failed: bool) -> tuple[bool, bool]:
        """(some rank failed, some rank has a batch): one all-reduce at the start of every step."""
        flags = torch.zeros(self.g.size + 1, dtype=torch.float64)
        flags[self.g.me] = float(failed)
        flags[-1] = float(has_batch and not failed)
        total = self._reduce(flags)
        return bool(total[:-1].any()), float(total[-1]) > 0

    def step(self, run: Callable[[], None] | None) -> BaseException | None:
        """One step: ``run()`` (this rank's forward) or, without a batch, zeros until the step is over. Returns the
        exception this rank's forward raised, if any (the step still ends on the same round everywhere)."""
        failure: BaseException | None = None
        if run is not None:
            try:
                run()
            except _StepOver:
                return _ended_apart()
            except BaseException as e:  # noqa: BLE001 - reported at the next vote; the step must still end here
                failure = e
            else:
                done = torch.zeros(self.size, dtype=torch.float64)
                done[0], done[3] = 1.0, 1.0
                total = self._reduce(done)
                if float(total[3]) != float(total[0]):
                    return _ended_apart()
                return None
        idle = torch.zeros(self.size, dtype=torch.float64)
        while True:
            total = self._reduce(idle)
            if self._over(total):
                return failure
