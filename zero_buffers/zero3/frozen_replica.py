"""frozen_replica: turn a (possibly ZeRO-partitioned) frozen module into a plain, identical replica on every rank.

Design (decided from what real code calls): the weights become persistent buffers of the same names, so a
parent's ``parameters()`` (what DeepSpeed, FSDP, DDP and optimizers walk) never sees them: nothing partitions,
casts or all-gathers them. Every module of the replica gets a subclass with its class's own name, module and
metaclass, whose ``parameters()`` (``recurse=True``, the default) still yields the weights to everyone but
DeepSpeed, so ``.dtype``, ``.device``, ``next(model.parameters())``, ``num_parameters()``, ``save_pretrained``
(which writes the original class name) and the model's own methods keep working; pickling rebuilds it from the
original class.
"""
from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._compat import deepspeed as ds_compat, torch as torch_compat
from .._core import (
    args as _args,
    group as _group,
    modules as _modules,
    structure as _structure,
    transaction as _transaction,
    wire as _wire,
)
from .._core.rollback import Snapshot
from ..errors import InvalidArgumentError
from .gathered import GatheredParametersAndBuffers, _zero_specs

_FN = "frozen_replica"
_TYPES: dict[tuple[type, bool, bool], type] = {}
_WEIGHTS = "_zb_weights"  # per module: names of the buffers that were parameters
# classes whose methods are library plumbing, not the model's own API: the method scan stops there
_LIBRARY_BASES = ("torch.", "transformers.modeling_utils", "transformers.integrations", "transformers.generation",
                  "huggingface_hub", "diffusers.models.modeling_utils", "diffusers.configuration_utils", "accelerate.")


def is_frozen_replica(module: nn.Module) -> bool:
    """Whether ``module`` was made a replica by :func:`frozen_replica` (its class keeps the original's name)."""
    return bool(getattr(type(module), "_zb_frozen", False))


def _rebuild(cls: type, root: bool, no_grad: bool) -> nn.Module:
    """Unpickling and deepcopy: an empty instance of the frozen type (pickle then restores its state)."""
    return object.__new__(_frozen_type(cls, root, no_grad))


# [Note: pickled replicas]
# A pickled replica (pickle, torch.save of the module, copy.deepcopy) names _rebuild by its module's path, and files
# written by zero_buffers 0.4 and 0.5 name zero_buffers.frozen_replica._rebuild, this module's path before the
# package was laid out in wings. This module answers to that name too, so those files still load; new pickles name
# zero_buffers.zero3.frozen_replica._rebuild. Only the entry in sys.modules: the attribute zero_buffers.frozen_replica
# stays the function (a module found in sys.modules is not bound on its parent package again).
sys.modules.setdefault("zero_buffers.frozen_replica", sys.modules[__name__])


def _weights(m: nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
    """A frozen module's own weights (buffers that were parameters), as ``_named_members`` wants them."""
    yield from m._parameters.items()
    for name in m.__dict__.get(_WEIGHTS, ()):
        t = m._buffers.get(name)
        if t is not None:
            yield name, t


def _without_grad(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under ``torch.no_grad()`` (generators keep it across resumptions)."""
    if inspect.isgeneratorfunction(fn):
        return torch.no_grad()(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return fn(*args, **kwargs)
    return wrapper


_CASTS = ("half", "bfloat16", "float", "double", "to", "type")
_casting = [0]  # > 0 while a cast was asked of a replica itself (then its children follow it)


def _cast_directly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (``half``, ``to`` ...) called on the replica: its ``_apply`` casts as asked."""
    @functools.wraps(method)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        _casting[0] += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _casting[0] -= 1
    return wrapper


def _device_only(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` as a parent's ``_apply`` gives it, minus any change of dtype (learned from an empty probe)."""
    def apply(t: torch.Tensor) -> torch.Tensor:
        probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
        return fn(t) if probe.dtype == t.dtype else t.to(probe.device)
    return apply


def _public_methods(cls: type) -> set[str]:
    """forward, generate, and the public functions the model's own classes define (up to library base classes)."""
    names = {"forward"} | ({"generate"} if hasattr(cls, "generate") else set())
    for klass in cls.__mro__:
        if klass is object or klass.__module__.startswith(_LIBRARY_BASES):
            break
        names |= {n for n, v in vars(klass).items() if inspect.isfunction(v) and not n.startswith("_")}
    return {n for n in names if n == "forward" or not hasattr(nn.Module, n)} & set(dir(cls))


def _frozen_type(cls: type[nn.Module], root: bool, no_grad: bool) -> type:
    """The subclass of ``cls`` a replica's module gets (cached); ``root`` adds the no_grad methods."""
    cls = vars(cls).get("_zb_original", cls)
    key = (cls, root, no_grad)
    if key in _TYPES:
        return _TYPES[key]

    def named_parameters(self: nn.Module, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        # recurse=False is the per-module walk of engines (DeepSpeed's hooks, FSDP2, DDP): they see no weights;
        # DeepSpeed sees none at all, and may not take a replica as the model of an engine
        caller = ds_compat.deepspeed_caller() if recurse else None
        if caller is not None and ds_compat.engine_model_is(caller, self):
            raise InvalidArgumentError(
                f"{cls.__name__} is a frozen replica (zero_buffers.frozen_replica): it has no trainable parameters, so "
                "do not pass it to deepspeed.initialize / accelerator.prepare. It is already a full copy on every "
                "rank: move it with .to(device) and call it directly, or keep it as a submodule of the model you train")
        hidden = caller is not None or not recurse
        members = (lambda m: m._parameters.items()) if hidden else _weights
        yield from self._named_members(members, prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def train(self: nn.Module, mode: bool = True) -> nn.Module:
        return cls.train(self, False)  # frozen: BatchNorm statistics never move

    def requires_grad_(self: nn.Module, requires_grad: bool = True) -> nn.Module:
        if requires_grad:
            raise InvalidArgumentError(f"{cls.__name__} is a frozen replica: its weights are buffers and cannot "
                                       "require grad (train the original module instead)")
        return self

    def _apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # a parent's .half() / .bfloat16() / .to(dtype) (DeepSpeed 0.16's engine casts the whole model) moves the
        # replica's tensors but keeps their dtype; a cast asked of the replica itself is honoured
        return cls._apply(self, fn if _casting[0] else _device_only(fn), recurse)

    def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
        return _rebuild, (cls, root, no_grad), self.__getstate__()  # [Note: pickled replicas]

    def __new__(klass: type, *args: Any, **kwargs: Any) -> Any:
        # type(replica)(config) / type(replica).from_pretrained(...): a fresh ORIGINAL model, not a hybrid with
        # real parameters that refuses requires_grad_ (pickling and deepcopy go through _rebuild instead)
        return cls(*args, **kwargs)

    ns: dict[str, Any] = {"named_parameters": named_parameters, "train": train, "requires_grad_": requires_grad_,
                          "_apply": _apply, **{n: _cast_directly(getattr(cls, n)) for n in _CASTS},
                          "__reduce_ex__": __reduce_ex__, "__new__": __new__, "_zb_frozen": True, "_zb_original": cls,
                          "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    if root:
        if no_grad:
            ns.update({n: _without_grad(getattr(cls, n)) for n in _public_methods(cls)})
        if hasattr(cls, "can_generate"):  # transformers inspects __bases__ by name: answer for the original
            ns["can_generate"] = classmethod(lambda _c: cls.can_generate())
        # accelerator.get_state_dict(replica) under ZeRO-3 calls what it expects of a DeepSpeed engine
        gather_16bit, consolidated = ds_compat.ENGINE_STATE_DICT_METHODS
        ns[gather_16bit] = lambda self: True
        ns[consolidated] = lambda self, exclude_frozen_parameters=False: self.state_dict()
    metaclass: Any = type(cls)  # the original metaclass
    _TYPES[key] = metaclass(cls.__name__, (cls,), ns)
    return _TYPES[key]


def _convert(module: nn.Module, no_grad: bool, sharded: dict[int, torch.Tensor]) -> None:
    """Every parameter becomes a persistent buffer of the same name (weights first, so ``state_dict`` keeps its
    order; tied weights stay one tensor; ZeRO ones gathered once, FSDP2 ones taken from ``sharded``, their full
    copies; plain ones keep their storage), every module gets its frozen type."""
    owners = [(m, name, p) for m in module.modules() for name, p in m._parameters.items() if p is not None]
    unique = list({id(p): p for _, _, p in owners}.values())
    zero = [p for p in unique if ds_compat.is_zero_param(p)]
    full: dict[int, torch.Tensor] = {id(p): sharded.get(id(p), p.detach()) for p in unique
                                     if not ds_compat.is_zero_param(p)}
    if zero:
        with GatheredParametersAndBuffers(zero):
            full.update({id(p): p.detach().clone() for p in zero})
    for m in module.modules():
        converted = {name: full[id(p)] for name, p in m._parameters.items() if p is not None}
        rest = dict(m._buffers)
        m._buffers.clear()
        m._buffers.update({**converted, **rest})
        for name in converted:
            del m._parameters[name]
            m._non_persistent_buffers_set.discard(name)
        m.__dict__[_WEIGHTS] = tuple(m.__dict__.get(_WEIGHTS, ())) + tuple(converted)
    for m in module.modules():
        if m is not module and is_frozen_replica(m):
            continue  # an inner replica keeps its type: its root's no_grad methods (and no_grad choice)
        m.__class__ = _frozen_type(type(m), m is module, no_grad)


def _fsdp2_modules(module: nn.Module) -> list[nn.Module]:
    """The ``fully_shard``ed modules of ``module``; InvalidArgumentError (at the call, on every rank alike) for FSDP1
    and for sharded parameters that an enclosing ``fully_shard`` or tensor parallelism owns."""
    one, _ = _modules.fsdp_kinds(module, _FN)
    if one or torch_compat.is_fsdp1(module):
        raise InvalidArgumentError(
            f"{_FN}(): FSDP1 (FullyShardedDataParallel) modules are not supported; build the frozen module outside "
            "FSDP (or fully_shard it: FSDP2 modules are gathered once and detached)")
    mods = torch_compat.fsdp2_modules(module)
    managed = torch_compat.fsdp2_managed(module) if mods else set()
    foreign = torch_compat.fsdp2_foreign(module)
    foreign += [n for n, p in module.named_parameters() if torch_compat.is_dtensor(p) and id(p) not in managed
                and n not in foreign]
    if foreign:
        raise InvalidArgumentError(
            f"{_FN}(): parameter '{foreign[0]}' (and {len(foreign) - 1} more) is sharded by a fully_shard or "
            "tensor-parallel plan outside this module; call frozen_replica before sharding the enclosing model "
            "(its frozen weights become buffers that fully_shard leaves alone), or fully_shard the frozen module "
            "on its own")
    return mods


def frozen_replica(module: nn.Module, *, src: int = 0, group: Any = None, timeout: _args.Timeout = None,
                   no_grad: bool = True) -> nn.Module:
    """Turn ``module`` (in place) into a frozen, plain replica that is identical on every rank; return it.

    * ZeRO-3 partitioned parameters are gathered once; every parameter becomes a persistent buffer of
      the same name, so ``state_dict`` keys and order are unchanged and a parent's ``parameters()``
      (``deepspeed.initialize``, FSDP, DDP, optimizers) never sees them: nothing partitions, casts or
      all-gathers them, and its forward issues no collective. Plain weights keep their storage.
    * All weights and buffers take rank ``src``'s values (a rank within ``group``; one structure-checked,
      all-or-nothing broadcast). A failed call leaves the module as it was.
    * The model keeps its API: ``parameters()`` (``recurse=True``) still yields the weights (not to
      DeepSpeed), so ``.dtype``, ``.device``, ``next(model.parameters())`` and ``num_parameters()``
      work; every module keeps its class name, so ``save_pretrained`` writes a checkpoint the original
      class loads with ``from_pretrained``; ``pickle``, ``torch.save`` and ``copy.deepcopy`` round-trip
      (unpickling needs zero_buffers importable). :func:`is_frozen_replica` tells a replica apart.
    * Frozen: ``forward``, ``generate`` and the public methods the model's own classes define
      (``encode``, ``decode``, ``get_image_features`` ...) run under ``no_grad`` (``no_grad=False``
      keeps gradients flowing to the inputs, for perceptual losses; the weights never get any), every
      module stays in eval mode even when a parent calls ``.train()``, ``requires_grad_(True)`` raises.

    Passing the replica itself to ``deepspeed.initialize`` / ``accelerator.prepare`` raises
    :class:`InvalidArgumentError` (it has nothing to train); ``accelerator.get_state_dict(replica)``
    returns its state dict. Under DDP keep it outside the wrapped module, or DDP broadcasts its weights,
    now buffers, before every forward (or list them with
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``). DeepSpeed's
    ``data_types.buffer_dtype`` and ``keep_in_fp32_modules`` do apply to the weights (they are buffers).
    Calling it again on a replica only re-broadcasts from ``src``.

    Example::

        with deepspeed.zero.Init(config_dict_or_path=cfg):
            tokenizer = VideoTokenizer()               # partitioned: all-gather on every forward
        tokenizer.load_state_dict(sd)                   # on rank 0 only, say
        tokenizer = zero_buffers.frozen_replica(tokenizer)   # full, identical, no_grad, no all-gather
    """
    _args.module(module, _FN)
    src = _args.rank(src, "src", _FN)
    deadline = _wire.Deadline(_args.timeout(timeout, _FN))
    g = _group.resolve(group, _FN)
    _group.check_src(g, src, _FN)
    frozen = is_frozen_replica(module)
    fsdp2 = _fsdp2_modules(module)
    if fsdp2:  # a rank outside the group must not gather either: its peers in the FSDP mesh would not
        _modules.check_fsdp_group(module, g.ranks if g is not None else (_group.global_rank(),), _FN)
    if g is not None:  # every rank gathers the same ZeRO / FSDP2 parameters, or none does
        zero = [p for p in module.parameters() if ds_compat.is_zero_param(p)]
        _structure.agree(g, (_FN, "enter", frozen, len(fsdp2)), _zero_specs(zero), deadline, _FN)
    saved = Snapshot.take(list(module.modules()), values=False)
    weights = [(m, m.__dict__.get(_WEIGHTS)) for m in module.modules()]
    undo_fsdp2: Callable[[], None] | None = None
    try:
        failure: BaseException | None = None
        try:  # converting is this rank's own step: a failure is its vote below
            _transaction.reached(_transaction.Phase.PREPARE, _FN)
            if not frozen:
                full = torch_compat.fsdp2_full_tensors(module) if fsdp2 else {}
                if fsdp2:
                    undo_fsdp2 = torch_compat.fsdp2_detach(module)
                _convert(module, no_grad, full)
        except BaseException as e:
            if g is None:
                raise
            failure = e
        if g is not None:  # one small all_gather: a rank that could not convert stops every rank before the sync
            _transaction.vote(g, failure, deadline, _FN, "converting the module failed",
                              "every module is as it was")
            _transaction.broadcast(g, _modules.named_buffers(module), src, (_FN,), deadline, _FN)
    except BaseException:
        if undo_fsdp2 is not None:
            undo_fsdp2()  # FSDP2's hooks, classes and state back
        saved.restore()  # registrations and classes as they were: the module as before
        for m, names in weights:
            if names is None:
                m.__dict__.pop(_WEIGHTS, None)
            else:
                m.__dict__[_WEIGHTS] = names
        raise
    vars(type(module))["_zb_original"].train(module, False)
    return module
