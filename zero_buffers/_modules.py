"""Module traversal: unwrap engines and wrappers, list buffers by qualified name, find tracking BatchNorms."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ._compat import deepspeed as ds_compat
from ._compat.torch import FSDP_CLASSES
from .errors import InvalidArgumentError

Entry = tuple[str, torch.Tensor]
"""A tensor a call synchronises, by the qualified name that identifies it on every rank."""

_PASS_THROUGH = frozenset({"DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "PipelineEngine"})


def unwrap(module: nn.Module, fn: str) -> nn.Module:
    """The module that holds the layers: strips DDP, DataParallel, DeepSpeed engines and torch.compile wrappers."""
    while True:
        names = {c.__name__ for c in type(module).__mro__}
        if names & FSDP_CLASSES:
            raise InvalidArgumentError(
                f"{fn}(): FSDP-sharded modules are not supported (their forward and state_dict gather parameters "
                "across ranks); use DDP, DeepSpeed or a plain module")
        inner = getattr(module, "module", None) if names & _PASS_THROUGH else \
            getattr(module, "_orig_mod", None) if "OptimizedModule" in names else None
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def _ignored(name: str, skip: frozenset[str]) -> bool:
    """True when ``name`` or one of its module prefixes is in ``skip``."""
    if name in skip:
        return True
    parts = name.split(".")
    return any(".".join(parts[:i]) in skip for i in range(1, len(parts)))


def named_buffers(module: nn.Module, *, ignore: Iterable[str] = (), include_parameters: bool = False) -> list[Entry]:
    """Buffers (then plain, non-ZeRO parameters if asked) by qualified name; None buffers and aliases skipped."""
    skip = frozenset(ignore)
    out: list[Entry] = []
    seen: set[int] = set()
    for mod_name, mod in module.named_modules(remove_duplicate=True):
        for key, buf in mod._buffers.items():
            if buf is None or id(buf) in seen:
                continue
            name = f"{mod_name}.{key}" if mod_name else key
            if not skip or not _ignored(name, skip):
                seen.add(id(buf))
                out.append((name, buf))
    if include_parameters:
        for name, p in module.named_parameters(remove_duplicate=True):
            if not ds_compat.is_zero_param(p) and not _ignored(name, skip):  # ZeRO parameters belong to DeepSpeed
                out.append((name, p))
    return out


def non_persistent_names(module: nn.Module) -> set[str]:
    """Qualified names of every non-persistent buffer (one pass over the modules)."""
    return {f"{prefix}.{key}" if prefix else key
            for prefix, mod in module.named_modules() for key in mod._non_persistent_buffers_set}


@dataclass(frozen=True)
class BatchNorm:
    """A layer that tracks running statistics (BatchNorm1d/2d/3d, SyncBatchNorm, tracking InstanceNorm, lazy ones
    once built), with its statistics as tensors: ``count`` is ``num_batches_tracked`` (None without a counter)."""

    name: str
    module: _NormBase
    mean: torch.Tensor
    var: torch.Tensor
    count: torch.Tensor | None

    def entries(self) -> list[Entry]:
        """(qualified name, tensor) of each statistic, as structure agreement sees them."""
        prefix = f"{self.name}." if self.name else ""
        out = [(prefix + "running_mean", self.mean), (prefix + "running_var", self.var)]
        if self.count is not None:
            out.append((prefix + "num_batches_tracked", self.count))
        return out


def tracking_bn(module: nn.Module) -> list[BatchNorm]:
    """Every layer of ``module`` that keeps running statistics, in module order."""
    out = []
    for name, m in module.named_modules():
        if isinstance(m, _NormBase) and m.track_running_stats and m.running_mean is not None:
            assert m.running_var is not None
            out.append(BatchNorm(name, m, m.running_mean, m.running_var, m.num_batches_tracked))
    return out


def bn_stat_entries(bns: Sequence[BatchNorm]) -> list[Entry]:
    """The statistics of every layer, in order."""
    return [e for bn in bns for e in bn.entries()]


def box(modules: Sequence[nn.Module]) -> nn.Module:
    """One module holding ``modules`` as '0', '1', ... without re-parenting them (a lone module is itself)."""
    if len(modules) == 1:
        return modules[0]
    holder = nn.Module()  # plain nn.Module: zero.Init does not patch its __init__, so nothing is partitioned
    for i, m in enumerate(modules):
        holder._modules[str(i)] = m
    return holder
