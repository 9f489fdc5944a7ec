"""Structure agreement: what every rank is about to send, as data; its digest; the error when ranks differ.

A call's structure is its arguments plus one :class:`Spec` per tensor (name, dtype, shape, device, layout).
It decides the number, order and size of every collective the call issues (buckets are cut by device and
dtype), so ranks first compare a 64-bit digest of it, together with a status code and a 64-bit extra
value, in one all_gather of three int64: the first collective of every public function. Only when the
digests differ are the full structures gathered, to name the first differing buffer.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import torch as torch_compat
from ..errors import BufferStructureError
from . import wire as _wire
from .group import Group

VERSION = "zero_buffers/2"  # part of every digest: ranks running different wire formats never match


@dataclass(frozen=True)
class Spec:
    """One tensor as structure agreement sees it. ``device`` is the device type, with ``#k`` for this rank's
    k-th distinct device of that type (k > 0): ranks on cuda:0 and cuda:1 match, one rank spread over two
    GPUs does not match one on a single GPU."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    device: str
    layout: str = "strided"

    def text(self) -> str:
        """``float32[4] cpu`` (plus `` sparse_coo`` for a non-strided layout)."""
        layout = "" if self.layout == "strided" else f" {self.layout}"
        return f"{self.dtype}{list(self.shape)} {self.device}{layout}"


ANY_DTYPE = "any"  # the dtype of a Spec in a dtype-blind structure (buffer_report compares dtypes as values)


def specs(entries: Sequence[tuple[str, Any]], dtypes: bool = True) -> list[Spec]:
    """The :class:`Spec` of every entry; an entry may carry a ready-made Spec instead of a tensor. ``dtypes=False``:
    dtype-blind, every dtype reads :data:`ANY_DTYPE` but a quantized one (which no collective carries, so whether a
    tensor is quantized stays part of what every rank must share)."""
    slots: dict[torch.device, str] = {}
    per_type: dict[str, int] = {}
    out = []
    for name, t in entries:
        if isinstance(t, Spec):
            out.append(t)
            continue
        slot = slots.get(t.device)
        if slot is None:
            k = per_type.get(t.device.type, 0)
            per_type[t.device.type] = k + 1
            slot = slots[t.device] = t.device.type if k == 0 else f"{t.device.type}#{k}"
        layout = "dtensor" if torch_compat.is_dtensor(t) else str(t.layout).removeprefix("torch.")
        if t.is_inference():  # no write can change it outside inference mode: part of what every rank must share
            layout = "inference" if layout == "strided" else f"{layout} inference"
        dtype = str(t.dtype).removeprefix("torch.") if dtypes else "quantized" if t.is_quantized else ANY_DTYPE
        out.append(Spec(name, dtype, tuple(t.shape), slot, layout))
    return out


# dtype codes: one byte per tensor (7 bits of dtype, 1 bit of flag) where a call carries dtypes as values
_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "complex64", "complex128", "complex32", "int64", "int32",
                "int16", "int8", "uint8", "bool", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "qint8", "quint8",
                "qint32", "quint4x2", "quint2x4")
DTYPES: tuple[torch.dtype, ...] = tuple(
    [getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)]
    + sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}
             - {getattr(torch, n, None) for n in _DTYPE_NAMES}, key=str))[:126]
"""Every dtype torch has, the common ones first in a fixed order (code ``i + 1``); 127 stands for any other."""
_CODES = {d: i + 1 for i, d in enumerate(DTYPES)}
OTHER_DTYPE = 127


def dtype_code(dtype: torch.dtype) -> int:
    """A dtype as a small int (1..126, or :data:`OTHER_DTYPE`), the same on every rank running this torch."""
    return _CODES.get(dtype, OTHER_DTYPE)


def dtype_of(code: int) -> torch.dtype | None:
    """The dtype of a code from :func:`dtype_code` (its low 7 bits; None for :data:`OTHER_DTYPE`)."""
    code &= 0x7F
    return DTYPES[code - 1] if 0 < code <= len(DTYPES) else None


def pack_bytes(values: Sequence[int]) -> list[int]:
    """Bytes (0..255) eight to an int64, little-endian: how per-tensor codes ride along a collective of int64."""
    data = bytes(values) + bytes(-len(values) % 8)
    return [int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, len(data), 8)]


def unpack_bytes(words: Sequence[int], n: int) -> list[int]:
    """The first ``n`` bytes :func:`pack_bytes` packed into ``words``."""
    return list(b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)[:n])


def digest_bytes(data: bytes | memoryview) -> int:
    """Signed first 64 bits of SHA-1 over ``data`` (a checksum, not for security)."""
    return int.from_bytes(hashlib.sha1(data, usedforsecurity=False).digest()[:8], "little", signed=True)


_CACHE: dict[tuple, list[Any]] = {}  # structure key -> [digest, bucket plan]; describing every tensor is the slow part


def _known(call: tuple, entries: Sequence[tuple[str, Any]], dtypes: bool = True) -> list[Any]:
    key = (_wire.BUCKET_BYTES, call, dtypes,
           tuple((n, t) if isinstance(t, Spec) else (n, t.dtype, t.shape, t.device, t.layout, type(t), t.is_inference())
                 for n, t in entries))
    found = _CACHE.get(key)
    if found is None:
        if len(_CACHE) > 256:
            _CACHE.clear()
        described = [(s.name, s.text()) for s in specs(entries, dtypes)]
        found = _CACHE[key] = [digest_bytes(repr((VERSION, _wire.BUCKET_BYTES, call, described)).encode()), None]
    return found


def digest(call: tuple, entries: Sequence[tuple[str, Any]], dtypes: bool = True) -> int:
    """64-bit digest of ``call`` and the structure of ``entries`` (cached per structure); ``dtypes=False``: of the
    dtype-blind structure (:func:`specs`)."""
    return int(_known(call, entries, dtypes)[0])


def digest_and_plan(call: tuple, entries: Sequence[tuple[str, Any]]) -> tuple[int, list[_wire.Bucket]]:
    """:func:`digest`, and the bucket plan of the entries' tensors (it depends on the structure only: cached)."""
    known = _known(call, entries)
    if known[1] is None:
        known[1] = _wire.plan([t for _, t in entries])
    return int(known[0]), known[1]


def agree(g: Group, call: tuple, entries: Sequence[tuple[str, Any]], deadline: _wire.Deadline, what: str, *,
          status: int = 0, extra: int = 0, known: int | None = None, dtypes: bool = True) -> list[tuple[int, int]]:
    """Raise the same BufferStructureError on every rank unless every rank passes equal ``call`` and structure.

    One all_gather of [digest, ``status``, ``extra``]; returns each member's (status, extra) in group order
    (callers vote with ``status``; buffer_report sends its content digest as ``extra``). Every caller sends
    the same shape, so ranks that call different functions still meet here and get a clean error. ``known``: the
    digest, when the caller has it already. ``dtypes=False``: ranks may hold a tensor in different dtypes (the
    caller carries dtypes as values, as buffer_report does); the error still shows each rank's.
    """
    mine = digest(call, entries, dtypes) if known is None else known
    votes = _wire.all_gather_values(g, [mine, status, extra], deadline, what)
    if all(v[0] == mine for v in votes):
        return [(v[1], v[2]) for v in votes]
    theirs = _wire.gather_objects(g, (call, specs(entries)), deadline, what)
    raise mismatch_error(what, g.ranks, theirs, dtypes=dtypes)


def refuse(g: Group, error: Exception, deadline: _wire.Deadline, what: str) -> None:
    """This rank cannot plan its part of the call (its own model makes ``error``): it meets its peers in their first
    collective with a call that says so, so every rank raises instead of waiting for it. Peers that planned: a
    BufferStructureError naming this rank's reason, on every rank. Every rank failed alike: ``error`` itself."""
    try:
        agree(g, (what, "could not plan its buffers here", f"{type(error).__name__}: {error}"), [], deadline, what)
    except BufferStructureError as mismatch:
        raise mismatch from error
    raise error


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def by_value(ranks: Sequence[int], values: Sequence[str]) -> str:
    """``ranks 0, 2: float32[4] cpu; rank 1: missing``."""
    groups: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{_ranks_text(rs)}: {v}" for v, rs in groups.items())


def _blind(spec: Spec | None) -> Spec | None:
    """``spec`` as a dtype-blind structure compares it."""
    if spec is None:
        return None
    return Spec(spec.name, "quantized" if spec.dtype.startswith("q") else ANY_DTYPE, spec.shape, spec.device,
                spec.layout)


def mismatch_error(what: str, ranks: Sequence[int], structures: Sequence[tuple[tuple, list[Spec]]],
                   dtypes: bool = True) -> BufferStructureError:
    """The deterministic, identical-on-every-rank error for differing structures (global ranks in the text).
    ``dtypes=False``: a tensor differing in dtype alone does not count as differing (the texts keep every field)."""
    calls = [c for c, _ in structures]
    if any(c != calls[0] for c in calls):
        texts, blamed, others = _call_difference(calls)
        extra = f" ({others} more buffers' rules differ)" if others else ""
        return BufferStructureError(
            f"{what}: ranks called it with different arguments: {by_value(ranks, texts)}{extra}", blamed,
            dict(zip(ranks, texts)))
    tables = [{s.name: s for s in ss} for _, ss in structures]
    order: list[str] = []
    for _, ss in structures:
        order += [s.name for s in ss if s.name not in order]
    def seen(spec: Spec | None) -> Spec | None:
        return spec if dtypes else _blind(spec)

    differing = [n for n in order if len({seen(t.get(n)) for t in tables}) > 1]
    if differing:
        name = differing[0]
        cells = [t.get(name) for t in tables]
        kind = "missing on some ranks" if None in cells else _which_differs([c for c in cells if c is not None])
        more = f" ({len(differing) - 1} more differing entries)" if len(differing) > 1 else ""
        texts = [c.text() if c is not None else "missing" for c in cells]
        meta = any(c is not None and c.device == "meta" for c in cells) and \
            any(c is not None and c.device != "meta" for c in cells)
        hint = " Some ranks hold meta tensors (no data): broadcast_buffers(module, src, materialize=True) allocates " \
            "them like the source's." if meta else ""
        if kind == "dtype differs":
            hint += (" Ranks hold it in different dtypes (a cast, an engine or a meta build in another dtype changed "
                     "it on some ranks): give it one dtype on every rank first (module.to(dtype) there, or "
                     "zb.keep_precision(model) before the engine casts), or, for buffers, take the source's with "
                     "broadcast_buffers(module, src, materialize=True, adopt_dtype=True); zb.buffer_report(module) "
                     "lists every buffer whose dtype differs.")
        return BufferStructureError(
            f"{what}: buffer structure differs across ranks at '{name}' ({kind}): {by_value(ranks, texts)}{more}. "
            f"No buffer was modified.{hint}", name, dict(zip(ranks, texts)))
    names = [[s.name for s in ss] for _, ss in structures]
    pos = next(i for i in range(len(names[0])) if any(ns[i] != names[0][i] for ns in names))
    texts = [f"'{ns[pos]}' at position {pos}" for ns in names]
    return BufferStructureError(
        f"{what}: ranks register the same buffers in a different order: {by_value(ranks, texts)}. "
        "No buffer was modified.", names[0][pos], dict(zip(ranks, texts)))


_ABSENT = object()  # a position one rank's call tuple does not have
_SHORT = 300  # characters of one argument's repr in a message


def _is_signature(x: Any) -> bool:
    """Whether ``x`` is a rules signature: ``((buffer name, rule), ...)``."""
    return isinstance(x, tuple) and all(isinstance(e, tuple) and len(e) == 2 and all(isinstance(v, str) for v in e)
                                        for e in x)


def _call_difference(calls: Sequence[tuple]) -> tuple[list[str], str | None, int]:
    """Per rank, what its call holds where the calls differ; for rules signatures, the first buffer whose rule
    differs (its name, and how many more differ)."""
    width = max(len(c) for c in calls)
    padded = [tuple(c) + (_ABSENT,) * (width - len(c)) for c in calls]
    positions = [i for i in range(width) if any(p[i] != padded[0][i] for p in padded)]
    for i in positions:
        parts = [p[i] for p in padded]
        if all(_is_signature(x) for x in parts):
            tables = [dict(x) for x in parts]
            order = list(dict.fromkeys(n for x in parts for n, _ in x))
            differing = [n for n in order if len({t.get(n) for t in tables}) > 1]
            if differing:
                name = differing[0]
                return ([f"rule {t[name]!r} for buffer '{name}'" if name in t else f"no buffer '{name}'"
                         for t in tables], name, len(differing) - 1)

    def short(v: Any) -> str:
        text = "(no such argument)" if v is _ABSENT else repr(v)
        return text if len(text) <= _SHORT else text[:_SHORT - 3] + "..."
    return [", ".join(short(p[i]) for i in positions) for p in padded], None, 0


def _which_differs(cells: Sequence[Spec]) -> str:
    """Name the fields (dtype, shape, device, layout) that differ."""
    diff = [f for f in ("dtype", "shape", "device", "layout") if len({getattr(c, f) for c in cells}) > 1]
    return " and ".join(diff) + " differs" if diff else "differs"
