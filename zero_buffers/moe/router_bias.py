"""router_bias: the aux-loss-free load-balancing update of an MoE router bias (DeepSeek-V3's
``e_score_correction_bias``), counted over the global batch and applied identically on every rank.

After every ``every``-th optimizer step, for each gate: ``load`` = tokens routed to each expert since the last
update, summed over the data-parallel group; ``bias += gamma * sign(mean(load) - load)`` (``rule="sign"``, DeepSeek-V3)
or ``bias += gamma * (mean(load) - load) / mean(load)`` (``rule="proportional"``). Experts that got fewer tokens than
the mean are favoured next time.

[Note: counted once]
A gate's tokens count in its forward hook when, and only when, the gate is in train mode and the forward does not
run inside the autograd engine's backward (``_compat/torch.py``: ``in_backward``). Activation checkpointing runs the
forward again during backward to rebuild what it freed: torch's reentrant checkpoint from
``CheckpointFunction.backward``, the non-reentrant one from the saved-tensor unpack hook, and transformers'
``gradient_checkpointing_enable()`` through either (DeepSpeed's ``deepspeed.checkpointing.checkpoint`` is an
autograd Function that recomputes in its backward too; not tested here). Every one recomputes inside the backward,
so none counts, while the first forward counts whether it ran with grad (non-reentrant) or under ``no_grad``
(reentrant). So each micro-batch counts once with and without checkpointing, and an eval-mode forward (validation,
``generate()`` after ``model.eval()``) counts nothing. A train-mode forward outside any backward counts even under
``no_grad`` (the reentrant checkpoint's first forward is one): switch to ``eval()`` for forwards that must not
count. Other projects: torchtitan counts in the MoE forward, halves the counts when full recompute is on and skips
eval forwards; counting at backward time instead would miss a gate whose output gets no gradient.

The counts of every gate go over the group in one transaction ([Note: the transaction], ``_core/transaction.py``):
one int64 ``"sum"`` all-reduce for all gates (``training/rules.py``: ``apply``), with the structure agreed first and
a vote before anything is written; the first update also broadcasts every bias from ``src``, so the ranks start
equal. The update itself is arithmetic every rank does on the same summed integers, in float64, into an fp32 value:
the biases stay bitwise equal. A bias buffer held in 16 bits (DeepSpeed bf16 without ``keep_precision``) is
written from an fp32 copy the handle keeps, so small steps are not lost to rounding.

With ``keep_in_sync`` on the same DeepSpeed engine, over the same ranks, from the same ``src``, with every bias under
its ``"broadcast"`` rule, the counts ride in keep_in_sync's sync instead ([Note: riders], ``training/keep_in_sync.py``):
one int64 ``"sum"`` entry per gate, so a step costs keep_in_sync's collectives (plus that one int64 bucket, shared
with any int64 ``"sum"`` buffer) and no transaction of the router's own. Every gate then keeps three int64 vectors:
``counts`` (cumulative: after a sync the global total, then plus what this rank counted since), ``synced`` (its value
after the last sync) and ``seen`` (the global total the last update used). An update due at a tick that synced takes
``load = synced - seen``, the very integers a transaction of its own would have summed; one due at a tick that did
not (the two ``every`` differ) sums ``counts - synced`` in its own transaction and adds ``synced - seen``. Either way
the load is exact, the same on every rank, and the arithmetic after it unchanged: the biases are bit-for-bit those
of the handle alone. Removing either handle leaves the other working (the router goes back to its own transaction,
with ``synced - seen`` still owed).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .._compat import deepspeed as ds_compat, torch as torch_compat
from .._core import args as _args, group as _group, modules as _modules, notice as _notice, wire as _wire
from ..errors import InvalidArgumentError
from ..training import keep_in_sync as kis_mod, rules as rules_mod
from . import gates as _gates

_FN = "router_bias"
_MARK = "_zero_buffers_router_bias"  # on the module while a handle counts its gates
Rule = Literal["sign", "proportional"]
RULES: tuple[str, ...] = ("sign", "proportional")


@dataclass
class _Gate:
    """One gate: its qualified name, module, adapter, this rank's counts since the last update, and the fp32 value
    of its bias when the buffer itself is held in a narrower dtype."""

    name: str
    module: nn.Module
    adapter: _gates.Adapter
    counts: torch.Tensor  # int64, one per expert: this rank's since the last update (riding: cumulative, module doc)
    synced: torch.Tensor  # int64: ``counts`` after the last sync it rode in (zeros when not riding)
    seen: torch.Tensor  # int64: the global total the last update used (relative to ``synced``'s origin)
    master: torch.Tensor | None = None

    @property
    def counts_name(self) -> str:
        """The name its counts travel under: no buffer's (a buffer name has no brackets)."""
        return f"{self.name}[tokens_per_expert]"

    @property
    def bias(self) -> torch.Tensor:
        return self.adapter.bias_of(self.module, self.name)

    @property
    def qualified_bias(self) -> str:
        return f"{self.name}.{self.adapter.bias}" if self.name else self.adapter.bias


def delta(load: torch.Tensor, gamma: float, rule: str) -> torch.Tensor:
    """The bias update for one gate's global ``load`` (tokens per expert), in float64."""
    load = load.to(torch.float64)
    mean = load.mean()
    if rule == "sign":
        return gamma * torch.sign(mean - load)
    return gamma * (mean - load) / mean if float(mean) > 0 else torch.zeros_like(load)


class RouterBias:
    """Handle returned by :func:`router_bias`: ``step()`` marks an optimizer step (the hooks call it), ``update()``
    sums the counts and updates the biases now (every rank), ``remove()`` stops counting (also a context manager).
    ``counts()`` gives this rank's counts since the last update by gate name, ``last_load`` the global counts the
    last update used, ``updates`` how many updates ran."""

    def __init__(self, module: nn.Module, found: list[_Gate], g: _group.Group | None, *, gamma: float, rule: str,
                 every: int, src: int, seconds: float | None):
        self.module, self.gates, self.g = module, found, g
        self.gamma, self.rule, self.every, self.src, self.seconds = gamma, rule, every, src, seconds
        self.updates = 0
        self.last_load: dict[str, torch.Tensor] = {}
        self._steps = 0
        self.engine: Any = None  # the DeepSpeed engine whose steps tick it, if any
        self.riding: kis_mod.KeepInSync | None = None  # the keep_in_sync handle its counts ride in ([Note: riders])
        self._undo: list[Callable[[], None]] = [self._unmark]  # run last to first by remove()
        for gate in found:
            handle = gate.module.register_forward_hook(functools.partial(_count, gate, self))
            self._undo.append(handle.remove)
        module.__dict__[_MARK] = self

    # -- [Note: riders]: the counts in keep_in_sync's sync ------------------------------------------------------------
    def join(self, kis: kis_mod.KeepInSync) -> None:
        """Ride in ``kis``'s sync when it is ticked by the same engine's steps, over the same ranks, from the same
        source, with every bias broadcast; else keep the own transaction."""
        rules = {id(a.tensor): a.rule for a in kis.plan.assigned}
        if self.riding is not None or self.engine is None or not kis.engine or kis.target is not self.engine or \
                self.g is None or kis.g is None or kis.g.mesh is not None or kis.g.ranks != self.g.ranks or \
                kis.src != self.src or any(rules.get(id(gate.bias)) != "broadcast" for gate in self.gates):
            return
        with torch.no_grad():  # from here the counts are counted from zero in kis's "sum": only this rank's part
            for gate in self.gates:
                gate.counts.sub_(gate.synced)
                gate.seen.sub_(gate.synced)
                gate.synced.zero_()
        self.riding = kis
        kis.attach(self)

    def entries(self) -> list[rules_mod.Assigned]:
        return [rules_mod.Assigned(gate.counts_name, gate.counts, "sum", _FN) for gate in self.gates]

    def synced(self) -> None:
        with torch.no_grad():
            for gate in self.gates:
                gate.synced.copy_(gate.counts)

    def ticked(self, synced: bool) -> None:
        if not self._due():
            return
        if not synced:  # keep_in_sync did not sync at this step: the own transaction
            self.update()
        else:  # the global totals are here: no collective
            loads = {gate.name: gate.synced - gate.seen for gate in self.gates}
            with torch.no_grad():
                for gate in self.gates:
                    gate.seen.copy_(gate.synced)
            self._apply(loads)

    def dropped(self) -> None:
        self.riding = None

    def _engine_step(self) -> None:
        """After an engine's optimizer step: ``step()``, unless keep_in_sync ticks this handle."""
        if self.riding is None:
            self.step()

    def counts(self) -> dict[str, torch.Tensor]:
        """This rank's tokens per expert since the last update (riding in keep_in_sync: since its last sync), by gate
        name (copies)."""
        return {gate.name: gate.counts - gate.synced for gate in self.gates}

    def step(self) -> None:
        """One optimizer step happened: update after every ``every``-th (every rank must call it alike)."""
        if self._due():
            self.update()

    def _due(self) -> bool:
        """Count one optimizer step; whether an update is due at it (every ``every``-th)."""
        self._steps += 1
        return self._steps % self.every == 0

    def update(self) -> None:
        """Sum every gate's counts over the group (one transaction) and update each bias; every rank must call it.
        On failure every rank raises and nothing changed: the counts carry over to the next update."""
        local = {gate.name: gate.counts - gate.synced for gate in self.gates}  # this rank's, not yet summed
        if self.g is not None:
            deadline = _wire.Deadline(self.seconds)
            assigned = [rules_mod.Assigned(f"{gate.name}.tokens_per_expert", local[gate.name], "sum", _FN)
                        for gate in self.gates]
            if self.updates == 0:  # the ranks start from src's biases: from then on equal by construction
                assigned += [rules_mod.Assigned(gate.qualified_bias, gate.bias, "broadcast", _FN)
                             for gate in self.gates]
            plan = rules_mod.Plan(assigned)
            rules_mod.apply(self.g, plan, self.src, deadline, _FN, call=(self.gamma, self.rule))
        load = {}
        with torch.no_grad():
            for gate in self.gates:
                load[gate.name] = gate.synced - gate.seen + local[gate.name]
                if self.riding is not None:  # kis's bases hold on to counts and synced: only seen moves
                    gate.seen.add_(load[gate.name])
                else:
                    for t in (gate.counts, gate.synced, gate.seen):
                        t.zero_()
        self._apply(load)

    def _apply(self, loads: dict[str, torch.Tensor]) -> None:
        """Update every bias from its gate's global ``loads`` (the same integers on every rank); no collective."""
        self.last_load = {}
        with torch.no_grad():
            for gate in self.gates:
                load = loads[gate.name].clone()
                self.last_load[gate.name] = load
                if int(load.sum()) == 0:
                    continue  # no train-mode forward since the last update (the same on every rank)
                bias = gate.bias
                if bias.dtype in (torch.float32, torch.float64):
                    gate.master = None
                    value = bias
                else:
                    if gate.master is None or self.updates == 0:
                        gate.master = bias.detach().to(torch.float32)
                    value = gate.master
                new = value.reshape(-1).to(torch.float64) + delta(load, self.gamma, self.rule).to(value.device)
                value.copy_(new.view(value.shape))
                if value is not bias:
                    bias.copy_(value)
        self.updates += 1

    def _unmark(self) -> None:
        if self.module.__dict__.get(_MARK) is self:
            del self.module.__dict__[_MARK]

    def remove(self) -> None:
        """Stop counting and updating (idempotent)."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> RouterBias:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _count(gate: _Gate, handle: RouterBias, module: nn.Module, inputs: tuple, output: Any) -> None:
    """The forward hook: add the top-k indices of a train-mode forward that is no recompute ([Note: counted once])."""
    if not module.training or torch_compat.in_backward():
        return
    indices = gate.adapter.indices(module, inputs, output)
    with torch.no_grad():
        flat = indices.detach().reshape(-1).to(torch.int64)
        if gate.counts.device != flat.device:
            if handle.riding is not None:  # keep_in_sync's plan holds these very tensors: bring the indices over
                flat = flat.to(gate.counts.device)
            else:
                gate.counts, gate.synced, gate.seen = (t.to(flat.device) for t in (gate.counts, gate.synced, gate.seen))
        try:  # scatter_add_: no host sync (bincount's output size would need one on a GPU)
            gate.counts.scatter_add_(0, flat, torch.ones_like(flat))
        except (RuntimeError, IndexError) as e:
            raise InvalidArgumentError(f"{_FN}(): gate '{gate.name}' ({type(module).__name__}) routed to an expert "
                                       f"outside its {gate.counts.numel()} bias entries ({gate.adapter.label}): "
                                       f"{e}") from e


def _leave(handle: RouterBias, riders: list) -> None:
    """Undo of the riding: off the module's list, out of keep_in_sync's plan ([Note: riders])."""
    if handle in riders:
        riders.remove(handle)
    if not riders and handle.module.__dict__.get(kis_mod.RIDERS) is riders:
        del handle.module.__dict__[kis_mod.RIDERS]
    if handle.riding is not None:
        handle.riding.detach(handle)
        handle.riding = None


def check(fn: str, gamma: Any, rule: Any, every: Any, src: Any, timeout: Any) -> tuple[float, int, int, float | None]:
    """The update's options checked (InvalidArgumentError naming ``fn``): (gamma, every, src, timeout seconds)."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma < float("inf"):
        raise InvalidArgumentError(f"{fn}(): gamma must be a finite number > 0, got {gamma!r}")
    if rule not in RULES:
        raise InvalidArgumentError(f"{fn}(): rule must be one of {', '.join(map(repr, RULES))}, got {rule!r}")
    return float(gamma), _args.every(every, fn), _args.rank(src, "src", fn), _args.timeout(timeout, fn)


def router_bias(model_or_engine: Any, *, gamma: float = 1e-3, rule: Rule = "sign", every: int = 1,
                optimizer: Any = None, src: int = 0, group: Any = None, timeout: _args.Timeout = None) -> RouterBias:
    """Update every MoE router bias of ``model_or_engine`` from the expert load of the global batch; returns a
    :class:`RouterBias` (module docstring for the update and [Note: counted once] for what counts).

    The gates are the modules holding an ``e_score_correction_bias`` buffer (transformers' aux-loss-free families)
    and instances of classes described with :func:`register_gate`. When the update runs: after every ``every``-th
    ``engine.step()`` at a gradient-accumulation boundary for a DeepSpeed engine; after every ``every``-th
    ``optimizer.step()`` given ``optimizer`` (a torch optimizer: a step post-hook; FSDP2 and plain loops); otherwise
    when you call ``handle.step()`` (or ``handle.update()``) after each optimizer step, as the trainer callbacks
    (``zero_buffers.integrations``) do. ``group``: the data-parallel group (default: the whole world); ``src``: whose
    biases every rank starts from. Installing issues no collective.

    Example::

        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        with zero_buffers.router_bias(engine, gamma=1e-3):
            for batch in loader:
                engine.backward(engine(**batch).loss); engine.step()   # biases updated, equal on every rank
    """
    gamma, every, src, seconds = check(_FN, gamma, rule, every, src, timeout)
    engine = ds_compat.is_engine(model_or_engine)
    if engine:
        if optimizer is not None:
            raise InvalidArgumentError(f"{_FN}(): a DeepSpeed engine updates after engine.step(); pass no optimizer")
        module = ds_compat.engine_module(model_or_engine)
    else:
        module = _modules.unwrap(_args.module(model_or_engine, _FN), _FN)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(f"{_FN}(): optimizer must be a torch.optim.Optimizer, got "
                                   f"{type(optimizer).__name__}")
    if module.__dict__.get(_MARK) is not None:
        raise InvalidArgumentError(f"{_FN}(): this model's gates are already counted by another handle; remove() it "
                                   "first (two handles would each update the biases)")
    g = _group.resolve(group, _FN)
    _group.check_src(g, src, _FN)
    found = []
    for name, gate, adapter in _gates.find(module):
        bias = adapter.bias_of(gate, name)
        if not bias.is_floating_point():
            raise InvalidArgumentError(f"{_FN}(): gate '{name}': bias {adapter.bias!r} is "
                                       f"{str(bias.dtype).removeprefix('torch.')}, not floating point")
        if bias.is_meta or torch_compat.is_dtensor(bias):
            raise InvalidArgumentError(f"{_FN}(): gate '{name}': bias {adapter.bias!r} is a "
                                       f"{'meta tensor' if bias.is_meta else 'DTensor'}; materialise it as a plain "
                                       "tensor first")
        zeros = functools.partial(torch.zeros, bias.numel(), dtype=torch.int64, device=bias.device)
        found.append(_Gate(name, gate, adapter, zeros(), zeros(), zeros()))
    if not found:
        raise InvalidArgumentError(f"{_FN}(): no MoE gate found in {type(module).__name__}: no module holds an "
                                   f"{_gates.BIAS!r} buffer and no class of the model was described with "
                                   "zero_buffers.register_gate")
    narrow = [gate.qualified_bias for gate in found if gate.bias.dtype not in (torch.float32, torch.float64)]
    if narrow:
        _notice.warn(f"{_FN}(): {len(narrow)} router bias buffer(s) are held in 16 bits ({narrow[0]}, ...): the handle "
                     "updates an fp32 copy and rounds it into them; zero_buffers.keep_precision(model) keeps them "
                     "fp32", once=f"{_FN}:narrow", group=g.pg if g is not None else None)
    handle = RouterBias(module, found, g, gamma=gamma, rule=rule, every=every, src=src, seconds=seconds)
    riders = module.__dict__.setdefault(kis_mod.RIDERS, [])
    riders.append(handle)
    handle._undo.append(functools.partial(_leave, handle, riders))
    if engine:
        handle.engine = model_or_engine
        handle._undo.append(ds_compat.after_optimizer_steps(model_or_engine, handle._engine_step))
        kept = module.__dict__.get(kis_mod._MARK)
        if isinstance(kept, kis_mod.KeepInSync):  # [Note: riders]
            handle.join(kept)
    elif optimizer is not None:
        hook = optimizer.register_step_post_hook(lambda opt, args, kwargs: handle.step())
        handle._undo.append(hook.remove)
    return handle
