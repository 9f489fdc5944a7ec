"""recompute_bn_stats: exact population BatchNorm statistics over every rank's data (precise BN across ranks)."""
from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.parameter import is_lazy

from . import _bn, _dist
from .errors import CollectiveError, InvalidArgumentError, RecomputeError

_FN = "recompute_bn_stats"


def recompute_bn_stats(model: nn.Module, data: Iterable[Any] | torch.Tensor | Mapping[str, Any], *,
                       num_batches: int | None = None, group: Any = None, progress: bool = True,
                       timeout: _dist.Timeout = None, device: torch.device | str | None = None,
                       forward: Callable[[nn.Module, Any], Any] | None = None) -> int:
    """Recompute every BatchNorm's running statistics from forward passes over all ranks' data, identically on each.

    Each rank runs ``model`` in train mode under ``torch.no_grad()`` over its own batches of ``data``
    (at most ``num_batches`` of them; ranks may have different numbers, zero included). Forward
    pre-hooks add up, per channel and in float64, the exact count, sum and sum of squares of every
    BatchNorm layer's input; after the loop one all-reduce combines all ranks and every rank writes

        running_mean = sum x / n,   running_var = (sum x^2 - n * mean^2) / (n - 1)   (unbiased, as torch)
        num_batches_tracked = max(1, round(T / world))

    where ``T`` is the number of batches the layer saw on all ranks together: each rank holds an equal
    share, so a later :func:`average_bn_stats` (which weights ranks by their counters and sums them)
    keeps these statistics and restores the total ``T``. For a model whose first layer is BatchNorm the
    result equals the statistics of all ranks' data concatenated. Tracking ``InstanceNorm`` layers get
    torch's own definition (mean of per-instance means and of per-instance unbiased variances).
    Layers no rank reached keep their statistics.

    Batches: a tensor is passed as ``model(x)``, a tuple or list as ``model(batch[0])`` (``(inputs,
    labels)``), a mapping as ``model(**batch)`` (Hugging Face style); ``forward(model, batch)``
    overrides this. ``data`` itself may be one tensor or mapping (a single batch). With ``device``,
    tensors in each batch are moved there first.

    Wrappers: DDP, DataParallel, DeepSpeed engines, Accelerate-prepared and ``torch.compile``d models
    are unwrapped and the passes run on the inner module (DDP's forward would broadcast buffers, a
    collective that hangs when ranks have different numbers of batches). ``SyncBatchNorm`` layers
    normalise with this rank's batch during the passes (no collective; their statistics are still
    combined exactly). ZeRO-3 partitioned models gather parameters inside every forward, so there the
    ranks step together: one small all-reduce per step, and a rank that ran out of batches replays its
    last one without counting it (every rank then needs at least one batch). Any other collective in
    the model's own forward is not supported.

    Afterwards every module's train/eval mode is restored, momentum is never touched, every buffer
    other than the BatchNorm statistics (EMA codebooks, step counters) gets its old value back, and
    the global RNG states are restored (dropout in these passes does not shift your random stream).
    A failure on any rank (data, forward, structure, collective) raises on every rank
    (:class:`RecomputeError` for data/forward failures) and leaves every buffer unchanged. Without a
    process group the statistics come from this process's data alone. A progress bar (tqdm) is shown
    on the group's first rank when ``progress``. Returns the number of layers written.

    Example::

        loader = DataLoader(train_shard, batch_size=64)        # each rank: its own shard
        zero_buffers.recompute_bn_stats(model, loader, num_batches=200)
        if rank == 0:
            torch.save(model.state_dict(), "ckpt.pt")          # statistics of all ranks' data
    """
    _dist.check_module(model, _FN)
    if num_batches is not None and (isinstance(num_batches, bool) or not isinstance(num_batches, int)
                                    or num_batches < 0):
        raise InvalidArgumentError(f"{_FN}(): num_batches must be None or an int >= 0, got {num_batches!r}")
    if forward is not None and not callable(forward):
        raise InvalidArgumentError(f"{_FN}(): forward must be a callable (model, batch) -> output, got {forward!r}")
    timeout = _dist.check_timeout(timeout, _FN)
    if not _dist.is_member(group):
        return 0
    inner = _dist.unwrap(model, _FN)
    g = _dist.resolve_group(group)
    bns = _bn.tracking_bn_modules(inner)
    lockstep = g is not None and any(hasattr(p, "ds_id") for p in inner.parameters())
    entries = _bn.stat_entries(bns)
    if g is not None:
        described = [(n, "uninitialised lazy buffer" if is_lazy(t) else t) for n, t in entries]
        _dist.agree_on_structure(g, (_FN, lockstep), described, timeout, _FN)
    lazy = [n for n, t in entries if is_lazy(t)]
    if lazy:
        raise InvalidArgumentError(f"{_FN}(): lazy BatchNorm '{lazy[0]}' is not initialised yet; run one forward first")
    if not bns:
        return 0
    _dist.reject_unsupported(entries, _FN)
    if g is not None:
        _dist.check_backend_devices(g, entries, _FN)
    world = g.size if g is not None else 1

    saved_stats = [(t, t.detach().clone()) for _, t in entries]
    stat_ids = {id(t) for _, t in entries}
    saved_other = [(b, b.detach().clone()) for _, b in _dist.named_buffers(inner) if id(b) not in stat_ids]
    acc = _Accumulators(bns)
    failure: BaseException | None = None
    try:
        with _passes(inner, bns, acc, saved_other):
            runner = _Runner(inner, acc, forward, device, g, timeout)
            batches = _limit(data, num_batches)
            with _progress(data, num_batches, progress and (g is None or g.rank == g.ranks[0])) as bar:
                try:
                    if lockstep:
                        runner.lockstep(batches, bar)
                    else:
                        runner.independent(batches, bar)
                except Exception as e:  # noqa: BLE001 - reported to every rank below
                    failure = e
        if failure is not None and g is None:
            raise RecomputeError(f"{_FN}() failed: {type(failure).__name__}: {failure}. No buffer was modified.",
                                 (0,)) from failure
        totals = acc.pack(world, g.rank if g is not None else 0, g.ranks if g is not None else (0,),
                          failure is not None)
        if g is not None:
            totals = _dist.all_reduce_sum(g, totals.to(g.device), timeout, _FN).cpu()
        _raise_failures(g, totals[:world], failure, timeout)
        _restore(saved_stats)  # the layers' own train-mode updates during the passes are discarded
        return _write(bns, totals[world:], world)
    except BaseException:
        _restore(saved_stats)
        raise
    finally:
        acc.clear()


class _Accumulators:
    """Per-layer float64 sums fed by forward pre-hooks; ``enabled`` switches counting off for replayed batches."""

    def __init__(self, bns: list[tuple[str, _NormBase]]):
        self.layers = [m for _, m in bns]
        self.enabled = True
        self.clear()

    def clear(self) -> None:
        self.calls = [0] * len(self.layers)
        self.n = [0.0] * len(self.layers)
        self.s1: list[torch.Tensor | None] = [None] * len(self.layers)
        self.s2: list[torch.Tensor | None] = [None] * len(self.layers)

    def hook(self, i: int) -> Callable[[nn.Module, tuple], None]:
        """The forward pre-hook of layer ``i``."""
        def pre_hook(module: nn.Module, args: tuple) -> None:
            if self.enabled and args and isinstance(args[0], torch.Tensor):
                self.add(i, module, args[0])
        return pre_hook

    def add(self, i: int, module: nn.Module, x: torch.Tensor) -> None:
        """Add one input batch of layer ``i``."""
        x = x.detach().to(torch.float64)
        if isinstance(module, _InstanceNorm):
            if x.dim() == module._get_no_batch_dim():
                x = x.unsqueeze(0)
            flat = x.flatten(2)  # (N, C, L): per-instance statistics, as F.instance_norm tracks them
            n, s1, s2 = flat.shape[0], flat.mean(2).sum(0), flat.var(2, unbiased=True).sum(0)
        else:
            dims = [0, *range(2, x.dim())]
            n = x.numel() // max(x.shape[1], 1)
            s1, s2 = x.sum(dims), (x * x).sum(dims)
        self.calls[i] += 1
        self.n[i] += n
        self.s1[i] = s1 if self.s1[i] is None else self.s1[i] + s1
        self.s2[i] = s2 if self.s2[i] is None else self.s2[i] + s2

    def pack(self, world: int, rank: int, ranks: tuple[int, ...], failed: bool) -> torch.Tensor:
        """[failed flag per rank] + per layer [calls, n, s1 (C), s2 (C)], float64 on CPU."""
        parts = [torch.zeros(world, dtype=torch.float64)]
        if failed:
            parts[0][ranks.index(rank)] = 1.0
        for i, m in enumerate(self.layers):
            c = m.running_mean.numel()
            ok = not failed and self.s1[i] is not None
            parts.append(torch.tensor([self.calls[i] if ok else 0, self.n[i] if ok else 0], dtype=torch.float64))
            parts.append(self.s1[i].cpu() if ok else torch.zeros(c, dtype=torch.float64))
            parts.append(self.s2[i].cpu() if ok else torch.zeros(c, dtype=torch.float64))
        return torch.cat(parts)


def _local_sync_bn_forward(self: nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
    """SyncBatchNorm's train-mode forward with this rank's batch statistics only (no collective)."""
    self._check_input_dim(input)
    return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)


@contextlib.contextmanager
def _passes(inner: nn.Module, bns: list[tuple[str, _NormBase]], acc: _Accumulators,
            saved_other: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Train mode, hooks, local SyncBatchNorm and a forked RNG for the passes; everything put back on exit."""
    modes = [(m, m.training) for m in inner.modules()]
    handles = [m.register_forward_pre_hook(acc.hook(i)) for i, (_, m) in enumerate(bns)]
    patched = []
    for _, m in bns:
        if isinstance(m, nn.SyncBatchNorm):
            patched.append((m, m.__dict__.get("forward")))
            m.forward = types.MethodType(_local_sync_bn_forward, m)
    cuda = sorted({t.device.index or 0 for t in [*inner.parameters(), *inner.buffers()] if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            inner.train()
            yield
    finally:
        for h in handles:
            h.remove()
        for m, old in patched:
            if old is None:
                del m.forward
            else:
                m.forward = old
        for m, training in modes:
            m.training = training
        _restore(saved_other)


def _restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy saved values back into their tensors."""
    with torch.no_grad():
        for t, old in saved:
            t.copy_(old)


def _limit(data: Any, num_batches: int | None) -> Iterator[Any]:
    """The batches of ``data`` (a lone tensor or mapping is one batch), at most ``num_batches``."""
    if isinstance(data, (torch.Tensor, Mapping)):
        data = (data,)
    if num_batches == 0:
        return
    for i, batch in enumerate(data):
        yield batch
        if num_batches is not None and i + 1 >= num_batches:
            return


@contextlib.contextmanager
def _progress(data: Any, num_batches: int | None, show: bool) -> Iterator[Any]:
    """A tqdm bar on the showing rank, else None."""
    if not show:
        yield None
        return
    from tqdm.auto import tqdm

    total = 1 if isinstance(data, (torch.Tensor, Mapping)) else None
    if total is None:
        try:
            total = len(data)
        except TypeError:
            total = None
    if num_batches is not None:
        total = num_batches if total is None else min(total, num_batches)
    bar = tqdm(total=total, desc=_FN, unit="batch", leave=False)
    try:
        yield bar
    finally:
        bar.close()


def _to(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [_to(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


class _Runner:
    """Runs the forward passes, independently per rank or (ZeRO-3) in lockstep."""

    def __init__(self, inner: nn.Module, acc: _Accumulators, forward: Callable[[nn.Module, Any], Any] | None,
                 device: torch.device | str | None, g: _dist.Group | None, timeout: _dist.Timeout):
        self.inner, self.acc, self.forward, self.g, self.timeout = inner, acc, forward, g, timeout
        self.device = torch.device(device) if device is not None else None

    def run(self, batch: Any) -> None:
        """One forward pass."""
        if self.device is not None:
            batch = _to(batch, self.device)
        if self.forward is not None:
            self.forward(self.inner, batch)
        elif isinstance(batch, torch.Tensor):
            self.inner(batch)
        elif isinstance(batch, (list, tuple)) and batch:
            self.inner(batch[0])
        elif isinstance(batch, Mapping):
            self.inner(**batch)
        else:
            raise InvalidArgumentError(
                f"{_FN}(): cannot feed a batch of type {type(batch).__name__} to the model; pass a tensor, a "
                "(inputs, ...) tuple, a mapping of keyword arguments, or forward=lambda model, batch: ...")

    def independent(self, batches: Iterator[Any], bar: Any) -> None:
        """Every rank loops over its own batches; no collective inside the loop."""
        for batch in batches:
            self.run(batch)
            if bar is not None:
                bar.update(1)

    def lockstep(self, batches: Iterator[Any], bar: Any) -> None:
        """Ranks step together (ZeRO-3 gathers parameters in every forward); spent ranks replay without counting."""
        # Before each step one all-reduce of [has a batch, failed reading, never had a batch] tells every rank
        # whether to go on; a rank whose data failed re-raises and reports in the final all-reduce.
        g = self.g
        last = None
        while True:
            batch, has, error = None, 0, None
            try:
                batch, has = next(batches), 1
            except StopIteration:
                pass
            except Exception as e:  # noqa: BLE001 - re-raised after the peers were told
                error = e
            empty = int(not has and error is None and last is None)
            flags = torch.tensor([has, int(error is not None), empty], dtype=torch.int64, device=g.device)
            anyone, failures, empties = (int(v) for v in _dist.all_reduce_sum(g, flags, self.timeout, _FN).cpu())
            if error is not None:
                raise error
            if failures or not anyone:
                return
            if empties:
                if empty:
                    raise InvalidArgumentError(
                        "this rank has no batch, but the model is partitioned by ZeRO-3 and every forward gathers "
                        "parameters from all ranks: each rank needs at least one batch")
                return
            if has:
                self.run(batch)
                last = batch
                if bar is not None:
                    bar.update(1)
            else:
                self.acc.enabled = False
                try:
                    self.run(last)
                finally:
                    self.acc.enabled = True


def _raise_failures(g: _dist.Group | None, flags: torch.Tensor, failure: BaseException | None,
                    timeout: _dist.Timeout) -> None:
    """Raise the same RecomputeError on every rank when any rank's passes failed."""
    if g is None or not bool((flags > 0).any()):
        return
    failed = tuple(r for r, f in zip(g.ranks, flags.tolist()) if f > 0)
    mine = f"{type(failure).__name__}: {failure}" if failure is not None else None
    try:  # the messages are a courtesy: a peer that dies or stalls here (past timeout) leaves them out
        messages: list[Any] = _dist.gather_objects(g, mine, timeout, _FN)
    except CollectiveError:
        messages = [None] * g.size
    reasons = "; ".join(f"rank {r}: {m}" for r, m in zip(g.ranks, messages) if m is not None and r in failed)
    who = ("rank " if len(failed) == 1 else "ranks ") + ", ".join(map(str, failed))
    err = RecomputeError(f"{_FN}() failed on {who} ({reasons or 'no message'}). No buffer was modified.", failed)
    raise err from failure


def _write(bns: list[tuple[str, _NormBase]], sums: torch.Tensor, world: int) -> int:
    """Write population statistics (identical on every rank: computed from the same all-reduced sums)."""
    written, offset = 0, 0
    with torch.no_grad():
        for i, (_, m) in enumerate(bns):
            c = m.running_mean.numel()
            calls, n = float(sums[offset]), float(sums[offset + 1])
            s1, s2 = sums[offset + 2:offset + 2 + c], sums[offset + 2 + c:offset + 2 + 2 * c]
            offset += 2 + 2 * c
            if n < 1 or (n < 2 and not isinstance(m, _InstanceNorm)):
                continue  # no rank reached this layer: it keeps its statistics
            if isinstance(m, _InstanceNorm):
                mean, var = s1 / n, s2 / n
            else:
                mean = s1 / n
                var = ((s2 - n * mean * mean) / (n - 1)).clamp_min(0)
            m.running_mean.copy_(mean.to(m.running_mean.device, m.running_mean.dtype))
            m.running_var.copy_(var.to(m.running_var.device, m.running_var.dtype))
            if m.num_batches_tracked is not None:
                m.num_batches_tracked.fill_(max(1, round(calls / world)))
            written += 1
    return written

