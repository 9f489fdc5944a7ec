"""Private DeepSpeed APIs zero_buffers relies on: ZeRO-3 parameter attributes, zero.Init's module hook and context
globals, GatheredParameters' internals, and the forward hooks a ZeRO-3 engine puts on every submodule.

Checked against DeepSpeed 0.16.0 and 0.19.8 (CI runs both); :func:`partition_parameters` raises
DependencyError when the installed version lacks one of them. What differs between them: GatheredParameters'
``_exit`` / ``_params_to_partition`` / ``_record_deferred_updates`` and its depth attribute (hence the refusal of
overlapping nested contexts) exist from 0.19.4 on.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import DeepSpeedUnavailableError
from . import missing, replace, version

DEPTH_ATTR = "_ds_z3_gathered_param_context_depth"  # set by GatheredParameters on the params it holds (0.19.4+)
_ORIGINAL: dict[str, Any] = {}  # GatheredParameters' own methods, kept before anyone patches the class


def is_zero_param(t: Any) -> bool:
    """A parameter partitioned by ZeRO-3 (DeepSpeed marks them with ``ds_id``); needs no DeepSpeed import."""
    return hasattr(t, "ds_id")


def ds_id(p: Any) -> int:
    """A ZeRO parameter's id: the same on every rank (DeepSpeed assigns them in construction order)."""
    return int(p.ds_id)


def loaded() -> Any:
    """``deepspeed.runtime.zero.partition_parameters`` if DeepSpeed was imported already, else None."""
    return sys.modules.get("deepspeed.runtime.zero.partition_parameters")


def partition_parameters() -> Any:
    """``deepspeed.runtime.zero.partition_parameters``, checked for everything this module uses."""
    try:
        from deepspeed.runtime.zero import partition_parameters as pp
    except ImportError as e:
        raise DeepSpeedUnavailableError(f"zero_buffers' ZeRO-3 tools need DeepSpeed: {e}", "deepspeed",
                                        version("deepspeed")) from e
    if not _ORIGINAL:
        needed = ("GatheredParameters", "Init", "InsertPostInitMethodToModuleSubClasses", "shutdown_init_context",
                  "restore_init_context", "zero_init_context", "top_level_context")
        absent = [n for n in needed if not hasattr(pp, n)]
        if absent or "_post_init_method" not in vars(pp.Init):
            raise missing("deepspeed", "partition_parameters." + (absent[0] if absent else "Init._post_init_method"))
        cls = pp.GatheredParameters
        _ORIGINAL.update(init=cls.__init__, enter=cls.__enter__, exit=cls.__exit__)
    return pp


def process_group(p: Any) -> Any:
    """The process group a ZeRO parameter is partitioned over (None: the world)."""
    return getattr(p, "ds_process_group", None)


def held(p: Any) -> bool:
    """Whether a GatheredParameters context holds ``p`` gathered right now (DeepSpeed 0.19.4+ records it; before,
    nesting is allowed by DeepSpeed and so by us)."""
    return getattr(p, DEPTH_ATTR, 0) > 0


class Gather:
    """DeepSpeed's own GatheredParameters over ZeRO parameters (sorted by ds_id, duplicates and non-ZeRO tensors
    dropped), driven with its original methods. :meth:`close` re-partitions in one of three ways: ``"own"``
    (DeepSpeed's exit as written), ``"updated"`` (each shard takes its slice of the gathered data, nothing is
    broadcast: zero_buffers moved the data already) or ``"discard"`` (shards keep their values from before)."""

    def __init__(self, params: Sequence[torch.Tensor], fwd_module: nn.Module | None = None, *,
                 modifier_rank: int | None = None, ctx: Any = None):
        pp = partition_parameters()
        if ctx is None:
            ctx = object.__new__(pp.GatheredParameters)
            zero = sorted({id(p): p for p in params if is_zero_param(p)}.values(), key=ds_id)
            _ORIGINAL["init"](ctx, zero, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=bool(zero))
        self._ctx = ctx
        enabled = getattr(ctx, "enabled", None)
        if not isinstance(enabled, bool):
            raise missing("deepspeed", "GatheredParameters.enabled (set by its __init__)")
        self.params: list[torch.Tensor] = list(getattr(ctx, "params", None) or []) if enabled else []
        if enabled and not self.params:
            raise missing("deepspeed", "GatheredParameters.params")
        if not all(callable(getattr(p, "partition", None)) for p in self.params[:1]):
            raise missing("deepspeed", "the partition() method of ZeRO-3 parameters")
        self._open = False

    def __enter__(self) -> Gather:
        if self.params:
            _ORIGINAL["enter"](self._ctx)
            self._open = True
        return self

    def close(self, how: str = "own") -> None:
        """Re-partition the parameters (once; later calls do nothing)."""
        if not self._open:
            return
        self._open = False
        ctx = self._ctx
        if how == "own":
            _ORIGINAL["exit"](ctx, None, None, None)
            return
        updated = how == "updated"
        if not hasattr(type(ctx), "_exit"):  # before 0.19.4, __exit__ does nothing else than partition
            ctx.params[0].partition(param_list=ctx.params, has_been_updated=updated)
            return

        def partition(*_exc: Any) -> None:  # replaces _exit for this call: __exit__'s bookkeeping still runs
            params = ctx._params_to_partition() if hasattr(ctx, "_params_to_partition") else ctx.params
            if updated and hasattr(ctx, "_record_deferred_updates"):
                ctx._record_deferred_updates(params)
            if params:
                params[0].partition(param_list=params, has_been_updated=updated)

        ctx._exit = partition
        try:
            _ORIGINAL["exit"](ctx, None, None, None)
        finally:
            del ctx._exit

    def __exit__(self, *exc: Any) -> None:
        self.close("own")


def _is_zero3_hook(fn: Any) -> bool:
    """A forward (pre-)hook DeepSpeed registered (ZeRO-3's parameter offload: it gathers and releases parameters;
    some are wrapped by ``deepspeed.utils.nvtx``, which keeps no ``__wrapped__``)."""
    return str(getattr(fn, "__module__", "")).startswith("deepspeed.")


@contextlib.contextmanager
def zero3_hooks_suspended(module: nn.Module) -> Iterator[None]:
    """Forwards of ``module`` without the ZeRO-3 engine's gather/release hooks (for parameters gathered
    beforehand: then a forward issues no collective). The hooks are put back in their order on exit."""
    saved = []
    for m in module.modules():
        for table in (m._forward_pre_hooks, m._forward_hooks):
            if any(_is_zero3_hook(fn) for fn in table.values()):
                saved.append((table, dict(table)))
                for key in [k for k, fn in table.items() if _is_zero3_hook(fn)]:
                    del table[key]
    try:
        yield
    finally:
        for table, items in saved:
            table.clear()
            table.update(items)


ENGINE_SAVE_METHODS = ("save_checkpoint", "save_16bit_model", "_zero3_consolidated_16bit_state_dict")
"""DeepSpeed engine methods that write a checkpoint, or build the state dict one is written from."""


def engine_save_methods(engine: Any) -> tuple[str, ...]:
    """:data:`ENGINE_SAVE_METHODS`, once ``engine`` is checked to have every one of them (DependencyError naming the
    first one this DeepSpeed's engine lacks)."""
    for name in ENGINE_SAVE_METHODS:
        if not callable(getattr(engine, name, None)):
            raise missing("deepspeed", f"{type(engine).__name__}.{name} (a method save hooks wrap)",
                          "use a DeepSpeed that has it, or call zero_buffers.sync_buffers(engine.module, policy) "
                          "on every rank before saving")
    return ENGINE_SAVE_METHODS


def engine_module(engine: Any) -> nn.Module:
    """The model a DeepSpeed engine wraps (``engine.module``)."""
    module = getattr(engine, "module", None)
    if not isinstance(module, nn.Module):
        raise missing("deepspeed", f"{type(engine).__name__}.module (the wrapped model)")
    return module


def after_optimizer_steps(engine: Any, callback: Callable[[], Any]) -> Callable[[], None]:
    """Wrap ``engine.step`` (whatever it is now, another wrapper included) so that ``callback()`` runs after every
    step at a gradient-accumulation boundary (an optimizer step); returns the undo, which puts the former ``step``
    back and raises InvalidArgumentError while a later wrapper still calls this one."""
    from ..errors import InvalidArgumentError

    original = engine.step
    had = "step" in vars(engine)

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        boundary = bool(engine.is_gradient_accumulation_boundary())
        out = original(*args, **kwargs)
        if boundary:
            callback()
        return out

    object.__setattr__(engine, "step", step)

    def undo() -> None:
        if vars(engine).get("step") is not step:
            raise InvalidArgumentError("engine.step was wrapped again after this hook (another zero_buffers handle?); "
                                       "remove that one first")
        if had:
            object.__setattr__(engine, "step", original)
        else:
            object.__delattr__(engine, "step")
    return undo


def is_engine(obj: Any) -> bool:
    """True for a DeepSpeed engine (checked by class name, so DeepSpeed need not be imported)."""
    return any(c.__name__ == "DeepSpeedEngine" for c in type(obj).__mro__)


def engine_is_zero3(engine: Any) -> bool:
    """Whether a DeepSpeed engine partitions parameters (ZeRO stage 3)."""
    method = getattr(engine, "zero_optimization_partition_weights", None)
    if method is None:
        raise missing("deepspeed", "DeepSpeedEngine.zero_optimization_partition_weights")
    return bool(method())


def suspend_init_context() -> Any:
    """Leave an active ``zero.Init`` (its class patches) as ``deepspeed.initialize`` does; returns the context to
    hand to :func:`resume_init_context`, or None when none was active. ``Init(enabled=False)`` does not escape."""
    pp = loaded()
    if pp is None:
        return None
    ctx = getattr(pp, "top_level_context", None)
    if ctx is None or not getattr(ctx, "patched", False):
        return None
    pp.shutdown_init_context()
    return ctx


def resume_init_context(ctx: Any) -> None:
    """Re-patch the context :func:`suspend_init_context` left (if it is still the active one)."""
    pp = loaded()
    if ctx is not None and pp is not None and getattr(pp, "top_level_context", None) is ctx:
        pp.restore_init_context()


def _is_partition_wrapper(f: Any) -> bool:
    code = getattr(f, "__code__", None)
    return (code is not None and code.co_filename.endswith("partition_parameters.py")
            and code.co_qualname.endswith("partition_after.<locals>.wrapper"))


def suspend_stale_init_patches() -> list[tuple[type, Any]]:
    """Take out the ``zero.Init`` ``__init__`` wrappers an exited context left behind; returns them for
    :func:`restore_stale_init_patches`. Call only while no ``zero.Init`` is active (after
    :func:`suspend_init_context`).

    DeepSpeed before 0.15 patches every ``nn.Module`` subclass, also one that inherits ``__init__`` (BatchNorm3d
    inherits ``_BatchNorm``'s): the subclass's saved "original" is then its parent's wrapper, and the exit puts that
    wrapper back on the subclass. From then on every such module built anywhere is partitioned by a context that is
    gone (measured on 0.14.4: after one ``from_pretrained`` under ZeRO-3, a BatchNorm3d built under
    ``no_zero_init`` came out with 0-element parameters and transformers 4.41's load raised a size mismatch)."""
    pp = loaded()
    if pp is None:
        return []
    stale: list[tuple[type, Any]] = []
    seen: set[type] = set()
    todo: list[type] = [nn.Module]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        f = cls.__dict__.get("__init__")
        if not _is_partition_wrapper(f):
            continue
        original: Any = f
        while _is_partition_wrapper(original):
            original = original.__wrapped__
        stale.append((cls, f))
        cls.__init__ = original  # type: ignore[misc]
    return stale


def restore_stale_init_patches(stale: list[tuple[type, Any]]) -> None:
    """Put back what :func:`suspend_stale_init_patches` took out (DeepSpeed's state as it was)."""
    for cls, f in stale:
        cls.__init__ = f  # type: ignore[misc]


_converted: list[Callable[[nn.Module], None]] = []
_undo_converted: list[Callable[[], None]] = []


def on_module_converted(callback: Callable[[nn.Module], None]) -> Callable[[], None]:
    """Call ``callback(module)`` after zero.Init has partitioned each module's own parameters (DeepSpeed's
    ``Init._post_init_method``); returns the undo. One patch however many callbacks."""
    pp = partition_parameters()
    if not _converted:
        def make(original: Any) -> Any:
            def _post_init_method(self: Any, module: nn.Module) -> None:
                original(self, module)
                for cb in list(_converted):
                    cb(module)
            return _post_init_method
        _undo_converted.append(replace(pp.Init, "_post_init_method", make))
    _converted.append(callback)

    def undo() -> None:
        _converted.remove(callback)
        if not _converted:
            _undo_converted.pop()()
    return undo


def init_depth() -> int:
    """How many zero.Init contexts are active (DeepSpeed's module global ``zero_init_context``, checked by
    :func:`partition_parameters`)."""
    return int(partition_parameters().zero_init_context)


def init_context_class() -> type:
    """The base class whose ``__enter__`` / ``__exit__`` every ``zero.Init`` runs."""
    return partition_parameters().InsertPostInitMethodToModuleSubClasses


def gathered_parameters_class() -> type:
    return partition_parameters().GatheredParameters


def original(name: str) -> Any:
    """GatheredParameters' own ``init`` / ``enter`` / ``exit``, as DeepSpeed defined them."""
    partition_parameters()
    return _ORIGINAL[name]


_PASS_THROUGH_FRAMES = ("torch.nn.modules.module", "zero_buffers.zero3.frozen_replica")


def deepspeed_caller(skip: int = 2) -> Any:
    """The frame of the first caller outside ``torch.nn.Module`` and zero_buffers' frozen replica, if it is
    DeepSpeed code (a heuristic on module names; pinned by a test that runs ``deepspeed.initialize``), else None."""
    f: Any = sys._getframe(skip)
    while f is not None and f.f_globals.get("__name__") in _PASS_THROUGH_FRAMES:
        f = f.f_back
    return f if f is not None and str(f.f_globals.get("__name__", "")).startswith("deepspeed.") else None


def engine_model_is(frame: Any, module: nn.Module) -> bool:
    """Whether DeepSpeed is looking at ``module`` as the model of an engine it builds (``DeepSpeedEngine.__init__``
    inspects ``model`` first, through ``deepspeed/utils/debug.py``)."""
    return frame.f_locals.get("model") is module


ENGINE_STATE_DICT_METHODS = ("zero_gather_16bit_weights_on_model_save", "_zero3_consolidated_16bit_state_dict")
"""What Accelerate's ``get_state_dict`` calls on a model under ZeRO-3 (it assumes a DeepSpeed engine)."""


def engine_loaded() -> bool:
    """Whether ``deepspeed.runtime.engine`` was imported already (``import deepspeed`` imports it)."""
    return "deepspeed.runtime.engine" in sys.modules


def wrap_engine_model_cast(make: Callable[[Any], Any]) -> Callable[[], None]:
    """Replace ``DeepSpeedEngine._configure_distributed_model(self, model)`` with ``make(original)``; returns the undo.

    That method is where every version in range casts the model for fp16 / bf16: 0.16.0 to 0.19.1 run
    ``module.half()`` / ``module.bfloat16()`` (through ``nn.Module._apply``); 0.19.2+ cast the parameters by
    ``p.data = ...`` and, only with ``data_types.buffer_dtype`` set, every buffer by ``b.data = b.data.to(...)``
    (not through ``_apply``), skipping those ``data_types.keep_in_fp32_modules`` names."""
    try:
        from deepspeed.runtime import engine
    except ImportError as e:
        raise DeepSpeedUnavailableError(f"zero_buffers' DeepSpeed engine support needs DeepSpeed: {e}", "deepspeed",
                                        version("deepspeed")) from e
    cls = getattr(engine, "DeepSpeedEngine", None)
    method = vars(cls).get("_configure_distributed_model") if isinstance(cls, type) else None
    if not isinstance(cls, type) or method is None or list(inspect.signature(method).parameters) != ["self", "model"]:
        raise missing("deepspeed", "DeepSpeedEngine._configure_distributed_model(self, model)")
    return replace(cls, "_configure_distributed_model", make)
