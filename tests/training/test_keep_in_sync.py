"""keep_in_sync on 2 and 4 real gloo ranks: a DeepSpeed ZeRO-3 engine training transformers' ResNet (buffers equal on
every rank after every step, counters that stay batch counts, int64 sums exact past 2**53), a plain and a
fully_shard module under a custom loop (syncs before train forwards only; an eval on one rank alone cannot hang),
the VQ codebook kept exact step by step, and bad input refused before any collective.

Its structure check ([Note: steady state]) is exact, and every rank raises together: a submodule replaced on every
rank is taken up (its statistics merged, the detached layer never again), one replaced on one rank only stops every
rank with an error naming it, and in a plan that only broadcasts a receiver's change stops the source too (no rank
waits for a peer that raised); the default ``timeout=None``."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal, messages
from zero_buffers.training import rules as rules_mod

BIG = 2 ** 60
STEPS = 4


class Router(nn.Module):
    """Counts what this rank routed (a sum across ranks) and keeps an EMA of its load (a mean)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("tokens", torch.full((3,), BIG, dtype=torch.int64))  # replicas start equal
        self.register_buffer("load", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            rank = dist.get_rank()
            with torch.no_grad():
                self.tokens += torch.tensor([rank + 1, 2 * rank, 1])
                self.load.mul_(0.9).add_(0.1 * (x.detach().mean() + rank))
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import ResNetConfig, ResNetModel
        torch.manual_seed(0)
        self.resnet = ResNetModel(ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                               layer_type="basic"))
        self.router = Router()
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.router(self.resnet(pixel_values=x).pooler_output.flatten(1)))


RULES = {"router.tokens": "sum", "router.load": "mean"}


def _images(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 3, 16, 16, generator=g) * (1 + rank) + 2.0 * rank


def _digests(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _engine_run(rank, world, every, synced):
    from tests.helpers import ZERO3_CONFIG, init_deepspeed
    deepspeed = init_deepspeed()
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                                      config={**ZERO3_CONFIG, "train_micro_batch_size_per_gpu": 4})
    handle = zb.keep_in_sync(engine, rules=RULES, every=every) if synced else None
    per_step = []
    for step in range(STEPS):
        engine.backward(engine(_images(rank, step)).square().mean())
        engine.step()
        per_step.append(_digests(engine.module))
    out = {"steps": per_step, "syncs": handle.syncs if handle else 0}
    if handle is not None:
        handle.remove()
        out["restored"] = "step" not in vars(engine)
    return out


def test_keep_in_sync_on_a_deepspeed_zero3_engine_keeps_every_buffer_equal_after_every_step(ranks):
    world = ranks.world_size
    bug = ranks.run(_engine_run, 1, False, timeout=240)
    out = ranks.run(_engine_run, 1, True, timeout=240)
    names = list(out[0]["steps"][0])
    stats = [n for n in names if "running" in n]
    assert any(not bitwise_equal(bug[0]["steps"][-1][n], bug[1]["steps"][-1][n]) for n in stats)  # the bug
    for o in out:
        assert o["syncs"] == STEPS and o["restored"]
        for step, buffers in enumerate(o["steps"]):
            assert all(bitwise_equal(buffers[n], out[0]["steps"][step][n]) for n in names), step
            counts = [buffers[n] for n in names if n.endswith("num_batches_tracked")]
            assert all(int(c) == world * (step + 1) for c in counts)  # a count of all ranks' batches, no compounding
            added = torch.tensor([sum(r + 1 for r in range(world)), sum(2 * r for r in range(world)), world])
            assert torch.equal(buffers["router.tokens"], BIG + (step + 1) * added)  # exact: int64 stays int64


def test_every_counts_optimizer_steps_of_the_engine(ranks2):
    out = ranks2.run(_engine_run, 2, True, timeout=240)
    for o in out:
        assert o["syncs"] == STEPS // 2
        second = o["steps"][1]  # synced after steps 2 and 4 only
        assert all(bitwise_equal(second[n], out[0]["steps"][1][n]) for n in second)
    assert any(not bitwise_equal(out[0]["steps"][0][n], out[1]["steps"][0][n]) for n in out[0]["steps"][0])


def _module_loops(rank, world):
    from torch.distributed.fsdp import fully_shard
    out = {}
    for kind in ("plain", "fully_shard"):
        model = Net()
        if kind == "fully_shard":
            for stage in model.resnet.encoder.stages:
                fully_shard(stage)
            fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        handle = zb.keep_in_sync(model, rules=RULES)
        for step in range(2):
            model(_images(rank, step)).square().mean().backward()  # the sync ran before this forward
            opt.step()
            opt.zero_grad()
        synced_before_last = handle.syncs
        model.eval()
        if rank == 0 and kind == "plain":  # one rank alone, eval mode: no sync, so nothing waits for the others
            with torch.no_grad():
                model(_images(rank, 9))
        dist.barrier()
        model.train()
        handle.sync()  # what the next train forward would do
        out[kind] = {"syncs": (synced_before_last, handle.syncs), "buffers": _digests(model)}
        handle.remove()
        model(_images(rank, 5)).sum().backward()
        out[kind]["after_remove"] = _digests(model)
    return out


@pytest.mark.torch_next  # torch internals: runs on the torch-next stack too (.ci/run)
def test_keep_in_sync_on_plain_and_fully_shard_modules_syncs_before_train_forwards_only(ranks):
    out = ranks.run(_module_loops, timeout=240)
    for kind in ("plain", "fully_shard"):
        for o in out:
            assert o[kind]["syncs"] == (2, 3)
            assert all(bitwise_equal(b, out[0][kind]["buffers"][n]) for n, b in o[kind]["buffers"].items())
        stats = [n for n in out[0][kind]["after_remove"] if "running_mean" in n]
        assert any(not bitwise_equal(out[0][kind]["after_remove"][n], out[1][kind]["after_remove"][n])
                   for n in stats)  # removed: the ranks drift apart again


def _vq_steps(rank, world):
    from vector_quantize_pytorch import VectorQuantize
    from vector_quantize_pytorch.vector_quantize_pytorch import Codebook
    vq_rules = {Codebook: {"cluster_size": "mean", "embed_avg": "mean", "embed": "local", "initted": "max"}}
    zb.register_rules(Codebook, vq_rules[Codebook], after_sync=lambda codebook: codebook.update_ema())
    try:
        torch.manual_seed(0)
        ours = VectorQuantize(dim=8, codebook_size=16, decay=0.8, sync_codebook=False, threshold_ema_dead_code=0)
        torch.manual_seed(0)
        reference = VectorQuantize(dim=8, codebook_size=16, decay=0.8, sync_codebook=True, threshold_ema_dead_code=0)

        def mean_all_reduce(t):
            dist.all_reduce(t)
            t /= world
        reference._codebook.all_reduce_fn = mean_all_reduce
        handle = zb.keep_in_sync(ours._codebook)  # its registered rules; syncs before each train forward
        diffs = []
        for step in range(5):
            x = torch.randn(4, 12, 8, generator=torch.Generator().manual_seed(10 * step + rank)) + rank
            ours(x)
            reference(x)
            handle.sync()  # after the step, as the reference's forward left it
            diffs.append(float((ours._codebook.embed - reference._codebook.embed).abs().max()))
        handle.remove()
        return diffs
    finally:
        rules_mod._REGISTRY.pop(Codebook, None)


def test_keep_in_sync_keeps_a_vq_codebook_equal_to_mean_all_reduced_statistics_step_by_step(ranks2):
    out = ranks2.run(_vq_steps, timeout=240)
    assert all(d < 1e-5 for diffs in out for d in diffs), out


def _bad(rank, world):
    return messages({"every=0": lambda: zb.keep_in_sync(Net(), every=0),
                     "unknown rule": lambda: zb.keep_in_sync(Net(), rules={"router.tokens": "total"}),
                     "mean of int": lambda: zb.keep_in_sync(Net(), rules={"router.tokens": "mean"}),
                     "not a module": lambda: zb.keep_in_sync([1, 2])}, zb.InvalidArgumentError)


def test_bad_input_is_refused_when_installing_before_any_collective(ranks2):
    out = ranks2.run(_bad)
    assert out[0] == out[1]
    assert "every must be an int >= 1" in out[0]["every=0"] and "unknown rule 'total'" in out[0]["unknown rule"]
    assert "'router.tokens' (int64) has rule 'mean'" in out[0]["mean of int"]
    assert "expects a torch.nn.Module" in out[0]["not a module"]


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)) + self.ema


def _broadcast_only(rank):
    """A module whose one buffer is broadcast (rank-specific values), kept in sync and synced once."""
    plain = nn.Module()
    plain.register_buffer("table", torch.full((4,), float(rank)))
    only = zb.keep_in_sync(plain)
    only.sync()
    return plain, only


def _changes(rank, world):
    out = {}
    torch.manual_seed(0)
    model = Small()
    handle = zb.keep_in_sync(model, rules={"ema": "mean"})
    # two train forwards before one backward: the sync before the second writes statistics the first saved
    a = model(torch.randn(4, 3) + rank)
    b = model(torch.randn(4, 3) - rank)
    (a.sum() + b.square().sum()).backward()
    out["two_forwards"] = handle.syncs
    out["second_handle"] = messages({"again": lambda: zb.keep_in_sync(model)}, zb.InvalidArgumentError)["again"]
    with torch.no_grad():  # tensors swapped for new ones of the same structure: taken up, nothing lost
        model._buffers["ema"] = torch.full((3,), float(rank))
    handle.sync()
    out["swapped"] = model.ema.clone()
    model._buffers["extra"] = torch.full((2,), float(rank))  # every rank changes: every rank raises, then agrees
    out["changed"] = messages({"sync": handle.sync}, zb.BufferStructureError)["sync"]
    handle.sync()
    out["extra"] = model.extra.clone()
    handle.remove()
    plain, only = _broadcast_only(rank)  # a plan that only broadcasts: a receiver's change stops every rank too
    if rank == world - 1:
        plain._buffers["table"] = torch.zeros(5)
    out["receiver_change"] = messages({"sync": only.sync}, zb.BufferStructureError)["sync"]
    out["table"] = plain.table.clone()
    only.remove()
    return out


def test_keep_in_sync_survives_autograd_swapped_tensors_and_structure_changes(ranks):
    out = ranks.run(_changes, timeout=240)
    world = len(out)
    for r, o in enumerate(out):
        assert o["two_forwards"] == 2  # it synced before the second forward and the backward still ran
        assert "already kept in sync by another handle" in o["second_handle"]
        torch.testing.assert_close(o["swapped"], torch.full((3,), (world - 1) / 2))
        assert "changed since the last sync" in o["changed"] and "next sync names" in o["changed"]
        assert torch.equal(o["extra"], torch.zeros(2))  # agreed again, then broadcast from rank 0
        assert f"changed since the last sync on rank {world - 1};" in o["receiver_change"]  # on every rank, together
        assert torch.equal(o["table"], torch.zeros(5) if r == world - 1 else torch.zeros(4))  # as the last sync left


def _mixed_and_swapped(rank, world):
    out = {}
    model = nn.Module()  # no BatchNorm: a "mean" buffer beside a "broadcast" one (the check is one small all-reduce)
    model.register_buffer("ema", torch.full((3,), float(rank)))
    model.register_buffer("table", torch.full((2, 2), float(rank)))
    model.register_buffer("flags", torch.tensor([rank == 1, False]))  # bool, "max": any rank
    handle = zb.keep_in_sync(model, rules={"ema": "mean", "flags": "max"})
    handle.sync()
    out["first"] = {n: b.clone() for n, b in model.named_buffers()}
    model.ema.add_(rank)  # in place: the kept buckets see it
    model.table.data = torch.full((2, 2), 10.0 + rank)  # new memory under the same tensor: followed, not lost
    handle.sync()
    out["second"] = {n: b.clone() for n, b in model.named_buffers()}
    handle.remove()
    plain, only = _broadcast_only(rank)  # a swap of the source's memory reaches every receiver
    if rank == 0:
        plain.table.data = torch.full((4,), 7.0)
    else:
        plain.table.data = torch.full((4,), -1.0)  # a receiver's new memory is written too
    only.sync()
    out["plain"] = plain.table.clone()
    only.remove()
    return out


def test_keep_in_sync_mixes_mean_and_broadcast_without_batchnorm_and_follows_swapped_memory(ranks):
    out = ranks.run(_mixed_and_swapped, timeout=120)
    world = len(out)
    mean = (world - 1) / 2
    for o in out:
        torch.testing.assert_close(o["first"]["ema"], torch.full((3,), mean))
        assert torch.equal(o["first"]["table"], torch.zeros(2, 2))
        assert torch.equal(o["first"]["flags"], torch.tensor([True, False]))
        torch.testing.assert_close(o["second"]["ema"], torch.full((3,), 2 * mean))
        assert torch.equal(o["second"]["table"], torch.full((2, 2), 10.0))
        assert torch.equal(o["plain"], torch.full((4,), 7.0))


def _pack_fails(rank, world):
    from zero_buffers.bn import average as bn_average
    out = {}
    torch.manual_seed(0)
    model = Small()
    model(torch.randn(4, 3) + rank)  # BatchNorm statistics differ per rank
    handle = zb.keep_in_sync(model, rules={"ema": "mean"})
    handle.sync()
    model(torch.randn(4, 3) * (rank + 1))
    before = _digests(model)
    real = bn_average._pack
    for where in ("kind", "bn"):
        def fail(*args, **kwargs):
            raise RuntimeError(f"simulated packing failure ({where})")
        if rank == world - 1:  # one rank fails while packing: every rank raises the same error, nothing is written
            if where == "kind":
                handle._steady.kinds[0].pack = fail
            else:
                bn_average._pack = fail
        try:
            out[where] = messages({"sync": handle.sync}, zb.SyncAbortedError)["sync"]
        finally:
            handle._steady.kinds[0].__dict__.pop("pack", None)
            bn_average._pack = real
        out[f"{where}_unchanged"] = all(bitwise_equal(b, before[n]) for n, b in _digests(model).items())
    handle.sync()  # and the next sync works
    out["after"] = _digests(model)
    handle.remove()
    plain = nn.Module()  # broadcast only: the source fails packing its first bucket; every rank learns it in the check
    plain.register_buffer("table", torch.full((4,), float(rank)))
    plain.register_buffer("count", torch.tensor(rank))
    only = zb.keep_in_sync(plain)
    only.sync()
    plain.table.add_(1)
    plain.count.add_(1)
    kept = _digests(plain)
    if rank == 0:
        only._steady.kinds[0].pack = lambda i: (_ for _ in ()).throw(RuntimeError("simulated on the source"))
    out["source"] = messages({"sync": only.sync}, zb.SyncAbortedError)["sync"]
    only._steady.kinds[0].__dict__.pop("pack", None)
    out["source_unchanged"] = all(bitwise_equal(b, kept[n]) for n, b in _digests(plain).items())
    only.sync()
    out["plain_after"] = _digests(plain)
    only.remove()
    return out


def test_a_rank_failing_to_pack_makes_every_rank_raise_and_write_nothing(ranks):
    out = ranks.run(_pack_fails, timeout=120)
    world = len(out)
    for o in out:
        for where in ("kind", "bn"):
            assert f"packing or exchanging the buffers failed on rank {world - 1}" in o[where], o[where]
            assert f"simulated packing failure ({where})" in o[where] and o[f"{where}_unchanged"]
        assert "exchanging the buffers failed on rank 0 (rank 0: RuntimeError: simulated on the source)" in o["source"]
        assert o["source_unchanged"]
        assert all(bitwise_equal(b, out[0]["after"][n]) for n, b in o["after"].items())
        assert torch.equal(o["plain_after"]["table"], torch.full((4,), 1.0))
        assert int(o["plain_after"]["count"]) == 1


def _rules_break_on_one_rank(rank, world):
    out = {}
    model = nn.Module()
    model.register_buffer("ema", torch.full((3,), float(rank)))
    model.register_buffer("table", torch.full((2,), float(rank)))
    handle = zb.keep_in_sync(model, rules={"ema": "mean"}, timeout=60)  # a hang would end in CollectiveError
    handle.sync()
    if rank == world - 1:  # its "mean" buffer is now an integer: its rules no longer apply, here alone
        model._buffers["ema"] = torch.zeros(3, dtype=torch.int64)
    before = _digests(model)
    out["steady"] = messages({"sync": handle.sync}, zb.BufferStructureError)["sync"]
    out["agreement"] = messages({"sync": handle.sync}, zb.BufferStructureError)["sync"]
    out["unchanged"] = all(bitwise_equal(b, before[n]) for n, b in _digests(model).items())
    if rank == world - 1:
        model._buffers["ema"] = torch.full((3,), 10.0)  # fixed: the next sync agrees again and syncs
    handle.sync()
    out["ema"] = model.ema.clone()
    handle.remove()
    return out


def test_rules_that_stop_applying_on_one_rank_raise_on_every_rank_without_waiting(ranks):
    out = ranks.run(_rules_break_on_one_rank, timeout=120)
    world = len(out)
    for o in out:
        assert f"changed since the last sync on rank {world - 1};" in o["steady"], o["steady"]
        assert "could not plan its buffers here" in o["agreement"] and "'ema' (int64) has rule 'mean'" in o["agreement"]
        assert o["unchanged"]
        first = (world - 1) / 2  # every rank's ema after the first sync; then the last rank's is 10
        torch.testing.assert_close(o["ema"], torch.full((3,), ((world - 1) * first + 10.0) / world))


def _broadcast_rules_break(rank, world):
    out = {}
    for breaker in (world - 1, 0):  # a receiver, then the source, of a plan that only broadcasts
        model = nn.Module()
        model.register_buffer("table", torch.full((2,), float(rank)))
        handle = zb.keep_in_sync(model, rules={"tab*": "broadcast"}, strict=True, timeout=60)
        handle.sync()
        if rank == breaker:  # renamed: the strict glob matches nothing here any more
            kept = model._buffers.pop("table")
            model.register_buffer("other", torch.zeros(2))
        first = messages({"sync": handle.sync}, zb.BufferStructureError)["sync"]
        second = messages({"sync": handle.sync}, zb.BufferStructureError)["sync"]
        if rank == breaker:  # put back: every rank syncs again
            del model._buffers["other"]
            model._buffers["table"] = kept
        handle.sync()
        out[breaker] = (first, second, model.table.clone())
        handle.remove()
    return out


def test_rules_that_stop_applying_on_a_receiver_or_the_source_of_a_broadcast_plan_stop_every_rank(ranks):
    out = ranks.run(_broadcast_rules_break, timeout=120)
    world = len(out)
    for o in out:
        first, second, table = o[world - 1]  # a receiver: every rank raises with it, then learns why
        assert f"changed since the last sync on rank {world - 1};" in first
        assert "could not plan its buffers here" in second and "matches no buffer of the model (strict=True)" in second
        assert torch.equal(table, torch.zeros(2))
        first, second, table = o[0]  # the source: every rank raises, then every rank learns why at the agreement
        assert "changed since the last sync on rank 0;" in first
        assert "could not plan its buffers here" in second and "matches no buffer of the model (strict=True)" in second
        assert torch.equal(table, torch.zeros(2))


# ---- the structure check: submodules replaced on every rank, or on one -----------------------------------------------
class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


def _step_images(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 3, 5, 5, generator=g) * (1 + rank) + rank


def _stats(bn: nn.BatchNorm2d) -> tuple[int, torch.Tensor, torch.Tensor]:
    return int(bn.num_batches_tracked), bn.running_mean.clone(), bn.running_var.clone()


def _replaced_everywhere(rank, world):
    torch.manual_seed(0)
    model = ConvBN()
    handle = zb.keep_in_sync(model)
    model(_step_images(rank, 0))
    handle.sync()
    old = model.bn
    old_first = _stats(old)
    model.bn = nn.BatchNorm2d(4)  # the same key on every rank: a new layer, fresh statistics
    model(_step_images(rank, 1))  # the hook syncs before this forward (the new layer untrained), then it trains
    before = _stats(model.bn)
    old_after = _stats(old)
    handle.sync()
    handle.remove()
    return {"before": before, "after": _stats(model.bn), "old": old_after, "old_first": old_first}


def test_a_submodule_replaced_on_every_rank_is_taken_up_and_its_statistics_merged(ranks):
    out = ranks.run(_replaced_everywhere, timeout=120)
    from tests.helpers import bn_mixture
    n, mean, var = bn_mixture([{"bn": o["before"]} for o in out], "bn")
    for o in out:
        count, got_mean, got_var = o["after"]
        assert bitwise_equal(got_mean, out[0]["after"][1]) and bitwise_equal(got_var, out[0]["after"][2])
        assert count == int(n.sum()) == len(out)  # one batch per rank on the new layer
        torch.testing.assert_close(got_mean.double(), mean.float().double(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_var.double(), var.float().double(), rtol=1e-5, atol=1e-6)
        assert o["old"][0] == o["old_first"][0] == len(out)  # the detached layer is not merged again
        assert bitwise_equal(o["old"][1], o["old_first"][1])


def _replaced_on_one_rank(rank, world):
    torch.manual_seed(0)
    model = ConvBN()
    handle = zb.keep_in_sync(model)
    model(_step_images(rank, 0))
    handle.sync()
    kept = model.bn
    if rank == world - 1:
        model.bn = nn.Identity()  # a BatchNorm that no longer is, here only
    started = time.monotonic()
    first = messages({"sync": handle.sync}, zb.BufferStructureError)["sync"]
    second = messages({"sync": handle.sync}, zb.BufferStructureError)["sync"]
    seconds = time.monotonic() - started
    if rank == world - 1:
        model.bn = kept
    handle.sync()  # put back: every rank syncs again
    handle.remove()
    return {"first": first, "second": second, "seconds": seconds, "stats": _stats(model.bn)}


def test_a_submodule_replaced_on_one_rank_stops_every_rank_naming_it(ranks):
    out = ranks.run(_replaced_on_one_rank, timeout=120)
    last = len(out) - 1
    for o in out:
        assert f"changed since the last sync on rank {last};" in o["first"]  # every rank, the same sync
        assert f"rank {last}: no buffer 'bn.running_mean'" in o["second"]  # then named, at the agreement
        assert o["seconds"] < 30  # nobody waited for a deadline (the default is 300 s)
        assert o["stats"][0] == out[0]["stats"][0] and bitwise_equal(o["stats"][1], out[0]["stats"][1])


def _receiver_changes(rank, world, receiver):
    model = nn.Module()
    model.register_buffer("table", torch.full((4,), float(rank)))
    handle = zb.keep_in_sync(model)  # every buffer broadcast from rank 0: a plan that only broadcasts
    handle.sync()
    model.table.add_(1)
    if rank == receiver:
        model._buffers["table"] = torch.zeros(5)
    started = time.monotonic()
    first = messages({"sync": handle.sync}, zb.BufferStructureError)["sync"]
    seconds = time.monotonic() - started
    table = model.table.clone()
    if rank == receiver:
        model._buffers["table"] = torch.full((4,), float(rank) + 1)
    second = messages({"sync": handle.sync}, zb.BufferStructureError)["sync"]  # agrees again: structures match
    handle.remove()
    return {"first": first, "seconds": seconds, "table": table, "second": second, "after": model.table.clone()}


def test_in_a_broadcast_only_plan_a_receiver_change_stops_the_source_too(ranks):
    receiver = ranks.world_size - 1
    out = ranks.run(_receiver_changes, receiver, timeout=120)
    for r, o in enumerate(out):
        assert f"changed since the last sync on rank {receiver};" in (o["first"] or ""), (r, o["first"])
        assert o["seconds"] < 30
        assert torch.equal(o["table"], torch.zeros(5) if r == receiver else torch.full((4,), 1.0))  # nothing written
        assert o["second"] is None and torch.equal(o["after"], torch.full((4,), 1.0))  # rank 0's, everywhere


def _reshaped_in_place(rank, world):
    out = {}
    for how in ("resize_", "t_", "unsqueeze_", "t_ square"):
        model = nn.Module()
        model.register_buffer("table", torch.arange(9.0).reshape(3, 3) if how == "t_ square"
                              else torch.arange(6.0).reshape(2, 3) + rank)
        handle = zb.keep_in_sync(model)
        handle.sync()
        if rank == 0:  # the same tensor object over the same memory, another shape or layout, here only
            if how == "resize_":
                model.table.resize_(6)
            elif how == "unsqueeze_":
                model.table.unsqueeze_(0)
            else:
                model.table.t_()
        out[how] = (messages({"sync": handle.sync}, zb.BufferStructureError)["sync"], model.table.clone())
        handle.remove()
    return out


def test_a_buffer_reshaped_in_place_on_one_rank_stops_every_rank_or_is_taken_up(ranks):
    out = ranks.run(_reshaped_in_place, timeout=120)
    for o in out:
        for how in ("resize_", "t_", "unsqueeze_"):  # the shape changed on rank 0: every rank raises, nothing written
            assert "changed since the last sync on rank 0;" in (o[how][0] or ""), (how, o[how][0])
        message, table = o["t_ square"]  # same shape, other strides: taken up, synced by logical index
        assert message is None and torch.equal(table, torch.arange(9.0).reshape(3, 3).t()), table


def _counter_reset_each_window(rank, world, rebase):
    model = nn.Module()
    model.register_buffer("tokens", torch.zeros(3, dtype=torch.int64))
    handle = zb.keep_in_sync(model, rules={"tokens": "sum"})
    totals = []
    for _window in range(3):
        for _step in range(2):
            model.tokens += torch.tensor([rank + 1, 2 * rank, 1])  # what this rank routed in this step
            handle.sync()
        totals.append(model.tokens.clone())  # logged, then zeroed on every rank, as routers do per window
        model.tokens.zero_()
        if rebase:
            handle.rebase()
    handle.remove()
    return totals


def test_rebase_after_zeroing_a_sum_counter_on_every_rank_counts_only_what_follows(ranks):
    world = ranks.world_size
    per_step = torch.tensor([sum(r + 1 for r in range(world)), sum(2 * r for r in range(world)), world])
    out = ranks.run(_counter_reset_each_window, True, timeout=120)
    for totals in out:
        assert all(torch.equal(t, 2 * per_step) for t in totals), totals  # each window: its own two steps
    bare = ranks.run(_counter_reset_each_window, False, timeout=120)  # without rebase: the documented hazard
    assert torch.equal(bare[0][0], 2 * per_step) and not torch.equal(bare[0][1], 2 * per_step)


def _rebase_awaiting_agreement(rank, world):
    model = nn.Module()
    model.register_buffer("tokens", torch.zeros(3, dtype=torch.int64))
    handle = zb.keep_in_sync(model, rules={"tokens": "sum"})
    model.tokens += torch.tensor([rank + 1, 2 * rank, 1])
    handle.sync()
    model.register_buffer("extra", torch.zeros(1))  # every rank: the next sync raises and the one after agrees again
    try:
        handle.sync()
    except zb.BufferStructureError:
        pass
    model.tokens.zero_()
    handle.rebase()  # between the two: the bases the new agreement carries over
    model.tokens += torch.tensor([rank + 1, 2 * rank, 1])
    handle.sync()
    handle.remove()
    return model.tokens.clone()


def test_rebase_while_a_new_agreement_is_pending_is_what_that_agreement_carries_over(ranks2):
    out = ranks2.run(_rebase_awaiting_agreement, timeout=120)
    assert all(torch.equal(t, torch.tensor([3, 2, 2])) for t in out), out


def _meta_at_install(rank, world):
    if rank == 0:
        model = nn.Sequential(nn.BatchNorm1d(3, affine=False))
        model[0](torch.randn(6, 3) + 5)  # rank 0 holds real, trained statistics
    else:
        with torch.device("meta"):
            model = nn.Sequential(nn.BatchNorm1d(3, affine=False))  # built on meta: its buffers hold nothing yet
    handle = zb.keep_in_sync(model)  # installed before the buffers are materialised: that start counts as not shared
    zb.broadcast_buffers(model, materialize=True)  # the flow the library's own errors recommend
    model[0](torch.randn(6, 3) * (rank + 1))
    handle.sync()
    handle.remove()
    return int(model[0].num_batches_tracked), model[0].running_mean.clone()


def test_keep_in_sync_installed_while_buffers_are_on_meta_syncs_once_they_are_materialised(ranks):
    out = ranks.run(_meta_at_install, timeout=120)
    for count, mean in out:
        assert count == out[0][0] and torch.equal(mean, out[0][1])
    assert out[0][0] == 2 * len(out)  # rank 0's batch counted on every rank by the broadcast, then every rank's one
