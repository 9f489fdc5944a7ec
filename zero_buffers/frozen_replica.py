"""frozen_replica: turn a (possibly ZeRO-partitioned) frozen module into a plain, identical replica on every rank."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from . import _args, _group
from ._compat import deepspeed as ds_compat
from .broadcast import broadcast_buffers

_FROZEN_TYPES: dict[type, type] = {}


def _frozen_type(cls: type) -> type:
    """A subclass of ``cls`` whose forward runs under no_grad and which stays in eval mode."""
    if getattr(cls, "_zb_frozen", False):
        return cls
    if cls not in _FROZEN_TYPES:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            with torch.no_grad():
                return cls.forward(self, *args, **kwargs)

        def train(self: nn.Module, mode: bool = True) -> nn.Module:
            return cls.train(self, False)  # frozen: BatchNorm must never update its statistics

        _FROZEN_TYPES[cls] = type(f"Frozen{cls.__name__}", (cls,), {
            "forward": forward, "train": train, "_zb_frozen": True, "__module__": cls.__module__,
            "__doc__": f"{cls.__name__} frozen by zero_buffers.frozen_replica: weights held as buffers, "
                       "forward under no_grad, always in eval mode."})
    return _FROZEN_TYPES[cls]


def _params_to_buffers(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Replace every parameter by a full, plain, persistent buffer of the same name (ZeRO ones gathered once)."""
    owners = [(m, name, p) for m in module.modules() for name, p in m._parameters.items() if p is not None]
    unique = list({id(p): p for _, _, p in owners}.values())
    zero = [p for p in unique if ds_compat.is_zero_param(p)]
    gather = ds_compat.Gather(zero) if zero else nullcontext()
    with gather:
        full = {id(p): p.detach().clone() for p in unique}  # tied weights stay tied
    for m in {id(m): m for m, _, _ in owners}.values():
        converted = {name: full[id(p)] for name, p in m._parameters.items() if p is not None}
        rest = dict(m._buffers)
        m._buffers.clear()
        m._buffers.update({**converted, **rest})  # weights first: state_dict keeps its key order
        for name in converted:
            del m._parameters[name]
            m._non_persistent_buffers_set.discard(name)
    return owners


def _undo(module: nn.Module, cls: type, owners: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    """Put the original parameters and class back after a failed frozen_replica."""
    for m, name, p in owners:
        del m._buffers[name]
        m._parameters[name] = p
    module.__class__ = cls


def frozen_replica(module: nn.Module, *, src: int = 0, group: Any = None, timeout: _args.Timeout = None) -> nn.Module:
    """Turn ``module`` (in place) into a frozen, plain replica that is identical on every rank; return it.

    * ZeRO-3 partitioned parameters are gathered once and the ZeRO state dropped; every parameter
      becomes a persistent buffer of the same name, so ``state_dict`` keys are unchanged and
      ``deepspeed.initialize`` (which partitions any parameter it finds) leaves it alone.
    * All weights and buffers take rank ``src``'s values (one structure-checked coalesced broadcast).
    * ``requires_grad`` is False for everything (buffers never require grad), forward runs under
      ``no_grad`` with no all-gather, and the module stays in eval mode even when a parent calls
      ``.train()`` (so BatchNorm statistics never drift).

    Calling it again on a replica only re-broadcasts from ``src``. Note: an engine that casts the whole
    model (fp16/bf16 ``.half()``) casts these buffers too, as it would cast frozen parameters.

    Example::

        with deepspeed.zero.Init(config_dict_or_path=cfg):
            tokenizer = VideoTokenizer()               # partitioned: all-gather on every forward
        tokenizer.load_state_dict(sd)                   # on rank 0 only, say
        tokenizer = zero_buffers.frozen_replica(tokenizer)   # full, identical, no_grad, no all-gather
    """
    _args.module(module, "frozen_replica")
    _args.timeout(timeout, "frozen_replica")
    src = _args.rank(src, "src", "frozen_replica")
    _group.check_src(_group.resolve(group, "frozen_replica"), src, "frozen_replica")
    cls = type(module)
    owners = _params_to_buffers(module)
    module.__class__ = _frozen_type(cls)
    try:
        broadcast_buffers(module, src=src, group=group, timeout=timeout)
    except BaseException:
        _undo(module, cls, owners)  # a failed call leaves the module as it was
        raise
    module.train(False)
    return module
