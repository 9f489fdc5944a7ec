"""The CUDA paths, on one GPU: two gloo ranks share it (one GPU cannot host an nccl world of two).

    python tests/gpu/check_cuda.py        # prints one line per check and exits non-zero if any fails

Checks: the core functions on CUDA buffers against CPU references; the on-device fingerprint (equal values,
layouts, one flipped bit, agreement across ranks, cost against copying to the host); UnsupportedDeviceError for
CPU buffers on an nccl group; frozen_replica against GatheredParameters on one GPU (needs DeepSpeed). The
benchmark's CUDA broadcast runs with ``benchmarks/bench.py --cuda-gloo``. tests/gpu/run.sh runs both.
"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import zero_buffers as zb  # noqa: E402
from zero_buffers._core import digest as _digest, group as _group, transaction as _transaction  # noqa: E402


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.LazyLinear(4), nn.BatchNorm1d(4))


def _rank(rank: int, world: int, store: str, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    dev = torch.device("cuda", 0)
    lines = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        lines.append(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")

    torch.manual_seed(0)
    model = _net().to(dev)
    model(torch.randn(4, 3, 8, 8, device=dev))  # materialise the lazy layer
    with torch.no_grad():
        for b in model.buffers():
            if b.is_floating_point():
                b.copy_(torch.rand_like(b) + rank)
    report = zb.buffer_report(model)
    check("buffer_report flags CUDA buffers that differ", not report.in_sync and all(
        r.differing_ranks == (1,) for r in report.rows if r.name.endswith(("mean", "var"))))
    zb.broadcast_buffers(model)
    check("broadcast_buffers on CUDA, then the report agrees", zb.buffer_report(model).in_sync)

    g = torch.Generator().manual_seed(10 + rank)
    data = [torch.randn(16, 3, 8, 8, generator=g).to(dev) * (1 + rank) for _ in range(3)]
    zb.recompute_bn_stats(model, data, progress=False)
    stats = model[1].running_var.cpu()
    everyone = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(everyone, stats)
    check("recompute_bn_stats on CUDA: identical on every rank", all(torch.equal(s, everyone[0]) for s in everyone))
    zb.recompute_bn_stats(model, data[:1 + rank], progress=False, global_batch=True)  # uneven: lockstep on CUDA
    stats = model[1].running_var.cpu()
    dist.all_gather(everyone, stats)
    check("recompute_bn_stats(global_batch=True) on CUDA: identical on every rank",
          all(torch.equal(s, everyone[0]) for s in everyone))
    with torch.no_grad():
        model[1].running_mean.add_(rank)
    zb.average_bn_stats(model)
    check("average_bn_stats on CUDA buffers", zb.buffer_report(model).in_sync)

    x = torch.randn(1 << 24, device=dev)  # 64 MiB
    fp = _digest.fingerprint(x)
    flipped = x.clone()
    flipped.view(torch.int32)[12345] ^= 1
    check("fingerprint: deterministic, sees one bit, ignores strides",
          fp == _digest.fingerprint(x.clone()) and fp != _digest.fingerprint(flipped)
          and _digest.fingerprint(x.view(4096, 4096).t().contiguous().t()) == fp)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        _digest.fingerprint(x)
    torch.cuda.synchronize()
    t_fp = (time.perf_counter() - start) / 5
    start = time.perf_counter()
    for _ in range(5):
        x.cpu()
    t_copy = (time.perf_counter() - start) / 5
    check("fingerprint of 64 MiB on the GPU vs only copying it to the host", True,
          f"{t_fp * 1e3:.2f} ms vs {t_copy * 1e3:.2f} ms")

    nccl = _group.Group(pg=None, ranks=(0, 1), me=0, backend="nccl")
    err = _transaction.unsendable(nccl, [("bn.running_mean", torch.zeros(3))], "broadcast_buffers")
    check("UnsupportedDeviceError for CPU buffers on nccl", isinstance(err, zb.UnsupportedDeviceError)
          and "bn.running_mean" in str(err))
    check("... and none for CUDA buffers", _transaction.unsendable(
        nccl, [("bn.running_mean", torch.zeros(3, device=dev))], "broadcast_buffers") is None)

    try:
        import deepspeed
    except ImportError:
        check("frozen_replica vs GatheredParameters on one GPU", True, "skipped: DeepSpeed not installed")
    else:
        deepspeed.init_distributed(dist_backend="gloo")
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}

        def tok() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(nn.Conv3d(3, 32, 3, padding=1), nn.BatchNorm3d(32), nn.ReLU(),
                                 nn.Conv3d(32, 32, 3, padding=1), nn.BatchNorm3d(32)).eval()

        with deepspeed.zero.Init(config_dict_or_path=cfg):
            part = tok()
        replica = zb.frozen_replica(tok().to(dev))
        video = torch.randn(1, 3, 8, 32, 32, device=dev)
        params = list(part.parameters())

        def timed(fn) -> float:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / 20

        def gathered() -> None:
            with torch.no_grad(), deepspeed.zero.GatheredParameters(params):
                part(video)

        t_g, t_f = timed(gathered), timed(lambda: replica(video))
        check("frozen_replica vs GatheredParameters per forward (2 ranks, 1 GPU)", t_f < t_g,
              f"{t_g * 1e3:.2f} ms vs {t_f * 1e3:.2f} ms ({t_g / t_f:.1f}x)")
    if rank == 0:
        Path(out).write_text("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    tmp = tempfile.mkdtemp()
    out = os.path.join(tmp, "out.txt")
    mp.start_processes(_rank, args=(2, os.path.join(tmp, "store"), out), nprocs=2, start_method="spawn")
    text = Path(out).read_text()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    print(text)
    return 1 if "FAIL" in text else 0


if __name__ == "__main__":
    sys.exit(main())
