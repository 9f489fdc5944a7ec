"""Private helpers shared by the BatchNorm tools: find the layers that track running statistics."""
from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _NormBase


def tracking_bn_modules(module: nn.Module) -> list[tuple[str, _NormBase]]:
    """BatchNorm-like modules (1d/2d/3d, SyncBatchNorm, lazy ones once built) that keep running stats."""
    return [(n, m) for n, m in module.named_modules()
            if isinstance(m, _NormBase) and m.track_running_stats and m.running_mean is not None]


def stat_entries(bns: list[tuple[str, _NormBase]]) -> list[tuple[str, object]]:
    """(qualified name, tensor) for the running stats of each layer, as structure agreement sees them."""
    out = []
    for name, m in bns:
        prefix = f"{name}." if name else ""
        out += [(prefix + "running_mean", m.running_mean), (prefix + "running_var", m.running_var)]
        if m.num_batches_tracked is not None:
            out.append((prefix + "num_batches_tracked", m.num_batches_tracked))
    return out
