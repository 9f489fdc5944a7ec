"""Which modules are MoE gates with a router bias, and how to read each one: its top-k expert indices, its bias.

A gate is described by an :class:`Adapter`. transformers' aux-loss-free families need none: a module that holds a
buffer named ``e_score_correction_bias`` gets :data:`DEFAULT` (the bias is that buffer; the top-k indices are the one
integer tensor its forward returns, as every ``*TopkRouter`` of transformers 4.57 and 5.x returns). A family whose
bias sits on another module than the one that picks the experts (Ernie 4.5's ``MoeStatics``, MiniMax-M2's sparse
block) is described with :func:`register_gate`; until then its first train-mode forward raises, naming the module and
this function.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import InvalidArgumentError

BIAS = "e_score_correction_bias"
"""The buffer name transformers' aux-loss-free MoE gates hold their router bias in."""

Indices = Callable[[nn.Module, tuple, Any], torch.Tensor]
"""``indices(gate, inputs, output)``: the top-k expert indices one forward chose (any shape, one entry per token and
choice)."""


@dataclass(frozen=True)
class Adapter:
    """How to read one gate class: ``bias`` (the name of the buffer on the gate that holds the router bias) and
    ``indices`` (the top-k expert indices, from the gate's forward inputs and output)."""

    bias: str
    indices: Indices
    label: str

    def bias_of(self, gate: nn.Module, name: str) -> torch.Tensor:
        """The gate's bias buffer (read again at every use: ``module.to()`` replaces buffers)."""
        t = gate._buffers.get(self.bias)
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"router_bias(): gate '{name}' ({type(gate).__name__}, {self.label}) has no "
                                       f"buffer {self.bias!r}")
        return t


def integer_output(gate: nn.Module, inputs: tuple, output: Any) -> torch.Tensor:
    """The default ``indices``: the one integer tensor among the forward's outputs (a tensor or a tuple / list)."""
    outs = output if isinstance(output, (tuple, list)) else (output,)
    found = [o for o in outs if isinstance(o, torch.Tensor) and not (o.is_floating_point() or o.is_complex())
             and o.dtype != torch.bool]
    if len(found) != 1:
        raise InvalidArgumentError(
            f"router_bias(): {type(gate).__name__}'s forward returned {len(found)} integer tensors, so the default "
            "adapter cannot tell which are the top-k expert indices; describe the class with "
            "zero_buffers.register_gate(cls, indices=lambda gate, inputs, output: ...)")
    return found[0]


DEFAULT = Adapter(BIAS, integer_output, f"the default adapter: buffer {BIAS!r}, the integer output")
_REGISTRY: dict[type | str, Adapter] = {}


def register_gate(cls: type | str, *, indices: Indices = integer_output, bias: str = BIAS) -> None:
    """Describe a router class for :func:`zero_buffers.router_bias`: ``bias`` names the buffer (on the instances of
    ``cls``) that holds the router bias, one value per expert; ``indices(gate, inputs, output)`` returns the top-k
    expert indices its forward chose. ``cls`` is a module class or its ``"module.QualName"``. Registering a class
    again replaces its entry.

    Example::

        zero_buffers.register_gate(MyRouter, indices=lambda gate, inputs, output: output.topk_ids,
                                   bias="expert_bias")
    """
    fn = "register_gate"
    if not isinstance(cls, (type, str)):
        raise InvalidArgumentError(f"{fn}(): cls must be a module class or its 'module.QualName', got {cls!r}")
    if not callable(indices):
        raise InvalidArgumentError(f"{fn}(): indices must be a callable (gate, inputs, output) -> Tensor, got "
                                   f"{indices!r}")
    if not isinstance(bias, str) or not bias:
        raise InvalidArgumentError(f"{fn}(): bias must be a buffer name, got {bias!r}")
    label = cls.__name__ if isinstance(cls, type) else cls
    _REGISTRY[cls] = Adapter(bias, indices, f"registered {label}")


def adapter_of(module: nn.Module) -> Adapter | None:
    """The registered adapter of ``module``'s most derived listed class, else :data:`DEFAULT` for a module that holds
    an ``e_score_correction_bias`` buffer, else None."""
    for klass in type(module).__mro__:
        for k in (klass, f"{klass.__module__}.{klass.__qualname__}"):
            if k in _REGISTRY:
                return _REGISTRY[k]
    return DEFAULT if isinstance(module._buffers.get(BIAS), torch.Tensor) else None


def find(module: nn.Module) -> Iterator[tuple[str, nn.Module, Adapter]]:
    """Every gate of ``module``'s tree, by qualified name, with its adapter."""
    for name, m in module.named_modules():
        adapter = adapter_of(m)
        if adapter is not None:
            yield name, m, adapter
