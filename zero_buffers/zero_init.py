"""Init and install(): zero.Init that broadcasts the buffers of every module built inside it when it exits."""
from __future__ import annotations

from typing import Any

from torch import nn

from . import _dist
from .broadcast import broadcast_buffers, broadcast_entries
from .errors import DeepSpeedUnavailableError, ZeroBuffersError

_recorders: list[list[nn.Module]] = []  # one list per recording context; every built module goes to each
_hook_users = 0
_own_depth = 0  # active zero_buffers.Init contexts
_originals: dict[str, Any] = {}  # what install() replaced, to put back exactly


def _partition_parameters() -> Any:
    """deepspeed.runtime.zero.partition_parameters, or a clear error."""
    try:
        from deepspeed.runtime.zero import partition_parameters
    except ImportError as e:
        raise DeepSpeedUnavailableError(f"zero_buffers ZeRO-3 tools need DeepSpeed: {e}") from e
    return partition_parameters


def _acquire_hook() -> None:
    """Route every module zero.Init post-processes into the active recorders (refcounted patch)."""
    global _hook_users
    pp = _partition_parameters()
    if _hook_users == 0:
        original = pp.Init._post_init_method

        def _post_init_method(self: Any, module: nn.Module) -> None:
            original(self, module)
            for rec in _recorders:
                rec.append(module)

        _post_init_method._zb_original = original  # type: ignore[attr-defined]
        pp.Init._post_init_method = _post_init_method
    _hook_users += 1


def _release_hook() -> None:
    """Undo _acquire_hook once its last user is done."""
    global _hook_users
    _hook_users -= 1
    if _hook_users == 0:
        pp = _partition_parameters()
        pp.Init._post_init_method = pp.Init._post_init_method._zb_original


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


def sync_built_modules(modules: list[nn.Module], *, failed: bool, src: int, group: Any, timeout: _dist.Timeout,
                       what: str) -> int:
    """Broadcast the buffers of modules built under zero.Init from ``src``: one structure-checked sync."""
    g = _dist.resolve_group(group)
    _dist.check_src(g, src)
    if g is None:
        return 0
    _dist.require_all_succeeded(g, failed, timeout, what, "buffers of the modules built inside were not broadcast")
    entries, seen = [], set()
    for k, root in enumerate(_roots(modules)):
        for name, buf in _dist.named_buffers(root):
            if id(buf) not in seen:
                seen.add(id(buf))
                entries.append((f"{type(root).__name__}#{k}.{name}", buf))
    return broadcast_entries(g, entries, src, timeout, what)


def _finish(modules: list[nn.Module], exc_type: Any, src: int, group: Any, timeout: _dist.Timeout,
            what: str) -> None:
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
    with one structure-checked, coalesced sync. Parameters are partitioned by DeepSpeed as usual.
    ``Init(module=m)`` (converting an existing module) broadcasts ``m``'s buffers at once. If the
    body raised on some ranks only, nothing is broadcast and the others raise :class:`ZeroBuffersError`.

    Example::

        with zero_buffers.Init(config_dict_or_path=ds_config):
            model = VQModel()          # codebook = torch.randn(...) differs per rank under plain zero.Init
        # here every rank holds rank 0's codebook and BatchNorm buffers
    """

    def __init__(self, *args: Any, src: int = 0, timeout: _dist.Timeout = None, **kwargs: Any):
        pp = _partition_parameters()
        src = _dist.check_rank_arg(src, "src", "zero_buffers.Init")
        timeout = _dist.check_timeout(timeout, "zero_buffers.Init")
        self._ds = pp.Init(*args, **kwargs)
        self._src, self._timeout = src, timeout
        self._group = kwargs.get("data_parallel_group")
        self._modules: list[nn.Module] = []
        self._outermost = False
        module = kwargs.get("module", args[0] if args else None)
        if module is not None and self._ds.enabled:
            sync_built_modules([module], failed=False, src=src, group=self._group, timeout=timeout,
                               what="zero_buffers.Init(module=...)")

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
            _recorders.append(self._modules)
            _acquire_hook()
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
            _recorders.remove(self._modules)
            _release_hook()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if not self._ds.enabled:
            return False
        try:
            self._ds.__exit__(exc_type, exc, tb)
        finally:
            self._unwind()
        if self._outermost:
            modules, self._modules = self._modules, []
            _finish(modules, exc_type, self._src, self._group, self._timeout, "zero_buffers.Init")
        return False


class _Installed:
    """Handle returned by :func:`install`; a context manager that uninstalls on exit if it installed."""

    def __init__(self, owner: bool):
        self.owner = owner

    def __enter__(self) -> _Installed:
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self.owner:
            uninstall()
        return False


def install(*, src: int = 0, timeout: _dist.Timeout = None) -> _Installed:
    """Make every ``deepspeed.zero.Init`` in this process sync buffers when its outermost context exits.

    That covers the contexts transformers' ``from_pretrained`` / ``from_config`` and Accelerate open
    for you; under ZeRO-3 the buffers of a model transformers initialises after loading (weights and
    non-persistent buffers missing from the checkpoint) are broadcast again once that is done.
    Opt-in and process-wide; idempotent (a second call changes nothing); :func:`uninstall` restores
    DeepSpeed (and transformers) exactly. Usable as a context manager. Raises :class:`DeepSpeedUnavailableError`
    if DeepSpeed cannot be imported; without a process group the sync is a no-op.

    Example::

        zero_buffers.install()
        model = AutoModel.from_pretrained(path)   # under ZeRO-3: buffers now agree on every rank
    """
    pp = _partition_parameters()
    src = _dist.check_rank_arg(src, "src", "install")
    timeout = _dist.check_timeout(timeout, "install")
    if _originals:
        return _Installed(owner=False)
    base = pp.InsertPostInitMethodToModuleSubClasses
    enter, exit_ = base.__dict__["__enter__"], base.__dict__["__exit__"]

    def __enter__(self: Any) -> Any:
        if not (self.enabled and pp.zero_init_context == 0 and _own_depth == 0):
            return enter(self)
        self._zb_modules = []
        _recorders.append(self._zb_modules)
        _acquire_hook()
        try:
            return enter(self)
        except BaseException:
            _recorders.remove(self.__dict__.pop("_zb_modules"))  # leave no recorder behind
            _release_hook()
            raise

    def __exit__(self: Any, exc_type: Any, exc: Any, tb: Any) -> Any:
        result = exit_(self, exc_type, exc, tb)
        modules = self.__dict__.pop("_zb_modules", None)
        if modules is not None and pp.zero_init_context == 0:
            _recorders.remove(modules)
            _release_hook()
            group = getattr(self, "ds_process_group", None)
            _finish(modules, exc_type, src, group, timeout, "zero.Init (zero_buffers.install)")
        return result

    _originals.update(enter=enter, exit=exit_)
    base.__enter__, base.__exit__ = __enter__, __exit__
    _patch_transformers(src, timeout)
    return _Installed(owner=True)


def _patch_transformers(src: int, timeout: _dist.Timeout) -> None:
    """Also sync after transformers' own post-load init (compat shim around a private transformers method).

    transformers 5 re-initialises weights and non-persistent buffers that the checkpoint lacks in
    ``PreTrainedModel._initialize_missing_keys``, after the zero.Init context has exited; under ZeRO-3
    only parameters are broadcast there (``GatheredParameters(modifier_rank=0)``). Where the method
    does not exist (other transformers versions) nothing is patched and the zero.Init exit sync remains.
    """
    try:
        from transformers import modeling_utils
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:
        return
    cls = modeling_utils.PreTrainedModel
    original = cls.__dict__.get("_initialize_missing_keys")
    if original is None:
        return

    def _initialize_missing_keys(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if is_deepspeed_zero3_enabled():
            broadcast_buffers(self, src=src, timeout=timeout)
        return result

    _originals["transformers"] = (cls, original)
    cls._initialize_missing_keys = _initialize_missing_keys


def uninstall() -> None:
    """Undo :func:`install`, restoring DeepSpeed's methods exactly. A no-op when not installed."""
    if not _originals:
        return
    base = _partition_parameters().InsertPostInitMethodToModuleSubClasses
    base.__enter__, base.__exit__ = _originals.pop("enter"), _originals.pop("exit")
    if "transformers" in _originals:
        cls, original = _originals.pop("transformers")
        cls._initialize_missing_keys = original


def installed() -> bool:
    """Whether :func:`install` is active."""
    return bool(_originals)
