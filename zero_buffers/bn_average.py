"""average_bn_stats: merge rank-local BatchNorm running statistics into those of all ranks' data."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from . import _args, _digest, _group, _modules, _notice, _transaction, _wire
from ._compat import torch as torch_compat


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
        merged.append(sum(total > 0 for total in _write(bns, sums).totals))

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


def _float64(ts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 1-D tensors concatenated as float64 on ``device`` (one conversion when they share a device and dtype)."""
    if len({(t.device, t.dtype) for t in ts}) == 1:
        return torch.cat(ts).to(device, torch.float64)
    return torch.cat([t.to(device, torch.float64) for t in ts])


@dataclass
class Layout:
    """Where every layer's statistics sit in the merged sums ``[n per layer (L), n * mean (C), n * (var + mean^2)
    (C)]`` (``C``: every layer's channels, in layer order; ``n`` is 1 for a layer without a counter), the tensors read
    and written, and the float64 space the merged statistics are computed in: made once per structure (keep_in_sync
    keeps it between syncs)."""

    bns: list[_modules.BatchNorm]
    channels: list[int]
    index: torch.Tensor  # per channel, its layer (to spread per-layer counts over channels)
    counted: list[int]  # the layers with a counter
    maxima: list[int]  # per counted layer, the largest value its counter's dtype holds
    direct: bool  # statistics and counters on ``device``, the statistics in one dtype: one cat each, no .to per layer
    means: list[torch.Tensor]  # the tensors written: ``.data`` of each when untracked
    vars: list[torch.Tensor]
    counts: list[torch.Tensor]  # per counted layer, its counter
    count_views: list[torch.Tensor]  # per counted layer, its counter as a 1-element view (0-d or (1,) alike)
    merged_mean: torch.Tensor  # float64 (C): the merged statistics before they are written
    merged_var: torch.Tensor
    mean_views: list[torch.Tensor]  # per layer, its slice of merged_mean / merged_var
    var_views: list[torch.Tensor]

    @property
    def numel(self) -> int:
        return len(self.bns) + 2 * sum(self.channels)


def layout(bns: list[_modules.BatchNorm], device: torch.device, untracked: bool = False) -> Layout:
    """The :class:`Layout` of ``bns`` with its sums on ``device``. ``untracked``: writes go through ``.data``, so a
    forward's autograd graph that saved the statistics (BatchNorm does, for its backward) is not invalidated."""
    channels = [bn.mean.numel() for bn in bns]
    index = torch.arange(len(bns), device=device).repeat_interleave(torch.tensor(channels, device=device)) \
        if bns else torch.zeros(0, dtype=torch.long, device=device)
    counts = [bn.count for bn in bns if bn.count is not None]
    counted = [i for i, bn in enumerate(bns) if bn.count is not None]
    stats = [t for bn in bns for t in (bn.mean, bn.var)]
    direct = not stats or (len({(t.device, t.dtype) for t in stats}) == 1 and stats[0].device == device
                           and all(t.device == device for t in counts))
    most = {dtype: torch.iinfo(dtype).max for dtype in {t.dtype for t in counts}}
    merged_mean = torch.empty(sum(channels), dtype=torch.float64, device=device)
    merged_var = torch.empty(sum(channels), dtype=torch.float64, device=device)

    def target(t: torch.Tensor) -> torch.Tensor:
        return t.data if untracked else t
    return Layout(bns, channels, index, counted, [most[t.dtype] for t in counts], direct,
                  [target(bn.mean) for bn in bns], [target(bn.var) for bn in bns], [target(t) for t in counts],
                  [t.data.reshape(1) for t in counts], merged_mean, merged_var,
                  list(merged_mean.split(channels)), list(merged_var.split(channels)))


def _pack(bns: list[_modules.BatchNorm], device: torch.device, base: torch.Tensor | None = None,
          lay: Layout | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The sums laid out as :class:`Layout` says, in float64 on ``device``: a few whole-model ops whatever the
    number of layers. ``base``: every layer's counter at the last sync (float64, one per layer with a counter):
    ``n`` is then the batches since (keep_in_sync: repeated merges must not count a batch twice). ``lay``: the
    layout kept from an earlier call; ``out``: float64 space of ``lay.numel`` to pack into (else a new tensor)."""
    if not bns:
        return torch.zeros(0, dtype=torch.float64, device=device) if out is None else out
    lay = layout(bns, device) if lay is None else lay
    layers, c = len(bns), sum(lay.channels)
    out = torch.empty(lay.numel, dtype=torch.float64, device=device) if out is None else out
    with torch.no_grad():
        n = out[:layers]
        n.fill_(1.0)
        if lay.counted:
            if len(lay.counted) == layers and lay.direct:
                n.copy_(torch.cat(lay.count_views))  # (a casting out= takes a slow path)
            else:
                n[lay.counted] = _float64(lay.count_views, device)
            if base is not None and len(lay.counted) == layers:
                n.sub_(base.to(device)).clamp_min_(0)
            elif base is not None:
                n[lay.counted] = (n[lay.counted] - base.to(device)).clamp_min(0)
        mean, square = out[layers:layers + c], out[layers + c:]
        if lay.direct:
            mean.copy_(torch.cat([bn.mean for bn in bns]))
            square.copy_(torch.cat([bn.var for bn in bns]))
        else:
            mean.copy_(_float64([bn.mean for bn in bns], device))
            square.copy_(_float64([bn.var for bn in bns], device))
        per = n.index_select(0, lay.index)
        square.add_(mean * mean).mul_(per)  # n * (var + mean^2)
        mean.mul_(per)  # n * mean
    return out


class Written(NamedTuple):
    """What :func:`_write` did: every layer's total count (0: no rank counted it, and it was left alone) and every
    counted layer's counter afterwards (float64, on the host)."""

    totals: list[float]
    counts: torch.Tensor


def _write(bns: list[_modules.BatchNorm], sums: torch.Tensor, base: torch.Tensor | None = None,
           untracked: bool = False, lay: Layout | None = None) -> Written:
    """Write the merged statistics (identical on every rank: the same all-reduced sums, laid out as :class:`Layout`
    says). Everything is computed first and the copies come last, so a failure while computing writes nothing.
    ``base`` (as in :func:`_pack`) is added back to the counters; ``untracked`` as in :func:`layout` (``lay`` made
    with it wins)."""
    if not bns:
        return Written([], torch.zeros(0, dtype=torch.float64))
    lay = layout(bns, sums.device, untracked) if lay is None else lay
    layers, c = len(bns), sum(lay.channels)
    totals = sums[:layers].cpu().tolist()  # one device-to-host copy
    with torch.no_grad():
        per = sums[:layers].index_select(0, lay.index)
        torch.div(sums[layers:layers + c], per, out=lay.merged_mean)
        torch.div(sums[layers + c:layers + 2 * c], per, out=lay.merged_var)
        lay.merged_var.sub_(lay.merged_mean * lay.merged_mean).clamp_min_(0)
        keep = [i for i, total in enumerate(totals) if total > 0]
        if len(keep) == layers:
            dst, src = lay.means + lay.vars, lay.mean_views + lay.var_views
        else:
            dst = [lay.means[i] for i in keep] + [lay.vars[i] for i in keep]
            src = [lay.mean_views[i] for i in keep] + [lay.var_views[i] for i in keep]
        bases = base.tolist() if base is not None else [0.0] * len(lay.counted)
        after = _float64(lay.count_views, torch.device("cpu")).tolist() if len(keep) < layers and lay.counted \
            else [0.0] * len(lay.counted)  # the counters left alone keep their value
        written, values = [], []
        for k, (i, before, most) in enumerate(zip(lay.counted, bases, lay.maxima)):
            if totals[i] > 0:  # saturating: merging again and again (every step) must not overflow mid-write
                written.append(lay.counts[k])
                values.append(min(round(before + totals[i]), most))
                after[k] = float(values[-1])
        counts = list(torch.tensor(values, dtype=torch.int64).unbind()) if written else []
        state = torch.tensor(after, dtype=torch.float64)
        if keep:  # every value is ready: the writes
            torch_compat.copy_all(dst, src, False)
        if written:
            torch_compat.copy_all(written, counts, False)
    return Written(totals, state)
