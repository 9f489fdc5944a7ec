"""average_bn_stats: merge rank-local BatchNorm running statistics into those of all ranks' data."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from .._compat import torch as torch_compat
from .._core import (
    args as _args,
    digest as _digest,
    group as _group,
    modules as _modules,
    notice as _notice,
    transaction as _transaction,
    wire as _wire,
)


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
    merged: list[Merged] = []

    def prepare() -> torch.Tensor:
        return _pack(bns, g.device)

    def exchange(sums: torch.Tensor) -> None:
        _wire.all_reduce(g, sums, deadline, fn)

    def compute(sums: torch.Tensor) -> None:  # the merge is computed before the receive vote, the write only copies
        merged.append(merge(bns, sums))

    def write(_: torch.Tensor) -> None:
        apply(merged[0])

    # [Note: the transaction]; the sums: [Note: the BatchNorm sums]
    contents = _transaction.commit(g, (fn,), entries, deadline, fn, prepare=prepare, exchange=exchange, apply=write,
                                   compute=compute, extra=stats_digest(g, entries, fn))
    layers = sum(total > 0 for total in merged[0].totals)
    if layers and len(set(contents)) == 1 and contents[0] != 0:
        warn_identical(fn, g)
    return layers


def stats_digest(g: _group.Group, entries: list[tuple[str, torch.Tensor]], fn: str) -> int:
    """A digest of this rank's statistics for the identical-statistics check; 0 (never equal to a real one, never
    raising: it runs before the first collective) when there are none or they cannot be read."""
    if not entries or _transaction.unsendable(g, entries, fn) is not None:
        return 0
    try:
        return _digest.combined([t for _, t in entries]) or 1
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return 0


def warn_identical(fn: str, group: _group.Group | None) -> None:
    """Every rank held bitwise the same statistics (decided from every rank's digest, the same on every rank): said
    once, by the first rank of ``group``."""
    _notice.warn(f"{fn}: every rank already held the same BatchNorm statistics (DDP's default broadcast_buffers=True "
                 "copies rank 0's into every rank before each forward, a distributed eval included), so the merge "
                 "changed nothing but the counters: these are one rank's statistics, not those of all ranks' data. "
                 "Recompute them instead: recompute_bn_stats(model, loader, global_batch=True), or the 'recompute' "
                 "policy of sync_buffers / sync_buffers_on_save.", stacklevel=4, group=group)


def _float64(ts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 1-D tensors concatenated as float64 on ``device`` (one conversion when they share a device and dtype)."""
    if not ts:
        return torch.zeros(0, dtype=torch.float64, device=device)
    if len({(t.device, t.dtype) for t in ts}) == 1:
        return torch.cat(ts).to(device, torch.float64)
    return torch.cat([t.to(device, torch.float64) for t in ts])


# [Note: the BatchNorm sums]
# Every merge of BatchNorm statistics (average_bn_stats, the "bn" rule, keep_in_sync, the save hooks) all-reduces one
# float64 tensor laid out as  [w (L) | c (L) | first (C) | second (C)]  (L layers, C channels of all layers in layer
# order) and divides after it:  mean = first / w,  var = second / w - mean**2,  num_batches_tracked = c.
#   w       the weight of what this rank contributes (batches),
#   c       what this rank adds to the counter,
#   first   w * mean of what it contributes,  second  w * (var + mean**2) of it.
# A one-shot merge contributes each rank's whole statistics (w = c = its counter; a layer without a counter has
# w = 1, c = 0): the exact mixture of the ranks' data when each rank's statistics are the plain average over its
# batches (momentum=None). Repeated merges (:class:`Repeated`) contribute so that a batch is never counted twice.

@dataclass
class Layout:
    """Where every layer's statistics sit in the sums ([Note: the BatchNorm sums]), the tensors read and written, and
    the float64 space the merged statistics are computed in: made once per structure (keep_in_sync keeps it)."""

    bns: list[_modules.BatchNorm]
    channels: list[int]
    index: torch.Tensor  # (C,) per channel, its layer (to spread per-layer values over channels)
    counted: list[int]  # the layers with a counter
    has_count: torch.Tensor  # (L,) float64: 1 where the layer has a counter
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
    def layers(self) -> int:
        return len(self.bns)

    @property
    def width(self) -> int:
        """C: the channels of every layer."""
        return sum(self.channels)

    @property
    def numel(self) -> int:
        return 2 * self.layers + 2 * self.width

    def parts(self, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w, c, first, second): views of ``sums``."""
        L, C = self.layers, self.width
        return sums[:L], sums[L:2 * L], sums[2 * L:2 * L + C], sums[2 * L + C:2 * L + 2 * C]

    def read(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (counter per layer, mean per channel, var per channel) in float64 on ``device``; a layer
        without a counter reads 1."""
        n = torch.ones(self.layers, dtype=torch.float64, device=device)
        if self.counted:
            if len(self.counted) == self.layers and self.direct:
                n.copy_(torch.cat(self.count_views))  # (a casting out= takes a slow path)
            else:
                n[self.counted] = _float64(self.count_views, device)
        if self.direct:
            return n, torch.cat([bn.mean for bn in self.bns]).double(), torch.cat([bn.var for bn in self.bns]).double()
        return n, _float64([bn.mean for bn in self.bns], device), _float64([bn.var for bn in self.bns], device)


def layout(bns: list[_modules.BatchNorm], device: torch.device, untracked: bool = False) -> Layout:
    """The :class:`Layout` of ``bns`` with its sums on ``device``. ``untracked``: writes go through ``.data``, so a
    forward's autograd graph that saved the statistics (BatchNorm does, for its backward) is not invalidated."""
    channels = [bn.mean.numel() for bn in bns]
    index = torch.arange(len(bns), device=device).repeat_interleave(torch.tensor(channels, device=device)) \
        if bns else torch.zeros(0, dtype=torch.long, device=device)
    counts = [bn.count for bn in bns if bn.count is not None]
    counted = [i for i, bn in enumerate(bns) if bn.count is not None]
    has_count = torch.tensor([float(bn.count is not None) for bn in bns], dtype=torch.float64, device=device)
    stats = [t for bn in bns for t in (bn.mean, bn.var)]
    direct = not stats or (len({(t.device, t.dtype) for t in stats}) == 1 and stats[0].device == device
                           and all(t.device == device for t in counts))
    most = {dtype: torch.iinfo(dtype).max for dtype in {t.dtype for t in counts}}
    merged_mean = torch.empty(sum(channels), dtype=torch.float64, device=device)
    merged_var = torch.empty(sum(channels), dtype=torch.float64, device=device)

    def target(t: torch.Tensor) -> torch.Tensor:
        return t.data if untracked else t
    return Layout(bns, channels, index, counted, has_count, [most[t.dtype] for t in counts], direct,
                  [target(bn.mean) for bn in bns], [target(bn.var) for bn in bns], [target(t) for t in counts],
                  [t.data.reshape(1) for t in counts], merged_mean, merged_var,
                  list(merged_mean.split(channels)), list(merged_var.split(channels)))


def _pack(bns: list[_modules.BatchNorm], device: torch.device, lay: Layout | None = None,
          out: torch.Tensor | None = None, repeated: Repeated | None = None) -> torch.Tensor:
    """This rank's contribution to the sums ([Note: the BatchNorm sums]) in float64 on ``device``: its whole statistics,
    or with ``repeated`` what it has to add since the last merge. ``lay``: the layout kept from an earlier call;
    ``out``: float64 space of ``lay.numel`` to pack into (else a new tensor). A few whole-model ops whatever the
    number of layers."""
    if not bns:
        return torch.zeros(0, dtype=torch.float64, device=device) if out is None else out
    lay = layout(bns, device) if lay is None else lay
    out = torch.empty(lay.numel, dtype=torch.float64, device=device) if out is None else out
    with torch.no_grad():
        n, mean, var = lay.read(device)
        w, c, first, second = lay.parts(out)
        if repeated is not None:
            repeated.contribute(n, mean, var, w, c, first, second)
            return out
        w.copy_(n)
        torch.mul(n, lay.has_count, out=c)
        per = n.index_select(0, lay.index)
        torch.mul(mean, per, out=first)
        torch.addcmul(var, mean, mean, out=second).mul_(per)
    return out


class Merged(NamedTuple):
    """What :func:`merge` computed and :func:`apply` writes: every layer's total weight (0: no rank contributed, and
    it is left alone), its counter afterwards (float64 on the sums' device; a layer without a counter or left
    alone: its value before), and the copies to make."""

    totals: list[float]
    counts: torch.Tensor
    dst: list[torch.Tensor]
    src: list[torch.Tensor]
    counters: list[torch.Tensor]
    values: list[torch.Tensor]


def merge(bns: list[_modules.BatchNorm], sums: torch.Tensor, untracked: bool = False,
          lay: Layout | None = None) -> Merged:
    """The merged statistics from the all-reduced sums ([Note: the BatchNorm sums]), identical on every rank, computed
    into the layout's float64 space; nothing is written. Counters saturate at their dtype's largest value.
    ``untracked`` as in :func:`layout` (``lay`` made with it wins)."""
    if not bns:
        return Merged([], torch.zeros(0, dtype=torch.float64), [], [], [], [])
    lay = layout(bns, sums.device, untracked) if lay is None else lay
    L = lay.layers
    w, _, first, second = lay.parts(sums)
    host = sums[:2 * L].cpu().tolist()  # one device-to-host copy: weights and counters
    totals, adds = host[:L], host[L:]
    with torch.no_grad():
        per = w.index_select(0, lay.index)
        torch.div(first, per, out=lay.merged_mean)
        torch.div(second, per, out=lay.merged_var)
        lay.merged_var.addcmul_(lay.merged_mean, lay.merged_mean, value=-1).clamp_min_(0)
        keep = [i for i, total in enumerate(totals) if total > 0]
        if len(keep) == L:
            dst, src = lay.means + lay.vars, lay.mean_views + lay.var_views
        else:
            dst = [lay.means[i] for i in keep] + [lay.vars[i] for i in keep]
            src = [lay.mean_views[i] for i in keep] + [lay.var_views[i] for i in keep]
        after = lay.read(sums.device)[0].tolist() if len(keep) < L else [0.0] * L  # left alone: as they were
        counters, values = [], []
        for k, (i, most) in enumerate(zip(lay.counted, lay.maxima)):
            if totals[i] > 0:  # saturating: merging again and again (every step) must not overflow mid-write
                counters.append(lay.counts[k])
                values.append(min(max(round(adds[i]), 0), most))
                after[i] = float(values[-1])
        counts = list(torch.tensor(values, dtype=torch.int64).unbind()) if counters else []
        state = torch.tensor(after, dtype=torch.float64, device=sums.device)
    return Merged(totals, state, dst, src, counters, counts)


def apply(m: Merged) -> None:
    """The copies :func:`merge` prepared (no allocation, no collective)."""
    with torch.no_grad():
        if m.dst:
            torch_compat.copy_all(m.dst, m.src, False)
        if m.counters:
            torch_compat.copy_all(m.counters, m.values, False)


def _write(bns: list[_modules.BatchNorm], sums: torch.Tensor, untracked: bool = False,
           lay: Layout | None = None) -> Merged:
    """:func:`merge` then :func:`apply`."""
    merged = merge(bns, sums, untracked, lay)
    apply(merged)
    return merged


# [Note: repeated merges]
# keep_in_sync (and the save hooks and trainer callbacks built on it) merge the same statistics again and again. After
# a merge every rank holds the same statistics, so merging whole statistics again would count the shared history once
# per rank. Each rank therefore contributes only what it did not contribute before, and the history every rank shares
# (the statistics at the start, when every rank held the same) enters once, through the source rank:
#
# * a layer with ``momentum=None`` (a cumulative average: the exact case) keeps, per rank, the sums of everything it
#   added since the start, derived from its statistics and those the last merge left (``a = n mean - n0 mean0``,
#   ``v = n var - n0 var0``): its batches ``K``, ``A = sum of batch means``, ``V = sum of batch variances``. The merge
#   is the mixture of the shared start (count N0, mean M0, var V0) and every rank's own data since:
#       mean = (N0 M0 + sum A) / (N0 + sum K)
#       var  = (N0 (V0 + M0**2) + sum (V + A**2 / K)) / (N0 + sum K) - mean**2
#   which is what one average_bn_stats at the end gives when no rank ever synced (from a fresh layer, N0 = 0), however
#   often the ranks merged in between;
# * a layer with a momentum (an EMA) cannot be split into batches: each rank's statistics are weighted by the batches
#   it ran since the last merge (``n - n0``). When every rank ran as many, the merged running_mean is the EMA of the
#   rank-averaged batch means (the update is linear); running_var is the average of the ranks' running_var plus the
#   weighted spread of their running means;
# * a layer without a counter has weight 1 on every rank;
# * num_batches_tracked becomes the count at the last merge plus every rank's batches since.
# Where the ranks did not hold the same statistics at the start (they diverged before keep_in_sync was called, or a
# save hook begins late), nothing is shared: every rank's whole statistics count, and the first merge is exactly
# average_bn_stats'. A counter below the one the last merge left (the layer was replaced or reloaded on this rank)
# starts this rank's layer afresh: its whole statistics count.

def _cumulative_kinds(lay: Layout) -> list[bool]:
    """Per layer: a cumulative average (momentum=None, with a counter) rather than an EMA."""
    return [bn.module.momentum is None and bn.count is not None for bn in lay.bns]


@dataclass
class Repeated:
    """One rank's side of repeated merges of ``lay``'s layers ([Note: repeated merges]); float64 on the sums' device.
    ``contribute`` fills this rank's part of the sums without changing anything; ``commit`` takes it up once the
    merged statistics were written."""

    lay: Layout
    source: bool  # the rank through which the shared start enters the sums
    cumulative: torch.Tensor  # (L,) bool: momentum=None layers with a counter
    last_n: torch.Tensor  # (L,) the counter the last merge left (at the start: the shared one, or 0)
    last_mean: torch.Tensor  # (C,) the statistics the last merge left (cumulative layers)
    last_var: torch.Tensor
    acc_k: torch.Tensor  # (L,) cumulative layers: this rank's batches since the start
    acc_a: torch.Tensor  # (C,) ... the sum of its batch means
    acc_v: torch.Tensor  # (C,) ... the sum of its batch variances
    origin: torch.Tensor  # (L + 2C,) on the source: the shared start of cumulative layers [N0, N0 M0, N0 (V0 + M0^2)]
    kinds: list[bool] = field(default_factory=list)  # per layer: cumulative (momentum=None) when last merged
    _pending: tuple[Any, ...] | None = None  # what contribute computed: acc_k, acc_a, acc_v, origin, kinds, cumulative

    @classmethod
    def start(cls, lay: Layout, device: torch.device, source: bool, shared: torch.Tensor,
              at_start: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> Repeated:
        """Before the first merge: ``shared`` (L,) bool marks the layers every rank held identically at the start,
        whose statistics then were ``at_start`` (counter, mean, var as :meth:`Layout.read` gives them)."""
        L, C = lay.layers, lay.width
        zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
        kinds = _cumulative_kinds(lay)
        cumulative = torch.tensor(kinds, dtype=torch.bool, device=device)
        state = cls(lay, source, cumulative, zeros(L), zeros(C), zeros(C), zeros(L), zeros(C), zeros(C),
                    zeros(L + 2 * C), kinds)
        if at_start is not None and L:
            n, mean, var = at_start
            keep = shared.to(device=device, dtype=torch.float64)
            keep_c = keep.index_select(0, lay.index)
            state.last_n.copy_(n * keep)
            state.last_mean.copy_(mean * keep_c)
            state.last_var.copy_(var * keep_c)
            if source:
                cum = keep * cumulative.double()
                cum_c = cum.index_select(0, lay.index)
                n_c = n.index_select(0, lay.index)
                state.origin[:L] = n * cum
                state.origin[L:L + C] = n_c * mean * cum_c
                state.origin[L + C:] = n_c * torch.addcmul(var, mean, mean) * cum_c
        return state

    def contribute(self, n: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, w: torch.Tensor, c: torch.Tensor,
                   first: torch.Tensor, second: torch.Tensor) -> None:
        """This rank's (w, c, first, second) for the next merge, from its statistics now (``n`` per layer, ``mean``
        and ``var`` per channel, float64). Nothing is kept until :meth:`commit`."""
        lay, index = self.lay, self.lay.index
        L, C = lay.layers, lay.width
        counted = lay.has_count > 0
        fresh = (n < self.last_n) & counted  # replaced or reloaded here: start this layer afresh
        kinds = _cumulative_kinds(lay)  # a layer whose momentum changed since the last merge starts afresh too
        cum = self.cumulative
        if kinds != self.kinds:
            cum = torch.tensor(kinds, dtype=torch.bool, device=n.device)
            fresh = fresh | (cum != self.cumulative)
        refresh = bool(fresh.any())
        last_n = self.last_n.masked_fill(fresh, 0.0) if refresh else self.last_n
        k = torch.where(counted, n - last_n, torch.ones_like(n))
        torch.mul(k + last_n if self.source else k, lay.has_count, out=c)
        if not any(kinds):  # EMA layers only: the one-shot contribution, weighted by the batches since the last merge
            w.copy_(k)
            per = k.index_select(0, index)
            torch.mul(mean, per, out=first)
            torch.addcmul(var, mean, mean, out=second).mul_(per)
            self._pending = (self.acc_k, self.acc_a, self.acc_v, self.origin, kinds, cum)
            return
        keep = (~fresh).double()
        keep_c = keep.index_select(0, index)
        k_c, n_c, last_c = k.index_select(0, index), n.index_select(0, index), last_n.index_select(0, index)
        acc_k = self.acc_k * keep + k
        acc_a = self.acc_a * keep_c + (n_c * mean - last_c * self.last_mean * keep_c)
        acc_v = self.acc_v * keep_c + (n_c * var - last_c * self.last_var * keep_c)
        cum_c = cum.index_select(0, index)
        acc_k_c = acc_k.index_select(0, index)
        spread = torch.where(acc_k_c > 0, acc_a * acc_a / acc_k_c.clamp_min(1), torch.zeros_like(acc_a))
        origin = self.origin * torch.cat([keep, keep_c, keep_c]) if refresh else self.origin
        w.copy_(torch.where(cum, acc_k, k) + origin[:L])
        first.copy_(torch.where(cum_c, acc_a, k_c * mean) + origin[L:L + C])
        second.copy_(torch.where(cum_c, acc_v + spread, k_c * torch.addcmul(var, mean, mean)) + origin[L + C:])
        self._pending = (acc_k, acc_a, acc_v, origin, kinds, cum)

    def commit(self, written: Merged) -> None:
        """The merge was written: take up what :meth:`contribute` computed, and what the merge left."""
        assert self._pending is not None
        self.acc_k, self.acc_a, self.acc_v, self.origin, self.kinds, self.cumulative = self._pending
        self._pending = None
        self.last_n.copy_(written.counts)
        if any(self.kinds):
            _, mean, var = self.lay.read(self.last_n.device)
            self.last_mean.copy_(mean)
            self.last_var.copy_(var)

    def _slots(self) -> dict[str, list[torch.Tensor]]:
        """Per layer name, views of its state: (last_n, acc_k, origin w) and (last_mean, last_var, acc_a, acc_v,
        origin first, origin second) over its channels."""
        L, C = self.lay.layers, self.lay.width
        out, start = {}, 0
        for i, (bn, ch) in enumerate(zip(self.lay.bns, self.lay.channels)):
            a, b = start, start + ch
            out[bn.name] = [self.last_n[i:i + 1], self.acc_k[i:i + 1], self.origin[i:i + 1], self.last_mean[a:b],
                            self.last_var[a:b], self.acc_a[a:b], self.acc_v[a:b], self.origin[L + a:L + b],
                            self.origin[L + C + a:L + C + b]]
            start = b
        return out

    def by_layer(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """Each layer's state by name (copies), to carry over to a new plan."""
        return {name: tuple(t.clone() for t in views) for name, views in self._slots().items()}

    def carry(self, earlier: dict[str, tuple[torch.Tensor, ...]]) -> None:
        """Take up the state of the layers a former plan knew by these names (with as many channels); the others
        start afresh (their whole statistics count)."""
        for name, views in self._slots().items():
            old = earlier.get(name)
            if old is not None and old[3].numel() == views[3].numel():
                torch_compat.copy_all(views, list(old), False)
