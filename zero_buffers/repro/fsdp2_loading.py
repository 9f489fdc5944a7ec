"""FSDP2-era loads leave buffers apart: set_model_state_dict from rank 0, dcp.load, Accelerate's FSDP2 load, a hand-written loop; install() and one line fix them.

Rank 0 holds the real model (its "pretrained" weights and buffers); every other rank builds it on ``meta`` and the
load brings the weights over, as FSDP2 jobs load large models. Two real transformers models, random and tiny: a
LlamaForCausalLM (rotary ``inv_freq`` / ``original_inv_freq``, non-persistent buffers computed at init) and a
ResNetForImageClassification (BatchNorm statistics, persistent). Each row gives, after the load, the buffers that
differ from rank 0's (or sit on ``meta``), their largest difference, how many buffer values are NaN on all ranks
together, and what the model does on each rank: 8 greedy tokens from one prompt (Llama) or the top-1 labels of 8
images (ResNet), ranks with the same output grouped. FIX rows must match a plain single-process copy of the model,
bit for bit in every buffer and token for token.

Run: zero-buffers repro fsdp2_loading --nproc 2
Quick and full (ZB_FULL=1) are the same run: it is all start-up.
"""
from __future__ import annotations

# _common first: it quiets other libraries' noise before they are imported (ZB_VERBOSE=1 keeps it)
from _common import Table, all_ranks, setup, shared_tmpdir, versions

import contextlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from transformers import LlamaConfig, LlamaForCausalLM, ResNetConfig, ResNetForImageClassification

import zero_buffers as zb

# Wall seconds under torchrun --nproc-per-node=2 on an idle 2-core machine, about 1.5x measured (the CLI's timeout).
NEEDS = ("fsdp2",)  # [Note: capabilities by presence]: skipped, saying why, where torch lacks it
BUDGET_SECONDS = {"quick": 20, "full": 20}

PROMPT = [3, 7, 11, 5, 9, 2, 14, 6]
NEW_TOKENS = 8


@dataclass(frozen=True)
class Kind:
    """One model: how to build it (seeded: every rank builds the same one), shard it and run it."""

    name: str
    build: Callable[[], nn.Module]
    units: Callable[[nn.Module], list[nn.Module]]  # the submodules fully_shard'ed before the root
    run: Callable[[nn.Module], list[int]]  # 8 greedy tokens, or 8 top-1 labels


def _llama() -> nn.Module:
    # initializer_range 0.2, not the default 0.02: at 0.02 a random model's attention is close to uniform, so the
    # positions (the rotary tables) barely change its tokens; at 0.2 they do, as in a trained model
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _generate(model: nn.Module) -> list[int]:
    with torch.no_grad():  # no eos: every rank runs the same number of forwards (each all-gathers under FSDP2)
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(PROMPT):].tolist()


def _resnet() -> nn.Module:
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                          num_labels=10)
    torch.manual_seed(0)
    model = ResNetForImageClassification(config).eval()
    with torch.no_grad():  # statistics as training leaves them: not the initial 0 / 1
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.num_batches_tracked.fill_(1000)
    return model


def _classify(model: nn.Module) -> list[int]:
    images = torch.randn(NEW_TOKENS, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(pixel_values=images).logits.argmax(-1).tolist()


KINDS = (Kind("llama", _llama, lambda m: list(m.model.layers), _generate),
         Kind("resnet", _resnet, lambda m: list(m.resnet.encoder.stages), _classify))


def start(kind: Kind, rank: int, to_empty: bool) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model before the load, ``fully_shard``'ed: rank 0's real, with its full state dict; every other rank's
    built on meta (then ``to_empty``, uninitialised memory, when the load needs allocated tensors), with none."""
    if rank == 0:
        model = kind.build()
        full = model.state_dict()
    else:
        with torch.device("meta"):
            model = kind.build()
        full = {}
    for unit in kind.units(model):
        fully_shard(unit)
    fully_shard(model)
    if rank and to_empty:
        model.to_empty(device="cpu")
    return model, full


# ---- the loads ------------------------------------------------------------------------------------------------------
def load_broadcast_from_rank0(kind: Kind, rank: int, folder: str) -> nn.Module:
    """torch's rank-0 load: meta init + ``to_empty`` + ``set_model_state_dict(full_state_dict, broadcast_from_rank0)``."""
    model, full = start(kind, rank, to_empty=True)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def save_checkpoint(kind: Kind, folder: str) -> nn.Module:
    """A DCP checkpoint of the model written by every rank (DCP writes state-dict entries: no non-persistent one)."""
    model = kind.build()
    for unit in kind.units(model):
        fully_shard(unit)
    fully_shard(model)
    dcp.save(get_model_state_dict(model), checkpoint_id=f"{folder}/{kind.name}")
    return model


def load_dcp(kind: Kind, rank: int, folder: str) -> nn.Module:
    """torch's DCP resume: ``get_model_state_dict``, ``dcp.load`` into it, ``set_model_state_dict``."""
    model, _ = start(kind, rank, to_empty=True)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=f"{folder}/{kind.name}")
    set_model_state_dict(model, state)
    return model


def load_accelerate(kind: Kind, rank: int, folder: str) -> nn.Module:
    """Accelerate's ``fsdp2_load_full_state_dict`` (what ``prepare`` runs under ``cpu_ram_efficient_loading``, looked
    up where ``fsdp2_prepare_model`` looks it up; called directly: on CPU ``prepare`` with an FSDP plugin wraps the
    model in DDP instead) into the model, on meta but on rank 0."""
    from accelerate import Accelerator
    from accelerate.utils import fsdp_utils

    model, full = start(kind, rank, to_empty=False)
    fsdp_utils.fsdp2_load_full_state_dict(Accelerator(cpu=True), model, full)
    return model


def accelerate_lacks_fsdp2() -> str | None:
    """Why Accelerate's FSDP2 load cannot run here (not installed, or a version before FSDP2: 1.1 has none), or None."""
    try:
        from accelerate.utils import fsdp_utils
    except ImportError:
        return "Accelerate is not installed"
    if not hasattr(fsdp_utils, "fsdp2_load_full_state_dict"):
        return f"Accelerate {versions().split('accelerate ')[-1]} has no FSDP2 load"
    return None


def load_by_hand(kind: Kind, rank: int, folder: str) -> nn.Module:
    """The loop people write (and FSDP2's examples show): rank 0 broadcasts each parameter, every rank keeps its
    shard; the buffers are nobody's job."""
    model, full = start(kind, rank, to_empty=False)
    sharded = {}
    for name, param in model.named_parameters():
        whole = full[name] if rank == 0 else torch.empty(param.shape, dtype=param.dtype)
        dist.broadcast(whole, 0)
        sharded[name] = nn.Parameter(distribute_tensor(whole, param.device_mesh, param.placements))
    model.load_state_dict(sharded, strict=False, assign=True)
    return model


# ---- measuring ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class After:
    """What a load left: the table's cells, and the verdicts the BUG / FIX rows need."""

    cells: list[object]
    apart: bool  # some buffer differs from rank 0's, sits on meta, or the load raised
    right: bool  # every rank: every buffer and output equal the plain model's


def _grouped(outputs: list[list[int] | None]) -> str:
    """``0: 1 2 3 | 1-3: 4 5 6``: each distinct output once, with the ranks that gave it."""
    groups: dict[str, list[int]] = {}
    for r, out in enumerate(outputs):
        groups.setdefault(" ".join(map(str, out)) if out is not None else "-", []).append(r)
    return " | ".join(f"{_ranks(rs)}: {text}" for text, rs in groups.items())


def _ranks(rs: list[int]) -> str:
    return f"{rs[0]}-{rs[-1]}" if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)) else ",".join(map(str, rs))


def measure(kind: Kind, model: nn.Module | None, error: str | None, reference: nn.Module, want: list[int]) -> After:
    world = dist.get_world_size()
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error)
    if any(errors):
        first = next(e for e in errors if e)
        return After([f"load raised on {sum(map(bool, errors))}/{world} ranks", "-", "-", first], True, False)
    assert model is not None
    buffers = dict(model.named_buffers())
    on_meta = torch.tensor([sum(b.is_meta for b in buffers.values())])
    dist.all_reduce(on_meta)
    if int(on_meta):
        ranks = [None] * world
        dist.all_gather_object(ranks, any(b.is_meta for b in buffers.values()))
        where = _ranks([r for r, m in enumerate(ranks) if m])
        return After([f"{int(on_meta)} on meta (rank{'s' if len(where) > 1 else ''} {where})", "no data", "-",
                      "cannot run: buffers on meta"],
                     True, False)
    rows = zb.buffer_report(model).rows
    differing = [r for r in rows if not r.in_sync]
    worst = max((r.max_abs_diff for r in rows), default=0.0)
    nans = torch.tensor([sum(int(b.isnan().sum()) for b in buffers.values() if b.is_floating_point())])
    dist.all_reduce(nans)
    out = kind.run(model)
    outputs: list[Any] = [None] * world
    dist.all_gather_object(outputs, out)
    same = all(torch.equal(b, dict(reference.named_buffers())[n]) for n, b in buffers.items())
    right = all_ranks(same) and all(o == want for o in outputs) and not differing and not int(nans)
    return After([f"{len(differing)}/{len(rows)}", worst, int(nans), _grouped(outputs)], bool(differing), right)


def attempt(load: Callable[[Kind, int, str], nn.Module], kind: Kind, rank: int, folder: str,
            fix: str | None) -> tuple[nn.Module | None, str | None]:
    """Run one load (``fix``: None, ``"install"`` around it, or ``"line"``: the one line after it); an exception
    of the load becomes its text (every rank of these loads raises at the same point, or none does)."""
    try:
        with zb.install() if fix == "install" else contextlib.nullcontext():
            model = load(kind, rank, folder)
        if fix == "line":
            zb.broadcast_buffers(model, materialize=True)
        return model, None
    except (AttributeError, KeyError, RuntimeError) as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}"


PATHS: tuple[tuple[str, Callable[[Kind, int, str], nn.Module], tuple[str, ...]], ...] = (
    ("set_model_state_dict(broadcast_from_rank0)", load_broadcast_from_rank0, ("install", "line")),
    ("dcp.load (get/set_model_state_dict)", load_dcp, ("install", "line")),
    ("Accelerate fsdp2_load_full_state_dict", load_accelerate, ("install", "line")),
    ("hand-written loop over parameters", load_by_hand, ("line",)),
)
FIXES = {"install": "under zb.install()", "line": "+ zb.broadcast_buffers(model, materialize=True)"}


def main() -> None:
    rank, world, device = setup()
    if device.type != "cpu":
        raise SystemExit("fsdp2_loading runs on CPU ranks (gloo): zero-buffers repro fsdp2_loading --backend gloo")
    table = Table(f"fsdp2_loading: {world} ranks, fully_shard on {dist.get_backend()}/cpu ({versions()})",
                  ["model", "buffers differing", "max abs diff", "NaN", "output per rank (ranks: 8 tokens / labels)"],
                  kinds={"n/a": "this load leaves these buffers right already (state-dict entries arrive)"})
    folder = shared_tmpdir()
    # Every model stays alive to the end, and every load without a fix runs before any with one: the memory a
    # to_empty() hands out is then never a block a right table was freed from (the allocator reuses freed blocks,
    # so a later load could "find" rank 0's values there by chance and hide the bug)
    keep: list[nn.Module | None] = [save_checkpoint(kind, folder) for kind in KINDS]
    references = {kind.name: kind.build() for kind in KINDS}
    wants = {kind.name: kind.run(references[kind.name]) for kind in KINDS}
    found: dict[tuple[str, str], tuple[After, str | None]] = {}
    paths = [p for p in PATHS if p[1] is not load_accelerate or not accelerate_lacks_fsdp2()]
    for case, load, _ in paths:
        for kind in KINDS:
            model, error = attempt(load, kind, rank, folder, None)
            keep.append(model)
            found[case, kind.name] = measure(kind, model, error, references[kind.name], wants[kind.name]), error
    for case, load, fixes in paths:
        for kind in KINDS:
            after, error = found[case, kind.name]
            if not after.apart and after.right:
                table.add("n/a", case, [kind.name, *after.cells], None)
                continue
            table.add("BUG", case, [kind.name, *after.cells], after.apart or not after.right)
            for fix in fixes if error is None else [f for f in fixes if f != "line"]:  # no line after a raise
                model, raised = attempt(load, kind, rank, folder, fix)
                keep.append(model)
                fixed = measure(kind, model, raised, references[kind.name], wants[kind.name])
                table.add("FIX", f"... {FIXES[fix]}", [kind.name, *fixed.cells], fixed.right)
    if (why := accelerate_lacks_fsdp2()) is not None:
        table.note(f"no Accelerate rows: {why}")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    table.note(f"plain model, one process: llama {' '.join(map(str, wants['llama']))}; "
               f"resnet {' '.join(map(str, wants['resnet']))}")
    table.finish()


if __name__ == "__main__":
    main()
