"""Init and install(): zero.Init that broadcasts the buffers of every module built inside it, and a process-wide
opt-in that makes every zero.Init, every GatheredParameters(modifier_rank=r) and from_pretrained do the same, and
the FSDP2-era loads of ``zero_buffers.fsdp.loads``."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .._compat import deepspeed as ds_compat, transformers as hf_compat
from .._core import (
    args as _args,
    group as _group,
    modules as _modules,
    notice as _notice,
    transaction as _transaction,
    wire as _wire,
)
from ..broadcast import broadcast_buffers
from ..errors import DeepSpeedUnavailableError, InvalidArgumentError, ZeroBuffersError
from ..fsdp import loads as _loads
from ..precision import keep as _keep
from . import _owners
from .gathered import _Commit, resolve_group

_recorders: list[list[nn.Module]] = []  # one list per recording context; every module zero.Init converts goes to each
_hook_undo: list[Callable[[], None]] = []
_own_depth = 0  # active zero_buffers.Init contexts


def _record(module: nn.Module) -> None:
    _owners.remember(module)  # kept while zero_buffers.Init (or install()) records: parameter lists find owners
    for rec in _recorders:
        rec.append(module)


def _start_recording(modules: list[nn.Module]) -> None:
    _recorders.append(modules)
    if len(_recorders) == 1:
        _hook_undo.append(ds_compat.on_module_converted(_record))


def _stop_recording(modules: list[nn.Module]) -> None:
    _recorders.remove(modules)
    if not _recorders:
        _hook_undo.pop()()


def _roots(modules: list[nn.Module]) -> list[nn.Module]:
    """Recorded modules that are not a direct child of another recorded module, in build order, deduplicated."""
    children = {id(c) for m in modules for c in m.children()}
    seen: set[int] = set()
    out = []
    for m in modules:
        if id(m) not in children and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def sync_built_modules(modules: list[nn.Module], *, failed: bool, src: int, group: Any, timeout: float | None,
                       what: str) -> int:
    """Broadcast the buffers of modules built under zero.Init from group rank ``src``: one structure-checked sync."""
    g = _group.resolve(group, what)
    _group.check_src(g, src, what)
    if g is None:
        return 0
    entries, seen = [], set()
    for k, root in enumerate(_roots(modules)):
        for name, buf in _modules.named_buffers(root):
            if id(buf) not in seen:
                seen.add(id(buf))
                entries.append((f"{type(root).__name__}#{k}.{name}", buf))
    return _transaction.broadcast(g, entries, src, (what,), _wire.Deadline(timeout), what,
                                  failure="the body raised" if failed else None,
                                  unchanged="buffers of the modules built inside were not broadcast",
                                  step="the body raised, or the sync could not start,")


def _finish(modules: list[nn.Module], exc_type: Any, src: int, group: Any, timeout: float | None, what: str) -> None:
    """Sync at the end of a recording context; the body's own exception wins over ours."""
    try:
        sync_built_modules(modules, failed=exc_type is not None, src=src, group=group, timeout=timeout, what=what)
    except ZeroBuffersError:
        if exc_type is None:
            raise


class Init:
    """A drop-in for ``deepspeed.zero.Init`` (same arguments) that also syncs buffers.

    When the outermost ``zero_buffers.Init`` exits, the buffers of every module constructed inside it
    (including inside nested Init contexts) are broadcast from rank ``src`` of the data-parallel group
    (a rank within that group) with one structure-checked, all-or-nothing sync. Parameters are
    partitioned by DeepSpeed as usual. ``Init(module=m)`` (converting an existing module) broadcasts
    ``m``'s buffers at once. If the body raised on some ranks only, nothing is broadcast and the others
    raise :class:`SyncAbortedError`.

    Example::

        with zero_buffers.Init(config_dict_or_path=ds_config):
            model = VQModel()          # codebook = torch.randn(...) differs per rank under plain zero.Init
        # here every rank holds rank 0's codebook and BatchNorm buffers
    """

    def __init__(self, *args: Any, src: int = 0, timeout: _args.Timeout = None, **kwargs: Any):
        pp = ds_compat.partition_parameters()
        self._src = _args.rank(src, "src", "zero_buffers.Init")
        self._timeout = _args.timeout(timeout, "zero_buffers.Init")
        self._ds = pp.Init(*args, **kwargs)
        self._modules: list[nn.Module] = []
        self._outermost = False
        module = kwargs.get("module", args[0] if args else None)
        if module is not None and self._ds.enabled:
            sync_built_modules([module], failed=False, src=self._src, group=self._group, timeout=self._timeout,
                               what="zero_buffers.Init(module=...)")

    @property
    def _group(self) -> Any:
        """The data-parallel group DeepSpeed partitions over (None: the world)."""
        return getattr(self._ds, "ds_process_group", None)

    def __getattr__(self, name: str) -> Any:
        if "_ds" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["_ds"], name)

    def __enter__(self) -> Init:
        global _own_depth
        if not self._ds.enabled:
            return self
        self._outermost = _own_depth == 0
        if self._outermost:
            _start_recording(self._modules)
        _own_depth += 1
        try:
            self._ds.__enter__()
        except BaseException:
            self._unwind()
            raise
        return self

    def _unwind(self) -> None:
        """Leave the recording state as it was before __enter__."""
        global _own_depth
        _own_depth -= 1
        if self._outermost:
            _stop_recording(self._modules)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._ds.enabled:
            return
        try:
            self._ds.__exit__(exc_type, exc, tb)
        finally:
            self._unwind()
        if self._outermost:
            modules, self._modules = self._modules, []
            _finish(modules, exc_type, self._src, self._group, self._timeout, "zero_buffers.Init")


# ---- install(): every zero.Init, every GatheredParameters(modifier_rank=r), from_pretrained ------------------------
_undo: list[Callable[[], None]] = []  # what install() changed, undone in reverse by uninstall()
_warned: set[str] = set()
_WHAT = "GatheredParameters (zero_buffers.install)"
_kept_spec: list[Any] = []  # install()'s keep_precision, while installed with one
_loading = [0]  # from_pretrained calls in progress (install() syncs their whole model afterwards)


class _Installed:
    """Handle returned by :func:`install`; a context manager that uninstalls on exit if it installed."""

    def __init__(self, owner: bool):
        self.owner = owner

    def __enter__(self) -> _Installed:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.owner:
            uninstall()


def install(*, src: int = 0, timeout: _args.Timeout = None,
            keep_precision: bool | _keep.Spec = False) -> _Installed:
    """Make DeepSpeed, torch's FSDP2-era loads, Accelerate and transformers keep buffers in sync wherever they build
    or load a model.

    Opt-in and process-wide. While installed, with ``src`` a rank within each data-parallel group:

    * (DeepSpeed) every ``deepspeed.zero.Init`` (including those transformers' ``from_pretrained`` /
      ``from_config`` and Accelerate open for you) broadcasts the buffers of every module built inside when its
      outermost context exits;
    * (DeepSpeed) every ``deepspeed.zero.GatheredParameters(params, modifier_rank=r)`` (DeepSpeed's documented
      ``if rank == 0: module.load_state_dict(...)`` pattern, transformers 4.x loading, DeepSpeed's own
      ``load_checkpoint`` and 16-bit export) behaves like :class:`GatheredParametersAndBuffers`: the
      buffers of the modules that own the gathered parameters (learned when zero.Init converted them)
      (and of their ancestors, and those modules' parameter-free submodules) are broadcast from ``r``
      together with the parameters, all or nothing, when the body changed them on ``r``. A call with no
      ZeRO parameter stays a no-op (as in DeepSpeed): given tensors none of which ZeRO manages it warns
      once, since zero_buffers cannot tell which buffers its body changes; an empty list (DeepSpeed's own
      16-bit export passes many) is silent. For a module without parameters use
      :class:`GatheredParametersAndBuffers` (module, ...) or :func:`broadcast_buffers`;
    * ``PreTrainedModel.from_pretrained`` under ZeRO-3 broadcasts every buffer of the loaded model from
      ``src`` before returning (transformers 4.x loads checkpoint buffers on rank 0 only; 5.x misses
      non-persistent ones and those computed at init); under Accelerate's FSDP rank-0 loading
      (``cpu_ram_efficient_loading``) from global rank 0;
    * (torch, Accelerate) after ``set_model_state_dict`` / ``set_state_dict`` with ``StateDictOptions(
      full_state_dict=True, broadcast_from_rank0=True)``, after ``dcp.load`` of a state dict that
      ``get_model_state_dict`` / ``get_state_dict`` built, and after Accelerate's FSDP2 full-state-dict load
      (which then also loads models with persistent buffers), every buffer of the model, persistent or not, on
      ``meta`` or holding what ``to_empty()`` left, is rank 0's (the loads' own source) in one sync over the ranks
      the load ran over (``src`` does not apply: these loads always come from rank 0). What each load leaves wrong
      without it, per version: docs/fsdp.md;
    * with ``keep_precision=True`` (or a spec, as :func:`~zero_buffers.keep_precision` takes), every module
      zero.Init converts has its declared buffers kept as soon as its own ``__init__`` ran (before a checkpoint is
      loaded into them), and so has every model a DeepSpeed engine is built around, before the engine's fp16 / bf16
      cast: BatchNorm statistics, transformers' fp32 lists and rotary tables stay fp32 (entries of the spec that
      match nothing in a module are fine here). :func:`uninstall` stops keeping them.

    Idempotent (a second call changes nothing); :func:`uninstall` puts back the identical functions and methods.
    Usable as a context manager. Without DeepSpeed the DeepSpeed parts are left out and the rest is installed;
    ``keep_precision`` then raises :class:`DeepSpeedUnavailableError` (what it keeps is what DeepSpeed builds). A
    version of torch, Accelerate or transformers without a function it wraps raises :class:`DependencyError` and
    installs nothing. Without a process group every sync is a no-op.

    Example::

        zero_buffers.install()
        model = AutoModel.from_pretrained(path)   # under ZeRO-3: buffers now agree on every rank
        set_model_state_dict(fsdp_model, sd, options=StateDictOptions(full_state_dict=True,
                                                                      broadcast_from_rank0=True))
        # every buffer of fsdp_model, rotary inv_freq included, is rank 0's
    """
    src = _args.rank(src, "src", "install")
    seconds = _args.timeout(timeout, "install")
    if not isinstance(keep_precision, bool):
        _keep.parse(keep_precision, "install")  # checked before anything is installed
    if _undo:
        if keep_precision is not False and _kept_spec != [keep_precision]:
            raise InvalidArgumentError("install(): zero_buffers is installed already with keep_precision="
                                       f"{_kept_spec[0] if _kept_spec else False!r}; call uninstall() first to "
                                       "change it")
        return _Installed(owner=False)
    deepspeed = _deepspeed_importable()
    if keep_precision is not False and not deepspeed:
        ds_compat.partition_parameters()  # DeepSpeedUnavailableError: what keep_precision keeps is DeepSpeed's
    try:
        _undo.append(_loads.install(seconds))
        if deepspeed:
            _undo.append(ds_compat.on_module_converted(_owners.remember))
            if keep_precision is not False:
                spec = None if keep_precision is True else keep_precision
                _undo.append(_keep.keep_everywhere(spec, "install"))
                _kept_spec.append(keep_precision)
                _undo.append(_kept_spec.clear)
            _undo.append(_patch_init_context(src, seconds))
            _undo.append(_patch_gathered_parameters(seconds))
        undo_hf = hf_compat.wrap_from_pretrained(lambda model: _after_from_pretrained(model, src, seconds), _loading,
                                                 lambda error: _from_pretrained_failed(error, seconds))
        if undo_hf is not None:
            _undo.append(undo_hf)
    except BaseException:
        uninstall()
        raise
    return _Installed(owner=True)


def _deepspeed_importable() -> bool:
    """Whether DeepSpeed imports (and has what install() patches: a DependencyError otherwise)."""
    try:
        ds_compat.partition_parameters()
    except DeepSpeedUnavailableError:
        return False
    return True


def uninstall() -> None:
    """Undo :func:`install`, restoring DeepSpeed's, torch's, Accelerate's and transformers' functions and methods
    exactly. A no-op when not installed."""
    while _undo:
        _undo.pop()()


def installed() -> bool:
    """Whether :func:`install` is active."""
    return bool(_undo)


def _related(zero: list[torch.Tensor]) -> list[tuple[str, nn.Module]]:
    """The modules owning ``zero``, their ancestors (a model's own buffers, a codebook beside the layers) and the
    parameter-free submodules of those, each with a tag that is the same on every rank (an owner's ds_id, levels up,
    the path below)."""
    out: dict[int, tuple[str, nn.Module]] = {}
    for p in zero:
        owner = _owners.recorded_owner(p)
        level = 0
        while owner is not None and id(owner) not in out:
            out[id(owner)] = (f"<ds_id={ds_compat.ds_id(p)}, up {level}>", owner)
            owner, level = _owners.recorded_parent(owner), level + 1
    for tag, module in list(out.values()):  # their parameter-free children: a BatchNorm(affine=False) beside them
        for name, child in module.named_children():
            if id(child) not in out and next(child.parameters(), None) is None:
                for sub_name, sub in child.named_modules(prefix=name):
                    out.setdefault(id(sub), (f"{tag}/{sub_name}", sub))
    return list(out.values())


def _patch_init_context(src: int, timeout: float | None) -> Callable[[], None]:
    """Every outermost zero.Init (not inside zero_buffers.Init) records its modules and syncs them on exit."""
    base = ds_compat.init_context_class()

    def make_enter(enter: Any) -> Any:
        def __enter__(self: Any) -> Any:
            if not (self.enabled and ds_compat.init_depth() == 0 and _own_depth == 0):
                return enter(self)
            self._zb_modules = []
            _start_recording(self._zb_modules)
            try:
                return enter(self)
            except BaseException:
                _stop_recording(self.__dict__.pop("_zb_modules"))  # leave no recorder behind
                raise
        return __enter__

    def make_exit(exit_: Any) -> Any:
        def __exit__(self: Any, exc_type: Any, exc: Any, tb: Any) -> Any:
            result = exit_(self, exc_type, exc, tb)
            modules = self.__dict__.pop("_zb_modules", None)
            if modules is not None and ds_compat.init_depth() == 0:
                _stop_recording(modules)
                _finish(modules, exc_type, src, getattr(self, "ds_process_group", None), timeout,
                        "zero.Init (zero_buffers.install)")
            return result
        return __exit__

    undo_enter = ds_compat.replace(base, "__enter__", make_enter)
    undo_exit = ds_compat.replace(base, "__exit__", make_exit)

    def undo() -> None:
        undo_exit()
        undo_enter()
    return undo


def _own_buffers(related: list[tuple[str, nn.Module]]) -> Callable[[], list[_modules.Entry]]:
    """The modules' own buffers (not their children's: those belong to other owners or other contexts)."""
    def entries() -> list[_modules.Entry]:
        return [(f"{tag}.{k}", b) for tag, m in related for k, b in m._buffers.items() if b is not None]
    return entries


def _patch_gathered_parameters(timeout: float | None) -> Callable[[], None]:
    """DeepSpeed's GatheredParameters with modifier_rank set runs zero_buffers' commit (parameters and the owners'
    buffers, all or nothing); with modifier_rank=None it is DeepSpeed's own."""
    cls = ds_compat.gathered_parameters_class()
    init, enter, exit_ = (ds_compat.original(n) for n in ("init", "enter", "exit"))

    def make_init(_: Any) -> Any:
        def __init__(self: Any, params: Any = None, modifier_rank: int | None = None, fwd_module: Any = None,
                     enabled: bool = True, **kwargs: Any) -> None:
            if isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
                params = list(params)  # a generator: DeepSpeed consumes it, and we look at it too
            init(self, params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled, **kwargs)
            self._zb_commit = None
            if modifier_rank is None or not enabled:
                return
            if not self.enabled:  # no ZeRO parameter: DeepSpeed's no-op, and ours
                given = params if isinstance(params, list) else [params]  # DeepSpeed's own normalisation
                if _loading[0] == 0 and any(isinstance(t, torch.Tensor) for t in given):
                    _warn_once("no-zero", "zero_buffers.install(): GatheredParameters(modifier_rank=...) got no ZeRO "
                               "parameter, so it is a no-op (in DeepSpeed too) and zero_buffers cannot tell which "
                               "buffers its body changes; if the body loads buffers on one rank, call "
                               "zero_buffers.broadcast_buffers(module, src=that_rank) afterwards on every rank")
                return
            zero = sorted(self.params, key=ds_compat.ds_id)
            g = resolve_group(None, zero, _WHAT)
            _group.check_src(g, modifier_rank, _WHAT, "modifier_rank")
            self._zb_commit = (g, modifier_rank)
        return __init__

    def make_enter(_: Any) -> Any:
        def __enter__(self: Any) -> Any:
            planned = self.__dict__.get("_zb_commit")
            if planned is None:
                return enter(self)
            g, modifier_rank = planned
            related = _related(sorted(self.params, key=ds_compat.ds_id))  # now: the body may swap modules later
            commit = _Commit(ds_compat.Gather((), ctx=self), [m for _, m in related], _own_buffers(related), g,
                             modifier_rank, timeout, snapshot=True, only_if_changed=True)
            self._zb_commit = commit
            commit.enter()
            return None
        return __enter__

    def make_exit(_: Any) -> Any:
        def __exit__(self: Any, *exc: Any) -> Any:
            commit = self.__dict__.get("_zb_commit")
            if not isinstance(commit, _Commit):
                return exit_(self, *exc)
            commit.exit(exc[1] if len(exc) > 1 else None)
            return None
        return __exit__

    undos = [ds_compat.replace(cls, "__init__", make_init), ds_compat.replace(cls, "__enter__", make_enter),
             ds_compat.replace(cls, "__exit__", make_exit)]

    def undo() -> None:
        for u in reversed(undos):
            u()
    return undo


def _after_from_pretrained(model: Any, src: int, timeout: float | None) -> None:
    """Under ZeRO-3, every buffer of a model transformers just loaded takes ``src``'s value (over its DP group);
    under Accelerate's FSDP rank-0 loading, global rank 0's (over the default group; a buffer on meta is allocated)."""
    if not isinstance(model, nn.Module):
        return
    if hf_compat.zero3_enabled():
        zero = [p for p in model.parameters() if ds_compat.is_zero_param(p)]
        group = ds_compat.process_group(zero[0]) if zero else None
        broadcast_buffers(model, src=src, group=group, timeout=timeout)
    elif hf_compat.fsdp_rank0_loading():
        _loads.after_rank0_load(model, timeout)  # [Note: loads install() follows]


def _from_pretrained_failed(error: BaseException, timeout: float | None) -> None:
    """Under Accelerate's FSDP rank-0 loading, a from_pretrained that raised votes, so the ranks whose load returned
    raise too instead of waiting in the sync ([Note: loads install() follows])."""
    if not hf_compat.zero3_enabled() and hf_compat.fsdp_rank0_loading():
        _loads.rank0_load_failed(error, timeout)


def _warn_once(key: str, message: str) -> None:
    """Once per process, on the default group's first rank (every rank runs the same GatheredParameters)."""
    if key not in _warned and _notice.first_rank():
        _warned.add(key)
        _notice.warn(message, stacklevel=4, category=RuntimeWarning)
