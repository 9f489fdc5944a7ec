"""ZeRO-3 never broadcasts buffers: rank-0-only loads and random buffers differ; GatheredParametersAndBuffers, Init and install() fix it.

Every BUG row shows a bug that exists on the versions it runs on (printed in the title): transformers before 5.6
loads checkpoint buffers on rank 0 only in from_pretrained; 5.6 and later get checkpoint buffers right on every
rank (that row then reads n/a), but not non-persistent buffers or those set at init.

Run: zero-buffers repro zero3_load_buffers --nproc 2
Quick and full (ZB_FULL=1) are the same run: it is all start-up.
"""
from __future__ import annotations

# _common first: it quiets other libraries' noise before they are imported (ZB_VERBOSE=1 keeps it)
from _common import (Table, all_ranks, keeps_zero_init_wrapper, max_cross_rank_diff, setup_deepspeed, shared_tmpdir,
                     version_at_least, versions, zero3_config)

import contextlib

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb

# Wall seconds under torchrun --nproc-per-node=2 on an idle 2-core machine, about 1.5x measured (the CLI's timeout).
BUDGET_SECONDS = {"quick": 25, "full": 25}


class VQBlock(nn.Module):
    """Linear + BatchNorm + a codebook made with randn (a VQ tokenizer's shape, in miniature)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("codebook", torch.randn(16, 8))


def pretrained_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    ref = VQBlock()
    with torch.no_grad():
        ref.bn.running_mean.uniform_(-1, 1)
        ref.bn.running_var.uniform_(0.5, 2)
        ref.bn.num_batches_tracked.fill_(500)
    return ref.state_dict()


def matches(model: nn.Module, sd: dict[str, torch.Tensor]) -> bool:
    """Every buffer in ``sd`` equals the model's, on every rank."""
    ok = all(torch.equal(b.cpu(), sd[n]) for n, b in model.named_buffers() if n in sd)
    return all_ranks(ok)


def load_case(rank: int, how: str, sd: dict[str, torch.Tensor]) -> VQBlock:
    """DeepSpeed's documented pattern: build under zero.Init, load on rank 0 inside a gather context (``how``:
    DeepSpeed's context, ours, or DeepSpeed's own under zero_buffers.install()); rank 0 loads ``sd``."""
    torch.manual_seed(rank)  # rank-specific RNG, as in any real job (dropout, augmentation seeds)
    with zb.install() if how == "installed" else contextlib.nullcontext():
        with deepspeed.zero.Init(config_dict_or_path=zero3_config()):
            model = VQBlock()
        ctx = zb.GatheredParametersAndBuffers(model, modifier_rank=0) if how == "ours" else \
            deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0)
        with ctx:
            if rank == 0:
                model.load_state_dict(sd)
    return model


def failed_load_case(rank: int, world: int, ours: bool, sd: dict[str, torch.Tensor]) -> tuple[float, bool]:
    """Rank 0 loads, then the last rank's body raises (a bad file there): what is left committed?

    Returns (max cross-rank buffer diff, whether any rank's weights changed).
    """
    torch.manual_seed(rank)
    with deepspeed.zero.Init(config_dict_or_path=zero3_config()):
        model = VQBlock()
    zb.broadcast_buffers(model)
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        before = [p.detach().clone() for p in params]
    ctx = zb.GatheredParametersAndBuffers(model, modifier_rank=0) if ours else \
        deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    try:
        with ctx:
            if rank == 0:
                model.load_state_dict(sd)
            if rank == world - 1:
                raise OSError("truncated checkpoint shard")
    except (OSError, zb.ZeroBuffersError):
        pass  # every rank raises: ours on every rank, DeepSpeed's only where the body raised
    with deepspeed.zero.GatheredParameters(params):
        changed = not all(torch.equal(a, p) for a, p in zip(before, params))
    return max_cross_rank_diff(model), not all_ranks(not changed)


def main() -> None:
    rank, world, _ = setup_deepspeed()
    # the checkpoints exist before the job: made before any zero.Init (on DeepSpeed < 0.15 a module class that
    # inherits __init__, such as BatchNorm1d, may stay patched after a zero.Init exits: see the
    # leftover rows)
    sd = pretrained_state()
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    class TinyConfig(PretrainedConfig):
        model_type = "zb_repro_tiny"

    class Tiny(PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config):
            super().__init__(config)
            self.block = VQBlock()
            self.register_buffer("rope", torch.randn(8), persistent=False)  # non-persistent: not in the file
            self.post_init()

    path = shared_tmpdir()
    if rank == 0:
        torch.manual_seed(7)
        Tiny(TinyConfig()).save_pretrained(path)
    dist.barrier()
    table = Table(f"zero3_load_buffers: {world} ranks, DeepSpeed ZeRO-3 ({versions()})",
                  ["max cross-rank diff", "buffers after"],
                  kinds={"n/a": "a bug these versions do not have (transformers 5.6+ loads checkpoint buffers on "
                                "every rank itself; DeepSpeed 0.15+ takes its __init__ wrappers off every class)"})

    where = {True: "= checkpoint on every rank", False: "= checkpoint on rank 0 only"}
    model = load_case(rank, "deepspeed", sd)
    table.add("BUG", "rank-0 load in GatheredParameters", [max_cross_rank_diff(model), where[matches(model, sd)]],
              max_cross_rank_diff(model) > 0)
    model = load_case(rank, "ours", sd)
    table.add("FIX", "GatheredParametersAndBuffers(model, 0)", [max_cross_rank_diff(model), where[matches(model, sd)]],
              max_cross_rank_diff(model) == 0 and matches(model, sd))
    model = load_case(rank, "installed", sd)
    table.add("FIX", "install() + DeepSpeed's GatheredParameters", [max_cross_rank_diff(model),
                                                                   where[matches(model, sd)]],
              max_cross_rank_diff(model) == 0 and matches(model, sd))

    for ours in (False, True):  # a body that raises: DeepSpeed commits rank 0's half-load, ours commits nothing
        diff, changed = failed_load_case(rank, world, ours, sd)
        state = f"{'differ' if diff else 'agree'}; weights {'half-loaded' if changed else 'as before'}"
        if ours:
            table.add("FIX", "... body raises on a rank: ours (all or nothing)", [diff, state], diff == 0 and not changed)
        else:
            table.add("BUG", "... body raises on a rank: GatheredParameters", [diff, state], changed and diff > 0)

    torch.manual_seed(rank)
    with deepspeed.zero.Init(config_dict_or_path=zero3_config()):
        model = VQBlock()
    diff = max_cross_rank_diff(model)
    table.add("BUG", "randn codebook under zero.Init", [diff, "-"], diff > 0)
    torch.manual_seed(rank)
    with zb.Init(config_dict_or_path=zero3_config()):
        model = VQBlock()
    diff = max_cross_rank_diff(model)
    table.add("FIX", "zero_buffers.Init", [diff, "-"], diff == 0)

    # after the zero.Init contexts above exited: checked, not built (a hang where one rank holds the wrapper)
    leaked = keeps_zero_init_wrapper(nn.BatchNorm1d)
    if leaked:
        table.add("BUG", "BatchNorm1d keeps zero.Init's __init__ after it exited", ["-", "partitioned when built"],
                  True)
        with zb.no_zero_init():
            plain = all_ranks(VQBlock().bn.weight.numel() == 8)
        table.add("FIX", "... a VQBlock built inside zero_buffers.no_zero_init()", ["-", "plain" if plain else
                                                                                     "partitioned"], plain)
    else:
        table.add("n/a", "BatchNorm1d keeps zero.Init's __init__ after it exited (DeepSpeed < 0.15)", ["-", "-"], None)

    transformers_loads_everywhere = version_at_least("transformers", "5.6.0")
    for fixed in (False, True):
        torch.manual_seed(rank)
        keep = HfDeepSpeedConfig(zero3_config())  # noqa: F841 - transformers keeps a weakref: ZeRO-3 is on
        try:
            with zb.install() if fixed else contextlib.nullcontext():
                model = Tiny.from_pretrained(path)
        finally:
            unset_hf_deepspeed_config()
        partitioned = all_ranks(model.block.proj.weight.numel() == 0)
        rows = {r.name: r.max_abs_diff for r in zb.buffer_report(model).rows}
        persistent = max(v for n, v in rows.items() if n != "rope")
        kind = "FIX" if fixed else "BUG"
        case = "install() + from_pretrained" if fixed else "from_pretrained under ZeRO-3"
        if fixed or not transformers_loads_everywhere:
            table.add(kind, f"{case}: checkpoint buffers", [persistent, "-"], partitioned and (persistent == 0) == fixed)
        else:  # transformers 5.6+ gets these right itself: no bug to show
            table.add("n/a", f"{case}: checkpoint buffers (transformers loads them)", [persistent, "-"], None)
        table.add(kind, f"{case}: non-persistent buffer", [rows["rope"], "-"], partitioned and (rows["rope"] == 0) == fixed)
    table.finish()


if __name__ == "__main__":
    main()
