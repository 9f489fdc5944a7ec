"""Private distributed plumbing: group resolution, buffer collection, structure agreement, bucketed collectives."""
from __future__ import annotations

import datetime
import hashlib
import math
import operator
import os
import pickle
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import (
    BufferStructureError,
    CollectiveError,
    DistributedSetupError,
    InvalidArgumentError,
    InvalidSourceRankError,
    UnsupportedDeviceError,
    ZeroBuffersError,
)

Timeout = float | datetime.timedelta | None

# c10d adds a wait's timeout to a nanosecond steady clock, which overflows (and then "times out" at
# once) from about 1e10 s; check_timeout treats timeouts of this many seconds (11.6 days) or more as none.
_MAX_WAIT_S = 1e6


@dataclass(frozen=True)
class Group:
    """A process group resolved for one call: this rank's place in it and the backend's device."""

    pg: Any
    rank: int
    ranks: tuple[int, ...]
    backend: str

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def device(self) -> torch.device:
        """Device for the small control tensors (nccl only carries CUDA tensors)."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def resolve_group(group: Any = None) -> Group | None:
    """Resolve ``group``; ``None`` means nothing to synchronise (not distributed, world 1, or not a member)."""
    if dist.is_available() and not (group is None or group is dist.GroupMember.NON_GROUP_MEMBER
                                    or isinstance(group, dist.ProcessGroup)):
        raise InvalidArgumentError(
            f"group must be a torch.distributed ProcessGroup (or None for the default group), got "
            f"{type(group).__name__} {group!r:.60}")
    if not (dist.is_available() and dist.is_initialized()):
        env_world = os.environ.get("WORLD_SIZE", "1").strip() or "1"
        if env_world.isdigit() and int(env_world) > 1:
            raise DistributedSetupError(
                f"WORLD_SIZE={env_world} is set but torch.distributed has no process group; call "
                "torch.distributed.init_process_group (or deepspeed.init_distributed) first"
            )
        return None
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    pg = group if group is not None else dist.group.WORLD
    try:
        ranks = tuple(dist.get_process_group_ranks(pg))
    except (KeyError, RuntimeError, ValueError) as e:
        raise InvalidArgumentError(f"group {pg!r:.60} is not a live process group (destroyed?): {e}") from e
    if len(ranks) <= 1:
        return None
    return Group(pg=group, rank=dist.get_rank(), ranks=ranks, backend=str(dist.get_backend(pg)))


def check_rank_arg(value: Any, name: str, fn: str, *, optional: bool = False) -> int | None:
    """``value`` as a non-negative int rank (ints, NumPy ints, 0-dim integer tensors; None when ``optional``),
    else InvalidSourceRankError: at call time."""
    if value is None and optional:
        return None
    try:
        rank = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        rank = None
    if rank is None or rank < 0:
        raise InvalidSourceRankError(f"{fn}(): {name} must be a non-negative int rank{' or None' if optional else ''}, "
                                     f"got {value!r:.40}")
    return rank


def check_src(g: Group | None, src: int) -> None:
    """Raise InvalidSourceRankError unless ``src`` is a global rank in the group (before any collective)."""
    if isinstance(src, bool) or not isinstance(src, int):
        raise InvalidSourceRankError(f"src must be an int global rank, got {src!r}")
    if g is None:
        if dist.is_available() and dist.is_initialized():
            return  # not a member of the group, or world 1: the call is a no-op
        if src != 0:
            raise InvalidSourceRankError(f"src={src} but torch.distributed is not initialised (the only rank is 0)")
        return
    if src not in g.ranks:
        world = dist.get_world_size()
        where = f"out of range for world size {world}" if not 0 <= src < world else f"not in the group {list(g.ranks)}"
        raise InvalidSourceRankError(f"src={src} is {where} (rank {g.rank})")


def check_module(module: Any, fn: str) -> nn.Module:
    """Raise InvalidArgumentError unless ``module`` is an nn.Module."""
    if isinstance(module, nn.Module):
        return module
    if isinstance(module, torch.Tensor):
        hint = " (pass the module that owns it, not a parameter or tensor)"
    elif isinstance(module, Iterable) and not isinstance(module, (str, bytes)):
        hint = " (pass the module itself, not module.parameters()/buffers() or a list; wrap several in nn.ModuleList)"
    else:
        hint = ""
    raise InvalidArgumentError(f"{fn}() expects a torch.nn.Module, got {type(module).__name__}{hint}")


def check_ignore(ignore: Any, fn: str) -> tuple[str, ...]:
    """Raise InvalidArgumentError unless ``ignore`` is an iterable of str (a bare str is refused, not split)."""
    if isinstance(ignore, (str, bytes)):
        raise InvalidArgumentError(
            f"{fn}(): ignore must be a collection of buffer names or module paths, got the bare string {ignore!r}; "
            f"write ignore=({ignore!r},)")
    if not isinstance(ignore, Iterable):
        raise InvalidArgumentError(f"{fn}(): ignore must be a collection of str, got {type(ignore).__name__}")
    names = tuple(ignore)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise InvalidArgumentError(f"{fn}(): ignore must hold str names, got {type(bad[0]).__name__} {bad[0]!r}")
    return names


def check_timeout(timeout: Any, fn: str) -> datetime.timedelta | None:
    """Normalise ``timeout`` (seconds > 0 or a timedelta; None, inf, >= _MAX_WAIT_S: none) or InvalidArgumentError."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise InvalidArgumentError(
            f"{fn}(): timeout must be seconds (a number > 0), a datetime.timedelta or None, got "
            f"{type(timeout).__name__} {timeout!r:.40}")
    if math.isnan(seconds) or seconds <= 0:
        raise InvalidArgumentError(f"{fn}(): timeout must be > 0 seconds (None waits forever), got {timeout!r}")
    return None if seconds >= _MAX_WAIT_S else datetime.timedelta(seconds=seconds)


_PASS_THROUGH = {"DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "PipelineEngine"}
_SHARDED = {"FullyShardedDataParallel", "FSDPModule"}


def unwrap(module: nn.Module, fn: str) -> nn.Module:
    """The module that holds the layers: strips DDP, DataParallel, DeepSpeed engines and torch.compile wrappers."""
    while True:
        names = {c.__name__ for c in type(module).__mro__}
        if names & _SHARDED:
            raise InvalidArgumentError(
                f"{fn}(): FSDP-sharded modules are not supported (their forward and state_dict gather parameters "
                "across ranks); use DDP, DeepSpeed or a plain module")
        if names & _PASS_THROUGH and isinstance(getattr(module, "module", None), nn.Module):
            module = module.module
        elif "OptimizedModule" in names and isinstance(getattr(module, "_orig_mod", None), nn.Module):
            module = module._orig_mod
        else:
            return module


def is_member(group: Any) -> bool:
    """False only when torch.distributed is initialised and this rank is outside ``group``."""
    if not (dist.is_available() and dist.is_initialized()) or group is None:
        return True
    return group is not dist.GroupMember.NON_GROUP_MEMBER and dist.get_rank(group) >= 0


def _ignored(name: str, ignore: frozenset[str]) -> bool:
    """True when ``name`` or one of its module prefixes is in ``ignore``."""
    if name in ignore:
        return True
    parts = name.split(".")
    return any(".".join(parts[:i]) in ignore for i in range(1, len(parts)))


def named_buffers(module: nn.Module, *, ignore: Iterable[str] = (), include_parameters: bool = False,
                  persistent_only: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Buffers (then plain, non-ZeRO parameters if asked) by qualified name; None and aliases skipped."""
    skip = frozenset(check_ignore(ignore, "named_buffers"))
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for mod_name, mod in module.named_modules(remove_duplicate=True):
        for key, buf in mod._buffers.items():
            if buf is None or id(buf) in seen:
                continue
            if persistent_only and key in mod._non_persistent_buffers_set:
                continue
            name = f"{mod_name}.{key}" if mod_name else key
            if not skip or not _ignored(name, skip):
                seen.add(id(buf))
                out.append((name, buf))
    if include_parameters:
        for name, p in module.named_parameters(remove_duplicate=True):
            if not hasattr(p, "ds_id") and not _ignored(name, skip):  # ZeRO parameters belong to DeepSpeed
                out.append((name, p))
    return out


def non_persistent_names(module: nn.Module) -> set[str]:
    """Qualified names of every non-persistent buffer (one pass over the modules)."""
    return {f"{prefix}.{key}" if prefix else key
            for prefix, mod in module.named_modules() for key in mod._non_persistent_buffers_set}


def describe(t: torch.Tensor) -> str:
    """``float32[64] cpu`` (plus `` sparse_coo`` etc. for non-strided layouts): what structure agreement compares."""
    layout = "" if t.layout == torch.strided else " " + str(t.layout).replace("torch.", "")
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)} {t.device.type}{layout}"


_DESCRIPTION = re.compile(r"^(?P<dtype>\w+)(?P<shape>\[[^\]]*\]) (?P<device>\S+)(?: (?P<layout>\S+))?$")


def _new_hash() -> Any:
    """The content hash: SHA-1 (hardware-accelerated on current x86 and ARM CPUs, about 2x blake2b here),
    used as a checksum for bitwise equality, not for security; digests are its first 64 bits."""
    return hashlib.sha1(usedforsecurity=False)


def _digest(data: bytes | memoryview) -> int:
    """Signed first 64 bits of the hash of ``data`` (structures and buffer contents alike)."""
    h = _new_hash()
    h.update(data)
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def wait_all(works: Sequence[Any], timeout: Timeout, what: str) -> None:
    """Wait for async collectives, all within one ``timeout``; a failure or timeout becomes CollectiveError."""
    td = datetime.timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
    end = None if td is None else time.monotonic() + td.total_seconds()
    try:
        for w in works:  # one deadline for the whole batch, not one timeout per work
            if end is None:
                w.wait()
            else:
                w.wait(timeout=datetime.timedelta(seconds=max(end - time.monotonic(), 0.001)))
    except RuntimeError as e:
        cause = (f"the collective did not complete within timeout={td.total_seconds():g} s (a peer stalled, died "
                 f"or never called {what})" if td is not None and "timed out" in str(e).lower() else str(e))
        raise CollectiveError(
            f"{what} failed on rank {dist.get_rank()}: {cause}. No buffer was modified; the process group may be "
            "unusable now (a peer died or stalled)"
        ) from e


def all_gather_tensor(g: Group, t: torch.Tensor, timeout: Timeout, what: str) -> list[torch.Tensor]:
    """all_gather one tensor; returns the list in group order."""
    out = [torch.empty_like(t) for _ in range(g.size)]
    wait_all([dist.all_gather(out, t, group=g.pg, async_op=True)], timeout, what)
    return out


_STRUCTURE_DIGESTS: dict[Any, int] = {}  # structure key -> digest; describing every tensor is the slow part


def structure_key(call: tuple, entries: Sequence[tuple[str, Any]]) -> tuple:
    """A hashable key of ``call`` and the (name, dtype, shape, device type, layout) of every entry."""
    return (call, tuple((n, x) if isinstance(x, str) else (n, x.dtype, x.shape, x.device.type, x.layout)
                        for n, x in entries))


def _structure_digest(key: tuple, entries: Sequence[tuple[str, Any]]) -> int:
    """64-bit digest of a structure (its ``structure_key``), cached per structure."""
    digest = _STRUCTURE_DIGESTS.get(key)
    if digest is None:
        if len(_STRUCTURE_DIGESTS) > 256:
            _STRUCTURE_DIGESTS.clear()
        digest = _STRUCTURE_DIGESTS[key] = _digest(repr((key[0], _described(entries))).encode())
    return digest


def _described(entries: Sequence[tuple[str, Any]]) -> list[tuple[str, str]]:
    """(name, description) pairs; an entry may carry a ready-made description string instead of a tensor."""
    return [(n, x if isinstance(x, str) else describe(x)) for n, x in entries]


def agree_on_structure(g: Group, call: tuple, entries: Sequence[tuple[str, Any]], timeout: Timeout, what: str,
                       extra: int | None = None, key: tuple | None = None) -> list[int] | None:
    """Raise the same BufferStructureError on every rank unless all ranks pass equal ``call`` and ``entries``.

    ``entries`` are (name, tensor) pairs (or (name, description)). One all_gather of two int64: the
    structure digest and ``extra``, a 64-bit value every rank contributes (returned in group order;
    buffer_report sends its content digest there). Every caller sends the same shape, so ranks that
    call different functions still meet in this collective and get a clean error. Only on mismatch a
    second gather of the full structure builds the message. ``key``: the ``structure_key``, if already made.
    """
    mine = _structure_digest(structure_key(call, entries) if key is None else key, entries)
    payload = torch.tensor([mine, 0 if extra is None else extra], dtype=torch.int64, device=g.device)
    gathered = [d.tolist() for d in all_gather_tensor(g, payload, timeout, what)]
    if all(d[0] == mine for d in gathered):
        return None if extra is None else [d[1] for d in gathered]
    raise _mismatch_error(what, list(g.ranks), gather_objects(g, (call, _described(entries)), timeout, what))


def gather_objects(g: Group, obj: Any, timeout: Timeout, what: str) -> list[Any]:
    """all_gather a picklable object (like dist.all_gather_object, but under ``timeout``): sizes, then padded bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = all_gather_tensor(g, torch.tensor([data.numel()], dtype=torch.int64, device=g.device), timeout, what)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=g.device)
    padded[:data.numel()] = data.to(g.device)
    blobs = all_gather_tensor(g, padded, timeout, what)
    return [pickle.loads(b[:int(s.item())].cpu().numpy().tobytes()) for b, s in zip(blobs, sizes)]


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _by_value(ranks: list[int], values: list[str]) -> str:
    """``ranks 0, 2: float32[4] cpu; rank 1: missing``."""
    groups: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{_ranks_text(rs)}: {v}" for v, rs in groups.items())


def _mismatch_error(what: str, ranks: list[int], objs: list[Any]) -> BufferStructureError:
    """Build the deterministic, identical-on-every-rank error for differing structures."""
    calls = [o[0] for o in objs]
    if any(c != calls[0] for c in calls):
        details = dict(zip(ranks, map(repr, calls)))
        return BufferStructureError(
            f"{what}: ranks called it with different arguments: {_by_value(ranks, list(details.values()))}",
            None, details)
    tables = [dict(o[1]) for o in objs]
    order: list[str] = []
    for o in objs:
        order += [n for n, _ in o[1] if n not in order]
    for name in order:
        values = [t.get(name, "missing") for t in tables]
        if any(v != values[0] for v in values):
            kind = "missing on some ranks" if "missing" in values else _which_differs(values)
            n_more = sum(1 for n in order if len({t.get(n, "missing") for t in tables}) > 1) - 1
            more = f" ({n_more} more differing entries)" if n_more > 0 else ""
            return BufferStructureError(
                f"{what}: buffer structure differs across ranks at '{name}' ({kind}): "
                f"{_by_value(ranks, values)}{more}. No buffer was modified.",
                name, dict(zip(ranks, values)))
    names = [[n for n, _ in o[1]] for o in objs]
    pos = next(i for i in range(len(names[0])) if any(ns[i] != names[0][i] for ns in names))
    values = [f"'{ns[pos]}' at position {pos}" for ns in names]
    return BufferStructureError(
        f"{what}: ranks register the same buffers in a different order: {_by_value(ranks, values)}. "
        "No buffer was modified.", names[0][pos], dict(zip(ranks, values)))


def _which_differs(values: list[str]) -> str:
    """Name the attributes (dtype, shape, device, layout) that differ between ``describe`` strings."""
    parsed = [m.groupdict() if (m := _DESCRIPTION.match(v)) else {} for v in values]
    diff = [lab for lab in ("dtype", "shape", "device", "layout") if len({p.get(lab) for p in parsed}) > 1]
    return " and ".join(diff) + " differs" if diff else "differs"


def reject_unsupported(entries: list[tuple[str, torch.Tensor]], fn: str) -> None:
    """Raise InvalidArgumentError for tensors that cannot be sent: meta (no data), non-strided layouts, quantized.

    Called after structure agreement (which compares device and layout), so every rank raises the same error.
    """
    meta = [n for n, t in entries if t.is_meta]
    if meta:
        raise InvalidArgumentError(
            f"{fn}(): {len(meta)} tensor(s) are on the meta device and hold no data, e.g. '{meta[0]}'. "
            "Materialise the module (to_empty + load, or build it outside a meta-device context) first")
    odd = [(n, t.layout) for n, t in entries if t.layout != torch.strided]
    if odd:
        raise InvalidArgumentError(
            f"{fn}(): {len(odd)} tensor(s) have a {str(odd[0][1]).replace('torch.', '')} layout, e.g. '{odd[0][0]}'; "
            "only dense (strided) tensors are supported: register t.to_dense() or pass ignore=(name,)")
    quant = [n for n, t in entries if t.is_quantized]
    if quant:
        raise InvalidArgumentError(
            f"{fn}(): {len(quant)} quantized tensor(s), e.g. '{quant[0]}', cannot be sent by torch.distributed; "
            "pass ignore=(name,) or register the dequantized / int_repr() tensors")


def check_backend_devices(g: Group, entries: list[tuple[str, torch.Tensor]], fn: str) -> None:
    """Raise UnsupportedDeviceError for tensors the backend cannot carry (CPU tensors on nccl)."""
    if g.backend == "nccl":
        bad = [n for n, t in entries if t.device.type != "cuda"]
        if bad:
            raise UnsupportedDeviceError(
                f"{fn}(): the process group's backend is nccl, which carries CUDA tensors only, but "
                f"{len(bad)} tensor(s) are not on CUDA, e.g. '{bad[0]}'. Move the module to the GPU or pass a "
                "gloo group (torch.distributed.new_group(backend='gloo'))")


def _wire(flat: torch.Tensor) -> torch.Tensor:
    """A bit-exact view of a flat tensor in a dtype every backend carries."""
    if flat.is_complex():
        return torch.view_as_real(flat)
    if flat.element_size() == 1 and flat.dtype not in (torch.uint8, torch.int8, torch.bool):
        return flat.view(torch.uint8)  # float8 and friends
    if flat.dtype in (torch.uint16, torch.uint32, torch.uint64, torch.int16):
        return flat.view(torch.uint8)
    return flat


def buckets(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), in first-seen order."""
    out: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault((t.device, t.dtype), []).append(i)
    return out


def flatten(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate same-dtype tensors into one flat tensor (a copy); torch's C++ helper when it exists."""
    if not ts:
        return torch.empty(0)
    with torch.no_grad():
        fast = getattr(torch._utils, "_flatten_dense_tensors", None)  # private torch API: compat with fallback
        if fast is not None and not any(t.is_complex() for t in ts):
            return fast(list(ts))
        return torch.cat([t.reshape(-1) for t in ts])


def unflatten_into(flat: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``ts`` (inverse of flatten), in as few kernel calls as torch allows."""
    with torch.no_grad():
        unflat = getattr(torch._utils, "_unflatten_dense_tensors", None)  # private torch API: compat with fallback
        foreach = getattr(torch, "_foreach_copy_", None)
        if unflat is not None and foreach is not None and not flat.is_complex():
            foreach(list(ts), unflat(flat, list(ts)))
            return
        offset = 0
        for t in ts:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()


def broadcast_coalesced(g: Group, tensors: Sequence[torch.Tensor], src: int, timeout: Timeout, what: str) -> None:
    """Broadcast ``tensors`` from global rank ``src`` in place: one collective per (device, dtype) bucket.

    All buckets are received into fresh flat tensors first; buffers are written only after every
    collective has completed, so a failed call leaves every tensor unchanged.
    """
    works, staged = [], []
    for (device, dtype), idx in buckets(tensors).items():
        ts = [tensors[i] for i in idx]
        numel = sum(t.numel() for t in ts)
        if numel == 0:
            continue
        flat = flatten(ts) if g.rank == src else torch.empty(numel, dtype=dtype, device=device)
        works.append(dist.broadcast(_wire(flat), src=src, group=g.pg, async_op=True))
        staged.append((ts, flat))
    wait_all(works, timeout, what)
    if g.rank == src:
        return
    for ts, flat in staged:
        unflatten_into(flat, ts)


def all_gather_coalesced(g: Group, tensors: Sequence[torch.Tensor], timeout: Timeout,
                         what: str) -> list[list[torch.Tensor]]:
    """All-gather ``tensors``: result[i][j] is group member j's copy of tensor i. One collective per bucket."""
    result: list[list[torch.Tensor]] = [[] for _ in tensors]
    works, staged = [], []
    for (device, dtype), idx in buckets(tensors).items():
        flat = flatten([tensors[i] for i in idx]).to(device)
        outs = [torch.empty_like(flat) for _ in range(g.size)]
        works.append(dist.all_gather([_wire(o) for o in outs], _wire(flat), group=g.pg, async_op=True))
        staged.append((idx, outs))
    wait_all(works, timeout, what)
    for idx, outs in staged:
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            result[i] = [o[offset:offset + n].view(tensors[i].shape) for o in outs]
            offset += n
    return result


def require_all_succeeded(g: Group, failed: int, timeout: Timeout, what: str, skipped: str,
                           steps: tuple[str, ...] = ("the body raised",)) -> None:
    """One all_gather of a code; if a step failed on any rank, every rank raises the same ZeroBuffersError.

    ``failed`` is 0 (fine) or k >= 1: ``steps[k - 1]`` failed here (True means the first). So every rank
    takes the same branch: no rank broadcasts while a peer has left. ``skipped`` says what was not done.
    """
    codes = all_gather_tensor(g, torch.tensor([int(failed)], dtype=torch.int64, device=g.device), timeout, what)
    by_step: dict[int, list[int]] = {}
    for r, c in zip(g.ranks, codes):
        if int(c.item()):
            by_step.setdefault(int(c.item()), []).append(r)
    if by_step:
        failures = "; ".join(f"{steps[k - 1]} on rank(s) {ranks}" for k, ranks in sorted(by_step.items()))
        raise ZeroBuffersError(f"{what}: {failures}; {skipped} (rank {g.rank})")


def as_module(modules: Sequence[nn.Module], params: Sequence[torch.Tensor] = ()) -> nn.Module:
    """A bare container holding ``modules`` (as '0', '1', ...) and loose ``params``; the modules are not re-parented."""
    if len(modules) == 1 and not params:
        return modules[0]
    box = nn.Module()  # plain nn.Module: zero.Init does not patch its __init__, so nothing is partitioned
    for i, m in enumerate(modules):
        box._modules[str(i)] = m
    for i, p in enumerate(params):
        box._parameters[f"param{i}"] = p
    return box


def all_reduce_sum(g: Group, t: torch.Tensor, timeout: Timeout, what: str) -> torch.Tensor:
    """Sum ``t`` across the group in place (one collective) and return it."""
    wait_all([dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g.pg, async_op=True)], timeout, what)
    return t


_IN_PLACE_BYTES = 1 << 16  # CPU tensors this large are hashed where they are; smaller ones are copied together


def _in_place(t: torch.Tensor, size: int) -> bool:
    """Hash this tensor on its own (large, on the host) rather than in its bucket's packed copy; the choice
    depends on the structure only, so every rank feeds the hash the same byte stream for equal values."""
    return t.device.type == "cpu" and t.numel() * size >= _IN_PLACE_BYTES


def _raw(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor in logical order (no copy when it is contiguous and not a conj/neg view)."""
    return memoryview(t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy())


def _host_chunks(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[list[int], int, memoryview]]:
    """(indices, element size, raw bytes) per (device, dtype) bucket: each large CPU tensor in place, then the rest
    flattened and copied to the host once. The order depends on the structure only."""
    for (_, dtype), idx in buckets(tensors).items():
        size = torch.empty((), dtype=dtype).element_size()
        packed = []
        for i in idx:
            if _in_place(tensors[i], size):
                yield [i], size, _raw(tensors[i])
            else:
                packed.append(i)
        if packed:
            yield packed, size, _raw(flatten([tensors[i] for i in packed]).cpu())


def combined_digest(tensors: Sequence[torch.Tensor]) -> int:
    """One 64-bit digest over the raw bytes of all ``tensors`` (fed in ``_host_chunks`` order)."""
    h = _new_hash()
    for _, _, view in _host_chunks(tensors):
        h.update(view)
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def content_digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 64-bit digest per tensor over its raw bytes (bitwise equality, NaN payloads included); 0 when empty."""
    out = [0] * len(tensors)
    for idx, size, view in _host_chunks(tensors):
        offset = 0
        for i in idx:
            n = tensors[i].numel() * size
            out[i] = _digest(view[offset:offset + n]) if n else 0
            offset += n
    return torch.tensor(out, dtype=torch.int64)
