"""The process group a call runs over (a ProcessGroup, a DeviceMesh or one of its dimensions), resolved once per
call into a :class:`Group`, and the one rank convention.

[Note: rank convention]
Every rank argument (``src``, ``modifier_rank``) counts *within* the group it is used with: ``src=1`` with a group
of global ranks (4, 5, 6, 7) is global rank 5. That is DeepSpeed's ``modifier_rank`` and torch's ``group_src``;
with it ``install()`` and ``Init`` sync every data-parallel group from its own first rank, whatever the
model-parallel layout. Over the default group a group rank is the global rank. Reports (``BufferReport.ranks``,
``differing_ranks``) and error messages name global ranks, the ones in your logs: :attr:`Group.ranks` lists the
members' global ranks in group order, so ``g.ranks[i]`` names member ``i``. One validator, ``args.rank`` (and
``args.optional_rank`` for ``modifier_rank=None``), checks every rank argument at the call, before the group is
resolved; :func:`check_src` checks it against the group, before any collective.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._compat import torch as torch_compat
from ..errors import DistributedSetupError, InvalidArgumentError, InvalidSourceRankError


@dataclass(frozen=True)
class Mesh:
    """The DeviceMesh a call runs over, as data ([Note: placements] in placement.py): the names and shape of all its
    dimensions, the ones the call's group spans (``dims``: all of them for ``group=mesh``, one for ``(mesh, dim)``),
    every member's coordinates (in group order) and this rank's line along each spanned dimension (a :class:`Group`
    whose members are ordered by their coordinate there)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    coords: tuple[tuple[int, ...], ...]
    lines: tuple[tuple[int, Group], ...]

    def line(self, dim: int) -> Group:
        return dict(self.lines)[dim]

    def where(self, coords: tuple[int, ...]) -> str:
        """``(dp=0, tp=1)``."""
        return "(" + ", ".join(f"{self.names[d]}={coords[d]}" for d in range(len(self.names))) + ")"


@dataclass(frozen=True)
class Group:
    """A process group resolved for one call: its members (global ranks, in group order) and this rank's place
    (``me``, a group rank: [Note: rank convention]); ``mesh`` when it was given as a DeviceMesh (or adopted from the
    DTensors' mesh: placement.py)."""

    pg: Any
    ranks: tuple[int, ...]
    me: int
    backend: str
    mesh: Mesh | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.ranks[self.me]

    def global_rank(self, group_rank: int) -> int:
        """The global rank of member ``group_rank``."""
        return self.ranks[group_rank]

    @property
    def device(self) -> torch.device:
        """Device for the small control tensors (nccl only carries CUDA tensors)."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if initialized() else 0


def resolve(group: Any, fn: str) -> Group | None:
    """``group`` (a ProcessGroup, a DeviceMesh, (mesh, dimension name), or None for the default one) for this call;
    None means there is nothing to synchronise: no process group, a group of one, or this rank is not a member."""
    mesh, dims = _mesh_of(group)
    group = _from_mesh(group, fn)
    if dist.is_available() and not (group is None or group is dist.GroupMember.NON_GROUP_MEMBER
                                    or isinstance(group, dist.ProcessGroup)):
        raise InvalidArgumentError(
            f"{fn}(): group must be a torch.distributed ProcessGroup, a DeviceMesh, (DeviceMesh, dimension name) "
            f"or None for the default group, got {type(group).__name__} {group!r:.60}")
    if not initialized():
        env_world = os.environ.get("WORLD_SIZE", "1").strip() or "1"
        if env_world.isdigit() and int(env_world) > 1:
            raise DistributedSetupError(
                f"{fn}(): WORLD_SIZE={env_world} is set but torch.distributed has no process group; call "
                "torch.distributed.init_process_group (or deepspeed.init_distributed) first")
        return None
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    pg = group if group is not None else dist.group.WORLD
    try:
        ranks = tuple(dist.get_process_group_ranks(pg))
    except (KeyError, RuntimeError, ValueError) as e:
        raise InvalidArgumentError(f"{fn}(): group {pg!r:.60} is not a live process group (destroyed?): {e}") from e
    me = dist.get_rank()
    if len(ranks) <= 1 or me not in ranks:
        return None
    g = Group(pg=group, ranks=ranks, me=ranks.index(me), backend=str(dist.get_backend(pg)))
    return g if mesh is None else with_mesh(g, mesh, dims)


def _mesh_of(group: Any) -> tuple[Any, tuple[str, ...] | None]:
    """The DeviceMesh in ``group`` and the dimension named (None: all of them), or (None, None)."""
    if torch_compat.is_device_mesh(group):
        return group, None
    if isinstance(group, tuple) and len(group) == 2 and torch_compat.is_device_mesh(group[0]) \
            and isinstance(group[1], str):
        return group[0], (group[1],)
    return None, None


def with_mesh(g: Group, mesh: Any, dims: tuple[str, ...] | None = None) -> Group:
    """``g`` knowing it runs over ``mesh`` (its dimensions ``dims``; None: all of them, and ``g`` spans the mesh)."""
    names, shape, flat = torch_compat.mesh_layout(mesh)
    spanned = tuple(range(len(names))) if dims is None else tuple(names.index(d) for d in dims)
    where = {r: i for i, r in enumerate(flat)}
    coords = []
    for r in g.ranks:
        i, c = where[r], []
        for size in reversed(shape):
            i, k = divmod(i, size)
            c.append(k)
        coords.append(tuple(reversed(c)))
    lines = []
    for d in spanned:
        if dims is not None:  # (mesh, dim): the group is that line
            lines.append((d, g))
            continue
        pg = torch_compat.mesh_dim_group(mesh, d)
        members = tuple(dist.get_process_group_ranks(pg))
        lines.append((d, Group(pg=pg, ranks=members, me=members.index(g.rank), backend=str(dist.get_backend(pg)))))
    return dataclasses.replace(g, mesh=Mesh(names, shape, spanned, tuple(coords), tuple(lines)))


def _from_mesh(group: Any, fn: str) -> Any:
    """A DeviceMesh (its whole extent) or (mesh, dimension name) as the process group it stands for."""
    if torch_compat.is_device_mesh(group):
        return torch_compat.mesh_group(group, None, fn)
    if isinstance(group, tuple) and len(group) == 2 and torch_compat.is_device_mesh(group[0]):
        if not isinstance(group[1], str):
            raise InvalidArgumentError(f"{fn}(): group=(mesh, dim) needs a dimension name (str), got {group[1]!r}")
        return torch_compat.mesh_group(group[0], group[1], fn)
    return group


def check_src(g: Group | None, src: int, fn: str, name: str = "src") -> None:
    """InvalidSourceRankError unless ``src`` is a rank within the group (checked before any collective;
    [Note: rank convention])."""
    if g is None:
        if not initialized() and src != 0:
            raise InvalidSourceRankError(f"{fn}(): {name}={src} but torch.distributed is not initialised (the only "
                                         "rank is 0)")
        return  # world 1, or not a member: the call is a no-op
    if not 0 <= src < g.size:
        where = "the world" if g.pg is None else f"the group (global ranks {list(g.ranks)})"
        raise InvalidSourceRankError(
            f"{fn}(): {name}={src} is not a rank of {where}: ranks are counted within the group, 0 to {g.size - 1} "
            f"(rank {g.rank})")
