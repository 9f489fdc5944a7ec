"""The aux-loss-free MoE router bias (DeepSeek-V3's ``e_score_correction_bias``) on data whose expert preference
differs per rank: never updated, updated from each rank's own counts, counted twice under activation checkpointing,
and ``router_bias``, against a single-process float64 run on the global batch.

A tiny transformers DeepseekV3ForCausalLM (8 routed experts, top-2, two MoE layers) trained data-parallel (gradients
averaged over the ranks, SGD); each rank's tokens come from its own slice of the vocabulary, so each rank prefers
other experts. The load imbalance is max / mean tokens per expert over the global batch (1.0 = balanced), averaged
over the layers, at the first step and over the last quarter of the steps.

Run: zero-buffers repro moe_router_bias --nproc 2   (or: torchrun --nproc-per-node 2 repro/moe_router_bias.py)
Quick: 24 steps; full (ZB_FULL=1): 80.
"""
from __future__ import annotations

# _common first: it quiets other libraries' noise before they are imported (ZB_VERBOSE=1 keeps it)
from _common import FULL, Table, setup

import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from zero_buffers._compat.torch import in_backward

# Wall seconds under torchrun --nproc-per-node=2 on an idle 2-core machine, about 1.5x measured (the CLI's timeout).
NEEDS = ("deepseek_v3",)  # zero-buffers repro skips it, saying why, where transformers lacks it (_compat/versions.py)
BUDGET_SECONDS = {"quick": 20, "full": 45}
STEPS = 80 if FULL else 24
GAMMA, LR, EXPERTS, BATCH, SEQ = 0.02, 0.01, 8, 4, 16
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              first_k_dense_replace=0, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS,
              num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=8, v_head_dim=8, initializer_range=0.5)


def model(dtype: torch.dtype = torch.float32, checkpointing: bool = False) -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)  # the same model on every rank
    config = DeepseekV3Config(**CONFIG)
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # transformers 5's grouped_mm takes no float64
    m = DeepseekV3ForCausalLM(config).to(dtype).train()
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return m


def batch(rank: int, world: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s tokens: its own slice of the vocabulary (the expert preference differs per rank)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(4 * rank, 4 * rank + 4, (BATCH, SEQ), generator=g)  # four tokens: a strong preference


def gates(m: nn.Module) -> list[nn.Module]:
    return [layer.mlp.gate for layer in m.model.layers]


class Loads:
    """Tokens per expert of each gate's first forward per micro-batch (what routing did), per step."""

    def __init__(self, m: nn.Module):
        self.now = [torch.zeros(EXPERTS, dtype=torch.int64) for _ in gates(m)]
        self.steps: list[list[torch.Tensor]] = []
        for i, gate in enumerate(gates(m)):
            gate.register_forward_hook(lambda mod, a, out, i=i: self._add(i, out))

    def _add(self, i: int, out: tuple) -> None:
        if in_backward():  # a checkpoint's recompute: this routing was seen already
            return
        ids, = [t for t in out if not t.is_floating_point()]
        self.now[i] += torch.bincount(ids.reshape(-1), minlength=EXPERTS)

    def close_step(self, reduce: bool) -> None:
        loads = [c.clone() for c in self.now]
        if reduce:
            for c in loads:
                dist.all_reduce(c)
        self.steps.append(loads)
        for c in self.now:
            c.zero_()

    def imbalance(self, first: int, last: int) -> float:
        """max / mean tokens per expert, averaged over the gates and the steps [first, last)."""
        vals = [float(c.max()) / float(c.double().mean()) for s in self.steps[first:last] for c in s]
        return sum(vals) / len(vals)


class Naive:
    """What a hand-written counter does: count in every train-mode forward (recomputes included)."""

    def __init__(self, m: nn.Module):
        self.tokens = 0
        for gate in gates(m):
            gate.register_forward_hook(lambda mod, a, out: self._add(mod, out))

    def _add(self, mod: nn.Module, out: tuple) -> None:
        if mod.training:
            ids, = [t for t in out if not t.is_floating_point()]
            self.tokens += ids.numel()


def train_step(m: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, world: int) -> None:
    """One data-parallel step: the gradients averaged over the ranks (what DDP / FSDP do), then SGD."""
    m(input_ids=ids, labels=ids).loss.backward()
    for p in m.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world
    opt.step()
    opt.zero_grad()


def reference(world: int) -> tuple[Loads, list[torch.Tensor]]:
    """One process, float64, every rank's batch at once; the update from the global counts."""
    import transformers

    # transformers 4.x's DeepSeek-V3 MoE routes in fp32 and index_adds into an fp32 buffer: float32 there
    m = model(torch.float64 if int(transformers.__version__.split(".")[0]) >= 5 else torch.float32)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    loads = Loads(m)
    for step in range(STEPS):
        ids = torch.cat([batch(r, world, step) for r in range(world)])
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for gate, load in zip(gates(m), loads.now):
                mean = load.double().mean()
                bias = gate.e_score_correction_bias
                bias.copy_(bias.double() + GAMMA * torch.sign(mean - load.double()))
        loads.close_step(reduce=False)
    return loads, [g.e_score_correction_bias.detach().clone() for g in gates(m)]


def spread(biases: list[torch.Tensor]) -> float:
    """Largest difference between any rank's bias and rank 0's."""
    worst = 0.0
    for b in biases:
        ref = b.clone()
        dist.broadcast(ref, 0)
        d = torch.tensor([float((b - ref).abs().max())])
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        worst = max(worst, float(d))
    return worst


def main() -> None:
    rank, world, _ = setup()
    singles = [dist.new_group([r]) for r in range(world)]  # each rank alone: the per-rank update
    runs = {"none": model(), "local": model(), "fix": model(checkpointing=True)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=LR) for k, m in runs.items()}
    loads = {k: Loads(m) for k, m in runs.items()}
    naive = Naive(runs["fix"])
    local = zb.router_bias(runs["local"], gamma=GAMMA, optimizer=opts["local"], group=singles[rank])
    fix = zb.router_bias(runs["fix"], gamma=GAMMA, optimizer=opts["fix"])
    for step in range(STEPS):
        ids = batch(rank, world, step)
        for k, m in runs.items():
            train_step(m, opts[k], ids, world)
            loads[k].close_step(reduce=True)
    local.remove()
    fix.remove()
    ref_loads, ref_bias = reference(world)
    tail = STEPS - STEPS // 4
    ref_first, ref_last = ref_loads.imbalance(0, 1), ref_loads.imbalance(tail, STEPS)
    table = Table(f"moe_router_bias: {world} ranks, tiny DeepseekV3ForCausalLM (2 MoE layers, {EXPERTS} experts, "
                  f"top-2), gamma={GAMMA}, {STEPS} steps, expert preference differs per rank",
                  ["imbalance step 1", f"imbalance last {STEPS // 4}", "bias spread", "max |bias - REF|",
                   "tokens counted / routed"])
    table.kinds["REF"] = "one process, float64, the global batch, the update from the global counts"
    counts = naive.tokens / (STEPS * BATCH * SEQ * 2 * len(gates(runs["fix"])))  # top-2: two choices per token
    for kind, case, key, ok_of in (
            ("BUG", "no update (transformers as shipped): the bias stays 0", "none",
             lambda imb, sp, err: imb > ref_last and err > 1e-3),
            ("BUG", "per-rank update from local counts", "local", lambda imb, sp, err: sp > 0 and err > 1e-3),
            ("FIX", "router_bias: global counts, once per micro-batch (reentrant checkpointing)", "fix",
             lambda imb, sp, err: sp == 0 and err < 1e-6 and abs(imb - ref_last) < 1e-9)):
        biases = [g.e_score_correction_bias.detach() for g in gates(runs[key])]
        sp = spread(biases)
        err = max(float((b.double() - r).abs().max()) for b, r in zip(biases, ref_bias))
        imb = loads[key].imbalance(tail, STEPS)
        table.add(kind, case, [loads[key].imbalance(0, 1), imb, sp, err, "1" if key == "fix" else "-"],
                  ok_of(imb, sp, err))
        if key == "local":
            table.add("BUG", "hand-written counter in every train-mode forward (checkpointing)",
                      ["-", "-", "-", "-", f"{counts:g}"], counts == 2)
    table.add("REF", "single process, global batch, float64", [ref_first, ref_last, 0.0, 0.0, "1"], None)
    table.note("imbalance: max / mean tokens per expert over the global batch (1.0 = balanced), mean over layers")
    table.finish()


if __name__ == "__main__":
    main()
