"""Which capabilities the installed torch, transformers and optional packages have: one table, read by ``install()``
(it follows only the loads the installed versions have) and by ``zero-buffers repro`` (a script that needs what is
not installed is skipped, the reason in its summary line).

[Note: capabilities by presence]
A capability is decided by what the installed package *has* (the public name a user would call), never by comparing
version numbers: a backport or a nightly has what it has. Each row names the releases CI runs it on, for the message;
docs/versions.md has the table.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from . import torch as torch_compat, version


def _has(module: str, name: str | None = None) -> bool:
    try:
        found = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - not there, or fails to import (a CUDA torchvision beside a CPU torch)
        return False
    return name is None or hasattr(found, name)


@dataclass(frozen=True)
class Capability:
    """One thing a feature needs: the package it comes from, what must be there, and the releases CI tests it on."""

    package: str
    what: str
    tested: str
    present: Callable[[], bool]


CAPABILITIES: dict[str, Capability] = {
    "fsdp2": Capability("torch", "torch.distributed.fsdp.fully_shard (FSDP2)", "torch 2.13.0 and 2.15.0",
                        lambda: _has("torch.distributed.fsdp", "fully_shard")),
    "dtensor": Capability("torch", "torch.distributed.tensor.DTensor (public DTensor placements)",
                          "torch 2.13.0 and 2.15.0",
                          lambda: _has("torch.distributed.tensor", "DTensor")),
    "rank0_loads": Capability("torch", "StateDictOptions(broadcast_from_rank0=True) (set_model_state_dict's rank-0 "
                              "load)", "torch 2.13.0 and 2.15.0",
                              lambda: "broadcast_from_rank0" in torch_compat.state_dict_options()),
    "deepseek_v3": Capability("transformers", "transformers.DeepseekV3Config (the MoE router-bias recipe's model)",
                              "transformers 4.57.6 and 5.24.0", lambda: _has("transformers", "DeepseekV3Config")),
    "vector_quantize": Capability("vector-quantize-pytorch", "vector_quantize_pytorch (pip install "
                                  "vector-quantize-pytorch)", "1.32.0",
                                  lambda: importlib.util.find_spec("vector_quantize_pytorch") is not None),
}


@functools.cache
def has(name: str) -> bool:
    """Whether the installed packages have capability ``name`` (a key of :data:`CAPABILITIES`)."""
    return CAPABILITIES[name].present()


def unmet(name: str) -> str | None:
    """None when capability ``name`` is there; else what is missing, the releases CI tests it on and what is
    installed, in words."""
    if has(name):
        return None
    cap = CAPABILITIES[name]
    found = version(cap.package)
    installed = f"{cap.package} {found} is installed" if found else f"{cap.package} is not installed"
    return f"needs {cap.what} (tested on {cap.tested}); {installed}"
