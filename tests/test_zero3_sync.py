"""ZeRO-3 sync at init and at load: GatheredParametersAndBuffers, Init and install() on real DeepSpeed ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import DS_NESTING_CHECK, HF5, ZERO3_CONFIG, buffers, init_deepspeed, same_state

# the tests of what DeepSpeed, transformers and Accelerate do: run on both dependency stacks (.ci/run)
pytestmark = pytest.mark.stack


class VQ(nn.Module):
    """BatchNorm + a codebook made with randn (differs per rank under zero.Init) + a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("codebook", torch.randn(6, 4))
        self.register_buffer("table", torch.randn(3), persistent=False)


def checkpoint() -> dict[str, torch.Tensor]:
    """A 'pretrained' state dict every rank can rebuild (only rank 0 will load it)."""
    torch.manual_seed(99)
    ref = VQ()
    with torch.no_grad():
        ref.bn.running_mean.uniform_(1, 2)
        ref.bn.running_var.uniform_(3, 4)
        ref.bn.num_batches_tracked.fill_(42)
    return ref.state_dict()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather ZeRO-3 parameters read-only and copy them out."""
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _load_rank0_only(rank, world, ours):
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)  # rank-specific randomness, as in real jobs
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        model = VQ()
    sd = checkpoint()
    ctx = zb.GatheredParametersAndBuffers(model, modifier_rank=0) if ours else \
        deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0)
    with ctx:
        if rank == 0:
            model.load_state_dict(sd)
    partitioned = all(p.numel() == 0 for p in model.parameters())  # re-partitioned on exit
    return buffers(model), full_params(model), partitioned


@pytest.mark.parametrize("ours", [False, True], ids=["deepspeed", "ours"])
def test_rank0_only_load_reaches_every_rank(ranks, ours):
    sd = checkpoint()
    out = ranks.run(_load_rank0_only, ours, timeout=120)
    want_buffers = {k: sd[k] for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "codebook")}
    for rank, (bufs, params, partitioned) in enumerate(out):
        assert partitioned
        assert same_state(params, {k: sd[k] for k in params})  # DeepSpeed handles parameters either way
        persistent_ok = same_state({k: bufs[k] for k in want_buffers}, want_buffers)
        if ours or rank == 0:
            assert persistent_ok, rank
        else:  # the bug: only rank 0 has the checkpoint's buffers
            assert not persistent_ok
            assert bufs["bn.running_mean"].abs().sum() == 0 and int(bufs["bn.num_batches_tracked"]) == 0
        if ours:  # the non-persistent buffer is not in the checkpoint: everyone takes rank 0's
            assert torch.equal(bufs["table"], out[0][0]["table"])


def _check_on_enter(rank, world, differ, check):
    deepspeed = init_deepspeed()
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        model = VQ()
    zb.broadcast_buffers(model)
    with torch.no_grad():
        if differ and rank == world - 1:
            model.bn.running_var += 1
    before = buffers(model)
    try:
        with zb.GatheredParametersAndBuffers(model, check_buffers=check) as ctx:
            gathered = all(p.numel() > 0 for p in model.parameters())
            assert isinstance(ctx, zb.GatheredParametersAndBuffers)
    except zb.BuffersOutOfSyncError as e:
        return str(e), None, same_state(before, buffers(model)), all(p.numel() == 0 for p in model.parameters())
    return None, gathered, same_state(before, buffers(model)), all(p.numel() == 0 for p in model.parameters())


@pytest.mark.parametrize("differ,check", [(True, True), (True, False), (False, True)])
def test_modifier_none_verifies_buffers_on_enter(ranks, differ, check):
    out = ranks.run(_check_on_enter, differ, check, timeout=120)
    for err, gathered, unchanged, partitioned in out:
        assert unchanged and partitioned
        if differ and check:
            assert err == out[0][0] and "bn.running_var" in err and f"{ranks.world_size - 1}" in err
        else:
            assert err is None and gathered


def _plain_model(rank, world):
    torch.manual_seed(rank)
    model = VQ()  # no DeepSpeed at all: a DDP-style replica
    sd = checkpoint()
    with zb.GatheredParametersAndBuffers([model], modifier_rank=0):
        if rank == 0:
            model.load_state_dict(sd)
    return {**buffers(model), **{n: p.detach().clone() for n, p in model.named_parameters()}}


def test_works_without_zero_parameters(ranks):
    sd = checkpoint()
    out = ranks.run(_plain_model)
    for state in out:
        assert same_state({k: state[k] for k in sd}, sd)  # parameters and persistent buffers
        assert torch.equal(state["table"], out[0]["table"])  # non-persistent: rank 0's


def _aligned_zero3_vq(rank):
    """A VQ built under zero.Init with rank-seeded randomness, buffers aligned; and its state before any load."""
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        model = VQ()
    zb.broadcast_buffers(model)
    return model, buffers(model), full_params(model)


def _body_raises(rank, world, failing, load_on, snapshot=True):
    model, before_buffers, before_params = _aligned_zero3_vq(rank)
    sd = checkpoint()
    try:
        with zb.GatheredParametersAndBuffers(model, modifier_rank=0, snapshot=snapshot):
            if rank in load_on:
                model.load_state_dict(sd)
                model.bn.running_var = torch.full((4,), 7.0)  # replaced, not copied into: must come back too
            if rank in failing:
                raise ValueError(f"bad file on rank {rank}")
    except ValueError as e:
        seen = ("ValueError", str(e))
    except zb.ZeroBuffersError as e:
        seen = (type(e).__name__, str(e), getattr(e, "ranks", None), getattr(e, "reasons", None))
    else:
        seen = None
    partitioned = all(p.numel() == 0 for p in model.parameters())
    return (seen, partitioned, same_state(before_buffers, buffers(model)),
            same_state(before_params, full_params(model)), rank)


@pytest.mark.parametrize("where", ["all", "one", "modifier"])
def test_exception_in_body_commits_nothing_on_any_rank(ranks, where):
    """All or nothing: rank 0 loads, some rank raises -> no rank keeps any loaded weight or buffer."""
    last = ranks.world_size - 1
    failing = {"all": list(range(ranks.world_size)), "one": [last], "modifier": [0]}[where]
    out = ranks.run(_body_raises, failing, [0, last], timeout=120)
    for seen, partitioned, buffers_unchanged, params_unchanged, rank in out:
        assert partitioned  # DeepSpeed's context was exited on every rank
        if rank in failing:
            assert seen == ("ValueError", f"bad file on rank {rank}")
        else:  # the others learn who failed and why
            name, _, failed, reasons = seen
            assert name == "SyncAbortedError" and failed == tuple(failing), seen
            assert reasons == {r: f"ValueError: bad file on rank {r}" for r in failing}, reasons
        # DeepSpeed's GatheredParameters alone would broadcast rank 0's loaded weights here
        assert params_unchanged, f"rank {rank}: half-loaded parameters"
        assert buffers_unchanged, f"rank {rank}: half-loaded buffers"


def test_without_snapshot_a_failure_commits_no_parameter_and_broadcasts_nothing(ranks2):
    out = ranks2.run(_body_raises, [1], [0], False, timeout=120)
    (seen0, _, buffers0, params0, _), (seen1, _, buffers1, params1, _) = out
    assert seen0[0] == "SyncAbortedError" and seen0[2] == (1,) and seen1[0] == "ValueError"
    assert params0 and params1  # ZeRO parameters are still discarded (no copy needed for them)
    assert not buffers0 and buffers1  # rank 0's loaded buffers stay as its body left them: nothing broadcast


def _ds_alone_body_raises(rank, world):
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        model = VQ()
    before = full_params(model)
    try:
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            if rank == 0:
                model.load_state_dict(checkpoint())
            if rank == world - 1:
                raise ValueError("bad file")
    except ValueError:
        pass
    return same_state(before, full_params(model))


def test_deepspeed_alone_leaves_a_half_loaded_model_when_a_body_raises(ranks2):
    """The control for the test above: the bug we fix is real in deepspeed 0.19.8."""
    assert ranks2.run(_ds_alone_body_raises, timeout=120) == [False, False]


def _structure_fails_on_exit(rank, world):
    model, before_buffers, before_params = _aligned_zero3_vq(rank)
    try:
        with zb.GatheredParametersAndBuffers(model, modifier_rank=0):
            if rank == 0:
                model.load_state_dict(checkpoint())
            if rank == world - 1:
                model.bn.register_buffer("extra", torch.zeros(2))  # this rank's structure now differs
    except zb.BufferStructureError as e:
        seen = str(e)
    else:
        seen = None
    # the buffer the body registered is gone again: before_buffers has no "bn.extra"
    return seen, same_state(before_buffers, buffers(model)), same_state(before_params, full_params(model))


def test_failed_buffer_sync_on_exit_commits_nothing(ranks):
    out = ranks.run(_structure_fails_on_exit, timeout=120)
    for seen, buffers_unchanged, params_unchanged in out:
        assert seen == out[0][0] and "bn.extra" in seen
        assert buffers_unchanged and params_unchanged


def _group_mismatch(rank, world):
    deepspeed = init_deepspeed()
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        model = VQ()
    pair = dist.new_group([0, 1])
    try:
        zb.GatheredParametersAndBuffers(model, modifier_rank=0, group=pair)
    except zb.InvalidArgumentError as e:
        return str(e)
    return None


def test_group_other_than_the_zero_parameters_group_is_refused_at_construction(ranks4):
    """DeepSpeed broadcasts over the parameters' group: agreeing on failure over a smaller one could deadlock."""
    out = ranks4.run(_group_mismatch, timeout=120)  # members and non-members of the pair alike
    for rank, e in enumerate(out):
        assert e and f"(as seen on rank {rank}) but the ZeRO parameters are partitioned over ranks [0, 1, 2, 3]" in e, e
        if rank < 2:
            assert "group has ranks [0, 1]" in e, e


def _snapshot_fails_on_one_rank(rank, world):
    model, before_buffers, _ = _aligned_zero3_vq(rank)
    if rank == world - 1:  # a 4 TiB broadcast view: copying it runs out of memory, like a too-large model would
        model.bn.register_buffer("broken", torch.zeros(1).expand(2**40))
    try:
        with zb.GatheredParametersAndBuffers(model, modifier_rank=0):
            pass
    except (RuntimeError, zb.ZeroBuffersError) as e:
        seen = (type(e).__name__, str(e), getattr(e, "ranks", None), type(e.__cause__).__name__, str(e.__cause__))
    else:
        seen = None
    if rank == world - 1:
        del model.bn._buffers["broken"]
    partitioned = all(p.numel() == 0 for p in model.parameters())  # DeepSpeed never gathered
    return seen, partitioned, same_state(before_buffers, buffers(model))


def test_a_rank_failing_to_take_the_rollback_copy_makes_every_rank_raise_on_enter(ranks):
    out = ranks.run(_snapshot_fails_on_one_rank, timeout=120)
    last = ranks.world_size - 1
    for rank, (seen, partitioned, unchanged) in enumerate(out):
        assert partitioned and unchanged
        name, text, failed, cause, cause_text = seen
        assert name == "SyncAbortedError" and failed == (last,) and "entering failed" in text, seen
        assert "can't allocate memory" in text  # the failing rank's reason, on every rank
        if rank == last:  # its own exception is chained
            assert cause == "RuntimeError" and "can't allocate memory" in cause_text


def _nested_overlap(rank, world, outer_kind):
    deepspeed = init_deepspeed()
    model, before_buffers, before_params = _aligned_zero3_vq(rank)
    outer = zb.GatheredParametersAndBuffers(model, modifier_rank=0) if outer_kind == "ours" else \
        deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0)
    error, ran = None, False
    with outer:
        try:
            with zb.GatheredParametersAndBuffers(model, modifier_rank=0):  # parameters held by the outer context
                ran = True
                if rank == 0:
                    model.load_state_dict(checkpoint())
        except zb.ZeroBuffersError as e:
            error = (type(e).__name__, str(e), getattr(e, "ranks", None))
        held = all(p.numel() > 0 for p in model.parameters())  # the outer context is intact
    return (error, ran, held, same_state(before_buffers, buffers(model)),
            same_state(before_params, full_params(model)), all(p.numel() == 0 for p in model.parameters()))


@pytest.mark.parametrize("outer_kind", ["ours", "deepspeed"])
def test_nested_overlap_raises_on_every_rank_before_the_body(ranks, outer_kind):
    """As DeepSpeed: an inner context on parameters an outer one holds raises on enter (voted, so every rank raises
    the same SyncAbortedError); its body never runs, nothing changes, the outer context exits normally."""
    if not DS_NESTING_CHECK:
        pytest.skip("DeepSpeed < 0.19.4 neither refuses overlapping nested GatheredParameters nor marks held ones")
    out = ranks.run(_nested_overlap, outer_kind, timeout=120)
    everyone = tuple(range(ranks.world_size))
    for error, ran, held, buffers_unchanged, params_unchanged, partitioned in out:
        assert error[0] in ("SyncAbortedError", "ZeroBuffersError"), error  # voted, or raised locally as DeepSpeed
        assert error[0] != "SyncAbortedError" or error[2] == everyone, error
        assert "Nested GatheredParameters contexts cannot overlap parameters" in error[1]
        assert not ran and held and buffers_unchanged and params_unchanged and partitioned


def _swapped_data(rank, world):
    torch.manual_seed(0)
    model = VQ()  # plain (DDP-style) replica
    before = {**buffers(model), **{n: p.detach().clone() for n, p in model.named_parameters()}}
    try:
        with zb.GatheredParametersAndBuffers(model, modifier_rank=0):
            if rank == 0:
                model.double()  # swaps .data of every floating parameter and buffer
                model.bn.running_mean.resize_(2)
                raise ValueError("wrong file")
    except (ValueError, zb.ZeroBuffersError):
        pass
    after = {**buffers(model), **{n: p.detach().clone() for n, p in model.named_parameters()}}
    return same_state(before, after), {n: t.dtype for n, t in after.items()}


def test_rollback_restores_dtype_shape_and_values(ranks2):
    for unchanged, dtypes in ranks2.run(_swapped_data, timeout=60):
        assert unchanged and dtypes["proj.weight"] == torch.float32 and dtypes["bn.num_batches_tracked"] == torch.int64


def _registrations_and_dtypes(rank, world, how):
    model, before_buffers, before_params = _aligned_zero3_vq(rank)
    original = model.proj.weight
    try:
        with zb.GatheredParametersAndBuffers(model, modifier_rank=0):
            if rank == 0:
                if how == "assign":
                    model.load_state_dict(checkpoint(), assign=True)  # new Parameter objects replace ZeRO's
                    model.add_module("head", nn.Linear(4, 2))  # and the body adds a submodule and a buffer
                    model.register_buffer("scale", torch.ones(1), persistent=False)
                else:
                    model.proj.weight.data = model.proj.weight.data.double()  # a gathered ZeRO parameter
            if rank == world - 1:
                raise ValueError("bad file")
    except (ValueError, zb.ZeroBuffersError):
        pass
    added = hasattr(model, "head") or hasattr(model, "scale") or "scale" in model._non_persistent_buffers_set
    return (model.proj.weight is original and not added, hasattr(model.proj.weight, "ds_id"), model.proj.weight.dtype,
            same_state(before_buffers, buffers(model)), same_state(before_params, full_params(model)))


@pytest.mark.parametrize("how", ["assign", "dtype"])
def test_rollback_restores_zero_parameter_objects_and_dtypes(ranks, how):
    assert ranks.run(_registrations_and_dtypes, how, timeout=120) == \
        [(True, True, torch.float32, True, True)] * ranks.world_size


def _materialize_meta_in_body(rank, world):
    torch.manual_seed(rank)
    model = VQ()
    model.codebook = torch.empty(6, 4, device="meta")  # built on meta, materialised and loaded in the body
    with zb.GatheredParametersAndBuffers(model, modifier_rank=0):
        model.codebook = torch.full((6, 4), float(rank))
    return model.codebook.clone()


def test_meta_buffers_materialised_in_the_body(ranks):
    assert all(torch.equal(c, torch.zeros(6, 4)) for c in ranks.run(_materialize_meta_in_body, timeout=60))


def _subgroup_plain(rank, world):
    import torch.distributed as dist
    pair = dist.new_group([0, 1])
    torch.manual_seed(rank)
    model = VQ()
    before = buffers(model)
    with zb.GatheredParametersAndBuffers(model, modifier_rank=0, group=pair):
        pass
    bad = None
    try:
        zb.GatheredParametersAndBuffers(model, modifier_rank=2, group=pair)
    except zb.InvalidSourceRankError as e:
        bad = str(e)
    return same_state(before, buffers(model)), buffers(model)["codebook"], bad


def test_plain_model_on_a_subgroup_non_members_untouched_and_bad_modifier_refused_at_construction(ranks4):
    out = ranks4.run(_subgroup_plain, timeout=60)
    assert torch.equal(out[1][1], out[0][1]) and out[0][0] and not out[1][0]  # members: rank 0's codebook
    assert out[2][0] and out[3][0]  # non-members: a no-op
    assert all(bad and "modifier_rank=2 is not a rank of the group" in bad for _, _, bad in out[:2])


def _targets(rank, world, kind):
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        a, b = VQ(), VQ()
    zb.broadcast_buffers(a)
    zb.broadcast_buffers(b)
    sd = checkpoint()
    target = {"param": a.proj.weight, "params": list(a.parameters()), "modules": [a, b], "fwd_module": a,
              "disabled": a}[kind]
    kw = {"fwd_module": a} if kind == "fwd_module" else {"enabled": False} if kind == "disabled" else {}
    with zb.GatheredParametersAndBuffers(target, modifier_rank=0, **kw):
        gathered = a.proj.weight.numel() == 16
        if rank == 0:
            with torch.no_grad():
                if kind in ("param", "params"):
                    a.proj.weight.fill_(3.0)
                elif kind != "disabled":
                    a.load_state_dict(sd)
                    if kind == "modules":
                        b.load_state_dict(sd)
    return gathered, full_params(a), full_params(b), buffers(a), buffers(b)


@pytest.mark.parametrize("kind", ["param", "params", "modules", "fwd_module", "disabled"])
def test_accepts_what_deepspeed_accepts_and_modules(ranks, kind):
    sd = checkpoint()
    sd_bufs = {k: sd[k] for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "codebook")}
    out = ranks.run(_targets, kind, timeout=120)
    for gathered, pa, pb, ba, bb in out:
        assert gathered == (kind != "disabled")
        if kind in ("param", "params"):  # rank 0's write reached every rank (parameter lists: their owners'
            # buffers are covered by tests/zero3/test_param_list_owners.py; here they agreed before and still do)
            assert torch.equal(pa["proj.weight"], torch.full((4, 4), 3.0))
            assert same_state(ba, out[0][3])
        elif kind == "disabled":  # a no-op: nothing gathered, nothing broadcast
            assert same_state(pa, out[0][1]) and not same_state(pa, {k: sd[k] for k in pa})
        else:
            assert same_state(pa, {k: sd[k] for k in pa}) and same_state({k: ba[k] for k in sd_bufs}, sd_bufs)
            assert torch.equal(ba["table"], out[0][3]["table"])  # non-persistent: rank 0's
            if kind == "modules":
                assert same_state(pb, {k: sd[k] for k in pb}) and same_state({k: bb[k] for k in sd_bufs}, sd_bufs)
            else:  # b was not named: its parameters are untouched and rank-independent (zero.Init)
                assert not same_state(pb, {k: sd[k] for k in pb})


def test_bad_targets_and_ranks_are_typed_errors():
    with zb.GatheredParametersAndBuffers(None, modifier_rank=0):  # as DeepSpeed: nothing ZeRO manages, a no-op
        pass
    with zb.GatheredParametersAndBuffers([None, torch.ones(2)], modifier_rank=0):
        pass
    # where DeepSpeed silently does nothing, ours names the mistake (intended)
    with pytest.raises(zb.InvalidArgumentError, match="expected a module, a parameter"):
        zb.GatheredParametersAndBuffers(3, modifier_rank=0)
    with pytest.raises(zb.InvalidArgumentError, match="item 1 is a str"):
        zb.GatheredParametersAndBuffers([VQ(), "x"])
    with pytest.raises(zb.InvalidSourceRankError, match="modifier_rank must be a non-negative int"):
        zb.GatheredParametersAndBuffers(VQ(), modifier_rank="0")
    with pytest.raises(zb.InvalidSourceRankError, match=r"install\(\): src must be"):
        zb.install(src="a")
    assert not zb.installed()
    with pytest.raises(zb.InvalidSourceRankError, match=r"zero_buffers.Init\(\): src must be"):
        zb.Init(src=-1)
    import numpy as np
    for rank in (np.int64(0), torch.tensor(0)):  # what DeepSpeed itself accepts as a rank
        with zb.GatheredParametersAndBuffers(VQ(), modifier_rank=rank):
            pass
    for rank in (np.int64(-1), torch.tensor(-1), 0.0, True):
        with pytest.raises(zb.InvalidSourceRankError, match="modifier_rank must be a non-negative int"):
            zb.GatheredParametersAndBuffers(VQ(), modifier_rank=rank)


def _init(rank, world, ours, nested, dtype):
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)
    # dtype only when asked: deepspeed 0.19.8's Init._set_dtype turns any explicit dtype into bf16 on CPU
    kw = dict(config_dict_or_path=ZERO3_CONFIG, **({"dtype": dtype} if dtype != torch.float32 else {}))
    outer = zb.Init(**kw) if ours and nested != "ds_outer" else deepspeed.zero.Init(**kw)
    inner = zb.Init(**kw) if ours else deepspeed.zero.Init(**kw)
    with outer:
        first = VQ()
        if nested:
            with inner:
                second = VQ()
        else:
            second = VQ()
        in_context = buffers(second)
    return buffers(first), buffers(second), in_context["codebook"].dtype


@pytest.mark.parametrize("ours,nested", [(False, None), (False, "nested"), (True, None), (True, "nested"),
                                          (True, "ds_outer")])
def test_init_syncs_buffers_of_every_module_built_inside(ranks, ours, nested):
    out = ranks.run(_init, ours, nested, torch.float32, timeout=120)
    for first, second, dtype in out[1:]:
        assert dtype == torch.float32
        if ours and nested == "ds_outer":  # only what was built inside zero_buffers.Init is synced
            assert same_state(second, out[0][1]) and not torch.equal(first["codebook"], out[0][0]["codebook"])
        elif ours:
            assert same_state(first, out[0][0]) and same_state(second, out[0][1])
        else:  # the bug: randn buffers differ per rank while the parameters beside them agree
            assert not torch.equal(first["codebook"], out[0][0]["codebook"])
            assert not torch.equal(second["table"], out[0][1]["table"])


def test_init_bf16_buffers(ranks):
    out = ranks.run(_init, True, None, torch.bfloat16, timeout=120)
    assert out[0][2] == torch.bfloat16 and out[0][0]["codebook"].dtype == torch.bfloat16
    for first, second, _ in out[1:]:
        assert same_state(out[0][0], first) and same_state(out[0][1], second)


def _init_raises(rank, world, failing):
    deepspeed = init_deepspeed()
    pp = deepspeed.runtime.zero.partition_parameters
    torch.manual_seed(rank)
    try:
        with zb.Init(config_dict_or_path=ZERO3_CONFIG):
            model = VQ()
            if rank in failing:
                raise KeyError("boom")
    except KeyError:
        seen = "KeyError"
    except zb.ZeroBuffersError as e:
        seen = (type(e).__name__, e.ranks)
    else:
        seen = None
    restored = pp.zero_init_context == 0 and pp.top_level_context is None
    hook_off = not hasattr(pp.Init._post_init_method, "_zb_original")
    return seen, restored and hook_off, model.codebook.clone()


@pytest.mark.parametrize("where", ["all", "one"])
def test_init_exception_in_body(ranks, where):
    last = ranks.world_size - 1
    failing = list(range(ranks.world_size)) if where == "all" else [last]
    out = ranks.run(_init_raises, failing, timeout=120)
    assert all(restored for _, restored, _ in out)
    for rank, (seen, _, codebook) in enumerate(out):
        if rank in failing:
            assert seen == "KeyError"
        else:
            assert seen == ("SyncAbortedError", (last,))
        if rank:
            assert not torch.equal(out[0][2], codebook)  # nothing was broadcast


def _install(rank, world, use_install):
    deepspeed = init_deepspeed()
    pp = deepspeed.runtime.zero.partition_parameters
    base = pp.InsertPostInitMethodToModuleSubClasses
    from transformers.modeling_utils import PreTrainedModel
    gp = pp.GatheredParameters
    originals = (base.__enter__, base.__exit__, pp.Init._post_init_method, gp.__init__, gp.__enter__, gp.__exit__,
                 PreTrainedModel.__dict__["from_pretrained"])
    torch.manual_seed(rank)
    if use_install:
        handle = zb.install()
        again = zb.install()  # idempotent
        assert zb.installed() and not again.owner and handle.owner
        with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
            with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
                inner = VQ()
            outer = VQ()
        zb.uninstall()
        zb.uninstall()
    else:
        with zb.install():  # as a context manager
            with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
                inner, outer = VQ(), VQ()
    restored = (base.__enter__, base.__exit__, pp.Init._post_init_method, gp.__init__, gp.__enter__, gp.__exit__,
                PreTrainedModel.__dict__["from_pretrained"]) == originals and not zb.installed()
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        after = VQ()  # uninstalled: the bug is back
    return buffers(inner), buffers(outer), buffers(after), restored


@pytest.mark.parametrize("use_install", [True, False], ids=["call", "context"])
def test_install_syncs_every_zero_init_and_uninstall_restores(ranks, use_install):
    out = ranks.run(_install, use_install, timeout=120)
    for inner, outer, after, restored in out[1:]:
        assert restored
        assert same_state(inner, out[0][0]) and same_state(outer, out[0][1])
        assert not torch.equal(after["codebook"], out[0][2]["codebook"])


def _from_pretrained(rank, world, path, use_install, via):
    init_deepspeed()
    from tests.hf_tiny import TinyModel, save_reference, zero3_switched_on
    if rank == 0:
        save_reference(path)
    dist.barrier()
    torch.manual_seed(rank)
    with zero3_switched_on(via, ZERO3_CONFIG):  # transformers now builds under a zero.Init it opens itself
        if use_install:
            with zb.install():
                model = TinyModel.from_pretrained(path)
        else:
            model = TinyModel.from_pretrained(path)
    return buffers(model), model.lin.weight.numel() == 0


@pytest.mark.parametrize("via", ["hf_config", "accelerate"])
@pytest.mark.parametrize("use_install", [False, True], ids=["plain", "install"])
def test_install_covers_transformers_from_pretrained(ranks, tmp_path, use_install, via):
    """transformers opens zero.Init when its global config says ZeRO-3, or an Accelerator's ZeRO-3 plugin does."""
    out = ranks.run(_from_pretrained, str(tmp_path), use_install, via, timeout=180)
    for rank, (bufs, partitioned) in enumerate(out):
        assert partitioned  # really built under zero.Init
        # transformers 5 broadcasts persistent checkpoint buffers; 4.x loads them on rank 0 only (incident 1)
        loaded = bufs["bn.running_mean"].tolist() == list(range(8))
        assert loaded == (use_install or HF5 or rank == 0), rank
    same_noise = all(torch.equal(b["noise"], out[0][0]["noise"]) for b, _ in out)
    assert same_noise == use_install  # the non-persistent buffer only agrees with install()


def test_install_without_deepspeed_is_a_clear_error(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.zero", None)
    with pytest.raises(zb.DeepSpeedUnavailableError, match="need DeepSpeed"):
        zb.install()
    assert not zb.installed()


def _init_with_module(rank, world):
    init_deepspeed()
    torch.manual_seed(rank)
    model = VQ()  # built outside any Init: rank-specific codebook
    before = buffers(model)
    zb.Init(module=model, config_dict_or_path=ZERO3_CONFIG)  # converts an existing module at once
    return before, buffers(model), all(hasattr(p, "ds_id") for p in model.parameters())


def test_init_with_module_argument_syncs_that_module_at_once(ranks):
    out = ranks.run(_init_with_module, timeout=120)
    b0 = out[0][0]
    for _, after, converted in out:
        assert converted  # DeepSpeed converted the parameters
        assert same_state(after, b0)  # rank 0's buffers everywhere
    assert not same_state(out[1][0], b0)  # they differed before


def test_install_without_a_process_group_patches_and_restores(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from deepspeed.runtime.zero import partition_parameters as pp
    from transformers.modeling_utils import PreTrainedModel

    from zero_buffers.zero3 import zero_init
    base = pp.InsertPostInitMethodToModuleSubClasses
    originals = (base.__enter__, base.__exit__, pp.GatheredParameters.__enter__,
                 PreTrainedModel.__dict__["from_pretrained"])
    with zb.install() as handle:
        assert handle.owner and zb.installed() and base.__enter__ is not originals[0]
        assert not zb.install().owner  # idempotent
        assert zero_init.sync_built_modules([VQ()], failed=False, src=0, group=None, timeout=None,
                                            what="test") == 0  # no process group: the sync is a no-op
    assert not zb.installed()
    assert (base.__enter__, base.__exit__, pp.GatheredParameters.__enter__,
            PreTrainedModel.__dict__["from_pretrained"]) == originals


def _documented_load(rank, world, use_install, how):
    """DeepSpeed's documented loading: build under zero.Init, then rank 0 loads inside GatheredParameters."""
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)
    if use_install:
        zb.install()
    try:
        with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
            model = VQ()
        sd = checkpoint()
        if how == "per_module":  # the walk in GatheredParameters' docstring (the root owns no parameter: an empty list)
            def load(module, prefix=""):
                with deepspeed.zero.GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=0):
                    if rank == 0:
                        module._load_from_state_dict(sd, prefix, {}, True, [], [], [])
                for name, child in module._modules.items():
                    if child is not None:
                        load(child, prefix + name + ".")
            load(model)
        else:
            with deepspeed.zero.GatheredParameters(model.parameters(), modifier_rank=0):
                if rank == 0:
                    model.load_state_dict(sd)
    finally:
        zb.uninstall()
    return buffers(model), full_params(model)


@pytest.mark.parametrize("how", ["per_module", "whole_model"])
@pytest.mark.parametrize("use_install", [True, False], ids=["install", "plain"])
def test_install_documented_rank0_load_reaches_every_rank(ranks2, use_install, how):
    sd = checkpoint()
    out = ranks2.run(_documented_load, use_install, how, timeout=120)
    bn = {k: sd[k] for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")}
    for rank, (bufs, params) in enumerate(out):
        assert same_state(params, {k: sd[k] for k in params})  # DeepSpeed's part, either way
        if use_install or rank == 0:
            assert same_state({k: bufs[k] for k in bn}, bn), rank
        else:  # the bug install() fixes: rank 1 keeps BatchNorm's defaults
            assert bufs["bn.running_mean"].abs().sum() == 0 and bufs["bn.running_var"].eq(1).all()
            assert int(bufs["bn.num_batches_tracked"]) == 0
        # install() broadcasts the own buffers of the modules owning the gathered parameters and of their ancestors
        # when rank 0's body changed any of them: VQ's codebook sits on the root, an ancestor of proj and bn. In the
        # per-module walk the root's own context is empty (a no-op) and the codebook rides along with bn's load
        assert torch.equal(bufs["codebook"], sd["codebook"]) == (use_install or rank == 0), rank


def _zero3_details(rank, world):
    """install()'s warning for a gather over tensors ZeRO does not manage; a body that swaps a gathered ZeRO
    parameter's data for another shape is refused on every rank; include_parameters leaves ZeRO parameters alone."""
    import warnings

    from zero_buffers.zero3 import zero_init

    deepspeed = init_deepspeed()
    out = {}
    zero_init._warned.clear()
    with zb.install(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = torch.zeros(3)
        for _ in range(2):  # warns once, and is DeepSpeed's no-op (no collective: a rank-0-only call cannot hang)
            with deepspeed.zero.GatheredParameters([plain], modifier_rank=0):
                pass
        with deepspeed.zero.GatheredParameters([], modifier_rank=0):  # an empty list (DeepSpeed's own exports): silent
            pass
    out["warnings"] = [str(w.message) for w in caught if "zero_buffers.install()" in str(w.message)]

    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        model = VQ()
    zb.broadcast_buffers(model)
    before = buffers(model)
    for who in ("rank 0", "every rank"):  # not the parameter's shape: DeepSpeed could not re-partition it
        try:
            with zb.GatheredParametersAndBuffers(model, modifier_rank=0):
                if rank == 0 or who == "every rank":
                    model.proj.weight.data = torch.zeros(2, 2)
            out[who] = None
        except zb.ZeroBuffersError as e:
            out[who] = (type(e).__name__, str(e))
    out["unchanged"] = same_state(before, buffers(model)) and all(p.numel() == 0 for p in model.parameters())

    torch.manual_seed(rank)
    mixed = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        mixed.append(nn.Linear(2, 2))
    out["synced"] = zb.broadcast_buffers(mixed, include_parameters=True)  # 3 BN buffers, 4 plain params, no ZeRO
    out["plain"] = mixed[0].weight.detach().clone()
    return out


def test_zero3_details_warning_refused_shape_change_and_include_parameters(ranks2):
    out = ranks2.run(_zero3_details, timeout=120)
    for o in out:
        assert len(o["warnings"]) == 1 and "got no ZeRO parameter" in o["warnings"][0], o["warnings"]
        one, every = o["rank 0"], o["every rank"]  # the shapes differ across ranks: the structure check says so
        assert one is not None and one[0] == "BufferStructureError" and "<ZeRO ds_id=" in one[1], one
        assert every is not None and every[0] == "SyncAbortedError", every  # equal shapes: the refusal says why
        assert "ZeRO parameter ds_id=" in every[1] and "cannot re-partition" in every[1], every
        assert o["unchanged"]
        assert o["synced"] == 7  # the ZeRO Linear (2 parameters) is left to DeepSpeed
        assert torch.equal(o["plain"], out[0]["plain"])
