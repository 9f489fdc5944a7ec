"""The ``zero-buffers`` command: the repro scripts (list, repro) and the checkpoint doctor (inspect, diff, repair)."""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def run_one(path: Path, nproc: int, backend: str, timeout: float, launcher: str = "torchrun",
            quick: bool = False) -> tuple[int, float]:
    """Run one script on ``nproc`` local ranks; returns (exit code, seconds).

    The launcher runs in its own session; on timeout (exit code 124), Ctrl-C or exit, its process group and
    every rank it started (torchrun gives each rank a session of its own) are killed.
    """
    env = dict(os.environ, ZB_BACKEND=backend, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if quick:
        env["ZB_QUICK"] = "1"
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
    rp.add_argument("--quick", action="store_true",
                    help="a smaller run where a script offers one (ddp_bn_checkpoint: a quarter of ResNet-34's width)")
    _doctor_parsers(sub)
    args = parser.parse_args(argv)
    if args.command in ("inspect", "diff", "repair"):
        return doctor(args)

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
        code, seconds = run_one(folder / f"{name}.py", args.nproc, backend, args.timeout, args.launcher, args.quick)
        summary.append((name, code, seconds))
    print("\n=== summary")
    for name, code, seconds in summary:
        print(f"{name:<32} {'ok' if code == 0 else f'FAILED (exit {code})':<18} {seconds:6.1f} s")
    return 0 if all(code == 0 for _, code, _ in summary) else 1


def _doctor_parsers(sub: Any) -> None:
    """The inspect / diff / repair subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--tag", help="DeepSpeed tag folder to read (default: the one 'latest' names)")
    common.add_argument("--trust-pickle", action="store_true",
                        help="unpickle Python objects in old or custom checkpoints (only for files you trust)")
    common.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: for 8 or more files on a terminal)")
    check = argparse.ArgumentParser(add_help=False)
    check.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                       help="check every .pt archive's CRC-32 first (default: files up to 256 MiB; repair: always)")
    ins = sub.add_parser("inspect", parents=[common, check],
                         help="what a checkpoint holds: kind, ranks, buffers, counters")
    ins.add_argument("path")
    ins.add_argument("--json", action="store_true", help="one JSON object instead of text")
    ins.add_argument("--all", action="store_true", help="also print the per-buffer table")
    df = sub.add_parser("diff", parents=[common, check],
                        help="per buffer, whether the ranks of a checkpoint (or several files) agree; exit 1 if not")
    df.add_argument("paths", nargs="+", metavar="PATH")
    df.add_argument("--atol", type=float, default=0.0, help="tolerance (default 0: bitwise identical)")
    df.add_argument("--only", action="append", default=[], metavar="PATTERN",
                    help="compare only buffers whose name matches this glob (repeatable)")
    df.add_argument("--json", action="store_true", help="one JSON object, with one object per buffer")
    df.add_argument("--all", action="store_true", help="every row, also for models with many buffers")
    rp = sub.add_parser("repair", parents=[common], help="write a copy where every rank holds the same buffers")
    rp.add_argument("path")
    rp.add_argument("-o", "--out", help="new folder for the repaired copy (must not exist)")
    rp.add_argument("--in-place", action="store_true",
                    help="replace the input folder (one atomic exchange; a crash leaves the old or the new one)")
    rp.add_argument("--recover", action="store_true",
                    help="only clean up or restore what an interrupted repair of PATH left beside it, then stop")
    rp.add_argument("--policy", choices=["average", "broadcast"], default="average",
                    help="average: exact mixture of BatchNorm statistics, other buffers from --src (default); "
                         "broadcast: every buffer from --src")
    rp.add_argument("--src", type=int, default=0, help="rank whose buffers are taken (default 0)")


def doctor(args: argparse.Namespace) -> int:
    """Run inspect / diff / repair: exit 0 when all agree (or the repair is written), 1 when buffers differ,
    2 when a checkpoint cannot be read or repaired."""
    from .doctor.repair import recover_checkpoint, repair_checkpoint
    from .doctor.report import checkpoint_report
    from .errors import ZeroBuffersError

    common = {"tag": args.tag, "trust_pickle": args.trust_pickle, "progress": args.progress}
    if args.command != "repair":
        common["verify"] = args.verify
    try:
        if args.command == "repair" and args.recover:
            if args.out is not None or args.in_place:
                print("zero-buffers repair: --recover does no repair; give it without -o and --in-place",
                      file=sys.stderr)
                return 2
            done = recover_checkpoint(args.path)
            print("\n".join(done) if done else f"{args.path}: nothing to recover (no leftovers of an interrupted "
                                                "repair beside or inside it)")
            return 0
        if args.command == "repair":
            if (args.out is None) == (not args.in_place):
                print("zero-buffers repair: give exactly one of -o OUT and --in-place (or --recover)", file=sys.stderr)
                return 2
            print(repair_checkpoint(args.path, args.out, policy=args.policy, src=args.src, in_place=args.in_place,
                                    **common).format())
            return 0
        if args.command == "inspect":
            report = checkpoint_report(args.path, **common)
        else:
            report = checkpoint_report(*args.paths, atol=args.atol, only=args.only, **common)
    except (ZeroBuffersError, OSError) as e:  # OSError: an output folder that cannot be made, a full disk ...
        print(f"zero-buffers {args.command}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    elif args.command == "inspect":
        print(report.format(full=args.all))
    else:
        print(report.heading())
        if not report.per_rank and len(report.sources) > 1:
            print("\n".join(f"  source {i}: {s}" for i, s in enumerate(report.sources)))
        print(report.table(full=args.all).replace("format(full=True)", "--all"))
        for w in report.warnings:
            print(f"WARNING: {w}")
    if args.command == "diff" and not report.compared:
        return 0
    return 0 if args.command == "inspect" or report.in_sync else 1


if __name__ == "__main__":
    sys.exit(main())
