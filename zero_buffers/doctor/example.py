"""A small checkpoint whose ranks diverged, to try the doctor on: ``zero-buffers example-checkpoint DIR``.

A tiny BatchNorm network (BatchNorm2d(3), Conv2d, BatchNorm2d(8), a linear head) is trained for a few steps on ``nproc``
local gloo ranks, each rank on images shifted by its own per-channel offset (one "site" per rank), with the buffers
never synced, exactly as DDP with ``broadcast_buffers=False`` or DeepSpeed ZeRO-3 leave them. Its weights agree across
ranks; its BatchNorm running statistics do not. Then it is saved as one of three kinds:

- ``zero3``: a real DeepSpeed ZeRO-3 checkpoint (``deepspeed.initialize`` and ``engine.save_checkpoint``, tag
  ``step4``): one model-states file per rank, each with that rank's buffers.
- ``per-rank``: ``torch.save(model.state_dict(), DIR / f"rank{r}.pt")`` on every rank (DDP).
- ``dcp``: ``torch.distributed.checkpoint.save`` of the DDP model's state dict: one copy of each entry, written by
  whichever rank DCP's planner picks, so nothing per rank is left to compare or repair.

:func:`write_example` launches the ranks (``zero_buffers/_launch.py``: torchrun's variables without its agent, CPU,
gloo, ``OMP_NUM_THREADS=1``) with a deadline, and kills every rank when it passes; ``python -m
zero_buffers.doctor.example`` is the rank's program. Nothing here reads a checkpoint: the doctor's readers do not import
it.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("zero3", "per-rank", "dcp")
STEPS = 4
TAG = f"step{STEPS}"


@dataclass(frozen=True)
class Example:
    """What :func:`write_example` wrote: the folder, its kind, the files (relative to ``folder``), the seconds it
    took, and the commands to try next, each with what it shows."""

    folder: Path
    kind: str
    nproc: int
    files: tuple[str, ...]
    seconds: float
    next_steps: tuple[tuple[str, str], ...]

    def format(self) -> str:
        what = {"zero3": f"a DeepSpeed ZeRO-3 checkpoint (engine.save_checkpoint, tag {TAG!r})",
                "per-rank": "one torch.save state dict per rank",
                "dcp": "a torch.distributed.checkpoint (DCP) folder"}[self.kind]
        lines = [f"wrote {self.folder}: {what} of a small BatchNorm network trained {STEPS} steps on {self.nproc} "
                 f"gloo ranks, each rank on data of its own offset, so the ranks' BatchNorm statistics differ "
                 f"({self.seconds:.1f} s)"]
        lines += [f"  {f}" for f in self.files]
        lines.append("try next:")
        for command, why in self.next_steps:
            lines += [f"  # {why}", f"  {command}"]
        return "\n".join(lines)


class ExampleError(Exception):
    """The example could not be written (the folder is not empty, a rank failed or ran past its deadline)."""


def next_steps(folder: Path, kind: str) -> tuple[tuple[str, str], ...]:
    """The commands a newcomer runs next on ``folder``, and what each shows."""
    d = shlex.quote(str(folder))
    fixed = shlex.quote(str(folder.with_name(folder.name + "_fixed")))
    if kind == "dcp":
        return ((f"zero-buffers inspect {d}", "which rank wrote each BatchNorm statistic (a mixture of ranks)"),
                (f"zero-buffers diff {d}", "exit 0: DCP keeps one copy of each entry, nothing per rank to compare"),
                (f"zero-buffers repair {d} -o {fixed}",
                 "exit 2: nothing per rank to merge; sync the buffers before dcp.save instead"))
    return ((f"zero-buffers inspect {d}", "what it holds: kind, ranks, buffers, counters"),
            (f"zero-buffers diff {d}", "exit 1: the BatchNorm running statistics differ across ranks"),
            (f"zero-buffers repair {d} -o {fixed} && zero-buffers diff {fixed}",
             "a copy with the statistics merged; its diff exits 0"))


def write_example(folder: str | os.PathLike, kind: str = "per-rank", nproc: int = 2, timeout: float = 300.0
                  ) -> Example:
    """Write the example checkpoint into ``folder`` (new, or an empty folder) on ``nproc`` local CPU ranks.

    Raises :class:`ExampleError` when ``folder`` exists and is not empty (nothing is written then), when a rank
    fails (its output's last lines are in the message; the folder is left as the ranks left it), or when the ranks
    run past ``timeout`` seconds (every one of them is killed).
    """
    from .. import _proc

    if kind not in KINDS:
        raise ExampleError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
        raise ExampleError(f"the example needs at least 2 ranks (their statistics differ), got {nproc!r}")
    if kind == "zero3":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise ExampleError("--kind zero3 needs DeepSpeed (pip install deepspeed); --kind per-rank needs torch "
                               "alone")
    out = Path(folder)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExampleError(f"{out}: exists and is not a folder; name a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise ExampleError(f"{out}: exists and is not empty; name a new folder (nothing was written)")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="lo",
               PYTHONWARNINGS="ignore")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = _proc.local_launch(nproc, "-m", "zero_buffers.doctor.example", "--kind", kind, "--out", str(out.resolve()))
    started = time.monotonic()
    try:
        done = _proc.run(cmd, timeout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except subprocess.TimeoutExpired as e:
        raise ExampleError(f"the {nproc} ranks writing {out} did not finish within {timeout:g} s; killed them and "
                           f"every process they started{_tail(e.output)}") from None
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise ExampleError(f"writing {out} failed: a rank exited with {done.returncode}{_tail(done.stdout)}")
    files = tuple(sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()))
    return Example(out, kind, nproc, files, seconds, next_steps(out, kind))


def _tail(output: bytes | str | None, lines: int = 15) -> str:
    if not output:
        return ""
    text = output.decode(errors="replace") if isinstance(output, bytes) else output
    last = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "; its last lines:\n" + "\n".join(f"  {line}" for line in last) if last else ""


# -- on every rank ---------------------------------------------------------------------------------------------------

def _net() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _batch(rank: int, step: int) -> Any:
    """Rank ``rank``'s images at ``step``: noise around four class prototypes, shifted by the rank's own offset."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    y = torch.randint(0, 4, (8,), generator=g)
    prototypes = torch.randn(4, 3, 1, 1, generator=torch.Generator().manual_seed(7))
    x = prototypes[y] + torch.randn(8, 3, 6, 6, generator=g)
    offset = torch.tensor([2.0, -1.0, 0.5]).view(1, 3, 1, 1) * rank
    return x * (1.0 + 0.5 * rank) + offset, y


def _rank_main(kind: str, out: Path) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    model = _net()
    if kind == "zero3":
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no 40-80 s JIT build of the shm comm op
        deepspeed.init_distributed(dist_backend="gloo")
        config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config=config)
        engine.train()
        for step in range(STEPS):
            x, y = _batch(rank, step)
            engine.backward(nn.functional.cross_entropy(engine(x), y))
            engine.step()
        engine.save_checkpoint(str(out), tag=TAG)
        engine.destroy()
    else:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, broadcast_buffers=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ddp.train()
        for step in range(STEPS):
            x, y = _batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        if kind == "per-rank":
            torch.save(model.state_dict(), out / f"rank{rank}.pt")
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            dcp.save(get_model_state_dict(ddp), checkpoint_id=str(out))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """One rank of the example's run (started by :func:`write_example`)."""
    parser = argparse.ArgumentParser(prog="python -m zero_buffers.doctor.example",
                                     description="one rank of zero-buffers example-checkpoint")
    parser.add_argument("--kind", choices=KINDS, required=True, help="what to save")
    parser.add_argument("--out", required=True, help="the folder to save into")
    args = parser.parse_args(argv)
    _rank_main(args.kind, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
