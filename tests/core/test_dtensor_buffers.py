"""DTensor buffers by placement ([Note: placements]), at world 4 on a 2x2 (dp x tp) mesh: Replicate synced over its
dimensions, Partial reduced by its op and relabelled Replicate, Shard synced over the other dimension only; each
checked against a float64 reference computed here. Then a torchtitan-style MoE (``expert_bias`` Replicate,
``tokens_per_expert`` Partial over dp, summed before the optimizer step) beside a BatchNorm passes every tool."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal, bn_mixture

TIMEOUT = 240.0


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # rank = 2 * dp + tp


def _rep_value(rank):
    return torch.tensor([0.1, 0.2, 0.3], dtype=torch.float32) * (1 + rank)


def _summand(dp):
    return torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float32) * (dp + 1) + 0.1


GLOBAL = torch.arange(8, dtype=torch.float32) / 3  # the sharded buffer's full value


def _holder(rank, mesh):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    dp, tp = divmod(rank, 2)
    m = nn.Module()
    m.register_buffer("rep", DTensor.from_local(_rep_value(rank), mesh, [Replicate(), Replicate()], run_check=False))
    m.register_buffer("counts", DTensor.from_local(_summand(dp), mesh, [Partial(), Replicate()], run_check=False))
    m.register_buffer("peak", DTensor.from_local(torch.tensor([float(rank), 3.0 - rank]), mesh,
                                                 [Partial("max"), Partial("max")], run_check=False))
    shard = GLOBAL[4 * tp:4 * tp + 4].clone()
    if dp == 1:
        shard += 0.5  # the dp=1 replica of each shard drifted
    m.register_buffer("table", DTensor.from_local(shard, mesh, [Replicate(), Shard(0)], run_check=False))
    return m


def _state(m):
    return {n: (b.to_local().clone(), tuple(type(p).__name__ for p in b.placements), b.full_tensor().clone())
            for n, b in m.named_buffers()}


def _by_placement(rank, world, tool):
    mesh = _mesh()
    m = _holder(rank, mesh)
    before = zb.buffer_report(m, group=mesh)
    if tool == "sync_buffers":
        n = zb.sync_buffers(m, rules={"rep": "mean"}, group=mesh)
    else:
        n = zb.broadcast_buffers(m, src=3, group=mesh)
    after = zb.buffer_report(m, group=mesh)
    rows = {r.name: (r.in_sync, r.differing_ranks, r.mesh_dims, r.coordinates, r.placement) for r in before.rows}
    return {"n": n, "state": _state(m), "rows": rows, "after": after.in_sync}


@pytest.mark.parametrize("tool", ["sync_buffers", "broadcast_buffers"])
def test_replicate_partial_and_shard_buffers_are_synced_by_placement_to_a_float64_reference(ranks4, tool):
    out = ranks4.run(_by_placement, tool, timeout=TIMEOUT)
    f64 = torch.float64
    if tool == "sync_buffers":  # "rep": the mean of the four ranks; the dp=0 replica of each shard (src=0)
        rep = torch.stack([_rep_value(r).to(f64) for r in range(4)]).mean(0)
        shards = [GLOBAL[4 * tp:4 * tp + 4].to(f64) for tp in (0, 1)]
    else:  # src=3 = (dp=1, tp=1): its value, and the dp=1 replica of each shard
        rep = _rep_value(3).to(f64)
        shards = [GLOBAL[4 * tp:4 * tp + 4].to(f64) + 0.5 for tp in (0, 1)]
    counts = _summand(0).to(f64) + _summand(1).to(f64)  # Partial(sum) over dp: the sum of the dp summands
    for rank, o in enumerate(out):
        s = o["state"]
        assert o["n"] == 4 and o["after"]
        assert torch.allclose(s["rep"][0].to(f64), rep, rtol=0, atol=1e-6), (rank, s["rep"][0])
        assert s["rep"][1] == ("Replicate", "Replicate")
        assert torch.allclose(s["counts"][2].to(f64), counts, rtol=0, atol=1e-6)  # the value never changes
        if tool == "sync_buffers":  # reduced by its op and relabelled Replicate
            assert torch.allclose(s["counts"][0].to(f64), counts, rtol=0, atol=1e-6), (rank, s["counts"][0])
            assert s["counts"][1] == ("Replicate", "Replicate")
            assert s["peak"][0].tolist() == [3.0, 3.0] and s["peak"][1] == ("Replicate", "Replicate")
        else:  # a broadcast copies: the summands stay this rank's, still Partial
            assert bitwise_equal(s["counts"][0], _summand(rank // 2)) and s["counts"][1] == ("Partial", "Replicate")
            assert s["peak"][0].tolist() == [rank, 3.0 - rank] and s["peak"][1] == ("Partial", "Partial")
        assert s["peak"][2].tolist() == [3.0, 3.0]
        tp = rank % 2
        assert torch.allclose(s["table"][0].to(f64), shards[tp], rtol=0, atol=1e-6), (rank, s["table"][0])
        assert s["table"][1] == ("Replicate", "Shard")  # a shard stays a shard: only its dp replicas were synced
        assert torch.allclose(s["table"][2].to(f64), torch.cat(shards), rtol=0, atol=1e-6)
        # before: the report compares each buffer only where it is replicated
        rows = o["rows"]
        assert rows["table"] == (False, (2, 3), ("dp",), ((1, 0), (1, 1)), "dp:R,tp:S(0)"), rows["table"]
        assert rows["counts"][:2] == (True, ()) and rows["counts"][4] == "dp:P(sum),tp:R"
        assert rows["peak"][:2] == (True, ())  # partial on both dimensions: nothing to compare
        assert rows["rep"][:3] == (False, (1, 2, 3), ("dp", "tp")), rows["rep"]
    assert all(bitwise_equal(o["state"]["rep"][0], out[0]["state"]["rep"][0]) for o in out)


# ============================================================================ a torchtitan-style MoE beside a BatchNorm

DIM, EXPERTS, TOP_K, GAMMA = 8, 4, 2, 1e-3


class TitanMoE(nn.Module):
    """The documented pattern of torchtitan's MoE (written here, not copied): the router picks experts by
    ``sigmoid(scores) + expert_bias`` (the bias steers selection only); ``expert_bias`` is a persistent Replicate
    buffer, ``tokens_per_expert`` a non-persistent one that each forward adds this rank's counts to, Partial over the
    data-parallel ranks (each sees its own tokens), replicated over tensor parallel (the router is replicated)."""

    def __init__(self, mesh):
        from torch.distributed.tensor import DTensor, Partial, Replicate
        super().__init__()
        self.mesh = mesh
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))
        self.register_buffer("expert_bias", DTensor.from_local(torch.zeros(EXPERTS), mesh, [Replicate(), Replicate()],
                                                               run_check=False), persistent=True)
        self.register_buffer("tokens_per_expert", DTensor.from_local(torch.zeros(EXPERTS), mesh,
                                                                     [Partial(), Replicate()], run_check=False),
                             persistent=False)

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Partial, Replicate
        scores = torch.sigmoid(self.router(x))
        _, chosen = torch.topk(scores + self.expert_bias.to_local(), TOP_K, dim=-1)
        if self.training:
            with torch.no_grad():
                counts = torch.bincount(chosen.reshape(-1), minlength=EXPERTS).float()
                self.tokens_per_expert.add_(DTensor.from_local(counts, self.mesh, [Partial(), Replicate()],
                                                               run_check=False))
        weights = scores.gather(-1, chosen)
        out = torch.zeros_like(x)
        for k in range(TOP_K):
            for e in range(EXPERTS):
                hit = chosen[:, k] == e
                if hit.any():
                    out[hit] += weights[hit, k:k + 1] * self.experts[e](x[hit])
        return out


class Net(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.bn = nn.BatchNorm1d(DIM)
        self.moe = TitanMoE(mesh)

    def forward(self, x):
        return self.moe(self.bn(x))


def _batch(dp, step):
    g = torch.Generator().manual_seed(1000 + 10 * dp + step)
    return torch.randn(16, DIM, generator=g) * (1 + dp) + 2.0 * dp  # the dp ranks see different data


def _update_bias(moe):
    """torchtitan's optimizer pre-step hook: the bias moves by gamma * sign(mean load - load), identically on every
    rank once the counts are global; the counts start again."""
    with torch.no_grad():
        load = moe.tokens_per_expert.to_local()
        moe.expert_bias.to_local().add_(GAMMA * torch.sign(load.mean() - load))
        moe.tokens_per_expert.zero_()


def _bn_local(bn):
    return (float(bn.num_batches_tracked), bn.running_mean.to(torch.float64).clone(),
            bn.running_var.to(torch.float64).clone())


def _titan(rank, world):
    mesh = _mesh()
    dp = rank // 2
    torch.manual_seed(0)
    net = Net(mesh)
    out = {}
    # 1. drift: one TP rank's bias differs; the report names it, broadcast_buffers and assert_buffers_in_sync agree
    with torch.no_grad():
        if rank == 1:
            net.moe.expert_bias.to_local().add_(0.25)
    report = zb.buffer_report(net, group=mesh)
    out["drift"] = [(r.name, r.differing_ranks, r.mesh_dims, r.coordinates) for r in report.out_of_sync]
    out["broadcast"] = zb.broadcast_buffers(net, group=mesh)
    zb.assert_buffers_in_sync(net, group=mesh)
    # 2. keep_in_sync: BatchNorm merged and the bias kept equal before every forward; the Partial counts left alone
    handle = zb.keep_in_sync(net, group=mesh)
    net.train()
    for step in range(2):
        net(_batch(dp, step))
        if step == 0 and rank == 2:
            with torch.no_grad():
                net.moe.expert_bias.to_local().add_(1.0)  # a drift the next sync repairs
    net(_batch(dp, 2))
    handle.sync()  # the syncs run before each forward: one more after the last
    handle.remove()
    out["kept"] = {n: b.to_local().clone() if hasattr(b, "to_local") else b.clone() for n, b in net.named_buffers()}
    out["kept_counts_placement"] = tuple(type(p).__name__ for p in net.moe.tokens_per_expert.placements)
    # 3. the optimizer step: BatchNorm statistics before the merge, then sync_buffers with rules (BN merged, the
    # counts summed over dp), the bias update on the global counts
    out["bn_local"] = _bn_local(net.bn)
    out["local_counts"] = net.moe.tokens_per_expert.to_local().clone()
    zb.sync_buffers(net, rules={"*.expert_bias": "broadcast"}, group=mesh)
    out["global_counts"] = net.moe.tokens_per_expert.to_local().clone()
    out["bn_synced"] = _bn_local(net.bn)
    _update_bias(net.moe)
    out["bias"] = net.moe.expert_bias.to_local().clone()
    # 4. average_bn_stats on a model that also holds DTensor buffers: the BatchNorm alone is merged
    net(_batch(dp, 3))
    out["bn_local2"] = _bn_local(net.bn)
    zb.average_bn_stats(net, group=mesh)
    out["bn_avg"] = _bn_local(net.bn)
    zb.assert_buffers_in_sync(net, group=mesh)
    out["state_dict"] = sorted(net.state_dict())
    out["bias_in_state"] = tuple(type(p).__name__ for p in net.state_dict()["moe.expert_bias"].placements)
    return out


def _reference_counts(steps):
    """Single process, float64: the tokens each expert got over both dp batches of ``steps``, from the same weights."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(DIM).double()
    router = nn.Linear(DIM, EXPERTS, bias=False).double()
    total = torch.zeros(EXPERTS, dtype=torch.float64)
    for step in steps:
        for dp in (0, 1):
            x = bn(_batch(dp, step).double())  # train mode: normalised by its own batch
            _, chosen = torch.topk(torch.sigmoid(router(x)), TOP_K, dim=-1)
            total += torch.bincount(chosen.reshape(-1), minlength=EXPERTS).double()
    return total


def test_a_torchtitan_style_moe_with_dtensor_buffers_passes_every_tool(ranks4):
    out = ranks4.run(_titan, timeout=TIMEOUT)
    for o in out:
        assert o["drift"] == [("moe.expert_bias", (1,), ("dp", "tp"), ((0, 1),))], o["drift"]
        assert o["broadcast"] == 5  # bn (3), expert_bias, tokens_per_expert
        assert o["kept_counts_placement"] == ("Partial", "Replicate")  # keep_in_sync left the counts alone
        for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "moe.expert_bias"):
            assert bitwise_equal(o["kept"][name], out[0]["kept"][name]), name
        assert o["kept"]["moe.expert_bias"].abs().max() == 0  # rank 2's drift was repaired before the next forward
        experts = [f"moe.experts.{e}.{p}" for e in range(EXPERTS) for p in ("weight", "bias")]
        assert o["state_dict"] == sorted(["bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
                                          "bn.num_batches_tracked", "moe.router.weight", "moe.expert_bias", *experts])
        assert o["bias_in_state"] == ("Replicate", "Replicate")
    # the counts each rank added are its dp batch's; summed over dp they are the global batch's (float64 reference)
    reference = _reference_counts(range(3))
    for o in out:
        assert torch.equal(o["global_counts"].double(), reference), (o["global_counts"], reference)
        assert bitwise_equal(o["bias"], out[0]["bias"])
        assert torch.equal(o["bias"], (GAMMA * torch.sign(reference.mean() - reference)).float())  # one update
    assert torch.equal(out[0]["local_counts"] + out[2]["local_counts"], out[0]["global_counts"])
    assert not torch.equal(out[0]["local_counts"], out[2]["local_counts"])  # the dp ranks did see different tokens
    # BatchNorm: sync_buffers and average_bn_stats give the exact mixture of the four ranks' statistics
    for key, synced in (("bn_local", "bn_synced"), ("bn_local2", "bn_avg")):
        _, mean, var = bn_mixture([{"bn": o[key]} for o in out], "bn")
        for o in out:
            assert torch.allclose(o[synced][1], mean, rtol=0, atol=1e-6)
            assert torch.allclose(o[synced][2], var, rtol=0, atol=1e-6)


# ============================================================================ faults, placements as rules, keep_in_sync

def _fault_on_one_line(rank, world, tool, phase):
    """Rank 3 fails at ``phase``; rank 0 and 2 (the other tp line) would have finished their own line's collectives:
    every rank of the mesh must raise the same error and keep its buffers."""
    from zero_buffers._core import transaction as _transaction
    mesh = _mesh()
    m = _holder(rank, mesh)
    before = _state(m)
    real = _transaction.reached

    def fail(at, what):
        if at.value == phase:
            raise RuntimeError(f"injected at {phase} on rank {rank}")
        real(at, what)
    if rank == 3:
        _transaction.reached = fail
    try:
        if tool == "sync_buffers":
            zb.sync_buffers(m, rules={"rep": "mean"}, group=mesh, timeout=60)
        else:
            zb.broadcast_buffers(m, group=mesh, timeout=60)
        raised = None
    except zb.SyncAbortedError as e:
        raised = (type(e).__name__, e.ranks)
    finally:
        _transaction.reached = real
    after = _state(m)
    same = all(bitwise_equal(before[n][0], after[n][0]) and before[n][1] == after[n][1] for n in before)
    return raised, same


@pytest.mark.parametrize("tool", ["sync_buffers", "broadcast_buffers"])
@pytest.mark.parametrize("phase", ["prepare", "exchange"])
def test_a_rank_failing_on_one_mesh_line_makes_every_rank_raise_and_change_nothing(ranks4, tool, phase):
    out = ranks4.run(_fault_on_one_line, tool, phase, timeout=TIMEOUT)
    assert all(o == (("SyncAbortedError", (3,)), True) for o in out), out


def _rules_and_kept(rank, world):
    from torch.distributed.tensor import Partial, Replicate, Shard
    mesh = _mesh()
    plain = nn.Module()
    plain.register_buffer("hits", torch.tensor([float(rank), 1.0]))
    plain.register_buffer("top", torch.tensor([float(rank)]))
    plain.register_buffer("ref", torch.tensor([float(rank)]))
    zb.sync_buffers(plain, rules={"hits": Partial(), "top": Partial("max"), "ref": Replicate()}, group=mesh)
    out = {"plain": [plain.hits.tolist(), plain.top.tolist(), plain.ref.tolist()]}
    try:
        zb.sync_buffers(plain, rules={"hits": Shard(0)}, group=mesh)
    except zb.InvalidArgumentError as e:
        out["shard_rule"] = str(e)
    m = _holder(rank, mesh)
    handle = zb.keep_in_sync(m, group=mesh, rules={"rep": "mean"})
    handle.sync()
    handle.remove()
    out["kept"] = _state(m)
    return out


def test_rules_may_name_placements_and_keep_in_sync_syncs_shards_over_their_replicas(ranks4):
    out = ranks4.run(_rules_and_kept, timeout=TIMEOUT)
    f64 = torch.float64
    rep = torch.stack([_rep_value(r).to(f64) for r in range(4)]).mean(0)
    for rank, o in enumerate(out):
        assert o["plain"] == [[6.0, 4.0], [3.0], [0.0]]  # Partial() sums, Partial("max"), Replicate() from rank 0
        assert "names the placement Shard(dim=0)" in o["shard_rule"], o["shard_rule"]
        kept = o["kept"]
        assert torch.allclose(kept["rep"][0].to(f64), rep, rtol=0, atol=1e-6)
        tp = rank % 2
        assert bitwise_equal(kept["table"][0], GLOBAL[4 * tp:4 * tp + 4]), kept["table"][0]  # dp=0's replica, its shard
        assert bitwise_equal(kept["counts"][0], _summand(rank // 2))  # Partial: left to sync_buffers
        assert kept["counts"][1] == ("Partial", "Replicate")
