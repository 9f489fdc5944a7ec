"""A DeepSpeed / transformers without a private API zero_buffers relies on gives a typed DependencyError at the call
that needs it, naming the package, its version and what is missing (never an AttributeError or KeyError later).

* ``sync_buffers_on_save`` on a real DeepSpeed engine (built by ``deepspeed.initialize`` on two gloo ranks) whose
  class, a DeepSpeedEngine subclass, lacks ``_zero3_consolidated_16bit_state_dict`` as an older DeepSpeed's would:
  DependencyError on every rank at the call, nothing wrapped; the same engine with its own class takes the hook;
* patching a method a DeepSpeed class does not define itself (``install()`` replaces methods in class dicts);
* zero.Init's module globals checked together (``zero_init_context``, ``top_level_context``);
* a GatheredParameters context without the ``enabled`` flag its ``__init__`` sets;
* transformers without ``is_deepspeed_zero3_enabled``.
"""
from __future__ import annotations

import importlib.metadata

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import ZERO3_CONFIG, init_deepspeed
from zero_buffers import _compat
from zero_buffers._compat import deepspeed as ds_compat, transformers as hf_compat

pytestmark = pytest.mark.stack

DS_VERSION = importlib.metadata.version("deepspeed")


class _Absent:
    """A class attribute that reads as missing (``hasattr`` is False), as on a version that never defined it."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        raise AttributeError(self.name)


def _engine_class_without(name: str) -> type:
    """A DeepSpeedEngine subclass on which ``name`` is missing, as on a DeepSpeed that never defined it: the
    attribute reads as absent and ``dir`` does not list it (DeepSpeed 0.16's ``__getattr__`` looks there)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    def __dir__(self):
        return [n for n in super(cls, self).__dir__() if n != name]

    cls = type(DeepSpeedEngine.__name__, (DeepSpeedEngine,), {name: _Absent(), "__dir__": __dir__})
    return cls


def _engine_lacking(rank, world):
    deepspeed = init_deepspeed()
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config=ZERO3_CONFIG)
    own = type(engine)
    engine.__class__ = _engine_class_without("_zero3_consolidated_16bit_state_dict")  # the real engine, as an older
    # DeepSpeed's class would have it
    assert not hasattr(engine, "_zero3_consolidated_16bit_state_dict")
    outcome = None
    try:
        zb.sync_buffers_on_save(engine, "broadcast")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        outcome = (type(e).__name__, str(e), getattr(e, "package", None), getattr(e, "version", None))
    untouched = "_zero_buffers_save_hook" not in vars(engine) and "save_checkpoint" not in vars(engine)
    engine.__class__ = own
    with zb.sync_buffers_on_save(engine, "broadcast") as hook:  # its own class: the hook takes
        installed = hook.installed and "save_checkpoint" in vars(engine)
    return outcome, untouched, installed


def test_save_hook_on_an_engine_without_the_16bit_state_dict_method_is_a_dependency_error(ranks2):
    for rank, (outcome, untouched, installed) in enumerate(ranks2.run(_engine_lacking, timeout=180)):
        name, text, package, version = outcome
        assert name == "DependencyError" and package == "deepspeed" and version == DS_VERSION, (rank, outcome)
        assert f"deepspeed {DS_VERSION}" in text and "_zero3_consolidated_16bit_state_dict" in text, text
        assert untouched and installed, rank


def test_patching_a_method_a_deepspeed_class_only_inherits_is_a_dependency_error():
    from deepspeed.runtime.zero import partition_parameters as pp

    assert "__enter__" not in vars(pp.Init)  # inherited from InsertPostInitMethodToModuleSubClasses
    with pytest.raises(zb.DependencyError) as info:
        _compat.replace(pp.Init, "__enter__", lambda original: original)
    assert info.value.package == "deepspeed" and info.value.version == DS_VERSION
    assert "Init.__enter__" in str(info.value) and f"deepspeed {DS_VERSION}" in str(info.value)
    assert "__enter__" not in vars(pp.Init)  # nothing was set


@pytest.mark.parametrize("name", ["zero_init_context", "top_level_context"])
def test_zero_init_module_globals_are_checked_with_the_rest(monkeypatch, name):
    from deepspeed.runtime.zero import partition_parameters as pp

    monkeypatch.setattr(ds_compat, "_ORIGINAL", {})  # as in a fresh process: the check runs on first use
    monkeypatch.delattr(pp, name)
    with pytest.raises(zb.DependencyError, match=rf"partition_parameters\.{name}"):
        ds_compat.partition_parameters()


def test_a_gathered_parameters_context_without_its_enabled_flag_is_a_dependency_error():
    from deepspeed.runtime.zero import partition_parameters as pp

    ctx = object.__new__(pp.GatheredParameters)  # no __init__ ran: no ``enabled``
    with pytest.raises(zb.DependencyError, match=r"GatheredParameters\.enabled"):
        ds_compat.Gather((), ctx=ctx)


def test_transformers_without_its_zero3_flag_function_is_a_dependency_error(monkeypatch):
    hf = pytest.importorskip("transformers.integrations.deepspeed")
    monkeypatch.delattr(hf, "is_deepspeed_zero3_enabled")
    with pytest.raises(zb.DependencyError, match="is_deepspeed_zero3_enabled") as info:
        hf_compat.zero3_enabled()
    assert info.value.package == "transformers"
