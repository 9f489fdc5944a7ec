"""Tiny models and comparisons shared by the tests (imported inside rank workers too)."""
from __future__ import annotations

import subprocess

import torch
import torch.distributed as dist
from torch import nn

import zero_buffers._core.wire as _dist
from zero_buffers import _proc


class Toy(nn.Module):
    """BatchNorms plus every kind of buffer we care about: random codebook, non-persistent, int, bf16, bool, None."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.register_buffer("codebook", torch.randn(8, 4))
        self.register_buffer("rope", torch.randn(6), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("bf16", torch.randn(5).to(torch.bfloat16))
        self.register_buffer("f16", torch.randn(3).half())
        self.register_buffer("mask", torch.zeros(4, dtype=torch.bool))
        self.register_buffer("nothing", None)

    def forward(self, x):
        x = self.bn(self.conv(x)).mean((2, 3))
        return self.head(x)


def scramble(module: nn.Module, seed: int) -> nn.Module:
    """Give every buffer and parameter seed-dependent values (different per rank)."""
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for t in list(module.buffers()) + list(module.parameters()):
            if t.dtype == torch.bool:
                t.copy_(torch.rand(t.shape, generator=g) > 0.5)
            elif t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g) * 4 + 0.5)
            else:
                t.copy_(torch.randint(0, 1000, t.shape, generator=g))
    return module


def buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in module.named_buffers()}


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)


def bn_mixture(locals_, name):
    """The float64 reference for one BatchNorm layer: (total count, mean, var) of the ranks' statistics in
    ``locals_`` (one dict per rank: layer name -> (count, mean, var), float64)."""
    n = torch.tensor([loc[name][0] for loc in locals_], dtype=torch.float64)
    means = torch.stack([loc[name][1] for loc in locals_])
    vars_ = torch.stack([loc[name][2] for loc in locals_])
    w = (n / n.sum())[:, None]
    mean = (w * means).sum(0)
    return n, mean, (w * vars_).sum(0) + (w * (means - mean) ** 2).sum(0)


def init_deepspeed():
    """Import DeepSpeed inside a rank worker and attach it to the worker's gloo group (no shm-comm JIT build)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    _wait_for_gloo_gathers(deepspeed)
    return deepspeed


def _wait_for_gloo_gathers(deepspeed) -> None:
    """DeepSpeed before 0.19.8 waits only on the last of the async all-gathers ZeRO-3 issues per parameter
    (``Init._allgather_params_coalesced``); on gloo (CPU) the earlier ones may still be running, and parameters come
    back with garbage (measured: 5-15 of 200 gathers). NCCL orders them on one stream, so GPU users never see it.
    This test-only fix makes each gather complete before DeepSpeed goes on, once per process (fixed upstream in
    0.19.8, where this is a no-op)."""
    from packaging.version import Version

    comm = deepspeed.comm
    if Version(deepspeed.__version__) >= Version("0.19.8") or getattr(comm, "_zb_gloo_fix", False):
        return
    real = comm.all_gather_into_tensor

    def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, **kwargs):
        handle = real(output_tensor, tensor, group=group, async_op=async_op, **kwargs)
        if async_op and handle is not None:
            handle.wait()
        return handle

    comm.all_gather_into_tensor = all_gather_into_tensor
    comm._zb_gloo_fix = True


ZERO3_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3},
}


# Collective logging for "within one collective" / "before any collective" checks (real collectives, wrapped).
ERROR_PATH = "error path: gather the structures to build the message"
COLLECTIVES = ("all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast", "broadcast_object_list",
               "all_reduce", "reduce", "gather", "scatter", "all_to_all", "send", "recv", "barrier")


def log_collectives(log: list) -> dict:
    """Wrap every torch.distributed collective (and the library's error path) to log calls; returns the originals."""
    real = {name: getattr(dist, name) for name in COLLECTIVES}
    real["gather_objects"] = _dist.gather_objects

    def wrap(name):
        def logged(*args, **kwargs):
            t = args[1] if name == "all_gather" else (args[0] if args else None)
            log.append((name, str(t.dtype), t.numel()) if isinstance(t, torch.Tensor) else (name,))
            return real[name](*args, **kwargs)
        return logged

    for name in COLLECTIVES:
        setattr(dist, name, wrap(name))

    def error_path(*args, **kwargs):
        log.append((ERROR_PATH,))
        return real["gather_objects"](*args, **kwargs)

    _dist.gather_objects = error_path
    return real


def restore_collectives(real: dict) -> None:
    """Undo log_collectives."""
    _dist.gather_objects = real.pop("gather_objects")
    for name, fn in real.items():
        setattr(dist, name, fn)


DEEPSPEED_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "broadcast", "all_reduce", "reduce_scatter_tensor")


def log_deepspeed_comm(log: list):
    """Log DeepSpeed's own comm backend calls (ZeRO-3 gathers bypass torch.distributed's module functions).

    Returns an undo callable.
    """
    from deepspeed.comm import comm

    backend = comm.cdb
    for name in DEEPSPEED_COLLECTIVES:
        real = getattr(backend, name)

        def logged(*args, _name=name, _real=real, **kwargs):
            log.append((f"deepspeed.{_name}",))
            return _real(*args, **kwargs)

        setattr(backend, name, logged)  # instance attribute shadows the bound method

    def undo():
        for name in DEEPSPEED_COLLECTIVES:
            backend.__dict__.pop(name, None)
    return undo


def run_cmd(args: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True)`` in a session of its own; on timeout and at the end
    the child's process group and every process it started (torchrun ranks sit in sessions of their own) are
    killed (``zero_buffers._proc``), so no launcher or rank outlives the test. A timeout fails the test with the
    output tail."""
    kw.setdefault("text", True)
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    try:
        return _proc.run(args, timeout, **kw)
    except subprocess.TimeoutExpired as exc:
        tail = [f"{name}:\n{_tail(text)}" for name, text in (("stdout", exc.stdout), ("stderr", exc.stderr)) if text]
        raise AssertionError("\n".join([f"{' '.join(map(str, args))} did not finish within {timeout:g} s "
                                         "(killed with every process it started)", *tail])) from None


def _tail(text: str | bytes, n: int = 3000) -> str:
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    return text[-n:]


# ---- table-driven multi-rank tests: many cases in one pool task, every failing case reported by name --------------
def logged_call(call) -> dict:
    """Run ``call()`` with every collective logged (:func:`log_collectives`); return what happened, picklable:
    ``error`` (None, or type name, message, and the error's ``name``, ``details``, ``ranks``, ``reasons`` and the type
    name of its ``__cause__``), ``value`` (what the call returned, if it pickles) and ``log``."""
    import pickle

    log: list = []
    real = log_collectives(log)
    try:
        value, error = call(), None
    except Exception as e:  # noqa: BLE001 - every outcome is data for the parent's assertions
        value, error = None, (type(e).__name__, str(e), getattr(e, "name", None), getattr(e, "details", None),
                              getattr(e, "ranks", None), getattr(e, "reasons", None),
                              type(e.__cause__).__name__ if e.__cause__ is not None else None)
    finally:
        restore_collectives(real)
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001
        value = repr(value)[:200]
    return {"error": error, "value": value, "log": log}


FENCE_SECONDS = 30.0


def fence(index: int, world: int) -> bool:
    """A control collective between two table cases: every rank must be at case ``index``. int32 x 7, a shape no
    library collective uses, so it cannot pair with one a desynchronised peer is still waiting in."""
    import datetime

    mine = torch.full((7,), index, dtype=torch.int32)
    out = [torch.empty_like(mine) for _ in range(world)]
    try:
        dist.all_gather(out, mine, async_op=True).wait(timeout=datetime.timedelta(seconds=FENCE_SECONDS))
    except RuntimeError:
        return False
    return all(bool((o == index).all()) for o in out)


def run_table(world: int, names, run_case) -> dict:
    """In a rank body: ``run_case(name)`` for every case name, in order, with a :func:`fence` after each. A case that
    raises is recorded as ``{"crashed": traceback}``; if the ranks fall out of step the table stops there and the
    key ``"<desynchronised>"`` names the case after which it happened (the process group is then suspect)."""
    import traceback

    results: dict = {}
    for i, name in enumerate(names):
        try:
            results[name] = run_case(name)
        except BaseException as e:  # noqa: BLE001 - reported per case by the parent
            results[name] = {"crashed": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
        if not fence(i, world):
            results["<desynchronised>"] = name
            break
    return results


def check_table(names, per_rank: list, check) -> None:
    """In the parent: ``check(name, [rank 0's result, rank 1's, ...])`` for every case; one AssertionError listing
    every failing case by name (and the cases the ranks never reached)."""
    failures = []
    stopped = [r.get("<desynchronised>") for r in per_rank if r.get("<desynchronised>")]
    if stopped:
        failures.append(f"<table>: ranks fell out of step after case {stopped[0]!r}")
    for name in names:
        results = [r.get(name) for r in per_rank]
        if any(res is None for res in results):
            failures.append(f"{name}: not run on rank(s) {[i for i, res in enumerate(results) if res is None]}")
            continue
        crashed = [(i, res["crashed"]) for i, res in enumerate(results) if "crashed" in res]
        if crashed:
            failures.append(f"{name}: the case itself crashed on rank {crashed[0][0]}: {crashed[0][1]}")
            continue
        try:
            check(name, results)
        except AssertionError as e:
            failures.append(f"{name}: {str(e)[:1500] or 'assertion failed'}")
    if failures:
        raise AssertionError(f"{len(failures)} of {len(names)} cases failed:\n" + "\n".join(failures))


# ---- what the installed DeepSpeed / transformers do (CI also runs the stack tests on the oldest versions) ----
def deepspeed_source_has(marker: str, path: str = "deepspeed/runtime/zero/partition_parameters.py") -> bool:
    """Whether the installed DeepSpeed's ``path`` contains ``marker`` (a feature check that imports nothing)."""
    import importlib.metadata

    try:
        return marker in importlib.metadata.distribution("deepspeed").locate_file(path).read_text()
    except (importlib.metadata.PackageNotFoundError, OSError):
        return False


def package_major(name: str) -> int:
    """The installed major version of a distribution (0 when it is not installed)."""
    import importlib.metadata

    try:
        return int(importlib.metadata.version(name).split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return 0


# GatheredParameters marks the parameters it holds and refuses overlapping nested contexts (DeepSpeed 0.19.4+); before
# that an inner context on held parameters re-partitions them under the outer one, and zero_buffers cannot tell.
DS_NESTING_CHECK = deepspeed_source_has("DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR")
# ... and with enable_sanity_checks, modifier_rank=None raises on an in-place write on any rank.
DS_SANITY_WRITE_CHECK = deepspeed_source_has("_param_versions")
# transformers 5.x broadcasts checkpoint buffers in from_pretrained under ZeRO-3; 4.x loads them on rank 0 only.
HF5 = package_major("transformers") >= 5


def messages(calls: dict, error: type = Exception) -> dict:
    """Each call's ``error`` message by name (None when it returned): how bad-input tests compare ranks' errors."""
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except error as e:
            out[name] = str(e)
    return out


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
