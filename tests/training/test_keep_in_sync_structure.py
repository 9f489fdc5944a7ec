"""keep_in_sync's structure check is exact, and every rank raises together: a submodule replaced on every rank is
taken up (its statistics merged, the detached layer never again), one replaced on one rank only stops every rank
with an error naming it, and in a plan that only broadcasts a receiver's change stops the source too (no rank waits
for a peer that raised). Real gloo ranks, the default ``timeout=None``."""
from __future__ import annotations

import time

import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal, messages


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


def _images(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 3, 5, 5, generator=g) * (1 + rank) + rank


def _stats(bn: nn.BatchNorm2d) -> tuple[int, torch.Tensor, torch.Tensor]:
    return int(bn.num_batches_tracked), bn.running_mean.clone(), bn.running_var.clone()


def _replaced_everywhere(rank, world):
    torch.manual_seed(0)
    model = Net()
    handle = zb.keep_in_sync(model)
    model(_images(rank, 0))
    handle.sync()
    old = model.bn
    old_first = _stats(old)
    model.bn = nn.BatchNorm2d(4)  # the same key on every rank: a new layer, fresh statistics
    model(_images(rank, 1))  # the hook syncs before this forward (the new layer untrained), then it trains
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
    model = Net()
    handle = zb.keep_in_sync(model)
    model(_images(rank, 0))
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
