"""Incident 1 through transformers + Accelerate: a frozen PreTrainedModel loaded with from_pretrained while a ZeRO-3 Accelerator exists.

Run: zero-buffers repro zero3_frozen_hf_accelerate --nproc 2
     (or: accelerate launch --num_processes 2 --use_deepspeed --zero_stage 3 --zero3_init_flag true repro/zero3_frozen_hf_accelerate.py)
Quick and full (ZB_FULL=1) are the same run: it is all start-up.
"""
from __future__ import annotations

# _common first: it quiets other libraries' noise before they are imported (ZB_VERBOSE=1 keeps it)
from _common import Table, all_ranks, keeps_zero_init_wrapper, max_output_diff, setup_deepspeed, shared_tmpdir

import deepspeed
import torch
import torch.distributed as dist
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

import zero_buffers as zb

# Wall seconds under torchrun --nproc-per-node=2 on an idle 2-core machine, about 1.5x measured (the CLI's timeout).
BUDGET_SECONDS = {"quick": 25, "full": 25}


class TokenizerConfig(PretrainedConfig):
    model_type = "zb_repro_video_tokenizer"

    def __init__(self, channels: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.channels = channels


class VideoTokenizer(PreTrainedModel):
    config_class = TokenizerConfig

    def __init__(self, config: TokenizerConfig):
        super().__init__(config)
        self.conv = nn.Conv3d(3, config.channels, 3, padding=1)
        self.bn = nn.BatchNorm3d(config.channels)
        # a fixed random projection, kept out of the checkpoint (persistent=False), like rotary tables
        self.register_buffer("projection", torch.randn(config.channels, 8), persistent=False)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self:  # transformers 5 builds on the meta device: non-persistent buffers are set here
            torch.nn.init.normal_(self.projection)

    def forward(self, video):
        return self.bn(self.conv(video)).mean((2, 3, 4)) @ self.projection


def is_plain(model: nn.Module) -> bool:
    return all_ranks(all(not hasattr(p, "ds_id") and p.numel() > 0 for p in model.parameters()))


def output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward, gathering ZeRO-3 parameters if there are any (what a user of a partitioned model must do)."""
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    with torch.no_grad(), deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params)):
        return model(x)


def load_or_size_mismatch(path: str) -> tuple[VideoTokenizer | None, str]:
    """from_pretrained, or the first size-mismatch line it raised on every rank (transformers 4.41 loads a model
    whose parameters are still ZeRO-3 placeholders as a plain one when Accelerate 0.30 has unset the DeepSpeed
    config); raises if only some ranks failed."""
    try:
        model, error = VideoTokenizer.from_pretrained(path), ""
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip().startswith("size mismatch")]
        if not lines:
            raise
        model, error = None, lines[0].split(":")[0]
    failed_everywhere, loaded_everywhere = all_ranks(bool(error)), all_ranks(not error)
    if not (failed_everywhere or loaded_everywhere):
        raise RuntimeError(f"from_pretrained failed on some ranks only (this one: {error or 'loaded'})")
    return model, error


def main() -> None:
    rank, world, device = setup_deepspeed()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True),
                              kwargs_handlers=[InitProcessGroupKwargs(backend=dist.get_backend())])
    path = shared_tmpdir()
    if accelerator.is_main_process:
        torch.manual_seed(0)
        pretrained = VideoTokenizer(TokenizerConfig())
        with torch.no_grad():
            pretrained.bn.running_mean.uniform_(-1, 1)
            pretrained.bn.running_var.uniform_(0.5, 2)
        pretrained.save_pretrained(path)
    accelerator.wait_for_everyone()
    x = torch.randn(2, 3, 4, 8, 8, generator=torch.Generator().manual_seed(3)).to(device)
    table = Table(f"zero3_frozen_hf_accelerate: {world} ranks, Accelerator(DeepSpeedPlugin(zero_stage=3, "
                  "zero3_init_flag=True))", ["plain replica", "max output diff across ranks"])

    torch.manual_seed(rank)
    model = VideoTokenizer.from_pretrained(path)
    diff = max_output_diff(output(model, x))
    table.add("BUG", "from_pretrained (default)", ["no" if not is_plain(model) else "yes", diff],
              not is_plain(model) and diff > 0)

    # DeepSpeed < 0.15 may leave zero.Init's __init__ wrapper on BatchNorm3d after the load above: the enable=False
    # load would then partition it on some ranks only and hang; checked, not run, where that is so
    leftover = keeps_zero_init_wrapper(nn.BatchNorm3d)
    torch.manual_seed(rank)
    with accelerator.state.deepspeed_plugin.zero3_init_context_manager(enable=False):
        model, error = (None, "") if leftover else load_or_size_mismatch(path)
    if leftover:
        table.add("BUG", "zero3_init_context_manager(enable=False)", ["partly", "not run: a rank keeps DeepSpeed's "
                  "BatchNorm3d wrapper (a hang)"], True)
    elif error:  # Accelerate 0.30 + transformers 4.41: built partly partitioned, then loaded as if plain
        table.add("BUG", "zero3_init_context_manager(enable=False)", ["partly", f"load raised: {error}"], True)
    else:  # partitioned anyway (Accelerate 1.x re-sets the flag), or plain with each rank's random buffer (0.30)
        plain, diff = is_plain(model), max_output_diff(output(model, x))
        table.add("BUG", "zero3_init_context_manager(enable=False)", ["yes" if plain else "no", diff],
                  not plain or diff > 0)

    torch.manual_seed(rank)
    with zb.no_zero_init():
        model = VideoTokenizer.from_pretrained(path).eval()
    plain = is_plain(model)
    raw = max_output_diff(output(model, x))
    table.add("BUG", "no_zero_init alone (random buffer)", ["yes" if plain else "no", raw], plain and raw > 0)
    zb.broadcast_buffers(model, include_parameters=True)
    diff = max_output_diff(output(model, x))
    table.add("FIX", "no_zero_init + broadcast_buffers", ["yes" if plain else "no", diff], plain and diff == 0)

    torch.manual_seed(rank)
    replica = zb.frozen_replica(VideoTokenizer.from_pretrained(path))
    plain = is_plain(replica) and all_ranks(zb.is_frozen_replica(replica))
    diff = max_output_diff(replica(x))
    table.add("FIX", "frozen_replica(from_pretrained(...))", ["yes" if plain else "no", diff], plain and diff == 0)
    table.finish()


if __name__ == "__main__":
    main()
