"""Declared reductions: every buffer gets a rule (by qualified-name pattern, by module class, or registered by the
library that owns the class), and one transaction applies them all, one coalesced collective per kind and bucket.

Rules: ``"broadcast"`` (from ``src``), ``"mean"``, ``"sum"``, ``"max"``, ``"min"`` (element-wise over the ranks),
``"bn"`` (a BatchNorm layer's statistics together: the exact mixture of :func:`average_bn_stats`) and ``"local"``
(never touched). Which rule a buffer gets, first match wins:

1. a qualified-name glob in ``rules`` (``"*.cluster_size"``; two globs with different rules on one buffer raise);
2. a module class in ``rules`` (the most derived class of the owning module that is listed); its value is a rule for
   every buffer of the module, or a mapping from the buffer's own name to a rule;
3. a class registered with :func:`register_rules` (same lookup);
4. the default: a tracking BatchNorm's statistics ``"bn"``, every other buffer ``"broadcast"``.
"""
from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .._compat import torch as torch_compat
from .._core import (
    modules as _modules,
    notice as _notice,
    placement as _placement,
    transaction as _transaction,
    wire as _wire,
)
from .._core.group import Group
from ..bn import average as bn_average, recompute as bn_recompute
from ..errors import InvalidArgumentError

Rule = Literal["broadcast", "mean", "sum", "max", "min", "bn", "local"]
RULES: tuple[str, ...] = ("broadcast", "mean", "sum", "max", "min", "bn", "local")
Rules = Mapping[Any, Any]
"""``{glob or module class: rule}``; a class may map to ``{buffer name: rule}``."""

_STATS = ("running_mean", "running_var", "num_batches_tracked")
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
"""The all-reduce of each element-wise rule ("mean" divides the sum afterwards)."""


def wire_dtype(rule: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a kind's bucket is reduced in: ``"mean"`` and ``"sum"`` of floats narrower than 32 bits in float64
    (exact sums, one rounding when written back), bools as uint8, everything else as it is."""
    if rule in ("mean", "sum") and dtype.is_floating_point and torch.finfo(dtype).bits < 32:
        return torch.float64
    if rule in ("mean", "sum") and dtype == torch.complex32:
        return torch.complex128
    return torch.uint8 if dtype == torch.bool else dtype


@dataclass(frozen=True)
class _Registered:
    rules: str | Mapping[str, str]
    after_sync: Callable[[nn.Module], Any] | None


_REGISTRY: dict[type | str, _Registered] = {}


def register_rules(cls: type | str, rules: str | Mapping[str, str], *,
                   after_sync: Callable[[nn.Module], Any] | None = None) -> None:
    """Declare how the buffers of every instance of ``cls`` are reduced, for every later sync that uses rules.

    ``cls`` is a module class, or its ``"module.QualName"`` so a library need not be imported to register it.
    ``rules`` is one rule for all of its buffers or ``{buffer name: rule}``. ``after_sync(module)`` runs on every
    instance after its buffers were written (to recompute what is derived from them). Rules passed to the call
    itself take precedence. Registering a class again replaces its entry.

    Example::

        zero_buffers.register_rules(MoERouter, {"tokens_per_expert": "sum", "step": "max"})
    """
    fn = "register_rules"
    if not isinstance(cls, (type, str)):
        raise InvalidArgumentError(f"{fn}(): cls must be a module class or its 'module.QualName', got {cls!r}")
    rules = normalise(rules, fn, f"the rules of {cls!r}")
    _check_value(rules, fn, f"the rules of {cls!r}")
    if after_sync is not None and not callable(after_sync):
        raise InvalidArgumentError(f"{fn}(): after_sync must be a callable (module) -> None, got {after_sync!r}")
    _REGISTRY[cls] = _Registered(rules if isinstance(rules, str) else dict(rules), after_sync)


def registered_in(module: nn.Module) -> bool:
    """Whether a module of ``module``'s tree has rules registered for its class (then policies apply them too)."""
    if not _REGISTRY:
        return False
    return any(k in _REGISTRY for m in module.modules() for c in type(m).__mro__
               for k in (c, f"{c.__module__}.{c.__qualname__}"))


_PLACEMENT_RULES = {("R", None): "broadcast", ("P", "sum"): "sum", ("P", "avg"): "mean", ("P", "max"): "max",
                    ("P", "min"): "min"}
"""A placement named as a rule ([Note: placements]): ``Replicate()`` is ``"broadcast"``, ``Partial(op)`` the
element-wise reduction of its op over the group (``"avg"`` is ``"mean"``)."""


def normalise(value: Any, fn: str, what: str) -> Any:
    """``value`` with every placement object replaced by its rule (InvalidArgumentError for ``Shard``, which says
    nothing about a plain buffer's values); other values as they are."""
    if isinstance(value, Mapping):
        return {k: normalise(v, fn, f"{what}[{k!r}]") for k, v in value.items()}
    found = torch_compat.placement_rule(value)
    if found is None:
        return value
    if found not in _PLACEMENT_RULES:
        raise InvalidArgumentError(
            f"{fn}(): {what} names the placement {value!r}; rules may name Replicate() (\"broadcast\") and "
            "Partial(sum / avg / max / min) (\"sum\" / \"mean\" / \"max\" / \"min\"); a sharded buffer is a DTensor "
            "whose own placements say so")
    return _PLACEMENT_RULES[found]


def _check_value(value: Any, fn: str, what: str) -> None:
    """InvalidArgumentError for a value that is neither a rule nor a {buffer name: rule} mapping of rules."""
    if isinstance(value, str):
        if value not in RULES:
            raise InvalidArgumentError(f"{fn}(): unknown rule {value!r} for {what}; rules are "
                                       f"{', '.join(map(repr, RULES))}")
        return
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{fn}(): {what} must be a rule ({', '.join(map(repr, RULES))}) or a mapping "
                                   f"from buffer names to rules, got {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgumentError(f"{fn}(): {what} must map buffer names (str) to rules, got {k!r}: {v!r}")
        _check_value(v, fn, f"{what}[{k!r}]")


@dataclass(frozen=True)
class Assigned:
    """One buffer's rule and where it came from (``pattern '*.x'``, ``class Foo``, ``registered Foo``, ``default``)."""

    name: str
    tensor: torch.Tensor
    rule: str
    source: str


@dataclass
class Plan:
    """A model's buffers by rule, resolved and checked at the call, before any collective."""

    assigned: list[Assigned]
    bns: list[_modules.BatchNorm] = field(default_factory=list)
    after: list[tuple[nn.Module, Callable[[nn.Module], Any]]] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)  # every module of the tree, where the buffers live

    def of(self, rule: str) -> list[Assigned]:
        return [a for a in self.assigned if a.rule == rule]

    @property
    def signature(self) -> tuple[tuple[str, str], ...]:
        """(name, rule) of every buffer: part of the structure every rank agrees on."""
        return tuple((a.name, a.rule) for a in self.assigned)

    def hooks(self) -> list[Callable[[], Any]]:
        """Every registered ``after_sync`` hook, bound to its module."""
        return [functools.partial(hook, module) for module, hook in self.after]

    def hooked(self) -> list[torch.Tensor]:
        """Every buffer and plain parameter of the modules with a hook: what a hook may change ("local" buffers, a
        codebook kept as a parameter and recomputed from the synced statistics)."""
        return [t for module, _ in self.after for t in (*module.buffers(), *module.parameters())
                if not torch_compat.is_dtensor(t) and not t.is_meta]

    def synced(self) -> list[_modules.Entry]:
        """Every entry a sync moves (all but ``"local"``), in module order."""
        return [(a.name, a.tensor) for a in self.assigned if a.rule != "local"]


def _class_rule(module: nn.Module, key: str, table: Mapping[Any, Any]) -> tuple[str, Any] | None:
    """(rule, the matching key) from the most derived listed class of ``module``, or None."""
    for klass in type(module).__mro__:
        for k in (klass, f"{klass.__module__}.{klass.__qualname__}"):
            if k in table:
                value = table[k]
                rule = value.rules if isinstance(value, _Registered) else value
                if isinstance(rule, str):
                    return rule, k
                if key in rule:
                    return rule[key], k
                return None
    return None


def _label(k: Any) -> str:
    return k.__name__ if isinstance(k, type) else str(k)


def parse(rules: Rules | None, fn: str) -> tuple[dict[str, str], dict[Any, Any]]:
    """The rules themselves checked (keys, values), without looking at any model: (patterns, classes).
    InvalidArgumentError for what is wrong, the same on every rank that passed the same rules."""
    rules = {} if rules is None else rules
    if not isinstance(rules, Mapping):
        raise InvalidArgumentError(f"{fn}(): rules must be a mapping {{glob or module class: rule}}, got "
                                   f"{type(rules).__name__}")
    patterns: dict[str, str] = {}
    classes: dict[Any, Any] = {}
    for k, v in rules.items():
        v = normalise(v, fn, f"rule {k!r}")
        if isinstance(k, str):
            _check_value(v, fn, f"pattern {k!r}")
            if not isinstance(v, str):
                raise InvalidArgumentError(f"{fn}(): pattern {k!r} must map to one rule, got {v!r}")
            patterns[k] = v
        elif isinstance(k, type) and issubclass(k, nn.Module):
            _check_value(v, fn, f"class {k.__name__}")
            classes[k] = v
        else:
            raise InvalidArgumentError(f"{fn}(): rules keys must be qualified-name globs (str) or nn.Module classes, "
                                       f"got {k!r}")
    return patterns, classes


def resolve(module: nn.Module, rules: Rules | None, fn: str, *, strict: bool = False,
            bn_default: str = "bn", group: Any = None) -> Plan:
    """Every buffer of ``module`` with its rule; InvalidArgumentError (the same on every rank that has the same model
    and rules) for unknown rules, rules claimed twice, ``"bn"`` outside BatchNorm statistics, ``"mean"`` on integers
    or bools, ``"sum"`` on bools; globs and classes that match nothing warn once, on the first rank of ``group``
    (raise with ``strict=True``)."""
    patterns, classes = parse(rules, fn)
    used: set[Any] = set()
    assigned: list[Assigned] = []
    layers = _modules.tracking_bn(module)
    stats = {id(t) for bn in layers for _, t in bn.entries()}
    after: dict[int, tuple[nn.Module, Callable[[nn.Module], Any]]] = {}
    for name, mod, key, buf in _modules.owned_buffers(module.named_modules(remove_duplicate=True)):
        hits = {(p, r) for p, r in patterns.items() if fnmatch.fnmatchcase(name, p)}
        used.update(p for p, _ in hits)
        if len({r for _, r in hits}) > 1:
            (p1, r1), (p2, r2) = sorted(hits)[:2]
            raise InvalidArgumentError(f"{fn}(): buffer '{name}' is claimed by two rules: pattern {p1!r} says "
                                       f"{r1!r}, pattern {p2!r} says {r2!r}. No buffer was modified")
        if hits:
            (pattern, rule), = sorted(hits)[:1]
            source = f"pattern {pattern!r}"
        elif (found := _class_rule(mod, key, classes)) is not None:
            rule, k = found
            used.add(k)
            used.add((k, key))
            source = f"class {_label(k)}"
        elif (found := _class_rule(mod, key, _REGISTRY)) is not None:
            rule, k = found
            source = f"registered {_label(k)}"
            if _REGISTRY[k].after_sync is not None:
                after[id(mod)] = (mod, _REGISTRY[k].after_sync)  # type: ignore[assignment]
        else:
            rule = bn_default if id(buf) in stats else "broadcast"
            source = "default"
        _check_rule(name, buf, rule, id(buf) in stats, source, fn)
        assigned.append(Assigned(name, buf, rule, source))
    named = [(k, key) for k, v in classes.items() if isinstance(v, Mapping) for key in v]  # {class: {name: rule}}
    for k in [*patterns, *classes, *named]:
        if k in used:
            continue
        if k in classes and any(isinstance(m, k) for m in module.modules()):
            continue  # the class is there (a name its mapping lists but no instance has is reported below)
        if isinstance(k, tuple) and not any(isinstance(m, k[0]) for m in module.modules()):
            continue  # the class itself is missing: reported once, above
        what = f"{_label(k[0])}: {{{k[1]!r}: ...}}" if isinstance(k, tuple) else _label(k)
        message = f"{fn}(): rule {what!r} matches no buffer of the model"
        if strict:
            raise InvalidArgumentError(message + " (strict=True). No buffer was modified")
        _notice.warn(message, once=f"rules:{what}", stacklevel=4, group=group)
    bns = []
    rule_of = {id(a.tensor): a.rule for a in assigned}
    for bn in layers:
        layer = {rule_of.get(id(t)) for _, t in bn.entries()}
        if "bn" in layer and layer != {"bn"}:
            raise InvalidArgumentError(f"{fn}(): BatchNorm '{bn.name}': 'bn' merges a layer's statistics together, "
                                       f"but its statistics got the rules {sorted(r for r in layer if r)}. No buffer "
                                       "was modified")
        if layer == {"bn"}:
            bns.append(bn)
    return Plan(assigned, bns, list(after.values()), list(module.modules()))


def _check_rule(name: str, t: torch.Tensor, rule: str, bn_stat: bool, source: str, fn: str) -> None:
    """InvalidArgumentError for a rule this buffer cannot take (named, with the rule's source)."""
    why = None
    if rule == "bn" and not bn_stat:
        why = "'bn' applies to a tracking BatchNorm's running_mean / running_var / num_batches_tracked only"
    elif rule == "mean" and (t.dtype == torch.bool or not (t.is_floating_point() or t.is_complex())):
        why = (f"'mean' of {str(t.dtype).removeprefix('torch.')} values is not exact (zero_buffers does not round): "
               "use 'max', 'min' or 'sum' for counters and flags, or keep the buffer in floating point")
    elif rule == "sum" and t.dtype == torch.bool:
        why = "'sum' of bool flags is not a bool: use 'max' (any rank) or 'min' (every rank)"
    elif rule in ("max", "min") and t.is_complex():
        why = f"'{rule}' of complex values is not defined"
    if why is None and torch_compat.is_dtensor(t) and rule != "local":
        roles = torch_compat.placements(t)
        if rule == "bn":
            why = "'bn' of DTensor statistics is not implemented: keep BatchNorm statistics plain tensors"
        elif any(k == "P" for k, _ in roles) and rule != "broadcast":
            why = (f"a Partial DTensor is reduced by its own op ({roles}); only its default ('broadcast', i.e. "
                   "Replicate() once reduced) or 'local' apply to it")
    if why is not None:
        raise InvalidArgumentError(f"{fn}(): buffer '{name}' ({str(t.dtype).removeprefix('torch.')}) has rule "
                                   f"{rule!r} ({source}): {why}. No buffer was modified")


def _flat(rule: str, ts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One bucket's tensors as a fresh flat tensor on ``device`` in the dtype ``rule`` reduces it in
    (:func:`wire_dtype`)."""
    flat = torch_compat.flatten([t.detach() for t in ts])
    return flat.to(device, wire_dtype(rule, flat.dtype))


def apply(g: Group, plan: Plan, src: int, deadline: _wire.Deadline, fn: str, *, call: tuple = (),
          sums: Any = None) -> int:
    """One transaction for every rule: structure (names, rules, dtypes, shapes) agreed, every kind exchanged into
    scratch, written only once every rank received everything; ``after_sync`` hooks then run. ``sums``: recomputed
    BatchNorm sums (the "recompute" policy) to write for the ``"bn"`` layers instead of merging. Over a mesh
    ([Note: placements]) each kind runs per class of replicated dimensions, in its own group, and Partial DTensors
    are reduced by their own op first."""
    entries = plan.synced()
    placed = _placement.placed(g, entries, deadline, fn)
    local = {id(t): t for _, t in entries}  # a DTensor's entry -> its local tensor
    if placed is not None:
        g = placed.g
        local = {id(t): lt for (_, t), (_, lt) in zip(entries, placed.entries)}
        call = (*call, "placements", placed.signature)
    partials = _placement.Partials(placed, src) if placed is not None else None
    skip = {id(entries[i][1]) for i in partials.indices} if partials is not None else set()
    index = {id(t): i for i, (_, t) in enumerate(entries)}

    def by_class(rule: str) -> list[tuple[Group, list[torch.Tensor]]]:
        ids = [index[id(a.tensor)] for a in plan.of(rule) if id(a.tensor) not in skip]
        if placed is None:
            return [(g, [entries[i][1] for i in ids])] if ids else []
        return [(sub, [local[id(entries[i][1])] for i in idx]) for sub, idx in placed.classes(ids) if sub is not None]

    sends = [(sub, ts, _placement.source_in(g, sub, src)) for sub, ts in by_class("broadcast")]
    sends_planned = [(sub, ts, s, _wire.plan(ts)) for sub, ts, s in sends]
    kinds = [(rule, sub, ts, _wire.plan(ts)) for rule in REDUCE_OPS for sub, ts in by_class(rule)]

    def prepare() -> Any:
        if partials is not None:
            partials.prepare()
        spaces = [_wire.send_space(ts, bs) if sub.me == s else _wire.receive_space(bs)
                  for sub, ts, s, bs in sends_planned]
        flats = [[_flat(rule, [ts[i] for i in b.indices], sub.device) for b in bs] for rule, sub, ts, bs in kinds]
        pack = bn_average._pack(plan.bns, g.device) if plan.bns and sums is None else None
        return spaces, flats, pack

    def exchange(prepared: Any) -> None:
        spaces, flats, pack = prepared
        if pack is not None:
            _wire.all_reduce(g, pack, deadline, fn)
        if partials is not None:
            partials.exchange(deadline, fn)
        for (rule, sub, _, _), parts in zip(kinds, flats):
            for flat in parts:
                _wire.all_reduce(sub, flat, deadline, fn, op=REDUCE_OPS[rule])
        for (sub, ts, s, bs), space in zip(sends_planned, spaces):
            _wire.broadcast(sub, ts, bs, s, space, deadline, fn)

    ready: list[Callable[[], Any]] = []  # the copies, prepared by compute()

    def compute(prepared: Any) -> None:
        spaces, flats, pack = prepared
        if pack is not None:
            merged = bn_average.merge(plan.bns, pack)
            ready.append(lambda: bn_average.apply(merged))
        elif sums is not None:
            recomputed = bn_recompute.compute(*sums)
            ready.append(lambda: bn_recompute.apply(recomputed))
        for (rule, sub, ts, bs), parts in zip(kinds, flats):
            for b, flat in zip(bs, parts):
                part = [ts[i] for i in b.indices]
                value = (flat / sub.size if rule == "mean" else flat).to(part[0].device, part[0].dtype)
                ready.append(functools.partial(torch_compat.unflatten_into, value, part))
        for (sub, ts, s, bs), space in zip(sends_planned, spaces):
            if sub.me != s:
                ready.append(functools.partial(_wire.write, ts, bs, space))
        if partials is not None:
            ready.append(partials.apply)

    def write(_: Any) -> None:
        for copy in ready:
            copy()

    moved = placed.entries if placed is not None else entries
    # [Note: the transaction]: the hooks run in AFTER, where a failure on any rank puts every rank's buffers back
    _transaction.commit(g, ("rules", src, plan.signature, *call), moved, deadline, fn, prepare=prepare,
                        exchange=exchange, compute=compute, apply=write, after=plan.hooks(), keep=plan.hooked(),
                        undo=partials.relabel_back if partials is not None else None)
    return len(entries)
