"""Private torch APIs: ``torch._utils`` flat-tensor helpers, the fused ``torch._foreach_copy_``, DCP's file layout,
FSDP1 / FSDP2 internals (the parameters they manage, a whole model unsharded, fully_shard undone), DeviceMesh, and
the frame of a ``Module.parameters()`` generator (which module it walks)."""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import inspect
import re
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import missing

try:
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    _foreach_copy = torch._foreach_copy_
except (ImportError, AttributeError) as e:  # pragma: no cover - every torch zero_buffers supports has them
    raise missing("torch", "torch._utils._flatten_dense_tensors / torch._foreach_copy_", str(e)) from e


def flatten(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate same-dtype, same-device tensors into one new flat tensor."""
    with torch.no_grad():
        if any(t.is_complex() for t in ts):  # the C++ helper refuses complex tensors
            return torch.cat([t.reshape(-1) for t in ts])
        return _flatten_dense_tensors(list(ts))


def unflatten_into(flat: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``ts`` (the inverse of :func:`flatten`) with one fused kernel."""
    with torch.no_grad():
        if flat.is_complex():
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
            return
        _foreach_copy(list(ts), list(_unflatten_dense_tensors(flat, list(ts))))


def pack_into(flat: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
    """Copy ``ts`` into consecutive slices of the preallocated ``flat`` (:func:`flatten` without allocating)."""
    with torch.no_grad():
        if any(t.is_complex() for t in ts):
            offset = 0
            for t in ts:
                flat[offset:offset + t.numel()].view(t.shape).copy_(t)
                offset += t.numel()
            return
        _foreach_copy(list(_unflatten_dense_tensors(flat, list(ts))), [t.detach() for t in ts])


def copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], complex_: bool | None = None) -> None:
    """``d.copy_(s)`` for every pair, with one fused kernel where torch has it (``complex_``: whether any is complex,
    when the caller knows)."""
    with torch.no_grad():
        if complex_ if complex_ is not None else any(t.is_complex() for t in dst):
            for d, s in zip(dst, src):
                d.copy_(s)
            return
        _foreach_copy(list(dst), list(src))


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy and without NumPy (``pip install torch`` does not bring
    it): a ctypes view of the tensor's memory. The caller must keep ``t`` alive while the view is used (or use
    :func:`to_bytes`)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("host_bytes needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def to_bytes(t: torch.Tensor) -> bytes:
    """A copy of a tensor's bytes (moved to the host, made contiguous first)."""
    host = t.detach().cpu().contiguous()
    return bytes(host_bytes(host))


# -- torch.distributed.checkpoint (DCP), read offline --------------------------------------------------------------
_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # FileSystemWriter names each rank's file __{rank}_{n}.distcp


def dcp_metadata(path: str) -> Any:
    """The ``.metadata`` of a DCP folder (``FileSystemReader.read_metadata``)."""
    try:
        from torch.distributed.checkpoint import FileSystemReader
    except ImportError as e:  # pragma: no cover - every torch zero_buffers supports has it
        raise missing("torch", "torch.distributed.checkpoint.FileSystemReader", str(e)) from e
    return FileSystemReader(path).read_metadata()


def dcp_tensors(metadata: Any) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every plain tensor entry of a DCP checkpoint: name -> (dtype, shape)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {name: (m.properties.dtype, tuple(m.size)) for name, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}


def dcp_writers(metadata: Any) -> dict[str, set[int]]:
    """Which ranks' files hold each entry (from ``storage_data``' relative paths); empty when it cannot tell."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return {}
    out: dict[str, set[int]] = {}
    for index, info in storage.items():
        found = _DCP_FILE.search(str(getattr(info, "relative_path", "")))
        fqn = getattr(index, "fqn", None)
        if found is None or fqn is None:
            return {}
        out.setdefault(fqn, set()).add(int(found.group(1)))
    return out


def dcp_read(path: str, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Load ``entries`` of a DCP folder into fresh CPU tensors, in this process (``no_dist=True``)."""
    import torch.distributed.checkpoint as dcp

    out = {name: torch.empty(shape, dtype=dtype) for name, (dtype, shape) in entries.items()}
    if out:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled ... single process"
            dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


# -- FSDP1 (FullyShardedDataParallel), FSDP2 (fully_shard), DTensor, DeviceMesh ------------------------------------
def _is(obj: Any, name: str, module_prefix: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith(module_prefix) for c in type(obj).__mro__)


def is_fsdp1(module: Any) -> bool:
    """An FSDP1 ``FullyShardedDataParallel`` wrapper."""
    return _is(module, "FullyShardedDataParallel", "torch.distributed.fsdp")


def is_fsdp2(module: Any) -> bool:
    """A module ``fully_shard`` was applied to (its class gained the ``FSDPModule`` mixin)."""
    return _is(module, "FSDPModule", "torch.distributed.fsdp")


def is_dtensor(t: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (FSDP2 and tensor-parallel parameters)."""
    return _is(t, "DTensor", "torch.distributed.tensor")


def is_device_mesh(obj: Any) -> bool:
    return _is(obj, "DeviceMesh", "torch.distributed")


@contextlib.contextmanager
def fsdp1_unsharded(module: Any) -> Iterator[None]:
    """FSDP1: every unit of ``module`` (the module as the caller passed it, root unit included) holds its full
    parameters (``summon_full_params(writeback=False)``: one all-gather per unit, every rank must enter), and each
    unit's forward is its wrapped module's, so forwards issue no collective. Private: ``_fsdp_wrapped_module``."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        units = FullyShardedDataParallel.fsdp_modules(module)
    except (ImportError, AttributeError) as e:  # pragma: no cover - every torch zero_buffers supports has them
        raise missing("torch", "FullyShardedDataParallel.fsdp_modules", str(e)) from e
    wrapped: list[Any] = [getattr(u, "_fsdp_wrapped_module", None) for u in units]
    if any(not callable(getattr(w, "forward", None)) for w in wrapped):
        raise missing("torch", "FullyShardedDataParallel._fsdp_wrapped_module")
    with FullyShardedDataParallel.summon_full_params(module, writeback=False):
        saved = [(u, u.__dict__.get("forward")) for u in units]
        for u, w in zip(units, wrapped):
            u.__dict__["forward"] = w.forward
        try:
            yield
        finally:
            for u, old in saved:
                if old is None:
                    u.__dict__.pop("forward", None)
                else:
                    u.__dict__["forward"] = old


def _fsdp2_state(module: Any) -> Any:
    """``fully_shard.state(module)``: the FSDPState holding a module's parameter groups and forward hooks."""
    try:
        from torch.distributed.fsdp import fully_shard
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        state._fsdp_param_groups  # noqa: B018 - fail here, naming the version, when the layout changed
    except (ImportError, AttributeError) as e:
        raise missing("torch", "fully_shard.state(module)._fsdp_param_groups", str(e)) from e
    return state


def fsdp2_modules(module: Any) -> list[Any]:
    """Every ``fully_shard``ed module of the tree, in module order."""
    return [m for m in module.modules() if is_fsdp2(m)]


def _fsdp_params(module: Any) -> Iterator[Any]:
    """Every FSDPParam of the ``fully_shard`` states inside ``module``."""
    for m in fsdp2_modules(module):
        for group in _fsdp2_state(m)._fsdp_param_groups:
            fsdp_params = getattr(group, "fsdp_params", None)
            if fsdp_params is None:
                raise missing("torch", "FSDPParamGroup.fsdp_params")
            yield from fsdp_params


def fsdp2_managed(module: Any) -> set[int]:
    """ids of the parameters the ``fully_shard`` states inside ``module`` manage: each sharded DTensor and, once it
    was all-gathered, its unsharded plain parameter (registered while the group is unsharded)."""
    try:
        return {i for fp in _fsdp_params(module) for i in _param_ids(fp)}
    except AttributeError as e:
        raise missing("torch", "FSDPParam.sharded_param", str(e)) from e


def _param_ids(fp: Any) -> list[int]:
    """ids of an FSDPParam's sharded DTensor and, once it was all-gathered, its unsharded plain parameter."""
    unsharded = getattr(fp, "_unsharded_param", None)
    return [id(fp.sharded_param)] + ([id(unsharded)] if unsharded is not None else [])


def fsdp2_foreign(module: Any) -> list[str]:
    """Qualified names of ``module``'s parameters that a ``fully_shard`` state registered on a module outside
    ``module`` manages (an enclosing root), sharded or, between its forward and backward, unsharded."""
    try:
        from torch.distributed import _composable_state
        states = [ref() for ref in list(_composable_state._module_state_mapping.values())]
    except (ImportError, AttributeError) as e:
        raise missing("torch", "torch.distributed._composable_state._module_state_mapping", str(e)) from e
    inside = {id(m) for m in module.modules()}
    owned: set[int] = set()
    for state in {id(st): st for st in states if st is not None}.values():
        if not hasattr(state, "_fsdp_param_groups") or all(id(m) in inside for m in getattr(state, "_modules", ())):
            continue
        for group in state._fsdp_param_groups:
            for fp in getattr(group, "fsdp_params", ()):
                info = getattr(fp, "_module_info", None)
                if info is not None and id(info.module) in inside:
                    owned.update(_param_ids(fp))
    return [n for n, p in module.named_parameters() if id(p) in owned]


def fsdp_ranks(module: Any) -> set[int]:
    """Global ranks that the FSDP1 units' and ``fully_shard`` groups' collectives inside ``module`` run over (the
    ranks that must all enter an unshard). Private: ``FSDPParamGroup.mesh_info.mesh``."""
    import torch.distributed as dist

    out: set[int] = set()
    for _, g in _groups(module):
        mesh = getattr(getattr(g, "mesh_info", None), "mesh", None)
        if mesh is None or not hasattr(mesh, "mesh"):
            raise missing("torch", "FSDPParamGroup.mesh_info.mesh")
        out.update(int(r) for r in mesh.mesh.flatten().tolist())
    for m in module.modules():
        if is_fsdp1(m):
            out.update(dist.get_process_group_ranks(m.process_group))
    return out


def _groups(module: Any) -> list[tuple[Any, Any]]:
    """(state, parameter group) of every ``fully_shard``ed module of ``module``, in module order."""
    return [(st, g) for m in fsdp2_modules(module) for st in (_fsdp2_state(m),) for g in st._fsdp_param_groups]


def _reshard_all(groups: list[tuple[Any, Any]]) -> None:
    """Every group sharded (local, no collective): then every rank's unshard issues one all-gather per group,
    whatever forwards or rank-0-only ``state_dict()`` calls left some groups unsharded on some ranks."""
    for _, g in groups:
        if g.is_unsharded:
            g.reshard()


@contextlib.contextmanager
def fsdp2_unsharded(module: Any) -> Iterator[None]:
    """Every ``fully_shard``ed module of ``module`` unsharded (exactly one all-gather per parameter group, in module
    order: every rank must enter) and kept so through any number of forwards, which then issue no collective;
    afterwards every group is sharded and reshard-after-forward is as it was (or as the root's lazy init, if a
    pass ran it, set it), and a forward that raised leaves no FSDP iteration state behind.

    Private: ``FSDPParamGroup.post_forward_mesh_info`` (None means "do not reshard after forward", what FSDP sets
    on its root), ``is_unsharded``, ``FSDPState._is_root`` / ``_auto_reshard_after_forward`` /
    ``_training_state``."""
    groups = _groups(module)
    if any(not hasattr(g, "post_forward_mesh_info") or not hasattr(type(g), "is_unsharded")
           or not hasattr(st, "_is_root") for st, g in groups):
        raise missing("torch", "FSDPParamGroup.post_forward_mesh_info / is_unsharded, FSDPState._is_root")
    saved = [(g.post_forward_mesh_info, st._is_root) for st, g in groups]
    _reshard_all(groups)
    try:
        for m in fsdp2_modules(module):
            m.unshard()
        for _, g in groups:
            g.post_forward_mesh_info = None
        yield
    finally:
        for (st, g), (info, root_before) in zip(groups, saved):
            lazily_made_root = root_before is None and st._is_root and getattr(st, "_auto_reshard_after_forward",
                                                                                False)
            g.post_forward_mesh_info = None if lazily_made_root else info
        aborted = [m for m in fsdp2_modules(module)
                   if getattr(getattr(_fsdp2_state(m), "_training_state", None), "name", "IDLE") != "IDLE"]
        for m in aborted:  # a pass raised inside a forward: FSDP's documented recovery
            if not callable(getattr(m, "reset_iter_state", None)):
                raise missing("torch", "FSDPModule.reset_iter_state")
            m.reset_iter_state()
        _reshard_all(groups)


def fsdp2_full_tensors(module: Any) -> dict[int, torch.Tensor]:
    """id(parameter) -> a plain full copy in its original dtype, for every parameter the ``fully_shard`` states
    inside ``module`` manage, keyed by the sharded DTensor (registered afterwards: every group is left sharded).
    One all-gather per parameter (``DTensor.full_tensor``), in the same order on every rank."""
    groups = _groups(module)
    _reshard_all(groups)
    out: dict[int, torch.Tensor] = {}
    try:
        for fp in _fsdp_params(module):
            out[id(fp.sharded_param)] = fp.sharded_param.detach().full_tensor().clone()
    except AttributeError as e:
        raise missing("torch", "FSDPParam.sharded_param", str(e)) from e
    return out


def fsdp2_detach(module: Any) -> Callable[[], None]:
    """Make every ``fully_shard``ed module of ``module`` a plain module again: its forward hooks and its parameter
    groups' state-dict hooks removed, its class the original one, its state unregistered (the FSDP of an enclosing
    root no longer finds it). Returns the undo.

    Private: ``FSDPState._pre_forward_hook_handle`` / ``_post_forward_hook_handle``,
    ``FSDPParamGroup._module_to_pre_save_state_dict_hook_handle`` / ``..._pre_load_...``,
    ``FSDPParam._post_load_hook_handle``, the composable contract's ``STATE_KEY`` / ``REGISTRY_KEY``, the
    ``_composable_state`` mapping, ``FSDPModule._orig_cls_mro_index``."""
    try:
        from torch.distributed import _composable_state
        contract = importlib.import_module("torch.distributed._composable.contract")  # not the same-named function
        mapping = _composable_state._module_state_mapping
        keys = (contract.STATE_KEY, contract.REGISTRY_KEY)  # where fully_shard's contract keeps its per-module state
    except (ImportError, AttributeError) as e:
        raise missing("torch", "torch.distributed._composable_state._module_state_mapping / "
                      "_composable.contract.STATE_KEY", str(e)) from e
    handles: list[Any] = []
    touched: dict[int, Any] = {}
    classes: list[tuple[Any, type, type, Any, dict]] = []
    for m in fsdp2_modules(module):
        state = _fsdp2_state(m)
        forward = [getattr(state, n, None) for n in ("_pre_forward_hook_handle", "_post_forward_hook_handle")]
        index = getattr(type(m), "_orig_cls_mro_index", None)
        if any(h is None for h in forward) or not isinstance(index, int):
            raise missing("torch", "FSDPState._pre_forward_hook_handle / FSDPModule._orig_cls_mro_index")
        handles += forward
        touched[id(m)] = m
        for group in state._fsdp_param_groups:
            for table in ("_module_to_pre_save_state_dict_hook_handle", "_module_to_pre_load_state_dict_hook_handle"):
                found = getattr(group, table, None)
                if not isinstance(found, dict):
                    raise missing("torch", f"FSDPParamGroup.{table}")
                handles += found.values()
                touched.update({id(k): k for k in found})
            for fp in group.fsdp_params:  # each parameter's load_state_dict post-hook (it re-pads the shard)
                post, info = getattr(fp, "_post_load_hook_handle", None), getattr(fp, "_module_info", None)
                if post is None or info is None:
                    raise missing("torch", "FSDPParam._post_load_hook_handle / _module_info")
                handles.append(post)
                touched[id(info.module)] = info.module
        classes.append((m, type(m), type(m).__mro__[index], mapping.get(m), {k: m.__dict__[k] for k in keys
                                                                              if k in m.__dict__}))
    saved = [(t, {n: dict(getattr(t, n)) for n in _HOOK_DICTS}) for t in touched.values()]
    for h in handles:
        h.remove()
    for m, _, original, _, contracts in classes:
        mapping.pop(m, None)
        for k in contracts:
            del m.__dict__[k]
        m.__class__ = original

    def undo() -> None:
        for t, hooks in saved:
            for n, d in hooks.items():
                getattr(t, n).clear()
                getattr(t, n).update(d)
        for m, cls, _, entry, contracts in classes:
            m.__class__ = cls
            m.__dict__.update(contracts)
            if entry is not None:
                mapping[m] = entry
    return undo


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def mesh_group(mesh: Any, dim: str | None, fn: str) -> Any:
    """The process group of ``mesh`` (a 1-D mesh, or one spanning the whole world) or of its dimension ``dim``;
    InvalidArgumentError for a dimension it does not have, a multi-dimensional mesh that is not the whole world,
    or a mesh this rank is not in."""
    import torch.distributed as dist

    from ..errors import InvalidArgumentError

    names = tuple(mesh.mesh_dim_names or ())
    if mesh.get_coordinate() is None:
        raise InvalidArgumentError(f"{fn}(): rank {dist.get_rank()} is not in the DeviceMesh passed as group "
                                   f"({mesh!r:.80}); every rank that calls must be in it")
    if dim is not None:
        if dim not in names:
            raise InvalidArgumentError(f"{fn}(): the DeviceMesh has no dimension {dim!r} (its dimensions: "
                                       f"{', '.join(map(repr, names)) or 'unnamed'})")
        return mesh.get_group(dim)
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    raise InvalidArgumentError(
        f"{fn}(): a {mesh.ndim}-D DeviceMesh of {mesh.size()} of the world's {dist.get_world_size()} ranks: buffers "
        "are synced over a whole mesh only when it spans the world; pass (mesh, dim) with one of "
        f"{', '.join(map(repr, names)) or 'its dimensions'}, or a ProcessGroup")


def parameters_generator(obj: Any) -> tuple[torch.nn.Module, bool] | None:
    """``(module, recurse)`` for ``module.parameters(recurse)`` as torch defines it, not yet started (a generator
    whose frame still holds its arguments), else None. Relies on ``nn.Module.parameters`` being a generator
    function with locals ``self`` and ``recurse``; anything else (an override, a started generator) gives None."""
    if not isinstance(obj, types.GeneratorType) or obj.gi_code is not torch.nn.Module.parameters.__code__:
        return None
    if inspect.getgeneratorstate(obj) != inspect.GEN_CREATED or obj.gi_frame is None:
        return None
    local = obj.gi_frame.f_locals
    module, recurse = local.get("self"), local.get("recurse", True)
    if not isinstance(module, torch.nn.Module) or not isinstance(recurse, bool):
        return None
    return module, recurse
