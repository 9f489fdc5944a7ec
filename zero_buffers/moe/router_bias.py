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
from ..training import rules as rules_mod
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
    counts: torch.Tensor  # int64, one per expert
    master: torch.Tensor | None = None

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
        self._undo: list[Callable[[], None]] = [self._unmark]  # run last to first by remove()
        for gate in found:
            handle = gate.module.register_forward_hook(functools.partial(_count, gate))
            self._undo.append(handle.remove)
        module.__dict__[_MARK] = self

    def counts(self) -> dict[str, torch.Tensor]:
        """This rank's tokens per expert since the last update, by gate name (copies)."""
        return {gate.name: gate.counts.clone() for gate in self.gates}

    def step(self) -> None:
        """One optimizer step happened: update after every ``every``-th (every rank must call it alike)."""
        self._steps += 1
        if self._steps % self.every == 0:
            self.update()

    def update(self) -> None:
        """Sum every gate's counts over the group (one transaction) and update each bias; every rank must call it.
        On failure every rank raises and nothing changed: the counts carry over to the next update."""
        if self.g is not None:
            deadline = _wire.Deadline(self.seconds)
            assigned = [rules_mod.Assigned(f"{gate.name}.tokens_per_expert", gate.counts, "sum", _FN)
                        for gate in self.gates]
            if self.updates == 0:  # the ranks start from src's biases: from then on equal by construction
                assigned += [rules_mod.Assigned(gate.qualified_bias, gate.bias, "broadcast", _FN)
                             for gate in self.gates]
            plan = rules_mod.Plan(assigned)
            rules_mod.apply(self.g, plan, self.src, deadline, _FN, call=(self.gamma, self.rule))
        self.last_load = {}
        with torch.no_grad():
            for gate in self.gates:
                load = gate.counts.clone()
                self.last_load[gate.name] = load
                gate.counts.zero_()
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


def _count(gate: _Gate, module: nn.Module, inputs: tuple, output: Any) -> None:
    """The forward hook: add the top-k indices of a train-mode forward that is no recompute ([Note: counted once])."""
    if not module.training or torch_compat.in_backward():
        return
    indices = gate.adapter.indices(module, inputs, output)
    with torch.no_grad():
        flat = indices.detach().reshape(-1).to(torch.int64)
        if gate.counts.device != flat.device:
            gate.counts = gate.counts.to(flat.device)
        try:  # scatter_add_: no host sync (bincount's output size would need one on a GPU)
            gate.counts.scatter_add_(0, flat, torch.ones_like(flat))
        except (RuntimeError, IndexError) as e:
            raise InvalidArgumentError(f"{_FN}(): gate '{gate.name}' ({type(module).__name__}) routed to an expert "
                                       f"outside its {gate.counts.numel()} bias entries ({gate.adapter.label}): "
                                       f"{e}") from e


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
        found.append(_Gate(name, gate, adapter, torch.zeros(bias.numel(), dtype=torch.int64, device=bias.device)))
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
    if engine:
        handle._undo.append(ds_compat.after_optimizer_steps(model_or_engine, handle.step))
    elif optimizer is not None:
        hook = optimizer.register_step_post_hook(lambda opt, args, kwargs: handle.step())
        handle._undo.append(hook.remove)
    return handle
