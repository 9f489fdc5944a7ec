"""``keep_precision``: declared buffers stay in their dtype through every cast of their module ([Note: kept buffers]).

[Note: kept buffers]
A kept buffer has a dtype (``fp32`` for the defaults) and the dtypes that would break it (``unsafe_in``: for an
explicit dtype the floating dtypes coarser than it; for a default the :class:`~.declared.Declared` one's). While it is
kept:

* every ``nn.Module._apply`` of its owner (``half()``, ``bfloat16()``, ``to(dtype)``, ``to(device, dtype)``,
  ``type(...)``, the owner's own or any ancestor's) still moves it to the device ``fn`` chose, but a result in an
  unsafe dtype is replaced by the buffer *from before the cast* moved to that device in its kept dtype: the values
  never pass through 16 bits. Casts to a safe dtype (``double()``) go through;
* a DeepSpeed engine's model cast (``_configure_distributed_model``: 0.19.2+ casts buffers by ``.data`` when
  ``data_types.buffer_dtype`` is set, outside ``_apply``) is undone the same way, from the tensors held before it;
* a kept BatchNorm whose input or affine parameters are in another dtype than its statistics normalises in the
  statistics' dtype and returns the input's dtype: the statistics are updated in their own dtype, and gradients flow
  to the parameters in theirs.

Each kept buffer counts the handles that claim it; it is kept (and its explicit declaration recorded) while any
handle does. The patches of ``_apply``, ``_BatchNorm.forward`` and the engine are in place while any handle is
alive, and put back exactly when the last one is removed.
"""
from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._compat import deepspeed as ds_compat, torch as torch_compat
from .._core import args as _args, modules as _modules
from ..errors import InvalidArgumentError
from . import declared as _declared

Spec = Mapping[Any, Any]
"""``{"name glob": dtype, ModuleClass: {"buffer name": dtype}}``."""


@dataclass
class _Entry:
    dtype: torch.dtype
    unsafe_in: frozenset[torch.dtype]
    why: str
    explicit: bool
    claims: set[int] = field(default_factory=set)  # ids of the handles that keep it


_KEPT: weakref.WeakKeyDictionary[nn.Module, dict[str, _Entry]] = weakref.WeakKeyDictionary()
_live: set[int] = set()  # ids of the handles not yet removed
_undo: list[Callable[[], None]] = []  # the patches, while any handle is alive
_engine_undo: list[Callable[[], None]] = []  # the engine's, once DeepSpeed was imported
_next_id = [0]


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _check_dtype(value: Any, fn: str, what: str) -> torch.dtype:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise InvalidArgumentError(f"{fn}(): {what} must be a floating torch.dtype (torch.float32, ...), got "
                                   f"{value!r}. No buffer was modified")
    return value


def parse(spec: Spec | None, fn: str) -> tuple[dict[str, torch.dtype], dict[type, dict[str, torch.dtype]]]:
    """The spec checked without looking at any model: (globs, classes)."""
    if spec is None:
        return {}, {}
    if not isinstance(spec, Mapping):
        raise InvalidArgumentError(f"{fn}(): spec must be a mapping {{name glob: dtype, module class: {{buffer name: "
                                   f"dtype}}}}, got {type(spec).__name__}. No buffer was modified")
    globs: dict[str, torch.dtype] = {}
    classes: dict[type, dict[str, torch.dtype]] = {}
    for k, v in spec.items():
        if isinstance(k, str):
            globs[k] = _check_dtype(v, fn, f"the dtype of pattern {k!r}")
        elif isinstance(k, type) and issubclass(k, nn.Module):
            if not isinstance(v, Mapping) or not all(isinstance(n, str) for n in v):
                raise InvalidArgumentError(f"{fn}(): class {k.__name__} must map buffer names (str) to dtypes, got "
                                           f"{v!r}. No buffer was modified")
            classes[k] = {n: _check_dtype(d, fn, f"the dtype of {k.__name__}.{n}") for n, d in v.items()}
        else:
            raise InvalidArgumentError(f"{fn}(): spec keys must be qualified-name globs (str) or nn.Module classes, "
                                       f"got {k!r}. No buffer was modified")
    return globs, classes


@dataclass(frozen=True)
class _Planned:
    name: str
    owner: nn.Module
    local: str
    dtype: torch.dtype
    unsafe_in: frozenset[torch.dtype]
    why: str
    explicit: bool


def _plan(root: nn.Module, globs: dict[str, torch.dtype], classes: dict[type, dict[str, torch.dtype]],
          defaults: bool, fn: str, required: bool) -> list[_Planned]:
    """What to keep, every check done before anything changes."""
    planned: dict[str, _Planned] = {}
    used: set[Any] = set()
    owners: dict[str, tuple[nn.Module, str]] = {}
    for name, mod, local, buf in _modules.owned_buffers(root.named_modules(remove_duplicate=True)):
        owners[name] = (mod, local)
        hits = {(g, d) for g, d in globs.items() if fnmatch.fnmatchcase(name, g)}
        used.update(g for g, _ in hits)
        source = None
        for klass in type(mod).__mro__:
            if klass in classes:
                if local in classes[klass]:
                    hits.add((f"class {klass.__name__}", classes[klass][local]))
                    used.add((klass, local))
                    source = klass
                break
        if not hits:
            continue
        if len({d for _, d in hits}) > 1:
            (s1, d1), (s2, d2) = sorted(hits, key=str)[:2]
            raise InvalidArgumentError(f"{fn}(): buffer '{name}' is given two dtypes: {s1!r} says "
                                       f"{_dtype_name(d1)}, {s2!r} says {_dtype_name(d2)}. No buffer was modified")
        (label, dtype), = sorted(hits, key=str)[:1]
        if not buf.is_floating_point():
            raise InvalidArgumentError(
                f"{fn}(): buffer '{name}' of {type(mod).__name__} is {_dtype_name(buf.dtype)}, not floating "
                f"point ({label if source is None else 'class ' + source.__name__} names it): keep_precision keeps "
                "floating buffers from 16-bit casts; integer and bool buffers are never cast by them. No buffer "
                "was modified")
        why = f"keep_precision: {label if label.startswith('class ') else 'pattern ' + repr(label)}"
        planned[name] = _Planned(name, mod, local, dtype, _declared.coarser_than(dtype), why, True)
    if required:
        keys: list[Any] = [*globs, *((k, n) for k, names in classes.items() for n in names)]
        for key in keys:
            if key not in used:
                what = repr(key) if isinstance(key, str) else f"{key[0].__name__}: {{{key[1]!r}: ...}}"
                raise InvalidArgumentError(f"{fn}(): {what} matches no buffer of the {type(root).__name__} (its "
                                           f"buffers: {', '.join(list(owners)[:8]) or 'none'}"
                                           f"{', ...' if len(owners) > 8 else ''}). No buffer was modified")
    if defaults:
        for d in _declared.declared(root):
            if d.name in planned or d.name not in owners:
                continue
            mod, local = owners[d.name]
            planned[d.name] = _Planned(d.name, mod, local, d.dtype, d.unsafe_in, d.why, False)
    out = [planned[n] for n in owners if n in planned]  # module order
    for p in out:
        have = _KEPT.get(p.owner, {}).get(p.local)
        if have is not None and have.claims and have.dtype != p.dtype:
            raise InvalidArgumentError(f"{fn}(): buffer '{p.name}' is kept in {_dtype_name(have.dtype)} already "
                                       f"({have.why}); this call asks {_dtype_name(p.dtype)} ({p.why}): remove the "
                                       "other handle first. No buffer was modified")
    return out


class Kept:
    """What :func:`keep_precision` keeps: ``names`` (qualified names, in module order) and ``dtypes`` (name ->
    dtype). :meth:`remove` stops keeping them (usable as a context manager)."""

    def __init__(self, ident: int, entries: list[tuple[str, nn.Module, str, torch.dtype]]):
        self._id = ident
        self._refs = [(name, weakref.ref(owner), local) for name, owner, local, _ in entries]
        self.names: tuple[str, ...] = tuple(name for name, *_ in entries)
        self.dtypes: dict[str, torch.dtype] = {name: dtype for name, _, _, dtype in entries}

    def remove(self) -> None:
        """Stop keeping these buffers (the ones no other handle keeps) and drop the explicit declarations this call
        recorded; their dtypes stay as they are now. A second call does nothing."""
        if self._id not in _live:
            return
        _live.discard(self._id)
        for _, ref, local in self._refs:
            owner = ref()
            table = _KEPT.get(owner) if owner is not None else None
            entry = table.get(local) if table is not None else None
            if entry is None or owner is None or table is None:
                continue
            entry.claims.discard(self._id)
            if not entry.claims:
                del table[local]
                if entry.explicit:
                    _declared.undeclare(owner, local)
                if not table:
                    del _KEPT[owner]
        if not _live:
            while _undo:
                _undo.pop()()

    def __enter__(self) -> Kept:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Kept({len(self.names)} buffers{', removed' if self._id not in _live else ''})"


def keep_precision(model: nn.Module, spec: Spec | None = None, *, defaults: bool = True) -> Kept:
    """Keep buffers in the dtype they need through every cast of their module; returns a :class:`Kept` handle.

    ``spec`` maps a qualified-name glob to a dtype (``{"*.running_mean": torch.float32}``) or a module class to
    ``{buffer name: dtype}`` (``{MoEGate: {"e_score_correction_bias": torch.float32}}``); with ``defaults`` (the
    default) every buffer :func:`~zero_buffers.precision.declared.declared` names is kept too: BatchNorm
    statistics, transformers' ``_keep_in_fp32_modules_strict`` (fp32 under fp16 and bf16) and
    ``_keep_in_fp32_modules`` (fp32 under fp16 only), rotary ``inv_freq`` tables, earlier explicit declarations.

    The call records the spec's declarations (``declared.declare``), casts each kept buffer held in a dtype coarser
    than its own to it (one held finer, float64, stays), and from then on ([Note: kept buffers]):

    * ``model.half()`` / ``.bfloat16()`` / ``.to(dtype)`` / ``.to(device, dtype)`` / ``.type(...)``, on the model or
      any submodule, cast everything else and leave kept buffers in their dtype, moved to the new device, their
      values taken from before the cast (never a round trip through 16 bits);
    * ``deepspeed.initialize`` with ``"bf16"`` / ``"fp16"`` enabled (0.16's ``module.bfloat16()``; 0.19.2+'s
      ``data_types.buffer_dtype``, undone when DeepSpeed was imported before this call) leaves them fp32 (and so
      ``accelerator.prepare``, which builds that engine: not tested yet). A model built under
      ``zero.Init(dtype=torch.bfloat16)`` has its buffers created in bf16: call this after building it (zeros
      and ones come back exactly; a table computed in bf16 does not) or use
      ``zero_buffers.install(keep_precision=True)``, which keeps them as each module is built;
    * a kept BatchNorm whose input or weights are 16-bit normalises in fp32 and returns the input's dtype, its
      statistics updated in fp32. On CPU this is needed: ``batch_norm`` with bf16 weights and fp32 statistics
      raises "expected scalar type BFloat16 but found Float". On CUDA (unverified here: no GPU, and the CPU wheel
      ships no ATen source) torch's kernels accept a 16-bit input with fp32 weights and statistics; the fp32
      computation is used there too.

    Raises :class:`InvalidArgumentError`, changing nothing, for a spec entry that matches no buffer, names an integer
    or bool buffer, gives a non-floating dtype or two dtypes to one buffer, or a buffer another handle keeps in
    another dtype. Meta buffers are kept too (their dtype changes; ``to_empty()`` keeps it). Idempotent: a second
    call keeps the same buffers and casts nothing; each handle's ``remove()`` undoes its own claims.

    Example::

        kept = zero_buffers.keep_precision(model)           # BatchNorm statistics, fp32 lists, rotary tables
        engine, *_ = deepspeed.initialize(model=model, config={"bf16": {"enabled": True}, ...})
        assert engine.module.bn.running_mean.dtype == torch.float32
    """
    fn = "keep_precision"
    model = _args.module(model, fn)
    defaults = _args.flag(defaults, "defaults", fn)
    globs, classes = parse(spec, fn)
    return _keep(model, globs, classes, defaults, fn, required=True)


def _keep(model: nn.Module, globs: dict[str, torch.dtype], classes: dict[type, dict[str, torch.dtype]],
          defaults: bool, fn: str, *, required: bool) -> Kept:
    root = _modules.unwrap(model, fn)
    planned = _plan(root, globs, classes, defaults, fn, required)
    with torch.no_grad():  # every cast made before any is written: a failure leaves the model as it was
        casts = [(p, buf.to(p.dtype)) for p in planned
                 if (buf := p.owner._buffers[p.local]) is not None and buf.dtype in p.unsafe_in
                 and buf.dtype != p.dtype]
    _ensure_patches()
    _next_id[0] += 1
    ident = _next_id[0]
    _live.add(ident)
    for p in planned:
        table = _KEPT.setdefault(p.owner, {})
        entry = table.get(p.local)
        if entry is None:
            entry = table[p.local] = _Entry(p.dtype, p.unsafe_in, p.why, p.explicit)
            if p.explicit:
                _declared.declare(p.owner, p.local, p.dtype, p.why)
        entry.claims.add(ident)
    for p, new in casts:
        p.owner._buffers[p.local] = new
    return Kept(ident, [(p.name, p.owner, p.local, p.dtype) for p in planned])


def kept(module: nn.Module) -> dict[str, torch.dtype]:
    """``module``'s own kept buffers and their dtypes (a copy)."""
    return {k: e.dtype for k, e in _KEPT.get(module, {}).items()}


# ---- the patches ([Note: kept buffers]) ----------------------------------------------------------------------------
def _ensure_patches(engine: bool = False) -> None:
    """The patches of [Note: kept buffers]; the engine's once DeepSpeed is imported (``engine``: import it)."""
    if not _undo:
        undos = [torch_compat.patch_module_apply(_make_apply)]
        try:
            undos.append(torch_compat.patch_batchnorm_forward(_make_bn_forward))
        except BaseException:
            undos.pop()()
            raise
        _undo.extend(undos)
    if (engine or ds_compat.engine_loaded()) and not _engine_undo:
        try:
            _engine_undo.append(ds_compat.wrap_engine_model_cast(_make_configure))
        except BaseException:
            if not _live:  # nothing holds the torch patches yet
                while _undo:
                    _undo.pop()()
            raise
        _undo.append(_undo_engine)


def _undo_engine() -> None:
    while _engine_undo:
        _engine_undo.pop()()


def _restore(module: nn.Module, before: dict[str, torch.Tensor | None], table: dict[str, _Entry]) -> None:
    """Each kept buffer a cast put in an unsafe dtype: from its tensor before the cast, on the new device."""
    with torch.no_grad():
        for local, old in before.items():
            new = module._buffers.get(local)
            entry = table.get(local)
            if old is None or new is None or entry is None or new.dtype not in entry.unsafe_in:
                continue
            if new.dtype != entry.dtype:
                module._buffers[local] = old.to(device=new.device, dtype=entry.dtype)


def _make_apply(original: Any) -> Any:
    def _apply(self: nn.Module, fn: Any, recurse: bool = True) -> Any:
        table = _KEPT.get(self)
        if not table:
            return original(self, fn, recurse)
        before = {k: self._buffers.get(k) for k in table}
        out = original(self, fn, recurse)
        _restore(self, before, table)
        return out
    return _apply


def _make_bn_forward(original: Any) -> Any:
    def forward(self: Any, input: torch.Tensor) -> torch.Tensor:
        table = _KEPT.get(self)
        stats = self.running_mean if table and "running_mean" in table else None
        if stats is None and table and "running_var" in table:
            stats = self.running_var
        if stats is None:
            return original(self, input)
        dtype = stats.dtype
        if input.dtype == dtype and all(p is None or p.dtype == dtype for p in (self.weight, self.bias)):
            return original(self, input)
        return _bn_in(self, input, dtype)
    return forward


def _bn_in(bn: Any, input: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``_BatchNorm.forward`` computed in ``dtype`` (the statistics'), returned in the input's dtype."""
    bn._check_input_dim(input)
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    use_batch = bn.training or (bn.running_mean is None and bn.running_var is None)
    track = not bn.training or bn.track_running_stats
    weight = None if bn.weight is None else bn.weight.to(dtype)
    bias = None if bn.bias is None else bn.bias.to(dtype)
    out = F.batch_norm(input.to(dtype), bn.running_mean if track else None, bn.running_var if track else None,
                       weight, bias, use_batch, factor, bn.eps)
    return out.to(input.dtype)


def _make_configure(original: Any) -> Any:
    def _configure_distributed_model(self: Any, model: nn.Module) -> Any:
        _on_engine[0](model)
        held = [(m, {k: m._buffers.get(k) for k in table}, table) for m in model.modules()
                if (table := _KEPT.get(m))]
        saved = {id(t): t.data for _, before, _ in held for t in before.values() if t is not None}
        out = original(self, model)
        with torch.no_grad():
            for m, before, table in held:
                for local, t in before.items():  # 0.19.2+'s buffer_dtype: b.data = b.data.to(...), same tensor
                    entry = table.get(local)
                    if t is not None and entry is not None and m._buffers.get(local) is t and \
                            t.dtype in entry.unsafe_in and t.dtype != entry.dtype:
                        t.data = saved[id(t)].to(device=t.device, dtype=entry.dtype)
                _restore(m, before, table)  # a version that replaced the tensor
        return out
    return _configure_distributed_model


_on_engine: list[Callable[[nn.Module], None]] = [lambda model: None]  # install(keep_precision=...) sets it


def keep_everywhere(spec: Spec | None, fn: str) -> Callable[[], None]:
    """``install(keep_precision=spec)``: every module zero.Init converts, and every model a DeepSpeed engine is
    built around, is kept (entries of ``spec`` that match nothing in one of them are fine); returns the undo."""
    globs, classes = parse(spec, fn)
    handles: list[Kept] = []

    def keep(module: nn.Module) -> None:
        handles.append(_keep(module, globs, classes, True, fn, required=False))

    _ensure_patches(engine=True)
    anchor = _keep(nn.Module(), {}, {}, False, fn, required=False)  # a live handle holds the patches while installed
    try:
        undo_converted = ds_compat.on_module_converted(keep)
    except BaseException:
        anchor.remove()
        raise
    _on_engine[0] = keep

    def undo() -> None:
        _on_engine[0] = lambda model: None
        undo_converted()
        for h in reversed(handles):
            h.remove()
        handles.clear()
        anchor.remove()
    return undo


def handles_alive() -> int:
    """How many handles are not removed (tests check that none leak)."""
    return len(_live)
