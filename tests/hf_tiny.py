"""A tiny transformers PreTrainedModel with BatchNorm and a random non-persistent buffer (no hub needed)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


@contextlib.contextmanager
def zero3_switched_on(via: str, config: dict) -> Iterator[None]:
    """Make transformers build under zero.Init: its global HfDeepSpeedConfig (``hf_config``) or an Accelerator
    with a ZeRO-3 DeepSpeedPlugin (``accelerate``); everything is reset on exit."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    keep = None
    try:
        if via == "accelerate":
            from accelerate import Accelerator, DeepSpeedPlugin
            from accelerate.utils import InitProcessGroupKwargs
            keep = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True),
                               kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
        else:
            keep = HfDeepSpeedConfig(config)  # transformers holds only a weakref
        yield
    finally:
        if via == "accelerate":
            from accelerate.state import AcceleratorState
            AcceleratorState._reset_state(True)
        del keep
        unset_hf_deepspeed_config()
