"""ZeRO-3 edge cases (reliability): nesting with DeepSpeed's own contexts, after deepspeed.initialize."""
from __future__ import annotations

import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import ZERO3_CONFIG, buffers, init_deepspeed, same_state


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)


def _nested_in_deepspeeds_own(rank, world):
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        model = Block()
    sd = {k: v.clone() for k, v in Block().state_dict().items()} if rank == 0 else None
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        # the same parameters again: DeepSpeed 0.19.8 raises on overlapping nested gathers; ours defers to the outer
        with zb.GatheredParametersAndBuffers(model, modifier_rank=0):
            gathered_inside = all(p.numel() > 0 for p in model.parameters())
            if rank == 0:
                model.load_state_dict(sd)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return gathered_inside, buffers(model), params, all(p.numel() == 0 for p in model.parameters())


def test_ours_nested_inside_deepspeeds_gather_of_the_same_parameters(ranks):
    out = ranks.run(_nested_in_deepspeeds_own, timeout=120)
    for gathered_inside, bufs, params, partitioned in out:
        assert gathered_inside and partitioned
        assert same_state(bufs, out[0][1]) and same_state(params, out[0][2])  # buffers AND params from rank 0


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
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
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
    calls = []
    import zero_buffers.zero_init as zi
    real = zi.broadcast_entries

    def counting(*a, **k):
        calls.append(a[4])
        return real(*a, **k)

    zi.broadcast_entries = counting
    try:
        with zb.install():
            with zb.Init(config_dict_or_path=ZERO3_CONFIG):
                with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
                    model = Block()
                    model.register_buffer("codebook", torch.randn(3))
    finally:
        zi.broadcast_entries = real
    return calls, buffers(model)


def test_install_and_own_init_together_sync_once(ranks):
    out = ranks.run(_install_with_own_init, timeout=120)
    for calls, bufs in out:
        assert calls == ["zero_buffers.Init"]  # one sync, not two
        assert same_state(bufs, out[0][1])
