"""Small models and helpers the ZeRO-3 tests share: a Linear + BatchNorm block, a VQ-style module and its rank-0
checkpoint, the Conv3d + BatchNorm3d tokenizer of incident 1, and a read-only gather of ZeRO-3 parameters."""
from __future__ import annotations

import torch
from torch import nn


class VQ(nn.Module):
    """BatchNorm + a codebook made with randn (differs per rank under zero.Init) + a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("codebook", torch.randn(6, 4))
        self.register_buffer("table", torch.randn(3), persistent=False)


def checkpoint() -> dict[str, torch.Tensor]:
    """A 'pretrained' state dict every rank can rebuild (only rank 0 will load it)."""
    torch.manual_seed(99)
    ref = VQ()
    with torch.no_grad():
        ref.bn.running_mean.uniform_(1, 2)
        ref.bn.running_var.uniform_(3, 4)
        ref.bn.num_batches_tracked.fill_(42)
    return ref.state_dict()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather ZeRO-3 parameters read-only and copy them out."""
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)


class Tokenizer(nn.Module):
    """Conv3d + BatchNorm3d: incident 1's frozen video tokenizer, in miniature."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm3d(4)
        self.proj = nn.Linear(4, 4)
        self.proj2 = nn.Linear(4, 4)
        self.proj2.weight = self.proj.weight  # tied weights stay tied

    def forward(self, x):
        return self.proj2(self.proj(self.bn(self.conv(x)).mean((2, 3, 4))))
