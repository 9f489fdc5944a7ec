"""GatheredParametersAndBuffers: deepspeed.zero.GatheredParameters that also keeps module buffers right."""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _dist
from .broadcast import broadcast_buffers
from .errors import InvalidArgumentError, ZeroBuffersError
from .report import assert_buffers_in_sync

_DEPTH_ATTR = "_ds_z3_gathered_param_context_depth"  # deepspeed.runtime.zero.partition_parameters


def _split(target: Any) -> tuple[list[nn.Module], list[torch.Tensor]]:
    """Modules and loose parameters named by ``target`` (one or an iterable of either)."""
    if isinstance(target, (nn.Module, torch.Tensor)):
        items = [target]
    elif isinstance(target, Iterable) and not isinstance(target, (str, bytes)):
        items = list(target)
    else:
        raise InvalidArgumentError(f"GatheredParametersAndBuffers: expected a module, a parameter, or an iterable of "
                                   f"them, got {type(target).__name__} {target!r:.40}")
    modules, params = [], []
    for i, item in enumerate(items):
        if isinstance(item, nn.Module):
            modules.append(item)
        elif isinstance(item, torch.Tensor):
            params.append(item)
        else:
            raise InvalidArgumentError(f"GatheredParametersAndBuffers: item {i} is a {type(item).__name__}; expected "
                                       "modules, parameters, or an iterable of them")
    return modules, params


def _gathered_parameters(params: list[torch.Tensor], modifier_rank: int | None, fwd_module: Any) -> Any:
    """DeepSpeed's context for the ZeRO parameters not already gathered by an outer context (or None)."""
    zero = [p for p in params if hasattr(p, "ds_id") and getattr(p, _DEPTH_ATTR, 0) == 0]
    if not zero:
        return None
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    return GatheredParameters(zero, modifier_rank=modifier_rank, fwd_module=fwd_module)


def _discard_updates(ds_ctx: Any) -> None:
    """Make DeepSpeed's context exit like ``modifier_rank=None``: no broadcast; shards keep their pre-gather values.

    Compat wrapper around GatheredParameters' private ``src_rank`` (deepspeed 0.19); without it DeepSpeed commits.
    """
    if hasattr(ds_ctx, "src_rank"):
        ds_ctx.src_rank = None
        ds_ctx._param_versions = []  # skip the in-place-modification sanity check (it would raise)
    else:  # pragma: no cover - a DeepSpeed without the attribute
        warnings.warn("GatheredParametersAndBuffers: this DeepSpeed version's GatheredParameters cannot be told to "
                      "discard the body's updates; its parameters are broadcast from the modifier rank", stacklevel=3)


def _snapshot(box: nn.Module) -> list[tuple[dict, str, torch.Tensor, torch.Tensor]]:
    """(owner dict, key, tensor, copy) for every buffer and plain parameter: what a rollback restores."""
    out, seen = [], set()
    for mod in box.modules():
        for table in (mod._buffers, mod._parameters):
            for key, t in table.items():
                if t is None or id(t) in seen or hasattr(t, "ds_id"):
                    continue
                seen.add(id(t))
                out.append((table, key, t, t.detach().clone()))
    return out


class GatheredParametersAndBuffers:
    """A drop-in for ``deepspeed.zero.GatheredParameters`` that also handles the buffers of the modules given.

    ``target`` is what GatheredParameters accepts (a parameter, an iterable of parameters) and also a
    module or several. ZeRO parameters are gathered by DeepSpeed exactly as before (those an outer
    GatheredParameters already holds are left to it). For modules:

    * ``modifier_rank=r``: on exit, buffers and plain (non-ZeRO) parameters are broadcast from ``r``
      (a rank of ``group``, as in DeepSpeed) with one structure-checked coalesced sync, so DeepSpeed's
      loading pattern leaves every rank with the checkpoint's buffers.
    * ``modifier_rank=None``: on enter, buffers are checked to agree across ranks (one small collective)
      and :class:`BuffersOutOfSyncError` is raised on every rank naming them; ``check_buffers=False``
      opts out. Nothing is modified.

    All or nothing with ``modifier_rank=r``: if the body raised on any rank, or the buffer sync fails
    (structure mismatch, timeout), nothing is committed. ZeRO parameters are re-partitioned without
    DeepSpeed's broadcast (each shard keeps its value from before the context) and buffers and plain
    parameters are restored from a copy taken on enter, on every rank; every rank raises (the body's
    own exception where it raised, :class:`ZeroBuffersError` elsewhere). DeepSpeed's own context
    broadcasts whatever the modifier rank holds even then, leaving a half-loaded model. The copy
    costs the size of the modules' buffers and plain parameters (small under ZeRO-3, whose parameters
    need none); for a large plain (DDP) model pass ``snapshot=False``: a failure then still commits
    no ZeRO parameter and broadcasts nothing, but buffers and plain parameters stay as the body left
    them on each rank.

    Works without DeepSpeed and with plain (DDP) models: there is nothing to gather, buffers are still
    handled. DeepSpeed's context is always exited.

    Example::

        with GatheredParametersAndBuffers(model, modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                model.load_state_dict(torch.load("ckpt.pt"))
        # every rank now has the checkpoint's weights AND buffers
    """

    def __init__(self, target: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True, *, check_buffers: bool = True, atol: float = 0.0, group: Any = None,
                 timeout: _dist.Timeout = None, snapshot: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        _dist.check_rank_arg(modifier_rank, "modifier_rank", "GatheredParametersAndBuffers", optional=True)
        modules, loose = _split(target)
        params = loose + [p for m in modules for p in m.parameters()]
        self.modifier_rank = modifier_rank
        self.check_buffers, self.atol, self.group, self.snapshot = check_buffers, atol, group, snapshot
        self.timeout = _dist.check_timeout(timeout, "GatheredParametersAndBuffers")
        plain = [p for p in loose if not hasattr(p, "ds_id")]
        self._box = _dist.as_module(modules, plain) if modules or plain else None
        self._ds = _gathered_parameters(params, modifier_rank, fwd_module)
        self._saved: list[tuple[dict, str, torch.Tensor, torch.Tensor]] = []

    def _src(self) -> int:
        """``modifier_rank`` as a global rank."""
        if self.group is None or not dist.is_initialized():
            return self.modifier_rank
        return dist.get_global_rank(self.group, self.modifier_rank)

    def __enter__(self) -> GatheredParametersAndBuffers:
        if not self.enabled:
            return self
        if self._box is not None and self.modifier_rank is None and self.check_buffers:
            assert_buffers_in_sync(self._box, group=self.group, atol=self.atol, timeout=self.timeout)
        if self._box is not None and self.modifier_rank is not None and self.snapshot:
            with torch.no_grad():
                self._saved = _snapshot(self._box)
        if self._ds is not None:
            self._ds.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if not self.enabled:
            return False
        committed = self.modifier_rank is None
        try:
            if not committed:
                self._commit(failed=exc_type is not None)
                committed = True
        except ZeroBuffersError:
            if exc_type is None:
                raise  # else: the body's own exception is the one to see
        finally:
            try:
                if not committed:
                    self._roll_back()
            finally:
                self._saved = []
                if self._ds is not None:
                    self._ds.__exit__(exc_type, exc, tb)
        return False

    def _commit(self, failed: bool) -> None:
        """Unless some rank's body raised (then every rank raises), broadcast buffers and plain parameters."""
        g = _dist.resolve_group(self.group)
        if g is None:
            if failed:
                raise ZeroBuffersError("GatheredParametersAndBuffers: the body raised; nothing was committed")
            return
        _dist.require_body_succeeded(g, failed, self.timeout, "GatheredParametersAndBuffers",
                                     "nothing was committed: parameters and buffers are as before the context")
        if self._box is not None:
            broadcast_buffers(self._box, src=self._src(), group=self.group, include_parameters=True,
                              timeout=self.timeout)

    def _roll_back(self) -> None:
        """Discard the body's updates: DeepSpeed re-partitions without broadcasting; buffers get their copies back."""
        if self._ds is not None:
            _discard_updates(self._ds)
        with torch.no_grad():
            for table, key, t, saved in self._saved:
                table[key] = t
                t.copy_(saved)
