"""Section ``recompute_modes``: the BatchNorm recompute modes side by side on transformers' ResNet-34.

Site-shifted batches per rank (each rank's images have their own gain and offset), the same calls taking turns:
plain train-mode forward passes over the data (the floor), ``recompute_bn_stats``, ``recompute_bn_stats(
global_batch=True)`` and the layer-by-layer exact variant (one pass per BatchNorm layer; the repro's
implementation in ``zero_buffers/repro/ddp_bn_checkpoint.py``, not shipped). The claim: the per-rank recompute
costs little over the plain passes, the global-batch mode a small all-reduce per BatchNorm call, and the exact
variant one pass per layer (36 here), how far the statistics of each land from the layer-by-layer ones is in the
last row.

Results: section ``recompute_modes`` of ``results.json`` / ``results.md`` and ``recompute_modes.png`` in the
output folder (the run the docs quote is in ``benchmarks/results/recompute_modes/``).
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import zero_buffers as zb
from harness import timed_together


def repro_module(name: str) -> Any:
    """A repro script shipped in zero_buffers/repro/ (which imports its ``_common`` as a sibling), as a module."""
    folder = str(Path(zb.__file__).resolve().parent / "repro")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def bench_recompute_modes(ctx: dict) -> list[dict]:
    """Section 9: recompute modes side by side on transformers' ResNet-34 (site-shifted batches per rank): plain
    train-mode forward passes (the floor), recompute_bn_stats, recompute_bn_stats(global_batch=True), and the
    layer-by-layer exact variant (one pass per BatchNorm layer; the repro's implementation, not shipped)."""
    from transformers import ResNetConfig, ResNetModel

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
