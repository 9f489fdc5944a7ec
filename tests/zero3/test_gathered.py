"""GatheredParametersAndBuffers on real DeepSpeed ZeRO-3 ranks: a rank-0 load inside it reaches every rank's
parameters and buffers, all or nothing.

``modifier_rank=None`` checks the buffers agree on enter; a body that raises (on every rank, one, or the modifier),
a failed buffer sync on exit, a rank that cannot take the rollback copy, or a foreign exception while receiving
commit nothing on any rank, and the rollback restores dtypes, shapes, values and ZeRO parameter objects. What
DeepSpeed accepts (a parameter, a list, modules, ``fwd_module``, ``enabled=False``) is accepted; nesting with
DeepSpeed's own contexts behaves as DeepSpeed's does (overlap refused on every rank before the body). How the
owners of a parameter list are found: tests/zero3/test_param_list_owners.py; ours against DeepSpeed's, call site by
call site: tests/zero3/test_gathered_dropin.py."""
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
    same_state,
)
from tests.zero3.models import VQ, Block, checkpoint, full_params

# the tests of what DeepSpeed, transformers and Accelerate do: run on both dependency stacks (.ci/run)
pytestmark = pytest.mark.stack


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


# ---- a foreign exception after the vote is still agreed on -----------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)


def _fails_while_receiving(rank, world, where):
    """Rank 1 hits a RuntimeError that is not ours right after the data broadcast (an OOM, say) while rank 0 loads."""
    deepspeed = init_deepspeed()
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        model = Net()
    torch.manual_seed(0)
    reference = Net()
    with torch.no_grad():
        reference.bn.running_mean.fill_(7.0)
    real = dist.broadcast

    def failing_broadcast(*args, **kwargs):
        real(*args, **kwargs)  # the collective went out; then this rank fails
        raise RuntimeError("CUDA out of memory (simulated while receiving)")

    before = buffers(model)
    try:
        with zb.GatheredParametersAndBuffers(model, modifier_rank=0):
            if rank == 0:
                model.load_state_dict(reference.state_dict())
            if rank == 1 and where == "receive":
                dist.broadcast = failing_broadcast
    except zb.ZeroBuffersError as e:
        caught = (type(e).__name__, str(e))
    else:
        caught = None
    finally:
        dist.broadcast = real
    partitioned = all(p.numel() == 0 for p in model.parameters())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return caught, same_state(before, buffers(model)), partitioned, params


def test_a_foreign_exception_while_receiving_makes_every_rank_roll_back(ranks):
    out = ranks.run(_fails_while_receiving, "receive", timeout=90)
    for rank, (caught, unchanged, partitioned, params) in enumerate(out):
        assert caught is not None and caught[0] == "SyncAbortedError", (rank, caught)
        assert "receiving failed on rank 1" in caught[1] and "CUDA out of memory" in caught[1], caught
        assert unchanged and partitioned  # nothing committed, parameters re-partitioned
        assert same_state(params, out[0][3])  # ZeRO shards kept their values from before on every rank
    assert not torch.equal(out[0][3]["lin.weight"], torch.zeros(4, 4))


# ---- nested inside DeepSpeed's own GatheredParameters ----------------------------------------------------------------
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
        before_buffers, before_params = buffers(model), full_params(model)
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
            same_state(before_params, full_params(model)), all(p.numel() == 0 for p in model.parameters()))


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
    params = full_params(model)
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
