"""Snapshot and rollback of modules: what a failed transaction puts back after arbitrary code ran on them.

A :class:`Snapshot` records each module's registration tables (buffers, parameters, submodules, the
non-persistent set) and, optionally, a host copy of every buffer and plain parameter with its data
tensor. :meth:`Snapshot.restore` undoes ``load_state_dict(assign=True)``, new names and submodules,
swapped ``.data`` (another dtype, device or shape) and in-place writes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._compat import deepspeed as ds_compat

_TABLES = ("_buffers", "_parameters", "_modules")


@dataclass
class Snapshot:
    """Registration tables per module, and per tensor its data tensor and a host copy (None for meta tensors)."""

    tables: list[tuple[nn.Module, list[dict], set[str]]] = field(default_factory=list)
    values: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    classes: list[tuple[nn.Module, type]] = field(default_factory=list)

    @classmethod
    def take(cls, modules: Sequence[nn.Module], *, values: bool = True) -> Snapshot:
        """Record ``modules`` (tables and classes; not their children unless listed) and, with ``values``, copy
        their buffers and plain parameters to the host (ZeRO parameters need no copy: DeepSpeed keeps their
        shards)."""
        snap = cls()
        snap.tables = [(m, [dict(getattr(m, name)) for name in _TABLES], set(m._non_persistent_buffers_set))
                       for m in modules]
        snap.classes = [(m, type(m)) for m in modules]
        if values:
            seen: set[int] = set()
            with torch.no_grad():
                for _, saved, _ in snap.tables:
                    for table in saved[:2]:
                        for t in table.values():
                            if t is None or id(t) in seen or is_lazy(t) or ds_compat.is_zero_param(t):
                                continue
                            seen.add(id(t))
                            data = t.data
                            snap.values.append((t, data, None if data.is_meta else data.to("cpu", copy=True)))
        return snap

    def changed(self) -> bool:
        """Whether any recorded registration or value differs from what was recorded."""
        for module, saved, _ in self.tables:
            for name, table in zip(_TABLES, saved):
                live = getattr(module, name)
                if live.keys() != table.keys() or any(live[k] is not v for k, v in table.items()):
                    return True
        with torch.no_grad():
            for t, data, copy in self.values:
                live = t.data  # a new alias object on every access: compare what it points at, not its identity
                if (live.data_ptr() != data.data_ptr() or live.shape != data.shape or live.dtype != data.dtype
                        or live.device != data.device or (copy is not None and not torch.equal(data.cpu(), copy))):
                    return True
        return False

    def restore(self, gathered: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> list[str]:
        """Put back classes, registrations, data tensors and values; ``gathered`` are (ZeRO parameter, its gathered
        data tensor) pairs to re-attach before DeepSpeed re-partitions them. Returns the problems met."""
        problems = []
        for module, cls in self.classes:
            if type(module) is not cls:
                module.__class__ = cls
        for module, saved, transient in self.tables:
            for name, table in zip(_TABLES, saved):
                live = getattr(module, name)
                live.clear()
                live.update(table)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(transient)
        for t, data in gathered:
            t.data = data
        with torch.no_grad():
            for t, data, copy in self.values:
                try:
                    t.data = data
                    if copy is None:
                        continue
                    if data.shape == copy.shape:
                        data.copy_(copy)
                    else:  # resized in place
                        t.data = copy.to(data.device)
                except Exception as e:  # noqa: BLE001 - keep restoring the others; reported together
                    problems.append(f"{type(e).__name__}: {e}")
        return problems
