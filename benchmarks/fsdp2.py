"""Section ``fsdp2``: zero_buffers under FSDP2's ``fully_shard``, beside a plain module and DeepSpeed ZeRO-3.

- ``broadcast_buffers`` and ``buffer_report`` of ResNet-50's BatchNorm layers as a plain (DDP) module, under
  ``fully_shard`` and under ZeRO-3 (``zero.Init``), side by side; the claim: buffers under FSDP2 are plain tensors,
  syncing or checking them costs what it costs on a plain module;
- a frozen Conv3d tokenizer's forward left inside ``fully_shard`` (it all-gathers its weights in every forward)
  against ``frozen_replica`` of it and the plain module; the claim: the replica runs as fast as the plain module.

Results: section ``fsdp2`` of ``results.json`` / ``results.md`` in the output folder (the run the docs quote is in
``benchmarks/results/fsdp2/``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import zero_buffers as zb
from harness import init_deepspeed, resnet_bn_net, scrambled, timed_together, tokenizer, zero3_config


def bench_fsdp2(ctx: dict) -> list[dict]:
    """Section 10: FSDP2. broadcast_buffers / buffer_report on ResNet-50's BatchNorm layers as a plain (DDP) module,
    under fully_shard and under ZeRO-3 (zero.Init), side by side; then a frozen module's forward under fully_shard
    (all-gathers per forward) against frozen_replica of it and the plain module."""
    from torch.distributed.fsdp import fully_shard

    deepspeed = init_deepspeed(ctx["device"])
    blocks = (1, 1, 1, 1) if ctx["quick"] else (3, 4, 6, 3)

    def bn_net() -> nn.Module:
        return scrambled(lambda: resnet_bn_net(blocks), ctx["rank"], ctx["device"])

    plain = bn_net()
    sharded = bn_net()
    for layer in sharded:
        fully_shard(layer)
    fully_shard(sharded)
    with deepspeed.zero.Init(config_dict_or_path=zero3_config()):
        zero3 = resnet_bn_net(blocks).to(ctx["device"])
    rows = []
    for what, call in (("broadcast_buffers", zb.broadcast_buffers), ("buffer_report", zb.buffer_report)):
        t = timed_together({k: functools.partial(call, m) for k, m in
                            (("plain", plain), ("fully_shard", sharded), ("zero3", zero3))}, ctx["repeats"],
                           ctx["device"])
        rows.append({"what": what, **t, "fsdp2_over_plain": t["fully_shard"] / t["plain"],
                     "fsdp2_over_zero3": t["fully_shard"] / t["zero3"]})
        ctx["log"](f"fsdp2 {what}: fully_shard/plain {rows[-1]['fsdp2_over_plain']:.2f}, "
                   f"fully_shard/zero3 {rows[-1]['fsdp2_over_zero3']:.2f}")
    width = 8 if ctx["quick"] else 32

    frozen_plain = tokenizer(width).to(ctx["device"])
    under_fsdp2 = tokenizer(width).to(ctx["device"])
    for layer in (under_fsdp2[0], under_fsdp2[3]):
        fully_shard(layer)
    fully_shard(under_fsdp2)
    replica = tokenizer(width).to(ctx["device"])
    for layer in (replica[0], replica[3]):
        fully_shard(layer)
    fully_shard(replica)
    zb.frozen_replica(replica)
    x = torch.randn(1, 3, 4, 16, 16, device=ctx["device"])

    def no_grad(m: nn.Module) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return m(x)
        return run

    want = no_grad(frozen_plain)()
    for m in (under_fsdp2, replica):
        torch.testing.assert_close(no_grad(m)(), want)
    t = timed_together({"fully_shard": no_grad(under_fsdp2), "frozen_replica": no_grad(replica),
                        "plain": no_grad(frozen_plain)}, ctx["repeats"], ctx["device"])
    rows.append({"what": "frozen forward 1x3x4x16x16", **t, "fsdp2_over_frozen": t["fully_shard"] / t["frozen_replica"],
                 "frozen_over_plain": t["frozen_replica"] / t["plain"]})
    ctx["log"](f"fsdp2 frozen forward: fully_shard/frozen_replica {rows[-1]['fsdp2_over_frozen']:.1f}x, "
               f"frozen_replica/plain {rows[-1]['frozen_over_plain']:.2f}")
    return rows
