"""Module traversal: unwrap engines and wrappers, list buffers by qualified name, find tracking BatchNorms."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from .._compat import deepspeed as ds_compat, torch as torch_compat
from ..errors import InvalidArgumentError

Entry = tuple[str, torch.Tensor]
"""A tensor a call synchronises, by the qualified name that identifies it on every rank."""

_PASS_THROUGH = frozenset({"DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "PipelineEngine",
                           "FullyShardedDataParallel"})
_FSDP1_PREFIX = "_fsdp_wrapped_module."  # FSDP1 units insert it into every qualified name below them


def unwrap(module: nn.Module, fn: str) -> nn.Module:
    """The module that holds the layers: strips DDP, DataParallel, DeepSpeed engines, an FSDP1 root and torch.compile
    wrappers (a ``fully_shard``ed module is itself). A tree mixing FSDP1 and FSDP2 raises InvalidArgumentError."""
    outer = module
    while True:
        names = {c.__name__ for c in type(module).__mro__}
        inner = getattr(module, "module", None) if names & _PASS_THROUGH else \
            getattr(module, "_orig_mod", None) if "OptimizedModule" in names else None
        if not isinstance(inner, nn.Module):
            break
        module = inner
    fsdp_kinds(outer, fn)
    return module


def is_wrapper(module: nn.Module) -> bool:
    """A DDP / DataParallel / DeepSpeed engine / torch.compile wrapper (what :func:`unwrap` strips)."""
    names = {c.__name__ for c in type(module).__mro__}
    return bool(names & _PASS_THROUGH) or "OptimizedModule" in names


def fsdp_kinds(module: nn.Module, fn: str) -> tuple[bool, bool]:
    """(has FSDP1 units, has FSDP2 modules) in ``module``'s tree; InvalidArgumentError when it has both."""
    return _kinds(module.named_modules(), fn)


def _kinds(named: Iterable[tuple[str, nn.Module]], fn: str) -> tuple[bool, bool]:
    """:func:`fsdp_kinds` over modules already listed."""
    one = two = None
    for name, m in named:
        if one is None and torch_compat.is_fsdp1(m):
            one = name
        if two is None and torch_compat.is_fsdp2(m):
            two = name
    if one is not None and two is not None:
        raise InvalidArgumentError(
            f"{fn}(): the module mixes FSDP1 (FullyShardedDataParallel at '{one or '<root>'}') and FSDP2 (fully_shard "
            f"at '{two or '<root>'}'); torch does not support that tree and neither does zero_buffers")
    return one is not None, two is not None


def check_fsdp_group(module: nn.Module, ranks: Sequence[int], fn: str) -> None:
    """InvalidArgumentError (before any collective) when the FSDP units / fully_shard groups inside ``module`` run
    over ranks outside the call's group: gathering their parameters needs every one of those ranks."""
    missing = sorted(torch_compat.fsdp_ranks(module) - set(ranks))
    if missing:
        raise InvalidArgumentError(
            f"{fn}(): the model's FSDP parameters are sharded over ranks {missing} too, which are not in the group "
            f"(global ranks {list(ranks)}); gathering them needs every one of those ranks: pass a group that holds "
            "the model's whole FSDP mesh (e.g. the default group)")


def _ignored(name: str, skip: frozenset[str]) -> bool:
    """True when ``name`` or one of its module prefixes is in ``skip``."""
    if name in skip:
        return True
    parts = name.split(".")
    return any(".".join(parts[:i]) in skip for i in range(1, len(parts)))


def owned_buffers(mods: Iterable[tuple[str, nn.Module]], skip: Callable[[str], bool] | None = None
                  ) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """Every buffer of ``mods`` (a ``named_modules(remove_duplicate=True)`` walk) once, as (qualified name with
    FSDP1's ``_fsdp_wrapped_module.`` left out, owning module, its key there, tensor): None buffers skipped, an alias
    under the first name not ``skip``-ped."""
    seen: set[int] = set()
    for mod_name, mod in mods:
        for key, buf in mod._buffers.items():
            if buf is None or id(buf) in seen:
                continue
            name = (f"{mod_name}.{key}" if mod_name else key).replace(_FSDP1_PREFIX, "")
            if skip is None or not skip(name):
                seen.add(id(buf))
                yield name, mod, key, buf


def named_buffers(module: nn.Module, *, ignore: Iterable[str] = (), include_parameters: bool = False,
                  fn: str = "zero_buffers") -> list[Entry]:
    """Buffers (then plain parameters if asked: not ZeRO's, not FSDP's, no DTensor) by qualified name, FSDP1's
    ``_fsdp_wrapped_module.`` left out of the names; None buffers and aliases skipped."""
    skip = frozenset(ignore)
    mods = list(module.named_modules(remove_duplicate=True))  # one walk of the tree for both passes
    fsdp1, fsdp2 = _kinds(mods, fn)
    out: list[Entry] = [(name, buf) for name, _, _, buf in
                        owned_buffers(mods, (lambda name: _ignored(name, skip)) if skip else None)]
    if include_parameters:
        if fsdp1:
            raise InvalidArgumentError(
                f"{fn}(): include_parameters=True on an FSDP1 (FullyShardedDataParallel) model: FSDP1 keeps its "
                "parameters as per-rank shards of flat parameters, which must never be broadcast; sync the buffers "
                "alone (the default), or use fully_shard (FSDP2), whose sharded parameters are told apart")
        # ZeRO parameters belong to DeepSpeed, DTensors (tensor parallel) to their placements, FSDP2's (sharded, or
        # unsharded between a forward and its backward, here or by an enclosing root) to FSDP
        sharded = torch_compat.fsdp2_managed(module) if fsdp2 else set()
        foreign = set(torch_compat.fsdp2_foreign(module))
        for name, p in module.named_parameters(remove_duplicate=True):
            if ds_compat.is_zero_param(p) or torch_compat.is_dtensor(p) or id(p) in sharded or name in foreign:
                continue
            if not _ignored(name, skip):
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
            out.append(BatchNorm(name.replace(_FSDP1_PREFIX, ""), m, m.running_mean, m.running_var,
                                 m.num_batches_tracked))
    return out


def bn_stat_entries(bns: Sequence[BatchNorm]) -> list[Entry]:
    """The statistics of every layer, in order."""
    return [e for bn in bns for e in bn.entries()]


def box(modules: Sequence[nn.Module]) -> nn.Module:
    """One module holding ``modules`` as '0', '1', ... without re-parenting them (a lone module is itself)."""
    if len(modules) == 1:
        return modules[0]
    holder = nn.Module()  # plain nn.Module: zero.Init does not patch its __init__, so nothing is partitioned
    holder.__dict__["_zb_box"] = True  # not the user's tree: the search for owners of ZeRO parameters skips it
    for i, m in enumerate(modules):
        holder._modules[str(i)] = m
    return holder
