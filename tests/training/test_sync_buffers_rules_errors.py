"""A rule only one rank's model refuses (its buffer an integer where the others' are floats, under ``"mean"``) stops
every rank: that rank meets its peers in their first collective with its reason, and every rank raises the same
``BufferStructureError`` naming it within seconds (before, its peers waited 300 s for it and ended in
``CollectiveError``), nothing changed; when every rank's model refuses it alike, every rank raises the
``InvalidArgumentError`` itself (after one small all_gather that shows they failed alike). Real gloo ranks at world 2
and 4."""
from __future__ import annotations

import time

import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import messages


def _model(rank: int, odd: int | str | None) -> nn.Module:
    model = nn.Module()
    dtype = torch.int64 if odd in (rank, "all") else torch.float32
    model.register_buffer("ema", torch.full((3,), rank, dtype=dtype))
    return model


def _rank_dependent(rank, world):
    out = {}
    for odd in (world - 1, "all", None):
        model = _model(rank, odd)
        started = time.monotonic()
        error = messages({"sync": lambda: zb.sync_buffers(model, rules={"ema": "mean"})}, zb.ZeroBuffersError)
        out[odd] = (error["sync"], time.monotonic() - started, model.ema.clone())
    return out


def test_a_rule_one_ranks_model_refuses_stops_every_rank_naming_it(ranks):
    out = ranks.run(_rank_dependent, timeout=120)
    world = len(out)
    for r, o in enumerate(out):
        message, seconds, ema = o[world - 1]
        assert message is not None and "could not plan its buffers here" in message, message
        assert "'mean' of int64 values is not exact" in message and f"rank {world - 1}" in message, message
        assert seconds < 20
        assert torch.equal(ema, torch.full((3,), r, dtype=ema.dtype))  # nothing changed
        message, _, _ = o["all"]  # every rank's model refuses it: the rule error itself, everywhere
        assert message == out[0]["all"][0] and message.startswith("sync_buffers(): buffer 'ema' (int64) has rule")
        message, _, _ = o[None]  # every rank's model is fine: they sync
        assert message is None
    assert all(torch.equal(o[None][2], out[0][None][2]) for o in out)
