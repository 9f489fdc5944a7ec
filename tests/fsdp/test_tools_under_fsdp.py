"""FSDP2 (fully_shard), FSDP1 and torch Distributed Checkpoint on 2 and 4 real gloo ranks, on transformers' ResNet.

Every body trains a tiny transformers ResNet under ``fully_shard`` (each stage, then the root) for two steps on
rank-shifted data, so every BatchNorm buffer differs across ranks while every parameter is a DTensor shard. The
references come from the ranks' own statistics (the exact mixture, ``tests.helpers.bn_mixture``) or from the
data itself (the first BatchNorm's population statistics), never from zero_buffers.
"""
from __future__ import annotations

import pickle
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal, bn_mixture, messages

TIMEOUT = 240
FIRST_BN = "resnet.embedder.embedder.normalization"


# ============================================================================================ in-rank helpers

def _resnet(seed: int = 0) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification
    torch.manual_seed(seed)
    return ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                                     depths=[1, 1], layer_type="basic", num_labels=3))


def _shard(model: nn.Module, mesh=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    for stage in model.resnet.encoder.stages:
        fully_shard(stage, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _images(rank: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, 3, 16, 16, generator=g) * (1 + rank) + 2.0 * rank  # each rank its own "site"


def _trained(rank: int, mesh=None) -> nn.Module:
    """The sharded ResNet after two steps on this rank's own data: BatchNorm buffers differ across ranks."""
    model = _shard(_resnet(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2):
        model(pixel_values=_images(rank, 4, step)).logits.square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def _stats(model: nn.Module) -> dict[str, tuple[int, torch.Tensor, torch.Tensor]]:
    """Every BatchNorm's (count, mean, var) in float64, as test_bn_average's reference wants them."""
    return {n: (int(m.num_batches_tracked), m.running_mean.double().clone(), m.running_var.double().clone())
            for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter as this rank holds it: its DTensor shard, or the plain tensor of an unsharded group."""
    return {n: (p.to_local() if _is_dtensor(p) else p).detach().clone() for n, p in model.named_parameters()}


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _full_copy(model: nn.Module) -> nn.Module:
    """A plain ResNet holding the sharded model's full weights and buffers (every rank must call)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plain = _resnet()
    plain.load_state_dict(full)
    return plain


def _forward(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=batch)


def _population(plain: nn.Module, batches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance, per channel, of the first BatchNorm's input over ``batches`` (float64)."""
    with torch.no_grad():
        x = torch.cat([plain.resnet.embedder.embedder.convolution(b) for b in batches]).double()
    flat = x.transpose(0, 1).reshape(x.shape[1], -1)
    return flat.mean(1), flat.var(1)


# ============================================================================================ every tool under FSDP2

def _unevenly_unsharded(model: nn.Module, rank: int) -> None:
    """An eval forward leaves the root unsharded on every rank; a rank-0-only state_dict() reshards it there alone."""
    model.eval()
    with torch.no_grad():
        model(pixel_values=_images(rank, 2, 50))
    model.train()
    if rank == 0:
        model.state_dict()


def _tools_on_fully_shard(rank, world):
    model = _trained(rank)
    out = {"stats": _stats(model), "dtensor_params": all(_is_dtensor(p) for p in model.parameters())}
    _unevenly_unsharded(model, rank)  # the root's parameters now plain on some ranks: still FSDP's, never synced
    shards = _local_shards(model)
    report = zb.buffer_report(model)
    out["report_diverged"] = sorted(r.name for r in report.out_of_sync)
    # include_parameters=True: the sharded (DTensor) parameters are not plain tensors: never broadcast
    out["synced_with_params"] = zb.broadcast_buffers(model, src=world - 1, include_parameters=True)
    out["after_broadcast"] = _buffers(model)
    out["shards_kept"] = all(bitwise_equal(shards[n], t) for n, t in _local_shards(model).items())
    # average_bn_stats from the trained statistics (the broadcast made them equal: train one more step first)
    model = _trained(rank)
    out["before_average"] = _stats(model)
    zb.average_bn_stats(model)
    out["averaged"] = _stats(model)
    zb.assert_buffers_in_sync(model)
    # recompute with uneven shards, one rank empty: rank r has (r + 1) batches except rank 1, which has none
    batches = [] if rank == 1 else [_images(rank, 3, 10 + i) for i in range(rank + 1)]
    every = [_images(r, 3, 10 + i) for r in range(world) if r != 1 for i in range(r + 1)]
    plain = _full_copy(model)
    out["population"] = _population(plain, every)
    shards = _local_shards(model)  # every group sharded (after the backward)
    _unevenly_unsharded(model, rank)  # the unshard must still be one all-gather per group on every rank
    out["written"] = zb.recompute_bn_stats(model, batches, forward=_forward)
    out["recomputed"] = _buffers(model)
    out["written_global"] = zb.recompute_bn_stats(model, batches, forward=_forward, global_batch=True)
    out["recomputed_global"] = _buffers(model)
    out["still_sharded"] = all(_is_dtensor(p) for p in model.parameters()) and \
        all(bitwise_equal(shards[n], t) for n, t in _local_shards(model).items())
    # a forward that raises on one rank: RecomputeError on every rank, nothing written, FSDP's state recovered
    before = _buffers(model)

    def failing(m, batch):
        if rank == world - 1:
            raise ValueError("bad batch")
        return m(pixel_values=batch)
    try:
        zb.recompute_bn_stats(model, [_images(rank, 2, 7)], forward=failing)
        out["failed"] = None
    except zb.RecomputeError as e:
        out["failed"] = str(e)
    out["failed_unchanged"] = all(bitwise_equal(before[n], b) for n, b in model.named_buffers())
    # the model still trains under FSDP2 afterwards, and sync_buffers accepts it too
    model(pixel_values=_images(rank, 2, 99)).logits.sum().backward()
    out["sync_average"] = zb.sync_buffers(model, "average")
    # recompute as the very first FSDP operation (it runs the root's lazy init): training afterwards as usual
    fresh = _shard(_resnet())
    zb.recompute_bn_stats(fresh, [_images(rank, 2, 8)], forward=_forward)
    from torch.distributed.fsdp import fully_shard
    out["root_keeps_params"] = all(g.post_forward_mesh_info is None for g in fully_shard.state(fresh)
                                   ._fsdp_param_groups)  # what FSDP's own lazy init sets on the root
    fresh(pixel_values=_images(rank, 2, 9)).logits.sum().backward()
    # a group that leaves out ranks of the FSDP mesh: refused before any collective (those ranks would never gather)
    if world == 4:
        pair = dist.new_group([0, 1])
        try:
            out["pair"] = zb.recompute_bn_stats(model, [_images(rank, 2)], forward=_forward, group=pair)
        except zb.InvalidArgumentError as e:
            out["pair"] = str(e)
    return out


def test_every_tool_accepts_a_fully_shard_resnet_and_never_touches_its_shards(ranks):
    out = ranks.run(_tools_on_fully_shard, timeout=TIMEOUT)
    world = len(out)
    assert all(o["dtensor_params"] for o in out)
    stat_names = {f"{n}.{k}" for n in out[0]["stats"] for k in ("running_mean", "running_var")}
    # the bug: two steps on each rank's own data leave every BatchNorm's statistics different per rank
    assert stat_names <= set(out[0]["report_diverged"]) and all(o["report_diverged"] == out[0]["report_diverged"]
                                                                 for o in out)
    # broadcast: every buffer is the source's; the DTensor shards (which differ per rank) are untouched
    src = out[world - 1]["after_broadcast"]
    for o in out:
        assert o["shards_kept"]
        assert all(bitwise_equal(o["after_broadcast"][n], src[n]) for n in src)
        assert o["synced_with_params"] == len(src)  # buffers only: no parameter is a plain tensor here
    # average: the exact mixture of the ranks' own statistics, on every rank
    locals_ = [o["before_average"] for o in out]
    for name in out[0]["averaged"]:
        n, mean, var = bn_mixture(locals_, name)
        for o in out:
            count, got_mean, got_var = o["averaged"][name]
            assert count == int(n.sum())
            torch.testing.assert_close(got_mean, mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got_var, var, rtol=1e-5, atol=1e-6)
    # recompute, uneven and empty shards, both modes: the first BatchNorm holds the population statistics of every
    # rank's data, every rank the same buffers, the parameters still sharded
    mean, var = out[0]["population"]
    for key in ("recomputed", "recomputed_global"):
        for o in out:
            assert o["written"] == o["written_global"] == len(out[0]["stats"])
            torch.testing.assert_close(o[key][f"{FIRST_BN}.running_mean"].double(), mean, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(o[key][f"{FIRST_BN}.running_var"].double(), var, rtol=1e-4, atol=1e-5)
            assert all(bitwise_equal(o[key][n], out[0][key][n]) for n in o[key])
    assert all(o["still_sharded"] and o["sync_average"] == len(src) and o["root_keeps_params"] for o in out)
    for o in out:
        assert f"rank {world - 1}: ValueError: bad batch" in o["failed"] and o["failed_unchanged"]
    if world == 4:
        assert all("sharded over ranks [2, 3] too" in out[r]["pair"] for r in (0, 1))
        assert out[2]["pair"] == out[3]["pair"] == 0  # not in the group: nothing to do


# ============================================================================================ DCP

def _dcp_after_diverged_run(rank, world, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    model = _trained(rank)
    stats = _stats(model)
    dcp.save(get_model_state_dict(model), checkpoint_id=f"{folder}/as_is")
    zb.sync_buffers(model, "average")  # the one line before dcp.save
    dcp.save(get_model_state_dict(model), checkpoint_id=f"{folder}/synced")
    return stats, _stats(model)


def _load_dcp(path: str, like: nn.Module) -> dict[str, torch.Tensor]:
    """A DCP folder loaded into a fresh single-process model (no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    sd = like.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=path, no_dist=True)
    like.load_state_dict(sd)
    return {n: (int(m.num_batches_tracked), m.running_mean.double(), m.running_var.double())
            for n, m in like.named_modules() if isinstance(m, nn.BatchNorm2d)}


def test_a_dcp_checkpoint_written_after_sync_buffers_holds_the_merged_statistics(ranks):
    with tempfile.TemporaryDirectory() as folder:
        out = ranks.run(_dcp_after_diverged_run, folder, timeout=TIMEOUT)
        as_is, synced = _load_dcp(f"{folder}/as_is", _resnet(7)), _load_dcp(f"{folder}/synced", _resnet(7))
    locals_ = [o[0] for o in out]
    for name, (count, mean, var) in synced.items():
        n, ref_mean, ref_var = bn_mixture(locals_, name)
        assert count == int(n.sum())
        torch.testing.assert_close(mean, ref_mean.float().double(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(var, ref_var.float().double(), rtol=1e-5, atol=1e-6)
        assert torch.equal(mean, out[0][1][name][1])  # what every rank held after the sync
    # without the sync: each statistic is one rank's own copy (DCP picks the rank), never the merge
    for name, (_, mean, var) in as_is.items():
        assert any(torch.equal(mean, loc[name][1]) for loc in locals_)
        assert any(torch.equal(var, loc[name][2]) for loc in locals_)
        assert not torch.allclose(mean, bn_mixture(locals_, name)[1].float().double(), atol=1e-4)


# ============================================================================================ meta device, to_empty

def _meta_init(rank, world, tmp):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM
    out = {}
    # (1) rank 0 loads real weights, the others build on meta; fully_shard, to_empty on the others,
    # set_model_state_dict from rank 0: parameters and persistent buffers arrive; the non-persistent rotary table
    # holds whatever memory held
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    if rank == 0:
        model = LlamaForCausalLM(config)
        full = model.state_dict()
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        full = {}
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if rank:
        model.to_empty(device="cpu")  # rank 0 keeps what it loaded
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    rope = dict(model.named_buffers())
    name = next(n for n in rope if n.endswith("inv_freq"))
    out["rope_before"] = rope[name].clone()
    zb.broadcast_buffers(model)
    out["rope_after"] = dict(model.named_buffers())[name].clone()
    ids = torch.arange(12).reshape(1, 12) % 64
    with torch.no_grad():
        out["logits"] = model(input_ids=ids).logits
    # (2) buffers left on meta (parameters and persistent state loaded elsewhere): without materialize every rank
    # raises and nothing changes; with it the receivers allocate them beside the module's other tensors
    if rank == 0:
        resnet = _resnet()
        with torch.no_grad():
            for m in resnet.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-1, 1)
                    m.num_batches_tracked.fill_(7)
    else:
        with torch.device("meta"):
            resnet = _resnet()
    out["meta_before"] = sorted({b.device.type for b in resnet.buffers()})
    try:
        zb.broadcast_buffers(resnet)
        out["without"] = None
    except zb.BufferStructureError as e:
        out["without"] = str(e)
    out["meta_unchanged"] = sorted({b.device.type for b in resnet.buffers()})
    out["count"] = zb.broadcast_buffers(resnet, materialize=True, include_parameters=True)
    out["after"] = _buffers(resnet)
    out["params"] = {n: p.detach().clone() for n, p in resnet.named_parameters()}
    out["is_param"] = all(isinstance(p, nn.Parameter) and p.requires_grad for p in resnet.parameters())
    resnet.eval()
    with torch.no_grad():
        out["resnet_logits"] = resnet(pixel_values=torch.ones(1, 3, 16, 16)).logits
    out["api"] = (str(resnet.device), str(resnet.dtype))
    resnet.save_pretrained(f"{tmp}/resnet")  # transformers 5 writes on global rank 0 only
    copy = pickle.loads(pickle.dumps(resnet))
    out["pickled"] = all(bitwise_equal(a, b) for a, b in zip(copy.state_dict().values(), resnet.state_dict().values()))
    return out


def test_meta_init_and_to_empty_leave_garbage_or_meta_until_broadcast_buffers_materializes(ranks):
    with tempfile.TemporaryDirectory() as tmp:
        out = ranks.run(_meta_init, tmp, timeout=TIMEOUT)
        from transformers import ResNetForImageClassification
        reloaded = ResNetForImageClassification.from_pretrained(f"{tmp}/resnet").state_dict()
    real = out[0]["rope_before"]
    for r, o in enumerate(out):
        if r:  # the bug: set_model_state_dict carries persistent entries only; to_empty left memory as it was
            assert not torch.equal(o["rope_before"], real)
            assert o["meta_before"] == ["meta"] and o["meta_unchanged"] == ["meta"]
            assert ": float32[8] meta" in o["without"] and "materialize=True" in o["without"]
        assert torch.equal(o["rope_after"], real)
        assert torch.equal(o["logits"], out[0]["logits"])  # every rank computes the same now
        assert o["after"].keys() == out[0]["after"].keys()
        assert all(bitwise_equal(o["after"][n], out[0]["after"][n]) for n in o["after"])
        assert all(bitwise_equal(o["params"][n], out[0]["params"][n]) for n in o["params"])
        assert o["count"] == len(o["after"]) + len(o["params"]) and o["is_param"]
        assert torch.equal(o["resnet_logits"], out[0]["resnet_logits"])
        assert o["api"] == ("cpu", "torch.float32") and o["pickled"]
        assert all(bitwise_equal(reloaded[n], t) for n, t in {**o["after"], **o["params"]}.items())
    assert out[0]["without"] == out[-1]["without"]  # the same error on every rank, the source included


# ============================================================================================ DeviceMesh groups

def _mesh_groups(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    out = {}
    if world == 4:  # HSDP: replicate over one dimension, shard over the other
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = _trained(rank, mesh)
        zb.broadcast_buffers(model, group=(mesh, "replicate"))
        out["replicate"] = _buffers(model)
        zb.average_bn_stats(model, group=mesh)  # a mesh alone: every rank of the mesh (here the world)
        out["whole"] = _buffers(model)
        from torch.distributed.device_mesh import DeviceMesh
        half = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("dp",))  # every rank builds it, 2 and 3 are out
        try:
            out["half"] = zb.broadcast_buffers(_trained(rank), group=half)
        except zb.InvalidArgumentError as e:
            out["half"] = str(e)
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        model = _trained(rank, mesh)
        zb.broadcast_buffers(model, src=1, group=mesh)
        out["whole"] = _buffers(model)
    errors = []
    for bad in ((mesh, "tp"), (mesh, 0)):
        try:
            zb.buffer_report(model, group=bad)
        except zb.InvalidArgumentError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


def test_group_may_be_a_device_mesh_or_one_of_its_dimensions(ranks):
    out = ranks.run(_mesh_groups, timeout=TIMEOUT)
    world = len(out)
    if world == 4:  # mesh [[0, 1], [2, 3]]: the replicate groups are {0, 2} and {1, 3}
        for a, b in ((0, 2), (1, 3)):
            assert all(bitwise_equal(out[a]["replicate"][n], out[b]["replicate"][n]) for n in out[a]["replicate"])
        diverged = [n for n in out[0]["replicate"] if not bitwise_equal(out[0]["replicate"][n], out[1]["replicate"][n])]
        assert diverged  # the other dimension was left alone
        assert out[0]["half"] == out[1]["half"] == len(out[0]["whole"])
        assert all(f"rank {r} is not in the DeviceMesh" in out[r]["half"] for r in (2, 3))
    for o in out:
        assert all(bitwise_equal(o["whole"][n], out[0]["whole"][n]) for n in o["whole"])
        assert len(o["errors"]) == 2 and "no dimension 'tp'" in o["errors"][0] and "dimension name" in o["errors"][1]


# ============================================================================================ frozen modules

class _Distill(nn.Module):
    """A student trained against a frozen teacher (distillation)."""

    def __init__(self, student: nn.Module, teacher: nn.Module):
        super().__init__()
        self.student, self.teacher = student, teacher

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(pixel_values=x).logits
        return (self.student(pixel_values=x).logits - target).square().mean()


def _frozen_under_fsdp2(rank, world, tmp):
    from torch.distributed.fsdp import fully_shard
    out = {}
    teacher = _shard(_resnet())  # the same weights on every rank, sharded; BatchNorm statistics per rank
    _unevenly_unsharded(teacher, rank)
    with torch.no_grad():
        for m in teacher.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.fill_(float(rank))
    reference = _resnet().state_dict()
    zb.frozen_replica(teacher)
    out["class"] = (type(teacher).__name__, any(c.__name__ == "FSDPModule" for c in type(teacher).__mro__),
                    zb.is_frozen_replica(teacher))
    out["plain"] = not any(_is_dtensor(t) for t in [*teacher.parameters(), *teacher.buffers()])
    sd = teacher.state_dict()
    out["weights_full"] = all(torch.equal(sd[k], v) for k, v in reference.items() if "running" not in k
                              and "num_batches" not in k)
    out["state"] = {k: v.clone() for k, v in sd.items()}
    if rank == 0:  # one rank alone: a forward that all-gathered would never return
        with torch.no_grad():
            out["alone"] = teacher(pixel_values=torch.ones(1, 3, 16, 16)).logits
    dist.barrier()
    out["logits"] = teacher(pixel_values=torch.ones(1, 3, 16, 16)).logits
    out["grad"] = out["logits"].requires_grad
    teacher.save_pretrained(f"{tmp}/teacher")  # on rank 0
    out["pickled"] = type(pickle.loads(pickle.dumps(teacher))).__name__
    out["api"] = (str(teacher.device), str(teacher.dtype), teacher.num_parameters())
    # kept out of fully_shard: frozen_replica first, then shard the model that holds it; its weights are buffers
    holder = _Distill(_resnet(1), zb.frozen_replica(_resnet(2)))
    fully_shard(holder.student)
    fully_shard(holder)
    opt = torch.optim.SGD(holder.parameters(), lr=0.1)
    holder(_images(rank, 2)).backward()
    opt.step()
    out["teacher_plain"] = not any(_is_dtensor(t) for t in holder.teacher.buffers())
    out["teacher_weights"] = {k: v.clone() for k, v in holder.teacher.state_dict().items()}
    # an enclosing fully_shard owns the parameters: refused by name, nothing changed
    outer = _Distill(_resnet(3), _resnet(4))
    fully_shard(outer)
    try:
        zb.frozen_replica(outer.teacher)
        out["foreign"] = None
    except zb.InvalidArgumentError as e:
        out["foreign"] = str(e)
    return out


def test_frozen_replica_of_a_fully_shard_module_is_full_identical_and_all_gathers_nothing(ranks):
    with tempfile.TemporaryDirectory() as tmp:
        out = ranks.run(_frozen_under_fsdp2, tmp, timeout=TIMEOUT)
        from transformers import ResNetForImageClassification
        reloaded = ResNetForImageClassification.from_pretrained(f"{tmp}/teacher")
    for o in out:
        assert o["class"] == ("ResNetForImageClassification", False, True)
        assert o["plain"] and o["weights_full"] and not o["grad"]
        assert all(torch.equal(o["state"][k], out[0]["state"][k]) for k in o["state"])  # rank 0's statistics
        assert torch.equal(o["state"][f"{FIRST_BN}.running_mean"], torch.zeros(8))
        assert torch.equal(o["logits"], out[0]["alone"])
        assert o["pickled"] == "ResNetForImageClassification" and o["api"][:2] == ("cpu", "torch.float32")
        assert o["teacher_plain"]
        assert all(torch.equal(o["teacher_weights"][k], out[0]["teacher_weights"][k]) for k in o["teacher_weights"])
        assert "is sharded by a fully_shard or tensor-parallel plan outside this module" in o["foreign"]
    assert all(torch.equal(v, out[0]["state"][k]) for k, v in reloaded.state_dict().items())


# ============================================================================================ FSDP1, bad input

def _fsdp1_and_bad_input(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    out = {}
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    model = FullyShardedDataParallel(inner, device_id=torch.device("cpu"))  # FSDP1 runs on CPU with gloo
    model(torch.randn(6, 4) * (1 + rank) + rank).sum().backward()
    out["names"] = sorted(r.name for r in zb.buffer_report(model).out_of_sync)
    out["before"] = {"1": (int(inner[1].num_batches_tracked), inner[1].running_mean.double().clone(),
                           inner[1].running_var.double().clone())}
    zb.average_bn_stats(model)
    out["averaged"] = (inner[1].running_mean.double().clone(), inner[1].running_var.double().clone())
    # recompute: rank r has r batches (rank 0 none); the forwards run on the full parameters, no collective in them
    data = [torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * r + i)) + r
            for r in range(world) for i in range(r)]
    mine = [torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * rank + i)) + rank for i in range(rank)]
    with FullyShardedDataParallel.summon_full_params(model), torch.no_grad():
        x = torch.cat([inner[0](b) for b in data]).double()
    out["population"] = (x.mean(0), x.var(0))
    out["written"] = zb.recompute_bn_stats(model, mine)
    out["recomputed"] = (inner[1].running_mean.double().clone(), inner[1].running_var.double().clone())
    out["sync_recompute"] = zb.sync_buffers(model, "recompute", data=mine)
    model(torch.randn(6, 4)).sum().backward()  # FSDP1 still trains
    out["trained"] = inner[1].running_mean.double().clone()
    zb.average_bn_stats(model)
    out["after"] = (inner[1].running_mean.double().clone(), inner[1].running_var.double().clone())
    calls = {"include_parameters": lambda: zb.broadcast_buffers(model, include_parameters=True)}
    mixed = nn.ModuleDict({"a": FullyShardedDataParallel(nn.Linear(2, 2), device_id=torch.device("cpu")),
                           "b": nn.Linear(2, 2)})
    fully_shard(mixed["b"])
    calls["mixed"] = lambda: zb.broadcast_buffers(mixed)
    calls["mixed_average"] = lambda: zb.average_bn_stats(mixed)
    with torch.device("meta" if rank == 0 else "cpu"):
        source_meta = nn.BatchNorm1d(4)
    calls["source_meta"] = lambda: zb.broadcast_buffers(source_meta, materialize=True)
    holder = nn.Module()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    holder.register_buffer("table", distribute_tensor(torch.ones(4), init_device_mesh("cpu", (world,)),
                                                      [Replicate()]))
    # DTensor buffers are synced by placement (tests/core/test_dtensor_buffers.py); materialize=True does not take them
    calls["dtensor_buffer"] = lambda: zb.broadcast_buffers(holder, materialize=True)
    out["errors"] = messages(calls, zb.InvalidArgumentError)
    out["unchanged"] = torch.equal(inner[1].running_mean.double(), out["after"][0])
    return out


def test_fsdp1_buffers_sync_recompute_runs_on_full_parameters_and_bad_trees_are_refused_by_name(ranks):
    out = ranks.run(_fsdp1_and_bad_input, timeout=TIMEOUT)
    assert out[0]["names"] == ["1.running_mean", "1.running_var"]  # FSDP1's _fsdp_wrapped_module. left out
    _n, mean, var = bn_mixture([o["before"] for o in out], "1")
    pop_mean, pop_var = out[0]["population"]
    for o in out:
        torch.testing.assert_close(o["averaged"][0], mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o["averaged"][1], var, rtol=1e-5, atol=1e-6)
        assert o["written"] == 1 and o["sync_recompute"] == 3
        torch.testing.assert_close(o["recomputed"][0], pop_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o["recomputed"][1], pop_var, rtol=1e-4, atol=1e-5)
        assert torch.equal(o["recomputed"][0], out[0]["recomputed"][0])
        e = o["errors"]
        assert e == out[0]["errors"] and o["unchanged"]
        assert "FSDP1" in e["include_parameters"] and "flat parameters" in e["include_parameters"]
        assert "mixes FSDP1" in e["mixed"] and "'a'" in e["mixed"] and "'b'" in e["mixed"]
        assert "mixes FSDP1" in e["mixed_average"]
        assert "the source, rank 0, holds 3 meta tensor(s) itself" in e["source_meta"]
        assert "DTensors" in e["dtensor_buffer"] and "'table'" in e["dtensor_buffer"]


def test_a_peer_dying_mid_broadcast_under_fsdp2_raises_collective_error_and_writes_nothing(ranks):
    out = ranks.run(_peer_dies, allow_dead=[1], timeout=TIMEOUT)
    assert out[1] is None
    for r, o in enumerate(out):
        if r != 1:
            err, unchanged = o
            assert err[0] == "CollectiveError" and unchanged


def _peer_dies(rank, world):
    from tests.core.test_rank_faults import _inject  # the real collectives, wrapped on the faulty rank only
    model = _trained(rank)
    before = _buffers(model)
    if rank == 1:
        _inject("die", 2)  # right after the structure check: the data never arrives
    try:
        zb.broadcast_buffers(model, timeout=20)
        err = None
    except zb.ZeroBuffersError as e:
        err = (type(e).__name__, str(e))
    return err, all(bitwise_equal(before[n], b) for n, b in model.named_buffers())


# ============================================================================================ Accelerate's FSDP path

def _accelerate_fsdp2(rank, world, folder):
    import os

    from accelerate.state import AcceleratorState
    env = dict(os.environ)
    AcceleratorState._reset_state(True)
    try:
        return _accelerate_fsdp2_body(rank, folder)
    finally:
        AcceleratorState._reset_state(True)
        os.environ.clear()
        os.environ.update(env)


def _accelerate_fsdp2_body(rank, folder):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, FullyShardedDataParallelPlugin
    out = {}
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                              kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    out["distributed_type"] = str(accelerator.distributed_type)  # on CPU Accelerate drops the plugin: MULTI_CPU
    model = _shard(_resnet())  # so the FSDP2 model is sharded by hand, as the plugin would on GPUs
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model(pixel_values=_images(rank, 4)).logits.square().mean().backward()
    opt.step()
    out["before"] = _stats(model)
    hook = zb.sync_buffers_on_save(accelerator, "average")
    try:
        state = accelerator.get_state_dict(model)  # every rank builds an FSDP state dict: the hook syncs first
    finally:
        hook.remove()
    out["saved"] = {k: (v.full_tensor() if _is_dtensor(v) else v).detach().clone() for k, v in state.items()
                    if "running" in k or "num_batches" in k}
    # the path Accelerate does run on CPU with the FSDP plugin: DDP, save_state on every rank
    plain = accelerator.prepare(_resnet())
    plain(pixel_values=_images(rank, 4, 5)).logits.sum().backward()
    out["ddp_before"] = _stats(accelerator.unwrap_model(plain))
    with zb.sync_buffers_on_save(accelerator, "average"):
        accelerator.save_state(folder)
    return out


def test_sync_buffers_on_save_on_accelerates_fsdp_path_as_far_as_it_runs_on_cpu(ranks):
    with tempfile.TemporaryDirectory() as folder:
        out = ranks.run(_accelerate_fsdp2, folder, timeout=TIMEOUT)
        from safetensors.torch import load_file
        ddp_saved = load_file(f"{folder}/model.safetensors")
    assert [o["distributed_type"] for o in out] == ["DistributedType.MULTI_CPU"] * len(out)
    for key, before in (("saved", "before"), ("ddp", "ddp_before")):
        locals_ = [o[before] for o in out]
        saved = out[0]["saved"] if key == "saved" else {k.removeprefix("module."): v for k, v in ddp_saved.items()}
        for name in out[0][before]:
            n, mean, var = bn_mixture(locals_, name)
            assert int(saved[f"{name}.num_batches_tracked"]) == int(n.sum())
            torch.testing.assert_close(saved[f"{name}.running_mean"].double(), mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(saved[f"{name}.running_var"].double(), var, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(out[1]["saved"][k], v) for k, v in out[0]["saved"].items())
