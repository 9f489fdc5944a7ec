"""average_bn_stats: merge rank-local BatchNorm running statistics into those of all ranks' data."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import _args, _digest, _group, _modules, _notice, _transaction, _wire


def average_bn_stats(module: nn.Module, *, group: Any = None, timeout: _args.Timeout = None) -> int:
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
    are computed in float64 with one all-reduce for the whole model, after a structure check, and
    written only once every rank has them (all or nothing; a peer that dies, or a call past
    ``timeout`` seconds, raises :class:`CollectiveError` and changes nothing). Layers no rank has
    updated (all counters 0) are left alone. Every rank takes part even when its module has no
    BatchNorm (then the structure check fails unless no rank has one). A no-op without a process
    group. Returns the number of layers merged.

    Example::

        zero_buffers.average_bn_stats(model)     # before saving the checkpoint on rank 0
    """
    fn = "average_bn_stats"
    _args.module(module, fn)
    deadline = _wire.Deadline(_args.timeout(timeout, fn))
    g = _group.resolve(group, fn)
    if g is None:
        if not _group.initialized():
            _notice.single_process(fn)
        return 0
    _modules.fsdp_kinds(module, fn)  # a tree mixing FSDP1 and FSDP2 is refused here too
    bns = _modules.tracking_bn(module)
    entries = _modules.bn_stat_entries(bns)
    merged: list[int] = []

    def prepare() -> torch.Tensor:
        return _pack(bns, g.device)

    def exchange(sums: torch.Tensor) -> None:
        _wire.all_reduce(g, sums, deadline, fn)

    def apply(sums: torch.Tensor) -> None:
        merged.append(_write(bns, sums))

    contents = _transaction.commit(g, (fn,), entries, deadline, fn, prepare=prepare, exchange=exchange, apply=apply,
                                   extra=stats_digest(g, entries, fn))
    if merged[0] and len(set(contents)) == 1 and contents[0] != 0:
        warn_identical(fn)
    return merged[0]


def stats_digest(g: _group.Group, entries: list[tuple[str, torch.Tensor]], fn: str) -> int:
    """A digest of this rank's statistics for the identical-statistics check; 0 (never equal to a real one, never
    raising: it runs before the first collective) when there are none or they cannot be read."""
    if not entries or _transaction.unsendable(g, entries, fn) is not None:
        return 0
    try:
        return _digest.combined([t for _, t in entries]) or 1
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return 0


def warn_identical(fn: str) -> None:
    """Every rank held bitwise the same statistics (decided from every rank's digest, so every rank warns)."""
    _notice.warn(f"{fn}: every rank already held the same BatchNorm statistics (DDP's default broadcast_buffers=True "
                 "copies rank 0's into every rank before each forward, a distributed eval included), so the merge "
                 "changed nothing but the counters: these are one rank's statistics, not those of all ranks' data. "
                 "Recompute them instead: recompute_bn_stats(model, loader, global_batch=True), or the 'recompute' "
                 "policy of sync_buffers / sync_buffers_on_save.", stacklevel=4)


def _pack(bns: list[_modules.BatchNorm], device: torch.device, base: torch.Tensor | None = None) -> torch.Tensor:
    """Per layer [n, n * mean (C), n * (var + mean^2) (C)] in float64 on ``device``; one host sync for the counters.
    ``base``: every layer's counter at the last sync (float64, one per layer with a counter): ``n`` is then the
    batches since (keep_in_sync: repeated merges must not count a batch twice)."""
    if not bns:
        return torch.zeros(0, dtype=torch.float64, device=device)
    known = [bn.count.reshape(1).to(device, torch.float64) for bn in bns if bn.count is not None]
    stacked = torch.cat(known) if known else torch.zeros(0, dtype=torch.float64, device=device)
    if base is not None:
        stacked = (stacked - base.to(device)).clamp_min(0)
    parts, k = [], 0
    for bn in bns:
        if bn.count is None:
            n = torch.ones(1, dtype=torch.float64, device=device)
        else:
            n = stacked[k:k + 1]
            k += 1
        mean = bn.mean.detach().to(device, torch.float64)
        var = bn.var.detach().to(device, torch.float64)
        parts += [n, n * mean, n * (var + mean * mean)]
    return torch.cat(parts)


def _write(bns: list[_modules.BatchNorm], sums: torch.Tensor, base: torch.Tensor | None = None,
           untracked: bool = False) -> int:
    """Write the merged statistics (identical on every rank: the same all-reduced sums); returns the count.
    ``base`` (as in :func:`_pack`) is added back to the counters. ``untracked``: through ``.data``, so a forward's
    autograd graph that saved the statistics (BatchNorm does, for its backward) is not invalidated by the write."""
    offsets, offset = [], 0
    for bn in bns:
        offsets.append(offset)
        offset += 1 + 2 * bn.mean.numel()
    totals = sums[offsets].cpu().tolist() if bns else []  # one device-to-host copy
    bases = iter(base.tolist() if base is not None else [])
    merged = 0
    with torch.no_grad():
        for bn, start, total in zip(bns, offsets, totals):
            before = next(bases, 0.0) if bn.count is not None else 0.0
            if total <= 0:
                continue
            c = bn.mean.numel()
            mean = sums[start + 1:start + 1 + c] / total
            var = (sums[start + 1 + c:start + 1 + 2 * c] / total - mean * mean).clamp_min(0)
            target_mean, target_var = (bn.mean.data, bn.var.data) if untracked else (bn.mean, bn.var)
            target_mean.copy_(mean.to(bn.mean.device, bn.mean.dtype))
            target_var.copy_(var.to(bn.var.device, bn.var.dtype))
            if bn.count is not None:  # saturating: merging again and again (every step) must not overflow mid-write
                (bn.count.data if untracked else bn.count).fill_(min(round(before + total),
                                                                     torch.iinfo(bn.count.dtype).max))
            merged += 1
    return merged

