"""Which modules a list of ZeRO parameters names: their owners, found without being told.

``GatheredParametersAndBuffers(tokenizer.parameters(), modifier_rank=0)`` names parameters, but the body changes
the buffers of the modules that register them. Those modules are found, cheapest source first:

1. a ``module.parameters()`` generator not yet started names ``module`` itself (its frame holds it);
2. the record zero_buffers keeps while :func:`~zero_buffers.install` or :class:`~zero_buffers.Init` is active: which
   module registered each ZeRO parameter when zero.Init converted it, and each such module's parent;
3. ``fwd_module``'s tree (DeepSpeed's module that uses the parameters);
4. a search of the heap for the modules that register these exact parameter objects (``gc.get_objects``, one pass;
   the index it builds is kept until any module anywhere registers a parameter or a submodule, which torch's global
   registration hooks report, so a per-module loading walk searches once).

Every link is checked against the live registration tables before it is used (identity, not names). What is synced
is decided in :func:`find`: the maximal modules whose every parameter was given (their whole tree, as when the
module is passed), and the owners whose parameters were given in part (their own buffers and their parameter-free
submodules). Each is named by a tag that is the same on every rank (its class and the smallest ds_id it was given),
so ranks that found different modules differ in structure and raise :class:`BufferStructureError` together.
"""
from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from .._compat import deepspeed as ds_compat
from .._core.modules import Entry, is_wrapper, named_buffers

# ---- the record (install() / zero_buffers.Init) ------------------------------------------------------------------
_by_ds_id: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()  # ds_id -> owning module
_parent_of: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()  # module -> its parent


def remember(module: nn.Module) -> None:
    """zero.Init converted ``module`` (after its children): note which module owns each of its ZeRO parameters, and
    each child's parent."""
    for p in module._parameters.values():
        if p is not None and ds_compat.is_zero_param(p):
            _by_ds_id[ds_compat.ds_id(p)] = module
    for child in module._modules.values():
        if child is not None:
            _parent_of[child] = weakref.ref(module)


def _table(module: nn.Module, name: str) -> dict:
    """A registration table read from the instance dict (a module still in ``__init__`` may not have it yet)."""
    return getattr(module, "__dict__", {}).get(name) or {}


def _registers(module: nn.Module, table: str, obj: Any) -> bool:
    return any(v is obj for v in _table(module, table).values())


def recorded_owner(p: torch.Tensor) -> nn.Module | None:
    """The module the record says registers ``p``, if it still does."""
    m = _by_ds_id.get(ds_compat.ds_id(p))
    return m if m is not None and _registers(m, "_parameters", p) else None


def recorded_parent(module: nn.Module) -> nn.Module | None:
    """The module's parent as zero.Init built it, if it still holds ``module``."""
    ref = _parent_of.get(module)
    parent = ref() if ref is not None else None
    return parent if parent is not None and _registers(parent, "_modules", module) else None


# ---- the heap index ----------------------------------------------------------------------------------------------
@dataclass
class _Heap:
    """Every live module's parameter and submodule registrations, by the registered object's id (weak)."""

    owners: dict[int, list[weakref.ref]] = field(default_factory=dict)
    parents: dict[int, list[weakref.ref]] = field(default_factory=dict)


_heap: list[_Heap] = []  # at most one, valid until the next registration anywhere
_hooks: list[Any] = []
scans = [0]  # heap searches this process made (tests and benchmarks read it)


def _invalidate(*_: Any) -> None:
    _heap.clear()
    while _hooks:
        _hooks.pop().remove()


def _heap_index() -> _Heap:
    """The index of every live module (one pass over the objects the garbage collector tracks), cached."""
    if _heap:
        return _heap[0]
    scans[0] += 1
    index = _Heap()
    objects = gc.get_objects()
    try:
        modules = [o for o in objects if issubclass(type(o), nn.Module)]  # type(): no user __class__ code runs
    finally:
        del objects
    for m in modules:
        if m.__dict__.get("_zb_box"):  # zero_buffers' own holder of a list of modules: not the user's tree
            continue
        try:
            ref = weakref.ref(m)
        except TypeError:  # a subclass with __slots__ and no __weakref__: not indexed
            continue
        for p in _table(m, "_parameters").values():
            if p is not None:
                index.owners.setdefault(id(p), []).append(ref)
        for c in _table(m, "_modules").values():
            if c is not None:
                index.parents.setdefault(id(c), []).append(ref)
    _hooks.append(torch_module.register_module_parameter_registration_hook(_invalidate))
    _hooks.append(torch_module.register_module_module_registration_hook(_invalidate))
    _heap.append(index)
    return index


# ---- the graph one call sees -------------------------------------------------------------------------------------
class _Graph:
    """Owners and parents known from whole trees walked now, the record (each link looked up when asked: a
    per-module loading walk costs each call its own modules, not the whole model) and, once searched, the heap
    index."""

    def __init__(self) -> None:
        self.owners: dict[int, dict[int, nn.Module]] = {}
        self.parents: dict[int, dict[int, nn.Module]] = {}
        self.walked: set[int] = set()
        self.heap: _Heap | None = None

    def walk(self, root: nn.Module) -> None:
        if id(root) in self.walked:
            return
        for m in root.modules():
            self.walked.add(id(m))
            for p in m._parameters.values():
                if p is not None:
                    self.owners.setdefault(id(p), {})[id(m)] = m
            for c in m._modules.values():
                if c is not None:
                    self.parents.setdefault(id(c), {})[id(m)] = m

    def _live(self, table: dict[int, list[weakref.ref]], obj: Any, kind: str) -> list[nn.Module]:
        out = []
        for ref in table.get(id(obj), ()):
            m = ref()
            if m is not None and _registers(m, kind, obj):  # ids are reused: check the object itself
                out.append(m)
        return out

    def owners_of(self, p: torch.Tensor) -> list[nn.Module]:
        found = {i: m for i, m in self.owners.get(id(p), {}).items() if _registers(m, "_parameters", p)}
        recorded = recorded_owner(p) if ds_compat.is_zero_param(p) else None
        if recorded is not None:
            found.setdefault(id(recorded), recorded)
        if self.heap is not None:
            found.update((id(m), m) for m in self._live(self.heap.owners, p, "_parameters"))
        return list(found.values())

    def parents_of(self, module: nn.Module) -> list[nn.Module]:
        found = {i: m for i, m in self.parents.get(id(module), {}).items() if _registers(m, "_modules", module)}
        recorded = recorded_parent(module)
        if recorded is not None:
            found.setdefault(id(recorded), recorded)
        if self.heap is not None:
            found.update((id(m), m) for m in self._live(self.heap.parents, module, "_modules"))
        return list(found.values())


# ---- what a call syncs -------------------------------------------------------------------------------------------
@dataclass
class Found:
    """The modules whose buffers a parameter list brings into the sync, each with a tag equal on every rank.

    ``whole``: modules every parameter of which was given: their whole tree's buffers and plain parameters;
    ``partial``: owners given only some of their parameters: their own buffers and their parameter-free
    submodules' (as under install()); ``unowned``: ds_ids of ZeRO parameters no module registers."""

    whole: list[tuple[str, nn.Module]] = field(default_factory=list)
    partial: list[tuple[str, nn.Module]] = field(default_factory=list)
    unowned: list[int] = field(default_factory=list)

    def entries(self) -> list[Entry]:
        """The tensors to sync, read from the modules now (a body may have swapped them), each once."""
        out: list[Entry] = []
        for tag, m in self.whole:
            out += [(f"{tag}.{n}", t) for n, t in named_buffers(m, include_parameters=True)]
        for tag, m in self.partial:
            out += [(f"{tag}.{k}", b) for k, b in m._buffers.items() if b is not None]
            for name, child in m.named_children():
                if next(child.parameters(), None) is None:
                    out += [(f"{tag}.{name}.{n}", b) for n, b in named_buffers(child)]
        seen: set[int] = set()
        unique = []
        for name, t in out:
            if id(t) not in seen:
                seen.add(id(t))
                unique.append((name, t))
        return unique

    def modules(self) -> list[nn.Module]:
        """Every module whose registrations the entries come from (for the rollback copy)."""
        out: dict[int, nn.Module] = {}
        for _, m in self.whole:
            out.update((id(s), s) for s in m.modules())
        for _, m in self.partial:
            out[id(m)] = m
            for child in m.children():
                if next(child.parameters(), None) is None:
                    out.update((id(s), s) for s in child.modules())
        return list(out.values())


def _tag(module: nn.Module, ids: Iterable[int]) -> str:
    return f"<{type(module).__name__} owning ds_id={min(ids)}>"


def find(zero: Sequence[torch.Tensor], given: set[int], *, root: tuple[nn.Module, bool] | None = None,
         fwd_module: nn.Module | None = None) -> Found:
    """The modules behind ``zero`` (ZeRO parameters, sorted by ds_id); ``given``: ids of every tensor passed;
    ``root``: (module, recurse) when a ``module.parameters(recurse)`` generator was passed."""
    graph = _Graph()
    if root is not None:
        graph.walk(root[0])
    if fwd_module is not None:
        graph.walk(fwd_module)
    if any(not graph.owners_of(p) for p in zero):  # neither named, nor under fwd_module, nor in the record
        graph.heap = _heap_index()

    whole_cache: dict[int, list[int] | None] = {}

    def whole(m: nn.Module) -> list[int] | None:
        """The ds_ids of ``m``'s tree when every parameter in it was given (and one is ZeRO), else None."""
        if id(m) not in whole_cache:
            ps = list(m.parameters())
            ids = [ds_compat.ds_id(p) for p in ps if ds_compat.is_zero_param(p)]
            whole_cache[id(m)] = ids if ids and all(id(p) in given for p in ps) else None
        return whole_cache[id(m)]

    tops: dict[int, nn.Module] = {}
    partial: dict[int, nn.Module] = {}
    unowned = []
    for p in zero:
        owners = graph.owners_of(p)
        if not owners:
            unowned.append(ds_compat.ds_id(p))
        for owner in owners:
            if whole(owner) is None:
                partial[id(owner)] = owner
                continue
            frontier, seen = [owner], {id(owner)}
            while frontier:  # climb while every parameter of the parent was given too
                m = frontier.pop()
                ups = [q for q in graph.parents_of(m) if not is_wrapper(q) and whole(q) is not None]
                if not ups:
                    tops[id(m)] = m
                for q in ups:
                    if id(q) not in seen:
                        seen.add(id(q))
                        frontier.append(q)
    inner = {id(s) for t in tops.values() for s in t.modules() if s is not t}
    found = Found(unowned=unowned)
    found.whole = sorted(((_tag(t, whole(t) or ()), t) for t in tops.values() if id(t) not in inner), key=_order)
    found.partial = sorted(((_tag(m, [ds_compat.ds_id(p) for p in m._parameters.values()
                                      if p is not None and id(p) in given and ds_compat.is_zero_param(p)]), m)
                            for m in partial.values()), key=_order)
    if unowned and fwd_module is not None:  # DeepSpeed's module that uses them: theirs, for want of a registrar
        listed = {id(s) for _, m in found.whole for s in m.modules()} | {id(m) for _, m in found.partial}
        if id(fwd_module) not in listed:
            found.partial.append((f"<{type(fwd_module).__name__} (fwd_module) using ds_id={min(unowned)}>",
                                  fwd_module))
        found.unowned = []
    return found


def _order(item: tuple[str, nn.Module]) -> tuple[int, str]:
    tag = item[0]
    return int(tag.rsplit("=", 1)[1].rstrip(">")), tag
