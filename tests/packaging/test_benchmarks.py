"""The benchmark driver in --quick mode: every section runs on real ranks and writes JSON, Markdown and a plot.

Correctness only (each method's result is checked inside the run); no timing is asserted here.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers import run_cmd

ROOT = Path(__file__).resolve().parents[2]


def test_quick_benchmarks_write_every_output(tmp_path):
    out = run_cmd([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--quick", "--world", "2",
                   "--out", str(tmp_path)], timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    run = data["runs"][0]
    assert run["world"] == 2 and data["meta"]["quick"] is True
    results = run["results"]
    assert set(results) == {"broadcast", "check", "frozen", "bn", "scaling", "report_diff", "memory", "frozen_real",
                            "recompute_modes", "fsdp2", "keep_in_sync"}
    kept = {r["what"]: r for r in results["keep_in_sync"]}
    syncs = [r for w, r in kept.items() if w.startswith("sync, ")]
    assert len(syncs) == 3 and all(r["keep_in_sync"] > 0 and r["raw_flat_broadcast"] > 0 for r in syncs)
    assert sum("copy_floor" in r for r in syncs) == 2 and sum("raw_merge_all_reduce" in r for r in syncs) == 1
    assert any(w.startswith("ResNet-18 train step") and "overhead_pct" in r and r["sync_share_pct"] > 0
               for w, r in kept.items())
    fsdp2 = {r["what"]: r for r in results["fsdp2"]}
    assert {"broadcast_buffers", "buffer_report", "frozen forward 1x3x4x16x16"} == set(fsdp2)
    assert all(fsdp2[w][k] > 0 for w in ("broadcast_buffers", "buffer_report")
               for k in ("plain", "fully_shard", "zero3"))
    modes = {r["method"]: r for r in results["recompute_modes"]}
    assert {"plain forward passes", "recompute_bn_stats", "recompute_bn_stats(global_batch=True)",
            "layer by layer (not shipped)"} < set(modes) and modes["passes over the data"]["layer_by_layer"] == 36
    methods = {"per_buffer_loop", "torch_broadcast_coalesced", "zero_buffers.broadcast_buffers", "raw_flat_broadcast"}
    for row in results["broadcast"]:
        assert methods <= row.keys() and all(row[m] > 0 for m in methods) and row["bytes"] > 0
    assert {r["set"] for r in results["broadcast"]} == {"resnet50_bn", "vit_nonpersistent", "resnet50_bn_bf16"}
    assert [r["buffers"] for r in results["scaling"]] == [10, 50]
    assert len(results["frozen"]) == 2 and all(r["plain"] > 0 for r in results["frozen"])
    assert [r["buffer_MB"] for r in results["report_diff"]] == [1, 4]
    assert all(r["zero_buffers.buffer_report"] > 0 and r["naive_all_gather"] > 0 for r in results["report_diff"])
    caps = [r["what"] for r in results["memory"] if r["what"].startswith("broadcast")]
    assert caps == ["broadcast, cap 250 MiB", "broadcast, cap 64 MiB", "broadcast, no cap"]
    ratios = [r for r in results["memory"] if "method" in r]  # per-rank peak over the buffer's size, side by side
    assert [(r["what"], r["method"]) for r in ratios] == [
        ("report, 8 MiB differing, contiguous", "zero_buffers.buffer_report"),
        ("report, 8 MiB differing, contiguous", "all-gather (0.1)"),
        ("report, 8 MiB differing, strided", "zero_buffers.buffer_report")]
    assert all({"rank0_ratio", "rank1_ratio", "max_rank_ratio"} <= r.keys() for r in ratios)
    assert {r["model"].split()[0] for r in results["frozen_real"]} == {"BERT", "ResNet-34"}
    md = (tmp_path / "results.md").read_text()
    assert "## world size 2" in md and "### broadcast" in md and "quick mode" in md
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "recompute_modes.png").read_bytes()[:4] == b"\x89PNG"


def test_quick_doctor_benchmark_checks_every_method_and_writes_its_outputs(tmp_path):
    out = run_cmd([sys.executable, str(ROOT / "benchmarks" / "doctor.py"), "--quick", "--out", str(tmp_path)],
                  timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "doctor.json").read_text())
    assert data["meta"]["quick"] is True and data["meta"]["files"] == 2
    assert [r["method"] for r in data["rows"]] == ["naive", "inspect", "diff", "diff_only_bn", "naive_zero3",
                                                  "inspect_zero3"]
    assert all(r["seconds"] > 0 and r["peak_rss_MiB"] > 0 for r in data["rows"])
    assert "quick mode" in (tmp_path / "doctor.md").read_text()
    assert (tmp_path / "doctor.png").read_bytes()[:4] == b"\x89PNG"


def test_quick_bn_precision_benchmark_shows_bf16_statistics_stagnating_and_changing_a_frozen_tokenizers_codes(
        tmp_path):
    out = run_cmd([sys.executable, str(ROOT / "benchmarks" / "bn_precision.py"), "--quick", "--out", str(tmp_path)],
                  timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["quick"] is True and data["meta"]["steps"] == 400
    rows = {(r["variant"], r["momentum"]): r for r in data["stats"]}
    for m in (0.1, 0.01):
        bf16, fp32, kept = rows["bfloat16", m], rows["float32", m], rows["float32 layer, bfloat16 batch", m]
        for stat in ("mean_rel", "var_rel"):  # against float64 on the same batches
            assert bf16[stat] > 1e-2 and bf16[stat] > 1000 * fp32[stat], (m, stat, bf16[stat], fp32[stat])
            assert fp32[stat] < 1e-5 and kept[stat] < 1e-5, (m, stat, fp32[stat], kept[stat])
        assert bf16["mean_moved_pct_2nd_half"] < 30 and fp32["mean_moved_pct_2nd_half"] == 100, (bf16, fp32)
        assert bf16["mean_still_from_step"] is not None and fp32["mean_still_from_step"] is None
        assert bf16["update_rule"].startswith("in the held dtype") and bf16["update_rule_pct"] == 100, bf16
        assert rows["bfloat16, EMA rounded once", m]["gap_over_dead_zone_median"] <= 1
        assert bf16["declared_flags"] and rows["float16", m]["declared_flags"] and not fp32["declared_flags"]
    fixed = {(r["momentum"], r["input"]): r for r in data["fixed_points"]}
    assert fixed[0.01, 10.0]["bfloat16_layer"] < 8 and fixed[0.01, 10.0]["bfloat16_rounded_once"] < 10
    tok = {(r["what"], r["momentum"]): r for r in data["tokenizer"] if "out_max_abs" in r}
    for m in (0.1, 0.01):
        bf16 = tok["statistics trained in bfloat16, run in float64", m]
        fp32 = tok["statistics trained in float32, run in float64", m]
        assert bf16["out_max_abs"] > 1000 * fp32["out_max_abs"] and fp32["out_max_rel"] < 1e-4, (bf16, fp32)
        assert bf16["codes_differ_pct"] > 5 and fp32["codes_differ_pct"] < 1, (bf16, fp32)
    assert "quick mode" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "bn_precision.png").read_bytes()[:4] == b"\x89PNG"


def test_quick_moe_router_bias_benchmark_times_the_step_with_and_without_the_recipe_and_writes_its_outputs(tmp_path):
    out = run_cmd([sys.executable, str(ROOT / "benchmarks" / "moe_router_bias.py"), "--quick", "--out",
                   str(tmp_path)], timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["quick"] is True and [r["world"] for r in data["runs"]] == [2]
    row, = data["runs"][0]["results"]["moe_router_bias"]
    assert all(row[k] > 0 for k in ("plain_step", "step_with_router_bias", "update_alone"))
    assert {"measured_overhead_pct", "recipe_share_pct"} <= row.keys() and row["count_alone"] > 0
    assert "quick mode" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "moe_router_bias.png").read_bytes()[:4] == b"\x89PNG"


def test_quick_fsdp2_load_benchmark_times_the_load_alone_under_install_and_with_the_one_line_after_checking_each(
        tmp_path):
    """benchmarks/fsdp2_load.py --quick: the plain load leaves every block's non-persistent table apart (checked in
    the run), the load under install() and the load + broadcast_buffers leave every buffer rank 0's (checked in the
    run, an AssertionError otherwise); every method timed, the ratios written, the plot drawn."""
    out = run_cmd([sys.executable, str(ROOT / "benchmarks" / "fsdp2_load.py"), "--quick", "--out", str(tmp_path)],
                  timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["quick"] is True and data["meta"]["world"] == 2
    [row] = data["runs"][0]["results"]["fsdp2_load"]
    assert row["buffers_apart_after_load"] == 4 and row["params_MB"] == 4 * (64 * 64 + 2 * 64) * 4 / 2 ** 20
    methods = ("load", "load_under_install", "load_then_broadcast_buffers", "broadcast_buffers", "install_uninstall")
    assert all(row[m] > 0 for m in methods), row
    assert row["install_over_load"] == row["load_under_install"] / row["load"]
    assert row["broadcast_over_load"] == row["load_then_broadcast_buffers"] / row["load"]
    md = (tmp_path / "results.md").read_text()
    assert "quick mode" in md and "### fsdp2_load" in md
    assert (tmp_path / "fsdp2_load.png").read_bytes()[:4] == b"\x89PNG"
