"""Shared plumbing for the repro scripts: quiet output, quick / full runs, process-group setup from torchrun's
environment and the BUG / FIX table.

Quick by default: each script's default run is its quick one (seconds to a few tens of seconds on 2 CPU cores); env
``ZB_FULL=1`` (``zero-buffers repro --full``) runs the full-width one. Each script states what both take in
``BUDGET_SECONDS`` (a literal the CLI reads without importing the script).

Quiet by default: importing this module from a running repro script (scripts import it first, before DeepSpeed,
transformers or Accelerate) hides other libraries' known noise: their FutureWarnings and DeprecationWarnings (by
the module that issued them; zero_buffers' own warnings still show), DeepSpeed's "Setting accelerator to CPU"
(``DS_ACCELERATOR=cpu`` when there is no GPU) and its info logs, tqdm and Hugging Face progress bars, and
transformers' / Accelerate's log lines below errors. Env ``ZB_VERBOSE=1`` keeps all of it. An environment variable
the user set already is left as it is. Rank 0 alone prints the table (``Table.finish``).
"""
from __future__ import annotations

import datetime
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

FULL = os.environ.get("ZB_FULL") == "1"  # else the quick run (the default; ZB_QUICK is no longer read)
MODE = "full" if FULL else "quick"
VERBOSE = os.environ.get("ZB_VERBOSE") == "1"

# Other libraries whose FutureWarnings / DeprecationWarnings are noise here: warnings about their own APIs or the
# torch APIs they call, nothing a repro reader can act on (zero_buffers is not among them).
NOISY_MODULES = r"(torch|deepspeed|transformers|accelerate|huggingface_hub|safetensors|vector_quantize_pytorch|" \
                r"einops|einx|lightning|lightning_fabric|pytorch_lightning|torchmetrics)(\.|$)"
# Deprecations those libraries attribute to their caller (the repro script, ``__main__``): matched by message.
NOISY_MESSAGES = (r".*broadcast_buffers.*deprecated",)
QUIET_ENV = {
    "TQDM_DISABLE": "1",  # tqdm reads it when imported
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub reads it when imported; transformers' bars follow it
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "ACCELERATE_LOG_LEVEL": "error",
}


def quiet() -> None:
    """Hide other libraries' known noise (see the module docstring); a no-op under ``ZB_VERBOSE=1``. Environment
    variables act only on libraries imported after this call; the warning filters and log levels at once."""
    if VERBOSE:
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        # DeepSpeed picks the CPU anyway, after a "Setting accelerator to CPU ..." warning on every rank
        os.environ["DS_ACCELERATOR"] = "cpu"
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=NOISY_MODULES)
        for message in NOISY_MESSAGES:
            warnings.filterwarnings("ignore", message=message, category=category)
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its info logs (accelerator, comm backend)
    for logger in ("accelerate", "transformers"):
        logging.getLogger(logger).setLevel(logging.ERROR)


def _running_a_repro() -> bool:
    """Whether the program running is a script in this folder (not, say, a benchmark importing one as a module)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return bool(main) and Path(main).resolve().parent == Path(__file__).resolve().parent


if _running_a_repro():
    quiet()


def setup(seed: int = 0) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes; returns (rank, world_size, device for tensors)."""
    quiet()
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


EXPECTED = "as expected"  # the last column: did the row come out as its kind says it should?
LEGEND = (f"{EXPECTED}: BUG rows reproduce the failure without the fix ('yes' = the bug showed up, as it should); "
          "FIX rows apply the fix ('yes' = fixed); 'n/a' = no pass criterion")
KINDS = {"REF": "a reference value to compare with", "COST": "timings"}  # legend of the other kinds of row


@dataclass
class Table:
    """Rows of (kind, case, measurements..., as expected); printed once, by rank 0, with a legend."""

    title: str
    columns: list[str]
    rows: list[tuple[str, str, list[str], bool | None]] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)  # legend text for this script's own kinds of row
    notes: list[str] = field(default_factory=list)

    def add(self, kind: str, case: str, values: list[object], ok: bool | None) -> None:
        """``ok``: whether the row came out as its kind expects (BUG: the bug reproduced; FIX: fixed); ``None``
        marks a row without a pass criterion (printed as n/a, never a failure)."""
        self.rows.append((kind, case, [v if isinstance(v, str) else f"{v:.4g}" for v in values],
                          None if ok is None else bool(ok)))

    def note(self, text: str) -> None:
        """A line printed after the table and its legend (rank 0's; every rank may call it)."""
        self.notes.append(text)

    def legend(self) -> list[str]:
        """The last column and BUG / FIX explained; then the other kinds of row this table has, if any."""
        kinds = dict(KINDS, **self.kinds)
        others = [k for k in dict.fromkeys(k.split()[0] for k, _, _, _ in self.rows) if k not in ("BUG", "FIX")]
        said = [f"{k} = {kinds[k]}" for k in others if k in kinds]
        return [LEGEND] + (["other rows: " + "; ".join(said)] if said else [])

    def render(self) -> str:
        head = ["", "case", *self.columns, EXPECTED]
        body = [[k, c, *v, "n/a" if ok is None else "yes" if ok else "NO"] for k, c, v, ok in self.rows]
        widths = [max(len(str(r[i])) for r in [head, *body]) for i in range(len(head))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [self.title, fmt.format(*head), fmt.format(*["-" * w for w in widths])]
        rows = [fmt.format(*r).rstrip() for r in body]
        return "\n".join([*(line.rstrip() for line in lines), *rows, *self.legend(), *self.notes])

    def failures(self) -> list[str]:
        """The rows that did not come out as expected, said in words."""
        said = {"BUG": "bug not reproduced", "FIX": "fix does not hold"}
        return [f"{k} {c!r} ({said.get(k.split()[0], 'not as expected')})" for k, c, _, ok in self.rows
                if ok is False]

    def finish(self) -> None:
        """Print on rank 0, tear down, exit non-zero (on every rank) if a row is not as expected."""
        failed = self.failures()
        if dist.get_rank() == 0:
            print(self.render(), flush=True)
            print("RESULT: all fixes hold" if not failed else f"RESULT: NOT AS EXPECTED: {'; '.join(failed)}",
                  flush=True)
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        # All work is done and printed. Under `accelerate launch` (DeepSpeed, gloo) an interpreter teardown
        # occasionally aborted with "terminate called without an active exception" (a C++ thread destroyed
        # at exit; 1 run in 6 here), turning a passing run into a ChildFailedError. os._exit skips that teardown.
        os._exit(1 if failed else 0)


def setup_deepspeed(seed: int = 0) -> tuple[int, int, torch.device]:
    """setup() plus DeepSpeed's comm layer on the same group (skipping the shm-comm JIT build on CPU)."""
    rank, world, device = setup(seed)
    import deepspeed

    if device.type == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    if dist.get_backend() == "gloo" and not version_at_least("deepspeed", "0.19.8"):
        _wait_for_each_gather(deepspeed)
    return rank, world, device


def _wait_for_each_gather(deepspeed) -> None:
    """DeepSpeed before 0.19.8 waits only on the last of the async all-gathers ZeRO-3 issues per parameter
    (``Init._allgather_params_coalesced``), and ``GatheredParameters.__exit__`` issues one async broadcast per
    parameter; on gloo the earlier ones may still run when the next collective starts, and ranks then gather garbage
    or wait on each other forever (measured with 0.14.4: the tokenizer repro hung in ``GatheredParameters.__exit__``
    on rank 0 while rank 1 had gone on). NCCL runs them in order on one stream, so GPU
    runs never see it. A DeepSpeed bug, not a buffer one: the repros wait for each gather on these versions, as the
    test suite does (tests/helpers.py); zero_buffers itself does not touch it."""
    comm = deepspeed.comm
    for name in ("all_gather_into_tensor", "broadcast"):  # GatheredParameters.__exit__'s async broadcasts too
        real = getattr(comm, name)

        def waited(*args, _real=real, **kwargs):
            handle = _real(*args, **kwargs)
            if kwargs.get("async_op") and handle is not None:
                handle.wait()
            return handle

        setattr(comm, name, waited)


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


def keeps_zero_init_wrapper(cls: type) -> bool:
    """Whether ``cls`` still holds zero.Init's ``__init__`` wrapper on any rank, no context being active.

    DeepSpeed < 0.15 puts back, as a class's "original" ``__init__``, what it found there; for a class that inherits
    ``__init__`` (BatchNorm1d, BatchNorm3d) that may be its parent's wrapper, depending on the order it patched the
    classes in, which varies per process. A module of that class built then is partitioned on those ranks only and
    its init broadcast waits for the others (a hang), so a repro checks this instead of building through it. The
    detector is the one ``no_zero_init`` uses (``zero_buffers/_compat/deepspeed.py``)."""
    from zero_buffers._compat.deepspeed import _is_partition_wrapper

    return not all_ranks(not _is_partition_wrapper(vars(cls).get("__init__")))


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
