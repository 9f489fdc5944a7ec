"""Sections ``frozen`` and ``frozen_real``: the per-forward cost of ``frozen_replica``.

- ``frozen``: a frozen Conv3d+BatchNorm tokenizer built under DeepSpeed ZeRO-3 (``zero.Init``), its forward wrapped
  in ``GatheredParameters`` (what a frozen module inside ZeRO-3 needs: an all-gather of its weights per call),
  against ``frozen_replica`` of it and the same module as a plain one under ``no_grad``; the claim: the replica runs
  as fast as the plain module, many times faster than gathering.
- ``frozen_real``: ``frozen_replica`` of real transformers models (BERT, ResNet-34) against the same model as a
  plain module under ``no_grad``; the claim: the replica's API (same-name subclasses, the ``parameters()``
  override, the ``no_grad`` wrapper) costs nothing measurable per forward.

One file for both: they measure the same function against the plain module, on a ZeRO-3 model and on real ones.
Every output is checked equal to the plain module's. Results: sections ``frozen`` and ``frozen_real`` of
``results.json`` / ``results.md`` in the output folder (default ``benchmarks/results/``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

import zero_buffers as zb
from harness import init_deepspeed, timed_together, tokenizer, zero3_config


def bench_frozen(ctx: dict) -> list[dict]:
    """Section 3: per-call forward of a frozen module: GatheredParameters around ZeRO-3 vs frozen_replica vs plain."""
    deepspeed = init_deepspeed(ctx["device"])
    cfg = zero3_config()
    width = 8 if ctx["quick"] else 32

    with deepspeed.zero.Init(config_dict_or_path=cfg):
        partitioned = tokenizer(width)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        replica = zb.frozen_replica(tokenizer(width))
    plain = tokenizer(width).to(ctx["device"])
    params = list(partitioned.parameters())

    def gathered(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return partitioned(x)

    rows = []
    for size in ((8, 32) if not ctx["quick"] else (4, 8)):
        x = torch.randn(1, 3, 4, size, size, device=ctx["device"])
        with torch.no_grad():
            want = plain(x)
        for out in (gathered(x), replica(x)):
            torch.testing.assert_close(out, want)
        r = {"input": f"1x3x4x{size}x{size}"}
        def plain_no_grad(x: torch.Tensor = x) -> torch.Tensor:
            with torch.no_grad():
                return plain(x)

        r.update(timed_together({"GatheredParameters": lambda: gathered(x), "frozen_replica": lambda: replica(x),
                                 "plain": plain_no_grad}, ctx["repeats"], ctx["device"]))
        r["frozen_over_plain"] = r["frozen_replica"] / r["plain"]
        r["gathered_over_frozen"] = r["GatheredParameters"] / r["frozen_replica"]
        rows.append(r)
        ctx["log"](f"frozen {r['input']}: gathered/frozen {r['gathered_over_frozen']:.1f}x, "
                   f"frozen/plain {r['frozen_over_plain']:.2f}x")
    return rows


def bench_frozen_real(ctx: dict) -> list[dict]:
    """Section 8: the per-forward cost of frozen_replica on real transformers models against the same model as a
    plain module under no_grad (the replica's no_grad wrapper, class swap and parameters() override)."""
    from transformers import BertConfig, BertModel, ResNetConfig, ResNetModel

    def bert() -> nn.Module:
        torch.manual_seed(0)
        cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                         vocab_size=256)
        return BertModel(cfg).eval()

    def resnet34() -> nn.Module:
        torch.manual_seed(0)
        cfg = ResNetConfig(depths=[3, 4, 6, 3], layer_type="basic", hidden_sizes=[16, 32, 64, 128], embedding_size=16)
        return ResNetModel(cfg).eval()

    inputs = {"BERT (2 layers, hidden 64)": (bert, {"input_ids": torch.randint(0, 256, (4, 32))}),
              "ResNet-34 (widths 16-128)": (resnet34, {"pixel_values": torch.randn(4, 3, 64, 64)})}
    rows = []
    for name, (build, batch) in inputs.items():
        plain, replica = build(), zb.frozen_replica(build())
        with torch.no_grad():
            want = plain(**batch).last_hidden_state
        torch.testing.assert_close(replica(**batch).last_hidden_state, want)

        def plain_forward() -> Any:
            with torch.no_grad():
                return plain(**batch)

        t = timed_together({"plain_no_grad": plain_forward, "frozen_replica": lambda: replica(**batch)},
                           ctx["repeats"], ctx["device"])
        rows.append({"model": name, **t, "frozen_over_plain": t["frozen_replica"] / t["plain_no_grad"]})
        ctx["log"](f"frozen_real {name}: frozen/plain {rows[-1]['frozen_over_plain']:.3f}x")
    return rows
