"""What a test body may not leave behind in a rank worker (checked by tests/multirank.py around every task).

A snapshot names every patchable global the library or the tests touch: torch.distributed's functions, DeepSpeed's
zero.Init and GatheredParameters methods and context globals, transformers' ZeRO-3 flag and from_pretrained, and
zero_buffers' own registries. A task that returns with any of them changed fails, naming what leaked; the
library's caches are emptied after each task so no test depends on what an earlier one cached.
"""
from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

_DIST_NAMES = ("all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast", "broadcast_object_list",
               "all_reduce", "reduce", "gather", "scatter", "all_to_all", "send", "recv", "barrier", "new_group")


def snapshot() -> dict[str, Any]:
    """Identity (or value) of every global a test could leak."""
    out: dict[str, Any] = {f"torch.distributed.{n}": getattr(dist, n, None) for n in _DIST_NAMES}
    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if pp is not None:
        out["deepspeed Init._post_init_method"] = vars(pp.Init).get("_post_init_method")
        base = pp.InsertPostInitMethodToModuleSubClasses
        out["deepspeed zero.Init __enter__/__exit__"] = (vars(base)["__enter__"], vars(base)["__exit__"])
        gp = pp.GatheredParameters
        out["deepspeed GatheredParameters methods"] = (vars(gp)["__init__"], vars(gp)["__enter__"],
                                                      vars(gp)["__exit__"])
        out["deepspeed zero_init_context"] = pp.zero_init_context
        out["deepspeed top_level_context"] = pp.top_level_context
    hf = sys.modules.get("transformers.integrations.deepspeed")
    if hf is not None:
        ref = getattr(hf, "_hf_deepspeed_config_weak_ref", None)
        out["transformers HfDeepSpeedConfig weakref"] = ref is not None and ref() is not None
    mu = sys.modules.get("transformers.modeling_utils")
    if mu is not None:
        out["transformers PreTrainedModel.from_pretrained"] = vars(mu.PreTrainedModel).get("from_pretrained")
    tr = sys.modules.get("zero_buffers._core.transaction")
    if tr is not None:
        out["zero_buffers _transaction.reached"] = tr.reached
    zi = sys.modules.get("zero_buffers.zero3.zero_init")
    if zi is not None:
        out["zero_buffers installed()"] = zi.installed()
        out["zero_buffers Init recorders"] = len(zi._recorders)
        out["zero_buffers Init depth"] = zi._own_depth
    nz = sys.modules.get("zero_buffers.zero3.no_zero_init")
    if nz is not None:
        out["zero_buffers no_zero_init depth"] = nz._depth
    from torch import nn
    from torch.nn.modules import batchnorm
    out["torch nn.Module._apply"] = vars(nn.Module)["_apply"]
    out["torch _BatchNorm.forward"] = vars(batchnorm._BatchNorm)["forward"]
    eng = sys.modules.get("deepspeed.runtime.engine")
    if eng is not None:
        out["deepspeed DeepSpeedEngine._configure_distributed_model"] = \
            vars(eng.DeepSpeedEngine).get("_configure_distributed_model")
    kp = sys.modules.get("zero_buffers.precision.keep")
    if kp is not None:
        out["zero_buffers keep_precision handles"] = kp.handles_alive()
    acc = sys.modules.get("accelerate.state")
    if acc is not None:
        out["accelerate AcceleratorState initialised"] = bool(acc.AcceleratorState._shared_state)
    return out


def leaked(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names whose value changed (a module imported during the task brings new names: only changes count)."""
    return [k for k, v in before.items() if k in after and after[k] is not v and after[k] != v]


def clear_caches() -> None:
    """Forget zero_buffers' caches (structure digests, all-agree reports, fingerprint tables)."""
    for name, attr in (("zero_buffers._core.structure", "_CACHE"), ("zero_buffers.report", "_IN_SYNC"),
                       ("zero_buffers._core.digest", "_TABLES"), ("zero_buffers._core.notice", "_SEEN")):
        module = sys.modules.get(name)
        if module is not None:
            getattr(module, attr).clear()


def clear_deepspeed_init_leftovers() -> None:
    """Take out the ``zero.Init`` ``__init__`` wrappers DeepSpeed before 0.15 leaves on classes that inherit
    ``__init__`` (BatchNorm1d: which ones varies per process), as the library does inside ``no_zero_init``: left in
    a long-lived worker, every later test's plain BatchNorm would be partitioned, on some ranks only, and its init
    broadcast would hang the pool. DeepSpeed's leak, not the test's: no LeakError; a no-op on 0.15+."""
    if sys.modules.get("deepspeed.runtime.zero.partition_parameters") is not None:
        from zero_buffers._compat.deepspeed import suspend_stale_init_patches

        suspend_stale_init_patches()
