"""``sync_buffers(model)`` with neither a policy nor rules (and with ``rules=None``) applies the default rules, the
``"average"`` preset, as ``keep_in_sync(rules=None)`` does: every BatchNorm's statistics become the exact merge, every
other buffer rank 0's; bit for bit what ``sync_buffers(model, "average")`` gives. Real gloo ranks at world 2 and 4."""
from __future__ import annotations

import torch

import zero_buffers as zb
from tests.helpers import Toy, bitwise_equal, scramble


def _model(rank: int) -> Toy:
    torch.manual_seed(0)
    model = scramble(Toy(), rank)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.num_batches_tracked.fill_(rank + 1)
    return model


def _defaults(rank, world):
    out = {}
    for how, call in {"bare": lambda m: zb.sync_buffers(m), "rules=None": lambda m: zb.sync_buffers(m, rules=None),
                      "average": lambda m: zb.sync_buffers(m, "average")}.items():
        model = _model(rank)
        returned = call(model)
        out[how] = (returned, {n: b.clone() for n, b in model.named_buffers()})
    out["rank0"] = {n: b.clone() for n, b in _model(0).named_buffers()}
    out["own"] = {n: b.clone() for n, b in _model(rank).named_buffers()}
    return out


def test_sync_buffers_without_policy_or_rules_applies_the_default_rules(ranks):
    out = ranks.run(_defaults, timeout=120)
    stats = ("running_mean", "running_var", "num_batches_tracked")
    for o in out:
        for how in ("bare", "rules=None"):
            returned, got = o[how]
            assert returned == o["average"][0] > 0
            assert all(bitwise_equal(got[n], o["average"][1][n]) for n in got), how  # the "average" preset
            assert all(bitwise_equal(got[n], out[0][how][1][n]) for n in got)  # the same on every rank
            for n, b in got.items():
                if not n.endswith(stats):
                    assert bitwise_equal(b, o["rank0"][n]), n  # every other buffer: rank 0's
            assert int(got["bn.num_batches_tracked"]) == sum(r + 1 for r in range(len(out)))  # merged, counted
            if len(out) > 1:
                assert not bitwise_equal(got["bn.running_mean"], o["own"]["bn.running_mean"])
