"""recompute_bn_stats: exact population BatchNorm statistics over every rank's data (precise BN across ranks)."""
from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.parameter import is_lazy

from .._compat import deepspeed as ds_compat, torch as torch_compat
from .._core import (
    args as _args,
    group as _group,
    modules as _modules,
    notice as _notice,
    structure as _structure,
    transaction as _transaction,
    wire as _wire,
)
from ..errors import InvalidArgumentError, RecomputeError
from . import _global_batch as _global_bn

_FN = "recompute_bn_stats"


def recompute_bn_stats(model: nn.Module, data: Iterable[Any] | torch.Tensor | Mapping[str, Any] | Callable[[], Any],
                       *, num_batches: int | None = None, group: Any = None, progress: bool | None = None,
                       timeout: _args.Timeout = None, device: torch.device | str | None = None,
                       forward: Callable[[nn.Module, Any], Any] | None = None, global_batch: bool = False) -> int:
    """Recompute every BatchNorm's running statistics from forward passes over all ranks' data, identically on each.

    Each rank runs ``model`` in train mode under ``torch.no_grad()`` over its own batches of ``data``
    (at most ``num_batches`` of them; ranks may have different numbers, zero included, but not all
    zero). Forward pre-hooks add up, per channel and in float64, the exact count, sum and sum of squares
    of every BatchNorm layer's input; after the loop one all-reduce combines all ranks and every rank writes

        running_mean = sum x / n,   running_var = (sum x^2 - n * mean^2) / (n - 1)   (unbiased, as torch)
        num_batches_tracked = max(1, round(T / world))

    where ``T`` is the number of batches the layer saw on all ranks together: each rank holds an equal
    share, so a later :func:`average_bn_stats` (which weights ranks by their counters and sums them)
    keeps these statistics and restores the total ``T``. For a model whose first layer is BatchNorm the
    result equals the statistics of all ranks' data concatenated. Tracking ``InstanceNorm`` layers get
    torch's own definition (mean of per-instance means and of per-instance unbiased variances).
    Layers no rank reached keep their statistics. This is the pooled variance over all samples, not the
    average of per-batch variances that fvcore's / detectron2's "precise BN" computes.

    ``global_batch=True``: during the passes every BatchNorm normalises by the statistics of the batch
    of all ranks together (the normalisation ``SyncBatchNorm`` would use, on any backend and device),
    instead of by this rank's batch. The ranks step together: step ``k`` is the ``k``-th batch of every
    rank that still has one; a rank that has run out (or never had a batch) runs no forward but joins
    each layer's all-reduce with nothing, so only real batches enter the normalisation. What is written
    is then, for every BatchNorm layer, the population mean and unbiased variance over all samples of
    its input, where that input was computed with every earlier BatchNorm normalising by its step's
    global batch: right at every layer, not only the first, when the ranks' data differ. It costs one
    all-reduce per BatchNorm call (a few KiB) and one per step; forwards must call the same layers in
    the same order on every rank (a difference raises :class:`RecomputeError` everywhere). BatchNorm
    layers that track no running statistics (``track_running_stats=False``) keep normalising by this
    rank's batch, as they would in any forward.

    ``data``: an iterable of batches, a callable returning a fresh one, or one tensor or mapping (a
    single batch). A tensor is passed as ``model(x)``, a tuple or list as ``model(batch[0])``
    (``(inputs, labels)``), a mapping as ``model(**batch)`` (Hugging Face style); ``forward(model,
    batch)`` overrides this. With ``device``, tensors in each batch are moved there first.

    Wrappers: DDP, DataParallel, DeepSpeed engines, Accelerate-prepared and ``torch.compile``d models
    are unwrapped and the passes run on the inner module (DDP's forward would broadcast buffers, a
    collective that hangs when ranks have different numbers of batches). ``SyncBatchNorm`` layers
    normalise with this rank's batch during the passes (no collective; their statistics are still
    combined exactly). A ZeRO-3 partitioned model is gathered once, whole, before the passes (it needs
    the memory of the full model on every rank for the duration) and the engine's per-layer
    gather/release hooks are suspended, so no forward issues a collective: a rank whose data or
    forward fails cannot leave its peers waiting inside a forward. Any other collective in the model's
    own forward is not supported. A ``fully_shard`` (FSDP2) model is likewise unsharded once, whole (one
    all-gather per FSDP module, then no collective in any forward), and resharded afterwards; an FSDP1
    (``FullyShardedDataParallel``) model runs inside ``summon_full_params(writeback=False)`` with each unit's
    forward bypassed (its wrapped module's forward runs; FSDP1's input casts do not).

    Afterwards every module's train/eval mode is restored, momentum is never touched, every buffer
    other than the BatchNorm statistics (EMA codebooks, step counters) gets its old value back, and
    the global RNG states are restored (dropout in these passes does not shift your random stream).
    A failure on any rank (data, forward, structure, collective) raises on every rank
    (:class:`RecomputeError`, naming each failing rank and its exception, for data/forward failures)
    and leaves every buffer unchanged; so does a call in which no rank had a batch. Without a process
    group the statistics come from this process's data alone. Progress is reported on stderr by the group's
    first rank only: ``progress=None`` (the default, as everywhere in zero_buffers) reports when stderr is a
    terminal and stays silent in a log; ``True`` reports anywhere, ``False`` never. On a terminal it is a tqdm
    bar; anywhere else (a file, a pipe, a notebook) never a carriage return, but a plain line at most every 10
    seconds (``recompute_bn_stats: 120/500 batches (24%), 10 s``) and a last one (``recompute_bn_stats: 500
    batches in 41.3 s``). Returns the number of layers written.

    Example::

        loader = DataLoader(train_shard, batch_size=64)        # each rank: its own shard
        zero_buffers.recompute_bn_stats(model, loader, num_batches=200)
        if rank == 0:
            torch.save(model.state_dict(), "ckpt.pt")          # statistics of all ranks' data
    """
    _args.module(model, _FN)
    check_options(num_batches, forward)
    deadline = _wire.Deadline(_args.timeout(timeout, _FN))
    g = _group.resolve(group, _FN)
    if g is None and _group.initialized() and group is not None:
        return 0  # not a member of the group
    inner = _modules.unwrap(model, _FN)
    result = population_sums(inner, data, g, deadline, num_batches=num_batches, progress=progress, device=device,
                             forward=forward, global_batch=_args.flag(global_batch, "global_batch", _FN), outer=model)
    if result is None:
        return 0
    if g is None:
        return write(*result)
    values, failure = None, None
    try:  # the statistics are computed before the writes, and every rank votes on it ([Note: the transaction])
        _transaction.reached(_transaction.Phase.EXCHANGE, _FN)
        values = compute(*result)
    except BaseException as e:  # noqa: BLE001 - a vote
        failure = e
    _transaction.vote(g, failure, deadline, f"{_FN}()", "computing the statistics failed", "no buffer was modified",
                      error=RecomputeError)
    assert values is not None
    return apply(values)


def check_options(num_batches: Any, forward: Any) -> None:
    """InvalidArgumentError for a bad ``num_batches`` or ``forward`` (at the call)."""
    if num_batches is not None and (isinstance(num_batches, bool) or not isinstance(num_batches, int)
                                    or num_batches < 0):
        raise InvalidArgumentError(f"{_FN}(): num_batches must be None or an int >= 0, got {num_batches!r}")
    if forward is not None and not callable(forward):
        raise InvalidArgumentError(f"{_FN}(): forward must be a callable (model, batch) -> output, got {forward!r}")


Sums = tuple[list[_modules.BatchNorm], torch.Tensor, int]
"""The layers, their all-reduced [calls, n, s1, s2] per layer, and the world size: what :func:`write` needs."""


def population_sums(inner: nn.Module, data: Any, g: _group.Group | None, deadline: _wire.Deadline, *,
                    num_batches: int | None = None, progress: bool | None = None,
                    device: torch.device | str | None = None,
                    forward: Callable[[nn.Module, Any], Any] | None = None, global_batch: bool = False,
                    outer: nn.Module | None = None) -> Sums | None:
    """The passes and the all-reduce, with every buffer as it was afterwards (nothing is written); None when the model
    has no tracking BatchNorm. Raises RecomputeError on every rank when a rank failed or no rank had a batch.
    ``outer``: the model as the caller passed it (an FSDP1 root unit is summoned through it)."""
    progress = _args.progress(progress, _FN)
    bns = _modules.tracking_bn(inner)
    entries = _modules.bn_stat_entries(bns)
    zero = [p for p in inner.parameters() if ds_compat.is_zero_param(p)]
    fsdp1, fsdp2 = _modules.fsdp_kinds(outer if outer is not None else inner, _FN)
    if (fsdp1 or fsdp2) and g is not None:
        _modules.check_fsdp_group(outer if outer is not None else inner, g.ranks, _FN)
    lazy = [n for n, t in entries if is_lazy(t)]
    if g is not None:
        described = [(n, _structure.Spec(n, "uninitialised", (), "lazy") if is_lazy(t) else t) for n, t in entries]
        _structure.agree(g, (_FN, bool(zero), fsdp1, fsdp2, global_batch), described, deadline, _FN)
    if lazy:
        raise InvalidArgumentError(f"{_FN}(): lazy BatchNorm '{lazy[0]}' is not initialised yet; run one forward first")
    if g is not None:
        problem = _transaction.unsendable(g, entries, _FN)
        if problem is not None:
            raise problem
    if not bns:
        return None
    world = g.size if g is not None else 1

    saved_stats = [(t, t.detach().clone()) for _, t in entries]
    stat_ids = {id(t) for _, t in entries}
    saved_other = [(b, b.detach().clone()) for _, b in _modules.named_buffers(inner) if id(b) not in stat_ids]
    acc = _Accumulators(bns)
    failure: BaseException | None = None
    plain = [bn for bn in bns if not isinstance(bn.module, _InstanceNorm)]
    lockstep = _global_bn.Lockstep(g, plain, deadline, _FN) if global_batch and g is not None and plain else None
    try:
        with _passes(inner, bns, acc, saved_other, zero, fsdp2, outer if fsdp1 else None):
            runner = _Runner(inner, acc, forward, device)
            if lockstep is not None:
                with lockstep.patched():
                    failure = _run_in_lockstep(lockstep, runner, data, num_batches, progress and lockstep.g.me == 0)
            else:
                try:
                    _transaction.reached(_transaction.Phase.PREPARE, _FN)
                    source = _batches(data)
                    with _progress(source, num_batches, progress and (g is None or g.me == 0)) as bar:
                        runner.run_all(_limit(source, num_batches), bar)
                except BaseException as e:  # noqa: BLE001 - reported to every rank below
                    failure = e
        if failure is not None and g is None:
            raise RecomputeError(f"{_FN}() failed: {type(failure).__name__}: {failure}. No buffer was modified.",
                                 (0,)) from failure
        me = g.me if g is not None else 0
        totals = acc.pack(world, me, failure is not None)
        if g is not None:  # one all-reduce: [failed flag per member] [batches] [per layer: calls, n, s1, s2]
            totals = _wire.all_reduce(g, totals.to(g.device), deadline, _FN).cpu()
            _transaction.abort_if_any(g, [int(f) for f in totals[:world].tolist()], failure, deadline, f"{_FN}()",
                                      "the data or forward pass failed", "no buffer was modified",
                                      error=RecomputeError)
        if int(totals[world]) == 0:
            raise RecomputeError(f"{_FN}(): no rank had a batch (data was empty or exhausted); nothing to recompute, "
                                 "no buffer was modified")
        return bns, totals[world + 1:], world
    finally:
        _restore(saved_stats)  # the layers' own train-mode updates during the passes are discarded
        acc.clear()


def _run_in_lockstep(lockstep: _global_bn.Lockstep, runner: _Runner, data: Any, num_batches: int | None,
                     show: bool) -> BaseException | None:
    """global_batch: step with every rank until no rank has a batch or one failed; returns this rank's failure."""
    failure: BaseException | None = None
    batches: Iterator[Any] = iter(())
    source: Any = None
    try:
        _transaction.reached(_transaction.Phase.PREPARE, _FN)
        source = _batches(data)
        batches = _limit(source, num_batches)
    except BaseException as e:  # noqa: BLE001 - voted on below
        failure = e
    with contextlib.ExitStack() as stack:
        bar = None
        try:  # a bar that cannot be drawn is this rank's failure, voted on like any other
            bar = stack.enter_context(_progress(source, num_batches, show and failure is None))
        except BaseException as e:  # noqa: BLE001 - voted on below
            failure = failure or e
        while True:
            batch, has = None, False
            if failure is None:
                try:
                    batch, has = next(batches), True
                except StopIteration:
                    pass
                except BaseException as e:  # noqa: BLE001 - voted on below
                    failure = e
            some_failed, some_batch = lockstep.vote(has, failure is not None)
            if some_failed or not some_batch:
                return failure
            error = lockstep.step(functools.partial(runner.run, batch) if has else None)
            failure = failure or error
            if bar is not None and has:
                bar.update(1)


def _batches(data: Any) -> Iterable[Any]:
    """The batches: ``data`` itself, a fresh iterable from a callable, or a lone tensor / mapping as one batch."""
    if callable(data) and not isinstance(data, (torch.Tensor, Mapping)) and not hasattr(data, "__iter__"):
        data = data()
    if isinstance(data, (torch.Tensor, Mapping)):
        return (data,)
    return data


class _Accumulators:
    """Per-layer float64 sums fed by forward pre-hooks, and the number of batches run."""

    def __init__(self, bns: list[_modules.BatchNorm]):
        self.layers = bns
        self.clear()

    def clear(self) -> None:
        self.batches = 0
        self.calls = [0] * len(self.layers)
        self.n = [0.0] * len(self.layers)
        self.s1: list[torch.Tensor] = [torch.zeros(bn.mean.numel(), dtype=torch.float64) for bn in self.layers]
        self.s2: list[torch.Tensor] = [torch.zeros(bn.mean.numel(), dtype=torch.float64) for bn in self.layers]

    def hook(self, i: int) -> Callable[[nn.Module, tuple], None]:
        """The forward pre-hook of layer ``i``."""
        def pre_hook(module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], torch.Tensor):
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
        self.s1[i] = self.s1[i].to(s1.device) + s1
        self.s2[i] = self.s2[i].to(s2.device) + s2

    def pack(self, world: int, me: int, failed: bool) -> torch.Tensor:
        """[failed flag per member] [batches] + per layer [calls, n, s1 (C), s2 (C)], float64 on CPU (the sums are
        concatenated where they are and copied to the host once)."""
        head = torch.zeros(world + 1, dtype=torch.float64)
        head[me] = float(failed)
        head[world] = 0 if failed else self.batches
        counts = torch.tensor([[c, n] for c, n in zip(self.calls, self.n)], dtype=torch.float64).reshape(-1, 2)
        sums = [torch.cat([s1, s2]) for s1, s2 in zip(self.s1, self.s2)]
        device = sums[0].device if sums else torch.device("cpu")
        layers = torch.cat([torch.cat([c.to(device), s.to(device)]) for c, s in zip(counts, sums)]).cpu() if sums \
            else torch.zeros(0, dtype=torch.float64)
        return torch.cat([head, torch.zeros_like(layers) if failed else layers])


def _local_sync_bn_forward(self: nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
    """SyncBatchNorm's train-mode forward with this rank's batch statistics only (no collective)."""
    self._check_input_dim(input)
    return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)


@contextlib.contextmanager
def _passes(inner: nn.Module, bns: list[_modules.BatchNorm], acc: _Accumulators,
            saved_other: list[tuple[torch.Tensor, torch.Tensor]], zero: Sequence[torch.Tensor],
            fsdp2: bool, fsdp1_root: nn.Module | None) -> Iterator[None]:
    """Train mode, hooks, local SyncBatchNorm, a forked RNG and the whole model gathered (ZeRO-3: the engine's
    gather/release hooks suspended; FSDP2: every module unsharded and kept so; FSDP1: every unit's full parameters,
    its forward bypassed), for the passes; everything put back on exit."""
    modes = [(m, m.training) for m in inner.modules()]
    handles = [bn.module.register_forward_pre_hook(acc.hook(i)) for i, bn in enumerate(bns)]
    patched: list[tuple[nn.Module, Any]] = []
    for bn in bns:
        if isinstance(bn.module, nn.SyncBatchNorm):
            patched.append((bn.module, bn.module.__dict__.get("forward")))
            bn.module.__dict__["forward"] = types.MethodType(_local_sync_bn_forward, bn.module)
    cuda = sorted({t.device.index or 0 for t in [*inner.parameters(), *inner.buffers()] if t.device.type == "cuda"})
    gathered = ds_compat.Gather(zero) if zero else contextlib.nullcontext()
    suspended = ds_compat.zero3_hooks_suspended(inner) if zero else contextlib.nullcontext()
    unsharded = torch_compat.fsdp2_unsharded(inner) if fsdp2 else \
        torch_compat.fsdp1_unsharded(fsdp1_root) if fsdp1_root is not None else contextlib.nullcontext()
    try:
        with gathered, suspended, unsharded, torch.random.fork_rng(devices=cuda), torch.no_grad():
            inner.train()
            yield
    finally:
        for h in handles:
            h.remove()
        for m, old in patched:
            if old is None:
                del m.__dict__["forward"]
            else:
                m.__dict__["forward"] = old
        for m, training in modes:
            m.training = training
        _restore(saved_other)


def _restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy saved values back into their tensors."""
    with torch.no_grad():
        for t, old in saved:
            t.copy_(old)


def _limit(data: Iterable[Any], num_batches: int | None) -> Iterator[Any]:
    """At most ``num_batches`` of ``data``."""
    if num_batches == 0:
        return
    for i, batch in enumerate(data):
        yield batch
        if num_batches is not None and i + 1 >= num_batches:
            return


@contextlib.contextmanager
def _progress(data: Any, num_batches: int | None, show: bool) -> Iterator[Any]:
    """The progress report on the showing rank, else None: a tqdm bar when stderr is a terminal, plain lines (at
    most one per ``_core/notice.py``'s ``LINE_SECONDS``, and a last one) anywhere else."""
    if not show:
        yield None
        return
    total = 1 if isinstance(data, (torch.Tensor, Mapping)) else None
    if total is None:
        try:
            total = len(data)
        except TypeError:
            total = None
    if num_batches is not None:
        total = num_batches if total is None else min(total, num_batches)
    with _notice.bar(_FN, total, "batch", True) as bar:
        yield bar


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
    """Runs the forward passes over one rank's batches (no collective: ZeRO-3 models are gathered beforehand)."""

    def __init__(self, inner: nn.Module, acc: _Accumulators, forward: Callable[[nn.Module, Any], Any] | None,
                 device: torch.device | str | None):
        self.inner, self.acc, self.forward = inner, acc, forward
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
        self.acc.batches += 1

    def run_all(self, batches: Iterator[Any], bar: Any) -> None:
        for batch in batches:
            self.run(batch)
            if bar is not None:
                bar.update(1)


class Recomputed(NamedTuple):
    """What :func:`compute` prepared and :func:`apply` copies: the layers written, (destination, value) pairs."""

    layers: int
    pairs: list[tuple[torch.Tensor, torch.Tensor]]


def compute(bns: list[_modules.BatchNorm], sums: torch.Tensor, world: int) -> Recomputed:
    """The population statistics from the all-reduced sums (identical on every rank), each already in its
    destination's dtype and device; nothing is written. Layers no rank reached keep their statistics."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    offset, layers = 0, 0
    with torch.no_grad():
        for bn in bns:
            c = bn.mean.numel()
            calls, n = float(sums[offset]), float(sums[offset + 1])
            s1, s2 = sums[offset + 2:offset + 2 + c], sums[offset + 2 + c:offset + 2 + 2 * c]
            offset += 2 + 2 * c
            instance = isinstance(bn.module, _InstanceNorm)
            if n < 1 or (n < 2 and not instance):
                continue  # no rank reached this layer: it keeps its statistics
            if instance:
                mean, var = s1 / n, s2 / n
            else:
                mean = s1 / n
                var = ((s2 - n * mean * mean) / (n - 1)).clamp_min(0)
            out += [(bn.mean, mean.to(bn.mean.device, bn.mean.dtype)), (bn.var, var.to(bn.var.device, bn.var.dtype))]
            if bn.count is not None:
                out.append((bn.count, torch.full_like(bn.count, max(1, round(calls / world)))))
            layers += 1
    return Recomputed(layers, out)


def apply(values: Recomputed) -> int:
    """Copy what :func:`compute` prepared; returns the number of layers written."""
    if values.pairs:
        torch_compat.copy_all([d for d, _ in values.pairs], [v for _, v in values.pairs])
    return values.layers


def write(bns: list[_modules.BatchNorm], sums: torch.Tensor, world: int) -> int:
    """Write population statistics (identical on every rank: computed from the same all-reduced sums)."""
    return apply(compute(bns, sums, world))
