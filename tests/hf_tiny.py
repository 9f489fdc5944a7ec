"""A tiny transformers PreTrainedModel with BatchNorm and a random non-persistent buffer (no hub needed)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class TinyConfig(PretrainedConfig):
    model_type = "zb_tiny"

    def __init__(self, hidden: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.hidden = hidden


class TinyModel(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig):
        super().__init__(config)
        h = config.hidden
        self.lin = nn.Linear(h, h)
        self.bn = nn.BatchNorm1d(h)
        self.register_buffer("noise", torch.randn(h), persistent=False)  # like a random projection / codebook
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self:  # transformers 5 builds on the meta device: non-persistent buffers are set here
            torch.nn.init.normal_(self.noise)

    def forward(self, x):
        return self.bn(self.lin(x)) + self.noise


def save_reference(path: str, seed: int = 5) -> TinyModel:
    """Build the 'pretrained' model (BN stats non-trivial) and save it with save_pretrained."""
    torch.manual_seed(seed)
    model = TinyModel(TinyConfig())
    with torch.no_grad():
        model.bn.running_mean.copy_(torch.arange(8.0))
        model.bn.running_var.fill_(2.5)
        model.bn.num_batches_tracked.fill_(17)
    model.save_pretrained(path)
    return model


def zero3_from_pretrained(path: str, config: dict) -> TinyModel:
    """from_pretrained while transformers' global HfDeepSpeedConfig says ZeRO-3 (so it builds under zero.Init)."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(config)  # noqa: F841 - transformers holds only a weakref
    try:
        return TinyModel.from_pretrained(path)
    finally:
        unset_hf_deepspeed_config()
