"""A buffer no write can change (an inference tensor, made under ``torch.inference_mode()``) is refused on every rank
right after the structure agreement, naming it, before any data moves: the writes after the vote only copy, so
whatever could make one fail is found before it. Real gloo ranks at world 2 and 4."""
from __future__ import annotations

import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import messages


def _inference_buffer(rank, world):
    model = nn.Module()
    with torch.inference_mode():
        frozen = torch.full((3,), float(rank))
    model.register_buffer("table", frozen)
    model.register_buffer("plain", torch.full((2,), float(rank)))
    errors = messages({"broadcast": lambda: zb.broadcast_buffers(model),
                       "average": lambda: zb.sync_buffers(model, "average")}, zb.InvalidArgumentError)
    return errors, model.table.clone(), model.plain.clone()


def test_an_inference_tensor_buffer_is_refused_on_every_rank_before_any_data_moves(ranks):
    out = ranks.run(_inference_buffer, timeout=60)
    for r, (errors, table, plain) in enumerate(out):
        for message in errors.values():
            assert message is not None and "inference tensors" in message and "'table'" in message, message
        assert errors == out[0][0]
        assert torch.equal(table, torch.full((3,), float(r))) and torch.equal(plain, torch.full((2,), float(r)))
