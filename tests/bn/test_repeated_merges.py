"""Repeated BatchNorm merges count nothing twice: with ``momentum=None`` eight syncs of keep_in_sync leave exactly
the statistics one average_bn_stats would give at the end (the float64 mixture of every rank's batches); the first
sync of ranks that already diverged (a plain module, and a real DeepSpeed ZeRO-3 engine) is exactly
average_bn_stats' mixture, not the source's whole count against the others' increments. Real gloo ranks at world 2,
3 and 4 (every other path and start: tests/training/test_reduction_oracle.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import bn_mixture

SYNCS = 8


def _rows(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 3, generator=g) * (1 + rank) + 3.0 * rank + 0.2 * step


def _reference(world: int, steps: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """float64: each rank's batches as its own component (its statistics had it never synced), mixed."""
    per_rank = []
    for r in range(world):
        xs = [_rows(r, s).float().double() for s in range(steps)]
        per_rank.append({"bn": (len(xs), sum(x.mean(0) for x in xs) / len(xs),
                                sum(x.var(0, unbiased=True) for x in xs) / len(xs))})
    n, mean, var = bn_mixture(per_rank, "bn")
    return int(n.sum()), mean, var


def _cumulative_syncs(rank, world):
    model = nn.Sequential(nn.BatchNorm1d(3, momentum=None))
    handle = zb.keep_in_sync(model)
    for step in range(SYNCS):
        model[0](_rows(rank, step))  # the layer itself: no hook, the sync is ours to call
        handle.sync()
    handle.remove()
    bn = model[0]
    return int(bn.num_batches_tracked), bn.running_mean.double(), bn.running_var.double()


def test_eight_cumulative_syncs_equal_one_merge_at_the_end(ranks):
    out = ranks.run(_cumulative_syncs, timeout=120)
    count, mean, var = _reference(len(out), SYNCS)
    for got in out:
        assert got[0] == count == SYNCS * len(out)
        torch.testing.assert_close(got[1], mean, rtol=1e-6, atol=1e-6)  # was off by 0.66 (values near 3.2)
        torch.testing.assert_close(got[2], var, rtol=1e-5, atol=1e-5)


def _diverged_first_sync(rank, world):
    model = nn.Sequential(nn.BatchNorm1d(3))
    for step in range(rank + 1):  # rank r ran r + 1 batches before keep_in_sync was called: ranks differ
        model[0](_rows(rank, step))
    before = (int(model[0].num_batches_tracked), model[0].running_mean.double(), model[0].running_var.double())
    handle = zb.keep_in_sync(model)
    model[0](_rows(rank, 50))  # one more batch each, then the first sync
    now = (int(model[0].num_batches_tracked), model[0].running_mean.double(), model[0].running_var.double())
    handle.sync()
    handle.remove()
    return {"before": before, "now": now, "after": (int(model[0].num_batches_tracked),
                                                    model[0].running_mean.double(), model[0].running_var.double())}


@pytest.mark.parametrize("world", [3, 4])
def test_the_first_sync_of_ranks_that_already_diverged_is_average_bn_stats(pools, world):
    out = pools(world).run(_diverged_first_sync, timeout=120)
    n, mean, var = bn_mixture([{"bn": o["now"]} for o in out], "bn")  # every rank's whole statistics
    for o in out:
        assert o["after"][0] == int(n.sum()) == sum(r + 2 for r in range(world))
        torch.testing.assert_close(o["after"][1], mean.float().double(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o["after"][2], var.float().double(), rtol=1e-5, atol=1e-6)


def _engine_first_sync(rank, world):
    from tests.helpers import ZERO3_CONFIG, init_deepspeed
    deepspeed = init_deepspeed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with torch.no_grad():
        for step in range(rank + 1):  # diverged before the engine and keep_in_sync exist
            model[1](_rows(rank, step))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.0),
                                      config={**ZERO3_CONFIG, "train_micro_batch_size_per_gpu": 6})
    handle = zb.keep_in_sync(engine)
    engine.backward(engine(_rows(rank, 50)).square().mean())
    bn = engine.module[1]
    now = (int(bn.num_batches_tracked), bn.running_mean.double(), bn.running_var.double())
    engine.step()  # the first sync
    handle.remove()
    return {"now": now, "after": (int(bn.num_batches_tracked), bn.running_mean.double(), bn.running_var.double())}


@pytest.mark.stack
def test_the_first_sync_of_a_zero3_engine_whose_ranks_diverged_is_average_bn_stats(ranks):
    out = ranks.run(_engine_first_sync, timeout=240)
    n, mean, var = bn_mixture([{"bn": o["now"]} for o in out], "bn")
    for o in out:
        assert o["after"][0] == int(n.sum())
        torch.testing.assert_close(o["after"][1], mean.float().double(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o["after"][2], var.float().double(), rtol=1e-5, atol=1e-6)


def _momentum_switches(rank, world):
    out = {}
    model = nn.Sequential(nn.BatchNorm1d(3, momentum=None))  # cumulative, then an EMA from step 4
    handle = zb.keep_in_sync(model)
    for step in range(8):
        if step == 4:
            model[0].momentum = 0.1
        model[0](_rows(rank, step))
        handle.sync()
    handle.remove()
    out["to_ema"] = model[0].running_mean.double()
    model = nn.Sequential(nn.BatchNorm1d(3))  # an EMA, then reset and cumulative (torch's swa_utils.update_bn)
    handle = zb.keep_in_sync(model)
    for step in range(8):
        if step == 4:
            model[0].momentum = None
            model[0].reset_running_stats()
        model[0](_rows(rank, step))
        handle.sync()
    handle.remove()
    bn = model[0]
    out["to_cumulative"] = (int(bn.num_batches_tracked), bn.running_mean.double(), bn.running_var.double())
    return out


def test_a_layer_whose_momentum_changes_is_merged_by_its_new_kind_from_then_on(ranks):
    out = ranks.run(_momentum_switches, timeout=120)
    world = len(out)
    # cumulative for 4 steps (the mean of every batch mean), then an EMA of the rank-averaged batch means
    avg = [sum(_rows(r, s).float().double().mean(0) for r in range(world)) / world for s in range(8)]
    want = sum(avg[:4]) / 4
    for s in range(4, 8):
        want = 0.9 * want + 0.1 * avg[s]
    # reset at step 4 and cumulative since: average_bn_stats of the batches since the reset, had no rank synced
    per_rank = [{"bn": (4, sum(_rows(r, s).float().double().mean(0) for s in range(4, 8)) / 4,
                        sum(_rows(r, s).float().double().var(0, unbiased=True) for s in range(4, 8)) / 4)}
                for r in range(world)]
    n, mean, var = bn_mixture(per_rank, "bn")
    for o in out:
        torch.testing.assert_close(o["to_ema"], want, rtol=1e-5, atol=1e-5)
        count, got_mean, got_var = o["to_cumulative"]
        assert count == int(n.sum()) == 4 * world
        torch.testing.assert_close(got_mean, mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_var, var, rtol=1e-5, atol=1e-5)
