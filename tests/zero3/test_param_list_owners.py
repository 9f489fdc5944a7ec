"""GatheredParametersAndBuffers given parameters, not modules, syncs the buffers of the modules that own them.

The incident's own call form, ``GatheredParametersAndBuffers(tokenizer.parameters(), modifier_rank=0)`` around a
rank-0 ``load_state_dict`` of a Conv3d + BatchNorm3d tokenizer built under plain ``deepspeed.zero.Init``, left every
other rank's BatchNorm statistics at their initial values. These tests prove, on real gloo ranks with real
zero.Init and GatheredParameters:

* the generator form (world 2 and 4) and ``list(tokenizer.parameters())`` give every rank rank 0's buffers bit for
  bit, the root's own buffer and a parameter-free submodule's included, and equal outputs;
* a model built under ``zero_buffers.Init`` is resolved from the record, without searching the heap; the heap
  search's index is kept until a module is registered anywhere, and the next call sees that module;
* a generator of some layers' parameters syncs those layers' buffers and leaves the others (and the root's) alone;
* a ZeRO parameter no module registers warns on every rank, naming what to pass, and its value is still committed;
* owners found on one rank but not another raise BufferStructureError on every rank, nothing changed, no hang.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import ZERO3_CONFIG, buffers, init_deepspeed, same_state

pytestmark = pytest.mark.stack


class Tokenizer(nn.Module):
    """Incident 1's frozen video tokenizer in miniature: Conv3d + BatchNorm3d twice, a parameter-free BatchNorm and a
    buffer on the root itself."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv3d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm3d(4)
        self.conv2 = nn.Conv3d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm3d(4)
        self.post = nn.BatchNorm3d(4, affine=False)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        x = self.bn1(self.conv1(x)).relu()
        return self.post(self.bn2(self.conv2(x))) * self.scale.view(1, -1, 1, 1, 1)


def checkpoint() -> dict[str, torch.Tensor]:
    """The pretrained tokenizer: every parameter and buffer away from its initial value."""
    g = torch.Generator().manual_seed(2024)
    ref = Tokenizer()
    with torch.no_grad():
        for t in list(ref.parameters()) + list(ref.buffers()):
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            else:
                t.fill_(1000)
    return ref.state_dict()


def sub(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def build(rank: int, own_init: bool = False) -> Tokenizer:
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)  # each rank initialises its own weights, as in the incident
    ctx = zb.Init if own_init else deepspeed.zero.Init
    with ctx(config_dict_or_path=ZERO3_CONFIG):
        tok = Tokenizer().eval()
    return tok


def outputs(tok: nn.Module) -> torch.Tensor:
    import deepspeed
    x = torch.randn(2, 3, 2, 6, 6, generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(tok.parameters())):
        return tok(x)


def heap_searches() -> int:
    """How many times this process searched the heap for owners (read without failing on a version that never does,
    so a test run against it fails on the values)."""
    try:
        from zero_buffers.zero3 import _owners
    except ImportError:
        return 0
    return _owners.scans[0]


def _incident(rank, world, form):
    tok = build(rank, own_init=form == "list_record")
    before = buffers(tok)
    scans = heap_searches()
    sd = checkpoint()
    arg = tok.parameters() if form == "generator" else list(tok.parameters())
    with zb.GatheredParametersAndBuffers(arg, modifier_rank=0):
        if rank == 0:
            tok.load_state_dict(sd)
    return {"before": before, "after": buffers(tok), "out": outputs(tok), "searched": heap_searches() - scans,
            "sd": {k: v for k, v in sd.items() if k in before}}


def check_incident(out, form):
    ref = out[0]
    assert same_state(ref["after"], ref["sd"])  # rank 0 loaded the checkpoint's buffers
    for rank, res in enumerate(out):
        assert same_state(res["after"], ref["after"]), f"rank {rank}: buffers are not rank 0's"
        assert torch.equal(res["out"], ref["out"]), f"rank {rank}: outputs differ from rank 0's"
        if form != "list_record":  # plain zero.Init: every rank started at the initial values
            before = res["before"]
            assert float(before["bn1.running_var"][0]) == 1.0 and int(before["bn1.num_batches_tracked"]) == 0
    for res in out:  # the generator names its module, zero_buffers.Init's record knows every owner: no heap search
        assert res["searched"] == (1 if form == "list" else 0), (form, res["searched"])


def test_incident_generator_form_gives_every_rank_rank0s_buffers(ranks):
    """Exactly the call in the DeepSpeed issue, at world 2 and 4."""
    check_incident(ranks.run(_incident, "generator", timeout=120), "generator")


@pytest.mark.parametrize("form", ["list", "list_record"])
def test_incident_list_form_finds_the_owners(ranks2, form):
    """list(tokenizer.parameters()): owners found by a heap search under plain zero.Init, from the record under
    zero_buffers.Init; the root's buffer and the parameter-free BatchNorm belong to the sync as well."""
    check_incident(ranks2.run(_incident, form, timeout=120), form)


class Wrapper(nn.Module):
    """A parameter-free wrapper with a buffer of its own: every parameter of it is the tokenizer's."""

    def __init__(self, tok: nn.Module):
        super().__init__()
        self.tok = tok
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))


def _index_kept_until_a_registration(rank, world):
    tok = build(rank)
    searches = []

    def commit(step: int, wrapper: Wrapper | None = None) -> None:
        start = heap_searches()
        with zb.GatheredParametersAndBuffers(list(tok.parameters()), modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    for t in (tok.scale, *([wrapper.step] if wrapper is not None else [])):
                        t.fill_(step)
        searches.append(heap_searches() - start)

    commit(1)
    commit(2)  # nothing registered since: the index is kept
    wrapper = Wrapper(tok)  # a registration anywhere: the next call searches again, and finds the new parent
    commit(3, wrapper)
    return searches, float(tok.scale[0]), int(wrapper.step)


def test_the_heap_index_is_kept_until_a_module_is_registered_anywhere(ranks2):
    """A per-module loading walk searches once; a module registered since (a wrapper around the tokenizer, all of
    whose parameters are the tokenizer's) is seen by the next call, its buffer committed with the rest."""
    out = ranks2.run(_index_kept_until_a_registration, timeout=120)
    for rank, (_, scale, step) in enumerate(out):
        assert scale == 3.0 and step == 3, (rank, scale, step)
    for rank, (searches, *_) in enumerate(out):
        assert searches == [1, 0, 1], (rank, searches)


def _some_layers(rank, world):
    tok = build(rank)
    with torch.no_grad():  # per-rank values in what the context must leave alone
        for t in [*tok.bn2.buffers(), *tok.post.buffers(), tok.scale]:
            t.fill_(rank + 3)
    sd = checkpoint()
    layer1 = (p for m in (tok.conv1, tok.bn1) for p in m.parameters())  # a generator of some layers' parameters
    with zb.GatheredParametersAndBuffers(layer1, modifier_rank=0):
        if rank == 0:
            tok.conv1.load_state_dict(sub(sd, "conv1."))
            tok.bn1.load_state_dict(sub(sd, "bn1."))
    return buffers(tok), {k: v for k, v in sub(sd, "bn1.").items() if k not in ("weight", "bias")}


def test_a_generator_of_some_layers_syncs_those_layers_only(ranks2):
    out = ranks2.run(_some_layers, timeout=120)
    for rank, (after, bn1) in enumerate(out):
        assert same_state({k[4:]: v for k, v in after.items() if k.startswith("bn1.")}, bn1), rank
        for k, v in after.items():
            if not k.startswith("bn1."):  # bn2, post and the root's buffer: not given, so untouched
                assert torch.equal(v, torch.full_like(v, rank + 3)), (rank, k)


def _no_owner(rank, world, fwd):
    deepspeed = init_deepspeed()
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        net = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    loose = net[0]._parameters.pop("weight")  # a ZeRO parameter that no module registers any more
    head = nn.Module()  # a module that uses it without registering it (DeepSpeed's external parameters)
    head.register_buffer("scale", torch.full((2,), float(rank)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with zb.GatheredParametersAndBuffers([loose], modifier_rank=0, fwd_module=head if fwd else None):
            if rank == 0:
                with torch.no_grad():
                    loose.fill_(5.0)
                    head.scale.fill_(9.0)
    with deepspeed.zero.GatheredParameters([loose]):
        value = loose.detach().clone()
    texts = [str(w.message) for w in caught if issubclass(w.category, zb.ZeroBuffersWarning)]
    return texts, value, float(head.scale[0])


@pytest.mark.parametrize("fwd", [False, True], ids=["no_fwd_module", "fwd_module"])
def test_a_parameter_no_module_registers_warns_once_on_the_first_rank(ranks2, fwd):
    """Without an owner it warns once, on the group's first rank, naming what to pass, and commits the parameter alone;
    fwd_module, DeepSpeed's module that uses the parameter, stands in as its owner (its buffers reach every rank)."""
    for rank, (texts, value, scale) in enumerate(ranks2.run(_no_owner, fwd, timeout=120)):
        assert torch.equal(value, torch.full((2, 3), 5.0)), rank  # the parameter itself is committed everywhere
        if fwd:
            assert texts == [] and scale == 9.0, (rank, texts, scale)
        else:
            assert scale == (9.0 if rank == 0 else rank), (rank, scale)
            assert len(texts) == (rank == 0), (rank, texts)
            if rank == 0:
                assert "no module registers the ZeRO parameter(s) with ds_id" in texts[0]
                assert "GatheredParametersAndBuffers(module, modifier_rank=0)" in texts[0]


def _owners_differ(rank, world):
    deepspeed = init_deepspeed()
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        net = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        net[1].running_mean.fill_(rank + 1)
    weight, bias = net[1].weight, net[1].bias
    if rank == world - 1:
        net[1]._parameters.pop("weight")  # here no module registers it: owners differ across ranks
    outcome = None
    try:
        with zb.GatheredParametersAndBuffers([weight, bias], modifier_rank=0):
            outcome = "entered"
            if rank == 0:
                net[1].running_mean.fill_(50.0)
    except zb.BufferStructureError as e:
        outcome = f"BufferStructureError: {e}"
    healthy = torch.tensor([1.0])
    dist.all_reduce(healthy)  # the group still works: every rank left through the same collectives
    return outcome, float(net[1].running_mean[0]), weight.numel(), float(healthy)


def test_owners_found_on_some_ranks_only_raise_the_same_error_everywhere(ranks):
    out = ranks.run(_owners_differ, timeout=120)
    world = len(out)
    texts = {o.split(": ", 1)[1] for o, *_ in out}
    assert len(texts) == 1 and all(o.startswith("BufferStructureError") for o, *_ in out), out
    assert "buffer structure differs across ranks at '<BatchNorm1d owning ds_id=" in next(iter(texts)), texts
    for rank, (_, mean, numel, healthy) in enumerate(out):
        assert mean == rank + 1 and numel == 0 and healthy == world, (rank, mean, numel)
