"""What ``zero_buffers.router_bias`` costs per training step, against the step itself.

    python benchmarks/moe_router_bias.py            # world sizes 2 and 4, a small DeepSeek-V3, 15 repeats
    python benchmarks/moe_router_bias.py --quick    # world 2, a tiny model, 3 repeats: claims nothing

Per world size, on gloo ranks (CPU): a transformers DeepseekV3ForCausalLM (4 MoE layers of 16 routed experts, top-4,
hidden 128, batch 4 x 64 tokens per rank) under FSDP2 (``fully_shard`` per decoder layer and the root), SGD. Two
copies of the model take turns step by step (the harness's ``timed_together``: drift hits both alike): one plain,
one with ``router_bias(model, optimizer=opt)`` (the forward hooks count every gate, and after the optimizer step
one transaction sums the counts and the biases are updated). The update alone (``handle.update()``: the
transaction and the arithmetic) and the counting alone (every gate's forward hook on one forward's captured outputs)
are timed too. Reported: the median of the slowest rank's seconds; ``measured_overhead_pct``, the step with the
recipe against the plain one (on a shared CPU machine this difference is within the noise of a step), and
``recipe_share_pct``, counting plus update timed alone, in percent of the plain step (the recipe's cost per step).

Writes ``results.json``, ``results.md`` and ``moe_router_bias.png`` into the output folder (default
``benchmarks/results/moe_router_bias``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import zero_buffers as zb
from harness import machine, md_table, pyplot, run_world, timed_together, utc_now, write_outputs
from zero_buffers.moe.router_bias import _count


def _model(quick: bool) -> torch.nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    size = dict(hidden_size=32, num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2) if quick else \
        dict(hidden_size=128, num_hidden_layers=4, n_routed_experts=16, num_experts_per_tok=4)
    config = DeepseekV3Config(vocab_size=256, intermediate_size=64, moe_intermediate_size=32, first_k_dense_replace=0,
                              num_attention_heads=4, num_key_value_heads=4, n_group=2, topk_group=1, kv_lora_rank=16,
                              q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **size)
    config._attn_implementation = "eager"
    return DeepseekV3ForCausalLM(config).train()


def bench(ctx: dict) -> list[dict]:
    """Section ``moe_router_bias``: one FSDP2 training step with and without the recipe, and the update alone."""
    from torch.distributed.fsdp import fully_shard

    quick, rank = ctx["quick"], ctx["rank"]
    models, opts = [], []
    for _ in range(2):
        m = _model(quick)
        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m)
        models.append(m)
        opts.append(torch.optim.SGD(m.parameters(), lr=1e-3))
    handle = zb.router_bias(models[1], gamma=1e-3, optimizer=opts[1])
    seq = 16 if quick else 64
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 256, (4, seq), generator=g)

    def step(i: int) -> None:
        models[i](input_ids=ids, labels=ids).loss.backward()
        opts[i].step()
        opts[i].zero_grad()

    captured = []  # one train-mode forward's (gate, inputs, output) per gate: what the counting hook sees
    hooks = [g.module.register_forward_hook(lambda m, a, o, g=g: captured.append((g, m, a, o))) for g in handle.gates]
    models[1](input_ids=ids)
    for h in hooks:
        h.remove()
    for g in handle.gates:
        g.counts.zero_()

    def count() -> None:  # every gate's counting hook, as one forward runs them
        for gate, module, inputs, output in captured:
            _count(gate, handle, module, inputs, output)

    times = timed_together({"plain_step": lambda: step(0), "step_with_router_bias": lambda: step(1)},
                           ctx["repeats"], ctx["device"])
    alone = timed_together({"count_alone": count, "update_alone": handle.update}, ctx["repeats"], ctx["device"])
    assert handle.updates > ctx["repeats"], handle.updates  # the optimizer hook ran every step
    bias = models[1].model.layers[0].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and float(bias.abs().max()) > 0
    gates = len(handle.gates)
    handle.remove()
    return [{"what": f"FSDP2 step, {gates} gates of {bias.numel()} experts, batch 4x{seq}",
             "plain_step": times["plain_step"], "step_with_router_bias": times["step_with_router_bias"],
             "count_alone": alone["count_alone"], "update_alone": alone["update_alone"],
             "measured_overhead_pct": 100 * (times["step_with_router_bias"] / times["plain_step"] - 1),
             "recipe_share_pct": 100 * (alone["count_alone"] + alone["update_alone"]) / times["plain_step"]}]


def markdown(data: dict) -> str:
    meta = data["meta"]
    lines = ["# router_bias: cost per training step", "",
             f"{meta['when']} on {meta['machine']}; torch {meta['torch']}; "
             f"{'quick mode (sizes too small to claim anything)' if meta['quick'] else 'default sizes'}. "
             "Median of the slowest rank over repeats; the two steps alternate.", ""]
    keys = ["world", "what", "plain_step", "step_with_router_bias", "count_alone", "update_alone",
            "measured_overhead_pct", "recipe_share_pct"]
    rows = []
    for run in data["runs"]:
        for r in run["results"]["moe_router_bias"]:
            rows.append([str(run["world"]), r["what"], *(f"{r[k] * 1e3:.3f} ms" for k in keys[2:6]),
                         *(f"{r[k]:+.2f} %" for k in keys[6:])])
    return "\n".join(lines + md_table(keys, rows)) + "\n"


def plot(data: dict, path: Path) -> bool:
    try:
        plt = pyplot()
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    runs = data["runs"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.25
    width = 0.2
    for i, key in enumerate(("plain_step", "step_with_router_bias", "count_alone", "update_alone")):
        xs = [j + (i - 1.5) * width for j in range(len(runs))]
        ax.bar(xs, [r["results"]["moe_router_bias"][0][key] * 1e3 for r in runs], width, label=key)
    ax.set_xticks(range(len(runs)), [f"world {r['world']}" for r in runs])
    ax.set_yscale("log")
    ax.set_ylabel("ms (median, slowest rank; log)")
    ax.set_title("router_bias against an FSDP2 DeepSeek-V3 step (gloo, CPU)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="world 2, a tiny model, 3 repeats: correctness only")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "moe_router_bias")
    args = parser.parse_args(argv)
    worlds = args.world or ([2] if args.quick else [2, 4])
    started = time.perf_counter()
    run_args = argparse.Namespace(only=["moe_router_bias"], quick=args.quick, repeats=args.repeats, cuda_gloo=False)
    runs = [run_world(w, run_args, {"moe_router_bias": bench}) for w in worlds]
    meta = {"when": utc_now(), "machine": machine(), "torch": torch.__version__, "quick": args.quick,
            "seconds": round(time.perf_counter() - started, 1)}
    data = {"meta": meta, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    plotted = plot(data, args.out / "moe_router_bias.png")
    write_outputs(args.out, data, markdown(data), ["moe_router_bias.png"] if plotted else [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
