"""What install() adds to FSDP2's rank-0 load, ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0)``.

    python benchmarks/fsdp2_load.py            # 1 GiB of parameters, 1 MiB of buffers, 2 gloo ranks
    python benchmarks/fsdp2_load.py --quick    # 64 KiB of parameters: checks every output, claims nothing

The model: 16 blocks of a bias-free ``Linear(4096, 4096)`` (fp32: 1 GiB of parameters in all), a ``BatchNorm1d(4096)``
(persistent statistics, 32 KiB) and a non-persistent 8192-entry table (32 KiB, a rotary table's kind): 1 MiB of
buffers. Rank 0 builds it for real and holds its full state dict; every other rank builds it on ``meta`` and
``to_empty``s it; every block and the root are ``fully_shard``'ed. Then, side by side (the methods take turns call by
call, median of the slowest rank's wall time):

- ``load``: ``set_model_state_dict(model, full, StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))``,
  which carries the state-dict entries only (the non-persistent table stays what ``to_empty`` left);
- ``load_under_install``: the same call inside ``with zero_buffers.install():`` (install and uninstall counted too),
  after which every buffer equals rank 0's;
- ``load_then_broadcast_buffers``: the load, then ``zero_buffers.broadcast_buffers(model, materialize=True)``, the
  one line for a loop no patch reaches;
- ``broadcast_buffers`` alone and ``install_uninstall`` alone (``install()`` then ``uninstall()``, no load).

Ratios: of the medians (``install_over_load``, ``broadcast_over_load``, ``install_added_pct``), and the median of
each round's own ratio (``..._per_round``), of the CPU seconds each call took in its process (``..._cpu``: the larger
rank's median; ``cpu_by_rank`` has every rank's); ``sync_share_pct``: ``broadcast_buffers`` alone over the load, the
work ``install()`` adds to it (one sync of every buffer). On a shared machine a load's wall time varies far more than
that work: ``samples`` keeps every call's time and ``results.md`` shows each method's spread. The methods take turns
in a new order each round (``harness.timed_together(shuffle=True)``).

Before timing, each method's outcome is checked: after the plain load the tables differ across ranks (counted in
``buffers_apart_after_load``), after the other two every buffer equals rank 0's.

Writes ``results.json``, ``results.md`` and ``fsdp2_load.png`` into the output folder (default
``benchmarks/results/fsdp2_load``).
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import harness
import zero_buffers as zb

SECTION = "fsdp2_load"


class Block(nn.Module):
    """A bias-free square Linear, a BatchNorm1d over its features and a non-persistent table twice as long."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width, bias=False)
        self.norm = nn.BatchNorm1d(width)
        self.register_buffer("table", 1.0 / 10000.0 ** (torch.arange(2 * width) / (2 * width)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)) * self.table[: x.shape[-1]]


def build(rank: int, blocks: int, width: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Rank 0: the real model (trained-looking statistics) and its full state dict; others: meta, then to_empty."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with torch.device("cpu" if rank == 0 else "meta"):
        model = nn.Sequential(*[Block(width) for _ in range(blocks)])
    full: dict[str, torch.Tensor] = {}
    if rank == 0:
        with torch.no_grad():
            for block in model:
                block.norm.running_mean.uniform_(-1, 1)
                block.norm.running_var.uniform_(0.5, 2)
        full = model.state_dict()
    for block in model:
        fully_shard(block)
    fully_shard(model)
    if rank:
        model.to_empty(device="cpu")
    return model, full


def bench_fsdp2_load(ctx: dict) -> list[dict]:
    """The rank-0 load alone, under install(), and followed by broadcast_buffers; side by side."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    blocks, width = (4, 64) if ctx["quick"] else (16, 4096)
    model, full = build(ctx["rank"], blocks, width)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def load() -> None:  # a fresh dict each call: set_model_state_dict puts its DTensors into the one it is given
        set_model_state_dict(model, dict(full), options=options)

    def under_install() -> None:
        with zb.install():
            load()

    def then_broadcast() -> None:
        load()
        zb.broadcast_buffers(model, materialize=True)

    def install_uninstall() -> None:
        zb.install()
        zb.uninstall()

    load()
    apart = len(zb.buffer_report(model).out_of_sync)
    if apart == 0:
        raise AssertionError("after the plain load every buffer already agrees: nothing for install() to fix")
    for method in (under_install, then_broadcast):
        model.apply(lambda m: m.table.normal_() if isinstance(m, Block) and ctx["rank"] else None)  # garbage again
        method()
        harness.check_equal_to_src(model)
    sizes = [sum(t.numel() * t.element_size() for t in ts) for ts in (model.parameters(), model.buffers())]  # global
    samples: dict[str, list[float]] = {}
    methods = {"load": load, "load_under_install": under_install, "load_then_broadcast_buffers": then_broadcast,
               "broadcast_buffers": functools.partial(zb.broadcast_buffers, model),
               "install_uninstall": install_uninstall}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    t = harness.timed_together({name: _cpu_timed(fn, cpu[name]) for name, fn in methods.items()}, ctx["repeats"],
                               ctx["device"], shuffle=True, samples=samples)
    cpu_by_rank = _cpu_medians(cpu, ctx["world"])
    row = {"what": f"set_model_state_dict(broadcast_from_rank0), {blocks} blocks of {width}x{width}",
           "params_MB": sizes[0] / 2 ** 20, "buffers_MB": sizes[1] / 2 ** 20,
           "buffers_apart_after_load": apart, **t, "install_over_load": t["load_under_install"] / t["load"],
           "broadcast_over_load": t["load_then_broadcast_buffers"] / t["load"],
           "install_added_pct": 100 * (t["load_under_install"] / t["load"] - 1),
           "install_over_load_per_round": _per_round(samples, "load_under_install"),
           "broadcast_over_load_per_round": _per_round(samples, "load_then_broadcast_buffers"),
           "sync_share_pct": 100 * t["broadcast_buffers"] / t["load"],
           "install_over_load_cpu": max(cpu_by_rank["load_under_install"]) / max(cpu_by_rank["load"]),
           "broadcast_over_load_cpu": max(cpu_by_rank["load_then_broadcast_buffers"]) / max(cpu_by_rank["load"]),
           "cpu_by_rank": cpu_by_rank,
           "samples": {k: [round(x, 6) for x in v] for k, v in samples.items()}}
    ctx["log"](f"load {t['load']:.3f} s, under install() {t['load_under_install']:.3f} s "
               f"({row['install_over_load']:.3f}x), + broadcast_buffers {t['load_then_broadcast_buffers']:.3f} s")
    return [row]


def _cpu_timed(fn: Callable[[], Any], into: list[float]) -> Callable[[], None]:
    """``fn``, appending the CPU seconds this process (every thread of it) spent in each call to ``into``."""
    def run() -> None:
        start = time.process_time()
        fn()
        into.append(time.process_time() - start)
    return run


def _cpu_medians(cpu: dict[str, list[float]], world: int) -> dict[str, list[float]]:
    """Per method, every rank's median CPU seconds per call (the 2 warm-up rounds left out), by rank."""
    mine = torch.tensor([statistics.median(v[2:]) for v in cpu.values()], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return {name: [float(r[i]) for r in every] for i, name in enumerate(cpu)}


def _per_round(samples: dict[str, list[float]], method: str) -> float:
    """The median over rounds of ``method``'s time over the plain load's in the same round."""
    return statistics.median(a / b for a, b in zip(samples[method], samples["load"]))


def plot(row: dict, meta: dict, path: Path) -> bool:
    """fsdp2_load.png: left, every call's seconds of the three loads (a box per method, each call a dot) with the
    ratio to the plain load (of the medians, per round, of the CPU seconds); right, the sync alone and install() +
    uninstall() in ms: what install() adds to a load."""
    try:
        plt = harness.pyplot()
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    loads = {"load": "load", "load_under_install": "load under\ninstall()",
             "load_then_broadcast_buffers": "load +\nbroadcast_buffers"}
    ratios = {"load_under_install": (row["install_over_load_per_round"], row["install_over_load_cpu"]),
              "load_then_broadcast_buffers": (row["broadcast_over_load_per_round"], row["broadcast_over_load_cpu"])}
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    data = [row["samples"][n] for n in loads]
    left.boxplot(data, showfliers=False)
    left.set_xticks(range(1, len(loads) + 1), list(loads.values()))
    for i, (n, values) in enumerate(zip(loads, data), 1):
        left.scatter([i] * len(values), values, s=10, alpha=0.6, color="#1f77b4")
        text = f"median {row[n]:.3g} s" + (f"\n{row[n] / row['load']:.2f}x (per round {ratios[n][0]:.2f}x)\n"
                                          f"CPU {ratios[n][1]:.2f}x" if n in ratios else "")
        left.annotate(text, (i, max(values)), ha="center", va="bottom", fontsize=8)
    left.set_ylabel("seconds per call (slowest rank)")
    left.set_ylim(0, 1.25 * max(max(v) for v in data))
    small = {"broadcast_buffers": "broadcast_buffers\nalone (the sync)",
             "install_uninstall": "install() +\nuninstall()"}
    bars = right.bar(list(small.values()), [row[n] * 1e3 for n in small], color=["#2ca02c", "#aec7e8"])
    for bar, n in zip(bars, small):
        right.annotate(f"{row[n] * 1e3:.3g} ms", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                       ha="center", va="bottom", fontsize=8)
    right.set_ylabel("ms (median, slowest rank)")
    right.set_title(f"the sync: {row['sync_share_pct']:.2f} % of the load", fontsize=9)
    right.margins(y=0.2)
    fig.suptitle(f"FSDP2 rank-0 load (set_model_state_dict, broadcast_from_rank0) of {row['params_MB']:.4g} MiB of "
                 f"parameters, {row['buffers_MB']:.2g} MiB of buffers\n{meta['world']} gloo ranks, {meta['machine']}, "
                 f"torch {meta['torch']}, {meta['when']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(result: dict, meta: dict) -> str:
    """harness.markdown's tables (the every-call samples left out), then each method's spread over the repeats."""
    rows = result["results"][SECTION]
    lines = [harness.markdown([{**result, "results": {SECTION: [{k: v for k, v in r.items()
                                                                 if k not in ("samples", "cpu_by_rank")}
                                                                for r in rows]}}], meta).rstrip(), "",
             f"Every call, {len(next(iter(rows[0]['samples'].values())))} repeats after 2 warm-up rounds, the methods "
             "taking turns (each round in a new order): slowest rank's seconds. The machine's load "
             f"average at the end (1, 5, 15 min): {', '.join(map(str, meta['load_average']))}.", ""]
    spread = [[name, f"{min(v):.4f}", f"{statistics.median(v):.4f}", f"{max(v):.4f}"]
              for name, v in rows[0]["samples"].items()]
    cpu = rows[0]["cpu_by_rank"]
    ranks = len(next(iter(cpu.values())))
    cpu_rows = [[name, *(f"{x:.4f}" for x in v)] for name, v in cpu.items()]
    return "\n".join(lines + harness.md_table(["method", "min", "median", "max"], spread) + [
        "", "CPU seconds per call (this process, every thread), median over the repeats, by rank: the work done, "
        "which other programs on the machine move far less than the wall time.", ""]
        + harness.md_table(["method", *(f"rank {r}" for r in range(ranks))], cpu_rows)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 3 repeats: correctness only")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / SECTION)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    run = argparse.Namespace(only=[SECTION], quick=args.quick, repeats=args.repeats, cuda_gloo=False)
    result = harness.run_world(args.world, run, {SECTION: bench_fsdp2_load})
    meta = {"when": harness.utc_now(), "machine": harness.machine(), "torch": torch.__version__,
            "quick": args.quick, "world": args.world, "seconds": round(time.perf_counter() - started, 1),
            "load_average": [round(x, 1) for x in os.getloadavg()]}  # 1, 5, 15 min, at the end: a shared machine
    plotted = plot(result["results"][SECTION][0], meta, args.out / f"{SECTION}.png")
    harness.write_outputs(args.out, {"meta": meta, "runs": [result]}, markdown(result, meta),
                          [f"{SECTION}.png"] if plotted else [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
