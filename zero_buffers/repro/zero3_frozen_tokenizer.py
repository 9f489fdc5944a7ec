"""Incident 1: a frozen Conv3d+BatchNorm3d tokenizer under ZeRO-3 gives different outputs per rank; four fixes, and the per-call cost.

Run: zero-buffers repro zero3_frozen_tokenizer --nproc 2   (or torchrun / accelerate launch, see README)
Quick and full (ZB_FULL=1) are the same run: it is all start-up.
"""
from __future__ import annotations

# _common first: it quiets other libraries' noise before they are imported (ZB_VERBOSE=1 keeps it)
from _common import Table, all_ranks, max_output_diff, ms_per_call, setup_deepspeed, zero3_config

import deepspeed
import torch
from torch import nn

import zero_buffers as zb

# Wall seconds under torchrun --nproc-per-node=2 on an idle 2-core machine, about 1.5x measured (the CLI's timeout).
BUDGET_SECONDS = {"quick": 15, "full": 15}


class VideoTokenizer(nn.Module):
    def __init__(self, channels: int = 32):
        super().__init__()
        self.conv1 = nn.Conv3d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm3d(channels)
        self.conv2 = nn.Conv3d(channels, channels, 3, padding=1, stride=2)
        self.bn2 = nn.BatchNorm3d(channels)

    def forward(self, video):
        return self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(video)))))


def pretrained() -> dict[str, torch.Tensor]:
    """The tokenizer checkpoint (non-trivial BatchNorm statistics)."""
    torch.manual_seed(0)
    ref = VideoTokenizer()
    with torch.no_grad():
        for bn in (ref.bn1, ref.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.num_batches_tracked.fill_(1000)
    return ref.state_dict()


def zero3_tokenizer(rank: int, loader, checkpoint: dict[str, torch.Tensor]) -> VideoTokenizer:
    """Built under zero.Init (as when created after the Accelerator), ``checkpoint`` loaded on rank 0 only."""
    torch.manual_seed(rank)
    with deepspeed.zero.Init(config_dict_or_path=zero3_config()):
        tok = VideoTokenizer().eval()
    with loader(tok):
        if rank == 0:
            tok.load_state_dict(checkpoint)
    return tok


def gathered_forward(tok: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the team ran: the forward inside GatheredParameters(modifier_rank=None)."""
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(tok.parameters()), modifier_rank=None):
        return tok(x)


def main() -> None:
    rank, world, device = setup_deepspeed()
    table = Table(f"zero3_frozen_tokenizer: {world} ranks, frozen tokenizer under ZeRO-3",
                  ["max output diff across ranks", "plain replica"])
    x = torch.randn(2, 3, 4, 16, 16, generator=torch.Generator().manual_seed(1)).to(device)
    # the checkpoint and the plain reference exist before any zero.Init: DeepSpeed < 0.15 may leave its __init__
    # wrapper on BatchNorm3d after a context exits (which classes varies per process), and a tokenizer built then is
    # partitioned on those ranks only (_common.keeps_zero_init_wrapper)
    checkpoint = pretrained()
    reference = VideoTokenizer().eval().to(device)
    reference.load_state_dict(checkpoint)
    ds_load = lambda tok: deepspeed.zero.GatheredParameters(list(tok.parameters()), modifier_rank=0)  # noqa: E731

    tok = zero3_tokenizer(rank, ds_load, checkpoint)
    diff = max_output_diff(gathered_forward(tok, x))
    table.add("BUG", "GatheredParameters, rank-0 load", [diff, "no"], diff > 0)

    zb.broadcast_buffers(tok)
    diff = max_output_diff(gathered_forward(tok, x))
    table.add("FIX 1", "broadcast_buffers after the load", [diff, "no"], diff == 0)
    partitioned = tok

    tok = zero3_tokenizer(rank, lambda t: zb.GatheredParametersAndBuffers(t, modifier_rank=0), checkpoint)
    diff = max_output_diff(gathered_forward(tok, x))
    table.add("FIX 2", "GatheredParametersAndBuffers(mod_rank=0)", [diff, "no"], diff == 0)

    with deepspeed.zero.Init(config_dict_or_path=zero3_config()):  # the training model's context is active
        with zb.no_zero_init():
            tok = VideoTokenizer().eval()
        tok.load_state_dict(checkpoint)  # a plain module: every rank loads the file itself
    plain = all_ranks(all(not hasattr(p, "ds_id") and p.numel() > 0 for p in tok.parameters()))
    with torch.no_grad():
        diff = max_output_diff(tok(x))
    table.add("FIX 3", "no_zero_init inside active zero.Init", [diff, "yes" if plain else "no"], diff == 0 and plain)

    replica = zb.frozen_replica(zero3_tokenizer(rank, ds_load, checkpoint))
    plain = all_ranks(zb.is_frozen_replica(replica) and all(not hasattr(t, "ds_id") and t.numel() > 0
                                                           for t in replica.parameters()))
    diff = max_output_diff(replica(x))
    table.add("FIX 4", "frozen_replica (weights as buffers)", [diff, "yes" if plain else "no"], diff == 0 and plain)

    for size in (8, 32):
        xs = torch.randn(1, 3, 4, size, size, device=device)
        t_gather = ms_per_call(lambda: gathered_forward(partitioned, xs))
        t_frozen = ms_per_call(lambda: replica(xs))
        with torch.no_grad():
            t_plain = ms_per_call(lambda: reference(xs))
        table.add("COST", f"ms/forward at {size}x{size}: gathered / frozen / plain",
                  [f"{t_gather:.2f} / {t_frozen:.2f} / {t_plain:.2f}",
                   f"gathered = {t_gather / t_frozen:.1f}x frozen"], None)
    table.finish()


if __name__ == "__main__":
    main()
