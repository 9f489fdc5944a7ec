"""Small checkpoints of each kind the doctor reads, built by hand in milliseconds (the layouts of
tests/ckpt_kinds.py, which the real tools write), a harmless pickle payload, and a snapshot of a folder tree.

The DeepSpeed-shaped folder is what ``engine.save_checkpoint`` writes under ZeRO-3, reduced to what the doctor
reads: ``latest``, per rank ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (``module`` with the rank's buffers and
empty parameter placeholders, ``buffer_names``, ``dp_world_size``, ``ds_config``) and ``..._optim_states.pt``.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
import stat
from pathlib import Path

import torch

from zero_buffers import cli

TAG = "step8"
BUFFERS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


class Payload:
    """Unpickled, it creates ``marker`` (``open(marker, "w")``): proof that a file's code ran, and harmless."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def buffers(rank: int, same: bool = False) -> dict[str, torch.Tensor]:
    """One BatchNorm layer's statistics for ``rank`` (identical on every rank with ``same``) and a weight."""
    g = torch.Generator().manual_seed(0 if same else rank + 1)
    return {"bn.weight": torch.ones(3), "bn.bias": torch.zeros(3),
            "bn.running_mean": torch.randn(3, generator=g), "bn.running_var": torch.rand(3, generator=g) + 0.5,
            "bn.num_batches_tracked": torch.tensor(21)}


def per_rank(folder: Path, world: int = 2, suffix: str = ".pt", same: bool = False) -> Path:
    """``rank{r}.pt`` (or .bin, .safetensors) for each rank: a state dict whose statistics differ across ranks."""
    folder.mkdir(parents=True, exist_ok=True)
    for r in range(world):
        if suffix == ".safetensors":
            from safetensors.torch import save_file
            save_file(buffers(r, same), str(folder / f"model-rank{r}.safetensors"))
        else:
            torch.save(buffers(r, same), folder / f"rank{r}{suffix}")
    return folder


def model_states(rank: int, world: int, extra: dict | None = None) -> dict:
    sd = buffers(rank)
    sd["bn.weight"], sd["bn.bias"] = torch.empty(0), torch.empty(0)  # ZeRO-3's parameter placeholders
    return {"module": sd, "buffer_names": list(BUFFERS), "dp_world_size": world, "global_steps": 8,
            "ds_config": {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}, **(extra or {})}


def zero3(root: Path, world: int = 2) -> Path:
    """A DeepSpeed ZeRO-3 root: ``latest`` and the tag folder with each rank's model and optimizer states."""
    step = root / TAG
    step.mkdir(parents=True)
    (root / "latest").write_text(TAG)
    (root / "zero_to_fp32.py").write_text("# DeepSpeed's export script\n")
    for r in range(world):
        torch.save(model_states(r, world), step / model_file(r))
        torch.save({"optimizer_state_dict": {"state": {0: {"exp_avg": torch.full((2,), float(r))}}},
                    "ds_version": "0.19.8"}, step / optim_file(r))
    return root


def model_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def dcp(folder: Path) -> Path:
    """A DCP folder written by ``dcp.save`` in this process."""
    import warnings

    import torch.distributed.checkpoint as dcp_

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_.save(buffers(0), checkpoint_id=str(folder), no_dist=True)
    return folder


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (links not followed): a file's bytes digest, a link's target, a folder, other."""
    out: dict[str, tuple] = {}
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(here) / name
            mode = os.lstat(p).st_mode
            key = str(p.relative_to(root))
            if stat.S_ISLNK(mode):
                out[key] = ("link", os.readlink(p))
            elif stat.S_ISREG(mode):
                out[key] = ("file", hashlib.sha1(p.read_bytes()).hexdigest())
            else:
                out[key] = ("dir",) if stat.S_ISDIR(mode) else ("other", stat.S_IFMT(mode))
    return out


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (TimeoutError) instead of hanging when a reader blocks (a FIFO) or never ends (/dev/zero)."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s: blocked on a FIFO or reading an endless file?")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def doctor(*args: str) -> tuple[int, str, str]:
    """The CLI in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()
