"""Private torch APIs: ``torch._utils`` flat-tensor helpers, the fused ``torch._foreach_copy_``, the version counter
of in-place writes (``Tensor._version``), DCP's file layout, FSDP1 / FSDP2 internals (the parameters they manage, a
whole model unsharded, fully_shard undone), DeviceMesh, and the frame of a ``Module.parameters()`` generator (which
module it walks), whether a backward is running."""
from __future__ import annotations

import builtins
import collections
import contextlib
import ctypes
import dataclasses
import functools
import importlib
import inspect
import io
import itertools
import math
import pathlib
import pickle
import re
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from . import missing, replace, replace_global, signature_starts

try:
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    _foreach_copy = torch._foreach_copy_
except (ImportError, AttributeError) as e:  # pragma: no cover - every torch zero_buffers supports has them
    raise missing("torch", "torch._utils._flatten_dense_tensors / torch._foreach_copy_", str(e)) from e


def flatten(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate same-dtype, same-device tensors into one new flat tensor (never a view of one of them: the C++
    helper returns ``t.view(-1)`` for a single contiguous tensor, and a collective into it would write the buffer)."""
    with torch.no_grad():
        if len(ts) == 1:
            return ts[0].reshape(-1).clone()
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


def never_written(t: torch.Tensor) -> bool:
    """Whether ``t`` was never written in place since it was made (its version counter, ``Tensor._version``, is 0:
    what ``to_empty()`` and every factory leave; ``copy_``, ``fill_``, an in-place op or a collective into it
    raise it). An inference tensor has no counter: False."""
    if not hasattr(torch.Tensor, "_version"):
        raise missing("torch", "Tensor._version (the version counter of in-place writes)")
    if t.is_inference():
        return False
    return int(t._version) == 0


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
# DCP's .metadata is a plain pickle and FileSystemReader.read_metadata loads it with pickle.load: a folder someone
# else wrote could run code. Here it is unpickled by an allowlist of exactly what torch's DCP metadata is made of
# (checked by pickling real metadata: tests/doctor/test_hostile_files.py), and dcp.load gets a reader that uses it.
_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # FileSystemWriter names each rank's file __{rank}_{n}.distcp
_DCP_METADATA_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a Python object outside the allowlist (``qualname``); nothing of it ran."""

    def __init__(self, qualname: str, why: str = "not part of DCP's metadata"):
        super().__init__(f"{qualname}: {why}")
        self.qualname = qualname
        self.why = why


@functools.cache
def _dcp_classes() -> dict[tuple[str, str], Any]:
    """(module, name) -> object, for every global torch's DCP metadata pickles refer to, and only those."""
    try:
        from torch.distributed.checkpoint import filesystem, metadata
        allowed: dict[tuple[str, str], Any] = {
            ("torch.distributed.checkpoint.metadata", n): getattr(metadata, n) for n in _DCP_METADATA_CLASSES}
        allowed["torch.distributed.checkpoint.filesystem", "_StorageInfo"] = filesystem._StorageInfo
    except (ImportError, AttributeError) as e:
        raise missing("torch", "torch.distributed.checkpoint.metadata's classes (" + ", ".join(_DCP_METADATA_CLASSES)
                      + ") and filesystem._StorageInfo", str(e)) from e
    return allowed


@functools.cache
def _dcp_globals() -> dict[tuple[str, str], Any]:
    """The allowlist: DCP's classes, torch.Size, dtypes, layouts (pickled through torch.serialization._get_layout,
    answered here by name lookup), memory formats, the paths ``checkpoint_id`` may be, two builtin containers."""
    allowed = dict(_dcp_classes())
    allowed["torch", "Size"] = torch.Size
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed["torch", name] = value
    allowed["torch.serialization", "_get_layout"] = _layout_named
    allowed.update({("pathlib", n): getattr(pathlib, n) for n in ("PosixPath", "PurePosixPath", "PureWindowsPath")})
    allowed["pathlib", "WindowsPath"] = pathlib.PureWindowsPath  # a checkpoint_id saved on Windows, read here
    allowed.update({("builtins", n): getattr(builtins, n) for n in ("set", "frozenset")})
    allowed["collections", "OrderedDict"] = collections.OrderedDict
    return allowed


def _layout_named(name: str) -> torch.layout:
    """What ``torch.serialization._get_layout`` returns for a layout's name (``"torch.strided"``), nothing else."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise RefusedGlobal(f"torch.serialization._get_layout({name!r})", "not a torch layout")
    return layouts[name]


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with every global looked up in the allowlist and BUILD applied only to instances of
    DCP's own classes (never to a class: that would rewrite it for the rest of the process)."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        found = _dcp_globals().get((module, name))
        if found is None:
            raise RefusedGlobal(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedGlobal("a persistent id", "DCP's metadata has none")

    def load_build(self) -> None:
        inst = self.stack[-2]  # type: ignore[attr-defined]
        if type(inst) not in set(_dcp_classes().values()):
            raise RefusedGlobal(f"state set on {type(inst).__name__}", "only DCP's own classes carry state")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = load_build


def dcp_metadata(path: str, trust_pickle: bool = False) -> Any:
    """The ``.metadata`` of a DCP folder, unpickled by the allowlist (or, with ``trust_pickle``, by ``pickle``), and
    checked: each entry's data lies in a regular file of the folder, inside it, and every tensor declares no more
    bytes than its files hold. CheckpointError naming the file otherwise."""
    from ..doctor import _checks as _file_checks
    from ..errors import CheckpointError

    file = pathlib.Path(path) / ".metadata"
    _file_checks.expect_kind(file, ("pickle",), "DCP's metadata (a pickle)")
    data = _file_checks.read_small(file, _METADATA_BYTES)
    try:
        metadata = pickle.loads(data) if trust_pickle else _MetadataUnpickler(io.BytesIO(data)).load()
    except RefusedGlobal as e:
        raise CheckpointError(f"{file}: holds {e.qualname} ({e.why}), which the allowlist for DCP's metadata "
                              f"(torch {torch.__version__}) refuses to unpickle; nothing of it ran. Only if you trust "
                              "this folder: --trust-pickle (trust_pickle=True)", str(file)) from e
    except Exception as e:  # whatever a damaged or foreign pickle raises, the file is at fault
        raise _file_checks.unpickling_failed(file, e, trust_pickle) from e
    _check_dcp(pathlib.Path(path), file, metadata)
    return metadata


_METADATA_BYTES = 2 ** 30  # far beyond what DCP writes for the largest models (about 200 bytes per tensor chunk)


def _check_dcp(folder: pathlib.Path, file: pathlib.Path, metadata: Any) -> None:
    """Every storage entry names a regular file in ``folder`` (one path component) and lies inside it, none is
    stored through a DCP extension (compression), and no tensor declares more bytes than its entries hold."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    from ..doctor import _checks as _file_checks
    from ..errors import CheckpointError

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{file}: {what}; not read", str(file))

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise refuse(f"holds a {type(metadata).__name__}, not DCP's Metadata")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise refuse("its storage_data (where each entry's data lies) is missing")
    sizes: dict[str, int] = {}
    stored: dict[str, int] = {}
    spans: dict[str, list[tuple[int, int, str]]] = {}  # per file: (offset, end, entry) of every range declared in it
    for index, info in storage.items():
        rel, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        fqn = getattr(index, "fqn", None)
        if not isinstance(rel, str) or not isinstance(offset, int) or not isinstance(length, int) \
                or not isinstance(fqn, str):
            raise refuse(f"a storage entry of the wrong shape ({type(info).__name__})")
        if rel in ("", ".", "..") or "/" in rel or "\\" in rel or "\0" in rel:
            raise refuse(f"entry {fqn!r} names the file {rel!r}, which is not a file name inside the folder")
        if getattr(info, "transform_descriptors", None):
            raise refuse(f"entry {fqn!r} is stored through DCP extension(s) {list(info.transform_descriptors)} "
                         "(compression ...), which the doctor does not decode")
        if rel not in sizes:
            sizes[rel] = _file_checks.regular(folder / rel)
        if offset < 0 or length < 0 or offset + length > sizes[rel]:
            raise refuse(f"entry {fqn!r} declares bytes {offset}..{offset + length} of {rel}, which has "
                         f"{sizes[rel]} bytes")
        stored[fqn] = stored.get(fqn, 0) + length
        spans.setdefault(rel, []).append((offset, offset + length, fqn))
    for rel, ranges in spans.items():  # a range listed twice, or two that overlap, would count the same bytes twice
        ranges.sort()
        for (_, end, first), (start, _, second) in itertools.pairwise(ranges):
            if start < end:
                raise refuse(f"entries {first!r} and {second!r} declare overlapping bytes of {rel} (from {start})")
    for name, m in metadata.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            continue
        dtype, shape = getattr(m.properties, "dtype", None), m.size
        if not isinstance(dtype, torch.dtype) or not isinstance(shape, torch.Size) or any(d < 0 for d in shape):
            raise refuse(f"entry {name!r} declares no valid dtype and shape")
        need = math.prod(shape) * dtype.itemsize
        if need > stored.get(name, 0):
            raise refuse(f"entry {name!r} declares {need} bytes ({dtype} {list(shape)}) but its files hold "
                         f"{stored.get(name, 0)}")


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


@functools.cache
def _checked_reader() -> type:
    """``FileSystemReader`` whose ``read_metadata`` (what ``dcp.load`` calls) returns metadata :func:`dcp_metadata`
    read and checked, never unpickling the file itself, and whose ``_slice_file`` (private: one entry's bytes, which
    DCP hands to ``torch.load``) checks the entry's zip layout first."""
    try:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import StorageMeta
    except ImportError as e:  # pragma: no cover - every torch zero_buffers supports has it
        raise missing("torch", "torch.distributed.checkpoint.FileSystemReader", str(e)) from e
    if not callable(getattr(FileSystemReader, "_slice_file", None)):
        raise missing("torch", "FileSystemReader._slice_file (one entry's bytes of a .distcp file)")

    class CheckedReader(FileSystemReader):
        checked: Any = None

        def read_metadata(self) -> Any:  # no **kwargs: dcp.load then never asks for a rank's own .metadata
            metadata = self.checked
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            from ..doctor import _checks as _file_checks
            from ..errors import CheckpointError

            where = f"{pathlib.Path(self.path) / sinfo.relative_path} (bytes {sinfo.offset}..)"
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            if len(data) != sinfo.length:
                raise CheckpointError(f"{where}: {len(data)} of the {sinfo.length} bytes declared", where)
            view = io.BytesIO(data)
            _file_checks.check_zip(view, len(data), where)
            view.seek(0)
            return view
    return CheckedReader


def dcp_read(path: str, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]], trust_pickle: bool = False,
             metadata: Any = None) -> dict[str, torch.Tensor]:
    """Load ``entries`` of a DCP folder into fresh CPU tensors, in this process (``no_dist=True``), through the
    checked reader, with ``metadata`` from :func:`dcp_metadata` (read here when not given). Whatever fails is a
    CheckpointError naming the folder (DCP wraps its readers' errors in a ``CheckpointException``, a
    BaseException: unwrapped here)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ..errors import CheckpointError

    checked = metadata if metadata is not None else dcp_metadata(path, trust_pickle)
    out = {name: torch.empty(shape, dtype=dtype) for name, (dtype, shape) in entries.items()}
    if not out:
        return out
    reader = _checked_reader()(path)
    reader.checked = checked
    held = sorted({info.relative_path for index, info in checked.storage_data.items() if index.fqn in out})
    where = str(pathlib.Path(path) / held[0]) if held else path
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled ... single process"
            dcp.load(out, storage_reader=reader, no_dist=True)
    except CheckpointException as e:
        causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        known = next((c for c in causes if isinstance(c, CheckpointError)), None)
        if known is not None:
            raise known from e
        raise CheckpointError(f"{where}: DCP could not read {', '.join(list(out)[:3])}: "
                              f"{_reason(causes[0] if causes else e)}", where) from e
    except CheckpointError:
        raise
    except Exception as e:  # a damaged entry: the folder is at fault
        raise CheckpointError(f"{where}: DCP could not read {', '.join(list(out)[:3])}: {_reason(e)}", where) from e
    return out


def _reason(e: BaseException) -> str:
    """One line on why an entry could not be read (torch's weights_only refusal named by its global)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if "Weights only load failed" in text:
        what = f"the Python object {found.group(1)}" if found else "Python objects"
        return f"its data holds {what}, which weights_only=True refuses to unpickle"
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


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


def placements(t: Any) -> tuple[tuple[str, Any], ...]:
    """A DTensor's placements as data, one per dimension of its mesh: ``("R", None)``, ``("S", tensor dim)`` or
    ``("P", reduce op)`` (``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ...). Public API: ``DTensor.placements``,
    ``Placement.is_replicate / is_shard / is_partial``, ``Shard.dim``, ``Partial.reduce_op``."""
    out: list[tuple[str, Any]] = []
    for p in t.placements:
        if p.is_replicate():
            out.append(("R", None))
        elif p.is_partial():
            out.append(("P", str(p.reduce_op)))
        elif p.is_shard():
            out.append(("S", int(p.dim)))
        else:
            out.append(("?", type(p).__name__))
    return tuple(out)


def placement_rule(value: Any) -> tuple[str, Any] | None:
    """A placement object (``Replicate()``, ``Partial(op)``, ``Shard(d)``) as :func:`placements` writes it; None for
    anything else."""
    if not _is(value, "Placement", "torch.distributed.tensor"):
        return None
    if value.is_replicate():
        return ("R", None)
    if value.is_partial():
        return ("P", str(value.reduce_op))
    if value.is_shard():
        return ("S", int(value.dim))
    return ("?", type(value).__name__)


def local_tensor(t: Any) -> torch.Tensor:
    """A DTensor's local tensor, the storage it holds on this rank: writes to it are writes to the DTensor. Public:
    ``DTensor.to_local()`` (a view, outside autograd)."""
    with torch.no_grad():
        return t.to_local()


def mark_replicated(t: Any, dims: Sequence[int]) -> Callable[[], None]:
    """Relabel the mesh dimensions ``dims`` of DTensor ``t`` Replicate, in place (its local tensor now holds the
    reduced value there): the object stays the same, so modules and optimizers that hold it see the change. Returns
    what puts the old placements back. Private: ``DTensor._spec`` (a ``DTensorSpec`` dataclass with ``placements``)."""
    from torch.distributed.tensor import Replicate
    spec = getattr(t, "_spec", None)
    if spec is None or not dataclasses.is_dataclass(spec) or not hasattr(spec, "placements"):
        raise missing("torch", "DTensor._spec (a DTensorSpec dataclass with placements)")
    new = tuple(Replicate() if i in dims else p for i, p in enumerate(spec.placements))
    t._spec = dataclasses.replace(spec, placements=new)  # type: ignore[type-var]

    def undo() -> None:
        t._spec = spec
    return undo


def device_mesh(t: Any) -> Any:
    """A DTensor's DeviceMesh (public: ``DTensor.device_mesh``)."""
    return t.device_mesh


def mesh_layout(mesh: Any) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """A DeviceMesh as data: its dimension names (``dim0``... when unnamed), its shape, and the global rank at each
    position in row-major order. Public: ``mesh_dim_names``, ``mesh`` (the rank tensor)."""
    shape = tuple(int(s) for s in mesh.mesh.shape)
    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(len(shape))))
    return names, shape, tuple(int(r) for r in mesh.mesh.flatten().tolist())


def mesh_dim_group(mesh: Any, dim: int) -> Any:
    """The process group of this rank's line along mesh dimension ``dim`` (members ordered by coordinate)."""
    return mesh.get_group(dim)

_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether this thread runs inside the autograd engine's backward pass: where activation checkpointing recomputes
    forwards (reentrant: ``CheckpointFunction.backward``; non-reentrant: the saved-tensor unpack hook). Uses
    ``torch._C._current_graph_task_id()`` (-1 outside a backward)."""
    if _GRAPH_TASK_ID is None:
        raise missing("torch", "torch._C._current_graph_task_id (telling a checkpoint's recompute from a forward)")
    return bool(_GRAPH_TASK_ID() != -1)


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


def patch_module_apply(make: Callable[[Any], Any]) -> Callable[[], None]:
    """Replace ``nn.Module._apply`` (what ``half()``, ``bfloat16()``, ``to()``, ``type()``, ``cuda()``, ``to_empty()``
    run, on each module of the tree: a parent calls ``child._apply(fn)``) with ``make(original)``; returns the undo.
    Relies on ``_apply(self, fn, recurse=True)`` writing each buffer as ``self._buffers[key] = fn(buf)``."""
    from torch import nn

    params = list(inspect.signature(vars(nn.Module).get("_apply", lambda: None)).parameters)
    if params[:3] != ["self", "fn", "recurse"]:
        raise missing("torch", "nn.Module._apply(self, fn, recurse=True)")
    return replace(nn.Module, "_apply", make)


def patch_batchnorm_forward(make: Callable[[Any], Any]) -> Callable[[], None]:
    """Replace ``torch.nn.modules.batchnorm._BatchNorm.forward`` (the forward of BatchNorm1d/2d/3d and their lazy
    forms) with ``make(original)``; returns the undo."""
    from torch.nn.modules import batchnorm

    base = getattr(batchnorm, "_BatchNorm", None)
    if not isinstance(base, type):
        raise missing("torch", "torch.nn.modules.batchnorm._BatchNorm")
    return replace(base, "forward", make)


# -- torch.distributed.checkpoint: the model loads install() follows ------------------------------------------------
def patch_model_state_dict_load(make: Callable[[Any], Any]) -> Callable[[], None]:
    """Replace ``torch.distributed.checkpoint.state_dict._load_model_state_dict(model, state_dict, info)``, the one
    function ``set_model_state_dict`` and ``set_state_dict`` load a model through (they look it up as a module
    global at each call, so a caller's own ``from ... import set_model_state_dict`` is covered), with
    ``make(original)``; returns the undo. Relies on ``info.broadcast_from_rank0`` (:func:`broadcasts_from_rank0`)."""
    from torch.distributed.checkpoint import state_dict as dsd

    original = vars(dsd).get("_load_model_state_dict")
    if not signature_starts(original, ("model", "state_dict", "info")):
        raise missing("torch", "torch.distributed.checkpoint.state_dict._load_model_state_dict(model, state_dict, "
                      "info)")
    if not {"broadcast_from_rank0", "full_state_dict"} <= state_dict_options():
        raise missing("torch", "StateDictOptions.broadcast_from_rank0 / full_state_dict")
    return replace_global(dsd, "_load_model_state_dict", make)


def state_dict_options() -> set[str]:
    """The fields of ``torch.distributed.checkpoint.state_dict.StateDictOptions`` (empty where torch has none)."""
    try:
        from torch.distributed.checkpoint import state_dict as dsd
    except ImportError:
        return set()
    return set(getattr(getattr(dsd, "StateDictOptions", None), "__dataclass_fields__", {}))


def broadcasts_from_rank0(info: Any) -> bool:
    """Whether a ``_StateDictInfo`` (the options ``set_model_state_dict`` was given) loaded the model from rank 0's
    state dict broadcast over the default group (``StateDictOptions(full_state_dict=True,
    broadcast_from_rank0=True)``, and the call loads a model: ``handle_model``, False for optimizer-only calls)."""
    flag, handles = getattr(info, "broadcast_from_rank0", None), getattr(info, "handle_model", None)
    if not isinstance(flag, bool) or not isinstance(handles, bool):
        raise missing("torch", "_StateDictInfo.broadcast_from_rank0 / handle_model")
    return flag and handles


def patch_model_state_dict_get(make: Callable[[Any], Any]) -> Callable[[], None]:
    """Replace ``torch.distributed.checkpoint.state_dict._get_model_state_dict(model, info)``, what
    ``get_model_state_dict`` and ``get_state_dict`` build a model's state dict with, by ``make(original)``."""
    from torch.distributed.checkpoint import state_dict as dsd

    if not signature_starts(vars(dsd).get("_get_model_state_dict"), ("model", "info")):
        raise missing("torch", "torch.distributed.checkpoint.state_dict._get_model_state_dict(model, info)")
    return replace_global(dsd, "_get_model_state_dict", make)


def patch_dcp_load(make: Callable[[Any], Any]) -> Callable[[], None]:
    """Replace ``torch.distributed.checkpoint.load`` (``state_dict_loader.load(state_dict, *, ...,
    process_group=None, ...)``; the package re-exports the same function, both names are replaced) by
    ``make(original)``. A caller that bound ``load`` by name before is not covered; ``dcp.load(...)`` is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict_loader

    original = vars(state_dict_loader).get("load")
    if original is None or not signature_starts(original, ("state_dict",)) or "process_group" not in (
            inspect.signature(original).parameters):
        raise missing("torch", "torch.distributed.checkpoint.state_dict_loader.load(state_dict, *, process_group)")
    if vars(dcp).get("load") is not original:
        raise missing("torch", "torch.distributed.checkpoint.load as state_dict_loader.load")
    replaced = make(original)
    undos = [replace_global(state_dict_loader, "load", lambda _: replaced),
             replace_global(dcp, "load", lambda _: replaced)]

    def undo() -> None:
        for u in reversed(undos):
            u()
    return undo

