"""Private: what a checkpoint on disk is (its kind, its files, which are ranks), lazy readers and atomic writers.

The kinds, as DeepSpeed 0.16-0.19, Accelerate 1.x and torch 2.13 write them:

- DeepSpeed ZeRO-3 folder: ``<root>/latest`` names the tag; ``<root>/<tag>/zero_pp_rank_{r}_mp_rank_00_model_states.pt``
  per data-parallel rank, whose ``module`` holds that rank's own buffers (parameters are empty placeholders) and
  ``buffer_names`` lists them; ``*_optim_states.pt`` hold the weights and optimizer state (no buffers).
- DeepSpeed ZeRO-1/2 folder: one ``mp_rank_00_model_states.pt``, written by rank 0 only.
- Accelerate ``save_state`` folder: ``model.safetensors`` / ``pytorch_model.bin`` from the main process only.
- torch DCP folder: ``.metadata`` and ``__{rank}_{n}.distcp``: one copy of each replicated entry, spread over ranks.
- Per-rank files: tensor files whose names differ only by the rank number (``rank0.pt``, ``rank1.pt`` ...).
- One state dict: a ``.pt`` / ``.bin`` / ``.pth`` / ``.safetensors`` file.
"""
from __future__ import annotations

import itertools
import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from . import _checks as _file_checks, _words

TENSOR_SUFFIXES = (*_file_checks.TORCH_SUFFIXES, ".safetensors")
_ZERO3_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_ZERO12_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
# what writers raise on a full disk or a size limit: OSError from Python, RuntimeError from torch's zip writer
WRITE_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError, ValueError)


def write_errors() -> tuple[type[BaseException], ...]:
    """WRITE_ERRORS and safetensors' own error type (what ``save_file`` raises on an I/O failure)."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return WRITE_ERRORS
    return (*WRITE_ERRORS, SafetensorError)


def _safetensors() -> Any:
    """The safetensors package, or DependencyError."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError as e:
        from .._compat import missing
        raise missing("safetensors", "safetensors.safe_open to read .safetensors files",
                      "pip install safetensors") from e
    return safetensors


@dataclass(frozen=True)
class StateFile:
    """One state dict on disk. ``inner`` is the key holding it inside the file (``"module"`` for DeepSpeed)."""

    path: Path
    label: str
    rank: int | None
    format: str  # "torch" | "safetensors" | "dcp"
    inner: str | None = None


@dataclass(frozen=True)
class Layout:
    """What ``path`` holds. ``per_rank``: each file is one rank's copy of the same state dict. ``unit`` is the folder a
    repair rewrites (the tag folder of a DeepSpeed root); ``notes`` say what the kind does and does not keep."""

    kind: str
    path: Path
    unit: Path
    files: tuple[StateFile, ...]
    per_rank: bool
    tag: str | None = None
    notes: tuple[str, ...] = ()


@dataclass
class Tensors:
    """A lazy view of one state dict: ``meta`` name -> (dtype, shape) without reading data; ``get`` reads one entry."""

    meta: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    get: Callable[[str], torch.Tensor]
    buffer_names: tuple[str, ...] | None  # DeepSpeed's list of buffers; None when every entry may be one


# -- finding the kind ------------------------------------------------------------------------------------------------

def locate(path: str | os.PathLike, tag: str | None = None, trust_pickle: bool = False) -> Layout:
    """The layout of ``path``; raises CheckpointError naming the file when it is not a checkpoint we can read."""
    p = Path(path)
    if not os.path.lexists(p):
        raise CheckpointError(f"{p}: no such file or folder", str(p))
    if not p.is_dir():
        _file_checks.regular(p)  # a FIFO, a device, a link loop or a dangling link: refused by name
        return _single(p, p.parent, "state dict file")
    if os.path.lexists(p / ".metadata"):
        return _dcp(p)
    latest = p / "latest"
    if tag is not None or os.path.lexists(latest):
        chosen = _tag(tag, _words.tag(tag)) if tag is not None else _tag(_read_latest(latest), str(latest))
        if not (p / chosen).is_dir():
            where = _words.Said(_words.tag(tag), ":") if tag is not None else f"{latest} names tag {chosen!r}, but"
            raise CheckpointError(_words.Said(where, f" there is no folder {p / chosen}; {_tags_found(p)}"),
                                  str(p / chosen))
        inner = _deepspeed(p / chosen, p, trust_pickle)
        return Layout(inner.kind, p, inner.unit, inner.files, inner.per_rank, chosen, inner.notes)
    if any(_ZERO3_FILE.match(f.name) or _ZERO12_FILE.match(f.name) for f in p.iterdir()):
        return _deepspeed(p, p, trust_pickle)
    if (p / "random_states_0.pkl").is_file() or (p / "optimizer.bin").is_file():
        return _accelerate(p)
    return _folder(p)


_LATEST_BYTES = 4096


def _read_latest(latest: Path) -> str:
    """DeepSpeed's ``latest``: the tag, as text, in a small regular file."""
    data = _file_checks.read_small(latest, _LATEST_BYTES)
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{latest}: not text (DeepSpeed writes the tag's name here)", str(latest)) from e


def _tag(tag: str, where: str | _words.Arg) -> str:
    """A tag names one folder inside the checkpoint: one path component, not "..", no separator."""
    if tag in ("", ".", "..") or any(c in tag for c in "/\\\0") or not tag.isprintable():
        raise CheckpointError(_words.Said(where, f": names the tag {tag[:80]!r}, which is not one folder name inside "
                                          "the checkpoint"), str(where) if isinstance(where, str) else None)
    return tag


def _tags_found(root: Path) -> str:
    """The tag folders of a DeepSpeed root (folders holding its model-states files), in words."""
    try:
        tags = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and any(
            _ZERO3_FILE.match(f.name) or _ZERO12_FILE.match(f.name) for f in d.iterdir()))
    except OSError:
        tags = []
    if not tags:
        return f"{root} holds no tag folder (none with DeepSpeed's model-states files)"
    shown = ", ".join(tags[:10]) + (f" and {len(tags) - 10} more" if len(tags) > 10 else "")
    return f"the tags in {root}: {shown}"


def _single(file: Path, unit: Path, kind: str, notes: tuple[str, ...] = ()) -> Layout:
    fmt = "safetensors" if file.suffix == ".safetensors" else "torch"
    return Layout(kind, file, unit, (StateFile(file, file.name, None, fmt),), False, None, notes)


def _deepspeed(folder: Path, path: Path, trust_pickle: bool) -> Layout:
    """A DeepSpeed tag folder: ZeRO-3 (one model-states file per rank) or ZeRO-1/2 (rank 0's only)."""
    zero3: dict[int, dict[int, Path]] = {}
    for f in folder.iterdir():
        m = _ZERO3_FILE.match(f.name)
        if m:
            zero3.setdefault(int(m.group(2)), {})[int(m.group(1))] = f
    if zero3:
        if set(zero3) != {0}:
            raise CheckpointError(f"{folder}: model-parallel ranks {sorted(zero3)} (mp_rank_01 and up) are not "
                                  "supported; only data-parallel ZeRO-3 folders (mp_rank_00)", str(folder))
        ranks = zero3[0]
        expected, _ = _ds_record(ranks[min(ranks)], trust_pickle)
        _check_ranks(folder, ranks, expected, "zero_pp_rank_{}_mp_rank_00_model_states.pt")
        files = tuple(StateFile(ranks[r], f"rank {r}", r, "torch", "module") for r in sorted(ranks))
        return Layout("DeepSpeed ZeRO-3", path, folder, files, True, None,
                      ("one model-states file per data-parallel rank, each with that rank's own buffers "
                       "(zero_to_fp32 and the 16-bit export take rank 0's)",))
    single = folder / "mp_rank_00_model_states.pt"
    if not os.path.lexists(single):
        raise CheckpointError(f"{folder}: a DeepSpeed folder without mp_rank_00_model_states.pt or "
                              "zero_pp_rank_*_mp_rank_00_model_states.pt", str(folder))
    world, stage = _ds_record(single, trust_pickle)
    others = f"the other {world - 1} rank(s)' buffers were never written" if world and world > 1 else \
        "other ranks' buffers, if any, were never written"
    return Layout(f"DeepSpeed ZeRO-{stage}" if stage in (0, 1, 2) else "DeepSpeed ZeRO-1/2", path, folder,
                  (StateFile(single, single.name, 0, "torch", "module"),), False, None,
                  (f"one model file, written by rank 0 alone: it holds rank 0's buffers; {others}, so there is "
                   "nothing per rank to compare or merge (recompute the statistics after loading)",))


def _ds_record(file: Path, trust_pickle: bool) -> tuple[int | None, int | None]:
    """``dp_world_size`` and the ZeRO stage a DeepSpeed model-states file records (None where absent), one read."""
    record = _open_torch(file, trust_pickle)
    if not isinstance(record, Mapping):
        raise CheckpointError(f"{file}: holds a {type(record).__name__}, not DeepSpeed's model states (a dict)",
                              str(file))
    world = record.get("dp_world_size")
    config = record.get("ds_config")
    zero = config.get("zero_optimization", {}) if isinstance(config, Mapping) else None
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else None  # legacy configs hold a bool there
    return (world if isinstance(world, int) else None), (stage if isinstance(stage, int) else None)


def _check_ranks(folder: Path, ranks: Mapping[int, Path], expected: int | None, template: str) -> None:
    """Ranks 0..n-1 present, none missing, none past the recorded world size."""
    n = expected if expected else max(ranks) + 1
    present = sum(1 for r in ranks if 0 <= r < n)
    if present < n:  # named without walking every rank a file may record (10**12 of them, say)
        first = list(itertools.islice((r for r in range(n) if r not in ranks), 4))
        names = ", ".join(template.format(r) for r in first)
        more = f" and {n - present - len(first)} more" if n - present > len(first) else ""
        raise CheckpointError(f"{folder}: rank file(s) missing for rank(s) {first}{more} of {n} ({names})",
                              str(folder / template.format(first[0])))
    extra = sorted(r for r in ranks if r >= n)
    if extra:
        raise CheckpointError(f"{folder}: rank file(s) for rank(s) {extra}, but the checkpoint records a "
                              f"data-parallel world of {n} ({ranks[extra[0]].name})", str(ranks[extra[0]]))


def _dcp(folder: Path) -> Layout:
    files = (StateFile(folder, folder.name, None, "dcp"),)
    return Layout("torch DCP", folder, folder, files, False, None,
                  ("one copy of each replicated entry, written by whichever rank the planner picked: the "
                   "statistics of one BatchNorm layer can come from different ranks, and nothing per rank is kept",))


def _accelerate(folder: Path) -> Layout:
    models = sorted(f for f in folder.iterdir() if not f.is_dir() and re.match(
        r"^(model|pytorch_model)(_\d+)?\.(safetensors|bin)$", f.name))
    if not models:
        raise CheckpointError(f"{folder}: an Accelerate save_state folder without model.safetensors or "
                              "pytorch_model.bin", str(folder))
    first = models[0]  # model_1.safetensors ... are other prepared models (an EMA copy ...), not copies of this one
    others = f"; other prepared models, read them by path: {', '.join(f.name for f in models[1:])}" if models[1:] \
        else ""
    return Layout("Accelerate save_state", folder, folder,
                  (StateFile(first, first.name, None, "safetensors" if first.suffix == ".safetensors" else "torch"),),
                  False, None, ("the model was written by the main process only: it holds rank 0's buffers, the other "
                                f"ranks' were never written{others}",))


def _folder(folder: Path) -> Layout:
    """Tensor files whose names differ only by a number: one per rank. One tensor file: a single state dict."""
    tensors = sorted(f for f in folder.iterdir() if f.suffix in TENSOR_SUFFIXES and not f.is_dir())
    if not tensors:
        raise CheckpointError(f"{folder}: no checkpoint here (no DeepSpeed, DCP or Accelerate folder, no "
                              f"{'/'.join(TENSOR_SUFFIXES)} files)", str(folder))
    groups: dict[str, dict[int, Path]] = {}
    for f in tensors:
        runs = list(re.finditer(r"\d+", f.name))
        if runs:
            last = runs[-1]
            template = f.name[:last.start()] + "{}" + f.name[last.end():]
            groups.setdefault(template, {})[int(last.group())] = f
    ranked = {t: g for t, g in groups.items() if len(g) > 1}
    if len(ranked) == 1:
        template, ranks = next(iter(ranked.items()))
        _check_ranks(folder, ranks, None, template)
        fmt = "safetensors" if template.endswith(".safetensors") else "torch"
        files = tuple(StateFile(ranks[r], f"rank {r}", r, fmt) for r in sorted(ranks))
        return Layout("per-rank files", folder, folder, files, True, None,
                      (f"{len(files)} files {template.format('{rank}')}, one per rank",))
    if len(tensors) == 1:
        return _single(tensors[0], folder, "state dict file")
    raise CheckpointError(f"{folder}: cannot tell which files are ranks: {len(tensors)} tensor files "
                          f"({', '.join(f.name for f in tensors[:5])}) are not one name with a rank number; "
                          "name the files to compare instead", str(folder))


# -- reading ---------------------------------------------------------------------------------------------------------

def _open_torch(file: Path, trust_pickle: bool) -> Any:
    """``torch.load`` lazily (mmap for zip archives), ``weights_only`` unless the caller trusts the file; the file
    must be a regular file holding a torch zip archive laid out as torch writes one, or a (legacy) pickle."""
    kind, size = _file_checks.expect_kind(file, ("zip", "pickle"), "a torch checkpoint")
    zipped = kind == "zip"
    if zipped:
        with open(file, "rb") as f:
            _file_checks.check_zip(f, size, str(file))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Detected pickle protocol 4 ..." on legacy pickles
            return torch.load(file, map_location="cpu", weights_only=not trust_pickle, mmap=zipped)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
            what = f"the Python object {found.group(1)}" if found else "Python objects (or an old-format pickle)"
            raise CheckpointError(_words.Said(f"{file}: holds {what}, which weights_only=True refuses to unpickle. "
                                              "Only if you trust this file: ", _words.TRUST_PICKLE), str(file)) from e
        if trust_pickle:
            raise _file_checks.unpickling_failed(file, e, True) from e
        raise CheckpointError(f"{file}: not a torch checkpoint ({_words.reason(e)})", str(file)) from e
    except Exception as e:  # whatever torch.load raises on a damaged or foreign file: the file is at fault
        if trust_pickle and not isinstance(e, (RuntimeError, EOFError, OSError, zipfile.BadZipFile)):
            raise _file_checks.unpickling_failed(file, e, True) from e  # a class not here, a failing __setstate__
        state = "a truncated or corrupt torch checkpoint" if zipped else "a damaged torch checkpoint (legacy pickle)"
        raise CheckpointError(f"{file}: {state}: {_words.reason(e)}", str(file)) from e


def check_crc(sf: StateFile) -> None:
    """Read every member of a torch zip checkpoint and check its CRC-32 (torch's mmap reader does not)."""
    if sf.format != "torch":
        return
    kind, size = _file_checks.expect_kind(sf.path, ("zip", "pickle"), "a torch checkpoint")
    if kind != "zip":
        return
    with open(sf.path, "rb") as f:
        _file_checks.check_zip(f, size, str(sf.path))  # every member stored and inside the file: testzip reads <= size
    try:
        with zipfile.ZipFile(sf.path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"{sf.path}: a truncated or corrupt torch checkpoint: {_words.reason(e)}",
                              str(sf.path)) from e
    if bad is not None:
        raise CheckpointError(f"{sf.path}: corrupt: the archive member {bad} fails its CRC-32 check", str(sf.path))


def _state_dict(obj: Any, sf: StateFile) -> tuple[Mapping[str, Any], tuple[str, ...] | None]:
    """The state dict inside a loaded file, and DeepSpeed's ``buffer_names`` when it has them."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{sf.path}: holds a {type(obj).__name__}, not a state dict", str(sf.path))
    names = obj.get("buffer_names") if sf.inner == "module" else None
    if sf.inner is not None:
        inner = obj.get(sf.inner)
        if not isinstance(inner, Mapping):
            raise CheckpointError(f"{sf.path}: no {sf.inner!r} state dict inside", str(sf.path))
        return inner, tuple(names) if isinstance(names, list) else None
    for key in ("state_dict", "module", "model", "model_state_dict"):  # Lightning, DeepSpeed, training scripts
        inner = obj.get(key)  # first: {"model": sd, "rng": torch.get_rng_state()} is a checkpoint, not a state dict
        if isinstance(inner, Mapping) and any(torch.is_tensor(v) for v in inner.values()):
            names = obj.get("buffer_names")
            return inner, tuple(names) if key == "module" and isinstance(names, list) else None
    if any(torch.is_tensor(v) for v in obj.values()):
        return obj, None
    raise CheckpointError(f"{sf.path}: holds no tensors (keys: {', '.join(map(str, list(obj)[:8]))})", str(sf.path))


@contextmanager
def open_tensors(sf: StateFile, trust_pickle: bool = False) -> Iterator[Tensors]:
    """A lazy view of ``sf``'s state dict; the file stays open (mapped) inside the ``with``."""
    if sf.format == "torch":
        sd, names = _state_dict(_open_torch(sf.path, trust_pickle), sf)
        entries = {k: v for k, v in sd.items() if torch.is_tensor(v)}
        named = next((k for k in entries if not isinstance(k, str)), None)
        if named is not None:
            raise CheckpointError(f"{sf.path}: the state dict names an entry by the {type(named).__name__} "
                                  f"{named!r}; a state dict names its entries by strings", str(sf.path))
        yield Tensors({k: (v.dtype, tuple(v.shape)) for k, v in entries.items()}, entries.__getitem__, names)
    elif sf.format == "safetensors":
        st = _safetensors()
        _file_checks.expect_kind(sf.path, ("safetensors",), "a safetensors file")
        try:
            handle = st.safe_open(str(sf.path), framework="pt")
            f = handle.__enter__()
            meta = {}
            for k in f.keys():  # noqa: SIM118 - safe_open is not iterable
                s = f.get_slice(k)
                meta[k] = (_SAFE_DTYPES[s.get_dtype()], tuple(s.get_shape()))
        except KeyError as e:  # a dtype this reader does not know
            raise CheckpointError(f"{sf.path}: holds an entry of a dtype this reader does not know "
                                  f"({e.args[0] if e.args else '?'})", str(sf.path)) from e
        except Exception as e:  # SafetensorError, ...: the file is at fault
            raise CheckpointError(f"{sf.path}: not a readable safetensors file ({_words.reason(e)})",
                                  str(sf.path)) from e
        try:
            yield Tensors(meta, f.get_tensor, None)
        finally:
            handle.__exit__(None, None, None)
    else:
        from .._compat import torch as compat

        metadata = compat.dcp_metadata(str(sf.path), trust_pickle)
        meta = compat.dcp_tensors(metadata)
        cache: dict[str, torch.Tensor] = {}

        def get(name: str) -> torch.Tensor:
            if name not in cache:
                cache.update(compat.dcp_read(str(sf.path), {name: meta[name]}, trust_pickle, metadata))
            return cache[name]
        yield Tensors(meta, get, None)


_SAFE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                "C64": torch.complex64, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}


def dcp_writers(sf: StateFile, trust_pickle: bool = False) -> dict[str, set[int]]:
    """For a DCP folder: entry -> ranks whose files hold it."""
    from .._compat import torch as compat

    return compat.dcp_writers(compat.dcp_metadata(str(sf.path), trust_pickle))


# -- writing ---------------------------------------------------------------------------------------------------------

def rewrite(sf: StateFile, target: Path, values: Mapping[str, torch.Tensor], trust_pickle: bool) -> None:
    """Write ``sf``'s file to ``target`` with the entries in ``values`` replaced; everything else as it was."""
    if sf.format == "torch":
        obj = _open_torch(sf.path, trust_pickle)
        sd, _ = _state_dict(obj, sf)
        for k, v in values.items():
            sd[k] = v  # type: ignore[index]
        torch.save(obj, target)
    else:
        st = _safetensors()
        with st.safe_open(str(sf.path), framework="pt") as f:
            tensors = {k: values[k] if k in values else f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            metadata = f.metadata()
        st.torch.save_file(tensors, str(target), metadata=metadata)
    _fsync(target)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
