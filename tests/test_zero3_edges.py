"""ZeRO-3 edge cases (reliability): nesting with DeepSpeed's own contexts, after deepspeed.initialize, DeepSpeed's
16-bit export under install(), data-parallel subgroups."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import (
    DS_NESTING_CHECK,
    ZERO3_CONFIG,
    buffers,
    init_deepspeed,
    log_collectives,
    restore_collectives,
    same_state,
)

# the tests of what DeepSpeed, transformers and Accelerate do: run on both dependency stacks (.ci/run)
pytestmark = pytest.mark.stack


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _nested_same_parameters(rank, world, inner, inner_mr):
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)
    if inner == "installed":
        zb.install()
    try:
        with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
            model = Block()
        with torch.no_grad():
            model.bn.running_mean.fill_(rank)  # per-rank buffers: nothing may broadcast them
        before_buffers, before_params = buffers(model), _full_params(model)
        error, ran = None, False
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            ctx = zb.GatheredParametersAndBuffers(model, modifier_rank=inner_mr) if inner == "ours" else \
                deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=inner_mr)
            try:
                with ctx:
                    ran = True
                    if rank == 0:
                        model.load_state_dict({k: torch.full_like(v, 7) for k, v in model.state_dict().items()})
            except RuntimeError as e:  # DeepSpeed's RuntimeError; ours are ZeroBuffersError (a RuntimeError)
                error = (type(e).__name__, str(e), getattr(e, "ranks", None))
            held = all(p.numel() > 0 for p in model.parameters())
    finally:
        zb.uninstall()
    return (error, ran, held, same_state(before_buffers, buffers(model)),
            same_state(before_params, _full_params(model)), all(p.numel() == 0 for p in model.parameters()))


@pytest.mark.parametrize("inner,inner_mr", [("ours", 0), ("ours", None), ("installed", 0), ("deepspeed", 0)])
def test_ours_nested_inside_deepspeeds_gather_of_the_same_parameters_raises_like_deepspeed(ranks, inner, inner_mr):
    """DeepSpeed raises on an inner context overlapping an outer one; ours raises too, on every rank, before its body,
    with nothing changed and no hang (modifier_rank set: voted, SyncAbortedError everywhere; None: DeepSpeed's check).
    The outer context then exits normally."""
    if not DS_NESTING_CHECK:
        pytest.skip("DeepSpeed < 0.19.4 neither refuses overlapping nested GatheredParameters nor marks held ones")
    out = ranks.run(_nested_same_parameters, inner, inner_mr, timeout=120)
    for error, ran, held, buffers_unchanged, params_unchanged, partitioned in out:
        assert error and "Nested GatheredParameters contexts cannot overlap parameters" in error[1], error
        if inner != "deepspeed":  # voted (SyncAbortedError, every rank named) or raised locally as DeepSpeed does
            assert error[0] in ("SyncAbortedError", "ZeroBuffersError"), error
            assert error[0] != "SyncAbortedError" or error[2] == tuple(range(ranks.world_size)), error
        assert not ran and held and partitioned
        assert buffers_unchanged and params_unchanged


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Block(), Block()


def rank0_checkpoint() -> dict[str, torch.Tensor]:
    """Values no rank has before the load (and which only rank 0 will load)."""
    ref = Block()
    with torch.no_grad():
        ref.lin.weight.fill_(7.0)
        ref.lin.bias.fill_(-1.0)
        ref.bn.weight.fill_(2.0)
        ref.bn.running_mean.copy_(torch.arange(4.0) + 5)
        ref.bn.running_var.fill_(3.5)
        ref.bn.num_batches_tracked.fill_(9)
    return ref.state_dict()


def _nested_other_parameters(rank, world, inner):
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        model = Pair()
    sd = rank0_checkpoint() if rank == 0 else None
    with deepspeed.zero.GatheredParameters(list(model.a.parameters()), modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.a.lin.weight.fill_(3.0)
        ctx = zb.GatheredParametersAndBuffers(model.b, modifier_rank=0) if inner == "ours" else \
            deepspeed.zero.GatheredParameters(list(model.b.parameters()), modifier_rank=0)
        with ctx:  # disjoint from the outer context: allowed
            gathered_inside = all(p.numel() > 0 for p in model.parameters())
            if rank == 0:
                model.b.load_state_dict(sd)
    params = _full_params(model)
    return gathered_inside, buffers(model.b), {k[2:]: v for k, v in params.items() if k.startswith("b.")}, \
        params["a.lin.weight"], all(p.numel() == 0 for p in model.parameters())


@pytest.mark.parametrize("inner", ["ours", "deepspeed"])
def test_ours_nested_inside_deepspeeds_gather_of_other_parameters(ranks, inner):
    """Rank 0 loads values no other rank has: with ours every rank ends with them, buffers AND params; with
    DeepSpeed's class in the same place (the feature deleted) only the parameters arrive."""
    sd = rank0_checkpoint()
    bn = {k: sd[k] for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")}
    out = ranks.run(_nested_other_parameters, inner, timeout=120)
    for rank, (gathered_inside, bufs, params, outer_weight, partitioned) in enumerate(out):
        assert gathered_inside and partitioned
        assert same_state(params, {k: sd[k] for k in params})  # parameters: DeepSpeed's broadcast, either way
        assert torch.equal(outer_weight, torch.full((4, 4), 3.0))  # the outer context committed too
        assert same_state(bufs, bn) == (inner == "ours" or rank == 0), rank


def _no_zero_init_nested_and_after_initialize(rank, world):
    deepspeed = init_deepspeed()
    import torch._dynamo  # noqa: F401 - its first import (by the optimizer) breaks under zero.Init's Tensor.__new__ patch
    pp = deepspeed.runtime.zero.partition_parameters
    seen = {}
    cfg = {**ZERO3_CONFIG, "zero_allow_untested_optimizer": True}
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        with deepspeed.zero.Init(config_dict_or_path=cfg):  # nested zero.Init
            with zb.no_zero_init():
                seen["nested"] = all(p.numel() > 0 and not hasattr(p, "ds_id") for p in Block().parameters())
            seen["inner_after"] = all(hasattr(p, "ds_id") for p in Block().parameters())
        seen["outer_after"] = all(hasattr(p, "ds_id") for p in Block().parameters())
        model = Block()
        # deepspeed.initialize inside an active Init does its own shutdown/restore of the context
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
        with zb.no_zero_init():
            seen["after_initialize"] = all(not hasattr(p, "ds_id") for p in Block().parameters())
        seen["still_active"] = all(hasattr(p, "ds_id") for p in Block().parameters())
    seen["closed"] = pp.top_level_context is None and pp.zero_init_context == 0
    return seen


def test_no_zero_init_in_nested_inits_and_after_deepspeed_initialize(ranks):
    for seen in ranks.run(_no_zero_init_nested_and_after_initialize, timeout=180):
        assert all(seen.values()), seen


def _install_with_own_init(rank, world):
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)
    calls, log = [], []
    import zero_buffers._core.transaction as tx
    real = tx.broadcast  # the one transactional broadcast every sync goes through: broadcast(g, entries, src, call, ..)

    def counting(g, entries, src, call, deadline, what, **kw):
        calls.append((what, len(entries)))
        real_collectives = log_collectives(log)  # only the sync's own collectives (not zero.Init's parameter ones)
        try:
            return real(g, entries, src, call, deadline, what, **kw)
        finally:
            restore_collectives(real_collectives)

    tx.broadcast = counting
    try:
        with zb.install():
            with zb.Init(config_dict_or_path=ZERO3_CONFIG):
                with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
                    model = Block()
                    model.register_buffer("codebook", torch.randn(3))
    finally:
        tx.broadcast = real
    return calls, buffers(model), log


def test_install_and_own_init_together_sync_once(ranks):
    out = ranks.run(_install_with_own_init, timeout=120)
    for calls, bufs, log in out:
        assert calls == [("zero_buffers.Init", 4)]  # one sync, not two (bn's three buffers and the codebook)
        # its collectives: the structure vote (3 int64), one broadcast per (dtype) bucket, the received-OK vote
        assert log == [("all_gather", "torch.int64", 3), ("broadcast", "torch.float32", 11),
                       ("broadcast", "torch.int64", 1), ("all_gather", "torch.int64", 1)], log
        assert same_state(bufs, out[0][1])


class RootOwned(Block):
    """The root owns a parameter of its own (so DeepSpeed's per-module export gathers a non-empty list there)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


def _export_16bit(rank, world, root_owns_a_parameter):
    deepspeed = init_deepspeed()
    import torch._dynamo  # noqa: F401 - its first import (by the optimizer) breaks under zero.Init's Tensor.__new__ patch
    cfg = {**ZERO3_CONFIG, "zero_allow_untested_optimizer": True}
    torch.manual_seed(0)
    with zb.install():
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = RootOwned() if root_owns_a_parameter else Block()
        engine = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)[0]
        with torch.no_grad():  # deliberately different per rank (each rank's own statistics, say)
            model.bn.running_mean.fill_(rank + 1)
            model.bn.running_var.fill_(10 + rank)
            model.bn.num_batches_tracked.fill_(rank)
        before = buffers(model)
        sd = engine._zero3_consolidated_16bit_state_dict()  # every rank; only rank 0 reads, modifier_rank=0
        after = buffers(model)
    return before, after, None if sd is None else {k: v.clone() for k, v in sd.items()}


@pytest.mark.parametrize("root_owns_a_parameter", [True, False], ids=["root-param", "no-root-param"])
def test_install_leaves_buffers_alone_in_deepspeeds_16bit_export(ranks2, root_owns_a_parameter):
    """The export's contexts have modifier_rank=0 but a read-only body: install() must not broadcast rank 0's
    buffers over the others' (it broadcasts owners' buffers only when rank r's body changed them)."""
    out = ranks2.run(_export_16bit, root_owns_a_parameter, timeout=180)
    for rank, (before, after, _) in enumerate(out):
        assert same_state(before, after), f"rank {rank}: the export changed this rank's buffers"
        assert float(after["bn.running_mean"][0]) == rank + 1
    sd = out[0][2]
    assert sd["lin.weight"].shape == (4, 4) and same_state({k: sd[k] for k in out[0][0]}, out[0][0])


class CodebookBN(nn.BatchNorm1d):
    """A BatchNorm that also keeps a random codebook: its parameters' owner holds every buffer."""

    def __init__(self, n: int):
        super().__init__(n)
        self.register_buffer("codebook", torch.randn(2, n))


class GroupBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = CodebookBN(4)


def group_checkpoint(group: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(50 + group)
    ref = GroupBlock()
    with torch.no_grad():
        ref.bn.running_mean.uniform_(1, 2)
        ref.bn.running_var.uniform_(3, 4)
        ref.bn.num_batches_tracked.fill_(10 + group)
    return ref.state_dict()


def _data_parallel_groups(rank, world):
    deepspeed = init_deepspeed()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in the same order
    g, member = rank // 2, rank % 2
    torch.manual_seed(rank)
    with zb.install():
        with deepspeed.zero.Init(data_parallel_group=groups[g], config_dict_or_path=ZERO3_CONFIG):
            model = GroupBlock()
        built = buffers(model)  # zero.Init's sync: from group rank 0 (global 0 and 2)
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            if member == 0:  # rank 0 of each group loads its group's checkpoint
                model.load_state_dict(group_checkpoint(g))
        loaded = buffers(model)
        with deepspeed.zero.GatheredParameters([model.bn.weight], modifier_rank=1):  # group rank 1: global 1 and 3
            if member == 1:
                model.bn.running_mean.fill_(100 + rank)
        return built, loaded, buffers(model), _full_params(model)


def test_install_with_data_parallel_subgroups(ranks4):
    """Two DP groups {0,1} and {2,3}: ranks are group-relative everywhere (as DeepSpeed's modifier_rank)."""
    out = ranks4.run(_data_parallel_groups, timeout=180)
    for rank, (built, loaded, final, params) in enumerate(out):
        g, first = rank // 2, out[rank - rank % 2]
        sd = group_checkpoint(g)
        assert same_state(built, first[0]), rank  # equal within the group after construction
        assert same_state(loaded, {k: sd[k] for k in loaded}), rank  # the group's own checkpoint, on both members
        assert same_state(params, {k: sd[k] for k in params}), rank
        assert torch.equal(final["bn.running_mean"], torch.full((4,), 100.0 + 2 * g + 1)), rank
    assert not torch.equal(out[0][0]["bn.codebook"], out[2][0]["bn.codebook"])  # each group synced on its own
