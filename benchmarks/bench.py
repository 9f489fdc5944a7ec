"""Side-by-side benchmarks of zero_buffers against the alternatives, on N local ranks.

    python benchmarks/bench.py                 # world sizes 2 and 4, writes benchmarks/results/
    python benchmarks/bench.py --quick         # tiny sizes, few repeats: checks every output, claims nothing
    python benchmarks/bench.py --world 2 --only broadcast scaling

Every number is the median over repeats of the slowest rank's wall time for one call (ranks start
each call together after a barrier); the methods compared take turns call by call, so drift on a
shared machine hits them alike. gloo on CPU by default, nccl when there is one GPU per rank.
Writes ``results.json``, ``results.md`` and ``scaling.png`` into the output folder.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

SECTIONS = ("broadcast", "check", "frozen", "bn", "scaling", "report_diff", "memory", "frozen_real", "recompute_modes",
            "fsdp2", "keep_in_sync")


# --------------------------------------------------------------------------------------------------
# buffer sets of real architectures (only the buffer-carrying layers are built)
# --------------------------------------------------------------------------------------------------
def resnet_bn_net(blocks: tuple[int, ...]) -> nn.Module:
    """The BatchNorm layers of a torchvision-style bottleneck ResNet (3 buffers each)."""
    bns: list[nn.Module] = [nn.BatchNorm2d(64)]
    for stage, n in enumerate(blocks):
        width = 64 * 2 ** stage
        for b in range(n):
            bns += [nn.BatchNorm2d(width), nn.BatchNorm2d(width), nn.BatchNorm2d(width * 4)]
            if b == 0:
                bns.append(nn.BatchNorm2d(width * 4))  # downsample branch
    return nn.Sequential(*bns)


class ViTBuffers(nn.Module):
    """A ViT-like buffer set: non-persistent rotary tables, position ids, attention masks, a few BN-free blocks."""

    def __init__(self, depth: int = 12, dim: int = 768, tokens: int = 197):
        super().__init__()
        self.register_buffer("position_ids", torch.arange(tokens).unsqueeze(0), persistent=False)
        for i in range(depth):
            block = nn.Module()
            block.register_buffer("inv_freq", torch.rand(dim // 24), persistent=False)
            block.register_buffer("rope_cos", torch.rand(tokens, dim // 12), persistent=False)
            block.register_buffer("rope_sin", torch.rand(tokens, dim // 12), persistent=False)
            block.register_buffer("attn_mask", torch.ones(tokens, tokens, dtype=torch.bool), persistent=False)
            self.add_module(f"block{i}", block)


def buffer_sets(quick: bool) -> dict[str, Callable[[], nn.Module]]:
    """Name -> builder of each buffer set measured."""
    if quick:
        return {"resnet50_bn": lambda: resnet_bn_net((1, 1, 1, 1)), "vit_nonpersistent": lambda: ViTBuffers(2, 96, 17),
                "resnet50_bn_bf16": lambda: resnet_bn_net((1, 1, 1, 1)).to(torch.bfloat16)}
    return {"resnet50_bn": lambda: resnet_bn_net((3, 4, 6, 3)), "resnet101_bn": lambda: resnet_bn_net((3, 4, 23, 3)),
            "vit_nonpersistent": lambda: ViTBuffers(), "resnet50_bn_bf16": lambda: resnet_bn_net((3, 4, 6, 3)).to(
                torch.bfloat16)}


def many_buffers(n: int) -> nn.Module:
    """``n`` float buffers of 64..1024 elements (the scaling sweep)."""
    m = nn.Module()
    for i in range(n):
        m.register_buffer(f"b{i}", torch.rand(64 * (1 + i % 16)))
    return m


# --------------------------------------------------------------------------------------------------
# the alternatives
# --------------------------------------------------------------------------------------------------
def torch_broadcast_coalesced(tensors: list[torch.Tensor], src: int) -> None:
    """What DDP/FSDP use (private torch API, wrapped here with a public fallback)."""
    fn = getattr(dist, "_broadcast_coalesced", None)
    if fn is not None:
        fn(dist.group.WORLD, tensors, 250 * 1024 * 1024, src)
        return
    for dtype in dict.fromkeys(t.dtype for t in tensors):  # fallback: one flat broadcast per dtype
        ts = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.broadcast(flat, src)
        for t, v in zip(ts, torch._utils._unflatten_dense_tensors(flat, ts)):
            t.copy_(v)


def per_buffer_loop(tensors: list[torch.Tensor], src: int) -> None:
    """The usual hand fix: one dist.broadcast per buffer."""
    for t in tensors:
        dist.broadcast(t, src)


def raw_flat(flats: list[torch.Tensor], src: int) -> None:
    """The floor: the same bytes, already flat, one broadcast per dtype, nothing copied."""
    for f in flats:
        dist.broadcast(f, src)


def timm_distribute_bn(model: nn.Module, world: int) -> None:
    """timm.utils.distribute_bn(reduce=True): one all_reduce per running stat tensor, naive average."""
    for name, buf in model.named_buffers():
        if "running_mean" in name or "running_var" in name:
            dist.all_reduce(buf)
            buf /= world


# --------------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------------
def _once(fn: Callable[[], Any], device: torch.device) -> float:
    """The slowest rank's seconds for one ``fn()`` call, all ranks starting together."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def timed_together(fns: dict[str, Callable[[], Any]], repeats: int, device: torch.device) -> dict[str, float]:
    """Median over ``repeats`` of each method's slowest-rank seconds; the methods take turns call by call, so
    drift on a shared machine hits every method alike and their ratios are measured side by side."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeats + 2):  # two warm-up rounds
        for name, fn in fns.items():
            t = _once(fn, device)
            if i >= 2:
                times[name].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def scrambled(builder: Callable[[], nn.Module], rank: int, device: torch.device) -> nn.Module:
    """A fresh module with rank-specific buffer values (so every broadcast really moves data)."""
    m = builder().to(device)
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for b in m.buffers():
            if b.is_floating_point():
                b.copy_(torch.rand(b.shape, generator=g).to(b.dtype))
            elif b.dtype == torch.bool:
                b.copy_(torch.rand(b.shape, generator=g) > 0.5)
            else:
                b.copy_(torch.randint(0, 100, b.shape, generator=g))
    return m


def check_equal_to_src(model: nn.Module) -> None:
    """Every buffer equals rank 0's (verifies each method really synchronised)."""
    import zero_buffers as zb

    report = zb.buffer_report(model)
    if not report.in_sync:
        raise AssertionError(f"not in sync after broadcast:\n{report.format(only_out_of_sync=True, limit=5)}")


def bench_broadcast(ctx: dict) -> list[dict]:
    """Section 1: buffer broadcast on architectures' buffer sets, four ways."""
    import zero_buffers as zb

    rank, dev, reps = ctx["rank"], ctx["device"], ctx["repeats"]
    rows = []
    for name, builder in buffer_sets(ctx["quick"]).items():
        model = scrambled(builder, rank, dev)
        tensors = [b for b in model.buffers()]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        flats = [torch.cat([t.reshape(-1) for t in tensors if t.dtype == d])
                 for d in dict.fromkeys(t.dtype for t in tensors)]
        res = {"set": name, "buffers": len(tensors), "bytes": nbytes}
        methods = {"per_buffer_loop": lambda: per_buffer_loop(tensors, 0),
                   "torch_broadcast_coalesced": lambda: torch_broadcast_coalesced(tensors, 0),
                   "zero_buffers.broadcast_buffers": lambda: zb.broadcast_buffers(model, 0),
                   "raw_flat_broadcast": lambda: raw_flat(flats, 0)}
        for method, fn in methods.items():
            if method != "raw_flat_broadcast":
                fresh = scrambled(builder, rank, dev)  # correctness: each method on rank-specific values
                with torch.no_grad():
                    for t, v in zip(tensors, fresh.buffers()):
                        t.copy_(v)
                fn()
                check_equal_to_src(model)
        res.update(timed_together(methods, reps, dev))
        res["speedup_vs_loop"] = res["per_buffer_loop"] / res["zero_buffers.broadcast_buffers"]
        res["ratio_vs_raw"] = res["zero_buffers.broadcast_buffers"] / res["raw_flat_broadcast"]
        res["ratio_vs_torch_coalesced"] = res["zero_buffers.broadcast_buffers"] / res["torch_broadcast_coalesced"]
        res["MB_per_s_ours"] = nbytes / res["zero_buffers.broadcast_buffers"] / 1e6
        res["MB_per_s_raw"] = nbytes / res["raw_flat_broadcast"] / 1e6
        rows.append(res)
        ctx["log"](f"broadcast {name}: {len(tensors)} buffers, {nbytes / 1e6:.2f} MB, "
                   f"loop/ours {res['speedup_vs_loop']:.1f}x, ours/raw {res['ratio_vs_raw']:.2f}x")
    return rows


def bench_check(ctx: dict) -> list[dict]:
    """Section 2: buffer_report when everything agrees, against one broadcast of the same buffers."""
    import zero_buffers as zb

    rows = []
    for name, builder in buffer_sets(ctx["quick"]).items():
        torch.manual_seed(0)
        model = builder().to(ctx["device"])  # identical on every rank
        report = zb.buffer_report(model)
        if not report.in_sync:
            raise AssertionError(f"{name}: identical buffers reported out of sync")
        t = timed_together({"report": lambda: zb.buffer_report(model), "bcast": lambda: zb.broadcast_buffers(model)},
                           ctx["repeats"], ctx["device"])
        t_report, t_bcast = t["report"], t["bcast"]
        rows.append({"set": name, "buffer_report": t_report, "broadcast_buffers": t_bcast,
                     "report_over_broadcast": t_report / t_bcast})
        ctx["log"](f"check {name}: report/broadcast {t_report / t_bcast:.2f}")
    return rows


def bench_frozen(ctx: dict) -> list[dict]:
    """Section 3: per-call forward of a frozen module: GatheredParameters around ZeRO-3 vs frozen_replica vs plain."""
    import deepspeed

    import zero_buffers as zb

    if ctx["device"].type == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    width = 8 if ctx["quick"] else 32

    def tokenizer() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv3d(3, width, 3, padding=1), nn.BatchNorm3d(width), nn.ReLU(),
                             nn.Conv3d(width, width, 3, padding=1, stride=2), nn.BatchNorm3d(width)).eval()

    with deepspeed.zero.Init(config_dict_or_path=cfg):
        partitioned = tokenizer()
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        replica = zb.frozen_replica(tokenizer())
    plain = tokenizer().to(ctx["device"])
    params = list(partitioned.parameters())

    def gathered(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return partitioned(x)

    rows = []
    for size in ((8, 32) if not ctx["quick"] else (4, 8)):
        x = torch.randn(1, 3, 4, size, size, device=ctx["device"])
        with torch.no_grad():
            want = plain(x)
        for out in (gathered(x), replica(x)):
            torch.testing.assert_close(out, want)
        r = {"input": f"1x3x4x{size}x{size}"}
        def plain_no_grad(x: torch.Tensor = x) -> torch.Tensor:
            with torch.no_grad():
                return plain(x)

        r.update(timed_together({"GatheredParameters": lambda: gathered(x), "frozen_replica": lambda: replica(x),
                                 "plain": plain_no_grad}, ctx["repeats"], ctx["device"]))
        r["frozen_over_plain"] = r["frozen_replica"] / r["plain"]
        r["gathered_over_frozen"] = r["GatheredParameters"] / r["frozen_replica"]
        rows.append(r)
        ctx["log"](f"frozen {r['input']}: gathered/frozen {r['gathered_over_frozen']:.1f}x, "
                   f"frozen/plain {r['frozen_over_plain']:.2f}x")
    return rows


def bench_bn(ctx: dict) -> list[dict]:
    """Section 4: average_bn_stats vs a timm-style per-tensor all-reduce loop; recompute_bn_stats throughput."""
    import zero_buffers as zb

    rows = []
    blocks = (1, 1, 1, 1) if ctx["quick"] else (3, 4, 23, 3)
    model = scrambled(lambda: resnet_bn_net(blocks), ctx["rank"], ctx["device"])
    snapshot = [b.clone() for b in model.buffers()]

    def reset() -> None:
        with torch.no_grad():
            for b, s in zip(model.buffers(), snapshot):
                b.copy_(s)

    def ours() -> None:
        reset()
        zb.average_bn_stats(model)

    def timm() -> None:
        reset()
        timm_distribute_bn(model, ctx["world"])

    t = timed_together({"ours": ours, "timm": timm, "reset": reset}, ctx["repeats"], ctx["device"])
    t_ours, t_timm, t_reset = t["ours"], t["timm"], t["reset"]
    rows.append({"what": "merge BN stats (ResNet-101 BN set)" if not ctx["quick"] else "merge BN stats",
                 "zero_buffers.average_bn_stats": t_ours - t_reset, "timm_style_loop": t_timm - t_reset,
                 "speedup": (t_timm - t_reset) / max(t_ours - t_reset, 1e-9)})
    ctx["log"](f"bn merge: timm-loop/ours {rows[-1]['speedup']:.1f}x")

    recompute = getattr(zb, "recompute_bn_stats", None)
    if recompute is not None:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)).to(ctx["device"])
        n_batches = 4 if ctx["quick"] else 16
        data = [torch.randn(32, 3, 32, 32, device=ctx["device"]) for _ in range(n_batches)]

        def single_pass() -> None:
            net.train()
            with torch.no_grad():
                for x in data:
                    net(x)

        t = timed_together({"recompute": lambda: recompute(net, data, progress=False), "one": single_pass},
                           ctx["repeats"], ctx["device"])
        t_rec, t_one = t["recompute"], t["one"]
        samples = n_batches * 32
        rows.append({"what": f"recompute_bn_stats (per rank: {n_batches} batches of 32x3x32x32)",
                     "zero_buffers.recompute_bn_stats": t_rec, "single_process_pass": t_one,
                     "speedup": t_one / t_rec, "samples_per_s_per_rank": samples / t_rec})
        ctx["log"](f"recompute: {samples / t_rec:.0f} samples/s per rank, overhead {t_rec / t_one:.2f}x a plain pass")
    return rows


def bench_scaling(ctx: dict) -> list[dict]:
    """Section 5: time vs number of buffers, three ways (the world-size axis comes from running at several N)."""
    import zero_buffers as zb

    counts = (10, 50) if ctx["quick"] else (10, 50, 200, 1000, 2000)
    rows = []
    for n in counts:
        model = scrambled(lambda: many_buffers(n), ctx["rank"], ctx["device"])
        tensors = list(model.buffers())
        reps = max(3, ctx["repeats"] // (1 + n // 500))
        rows.append({"buffers": n, **timed_together(
            {"per_buffer_loop": lambda: per_buffer_loop(tensors, 0),
             "torch_broadcast_coalesced": lambda: torch_broadcast_coalesced(tensors, 0),
             "zero_buffers.broadcast_buffers": lambda: zb.broadcast_buffers(model, 0)}, reps, ctx["device"])})
        check_equal_to_src(model)
        ctx["log"](f"scaling {n} buffers done")
    return rows


# --------------------------------------------------------------------------------------------------
# memory: the peak resident set of this process during one call (Linux), not counting what was there before
# --------------------------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_extra_bytes(fn: Callable[[], Any]) -> int:
    """How far the resident set rose above its level before ``fn()`` while it ran (VmHWM after resetting it through
    /proc/self/clear_refs). Large tensors are mmap'd and given back on free, so this sees their real peak."""
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current resident set
    before = _status_kb("VmRSS")
    fn()
    return max(0, _status_kb("VmHWM") - before) * 1024


def naive_report(tensors: list[torch.Tensor]) -> list[float]:
    """What 0.1 did when buffers differed: all-gather every differing buffer to every rank, compare there."""
    out = []
    for t in tensors:
        copies = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, t)
        out.append(max(float((c - copies[0]).abs().max()) for c in copies))
    return out


def bench_report_diff(ctx: dict) -> list[dict]:
    """Section 6: buffer_report when a large buffer differs on every rank, against all-gathering it to every rank
    (what 0.1 did): time per call. The memory of the two is in section "memory"."""
    import zero_buffers as zb

    rows = []
    for mb in ((1, 4) if ctx["quick"] else (4, 32, 128)):
        model = nn.Module()
        model.register_buffer("codebook", torch.full((mb * 2 ** 18,), float(ctx["rank"]), device=ctx["device"]))
        report = zb.buffer_report(model)
        if report.in_sync or report.rows[0].max_abs_diff != ctx["world"] - 1:
            raise AssertionError("buffer_report missed the differing codebook")
        tensors = [model.codebook]
        t = timed_together({"zero_buffers.buffer_report": lambda: zb.buffer_report(model),
                            "naive_all_gather": lambda: naive_report(tensors)}, max(3, ctx["repeats"] // 3),
                           ctx["device"])
        rows.append({"buffer_MB": mb, **t,
                     "ours_over_naive": t["zero_buffers.buffer_report"] / t["naive_all_gather"]})
        ctx["log"](f"report_diff {mb} MB: ours/naive {rows[-1]['ours_over_naive']:.2f}x")
    return rows


def _peaks(ctx: dict, fn: Callable[[], Any]) -> list[float]:
    """Every rank's peak extra MiB for one ``fn()`` call (by rank)."""
    peak = float(peak_extra_bytes(fn)) / 2 ** 20
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(ctx["world"])]
    dist.all_gather(out, torch.tensor([peak], dtype=torch.float64))
    return [float(p) for p in out]


def bench_memory(ctx: dict) -> list[dict]:
    """Section 7: peak extra memory per rank (its resident set above the level before the call; this section runs in
    processes whose allocator hands every freed block >= 64 KiB back at once, so the resident set follows the live
    tensors). (a) buffer_report of a differing codebook vs all-gathering it; (a') per rank, the peak over the buffer's
    size for an 8 MiB differing buffer, contiguous and strided, for buffer_report and the all-gather; (b)
    broadcast_buffers of buffers the source must pack (transposed views), with the 250 MiB bucket cap, a 64 MiB cap
    and no cap."""
    import zero_buffers as zb
    from zero_buffers._core import wire as _wire

    rows = []
    for mb in ((4,) if ctx["quick"] else (32, 128)):
        model = nn.Module()
        model.register_buffer("codebook", torch.full((mb * 2 ** 18,), float(ctx["rank"])))
        tensors = [model.codebook]
        ours, naive = _peaks(ctx, lambda: zb.buffer_report(model)), _peaks(ctx, lambda: naive_report(tensors))
        rows.append({"what": f"report, {mb} MiB codebook differing", "data_MB": mb,
                     "ours_max_rank_MB": max(ours), "naive_max_rank_MB": max(naive)})
        ctx["log"](f"memory report {mb} MiB: ours {max(ours):.0f} MiB, naive {max(naive):.0f} MiB")
    rows += report_memory_ratios(ctx)
    n, mb = (4, 2) if ctx["quick"] else (12, 32)
    model = nn.Module()
    g = torch.Generator().manual_seed(ctx["rank"])
    for i in range(n):
        model.register_buffer(f"b{i}", torch.rand(512, mb * 512, generator=g).t())
    total = sum(b.numel() * b.element_size() for b in model.buffers()) / 2 ** 20
    for label, cap in (("cap 250 MiB", 250 * 2 ** 20), ("cap 64 MiB", 64 * 2 ** 20), ("no cap", 1 << 62)):
        _wire.BUCKET_BYTES = cap
        try:
            peaks = _peaks(ctx, lambda: zb.broadcast_buffers(model))
            check_equal_to_src(model)
        finally:
            _wire.BUCKET_BYTES = 250 * 2 ** 20
        rows.append({"what": f"broadcast, {label}", "data_MB": total, "source_MB": peaks[0],
                     "receiver_max_MB": max(peaks[1:])})
        ctx["log"](f"memory broadcast {label}: source {peaks[0]:.0f} MiB, receivers {max(peaks[1:]):.0f} MiB "
                   f"of {total:.0f} MiB")
    return rows


def report_memory_ratios(ctx: dict, mb: int = 8) -> list[dict]:
    """buffer_report of one differing ``mb`` MiB buffer (rank r holds r everywhere), held contiguous and strided
    (same shape, transposed storage): each rank's peak extra memory over the buffer's size, side by side, for
    buffer_report and the all-gather (contiguous only: gloo gathers contiguous tensors). Measured after the
    section's first report, so a process's one-time pages (about 5 MiB on the first call) are not counted."""
    import zero_buffers as zb

    rows = []
    for layout in ("contiguous", "strided"):
        values = torch.full((512, mb * 512), float(ctx["rank"]))
        buf = values if layout == "contiguous" else values.t().contiguous().t()
        del values
        model = nn.Module()
        model.register_buffer("codebook", buf)
        size = buf.numel() * buf.element_size() / 2 ** 20
        methods: dict[str, Callable[[], Any]] = {"zero_buffers.buffer_report": lambda: zb.buffer_report(model)}
        if layout == "contiguous":
            methods["all-gather (0.1)"] = lambda: naive_report([buf])
        if zb.buffer_report(model).rows[0].max_abs_diff != ctx["world"] - 1:
            raise AssertionError("buffer_report missed the differing buffer")
        for method, fn in methods.items():
            peaks = _peaks(ctx, fn)
            rows.append({"what": f"report, {mb} MiB differing, {layout}", "method": method,
                         **{f"rank{r}_ratio": p / size for r, p in enumerate(peaks)},
                         "max_rank_ratio": max(peaks) / size})
            ctx["log"](f"memory report {mb} MiB {layout}, {method}: "
                       + " / ".join(f"{p / size:.2f}x" for p in peaks))
    return rows


def repro_module(name: str) -> Any:
    """A repro script shipped in zero_buffers/repro/ (which imports its ``_common`` as a sibling), as a module."""
    import importlib

    import zero_buffers

    folder = str(Path(zero_buffers.__file__).resolve().parent / "repro")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def bench_recompute_modes(ctx: dict) -> list[dict]:
    """Section 9: recompute modes side by side on transformers' ResNet-34 (site-shifted batches per rank): plain
    train-mode forward passes (the floor), recompute_bn_stats, recompute_bn_stats(global_batch=True), and the
    layer-by-layer exact variant (one pass per BatchNorm layer; the repro's implementation, not shipped)."""
    from transformers import ResNetConfig, ResNetModel

    import zero_buffers as zb

    widths = [16, 32, 64, 128] if ctx["quick"] else [64, 128, 256, 512]
    torch.manual_seed(0)
    model = ResNetModel(ResNetConfig(embedding_size=widths[0], hidden_sizes=widths, depths=[3, 4, 6, 3],
                                     layer_type="basic")).to(ctx["device"])
    g = torch.Generator().manual_seed(ctx["rank"])
    gain, offset = 0.9 + 0.3 * torch.rand(3, 1, 1, generator=g), 1.2 * torch.rand(3, 1, 1, generator=g) - 0.6
    n_batches = 2 if ctx["quick"] else 4
    data = [(torch.randn(16, 3, 32, 32, generator=g) * gain + offset).to(ctx["device"]) for _ in range(n_batches)]
    start = {k: v.clone() for k, v in model.state_dict().items()}
    exact = repro_module("ddp_bn_checkpoint").layer_by_layer
    layers = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())

    def plain() -> None:
        model.train()
        with torch.no_grad():
            for x in data:
                model(x)

    results: dict[str, dict[str, torch.Tensor]] = {}

    def run(name: str, fn: Callable[[], Any]) -> Callable[[], None]:
        def call() -> None:
            model.load_state_dict(start)
            fn()
            results[name] = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}
        return call

    passes: list[int] = []
    methods = {"plain forward passes": run("plain", plain),
               "recompute_bn_stats": run("per_rank", lambda: zb.recompute_bn_stats(model, data, progress=False)),
               "recompute_bn_stats(global_batch=True)": run("global", lambda: zb.recompute_bn_stats(
                   model, data, progress=False, global_batch=True)),
               "layer by layer (not shipped)": run("layer", lambda: (exact(model, data), passes.append(layers)))}
    t = timed_together(methods, max(1, ctx["repeats"] // 4), ctx["device"])

    def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max()) for k in b)

    floor = t["plain forward passes"]
    rows = [{"method": m, "seconds": v, "ratio_to_plain_passes": v / floor} for m, v in t.items()]
    rows.append({"method": "passes over the data", "layer_by_layer": passes[-1], "recompute": 1, "global_batch": 1,
                 "max_rel_diff_global_vs_layer_by_layer": rel(results["global"], results["layer"]),
                 "max_rel_diff_per_rank_vs_layer_by_layer": rel(results["per_rank"], results["layer"])})
    summary = ", ".join(f"{r['method']} {r['ratio_to_plain_passes']:.2f}x" for r in rows[:-1])
    ctx["log"](f"recompute modes: {summary}; layer by layer: {passes[-1]} passes")
    return rows


def bench_fsdp2(ctx: dict) -> list[dict]:
    """Section 10: FSDP2. broadcast_buffers / buffer_report on ResNet-50's BatchNorm layers as a plain (DDP) module,
    under fully_shard and under ZeRO-3 (zero.Init), side by side; then a frozen module's forward under fully_shard
    (all-gathers per forward) against frozen_replica of it and the plain module."""
    import deepspeed
    from torch.distributed.fsdp import fully_shard

    import zero_buffers as zb

    if ctx["device"].type == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    blocks = (1, 1, 1, 1) if ctx["quick"] else (3, 4, 6, 3)

    def bn_net() -> nn.Module:
        return scrambled(lambda: resnet_bn_net(blocks), ctx["rank"], ctx["device"])

    plain = bn_net()
    sharded = bn_net()
    for layer in sharded:
        fully_shard(layer)
    fully_shard(sharded)
    with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                  "zero_optimization": {"stage": 3}}):
        zero3 = resnet_bn_net(blocks).to(ctx["device"])
    rows = []
    for what, call in (("broadcast_buffers", zb.broadcast_buffers), ("buffer_report", zb.buffer_report)):
        t = timed_together({k: functools.partial(call, m) for k, m in
                            (("plain", plain), ("fully_shard", sharded), ("zero3", zero3))}, ctx["repeats"],
                           ctx["device"])
        rows.append({"what": what, **t, "fsdp2_over_plain": t["fully_shard"] / t["plain"],
                     "fsdp2_over_zero3": t["fully_shard"] / t["zero3"]})
        ctx["log"](f"fsdp2 {what}: fully_shard/plain {rows[-1]['fsdp2_over_plain']:.2f}, "
                   f"fully_shard/zero3 {rows[-1]['fsdp2_over_zero3']:.2f}")
    width = 8 if ctx["quick"] else 32

    def tokenizer() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv3d(3, width, 3, padding=1), nn.BatchNorm3d(width), nn.ReLU(),
                             nn.Conv3d(width, width, 3, padding=1, stride=2), nn.BatchNorm3d(width)).eval()

    frozen_plain = tokenizer().to(ctx["device"])
    under_fsdp2 = tokenizer().to(ctx["device"])
    for layer in (under_fsdp2[0], under_fsdp2[3]):
        fully_shard(layer)
    fully_shard(under_fsdp2)
    replica = tokenizer().to(ctx["device"])
    for layer in (replica[0], replica[3]):
        fully_shard(layer)
    fully_shard(replica)
    zb.frozen_replica(replica)
    x = torch.randn(1, 3, 4, 16, 16, device=ctx["device"])

    def no_grad(m: nn.Module) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return m(x)
        return run

    want = no_grad(frozen_plain)()
    for m in (under_fsdp2, replica):
        torch.testing.assert_close(no_grad(m)(), want)
    t = timed_together({"fully_shard": no_grad(under_fsdp2), "frozen_replica": no_grad(replica),
                        "plain": no_grad(frozen_plain)}, ctx["repeats"], ctx["device"])
    rows.append({"what": "frozen forward 1x3x4x16x16", **t, "fsdp2_over_frozen": t["fully_shard"] / t["frozen_replica"],
                 "frozen_over_plain": t["frozen_replica"] / t["plain"]})
    ctx["log"](f"fsdp2 frozen forward: fully_shard/frozen_replica {rows[-1]['fsdp2_over_frozen']:.1f}x, "
               f"frozen_replica/plain {rows[-1]['frozen_over_plain']:.2f}")
    return rows


class Codebooks(nn.Module):
    """Four large buffers (a VQ codebook's embed, embed_avg, and two more of its size): bytes without tensor count."""

    def __init__(self, size: int = 1024, dim: int = 256):
        super().__init__()
        for name in ("embed", "embed_avg", "embed_ema", "embed_prev"):
            self.register_buffer(name, torch.rand(size, dim))


def copy_floor(tensors: list[torch.Tensor], flats: list[torch.Tensor], src: int) -> Callable[[], None]:
    """The least any sync that keeps the buffers in their own memory must do: the source packs each dtype with one
    torch.cat(out=), one broadcast per dtype, receivers copy out with one fused _foreach_copy_ per dtype."""
    groups = [[t for t in tensors if t.dtype == f.dtype] for f in flats]
    sources = [[t.view(-1) for t in g] for g in groups]
    views = [list(f.split([t.numel() for t in g])) for f, g in zip(flats, groups)]
    targets = [[t.view(-1) for t in g] for g in groups]
    source = dist.get_rank() == src

    def run() -> None:
        with torch.no_grad():
            for f, srcs in zip(flats, sources):
                if source:
                    torch.cat(srcs, out=f)
                dist.broadcast(f, src)
            if not source:
                for dst, v in zip(targets, views):
                    torch._foreach_copy_(dst, v)
    return run


def bench_keep_in_sync(ctx: dict) -> list[dict]:
    """Section 11: keep_in_sync's steady state. (a) One sync of ResNet-50's BatchNorm buffers (159 tensors) and of
    four 1 MB buffers, against one raw broadcast of the same flat bytes (the floor), against the copy floor (the
    same broadcast plus the one-op pack and fused copy-out that any sync keeping each buffer in its own memory must
    add), that floor plus the vote (one raw all-reduce of 2 x world floats, what every plan's check costs), and against
    the transactional sync_buffers, with every buffer "broadcast"; with the default rules ("bn"
    merge) also against one raw all-reduce of the float64 sums the merge moves; (b) a training step of
    transformers' ResNet-18 (batch 32, DDP with broadcast_buffers=False) with and without keep_in_sync before every
    forward, steps alternating."""
    from transformers import ResNetConfig, ResNetModel

    import zero_buffers as zb

    rows = []
    blocks = (1, 1, 1, 1) if ctx["quick"] else (3, 4, 6, 3)
    cases = (("ResNet-50 BatchNorm, every buffer 'broadcast'", lambda: resnet_bn_net(blocks),
              {nn.BatchNorm2d: "broadcast"}),
             ("ResNet-50 BatchNorm, default rules ('bn')", lambda: resnet_bn_net(blocks), None),
             ("4 buffers of 1 MB, 'broadcast'", lambda: Codebooks(64 if ctx["quick"] else 1024), None))
    for label, builder, rules in cases:
        model = scrambled(builder, ctx["rank"], ctx["device"])
        handle = zb.keep_in_sync(model, rules=rules)
        handle.sync()  # the first sync agrees on the structure; the steady state is what follows
        tensors = list(model.buffers())
        flats = [torch.cat([t.reshape(-1) for t in tensors if t.dtype == d])
                 for d in dict.fromkeys(t.dtype for t in tensors)]
        vote = torch.zeros(2 * ctx["world"], dtype=torch.float64, device=ctx["device"])  # [failed, changed] per rank
        fns = {"keep_in_sync": handle.sync, "raw_flat_broadcast": lambda: raw_flat(flats, 0),
               "copy_floor": copy_floor(tensors, [f.clone() for f in flats], 0),
               "raw_vote_all_reduce": lambda: dist.all_reduce(vote),
               "sync_buffers": lambda: zb.sync_buffers(model, rules=rules or {})}
        merge = None
        if rules is None and any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):
            bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
            merge = torch.rand(sum(2 + 2 * m.num_features for m in bns), dtype=torch.float64, device=ctx["device"])
            fns = {"keep_in_sync": handle.sync, "raw_flat_broadcast": fns["raw_flat_broadcast"],
                   "raw_merge_all_reduce": lambda: dist.all_reduce(merge), "sync_buffers": fns["sync_buffers"]}
        t = timed_together(fns, ctx["repeats"] * 3, ctx["device"])
        handle.remove()
        row = {"what": f"sync, {label}", "tensors": len(tensors),
               "bytes": sum(f.numel() * f.element_size() for f in flats), **t,
               "steady_over_raw": t["keep_in_sync"] / t["raw_flat_broadcast"]}
        if merge is None:
            row["steady_over_copy_floor"] = t["keep_in_sync"] / t["copy_floor"]
            row["steady_over_copy_floor_and_vote"] = t["keep_in_sync"] / (t["copy_floor"] + t["raw_vote_all_reduce"])
        else:
            row["steady_over_merge_all_reduce"] = t["keep_in_sync"] / t["raw_merge_all_reduce"]
        row["transactional_over_steady"] = t["sync_buffers"] / t["keep_in_sync"]
        rows.append(row)
        ctx["log"](f"keep_in_sync {label}: steady/raw {row['steady_over_raw']:.2f}x, "
                   + (f"steady/copy floor {row['steady_over_copy_floor']:.2f}x, " if merge is None else
                      f"steady/merge all-reduce {row['steady_over_merge_all_reduce']:.2f}x, ")
                   + f"sync_buffers/steady {row['transactional_over_steady']:.2f}x")

    torch.manual_seed(0)
    width = (8, 16, 16, 16) if ctx["quick"] else (64, 128, 256, 512)
    net = ResNetModel(ResNetConfig(num_channels=3, embedding_size=width[0], hidden_sizes=list(width),
                                   depths=[2, 2, 2, 2], layer_type="basic")).to(ctx["device"])
    ddp = nn.parallel.DistributedDataParallel(net, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    batch, size = (4, 32) if ctx["quick"] else (32, 64)
    x = torch.randn(batch, 3, size, size, device=ctx["device"]) + ctx["rank"]

    def step() -> None:
        ddp(pixel_values=x).pooler_output.square().mean().backward()
        opt.step()
        opt.zero_grad()

    handle = zb.keep_in_sync(ddp)  # on DDP's inner module, default rules
    handle.sync()  # the first sync agrees on the structure
    handle.remove()  # the hook is gone; handle.sync() does what it did before every forward

    def plain_step() -> None:
        step()

    def synced_step() -> None:
        handle.sync()
        step()

    t = timed_together({"step": plain_step, "step + keep_in_sync": synced_step}, ctx["repeats"], ctx["device"])
    alone = timed_together({"sync": handle.sync}, ctx["repeats"] * 3, ctx["device"])["sync"]  # the sync it adds
    rows.append({"what": f"ResNet-18 train step, batch {batch}, {size}x{size}", **t,
                 "overhead_pct": 100 * (t["step + keep_in_sync"] / t["step"] - 1), "sync_alone": alone,
                 "sync_share_pct": 100 * alone / t["step"]})
    ctx["log"](f"keep_in_sync train step overhead {rows[-1]['overhead_pct']:.1f}% (the sync alone: "
               f"{rows[-1]['sync_share_pct']:.2f}% of a step)")
    return rows


def bench_frozen_real(ctx: dict) -> list[dict]:
    """Section 8: the per-forward cost of frozen_replica on real transformers models against the same model as a
    plain module under no_grad (the replica's no_grad wrapper, class swap and parameters() override)."""
    from transformers import BertConfig, BertModel, ResNetConfig, ResNetModel

    import zero_buffers as zb

    def bert() -> nn.Module:
        torch.manual_seed(0)
        cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                         vocab_size=256)
        return BertModel(cfg).eval()

    def resnet34() -> nn.Module:
        torch.manual_seed(0)
        cfg = ResNetConfig(depths=[3, 4, 6, 3], layer_type="basic", hidden_sizes=[16, 32, 64, 128], embedding_size=16)
        return ResNetModel(cfg).eval()

    inputs = {"BERT (2 layers, hidden 64)": (bert, {"input_ids": torch.randint(0, 256, (4, 32))}),
              "ResNet-34 (widths 16-128)": (resnet34, {"pixel_values": torch.randn(4, 3, 64, 64)})}
    rows = []
    for name, (build, batch) in inputs.items():
        plain, replica = build(), zb.frozen_replica(build())
        with torch.no_grad():
            want = plain(**batch).last_hidden_state
        torch.testing.assert_close(replica(**batch).last_hidden_state, want)

        def plain_forward() -> Any:
            with torch.no_grad():
                return plain(**batch)

        t = timed_together({"plain_no_grad": plain_forward, "frozen_replica": lambda: replica(**batch)},
                           ctx["repeats"], ctx["device"])
        rows.append({"model": name, **t, "frozen_over_plain": t["frozen_replica"] / t["plain_no_grad"]})
        ctx["log"](f"frozen_real {name}: frozen/plain {rows[-1]['frozen_over_plain']:.3f}x")
    return rows


def _rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    """One rank: join the group, run the asked sections, rank 0 writes JSON."""
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_PORT=os.environ["ZB_BENCH_PORT"])
    torch.set_num_threads(1)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world and not args.cuda_gloo
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if args.cuda_gloo:  # one GPU, shared: CUDA tensors over gloo (an nccl world needs one GPU per rank)
        device = torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    log = (lambda msg: print(f"[world {world}] {msg}", flush=True)) if rank == 0 else (lambda msg: None)
    ctx = {"rank": rank, "world": world, "device": device, "quick": args.quick, "log": log,
           "repeats": 3 if args.quick else args.repeats}
    funcs = {"broadcast": bench_broadcast, "check": bench_check, "frozen": bench_frozen, "bn": bench_bn,
             "scaling": bench_scaling, "report_diff": bench_report_diff, "memory": bench_memory,
             "frozen_real": bench_frozen_real, "recompute_modes": bench_recompute_modes, "fsdp2": bench_fsdp2,
             "keep_in_sync": bench_keep_in_sync}
    results = {}
    for section in args.only:
        log(f"section {section} ...")
        results[section] = funcs[section](ctx)
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, "backend": dist.get_backend(), "device": device.type,
                                         "results": results}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is measured and written. After DeepSpeed's init_distributed (section "frozen") the interpreter
    # teardown sometimes aborts with "terminate called without an active exception" (a C++ thread destroyed at
    # exit), failing a finished run; repro/_common.py sees the same. os._exit skips that teardown.
    os._exit(0)


MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}  # glibc: free hands big blocks back


def run_world(world: int, args: argparse.Namespace, env: dict[str, str] | None = None) -> dict:
    """Spawn ``world`` ranks for the sections asked (with ``env`` added to their environment); return rank 0's
    results."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return _spawn(world, args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spawn(world: int, args: argparse.Namespace) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["ZB_BENCH_PORT"] = str(s.getsockname()[1])
    tmp = tempfile.mkdtemp(prefix="zb_bench_")
    out = os.path.join(tmp, "out.json")
    mp.start_processes(_rank_main, args=(world, os.path.join(tmp, "store"), args, out), nprocs=world,
                       start_method="spawn")
    return json.loads(Path(out).read_text())


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v * 1e3:.3f} ms" if v < 10 else f"{v:.1f}"
    return str(v)


def markdown(all_results: list[dict], meta: dict) -> str:
    """The results as Markdown tables (times in ms; ratios as x)."""
    lines = ["# zero_buffers benchmarks", "", f"{meta['when']} on {meta['machine']}; torch {meta['torch']}; "
             f"{'quick mode (sizes too small to claim anything)' if meta['quick'] else 'default sizes'}. "
             "Median of the slowest rank over repeats.", ""]
    for res in all_results:
        lines.append(f"## world size {res['world']} ({res['backend']}, {res['device']})")
        for section, rows in res["results"].items():
            if not rows:
                continue
            lines += ["", f"### {section}", ""]
            keys = list(rows[0].keys())
            for r in rows[1:]:
                keys += [k for k in r if k not in keys]
            lines.append("| " + " | ".join(keys) + " |")
            lines.append("|" + "---|" * len(keys))
            for r in rows:
                cells = []
                for k in keys:
                    v = r.get(k, "")
                    if isinstance(v, float) and "rel_diff" in k:
                        cells.append(f"{v:.2e}")
                    elif isinstance(v, float) and k.endswith("_pct"):
                        cells.append(f"{v:+.1f} %")
                    elif isinstance(v, float) and any(w in k for w in ("speedup", "ratio", "over")):
                        cells.append(f"{v:.2f}x")
                    elif isinstance(v, float) and "MB" in k:
                        cells.append(f"{v:.0f} MiB")
                    elif isinstance(v, float) and "per_s" in k:
                        cells.append(f"{v:,.0f}")
                    elif isinstance(v, float):
                        cells.append(f"{v * 1e3:.3f} ms")
                    else:
                        cells.append(str(v))
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(all_results: list[dict], path: Path) -> bool:
    """scaling.png: time vs number of buffers per method, one line style per world size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"per_buffer_loop": "tab:red", "torch_broadcast_coalesced": "tab:blue",
              "zero_buffers.broadcast_buffers": "tab:green"}
    styles = {2: "-o", 4: "--s", 8: ":^"}
    for res in all_results:
        rows = res["results"].get("scaling", [])
        if not rows:
            continue
        xs = [r["buffers"] for r in rows]
        for method, color in colors.items():
            axes[0].plot(xs, [r[method] * 1e3 for r in rows], styles.get(res["world"], "-"), color=color,
                         label=f"{method} (world {res['world']})")
    axes[0].set(xscale="log", yscale="log", xlabel="number of buffers", ylabel="ms per sync (median)",
                title="Buffer broadcast vs number of buffers")
    axes[0].legend(fontsize=7)
    worlds = [r["world"] for r in all_results if r["results"].get("broadcast")]
    for method, color in colors.items():
        ys = [next(r for r in res["results"]["broadcast"] if r["set"].startswith("resnet"))[method] * 1e3
              for res in all_results if res["results"].get("broadcast")]
        if ys:
            axes[1].plot(worlds, ys, "-o", color=color, label=method)
    axes[1].set(xlabel="world size (ranks)", ylabel="ms per sync (median)", yscale="log",
                title="ResNet-50 BN buffers vs world size")
    axes[1].set_xticks(worlds or [2])
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plot_recompute_modes(all_results, path.with_name("recompute_modes.png"), plt)
    return True


def plot_recompute_modes(all_results: list[dict], path: Path, plt: Any) -> None:
    """recompute_modes.png: each recompute mode's time over plain forward passes, per world size."""
    runs = [(res["world"], [r for r in res["results"].get("recompute_modes", []) if "seconds" in r])
            for res in all_results]
    runs = [(w, rows) for w, rows in runs if rows]
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(8, 3.8))
    methods = [r["method"] for r in runs[0][1]]
    width = 0.8 / len(runs)
    for i, (world, rows) in enumerate(runs):
        ratio = {r["method"]: r["ratio_to_plain_passes"] for r in rows}
        ax.bar([j + i * width for j in range(len(methods))], [ratio[m] for m in methods], width,
               label=f"world {world}")
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(methods))], methods, fontsize=8,
                  rotation=10)
    ax.set(yscale="log", ylabel="time / plain forward passes", title="BatchNorm recompute modes on ResNet-34")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 3 repeats: correctness only")
    parser.add_argument("--cuda-gloo", action="store_true",
                        help="every rank's tensors on cuda:0, over gloo (one GPU shared by the ranks)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    all_results = []
    for w in args.world:
        timing = argparse.Namespace(**{**vars(args), "only": [x for x in args.only if x != "memory"]})
        result = run_world(w, timing) if timing.only else {"world": w, "results": {}}
        if "memory" in args.only:
            measured = run_world(w, argparse.Namespace(**{**vars(args), "only": ["memory"]}), MEMORY_ENV)
            result.setdefault("backend", measured["backend"])
            result.setdefault("device", measured["device"])
            result["results"]["memory"] = measured["results"]["memory"]
        all_results.append(result)
    meta = {"when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores"
                       + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
            "torch": torch.__version__, "quick": args.quick, "seconds": round(time.perf_counter() - started, 1)}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": all_results}, indent=1))
    md = markdown(all_results, meta)
    (args.out / "results.md").write_text(md)
    plotted = plot(all_results, args.out / "scaling.png")
    print(md)
    print(f"\nwrote {args.out / 'results.json'}, results.md{', scaling.png' if plotted else ''} "
          f"in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
