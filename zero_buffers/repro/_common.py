"""Shared plumbing for the repro scripts: process-group setup from torchrun's environment and the BUG / FIX table."""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def setup(seed: int = 0) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes; returns (rank, world_size, device for tensors)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    backend = os.environ.get("ZB_BACKEND") or ("nccl" if torch.cuda.is_available() and
                                               torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
                                               else "gloo")
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    torch.manual_seed(seed)
    return rank, dist.get_world_size(), device


@dataclass
class Table:
    """Rows of (kind, case, measurements..., ok); printed once by rank 0."""

    title: str
    columns: list[str]
    rows: list[tuple[str, str, list[str], bool | None]] = field(default_factory=list)

    def add(self, kind: str, case: str, values: list[object], ok: bool | None) -> None:
        """``ok=None`` marks a row that does not apply here (printed as n/a, never a failure)."""
        self.rows.append((kind, case, [v if isinstance(v, str) else f"{v:.4g}" for v in values],
                          None if ok is None else bool(ok)))

    def render(self) -> str:
        head = ["", "case", *self.columns, "holds"]
        body = [[k, c, *v, "n/a" if ok is None else "yes" if ok else "NO"] for k, c, v, ok in self.rows]
        widths = [max(len(str(r[i])) for r in [head, *body]) for i in range(len(head))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [self.title, fmt.format(*head), fmt.format(*["-" * w for w in widths])]
        return "\n".join([*lines, *(fmt.format(*r) for r in body)])

    def finish(self) -> None:
        """Print on rank 0, tear down, exit non-zero (on every rank) if a row does not hold."""
        ok = all(r[3] is not False for r in self.rows)
        if dist.get_rank() == 0:
            print(self.render(), flush=True)
            print(f"RESULT: {'all fixes hold' if ok else 'A FIX DOES NOT HOLD'}", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        # All work is done and printed. Under `accelerate launch` (DeepSpeed, gloo) an interpreter teardown
        # occasionally aborted with "terminate called without an active exception" (a C++ thread destroyed
        # at exit; 1 run in 6 here), turning a passing run into a ChildFailedError. os._exit skips that teardown.
        os._exit(0 if ok else 1)


def setup_deepspeed(seed: int = 0) -> tuple[int, int, torch.device]:
    """setup() plus DeepSpeed's comm layer on the same group (skipping the shm-comm JIT build on CPU)."""
    rank, world, device = setup(seed)
    import deepspeed

    if device.type == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    return rank, world, device


def versions() -> str:
    """``torch 2.13.0, deepspeed 0.19.8, ...``: the stack this run measured (rows depend on it)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("torch", "deepspeed", "transformers", "accelerate"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return ", ".join(out)


def version_at_least(package: str, floor: str) -> bool:
    """Whether the installed ``package`` is at least ``floor``."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version(package)) >= Version(floor)


def zero3_config() -> dict:
    """The smallest ZeRO-3 config DeepSpeed accepts."""
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def max_cross_rank_diff(module: torch.nn.Module) -> float:
    """Largest buffer difference between any rank and rank 0 (buffer_report)."""
    import zero_buffers as zb

    return max((r.max_abs_diff for r in zb.buffer_report(module).rows), default=0.0)


def all_ranks(flag: bool) -> bool:
    """True when ``flag`` holds on every rank."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def shared_tmpdir() -> str:
    """A temporary directory made by rank 0 and known to every rank (same machine)."""
    import tempfile

    box = [tempfile.mkdtemp(prefix="zero_buffers_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def max_output_diff(y: torch.Tensor) -> float:
    """Largest |y_r - y_0| over ranks for an output every rank computed from the same input."""
    ys = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(ys, y.detach().contiguous())
    return max(float((o - ys[0]).abs().max()) for o in ys)


def ms_per_call(fn, repeats: int = 20) -> float:
    """Median wall time of ``fn()`` in milliseconds (ranks start each call together)."""
    import statistics
    import time

    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])
