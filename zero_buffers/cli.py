"""The ``zero-buffers`` command: list and run the bundled repro scripts on N local ranks."""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import time
from pathlib import Path

from . import _proc


def repro_dir() -> Path:
    """``$ZERO_BUFFERS_REPRO_DIR``, else the ``repro/`` folder inside the package (also in an installed wheel)."""
    env = os.environ.get("ZERO_BUFFERS_REPRO_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "repro"


def scripts(folder: Path) -> dict[str, str]:
    """Repro name -> first docstring line, for every ``*.py`` not starting with ``_``."""
    out = {}
    for path in sorted(folder.glob("[!_]*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        out[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return out


def default_backend(nproc: int) -> str:
    """nccl when there is one GPU per rank, else gloo."""
    try:
        import torch
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"
    except ImportError:
        return "gloo"


def _free_port() -> int:
    """A TCP port nobody listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(path: Path, nproc: int, launcher: str) -> list[str]:
    """torchrun, or ``accelerate launch`` with DeepSpeed ZeRO-3 (the recipe that works on CPU)."""
    if launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", f"--num_processes={nproc}", "--num_machines=1",
                "--mixed_precision=no", "--dynamo_backend=no", "--use_deepspeed", "--zero_stage=3",
                "--zero3_init_flag=true", f"--main_process_port={_free_port()}", str(path)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(path)]


def run_one(path: Path, nproc: int, backend: str, timeout: float, launcher: str = "torchrun") -> tuple[int, float]:
    """Run one script on ``nproc`` local ranks; returns (exit code, seconds).

    The launcher runs in its own session; on timeout (exit code 124), Ctrl-C or exit, its process group and
    every rank it started (torchrun gives each rank a session of its own) are killed.
    """
    env = dict(os.environ, ZB_BACKEND=backend, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = launch_command(path, nproc, launcher)
    started = time.monotonic()
    try:
        code = _proc.run(cmd, timeout, env=env).returncode
    except subprocess.TimeoutExpired:
        print(f"zero-buffers: {path.stem} did not finish within {timeout:g} s; killed it and every rank it started",
              file=sys.stderr)
        code = 124
    return code, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zero-buffers``."""
    parser = argparse.ArgumentParser(prog="zero-buffers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the repro scripts")
    rp = sub.add_parser("repro", help="run one repro script (or all of them) on N local ranks")
    rp.add_argument("name", nargs="?", help="script name from 'zero-buffers list' (default: all)")
    rp.add_argument("--nproc", type=int, default=2, help="number of local ranks (default 2)")
    rp.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                    help="default: nccl with one GPU per rank, else gloo on CPU")
    rp.add_argument("--launcher", choices=["torchrun", "accelerate"], default="torchrun",
                    help="torchrun (default) or accelerate launch with DeepSpeed ZeRO-3")
    rp.add_argument("--timeout", type=float, default=900,
                    help="seconds per script, then it and all its ranks are killed (default 900)")
    args = parser.parse_args(argv)

    folder = repro_dir()
    found = scripts(folder) if folder.is_dir() else {}
    if not found:
        print(f"zero-buffers: no repro scripts in {folder} (set ZERO_BUFFERS_REPRO_DIR)", file=sys.stderr)
        return 2
    if args.command == "list":
        width = max(map(len, found))
        for name, doc in found.items():
            print(f"{name:<{width}}  {doc}")
        return 0
    if args.nproc < 1:
        parser.error("--nproc must be >= 1")
    if not args.timeout > 0:
        parser.error("--timeout must be > 0")
    names = [args.name] if args.name else list(found)
    unknown = [n for n in names if n not in found]
    if unknown:
        parser.error(f"unknown repro {unknown[0]!r}; choose from: {', '.join(found)}")
    backend = args.backend or default_backend(args.nproc)
    summary = []
    for name in names:
        print(f"=== zero-buffers repro {name} --nproc {args.nproc} --backend {backend} --launcher {args.launcher}",
              flush=True)
        code, seconds = run_one(folder / f"{name}.py", args.nproc, backend, args.timeout, args.launcher)
        summary.append((name, code, seconds))
    print("\n=== summary")
    for name, code, seconds in summary:
        print(f"{name:<32} {'ok' if code == 0 else f'FAILED (exit {code})':<18} {seconds:6.1f} s")
    return 0 if all(code == 0 for _, code, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
