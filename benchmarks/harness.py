"""What every benchmark section uses: N local ranks, the timing, the peak memory, the writers, the shared models.

- ``run_world``: spawns N ranks (``torch.multiprocessing``, spawn) that join one process group through a FileStore
  (gloo on CPU, nccl with one GPU per rank, ``--cuda-gloo``: every rank's tensors on cuda:0 over gloo), run the
  sections asked in turn and hand rank 0's results back as JSON.
- ``timed_together``: the measured method behind every time in ``results.md``: the median over repeats of the
  slowest rank's wall time for one call, the ranks starting each call together after a barrier, the methods of a row
  taking turns call by call so that drift on a shared machine hits them alike.
- ``peaks_by_rank``: every rank's peak extra resident memory for one call (section ``memory``).
- the writers: ``markdown`` (``results.md`` from the results: times in ms, ratios as x), ``md_table``,
  ``write_json``, ``utc_now`` and ``machine`` (the run's metadata), ``pyplot`` (matplotlib without a display); also
  used by ``doctor.py`` and ``owners.py``.
- the buffer sets and small models several sections build, and the alternatives several sections compare against.

It measures nothing of its own and writes nothing: ``bench.py`` writes ``results.json``, ``results.md`` and the
figures into the output folder.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import socket
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

import zero_buffers as zb

Section = Callable[[dict], list[dict]]  # one section: the rank's context -> its rows (rank 0's are kept)


# --------------------------------------------------------------------------------------------------
# N local ranks
# --------------------------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out: str,
               sections: dict[str, Section]) -> None:
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
    results = {}
    for section in args.only:
        log(f"section {section} ...")
        results[section] = sections[section](ctx)
    if rank == 0:
        write_json(Path(out), {"world": world, "backend": dist.get_backend(), "device": device.type,
                               "results": results})
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is measured and written. After DeepSpeed's init_distributed (section "frozen") the interpreter
    # teardown sometimes aborts with "terminate called without an active exception" (a C++ thread destroyed at
    # exit), failing a finished run; repro/_common.py sees the same. os._exit skips that teardown.
    os._exit(0)


def run_world(world: int, args: argparse.Namespace, sections: dict[str, Section],
              env: dict[str, str] | None = None) -> dict:
    """Spawn ``world`` ranks for the sections asked (``args.only``, each run by its function in ``sections``; with
    ``env`` added to their environment); return rank 0's results."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return _spawn(world, args, sections)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spawn(world: int, args: argparse.Namespace, sections: dict[str, Section]) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["ZB_BENCH_PORT"] = str(s.getsockname()[1])
    tmp = tempfile.mkdtemp(prefix="zb_bench_")
    out = os.path.join(tmp, "out.json")
    mp.start_processes(_rank_main, args=(world, os.path.join(tmp, "store"), args, out,
                                         {k: sections[k] for k in args.only}), nprocs=world, start_method="spawn")
    return json.loads(Path(out).read_text())


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


def timed_together(fns: dict[str, Callable[[], Any]], repeats: int, device: torch.device, shuffle: bool = False,
                   samples: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Median over ``repeats`` of each method's slowest-rank seconds; the methods take turns call by call, so
    drift on a shared machine hits every method alike and their ratios are measured side by side. ``shuffle``: each
    round takes the methods in a new order (seeded, the same on every rank), so that no method always follows the
    same one (for long calls, where one call may leave work behind for the next: memory given back, pages to fault
    in); ``samples``, when given, receives every measured time by method."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    order = random.Random(0)
    for i in range(repeats + 2):  # two warm-up rounds
        turn = order.sample(names, len(names)) if shuffle else names
        for name in turn:
            t = _once(fns[name], device)
            if i >= 2:
                times[name].append(t)
    if samples is not None:
        samples.update(times)
    return {k: statistics.median(v) for k, v in times.items()}


# the peak resident set of this process during one call (Linux), not counting what was there before
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_extra_bytes(fn: Callable[[], Any]) -> int:
    """How far the resident set rose above its level before ``fn()`` while it ran (VmHWM after resetting it through
    /proc/self/clear_refs). Large tensors are mmap'd and given back on free, so this sees their real peak."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current resident set
    before = _status_kb("VmRSS")
    fn()
    return max(0, _status_kb("VmHWM") - before) * 1024


def peaks_by_rank(ctx: dict, fn: Callable[[], Any]) -> list[float]:
    """Every rank's peak extra MiB for one ``fn()`` call (by rank)."""
    peak = float(peak_extra_bytes(fn)) / 2 ** 20
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(ctx["world"])]
    dist.all_gather(out, torch.tensor([peak], dtype=torch.float64))
    return [float(p) for p in out]


# --------------------------------------------------------------------------------------------------
# writers
# --------------------------------------------------------------------------------------------------
def utc_now() -> str:
    """When a run ended, as every results file of the benchmarks gives it."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def machine() -> str:
    """The machine, as the results files give it: architecture and CPU cores."""
    return f"{platform.machine()}, {os.cpu_count()} CPU cores"


def write_json(path: Path, data: Any) -> None:
    """``data`` as JSON, indented by one, the form of every results file."""
    path.write_text(json.dumps(data, indent=1))


def write_outputs(out: Path, data: dict, md: str, figures: list[str]) -> None:
    """``results.json`` (``data``, whose ``meta`` says how long the run took) and ``results.md`` into ``out``; the
    Markdown printed, then what was written (with the ``figures`` drawn beside them)."""
    write_json(out / "results.json", data)
    (out / "results.md").write_text(md)
    print(md)
    print(f"\nwrote {out / 'results.json'}, results.md{''.join(f', {f}' for f in figures)} in "
          f"{data['meta']['seconds']} s")


def md_table(keys: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines: the header ``keys``, the separator, then one line of cells per row."""
    return ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys), *("| " + " | ".join(r) + " |" for r in rows)]


def _cell(key: str, v: Any) -> str:
    """A value of results.md: by its column's name, a float is a relative difference, a percentage, a ratio, MiB, a
    rate or else seconds shown in ms."""
    if isinstance(v, float) and "rel_diff" in key:
        return f"{v:.2e}"
    if isinstance(v, float) and key.endswith("_pct"):
        return f"{v:+.1f} %"
    if isinstance(v, float) and any(w in key for w in ("speedup", "ratio", "over")):
        return f"{v:.2f}x"
    if isinstance(v, float) and "MB" in key:
        return f"{v:.0f} MiB"
    if isinstance(v, float) and "per_s" in key:
        return f"{v:,.0f}"
    if isinstance(v, float):
        return f"{v * 1e3:.3f} ms"
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
            lines += md_table(keys, [[_cell(k, r.get(k, "")) for k in keys] for r in rows])
        lines.append("")
    return "\n".join(lines)


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing without a display (Agg); ImportError where matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --------------------------------------------------------------------------------------------------
# what several sections build: buffer sets of real architectures (only the buffer-carrying layers), small models,
# DeepSpeed's setup
# --------------------------------------------------------------------------------------------------
def resnet_bn_layers(blocks: tuple[int, ...]) -> list[tuple[str, int]]:
    """(name, channels) of a torchvision-style bottleneck ResNet's BatchNorm layers, in its order; ``blocks``: the
    bottleneck blocks per stage ((3, 4, 6, 3): ResNet-50's 53 layers)."""
    out = [("bn1", 64)]
    for stage, n in enumerate(blocks):
        width = 64 * 2 ** stage
        for b in range(n):
            out += [(f"layer{stage + 1}.{b}.bn{i + 1}", c) for i, c in enumerate((width, width, width * 4))]
            if b == 0:
                out.append((f"layer{stage + 1}.{b}.downsample.1", width * 4))  # downsample branch
    return out


def resnet_bn_net(blocks: tuple[int, ...]) -> nn.Module:
    """The BatchNorm layers of a torchvision-style bottleneck ResNet (3 buffers each)."""
    return nn.Sequential(*[nn.BatchNorm2d(c) for _, c in resnet_bn_layers(blocks)])


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
    """Name -> builder of each buffer set measured (sections broadcast and check)."""
    if quick:
        return {"resnet50_bn": lambda: resnet_bn_net((1, 1, 1, 1)), "vit_nonpersistent": lambda: ViTBuffers(2, 96, 17),
                "resnet50_bn_bf16": lambda: resnet_bn_net((1, 1, 1, 1)).to(torch.bfloat16)}
    return {"resnet50_bn": lambda: resnet_bn_net((3, 4, 6, 3)), "resnet101_bn": lambda: resnet_bn_net((3, 4, 23, 3)),
            "vit_nonpersistent": lambda: ViTBuffers(), "resnet50_bn_bf16": lambda: resnet_bn_net((3, 4, 6, 3)).to(
                torch.bfloat16)}


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
    report = zb.buffer_report(model)
    if not report.in_sync:
        raise AssertionError(f"not in sync after broadcast:\n{report.format(only_out_of_sync=True, limit=5)}")


def flat_by_dtype(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors' values packed into one flat tensor per dtype (in the order the dtypes first appear)."""
    return [torch.cat([t.reshape(-1) for t in tensors if t.dtype == d])
            for d in dict.fromkeys(t.dtype for t in tensors)]


def tokenizer(width: int) -> nn.Module:
    """A frozen Conv3d video tokenizer with BatchNorm (sections frozen and fsdp2): seeded, in eval mode."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(3, width, 3, padding=1), nn.BatchNorm3d(width), nn.ReLU(),
                         nn.Conv3d(width, width, 3, padding=1, stride=2), nn.BatchNorm3d(width)).eval()


def init_deepspeed(device: torch.device) -> Any:
    """The ``deepspeed`` module with its distributed state set up on the process group's backend (on CPU, its
    shared-memory communication op marked unavailable first)."""
    import deepspeed

    if device.type == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    return deepspeed


def zero3_config() -> dict:
    """A DeepSpeed config for ``zero.Init`` with ZeRO stage 3 (a new dict each call)."""
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


# --------------------------------------------------------------------------------------------------
# the alternatives several sections compare against
# --------------------------------------------------------------------------------------------------
def raw_flat(flats: list[torch.Tensor], src: int) -> None:
    """The floor: the same bytes, already flat, one broadcast per dtype, nothing copied."""
    for f in flats:
        dist.broadcast(f, src)


def naive_report(tensors: list[torch.Tensor]) -> list[float]:
    """What 0.1 did when buffers differed: all-gather every differing buffer to every rank, compare there."""
    out = []
    for t in tensors:
        copies = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, t)
        out.append(max(float((c - copies[0]).abs().max()) for c in copies))
    return out
