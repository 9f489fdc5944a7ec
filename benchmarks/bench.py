"""Side-by-side benchmarks of zero_buffers against the alternatives, on N local ranks.

    python benchmarks/bench.py                 # world sizes 2 and 4, writes benchmarks/results/
    python benchmarks/bench.py --quick         # tiny sizes, few repeats: checks every output, claims nothing
    python benchmarks/bench.py --world 2 --only broadcast scaling

Every number is the median over repeats of the slowest rank's wall time for one call (ranks start
each call together after a barrier); the methods compared take turns call by call, so drift on a
shared machine hits them alike. gloo on CPU by default, nccl when there is one GPU per rank.
Writes ``results.json``, ``results.md`` and ``scaling.png`` into the output folder.

This file is the runner: ``SECTIONS`` names each section's function, in the file of benchmarks/ that measures it
(each file's docstring says what against what); ``harness.py`` holds the ranks, the timing and the writers.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import bn
import broadcast
import frozen
import fsdp2
import harness
import keep_in_sync
import memory
import recompute_modes
import report

SECTIONS: dict[str, harness.Section] = {  # the order of a default run
    "broadcast": broadcast.bench_broadcast, "check": report.bench_check, "frozen": frozen.bench_frozen,
    "bn": bn.bench_bn, "scaling": broadcast.bench_scaling, "report_diff": report.bench_report_diff,
    "memory": memory.bench_memory, "frozen_real": frozen.bench_frozen_real,
    "recompute_modes": recompute_modes.bench_recompute_modes, "fsdp2": fsdp2.bench_fsdp2,
    "keep_in_sync": keep_in_sync.bench_keep_in_sync}
OWN_PROCESSES = {"memory": memory.MEMORY_ENV}  # sections run in ranks of their own, with this added to their env


def plot(all_results: list[dict], path: Path) -> bool:
    """scaling.png (sections broadcast and scaling) and, where that section ran, recompute_modes.png."""
    try:
        plt = harness.pyplot()
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    broadcast.plot_scaling(all_results, path, plt)
    recompute_modes.plot_recompute_modes(all_results, path.with_name("recompute_modes.png"), plt)
    return True


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
        timing = argparse.Namespace(**{**vars(args), "only": [x for x in args.only if x not in OWN_PROCESSES]})
        result = harness.run_world(w, timing, SECTIONS) if timing.only else {"world": w, "results": {}}
        for section, env in OWN_PROCESSES.items():
            if section in args.only:
                measured = harness.run_world(w, argparse.Namespace(**{**vars(args), "only": [section]}), SECTIONS,
                                             env)
                result.setdefault("backend", measured["backend"])
                result.setdefault("device", measured["device"])
                result["results"][section] = measured["results"][section]
        all_results.append(result)
    meta = {"when": harness.utc_now(),
            "machine": harness.machine() + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
            "torch": torch.__version__, "quick": args.quick, "seconds": round(time.perf_counter() - started, 1)}
    plotted = plot(all_results, args.out / "scaling.png")
    harness.write_outputs(args.out, {"meta": meta, "runs": all_results}, harness.markdown(all_results, meta),
                          ["scaling.png"] if plotted else [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
