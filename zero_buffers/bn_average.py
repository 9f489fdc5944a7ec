"""average_bn_stats: merge rank-local BatchNorm running statistics into those of all ranks' data."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import _bn, _dist


def average_bn_stats(module: nn.Module, *, group: Any = None, timeout: _dist.Timeout = None) -> int:
    """Replace every BatchNorm's running statistics, on every rank, by the statistics of the mixture of all ranks.

    Estimator: rank r contributes with weight ``w_r = n_r / sum(n)``, where ``n_r`` is its
    ``num_batches_tracked`` (1 when the layer has no counter), and

        mean = sum_r w_r * mean_r
        var  = sum_r w_r * var_r + sum_r w_r * (mean_r - mean)**2
        num_batches_tracked = sum_r n_r

    i.e. the exact mean and variance of the union of the ranks' data when every rank saw batches of
    the same size and its running stats are the plain average over its batches (``momentum=None``).
    The second term is the spread between rank means, which a naive average of ``running_var`` (timm's
    ``distribute_bn``) drops. With EMA momentum or unequal batch sizes the weights are approximate:
    use :func:`recompute_bn_stats` for exact population statistics.

    Covers every ``_NormBase`` that tracks running stats (BatchNorm1d/2d/3d, SyncBatchNorm). The sums
    are computed in float64 with one all-reduce for the whole model, after a structure check; buffers
    are written only once the all-reduce succeeded (a peer that dies, or stalls past ``timeout`` seconds
    per step, raises :class:`CollectiveError` and changes nothing). Layers no rank has updated (all
    counters 0) are left alone. A no-op without a process group. Returns the number of layers merged.

    Example::

        zero_buffers.average_bn_stats(model)     # before saving the checkpoint on rank 0
    """
    _dist.check_module(module, "average_bn_stats")
    timeout = _dist.check_timeout(timeout, "average_bn_stats")
    g = _dist.resolve_group(group)
    bns = _bn.tracking_bn_modules(module)
    if g is None or not bns:
        return 0
    entries = _bn.stat_entries(bns)
    _dist.agree_on_structure(g, ("average_bn_stats",), entries, timeout,
                             "average_bn_stats")
    _dist.reject_unsupported(entries, "average_bn_stats")
    _dist.check_backend_devices(g, entries, "average_bn_stats")

    parts = []
    for _, m in bns:
        n = float(m.num_batches_tracked) if m.num_batches_tracked is not None else 1.0
        mean = m.running_mean.detach().to(g.device, torch.float64)
        var = m.running_var.detach().to(g.device, torch.float64)
        parts += [torch.tensor([n], dtype=torch.float64, device=g.device), n * mean, n * (var + mean * mean)]
    sums = _dist.all_reduce_sum(g, torch.cat(parts), timeout, "average_bn_stats")

    merged, offset = 0, 0
    with torch.no_grad():
        for _, m in bns:
            c = m.running_mean.numel()
            total, s1, s2 = sums[offset], sums[offset + 1:offset + 1 + c], sums[offset + 1 + c:offset + 1 + 2 * c]
            offset += 1 + 2 * c
            if total <= 0:
                continue
            mean = s1 / total
            var = (s2 / total - mean * mean).clamp_min(0)
            m.running_mean.copy_(mean.to(m.running_mean.device, m.running_mean.dtype))
            m.running_var.copy_(var.to(m.running_var.device, m.running_var.dtype))
            if m.num_batches_tracked is not None:
                m.num_batches_tracked.fill_(int(round(float(total))))
            merged += 1
    return merged
