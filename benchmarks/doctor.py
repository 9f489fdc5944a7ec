"""The checkpoint doctor against the naive way, on a generated folder of per-rank checkpoint files.

    python benchmarks/doctor.py               # 4 ranks x 512 MiB of weights (2 GiB) + ResNet-50's BatchNorm buffers
    python benchmarks/doctor.py --quick       # 2 ranks x 8 MiB: checks every output, claims nothing

Methods, each in a fresh process so that its peak memory is its own (VmHWM: peak resident set, which counts
mmap'ed file pages it touched; RssAnon: the peak of the memory it allocated, sampled every 5 ms):

- naive: ``torch.load`` every rank file (``weights_only=True``), then compare every entry with rank 0's;
- ``zero-buffers inspect`` / ``diff``: lazy (mmap) reads, one entry of every rank at a time;
- ``diff --only`` the BatchNorm statistics: what it costs to compare the buffers alone;
- on a DeepSpeed ZeRO-3 tag folder of the same size (weights in the optimizer files): ``torch.load`` of every
  file (``weights_only=False``, as the optimizer files need) against ``zero-buffers inspect``.

The methods take turns run by run (median of the repeats); the page cache is warm for all of them after the
first round, so the times compare the work, not the disk. Writes ``doctor.json``, ``doctor.md`` and
``doctor.png`` into the output folder.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from harness import pyplot, resnet_bn_layers, write_json

_CHILD = r"""
import json, re, sys, threading, time
peak = [0]
def rss_anon():
    return int(re.search(r"RssAnon:\s+(\d+)", open("/proc/self/status").read()).group(1))
def sample():
    while True:
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
method, folder = sys.argv[1], sys.argv[2]
import torch
from pathlib import Path
from zero_buffers import cli
base = rss_anon()
start = time.perf_counter()
if method == "naive":
    files = sorted(Path(folder).glob("rank*.pt"))
    sds = [torch.load(f, weights_only=True) for f in files]
    differ = sorted(k for k in sds[0] if any(not torch.equal(sd[k], sds[0][k]) for sd in sds[1:]))
    result = len(differ)
elif method == "naive_zero3":  # what a script does without the doctor: load every file of the tag folder
    step = Path(folder) / "step1"
    loaded = {f.name: torch.load(f, weights_only=False) for f in sorted(step.glob("*.pt"))}
    models = [v["module"] for k, v in sorted(loaded.items()) if k.endswith("model_states.pt")]
    differ = sorted(k for k in models[0] if any(not torch.equal(m[k], models[0][k]) for m in models[1:]))
    result = len(differ)
else:
    import contextlib, io
    args = {"inspect": ["inspect", folder], "diff": ["diff", folder], "inspect_zero3": ["inspect", folder],
            "diff_only_bn": ["diff", folder, "--only", "*running_*", "--only", "*num_batches_tracked"]}[method]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = cli.main(args)
    text = out.getvalue()
    found = re.search(r"(\d+) of (\d+) (?:buffers|tensors) differ", text)
    result = int(found.group(1)) if found else -1
seconds = time.perf_counter() - start
peak[0] = max(peak[0], rss_anon())
hwm = int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))
print(json.dumps({"seconds": seconds, "peak_rss_MiB": hwm / 1024, "peak_anon_MiB": (peak[0] - base) / 1024,
                  "differing": result}))
"""

METHODS = ("naive", "inspect", "diff", "diff_only_bn")
ZERO3_METHODS = ("naive_zero3", "inspect_zero3")


def resnet50_bn() -> list[tuple[str, int]]:
    """(name, channels) of ResNet-50's 53 BatchNorm layers."""
    return resnet_bn_layers((3, 4, 6, 3))


def bn_buffers(rank: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """ResNet-50's BatchNorm statistics as rank ``rank`` holds them: diverged from rank 0's, the same counters."""
    out = {}
    for name, c in resnet50_bn():
        out[f"{name}.running_mean"] = torch.randn(c, generator=g) * 0.1 * rank
        out[f"{name}.running_var"] = 1 + torch.rand(c, generator=g) * rank
        out[f"{name}.num_batches_tracked"] = torch.tensor(100)
    return out


def generate(folder: Path, world: int, weight_mib: int) -> dict[str, float]:
    """``world`` rank files: identical weights (``weight_mib`` MiB each, 32 MiB tensors) and BatchNorm statistics
    that differ on every rank but rank 0's counters."""
    g = torch.Generator().manual_seed(0)
    chunk = min(32, weight_mib)
    weights = {f"weight.{i}": torch.randn(chunk * (1 << 18), generator=g) for i in range(weight_mib // chunk)}
    for r in range(world):
        torch.save({**weights, **bn_buffers(r, g)}, folder / f"rank{r}.pt")
    total = sum(f.stat().st_size for f in folder.iterdir())
    return {"files": world, "total_MiB": total / 2 ** 20, "weights_MiB_per_file": float(weight_mib),
            "bn_layers": len(resnet50_bn())}


def generate_zero3(folder: Path, world: int, weight_mib: int) -> None:
    """A DeepSpeed ZeRO-3 tag folder as save_checkpoint lays it out: per rank, a model-states file with that rank's
    buffers, empty parameter placeholders and ``buffer_names``, and an optimizer file holding the rank's partition
    of the weights (``weight_mib`` MiB each, fp32 master weights and two Adam moments)."""
    g = torch.Generator().manual_seed(1)
    step = folder / "step1"
    step.mkdir(parents=True)
    (folder / "latest").write_text("step1")
    part = weight_mib * (1 << 18) // 3
    for r in range(world):
        buffers = bn_buffers(r, g)
        module = {**{f"weight.{i}": torch.empty(0) for i in range(16)}, **buffers}
        torch.save({"module": module, "buffer_names": list(buffers), "dp_world_size": world,
                    "ds_config": {"zero_optimization": {"stage": 3}}, "ds_version": "0.19.8"},
                   step / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        flat = torch.randn(part, generator=g)
        torch.save({"optimizer_state_dict": {"fp32_flat_groups": [flat], "state": {0: {
            "exp_avg": torch.randn(part, generator=g), "exp_avg_sq": torch.rand(part, generator=g)}}}},
            step / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def run(method: str, folder: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _CHILD, method, str(folder)], capture_output=True, text=True,
                          timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    world, mib, repeats = (2, 8, 1) if args.quick else (4, 512, args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in (*METHODS, *ZERO3_METHODS)}
    with tempfile.TemporaryDirectory(prefix="zb_doctor_bench_") as tmp:
        folder = Path(tmp)
        setup = generate(folder, world, mib)
        for _ in range(repeats):
            for m in METHODS:
                runs[m].append(run(m, folder))
    with tempfile.TemporaryDirectory(prefix="zb_doctor_bench_z3_") as tmp:
        folder = Path(tmp)
        generate_zero3(folder, world, mib)
        setup["zero3_total_MiB"] = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2 ** 20
        for _ in range(repeats):
            for m in ZERO3_METHODS:
                runs[m].append(run(m, folder))
    want = 2 * len(resnet50_bn())  # running_mean and running_var of every layer differ; the counters agree
    rows = []
    for m in (*METHODS, *ZERO3_METHODS):
        got = {r["differing"] for r in runs[m]}
        if got != {want}:
            raise SystemExit(f"{m} found {got} differing entries, expected {want}")
        rows.append({"method": m, "seconds": statistics.median(r["seconds"] for r in runs[m]),
                     "peak_rss_MiB": max(r["peak_rss_MiB"] for r in runs[m]),
                     "peak_anon_MiB": max(r["peak_anon_MiB"] for r in runs[m])})
    for r in rows:
        naive = rows[0] if r["method"] in METHODS else rows[len(METHODS)]
        r["time_vs_naive"] = r["seconds"] / naive["seconds"]
        r["anon_vs_naive"] = r["peak_anon_MiB"] / max(naive["peak_anon_MiB"], 1e-9)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "quick": args.quick,
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": __import__("os").cpu_count(), "repeats": repeats, **setup}
    write_json(out / "doctor.json", {"meta": meta, "rows": rows})
    lines = [f"# checkpoint doctor vs torch.load of every file ({meta['date']})", "",
             f"{setup['files']} rank files, {setup['total_MiB']:.0f} MiB in all ({mib} MiB of weights each, "
             f"ResNet-50's {setup['bn_layers']} BatchNorm layers diverged); torch {meta['torch']}, "
             f"{meta['cpus']} CPUs; median of {repeats}." + (" quick mode: claims nothing." if args.quick else ""),
             "", "| method | seconds | x naive | peak RSS MiB | peak allocated MiB | x naive |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['seconds']:.2f} | {r['time_vs_naive']:.2f} | {r['peak_rss_MiB']:.0f} | "
              f"{r['peak_anon_MiB']:.0f} | {r['anon_vs_naive']:.4f} |" for r in rows]
    z3 = setup["zero3_total_MiB"]
    lines += ["", f"The last two rows: a DeepSpeed ZeRO-3 tag folder of the same size ({z3:.0f} MiB, the weights in "
              "the optimizer files, the buffers in the model-states files), against loading every file of it.", "",
              "Peak RSS counts the mmap'ed file pages a method touched (the kernel can drop them at any time); "
              "peak allocated (RssAnon) is the memory the method needs."]
    (out / "doctor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(rows, out / "doctor.png")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [r["method"] for r in rows]
    a.bar(names, [r["seconds"] for r in rows], color="tab:blue")
    a.set_ylabel("seconds (median)")
    b.bar(names, [r["peak_anon_MiB"] for r in rows], color="tab:orange", label="allocated (RssAnon)")
    b.bar(names, [r["peak_rss_MiB"] for r in rows], color="none", edgecolor="black", label="peak RSS (with mmap)")
    b.set_ylabel("MiB")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle("zero-buffers inspect / diff vs torch.load of every rank file")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
