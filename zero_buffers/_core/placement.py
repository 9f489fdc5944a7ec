"""Placements: how each buffer lies over the call's DeviceMesh, the groups it is checked and synced over, and the
reduction of its Partial dimensions.

[Note: placements]
Over a mesh (``group=mesh``, ``group=(mesh, dim)``, or the default group when DTensor buffers live on a mesh that
spans it), every buffer has, for each dimension the call spans, one of three roles:

    replicated  its local values must be equal along that dimension: checked there, synced there (from ``src``'s
                coordinate, or reduced by the buffer's rule). A plain tensor is replicated on every dimension, and so
                is a DTensor on every dimension its own mesh lacks; a DTensor is where it says ``Replicate()``.
    partial     ``Partial(op)``: its local values are summands of one value. ``sync_buffers`` (and any sync by
                rules) reduces them with ``op`` (sum, avg, max, min) over those dimensions and relabels them
                ``Replicate()`` (the DTensor object stays the same; its value, ``full_tensor()``, does not change);
                from then on they are replicated dimensions. ``broadcast_buffers`` copies, and a copied summand would
                change the value, so it leaves them as they are; ``buffer_report`` does not compare them;
                ``keep_in_sync`` leaves a Partial DTensor alone (a forward keeps adding this rank's summands to it:
                reduce it with ``sync_buffers`` where the value is needed, before the optimizer step).
    sharded     ``Shard(d)``: each coordinate holds its own part; never compared or moved along that dimension.

A DTensor's local tensor (an alias of its storage) is what travels, and its placements are part of the structure
every rank agrees on first. Each kind of collective runs over the group of the dimensions it concerns: the whole
group when that is every spanned dimension, the rank's line (``Mesh.lines``) for one; every rank issues the same
collectives in the same order (the classes come in the order of the agreed entries), each in its own line, and the
votes of the transaction run over the whole group, so a failure anywhere aborts every rank of the mesh. A class of
two dimensions of a mesh of three or more is refused (not implemented). Sharded local tensors must have equal
shapes across the ranks (uneven shards are a structure mismatch).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._compat import torch as torch_compat
from ..errors import InvalidArgumentError
from . import structure as _structure, wire as _wire
from .group import Group, with_mesh
from .modules import Entry

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
"""The reduce ops a Partial placement may declare ("avg" divides the sum afterwards)."""


@dataclass(frozen=True)
class Layout:
    """One entry over the call's mesh: the spanned dimensions it is replicated over and those it is partial over
    (reduced with ``op``), ascending; ``text`` the placements, one per mesh dimension (``R``, ``S(0)``, ``P(sum)``)."""

    replicate: tuple[int, ...]
    partial: tuple[int, ...] = ()
    op: str = ""
    text: str = ""


@dataclass
class Placed:
    """A call's entries with DTensors replaced by their local tensors, each with its :class:`Layout`; ``g`` the
    call's group, knowing its mesh. ``dtensors``: entry index -> the DTensor (to relabel its Partial dimensions)."""

    g: Group
    entries: list[Entry]
    layouts: list[Layout]
    dtensors: dict[int, Any] = field(default_factory=dict)

    @property
    def signature(self) -> tuple[tuple[str, str], ...]:
        """(name, placements) of every DTensor: part of the structure every rank agrees on."""
        return tuple((self.entries[i][0], self.layouts[i].text) for i in sorted(self.dtensors))

    def partial(self) -> list[int]:
        """The entries with Partial dimensions."""
        return [i for i, lay in enumerate(self.layouts) if lay.partial]

    def classes(self, indices: Sequence[int]) -> list[tuple[Group | None, list[int]]]:
        """``indices`` by the group of the dimensions they are replicated over, in first-seen order (the same on
        every rank: the layouts are agreed); None for entries replicated over none."""
        order: dict[tuple[int, ...], list[int]] = {}
        for i in indices:
            order.setdefault(self.layouts[i].replicate, []).append(i)
        return [(over(self.g, key), idx) for key, idx in order.items()]


def over(g: Group, dims: tuple[int, ...]) -> Group | None:
    """The group of ``dims`` for this rank: ``g`` itself for every spanned dimension, its line for one, None for
    none ([Note: placements])."""
    if g.mesh is None or set(dims) == set(g.mesh.dims):
        return g if dims or g.mesh is None else None
    if not dims:
        return None
    if len(dims) == 1:
        return g.mesh.line(dims[0])
    raise AssertionError("refused by place()")  # pragma: no cover


def source_in(g: Group, sub: Group, src: int) -> int:
    """The group rank within ``sub`` (``g`` or one of its lines) of the member at ``src``'s coordinate along it."""
    if sub is g or g.mesh is None:
        return src
    d = next(d for d, line in g.mesh.lines if line is sub)
    return g.mesh.coords[src][d]


def _text(names: Sequence[str], roles: Sequence[tuple[str, Any]]) -> str:
    def one(kind: str, arg: Any) -> str:
        return {"R": "R", "S": f"S({arg})", "P": f"P({arg})"}.get(kind, f"?{arg}")
    return ",".join(f"{n}:{one(*r)}" for n, r in zip(names, roles))


def place(g: Group, entries: Sequence[Entry], fn: str) -> Placed | None:
    """The layouts of ``entries`` over ``g`` (None when there is neither a mesh nor a DTensor: the plain path).
    InvalidArgumentError, before any collective, for a DTensor whose mesh is not the call's, a placement that is not
    Replicate / Shard / Partial(sum, avg, max, min), or a class of dimensions no single group covers."""
    dts = {i: t for i, (_, t) in enumerate(entries) if torch_compat.is_dtensor(t)}
    if g.mesh is None and not dts:
        return None
    if g.mesh is None:
        first = entries[min(dts)][0]
        mesh = torch_compat.device_mesh(dts[min(dts)])
        names, _, flat = torch_compat.mesh_layout(mesh)
        if sorted(flat) != sorted(g.ranks):
            raise InvalidArgumentError(
                f"{fn}(): buffer '{first}' is a DTensor on a DeviceMesh of ranks {sorted(flat)}, but the call runs "
                f"over ranks {list(g.ranks)}: pass group=mesh (or (mesh, dim)) for the mesh it lives on")
        g = with_mesh(g, mesh)
    assert g.mesh is not None
    m = g.mesh
    layouts: list[Layout] = []
    everywhere = Layout(m.dims, text=_text(m.names, [("R", None)] * len(m.names)))
    for i, (name, t) in enumerate(entries):
        if i not in dts:
            layouts.append(everywhere)
            continue
        names = tuple(torch_compat.mesh_layout(torch_compat.device_mesh(t))[0])
        unknown = [n for n in names if n not in m.names]
        if unknown or len(set(names)) != len(names):
            raise InvalidArgumentError(
                f"{fn}(): buffer '{name}' is a DTensor on a mesh with dimensions {list(names)}, which are not "
                f"dimensions of the call's mesh {list(m.names)}: pass group= the mesh it lives on")
        own = dict(zip(names, torch_compat.placements(t)))
        roles = [own.get(n, ("R", None)) for n in m.names]  # a dimension its mesh lacks: as a plain tensor
        bad = [(n, r) for n, r in zip(m.names, roles) if r[0] == "?" or (r[0] == "P" and r[1] not in OPS)]
        if bad:
            raise InvalidArgumentError(
                f"{fn}(): buffer '{name}' has placement {bad[0][1]} on mesh dimension {bad[0][0]!r}; zero_buffers "
                f"syncs Replicate(), Shard(d) and Partial({', '.join(OPS)})")
        rep = tuple(d for d in m.dims if roles[d][0] == "R")
        par = tuple(d for d in m.dims if roles[d][0] == "P")
        ops = {roles[d][1] for d in par}
        if "avg" in ops and not (t.is_floating_point() or t.is_complex()):
            raise InvalidArgumentError(f"{fn}(): buffer '{name}' is Partial(avg) over integers, which zero_buffers "
                                       "does not round: keep it in floating point or declare Partial(sum)")
        if len(ops) > 1:
            raise InvalidArgumentError(f"{fn}(): buffer '{name}' is Partial with different ops on different mesh "
                                       f"dimensions ({sorted(ops)}); reduce it yourself first")
        for dims in (rep, par, tuple(sorted(rep + par))):
            if 1 < len(dims) < len(m.dims):
                raise InvalidArgumentError(
                    f"{fn}(): buffer '{name}' ({_text(m.names, roles)}) would be synced over mesh dimensions "
                    f"{[m.names[d] for d in dims]} together, a part of a {len(m.names)}-D mesh no single group covers "
                    "(not implemented: pass group=(mesh, dim) one dimension at a time)")
        layouts.append(Layout(rep, par, ops.pop() if ops else "", _text(m.names, roles)))
    out = [(name, torch_compat.local_tensor(t) if i in dts else t) for i, (name, t) in enumerate(entries)]
    return Placed(g, out, layouts, dts)


def placed(g: Group, entries: Sequence[Entry], deadline: _wire.Deadline, fn: str) -> Placed | None:
    """:func:`place`; a rank whose model it refuses tells its peers in their first collective, so every rank raises
    (``structure.refuse``)."""
    try:
        return place(g, entries, fn)
    except InvalidArgumentError as e:
        _structure.refuse(g, e, deadline, fn)
        raise  # pragma: no cover - refuse() always raises


def _wide(t: torch.Tensor, op: str) -> torch.dtype:
    """Sums and averages of floats narrower than 32 bits run in float64 (one rounding when written back)."""
    if op in ("sum", "avg") and t.is_floating_point() and torch.finfo(t.dtype).bits < 32:
        return torch.float64
    return torch.uint8 if t.dtype == torch.bool else t.dtype


class Partials:
    """The Partial entries of a call ([Note: placements]): each reduced with its op over its partial dimensions,
    then made equal over its replicated ones from ``src``'s coordinate, into scratch (EXCHANGE); written and
    relabelled Replicate at WRITE. One collective per entry and step (Partial buffers are few: counters)."""

    def __init__(self, placed: Placed, src: int):
        self.placed, self.src = placed, src
        self.indices = placed.partial()
        self.flats: list[torch.Tensor] = []
        self.undo: list[Callable[[], None]] = []

    def prepare(self) -> None:
        ts = [self.placed.entries[i][1] for i in self.indices]
        self.flats = [t.detach().reshape(-1).to(_wide(t, self.placed.layouts[i].op), copy=True)
                      for i, t in zip(self.indices, ts)]

    def exchange(self, deadline: _wire.Deadline, what: str) -> None:
        """Every rank issues every collective, even after a local failure (zeros where its flats would be)."""
        g = self.placed.g
        for k, i in enumerate(self.indices):
            lay = self.placed.layouts[i]
            t = self.placed.entries[i][1]
            flat = self.flats[k] if k < len(self.flats) else torch.zeros(t.numel(), dtype=_wide(t, lay.op),
                                                                         device=t.device)
            sub = over(g, lay.partial)
            if sub is not None:
                _wire.all_reduce(sub, flat, deadline, what, op=OPS[lay.op])
                if lay.op == "avg":
                    flat /= sub.size
            rest = over(g, lay.replicate)
            if rest is not None:
                _wire.broadcast_flat(rest, flat, source_in(g, rest, self.src), deadline, what)

    def apply(self) -> None:
        for i, flat in zip(self.indices, self.flats):
            t = self.placed.entries[i][1]
            t.copy_(flat.view(t.shape) if flat.dtype == t.dtype else flat.view(t.shape).to(t.dtype))
            self.undo.append(torch_compat.mark_replicated(self.placed.dtensors[i], self.placed.layouts[i].partial))

    def relabel_back(self) -> None:
        """Put the Partial placements back (an ``after_sync`` hook failed on some rank: every rank undoes the call)."""
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()
