"""BatchNorm statistics held in 16 bits against a float64 reference: the EMA stagnates, and a frozen tokenizer then
normalises with stale statistics.

    python benchmarks/bn_precision.py            # 3 000 steps, the tokenizer on 1 000 batches
    python benchmarks/bn_precision.py --quick    # 400 and 150: checks every output, claims nothing

One process, CPU, no ranks, one thread. Both parts run momentum 0.1 (torch's default) and 0.01.

Part 1 (``stats``): a ``BatchNorm3d`` of 8 channels (the Emu3 tokenizer's layer type) updated by its own
train-mode forward, step after step, on a synthetic stream of batches of 4x8x2x4x4 (128 values per channel) whose
channel means sit far from 0 (6 to 14) and drift slowly (+1 per 1 000 steps) while their spread widens (std 1 at
step 0, 2 at step 3 000). The layer is held as engines leave it: ``.to(dtype)`` with the batch in that dtype
(bfloat16: what DeepSpeed's bf16 leaves, float16, float32), and as keeping the statistics in fp32 leaves it: a
float32 layer fed the bfloat16 batch. Each is compared with a float64 layer fed the same batches (the batch as
the held layer saw it, in float64; the ``_vs_unrounded`` columns: the float64 stream itself), at every step: max
|diff| and max relative error over channels of ``running_mean`` / ``running_var``, the share of steps that changed
each statistic, the step from which it stopped moving (the median channel's first 50 steps without a change). A
hand-written EMA of the exact batch statistics rounded once to bfloat16 (the best a bfloat16 buffer can hold)
shows the dead zone is the format's: an update ``r + m * (batch_mean - r)`` rounds back to ``r`` when
``m * |batch_mean - r|`` is under half a step of ``r``, so the EMA stops at a gap of ``ulp(r) / (2 m)`` from its
target (the ``dead_zone`` column; bfloat16 keeps 8 significant bits: between 8 and 16 a step is 0.0625). The
``update_rule`` column names the rule that reproduces a 16-bit layer's ``running_mean`` update bit for bit on
every step (on torch 2.13's CPU kernel, measured: bfloat16 arithmetic, (1 - m) and m rounded too; float16:
float32, rounded once); a constant input shows where a bfloat16 layer settles (``fixed_points``).

Part 2 (``tokenizer``): a frozen video tokenizer: Conv3d, BatchNorm3d, ReLU, Conv3d (stride 2), BatchNorm3d
(random seeded weights, never trained) and vector-quantize-pytorch's ``VectorQuantize`` (128 codes, k-means
initialised on float64 encodings, then frozen). Its BatchNorm statistics are trained by train-mode passes over the
same stream of 2x3x2x8x8 batches, once per dtype; then everything is put in eval mode and run on the same 32
held-out batches (drawn as the stream's last step draws them; 1 024 code positions): output max |diff| against the
float64-trained tokenizer (and relative to the largest output) and the share of VQ codes that differ, for the
statistics alone (the float64 tokenizer run with the statistics each dtype learned) and end to end (each tokenizer
run in its own dtype, against the float64 one; and bfloat16 compute with the float64-trained statistics: the
floor bfloat16 inference costs anyway).

``zero_buffers.precision.declared`` flags the layers held in 16 bits (column ``declared_flags``).

Writes ``results.json``, ``results.md`` and ``bn_precision.png`` into the output folder (default
``benchmarks/results/bn_precision``).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness import machine, md_table, pyplot, utc_now, write_json
from zero_buffers.precision.declared import declared

F64 = torch.float64
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": F64}
MOMENTA = (0.1, 0.01)
MEAN_DRIFT = 1e-3  # per step, every channel
STD_DRIFT = 1 / 3000  # per step
HALF = (torch.bfloat16, torch.float16)
# how a layer held in 16 bits may update running_mean r from the batch mean x: each product and the sum rounded to
# the held dtype, (1 - m) and m included; or computed in float32 and rounded once
RULES = ("in the held dtype: r*(1-m) + m*x, each op rounded", "float32, rounded once")
STILL = 50  # steps without a change that count as "stopped moving"
# part 1: (label, the layer's dtype, the batch's dtype, how it updates)
VARIANTS = (("bfloat16", torch.bfloat16, torch.bfloat16, "module"),
            ("float16", torch.float16, torch.float16, "module"),
            ("float32", torch.float32, torch.float32, "module"),
            ("float32 layer, bfloat16 batch", torch.float32, torch.bfloat16, "module"),
            ("bfloat16, EMA rounded once", torch.bfloat16, torch.bfloat16, "hand"))


def stream(steps: int, shape: tuple[int, ...], seed: int, start: int = 0) -> Iterator[torch.Tensor]:
    """float64 batches of ``shape`` (channels second): channel means 6 to 14 plus ``MEAN_DRIFT`` per step, std 1 plus
    ``STD_DRIFT`` per step, for steps ``start`` to ``start + steps``."""
    g = torch.Generator().manual_seed(seed)
    view = (1, shape[1]) + (1,) * (len(shape) - 2)
    base = torch.linspace(6, 14, shape[1], dtype=F64).view(view)
    for t in range(start, start + steps):
        yield base + MEAN_DRIFT * t + (1 + STD_DRIFT * t) * torch.randn(shape, generator=g, dtype=F64)


def half_step(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the distance between ``value`` (held in ``dtype``) and its neighbour away from 0, in float64."""
    v = value.to(F64).abs()
    return torch.exp2(torch.floor(torch.log2(v))) * torch.finfo(dtype).eps / 2


def _errors(held: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step, over channels: max |held - ref| and max |held - ref| / |ref| (both (steps,))."""
    diff = (held - ref).abs()
    return diff.amax(1), (diff / ref.abs()).amax(1)


def _rule(counts: dict[str, int] | None, steps: int) -> dict[str, Any]:
    """The update rule that reproduced most of a 16-bit layer's steps bit for bit, and on what share of them."""
    if not counts or not any(counts.values()):
        return {"update_rule": None, "update_rule_pct": None}
    rule = max(counts, key=lambda k: counts[k])
    return {"update_rule": rule, "update_rule_pct": 100 * counts[rule] / steps}


def first_still_step(moved: torch.Tensor, window: int = STILL) -> int | None:
    """``moved``: (steps - 1, channels), whether each step changed each channel's value. The first step of the
    median channel's first run of ``window`` steps without a change (None: the median channel has none)."""
    starts = []
    for c in range(moved.shape[1]):
        run = 0
        for t, changed in enumerate(moved[:, c].tolist()):
            run = 0 if changed else run + 1
            if run == window:
                starts.append(t - window + 2)  # moved[t] compares steps t and t + 1
                break
    ranked = sorted(starts) + [None] * (moved.shape[1] - len(starts))
    return ranked[(moved.shape[1] - 1) // 2]


def fixed_points(steps: int) -> list[dict]:
    """Where a BatchNorm1d held in bfloat16 settles on a constant input (every batch the same value), against the
    EMA rounded once to bfloat16 and the exact value."""
    rows = []
    for m in MOMENTA:
        for value in (1.0, 10.0, 100.0):
            layer = nn.BatchNorm1d(1, momentum=m).to(torch.bfloat16)
            x = torch.full((16, 1), value, dtype=torch.bfloat16)
            once = torch.zeros(1, dtype=torch.bfloat16)
            for _ in range(steps):
                layer(x)
                once = ((1 - m) * once.to(F64) + m * value).to(torch.bfloat16)
            held = float(layer.running_mean)
            rows.append({"momentum": m, "input": value, "bfloat16_layer": held, "rel_err": abs(held - value) / value,
                         "bfloat16_rounded_once": float(once), "rounded_once_rel_err": abs(float(once) - value) / value,
                         "dead_zone": float(half_step(once, torch.bfloat16)[0]) / m})
    return rows


def curve_points(steps: int, n: int = 60) -> list[int]:
    """About ``n`` step indices, log-spaced from 0 to ``steps - 1``: where the error curves are saved and plotted."""
    spaced = torch.logspace(0, float(torch.log10(torch.tensor(float(steps)))), n, dtype=F64) - 1
    return sorted({min(steps - 1, round(float(x))) for x in spaced} | {steps - 1})


def bench_stats(steps: int) -> tuple[list[dict], dict[str, Any]]:
    """Part 1: the rows (one per variant and momentum) and the curves (errors at ``curve_points``, channel 0's
    running_mean every few steps)."""
    shape = (4, 8, 2, 4, 4)
    layers: dict[tuple[str, float], nn.BatchNorm3d] = {}
    hand: dict[float, list[torch.Tensor]] = {}
    refs: dict[tuple[torch.dtype, float], nn.BatchNorm3d] = {}
    for m in MOMENTA:
        for label, dtype, _, kind in VARIANTS:
            if kind == "module":
                layers[label, m] = nn.BatchNorm3d(shape[1], momentum=m).to(dtype)
        hand[m] = [torch.zeros(shape[1], dtype=torch.bfloat16), torch.ones(shape[1], dtype=torch.bfloat16)]
        for dtype in {v[2] for v in VARIANTS} | {F64}:  # float64: the stream itself, unrounded
            refs[dtype, m] = nn.BatchNorm3d(shape[1], momentum=m).to(F64)
    flagged = {label: any(d.degraded(layers[label, MOMENTA[0]].running_mean.dtype)
                          for d in declared(layers[label, MOMENTA[0]])) for label, *_, kind in VARIANTS
               if kind == "module"}
    flagged["bfloat16, EMA rounded once"] = flagged["bfloat16"]
    trace: dict[tuple[str, float], list[torch.Tensor]] = {key: [] for key in [*layers, *refs]}
    trace.update({("hand", m): [] for m in MOMENTA})
    matched = {key: dict.fromkeys(RULES, 0) for key in layers}
    started = time.perf_counter()
    for x in stream(steps, shape, seed=0):
        seen = {dtype: x.to(dtype) for dtype, _ in refs}
        for (label, m), layer in layers.items():
            batch = seen[next(v[2] for v in VARIANTS if v[0] == label)]
            dtype = layer.running_mean.dtype
            if dtype in HALF:  # which rule the kernel's running_mean update follows, bit for bit
                exact = batch.to(F64).mean((0, 2, 3, 4))
                r = layer.running_mean
                predicted = {RULES[0]: r * torch.tensor(1 - m, dtype=dtype) + torch.tensor(m, dtype=dtype)
                             * exact.to(dtype), RULES[1]: ((1 - m) * r.float() + m * exact.float()).to(dtype)}
            layer(batch)
            if dtype in HALF:
                for rule, value in predicted.items():
                    matched[label, m][rule] += int(torch.equal(value, layer.running_mean))
            trace[label, m].append(torch.stack([layer.running_mean, layer.running_var]).to(F64))
        for (dtype, m), ref in refs.items():
            ref(seen[dtype].to(F64))
            trace[dtype, m].append(torch.stack([ref.running_mean, ref.running_var]))
        exact = seen[torch.bfloat16].to(F64)
        mean, var = exact.mean((0, 2, 3, 4)), exact.var((0, 2, 3, 4), correction=1)
        for m, (rm, rv) in hand.items():
            rm.copy_((1 - m) * rm.to(F64) + m * mean)
            rv.copy_((1 - m) * rv.to(F64) + m * var)
            trace["hand", m].append(torch.stack([rm, rv]).to(F64))
    seconds = time.perf_counter() - started
    held_traces = {k: torch.stack(v) for k, v in trace.items()}  # (steps, 2, channels)
    points = curve_points(steps)
    rows: list[dict] = []
    curves: dict[str, Any] = {"steps": points, "errors": {}, "every": max(1, steps // 300), "channel0": {}}
    half = steps // 2
    for m in MOMENTA:
        for label, dtype, seen_dtype, kind in VARIANTS:
            held = held_traces[(label if kind == "module" else "hand"), m]
            ref, exact_ref = held_traces[seen_dtype, m], held_traces[F64, m]
            mean_abs, mean_rel = _errors(held[:, 0], ref[:, 0])
            var_abs, var_rel = _errors(held[:, 1], ref[:, 1])
            moved = held[1:] != held[:-1]  # (steps - 1, 2, channels)
            still = [first_still_step(moved[:, i]) for i in (0, 1)]
            final = held[-1, 0]
            gap = (ref[-1, 0] - final).abs()
            zone = half_step(final, dtype) / m
            rows.append({
                "variant": label, "momentum": m, "kind": kind, "declared_flags": flagged[label],
                "mean_abs": float(mean_abs[-1]), "mean_rel": float(mean_rel[-1]),
                "var_abs": float(var_abs[-1]), "var_rel": float(var_rel[-1]),
                "mean_rel_max_2nd_half": float(mean_rel[half:].max()),
                "var_rel_max_2nd_half": float(var_rel[half:].max()),
                "mean_rel_vs_unrounded": float(_errors(held[-1:, 0], exact_ref[-1:, 0])[1][0]),
                "var_rel_vs_unrounded": float(_errors(held[-1:, 1], exact_ref[-1:, 1])[1][0]),
                "mean_moved_pct_2nd_half": 100 * float(moved[half:, 0].double().mean()),
                "var_moved_pct_2nd_half": 100 * float(moved[half:, 1].double().mean()),
                "mean_still_from_step": still[0], "var_still_from_step": still[1],
                "final_mean_ch0": float(final[0]), "ref_mean_ch0": float(ref[-1, 0, 0]),
                "dead_zone_max": float(zone.max()), "gap_max": float(gap.max()),
                "gap_over_dead_zone_median": float((gap / zone).median()),
                **_rule(matched.get((label, m)), steps)})
            key = f"{label}, m={m}"
            curves["errors"][key] = {"mean_rel": [float(mean_rel[p]) for p in points],
                                     "var_rel": [float(var_rel[p]) for p in points]}
            curves["channel0"][key] = held[::curves["every"], 0, 0].tolist()
        curves["channel0"][f"float64, m={m}"] = held_traces[F64, m][::curves["every"], 0, 0].tolist()
    curves["seconds"] = seconds
    return rows, curves


def tokenizer(width: int, momentum: float) -> nn.Sequential:
    """The frozen encoder, in float64: seeded random weights, BatchNorm3d statistics at their defaults."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv3d(3, width, 3, padding=1), nn.BatchNorm3d(width, momentum=momentum), nn.ReLU(),
                         nn.Conv3d(width, width, 3, padding=1, stride=2), nn.BatchNorm3d(width, momentum=momentum)
                         ).to(F64).requires_grad_(False)


def _with_statistics(encoder: nn.Module, source: nn.Module) -> nn.Module:
    """A float64 copy of ``encoder`` holding ``source``'s BatchNorm buffers (as float64), in eval mode."""
    out = copy.deepcopy(encoder)
    with torch.no_grad():
        for buf, theirs in zip(out.buffers(), source.buffers()):
            if buf.is_floating_point():
                buf.copy_(theirs.to(F64))
    return out.eval()


def bench_tokenizer(batches: int) -> list[dict]:
    """Part 2: one row per momentum and way of running the tokenizer (see the module's docstring)."""
    from vector_quantize_pytorch import VectorQuantize

    shape, width, codes = (2, 3, 2, 8, 8), 16, 128
    held_out = list(stream(32, shape, seed=2, start=batches))  # the distribution at the stream's end
    calibration = list(stream(8, shape, seed=3, start=batches))
    rows: list[dict] = []
    for m in MOMENTA:
        base = tokenizer(width, m)
        trained = {name: copy.deepcopy(base).to(dtype).train() for name, dtype in DTYPES.items()}
        with torch.no_grad():
            for x in stream(batches, shape, seed=1):
                for name, enc in trained.items():
                    enc(x.to(DTYPES[name]))
            reference = trained["float64"].eval()
            torch.manual_seed(4)
            vq = VectorQuantize(dim=width, codebook_size=codes, kmeans_init=True, kmeans_iters=10,
                                accept_3d_fmap=True, freeze_codebook=True)
            vq.train()
            vq(torch.cat([reference(x) for x in calibration]).float())
            vq.eval()

            def run(enc: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
                z = torch.cat([enc(x.to(dtype)) for x in held_out]).to(F64)
                return z, vq(z.float())[1]

            z_ref, codes_ref = run(reference, F64)
            scale = float(z_ref.abs().max())
            ways = [(f"statistics trained in {name}, run in float64", _with_statistics(base, enc), F64)
                    for name, enc in trained.items() if name != "float64"]
            ways += [(f"{name} end to end", trained[name].eval(), DTYPES[name]) for name in ("bfloat16", "float16")]
            ways.append(("bfloat16 compute, float64-trained statistics",
                         copy.deepcopy(reference).to(torch.bfloat16).eval(), torch.bfloat16))
            for what, enc, dtype in ways:
                z, got = run(enc, dtype)
                diff = (z - z_ref).abs()
                rows.append({"what": what, "momentum": m, "out_max_abs": float(diff.max()),
                             "out_max_rel": float(diff.max()) / scale, "out_mean_abs": float(diff.mean()),
                             "codes_differ_pct": 100 * float((got != codes_ref).double().mean()),
                             "codes": int(codes_ref.numel())})
            bn = [mod for mod in trained["bfloat16"].modules() if isinstance(mod, nn.BatchNorm3d)]
            ref_bn = [mod for mod in reference.modules() if isinstance(mod, nn.BatchNorm3d)]
            rows.append({"what": "bfloat16-trained statistics against float64's, max relative error", "momentum": m,
                         "running_mean_rel": max(float(((a.running_mean.to(F64) - b.running_mean).abs()
                                                        / b.running_mean.abs()).max()) for a, b in zip(bn, ref_bn)),
                         "running_var_rel": max(float(((a.running_var.to(F64) - b.running_var).abs()
                                                       / b.running_var).max()) for a, b in zip(bn, ref_bn))})
    return rows


def _fmt(v: Any) -> str:
    """A cell of results.md: 3 significant digits, None as a dash."""
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, float):
        return str(v)
    if v == 0:
        return "0"
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e4 else f"{v:.2e}"


def markdown(data: dict) -> str:
    meta = data["meta"]
    stats_keys = ["variant", "momentum", "mean_rel", "mean_abs", "var_rel", "var_abs", "mean_rel_max_2nd_half",
                  "var_rel_max_2nd_half", "mean_rel_vs_unrounded", "var_rel_vs_unrounded",
                  "mean_moved_pct_2nd_half", "var_moved_pct_2nd_half", "mean_still_from_step",
                  "dead_zone_max", "gap_max", "gap_over_dead_zone_median", "update_rule", "update_rule_pct",
                  "declared_flags"]
    fixed_keys = ["momentum", "input", "bfloat16_layer", "rel_err", "bfloat16_rounded_once", "rounded_once_rel_err",
                  "dead_zone"]
    tok = [r for r in data["tokenizer"] if "out_max_abs" in r]
    tok_keys = ["what", "momentum", "out_max_abs", "out_max_rel", "out_mean_abs", "codes_differ_pct"]
    stat_rows = [r for r in data["tokenizer"] if "running_mean_rel" in r]
    lines = ["# BatchNorm statistics in 16 bits against float64", "",
             f"{meta['when']} on {meta['machine']}; torch {meta['torch']}; {meta['steps']} steps, tokenizer "
             f"{meta['batches']} batches; {meta['seconds']} s." + (" quick mode: claims nothing." if meta["quick"]
                                                                   else ""), "",
             "## running statistics after the last step, against a float64 layer on the same batches", "",
             *md_table(stats_keys, [[_fmt(r[k]) for k in stats_keys] for r in data["stats"]]), "",
             f"## a bfloat16 BatchNorm1d on a constant input, after {meta['fixed_steps']} steps", "",
             *md_table(fixed_keys, [[_fmt(r[k]) for k in fixed_keys] for r in data["fixed_points"]]), "",
             "## the frozen tokenizer on held-out batches, against the float64-trained one", "",
             *md_table(tok_keys, [[_fmt(r[k]) for k in tok_keys] for r in tok]), "",
             *(f"momentum {r['momentum']}: {r['what']}: running_mean {_fmt(r['running_mean_rel'])}, running_var "
               f"{_fmt(r['running_var_rel'])}" for r in stat_rows), ""]
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    curves = data["curves"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    colors = {"bfloat16": "tab:red", "float16": "tab:orange", "float32": "tab:blue",
              "float32 layer, bfloat16 batch": "tab:green", "bfloat16, EMA rounded once": "tab:purple"}
    for stat, ax in zip(("mean_rel", "var_rel"), axes[0]):
        for key, errs in curves["errors"].items():
            label, m = key.rsplit(", m=", 1)
            ys = [max(e, 1e-12) for e in errs[stat]]
            ax.plot([s + 1 for s in curves["steps"]], ys, color=colors[label], ls="-" if m == "0.01" else "--",
                    label=key)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        name = f"running_{stat.removesuffix('_rel')}"
        ax.set_ylabel(f"max relative error of {name}")
        ax.set_title(f"{name} against float64 (solid: momentum 0.01, dashed: 0.1)", fontsize=9)
    axes[0][0].legend(fontsize=6, ncol=2, loc="center left", framealpha=0.9)
    ax = axes[1][0]
    every = curves["every"]
    for key, ys in curves["channel0"].items():
        label, m = key.rsplit(", m=", 1)
        if m != "0.01" or label not in ("float64", "bfloat16", "float16", "float32"):
            continue
        ax.plot([i * every for i in range(len(ys))], ys, color=colors.get(label, "black"),
                label="float32 (on float64's line)" if label == "float32" else label, lw=2 if label == "float64" else 1,
                zorder=1 if label == "float64" else 2)
    ax.set_xlabel("step")
    ax.set_ylabel("running_mean, channel 0")
    ax.set_title("momentum 0.01, channel 0 (data mean 6 + 0.001 per step): bfloat16 stops moving", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1][1]
    tok = [r for r in data["tokenizer"] if "out_max_abs" in r]
    names = list(dict.fromkeys(r["what"] for r in tok))
    for i, m in enumerate(MOMENTA):
        vals = [next(r for r in tok if r["what"] == n and r["momentum"] == m) for n in names]
        bars = ax.barh([j + 0.4 * i for j in range(len(names))], [max(v["out_max_abs"], 1e-12) for v in vals],
                       height=0.4, color=("tab:gray", "tab:cyan")[i])
        for bar, v in zip(bars, vals):
            ax.text(bar.get_width(), bar.get_y() + 0.2, f" codes {v['codes_differ_pct']:.1f} %", va="center",
                    fontsize=6)
    ax.set_yticks([j + 0.2 for j in range(len(names))], names, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("tokenizer output max |diff| against the float64-trained one")
    ax.set_title("frozen tokenizer (grey: momentum 0.1, cyan: 0.01; codes: VQ codes that differ)", fontsize=9)
    fig.suptitle(f"BatchNorm3d statistics in 16 bits ({data['meta']['steps']} steps; tokenizer "
                 f"{data['meta']['batches']} batches)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batches", type=int, default=1000, help="the tokenizer's training batches")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "bn_precision")
    args = parser.parse_args(argv)
    steps, batches = (400, 150) if args.quick else (args.steps, args.batches)
    torch.set_num_threads(1)
    started = time.perf_counter()
    stats, curves = bench_stats(steps)
    fixed = fixed_points(fixed_steps := 1500 if args.quick else 3000)
    tok = bench_tokenizer(batches)
    meta = {"when": utc_now(), "machine": machine(), "torch": torch.__version__, "quick": args.quick, "steps": steps,
            "fixed_steps": fixed_steps, "batches": batches, "seconds": round(time.perf_counter() - started, 1)}
    data = {"meta": meta, "stats": stats, "fixed_points": fixed, "tokenizer": tok, "curves": curves}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "results.json", data)
    md = markdown(data)
    (args.out / "results.md").write_text(md)
    plot(data, args.out / "bn_precision.png")
    print(md)
    print(f"wrote {args.out / 'results.json'}, results.md, bn_precision.png in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
