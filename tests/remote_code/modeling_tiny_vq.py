"""A tiny VQ "video tokenizer" shipped as custom code: Conv3d + BatchNorm3d encoder, a codebook kept as a
persistent buffer (randn at init, like the EMA codebooks of real tokenizers), a non-persistent per-channel input
scale computed from the config (like rotary tables / filter kernels), ConvTranspose3d decoder.

It reads `self.dtype`, `self.device` and `next(self.parameters())` the way real remote-code models do, so it also
exercises those under tools that move, partition or gather parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_tiny_vq import TinyVQConfig


@dataclass
class TinyVQOutput(ModelOutput):
    reconstruction: torch.FloatTensor | None = None
    indices: torch.LongTensor | None = None
    commit_loss: torch.FloatTensor | None = None


def _input_scale(config: TinyVQConfig) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, config.in_channels).view(1, -1, 1, 1, 1)


class TinyVQVideoModel(PreTrainedModel):
    # Not "...Tokenizer": transformers' custom_object_save writes a tokenizer-style [slow, fast] auto_map entry for
    # any class whose name contains "Tokenizer", and AutoModel cannot load that.
    config_class = TinyVQConfig
    base_model_prefix = "tokenizer"
    main_input_name = "pixel_values"

    def __init__(self, config: TinyVQConfig):
        super().__init__(config)
        c, h, d = config.in_channels, config.hidden_channels, config.embed_dim
        self.enc_conv = nn.Conv3d(c, h, kernel_size=3, stride=(1, 2, 2), padding=1)
        self.enc_bn = nn.BatchNorm3d(h)
        self.enc_proj = nn.Conv3d(h, d, kernel_size=1)
        self.dec_up = nn.ConvTranspose3d(d, h, kernel_size=(1, 4, 4), stride=(1, 2, 2), padding=(0, 1, 1))
        self.dec_bn = nn.BatchNorm3d(h)
        self.dec_out = nn.Conv3d(h, c, kernel_size=3, padding=1)
        self.act = nn.SiLU()
        self.register_buffer("codebook", torch.randn(config.codebook_size, d))
        self.register_buffer("input_scale", _input_scale(config), persistent=False)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self:
            # transformers 5 builds on the meta device and leaves non-persistent buffers empty: set them here.
            # (torch.nn.init is guarded by transformers 5, so a codebook loaded from the checkpoint is kept.)
            with torch.no_grad():
                self.input_scale.copy_(_input_scale(self.config).to(self.input_scale))
            nn.init.normal_(self.codebook)

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Video (B, C, T, H, W) -> token indices (B, T, H/2, W/2)."""
        pixel_values = pixel_values.to(device=self.device, dtype=self.dtype)
        z = self._encode_latents(pixel_values)
        return self._quantize(z)[1]

    def decode(self, indices: torch.Tensor) -> torch.Tensor:
        """Token indices (B, T, h, w) -> video (B, C, T, 2h, 2w)."""
        param = next(self.parameters())
        z = self.codebook[indices.to(self.codebook.device)].to(param.dtype)  # B T h w D
        return self._decode_latents(z.permute(0, 4, 1, 2, 3))

    def _encode_latents(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.input_scale.to(x.dtype)
        return self.enc_proj(self.act(self.enc_bn(self.enc_conv(x))))

    def _quantize(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = z.permute(0, 2, 3, 4, 1).reshape(-1, z.shape[1])
        codebook = self.codebook.to(flat.dtype)
        indices = torch.cdist(flat, codebook).argmin(dim=-1)
        q = codebook[indices].view(z.shape[0], *z.shape[2:], z.shape[1]).permute(0, 4, 1, 2, 3)
        return q, indices.view(z.shape[0], *z.shape[2:])

    def _decode_latents(self, q: torch.Tensor) -> torch.Tensor:
        return self.dec_out(self.act(self.dec_bn(self.dec_up(q)))) / self.input_scale.to(q.dtype)

    def forward(self, pixel_values: torch.Tensor, return_dict: bool | None = None):
        pixel_values = pixel_values.to(device=self.device, dtype=self.dtype)
        z = self._encode_latents(pixel_values)
        q, indices = self._quantize(z)
        commit_loss = torch.mean((z - q.detach()) ** 2)
        q = z + (q - z).detach()  # straight-through
        recon = self._decode_latents(q)
        if return_dict is False:
            return recon, indices, commit_loss
        return TinyVQOutput(reconstruction=recon, indices=indices, commit_loss=commit_loss)
