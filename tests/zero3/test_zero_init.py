"""Init and install() on real DeepSpeed ZeRO-3 ranks: every module built under zero.Init gets the source rank's
buffers, and install() makes DeepSpeed's own contexts and transformers' from_pretrained do the same.

zb.Init alone and nested (bf16 buffers too, a body that raises, a module argument synced at once); install() and
uninstall() restore every patch (with and without a process group, a clear error without DeepSpeed); a rank-0 load
through DeepSpeed's GatheredParameters under install() reaches every rank, per module and for the whole model, and
from_pretrained under HfDeepSpeedConfig and Accelerate; install() together with zb.Init syncs once, leaves buffers
alone in DeepSpeed's 16-bit export, and syncs each data-parallel subgroup from its own first rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import (
    HF5,
    ZERO3_CONFIG,
    buffers,
    init_deepspeed,
    log_collectives,
    restore_collectives,
    same_state,
)
from tests.zero3.models import VQ, Block, checkpoint, full_params

# the tests of what DeepSpeed, transformers and Accelerate do: run on both dependency stacks (.ci/run)
pytestmark = pytest.mark.stack


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


def test_install_without_deepspeed_installs_the_fsdp_loads_and_refuses_only_keep_precision(monkeypatch):
    import sys

    from torch.distributed.checkpoint import state_dict as dsd
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.zero", None)
    original = dsd._load_model_state_dict
    with pytest.raises(zb.DeepSpeedUnavailableError, match="need DeepSpeed"):
        zb.install(keep_precision=True)  # what it keeps is what zero.Init converts and DeepSpeed engines
    assert not zb.installed() and dsd._load_model_state_dict is original
    with zb.install() as handle:
        assert handle.owner and zb.installed() and dsd._load_model_state_dict is not original
    assert not zb.installed() and dsd._load_model_state_dict is original


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
    for rank, o in enumerate(out):  # once per job: on rank 0 only
        assert len(o["warnings"]) == (rank == 0) and all("got no ZeRO parameter" in w for w in o["warnings"]), o

        one, every = o["rank 0"], o["every rank"]  # the shapes differ across ranks: the structure check says so
        assert one is not None and one[0] == "BufferStructureError" and "<ZeRO ds_id=" in one[1], one
        assert every is not None and every[0] == "SyncAbortedError", every  # equal shapes: the refusal says why
        assert "ZeRO parameter ds_id=" in every[1] and "cannot re-partition" in every[1], every
        assert o["unchanged"]
        assert o["synced"] == 7  # the ZeRO Linear (2 parameters) is left to DeepSpeed
        assert torch.equal(o["plain"], out[0]["plain"])


# ---- with DeepSpeed's own contexts, its 16-bit export, data-parallel subgroups ---------------------------------------
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
        return built, loaded, buffers(model), full_params(model)


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
