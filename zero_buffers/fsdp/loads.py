"""The FSDP2-era loads ``install()`` follows: after each, every buffer of the loaded model takes rank 0's values.

[Note: loads install() follows]
A load that puts one rank's checkpoint into a model on every rank carries the model's state-dict entries only, and
leaves the rest as each rank had it: non-persistent buffers (a rotary ``inv_freq``, cached masks) hold whatever
``to_empty()`` allocated, are still on ``meta``, or were computed by each rank on its own. While ``install()`` is
active, each of these ends with one ``broadcast_buffers(model, src=0, group=..., materialize=True)`` over the ranks
the load itself ran over, so every buffer, persistent or not, is rank 0's, bit for bit, and a buffer left on
``meta`` on some ranks is allocated there (the first such load fixes a ``fully_shard`` of a module built on
``meta`` on some ranks):

* ``set_model_state_dict`` / ``set_state_dict`` with ``StateDictOptions(full_state_dict=True,
  broadcast_from_rank0=True)``: torch broadcasts rank 0's state dict over the default group, so the sync runs from
  global rank 0 over the default group (under HSDP every rank of the mesh, replicate and shard dimensions alike:
  buffers are replicated over both). Without ``broadcast_from_rank0`` every rank loaded the state dict it passed
  itself, and nothing is synced: which rank's values are right is the caller's to say (``buffer_report`` tells
  whether they agree; ``broadcast_buffers`` picks one);
* ``torch.distributed.checkpoint.load(state_dict, process_group=pg)`` where ``state_dict`` (or one of its values)
  is a dict ``get_model_state_dict`` / ``get_state_dict`` returned while installed: every rank read the same
  persistent entries from the files; the buffers DCP never saved are synced from rank 0 of ``pg`` (the default
  group when None); every rank's dict counts, an empty one too (``full_state_dict=True, cpu_offload=True`` gives
  rank 0 the entries and the others ``{}``: each rank follows its own, so all of them sync). A state dict from
  ``model.state_dict()`` names no model and is not followed, nor is a load through a ``Stateful`` (its own
  ``load_state_dict`` runs ``set_state_dict``, covered as above), nor ``no_dist=True``. Every rank of ``pg``
  then says in one small all_gather how many models it follows: where they differ (a rank that built more state
  dicts than install() remembers, or replaced a value of its dict, follows none), every rank raises the same
  ``BufferStructureError``;
* Accelerate's ``fsdp2_load_full_state_dict`` (``cpu_ram_efficient_loading``): its loop reads every state-dict
  entry as a sharded parameter and fails on a persistent buffer (a plain tensor has no ``device_mesh``). While
  installed, a model without persistent buffers loads through Accelerate's own loop; one with them through torch's
  ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` (its ``cpu_offload`` passed on), which
  carries parameters and persistent buffers from rank 0 alike. The sync then runs from global rank 0 (Accelerate's
  ``is_main_process``, the source of its own broadcasts) over the default group once ``fsdp2_prepare_model``
  re-registered the non-persistent buffers (each rank's own copy), or at once when the load is called directly;
* transformers' ``from_pretrained`` while its ``is_fsdp_enabled()`` holds (Accelerate's FSDP with
  ``cpu_ram_efficient_loading``: 4.x loads the checkpoint on local rank 0 only, the others keep what the
  constructor made): from global rank 0 over the default group, as it returns (its parameters are Accelerate's
  to broadcast at ``prepare``).

A load that raised is not followed by a sync. A broadcast load that raised on some ranks only (torch's broadcasts
completed on every rank, then one rank's own ``load_state_dict`` refused its state dict, e.g. a key the model lacks
under ``strict``) must not leave the others waiting in the sync for it: after a ``broadcast_from_rank0`` load every
rank votes in one small all_gather whether its load raised, and if any did, the ranks that raised re-raise their own
error and the others raise the same ``SyncAbortedError`` naming them (nothing synced). So does ``from_pretrained``
under FSDP rank-0 loading (rank 0 alone reads the checkpoint on 4.x; any rank's may fail). The sync is the transaction
of ``broadcast_buffers``: a structure that differs (a rank built another model) raises the same
``BufferStructureError`` on every rank.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from .._compat import accelerate as acc_compat, torch as torch_compat, versions as _versions
from .._core import (
    group as _group,
    modules as _modules,
    structure as _structure,
    transaction as _transaction,
    wire as _wire,
)
from ..broadcast import broadcast_buffers
from ..errors import BufferStructureError, ZeroBuffersError

_state_dicts: dict[int, tuple[weakref.ref[nn.Module], tuple[int, ...]]] = {}  # id(dict) -> model, ids of its values
_REMEMBERED = 64  # state dicts remembered at most (the newest); one per get_model_state_dict call
_preparing: list[list[nn.Module]] = []  # per fsdp2_prepare_model in progress: the models its load filled
_quiet: list[bool] = []  # a load of ours inside Accelerate's: its own sync comes later


def install(timeout: float | None) -> Callable[[], None]:
    """Wrap the loads of [Note: loads install() follows]; returns the undo (the identical originals back)."""
    undos: list[Callable[[], None]] = []
    try:
        # only the loads the installed torch has ([Note: capabilities by presence]): before
        # StateDictOptions.broadcast_from_rank0 there is no rank-0 load to follow, and the DCP loads of that era
        # start from get_model_state_dict's FSDP2-era state dicts
        if _versions.has("rank0_loads"):
            undos.append(torch_compat.patch_model_state_dict_load(lambda original: _set_then_sync(original, timeout)))
            undos.append(torch_compat.patch_model_state_dict_get(_remembering))
            undos.append(torch_compat.patch_dcp_load(lambda original: _dcp_load_then_sync(original, timeout)))
        accelerate = acc_compat.patch_fsdp2_loading(lambda original: _accelerate_load(original, timeout),
                                                    lambda original: _accelerate_prepare(original, timeout))
        if accelerate is not None:
            undos.append(accelerate)
    except BaseException:
        for u in reversed(undos):
            u()
        raise

    def undo() -> None:
        for u in reversed(undos):
            u()
        _state_dicts.clear()
    return undo


def _sync(model: nn.Module, group: Any, timeout: float | None) -> None:
    """[Note: loads install() follows]: one structure-checked sync of every buffer from rank 0 of ``group``."""
    broadcast_buffers(model, src=0, group=group, timeout=timeout, materialize=True)


_PRETRAINED = "from_pretrained under FSDP rank-0 loading (zero_buffers.install)"


def after_rank0_load(model: nn.Module, timeout: float | None) -> None:
    """``from_pretrained`` under Accelerate's FSDP rank-0 loading ([Note: loads install() follows])."""
    _agree(None, timeout, _PRETRAINED)
    _sync(model, None, timeout)


def rank0_load_failed(error: BaseException, timeout: float | None) -> None:
    """That ``from_pretrained`` raised here: the vote :func:`after_rank0_load` holds on the others; raises."""
    _agree(error, timeout, _PRETRAINED)


def _set_then_sync(original: Callable[..., Any], timeout: float | None) -> Callable[..., Any]:
    def _load_model_state_dict(model: nn.Module, state_dict: Any, info: Any) -> Any:
        if not (torch_compat.broadcasts_from_rank0(info) and isinstance(model, nn.Module)):
            return original(model, state_dict, info)
        failure: BaseException | None = None
        try:
            result = original(model, state_dict, info)
        except BaseException as e:  # noqa: BLE001 - voted on in _agree, then re-raised
            failure = e
        _agree(failure, timeout, _LOAD)  # [Note: loads install() follows]: a load that raised on some ranks only
        if not _quiet:
            _sync(model, None, timeout)  # [Note: loads install() follows]
        return result
    return _load_model_state_dict


_LOAD = "set_model_state_dict(broadcast_from_rank0=True) (zero_buffers.install)"


def _agree(failure: BaseException | None, timeout: float | None, what: str) -> None:
    """Every rank of the default group learns whether the load raised anywhere; a rank whose load raised re-raises
    its own error, the others the same SyncAbortedError naming it ([Note: loads install() follows])."""
    g = _group.resolve(None, what)
    if g is not None:
        try:
            _transaction.vote(g, failure, _wire.Deadline(timeout), what, "the load raised",
                              "no buffer was synced (the load itself ran on the ranks that did not raise)")
        except ZeroBuffersError:
            if failure is None:
                raise
    if failure is not None:
        raise failure


def _value_ids(state_dict: dict) -> tuple[int, ...]:
    return tuple(id(v) for v in state_dict.values())


def _remembering(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_model_state_dict(model: nn.Module, info: Any) -> Any:
        state_dict = original(model, info)
        # an empty one too: a full state dict with cpu_offload is rank 0's alone, the others get {} and must follow
        # the same dcp.load as rank 0 (the sync is a collective)
        if isinstance(state_dict, dict) and isinstance(model, nn.Module):
            for key in [k for k, (ref, _) in _state_dicts.items() if ref() is None]:
                del _state_dicts[key]
            while len(_state_dicts) >= _REMEMBERED:
                del _state_dicts[next(iter(_state_dicts))]
            _state_dicts[id(state_dict)] = (weakref.ref(model), _value_ids(state_dict))
        return state_dict
    return _get_model_state_dict


def _models_of(state_dict: Any) -> list[nn.Module]:
    """The models whose ``get_model_state_dict`` output ``state_dict`` is or holds as a value, in key order (the
    same on every rank: DCP requires the same keys everywhere)."""
    found: list[nn.Module] = []
    candidates = [state_dict] + (list(state_dict.values()) if isinstance(state_dict, dict) else [])
    for d in candidates:
        entry = _state_dicts.get(id(d)) if isinstance(d, dict) else None
        model = entry[0]() if entry is not None else None
        if model is not None and entry is not None and entry[1] == _value_ids(d) and all(m is not model for m in found):
            found.append(model)
    return found


def _dcp_load_then_sync(original: Callable[..., Any], timeout: float | None) -> Callable[..., Any]:
    def load(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        models = _models_of(state_dict)  # before: a load may put new values into the dict
        result = original(state_dict, *args, **kwargs)
        if not kwargs.get("no_dist", False):
            _agree_followed(len(models), kwargs.get("process_group"), timeout)
            for model in models:
                _sync(model, kwargs.get("process_group"), timeout)  # [Note: loads install() follows]
        return result
    return load


_DCP = "dcp.load (zero_buffers.install)"


def _agree_followed(count: int, group: Any, timeout: float | None) -> None:
    """Which state dicts a rank follows is its own memory of them (a rank that built more than it remembers, or
    mutated its dict, follows none): one small all_gather of how many models each rank syncs, and a
    BufferStructureError on every rank where they differ, instead of some ranks waiting in a sync the others skip
    ([Note: loads install() follows])."""
    g = _group.resolve(group, _DCP)
    if g is None:
        return
    counts = [v[0] for v in _wire.all_gather_values(g, [count], _wire.Deadline(timeout), _DCP)]
    if any(c != counts[0] for c in counts):
        said = [f"{c} model(s) to sync" for c in counts]
        raise BufferStructureError(
            f"{_DCP}: ranks follow different state dicts: {_structure.by_value(g.ranks, said)} (a rank follows the "
            "dict get_model_state_dict / get_state_dict returned, unchanged, among the last "
            f"{_REMEMBERED} it built). The load itself completed; no buffer was synced: call "
            "zero_buffers.broadcast_buffers(model, materialize=True) on every rank", None, dict(zip(g.ranks, said)))


def _has_persistent_buffers(model: nn.Module) -> bool:
    transient = _modules.non_persistent_names(model)
    return any(name not in transient for name, _ in model.named_buffers())


def _accelerate_load(original: Callable[..., Any], timeout: float | None) -> Callable[..., Any]:
    def fsdp2_load_full_state_dict(accelerator: Any, model: nn.Module, full_sd: dict, *args: Any,
                                   **kwargs: Any) -> Any:
        acc_compat.is_main_process(accelerator)  # checked: the source of Accelerate's broadcasts is global rank 0
        if _has_persistent_buffers(model):  # Accelerate's loop would fail on them: torch's own load from rank 0
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
            offload = bool(kwargs.get("cpu_offload", args[0] if args else False))
            _quiet.append(True)
            try:
                set_model_state_dict(model, full_sd, options=StateDictOptions(
                    full_state_dict=True, broadcast_from_rank0=True, cpu_offload=offload))
            finally:
                _quiet.pop()
            result = model
        else:
            result = original(accelerator, model, full_sd, *args, **kwargs)
        if _preparing:
            _preparing[-1].append(model)  # synced once fsdp2_prepare_model re-registered the non-persistent ones
        else:
            _sync(model, None, timeout)  # [Note: loads install() follows]
        return result
    return fsdp2_load_full_state_dict


def _accelerate_prepare(original: Callable[..., Any], timeout: float | None) -> Callable[..., Any]:
    def fsdp2_prepare_model(accelerator: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        _preparing.append([])
        try:
            result = original(accelerator, model, *args, **kwargs)
        finally:
            loaded = _preparing.pop()
        for m in loaded:
            _sync(m, None, timeout)  # [Note: loads install() follows]
        return result
    return fsdp2_prepare_model
