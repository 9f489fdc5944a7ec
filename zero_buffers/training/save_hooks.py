"""Checkpoints that carry synchronised buffers: sync_buffers (plain torch), sync_buffers_on_save (Accelerate,
DeepSpeed)."""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn

from .._compat import accelerate as acc_compat, deepspeed as ds_compat, torch as torch_compat
from .._core import (
    args as _args,
    group as _group,
    modules as _modules,
    notice as _notice,
    structure as _structure,
    transaction as _transaction,
    wire as _wire,
)
from ..bn import average as bn_average, recompute as bn_recompute
from ..bn.recompute import recompute_bn_stats
from ..errors import InvalidArgumentError
from ..report import assert_buffers_in_sync
from . import rules as rules_mod

Policy = Literal["broadcast", "average", "recompute", "check"]
POLICIES: tuple[str, ...] = ("broadcast", "average", "recompute", "check")

# The Accelerator methods save hooks wrap are _compat.accelerate.SAVE_METHODS. save_state is called on every rank;
# get_state_dict / save_model only under ZeRO-3 (elsewhere they are often called on the main process alone, where a
# collective would hang: they warn instead).


def sync_buffers(model: nn.Module, policy: Policy | None = None, *, rules: rules_mod.Rules | None = None,
                 strict: bool = False, src: int = 0, data: Any = None, num_batches: int | None = None,
                 group: Any = None, timeout: _args.Timeout = None, progress: bool | None = None,
                 device: torch.device | str | None = None,
                 forward: Callable[[nn.Module, Any], Any] | None = None, global_batch: bool = False) -> int:
    """Make ``model``'s buffers identical on every rank according to ``policy`` and ``rules``; call it on every rank
    before saving.

    ``rules`` declares a reduction per buffer (:mod:`zero_buffers.training.rules`): ``{"*.cluster_size": "mean",
    MoERouter: {"tokens_per_expert": "sum"}, "*.rng_offset": "local"}``, with ``"broadcast"``, ``"mean"``,
    ``"sum"``, ``"max"``, ``"min"``, ``"bn"`` and ``"local"``; buffers no rule names take the default (a
    BatchNorm's statistics ``"bn"``, the rest ``"broadcast"``) or the rules their class registered
    (:func:`register_rules`). The policies are presets: ``"average"`` is the default rules, ``"broadcast"``
    makes BatchNorm statistics ``"broadcast"`` too, ``"recompute"`` recomputes them (every other buffer by its
    rule). ``strict=True`` raises for a rule that matches no buffer (else it warns once).

    - ``"broadcast"``: every buffer takes rank ``src``'s value (:func:`broadcast_buffers`).
    - ``"average"``: BatchNorm statistics become the exact merge of all ranks' (:func:`average_bn_stats`)
      and every other buffer takes ``src``'s value (what DDP does before each forward).
    - ``"recompute"``: BatchNorm statistics are recomputed over every rank's ``data``
      (:func:`recompute_bn_stats`, with ``num_batches``, ``device``, ``forward``, ``progress``,
      ``global_batch``) and every
      other buffer takes ``src``'s value. ``data`` is iterated once; a call in which no rank had a batch
      raises :class:`RecomputeError` and changes nothing.

    One transaction for the whole model: the structure of every buffer is agreed before anything is
    written (a mismatch in any buffer raises before the statistics are touched), and the merged or
    recomputed statistics and the broadcast buffers are written together, after every rank confirmed it
    received them, or not at all.
    - ``"check"``: nothing changes; :class:`BuffersOutOfSyncError` is raised on every rank if any buffer
      differs (use it to refuse to write a checkpoint that would carry one rank's values).

    ``src`` is a rank within ``group``. DDP, DeepSpeed engines and Accelerate-prepared models are unwrapped.
    Returns the number of buffers
    now known identical on every rank (checked ones for ``"check"``; 0 without a process group).

    Example::

        zero_buffers.sync_buffers(model, "average")       # on every rank
        if dist.get_rank() == 0:
            torch.save(model.module.state_dict(), "ckpt.pt")
    """
    fn = "sync_buffers"
    _check_policy(policy, data, fn, rules=rules)
    if policy is None and rules is None:
        policy = "average"  # the default rules: BatchNorm statistics merged, every other buffer from src
    _args.module(model, fn)
    src = _args.rank(src, "src", fn)
    seconds = _args.timeout(timeout, fn)
    bn_recompute.check_options(num_batches, forward)
    global_batch = _args.flag(global_batch, "global_batch", fn)
    g = _group.resolve(group, fn)
    _group.check_src(g, src, fn)  # before any collective, whatever the policy
    inner = _modules.unwrap(model, fn)
    plan = None
    if rules is None and policy in ("broadcast", "average", "recompute") and (
            rules_mod.registered_in(inner) or (g is not None and g.mesh is not None)
            or any(torch_compat.is_dtensor(b) for b in inner.buffers())):
        rules = {}  # registered rules, a mesh or DTensor buffers: the policy is the preset, [Note: placements] apply
    strict = _args.flag(strict, "strict", fn)
    deadline = _wire.Deadline(seconds)
    if rules is not None:  # the rules checked before any collective, with or without a process group
        rules_mod.parse(rules, fn)
        try:  # what depends on this rank's model: a rank that cannot plan tells its peers in their first collective
            plan = _plan(inner, rules, policy, strict, fn, group if g is None else g)
        except InvalidArgumentError as e:
            if g is None:
                raise
            _structure.refuse(g, e, deadline, fn)
    if policy == "check":
        report = assert_buffers_in_sync(inner, group=group, timeout=timeout)
        return len(report.rows) if report.checked else 0
    if g is None:
        if not _group.initialized() and policy != "recompute":
            _notice.single_process(fn)
        if policy == "recompute" and not (_group.initialized() and group is not None):
            recompute_bn_stats(inner, data, num_batches=num_batches, progress=progress, device=device,
                               forward=forward, global_batch=global_batch)
        return 0
    sums = None
    if policy == "recompute":  # the passes and their all-reduce; nothing is written before the commit below
        _structure.agree(g, (fn, policy, src, "before the passes", plan.signature if plan else None),
                         _modules.named_buffers(inner), deadline, fn)
        sums = bn_recompute.population_sums(inner, data, g, deadline, num_batches=num_batches, progress=progress,
                                            device=device, forward=forward, global_batch=global_batch, outer=model)
    if plan is not None:
        return rules_mod.apply(g, plan, src, deadline, fn, call=(policy,), sums=sums)
    return _commit(g, inner, str(policy), src, sums, deadline, fn)


def _plan(inner: nn.Module, rules: rules_mod.Rules, policy: str | None, strict: bool, fn: str,
          group: Any = None) -> rules_mod.Plan:
    """The rules resolved on ``inner`` (InvalidArgumentError for what this model cannot take); ``group``: the call's,
    whose first rank warns."""
    plan = rules_mod.resolve(inner, rules, fn, strict=strict, bn_default="broadcast" if policy == "broadcast" else "bn",
                             group=group)
    if policy == "recompute":
        stats = {id(t) for _, t in _modules.bn_stat_entries(_modules.tracking_bn(inner))}
        odd = [a for a in plan.assigned if a.rule != "bn" and id(a.tensor) in stats]
        if odd:
            raise InvalidArgumentError(f"{fn}(): policy 'recompute' recomputes every BatchNorm's statistics, but "
                                       f"'{odd[0].name}' has rule {odd[0].rule!r} ({odd[0].source})")
    return plan


def _commit(g: _group.Group, inner: nn.Module, policy: str, src: int, sums: bn_recompute.Sums | None,
            deadline: _wire.Deadline, fn: str) -> int:
    """One transaction for every buffer: BatchNorm statistics merged (``"average"``: their all-reduce is part of the
    exchange) or recomputed (``sums``), every other buffer broadcast from ``src``; all written, or none."""
    entries = _modules.named_buffers(inner)
    bns = _modules.tracking_bn(inner) if policy != "broadcast" else []
    stats = {id(t) for bn in bns for _, t in bn.entries()}
    others = [t for _, t in entries if id(t) not in stats]
    buckets = _wire.plan(others)
    source = g.me == src

    def prepare() -> Any:
        space = _wire.send_space(others, buckets) if source else _wire.receive_space(buckets)
        return space, bn_average._pack(bns, g.device) if policy == "average" else None

    def exchange(prepared: Any) -> None:
        space, pack = prepared
        if pack is not None:
            _wire.all_reduce(g, pack, deadline, fn)
        _wire.broadcast(g, others, buckets, src, space, deadline, fn)

    ready: list[Callable[[], Any]] = []  # the copies, prepared by compute()

    def compute(prepared: Any) -> None:
        space, pack = prepared
        if pack is not None:
            merged = bn_average.merge(bns, pack)
            ready.append(lambda: bn_average.apply(merged))
        elif sums is not None:
            recomputed = bn_recompute.compute(*sums)
            ready.append(lambda: bn_recompute.apply(recomputed))
        if not source:
            ready.append(lambda: _wire.write(others, buckets, space))

    def apply(_: Any) -> None:
        for copy in ready:
            copy()

    content = bn_average.stats_digest(g, [e for bn in bns for e in bn.entries()], fn) if policy == "average" else 0
    contents = _transaction.commit(g, (fn, policy, src), entries, deadline, fn, prepare=prepare, exchange=exchange,
                                   compute=compute, apply=apply, extra=content)
    if policy == "average" and len(set(contents)) == 1 and contents[0] != 0:
        bn_average.warn_identical(f"{fn}(policy='average')", g)
    return len(entries)


def _check_policy(policy: Any, data: Any, fn: str, reused: bool = False, rules: Any = None) -> None:
    """Raise InvalidArgumentError for an unknown policy, ``"check"`` with rules,
    ``"recompute"`` without data, or (``reused``: data that every save iterates again) a one-shot iterator; before
    any collective."""
    if policy == "check" and rules is not None:
        raise InvalidArgumentError(f"{fn}(): policy 'check' changes nothing, so it takes no rules")
    if policy is not None and policy not in POLICIES:
        raise InvalidArgumentError(f"{fn}(): policy must be one of {', '.join(map(repr, POLICIES))}, got {policy!r}")
    if policy == "recompute" and data is None:
        raise InvalidArgumentError(f"{fn}(): policy 'recompute' needs data= (each rank's batches)")
    if policy != "recompute" and data is not None:
        raise InvalidArgumentError(f"{fn}(): data= is only used by policy 'recompute', not {policy!r}")
    if reused and data is not None and _one_shot(data):
        raise InvalidArgumentError(
            f"{fn}(): data is a one-shot iterator ({type(data).__name__}), but every save iterates it again: the "
            "second save would see no batch. Pass something iterable many times (a list, a DataLoader) or a "
            "callable that returns a fresh iterable (data=lambda: iter(loader))")


def _one_shot(data: Any) -> bool:
    """An iterator that is its own iterable (a generator, ``iter(list)``): it can be iterated only once."""
    if isinstance(data, (torch.Tensor, dict)) or (callable(data) and not hasattr(data, "__iter__")):
        return False
    try:
        return iter(data) is data
    except TypeError:
        return False


class SaveHook:
    """Handle returned by :func:`sync_buffers_on_save`: ``remove()`` puts the original methods back.

    Also a context manager: ``with sync_buffers_on_save(accelerator, "average"): accelerator.save_state(d)``.
    """

    def __init__(self, target: Any, methods: Iterable[str], sync: Callable[[Any, str, tuple, dict], None]):
        self.target = target
        self._sync = sync
        self._active = False
        self._saved: dict[str, Any] = {}
        for name in methods:
            original = getattr(target, name)
            self._saved[name] = target.__dict__.get(name, _MISSING)
            object.__setattr__(target, name, self._wrap(name, original))
        object.__setattr__(target, "_zero_buffers_save_hook", self)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        """``original`` preceded by the sync, once per outermost call (save_state calls get_state_dict)."""
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._active:
                return original(*args, **kwargs)
            self._active = True
            try:
                self._sync(self.target, name, args, kwargs)
                return original(*args, **kwargs)
            finally:
                self._active = False
        return wrapper

    @property
    def installed(self) -> bool:
        return getattr(self.target, "_zero_buffers_save_hook", None) is self

    def remove(self) -> None:
        """Restore the wrapped methods (idempotent)."""
        if not self.installed:
            return
        for name, old in self._saved.items():
            if old is _MISSING:
                object.__delattr__(self.target, name)
            else:
                object.__setattr__(self.target, name, old)
        object.__delattr__(self.target, "_zero_buffers_save_hook")

    def __enter__(self) -> SaveHook:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


_MISSING = object()


class _RepeatedSaves:
    """The syncs of one save hook, through a hookless :func:`keep_in_sync` per model begun at its first save: that
    first sync counts every rank's whole statistics (the merge :func:`sync_buffers` does), each later one what the
    ranks added since ([Note: repeated merges] in bn/average.py), so a save with no training in between changes
    nothing and a batch never counts twice. ``"recompute"`` and ``"check"`` are one-shot by nature and stay so."""

    def __init__(self, policy: str | None, options: dict[str, Any]):
        self.policy, self.options = policy, options
        self.handles: dict[int, Any] = {}

    def sync(self, model: Any) -> None:
        if self.policy in ("recompute", "check"):
            sync_buffers(model, self.policy, **self.options)  # type: ignore[arg-type]
            return
        inner = _modules.unwrap(model, "sync_buffers_on_save")
        handle = self.handles.get(id(inner))
        if handle is None or handle.module is not inner:
            from .keep_in_sync import hookless
            o = self.options
            handle = self.handles[id(inner)] = hookless(
                inner, self.policy, "zero", rules=o["rules"], src=o["src"], group=o["group"], timeout=o["timeout"],
                strict=o["strict"], identical_warning=f"sync_buffers_on_save(policy={self.policy or 'average'!r})")
        handle.sync()  # the lean loop of [Note: steady state] from the second save on


def sync_buffers_on_save(target: Any, policy: Policy | None = None, *, rules: rules_mod.Rules | None = None,
                         strict: bool = False, src: int = 0, data: Any = None,
                         num_batches: int | None = None, group: Any = None, timeout: _args.Timeout = None,
                         progress: bool | None = None, device: torch.device | str | None = None,
                         forward: Callable[[nn.Module, Any], Any] | None = None,
                         global_batch: bool = False) -> SaveHook:
    """Make every checkpoint that ``target`` writes carry synchronised buffers: :func:`sync_buffers` runs first.

    ``target`` is an ``accelerate.Accelerator`` or a DeepSpeed engine. Only methods that every rank must
    call anyway are wrapped, so the sync (a collective) cannot hang a rank-0-only call:

    - Accelerator: ``save_state`` (DDP, DeepSpeed and single-process paths; every prepared model is
      synced before anything is written, which Accelerate's save-state "pre" hooks cannot do: they run
      after the DeepSpeed save) and ``get_state_dict`` / ``save_model`` for ZeRO-3 engines and FSDP1 / FSDP2
      models (every rank calls those there: their state dicts are gathered). On the DDP
      path ``get_state_dict`` / ``save_model`` are often called on the main process only, where a sync
      would hang: they warn (:class:`ZeroBuffersWarning`, once per process) that they write this rank's
      buffers; call :func:`sync_buffers` on every rank before them.
    - DeepSpeed engine: ``save_checkpoint`` (under ZeRO-3 each rank writes its own buffers; now they are
      equal, so ``load_checkpoint`` and ``zero_to_fp32``, which reads rank 0's file, agree),
      ``save_16bit_model`` and ``_zero3_consolidated_16bit_state_dict`` (rank 0's buffers).

    Returns a :class:`SaveHook`; ``hook.remove()`` undoes it (it is also a context manager).

    Example::

        zero_buffers.sync_buffers_on_save(accelerator, "average")   # once, after prepare()
        accelerator.save_state("ckpt")                               # BatchNorm stats of all ranks
    """
    _check_policy(policy, data, "sync_buffers_on_save", reused=True, rules=rules)
    src = _args.rank(src, "src", "sync_buffers_on_save")  # now, not at the first save
    _args.timeout(timeout, "sync_buffers_on_save")
    if getattr(target, "_zero_buffers_save_hook", None) is not None:
        raise InvalidArgumentError(
            "sync_buffers_on_save(): this object already has a save hook; call .remove() on it first")
    options = dict(rules=rules, strict=strict, src=src, data=data, num_batches=num_batches, group=group,
                   timeout=timeout, progress=progress, device=device, forward=forward,
                   global_batch=_args.flag(global_batch, "global_batch", "sync_buffers_on_save"))

    repeated = _RepeatedSaves(policy, options)

    if acc_compat.is_accelerator(target):
        acc_compat.prepared_models(target)  # fail now, not at the first save, on an Accelerate without it
        methods = acc_compat.save_methods(target)

        def sync_accelerator(acc: Any, name: str, args: tuple, kwargs: dict) -> None:
            if name == "save_state":
                for model in acc_compat.prepared_models(acc):
                    repeated.sync(model)
            else:  # get_state_dict / save_model(model, ...): collective only for a ZeRO-3 engine or an FSDP model,
                # whose state dict every rank must build anyway
                model = args[0] if args else kwargs.get("model")
                zero3 = model is not None and ds_compat.is_engine(model) and ds_compat.engine_is_zero3(model)
                if model is not None and (zero3 or (isinstance(model, nn.Module)
                                                    and any(_modules.fsdp_kinds(model, name)))):
                    repeated.sync(model)
                else:
                    _notice.warn(
                        f"accelerator.{name}() writes the model's buffers as this rank holds them (rank 0's "
                        f"statistics on the main process): the {policy!r} save hook does not sync here, because "
                        f"{name} is often called on the main process alone, where a collective would hang. Call "
                        f"zero_buffers.sync_buffers(model, {policy!r}) on every rank first, or use "
                        "accelerator.save_state(), which the hook covers.", once=f"accelerate.{name}", stacklevel=4)
        return SaveHook(target, methods, sync_accelerator)

    if ds_compat.is_engine(target):  # every method and the model checked now, not at the first save
        methods = ds_compat.engine_save_methods(target)
        ds_compat.engine_module(target)

        def sync_engine(engine: Any, name: str, args: tuple, kwargs: dict) -> None:
            repeated.sync(ds_compat.engine_module(engine))
        return SaveHook(target, methods, sync_engine)

    raise InvalidArgumentError(
        f"sync_buffers_on_save() expects an accelerate.Accelerator or a DeepSpeed engine, got {type(target).__name__}; "
        "for a plain module call zero_buffers.sync_buffers(model, policy) on every rank before torch.save")
