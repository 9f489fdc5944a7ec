"""The ``zero-buffers`` command: the checkpoint doctor (inspect, diff, repair), a checkpoint to try it on
(example-checkpoint) and the repro scripts (list, repro).

Every message names the command line's flags (``--in-place``, ``-o``); the doctor's errors carry their arguments as
data (``doctor._words``) and are spelled here. A bare ``zero-buffers`` prints the help and exits 0: it asked for
nothing wrong, only for orientation. Usage errors exit 2, as argparse's do.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import json
import math
import os
import shlex
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from . import __version__, _proc

DESCRIPTION = ("Keep PyTorch module buffers (BatchNorm statistics, codebooks, counters) correct across ranks. "
               "Find and repair diverged buffers in checkpoints already written, offline (inspect, diff, repair); "
               "make a small checkpoint to try that on (example-checkpoint); run the bundled repro scripts, each a "
               "bug and its fixes on real local ranks (list, repro).")

EXAMPLES = {
    "example-checkpoint": ("zero-buffers example-checkpoint demo", "write a small checkpoint whose ranks diverged"),
    "inspect": ("zero-buffers inspect demo", "what a checkpoint holds: kind, ranks, buffers, counters"),
    "diff": ("zero-buffers diff demo", "which buffers differ across its ranks (exit 1 when any does)"),
    "repair": ("zero-buffers repair demo -o demo_fixed", "a copy in which every rank holds the same buffers"),
    "list": ("zero-buffers list", "the bundled repro scripts, one line each"),
    "repro": ("zero-buffers repro buffers_diverge", "run one on 2 local ranks: its bug and each fix, in a table"),
}

DEFAULT_TIMEOUT = 900.0  # a script without BUDGET_SECONDS
MIN_TIMEOUT = 120.0  # the least a budgeted script gets; $ZERO_BUFFERS_MIN_TIMEOUT lowers it (the CLI's own tests)


def _min_timeout() -> float:
    try:
        value = float(os.environ.get("ZERO_BUFFERS_MIN_TIMEOUT", MIN_TIMEOUT))
    except ValueError:
        return MIN_TIMEOUT
    return value if value > 0 else MIN_TIMEOUT


def _examples(*names: str, more: tuple[tuple[str, str], ...] = ()) -> str:
    rows = [EXAMPLES[n] for n in names] + list(more)
    width = max(len(c) for c, _ in rows)
    return "example" + ("s" if len(rows) > 1 else "") + ":\n" + "\n".join(f"  {c:<{width}}  {w}" for c, w in rows)


def repro_dir() -> Path:
    """``$ZERO_BUFFERS_REPRO_DIR``, else the ``repro/`` folder inside the package (also in an installed wheel)."""
    env = os.environ.get("ZERO_BUFFERS_REPRO_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "repro"


def scripts(folder: Path) -> dict[str, str]:
    """Repro name -> the first paragraph of its docstring on one line (a summary wrapped over lines stays whole),
    for every ``*.py`` not starting with ``_``."""
    out = {}
    for path in sorted(folder.glob("[!_]*.py")):
        doc = (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
        out[path.stem] = " ".join(doc.split("\n\n", 1)[0].split())
    return out


def _literal(path: Path, name: str) -> object:
    """The literal a script assigns to the module-level ``name``, read with ``ast``, never by importing the
    script; None when it has none (or not a literal)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        target: ast.expr
        expr: ast.expr | None
        if isinstance(node, ast.AnnAssign):
            target, expr = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, expr = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == name and expr is not None:
            try:
                return ast.literal_eval(expr)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
    return None


def budget(path: Path) -> dict[str, int] | None:
    """A script's ``BUDGET_SECONDS = {"quick": int, "full": int}`` (seconds on an idle 2-core machine); None when
    it has none (or not a literal of that shape)."""
    value = _literal(path, "BUDGET_SECONDS")
    if isinstance(value, dict) and set(value) == {"quick", "full"} and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value.values()):
        return value
    return None


def unmet_needs(path: Path) -> str | None:
    """Why a script cannot run with the installed packages: its ``NEEDS = ("fsdp2", ...)`` names capabilities of
    ``zero_buffers._compat.versions``; None when every one is there (or it declares none)."""
    from ._compat import versions

    needs = _literal(path, "NEEDS")
    if not isinstance(needs, tuple):
        return None
    for name in needs:
        if isinstance(name, str) and name in versions.CAPABILITIES:
            why = versions.unmet(name)
            if why is not None:
                return why
    return None


@dataclass(frozen=True)
class Limit:
    """How long one script may run, and why (the words of the summary)."""

    seconds: float
    why: str

    @classmethod
    def of(cls, path: Path, mode: str, given: float | None) -> Limit:
        if given is not None:
            return cls(given, f"--timeout {given:g}")
        found = budget(path)
        if found is None:
            return cls(DEFAULT_TIMEOUT, f"the default {DEFAULT_TIMEOUT:g} s for a script without a time budget")
        own, least = found[mode], _min_timeout()
        if 4.0 * own >= least:
            return cls(4.0 * own, f"its time budget, 4x its {own} s on an idle machine")
        return cls(least, f"the least time budget a script gets; its own is {own} s on an idle machine")


def default_backend(nproc: int) -> str:
    """nccl when there is one GPU per rank, else gloo (without importing torch where Linux shows no NVIDIA device)."""
    if sys.platform.startswith("linux") and not any(Path("/dev").glob("nvidia[0-9]*")):
        return "gloo"
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
    """The ranks started directly (``_launch.py``, run by path: no torch import, no agent), torchrun, or
    ``accelerate launch`` with DeepSpeed ZeRO-3 (the recipe that works on CPU)."""
    if launcher == "local":
        return _proc.local_launch(nproc, str(path))
    if launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", f"--num_processes={nproc}", "--num_machines=1",
                "--mixed_precision=no", "--dynamo_backend=no", "--use_deepspeed", "--zero_stage=3",
                "--zero3_init_flag=true", f"--main_process_port={_free_port()}", str(path)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(path)]


QUIET = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def child_env(backend: str, full: bool, verbose: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a repro script runs in: ``ZB_BACKEND``, ``ZB_FULL=1`` for the full run, ``ZB_VERBOSE=1``
    with ``--verbose``; without it, other libraries' progress bars and chatter off (each only where the user has not
    set it). ``DS_ACCELERATOR=cpu`` on gloo skips DeepSpeed's "Setting accelerator to CPU" warning."""
    env = dict(os.environ if base is None else base, ZB_BACKEND=backend)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("ZB_QUICK", None)
    env.pop("ZB_FULL", None)
    env.pop("ZB_VERBOSE", None)
    if full:
        env["ZB_FULL"] = "1"
    if verbose:
        env["ZB_VERBOSE"] = "1"
    else:
        for k, v in QUIET.items():
            env.setdefault(k, v)
        if backend == "gloo":
            env.setdefault("DS_ACCELERATOR", "cpu")
    return env


@dataclass(frozen=True)
class Outcome:
    """One script's run: its exit code (None when killed), seconds, whether its table said a fix did not hold."""

    name: str
    code: int | None
    seconds: float
    limit: Limit
    fix_failed: bool
    printed_result: bool
    skipped: str | None = None  # why it did not run (a capability the installed packages lack)


class InOrder:
    """The scripts' output in the order they were listed, whatever order they run in: the first unfinished script's
    lines are written as they come, a later one's are held until every script before it has finished, then written
    at once and live from there. Each line keeps its stream (stdout or stderr)."""

    def __init__(self, n: int) -> None:
        self._lock = threading.Lock()
        self._head = 0
        self._held: list[list[tuple[str, bytes]]] = [[] for _ in range(n)]
        self._done = [False] * n

    @staticmethod
    def _emit(stream: str, data: bytes) -> None:
        out = sys.stdout if stream == "stdout" else sys.stderr
        raw = getattr(out, "buffer", None)
        if raw is not None:
            out.flush()
            raw.write(data)
            raw.flush()
        else:
            out.write(data.decode(errors="replace"))
            out.flush()

    def write(self, i: int, stream: str, data: bytes) -> None:
        with self._lock:
            if i == self._head:
                self._emit(stream, data)
            else:
                self._held[i].append((stream, data))

    def finish(self, i: int) -> None:
        with self._lock:
            self._done[i] = True
            while self._head < len(self._done) and self._done[self._head]:
                self._head += 1
                if self._head < len(self._done):
                    for stream, data in self._held[self._head]:
                        self._emit(stream, data)
                    self._held[self._head].clear()


_RUNNING: dict[str, subprocess.Popen] = {}  # tag -> launcher, while it runs: Ctrl-C kills them all
_RUNNING_LOCK = threading.Lock()


def _pump(stream: IO[bytes], name: str, sink: InOrder, i: int, seen: list[bytes]) -> None:
    """Copy one of the script's streams to ours (through ``sink``), remembering its RESULT line."""
    for line in iter(stream.readline, b""):
        if name == "stdout" and line.startswith(b"RESULT:"):
            seen.append(line)
        sink.write(i, name, line)


def run_one(path: Path, nproc: int, backend: str, limit: Limit, launcher: str = "local", full: bool = False,
            verbose: bool = False, sink: InOrder | None = None, i: int = 0) -> Outcome:
    """Run one script on ``nproc`` local ranks, its output (stdout and stderr) passed to ``sink`` as it comes.

    The launcher runs in its own session with a tag in its environment; past ``limit`` seconds, on Ctrl-C and after
    it exits, its process group and every tagged process (torchrun gives each rank a session of its own) are killed.
    """
    sink = sink or InOrder(1)
    tag = f"ZERO_BUFFERS_RUN_{uuid.uuid4().hex}"
    env = child_env(backend, full, verbose)
    env[tag] = "1"
    cmd = launch_command(path, nproc, launcher)
    seen: list[bytes] = []
    started = time.monotonic()
    code: int | None
    with subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        with _RUNNING_LOCK:
            _RUNNING[tag] = proc
        assert proc.stdout is not None and proc.stderr is not None
        pumps = [threading.Thread(target=_pump, args=(stream, name, sink, i, seen), daemon=True)
                 for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
        for pump in pumps:
            pump.start()
        try:
            code = proc.wait(timeout=limit.seconds)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _proc.kill_tree(proc, tag)
            with _RUNNING_LOCK:
                _RUNNING.pop(tag, None)
            for pump in pumps:
                pump.join(timeout=10)
        if code is None:
            sink.write(i, "stderr", f"zero-buffers: {path.stem} did not finish within {limit.seconds:g} s "
                                    f"({limit.why}); killed it and every rank it started\n".encode())
    seconds = time.monotonic() - started
    failed = any(b"DOES NOT HOLD" in line.upper() for line in seen)
    return Outcome(path.stem, code, seconds, limit, failed, bool(seen))


def _kill_running() -> None:
    with _RUNNING_LOCK:
        running = list(_RUNNING.items())
    for tag, proc in running:
        _proc.kill_tree(proc, tag)


def _rerun(o: Outcome, args: argparse.Namespace, backend: str, timeout: float | None = None) -> str:
    cmd = ["zero-buffers", "repro", o.name]
    if args.nproc != 2:
        cmd += ["--nproc", str(args.nproc)]
    if args.backend:
        cmd += ["--backend", backend]
    if args.launcher != "local":
        cmd += ["--launcher", args.launcher]
    if args.full:
        cmd.append("--full")
    if timeout is not None:
        cmd += ["--timeout", f"{timeout:g}"]
    return shlex.join(cmd)


def _status(o: Outcome, args: argparse.Namespace, backend: str) -> str:
    """One script's line of the summary, in words."""
    if o.skipped is not None:
        return f"skipped: it {o.skipped}"
    if o.code is None:
        more = 60 * math.ceil(4 * o.limit.seconds / 60)
        return (f"KILLED after {o.limit.seconds:g} s ({o.limit.why}); rerun alone: "
                f"{_rerun(o, args, backend, more)}")
    if o.code == 0:
        return f"ok ({o.seconds:.1f} s)"
    if o.fix_failed:
        return f"FAILED (exit {o.code}): a fix did not hold, see its table above"
    if not o.printed_result:
        return (f"FAILED (exit {o.code}): it stopped before its table, see its error above; rerun alone: "
                f"{_rerun(o, args, backend)}")
    return f"FAILED (exit {o.code}) after its table, see its output above"


def repro(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
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
    if args.nproc < 2:
        parser.error("--nproc must be >= 2: every repro compares ranks")
    if args.timeout is not None and not args.timeout > 0:
        parser.error("--timeout must be > 0")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    if args.quick:
        print("zero-buffers: --quick is the default now and does nothing; --full runs the full-width tables",
              file=sys.stderr)
    names = [args.name] if args.name else list(found)
    unknown = [n for n in names if n not in found]
    if unknown:
        parser.error(f"unknown repro {unknown[0]!r}; choose from: {', '.join(found)}")
    backend = args.backend or default_backend(args.nproc)
    # ZB_FULL=1 / ZB_VERBOSE=1 in the caller's environment mean what the flags mean (the scripts read them too)
    args.full = args.full or os.environ.get("ZB_FULL") == "1"
    args.verbose = args.verbose or os.environ.get("ZB_VERBOSE") == "1"
    mode = "full" if args.full else "quick"
    sink = InOrder(len(names))

    def one(i: int, name: str) -> Outcome:
        path = folder / f"{name}.py"
        limit = Limit.of(path, mode, args.timeout)
        sink.write(i, "stdout", f"=== zero-buffers repro {name} --nproc {args.nproc} --backend {backend} --launcher "
                                f"{args.launcher}{' --full' if args.full else ''}  ({mode} run, at most "
                                f"{limit.seconds:g} s)\n".encode())
        try:
            why = unmet_needs(path)
            if why is not None:
                sink.write(i, "stdout", f"zero-buffers: {name} skipped: it {why}\n".encode())
                return Outcome(name, 0, 0.0, limit, False, False, skipped=why)
            return run_one(path, args.nproc, backend, limit, args.launcher, args.full, args.verbose, sink, i)
        finally:
            sink.finish(i)

    # side by side: a script's ranks wait on each other much of the time, so on 2 cores two
    # scripts at once finish sooner than one after the other; their output still comes in the listed order (InOrder)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(args.jobs, len(names)))) as pool:
        futures = [pool.submit(one, i, name) for i, name in enumerate(names)]
        try:
            outcomes = [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            _kill_running()
            raise
    print("\n=== summary")
    width = max(len(o.name) for o in outcomes)
    for o in outcomes:
        print(f"{o.name:<{width}}  {_status(o, args, backend)}")
    bad = [o for o in outcomes if o.code != 0]
    if not bad:
        ran = [o for o in outcomes if o.skipped is None]
        skipped = len(outcomes) - len(ran)
        if not ran:
            said = "none ran"
        elif len(ran) == 1:
            said = "it ran and every fix held"
        else:
            said = f"all {len(ran)} {'that ran held every fix' if skipped else 'ran and every fix held'}"
        print(said + (f"; {skipped} skipped: the installed versions lack what they need" if skipped else ""))
        return 0
    print(f"{len(bad)} of {len(outcomes)} did not pass: {', '.join(o.name for o in bad)}")
    return 1


# -- the parser ------------------------------------------------------------------------------------------------------

class _Formatter(argparse.HelpFormatter):
    """Wraps the prose of descriptions and epilogs; keeps the layout of indented blocks (the examples)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        out = []
        for para in text.split("\n\n"):
            if any(line.startswith("  ") for line in para.splitlines()[1:]):
                out.append(para)
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero-buffers", description=DESCRIPTION, formatter_class=_Formatter,
                                     epilog=_examples(*EXAMPLES) + "\n\n'zero-buffers COMMAND --help' tells more.")
    parser.add_argument("--version", action="version", version=f"zero-buffers {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands",
                                help="one of the commands below")
    ex = sub.add_parser("example-checkpoint", help="write a small checkpoint whose ranks diverged, to try the "
                        "doctor on", formatter_class=_Formatter,
                        description="Train a tiny BatchNorm network a few steps on local CPU ranks (gloo), each rank "
                        "on data of its own offset, and save it: a checkpoint whose ranks' BatchNorm statistics "
                        "differ. It prints the files written and the commands to try next.",
                        epilog=_examples("example-checkpoint", more=(
                            ("zero-buffers example-checkpoint demo_z3 --kind zero3",
                             "a real DeepSpeed ZeRO-3 checkpoint instead"),)))
    ex.add_argument("dir", metavar="DIR", help="a new folder (or an empty one) to write the checkpoint into")
    ex.add_argument("--kind", choices=["per-rank", "zero3", "dcp"], default="per-rank",
                    help="per-rank (default, torch alone): one torch.save file per rank; zero3: a DeepSpeed ZeRO-3 "
                         "checkpoint (needs DeepSpeed); dcp: a torch.distributed.checkpoint folder")
    ex.add_argument("--nproc", type=int, default=2, help="number of local ranks (default 2, at least 2)")
    ex.add_argument("--timeout", type=float, default=300,
                    help="seconds before the ranks are killed (default 300)")
    _doctor_parsers(sub)
    sub.add_parser("list", help="list the bundled repro scripts", formatter_class=_Formatter,
                   description="List the bundled repro scripts, one line each: its name and what it shows.",
                   epilog=_examples("list"))
    rp = sub.add_parser("repro", help="run one repro script (or all of them) on N local ranks",
                        formatter_class=_Formatter,
                        description="Run a bundled repro script (or every one) on N local ranks: each prints a table "
                        "of a bug and its fixes and exits 1 when a fix does not hold. A quick run by default; each "
                        "script is killed with all its ranks past its time budget (4x its seconds on an idle "
                        "2-core machine, at least 120 s) or --timeout.",
                        epilog=_examples("repro", more=(
                            ("zero-buffers repro ddp_bn_checkpoint --full", "the full-width table the docs quote"),
                            ("zero-buffers repro", "every script, then a summary"))))
    rp.add_argument("name", nargs="?", metavar="NAME", help="a script name from 'zero-buffers list' (default: all)")
    rp.add_argument("--nproc", type=int, default=2, help="number of local ranks (default 2, at least 2)")
    rp.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                    help="default: nccl with one GPU per rank, else gloo on CPU")
    rp.add_argument("--launcher", choices=["local", "torchrun", "accelerate"], default="local",
                    help="local (default: the ranks started directly, with the variables torchrun sets), torchrun, "
                         "or accelerate launch with DeepSpeed ZeRO-3")
    rp.add_argument("--jobs", type=int, default=2,
                    help="scripts run at the same time (default 2; 1: one after the other); the output still comes "
                         "in the listed order")
    rp.add_argument("--full", action="store_true",
                    help="the full-size run the docs' tables quote (default: a quick run, where a script has one; "
                         "ZB_FULL=1 in the environment too)")
    rp.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # deprecated: the default now, a no-op
    rp.add_argument("--verbose", action="store_true",
                    help="keep other libraries' logs and progress bars (hidden by default; ZB_VERBOSE=1 in the "
                         "environment too)")
    rp.add_argument("--timeout", type=float, default=None, metavar="S",
                    help="seconds per script, then it and all its ranks are killed (default: 4x the script's time "
                         f"budget, at least {MIN_TIMEOUT:g}; {DEFAULT_TIMEOUT:g} for a script without one)")
    parser.set_defaults(commands=sub.choices)  # command -> its parser: errors show that command's usage
    return parser


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
    where = ("a checkpoint: a DeepSpeed folder (or one of its tag folders), a folder of per-rank files, a DCP "
             "folder, an Accelerate save_state folder, or one state-dict file")
    ins = sub.add_parser("inspect", parents=[common, check], formatter_class=_Formatter,
                         help="what a checkpoint holds: kind, ranks, buffers, counters",
                         description="Say what a checkpoint holds: its kind, its ranks, its buffers, its BatchNorm "
                         "counters, BatchNorm layers still at their initial values on some ranks, and whether its "
                         "ranks agree. Reads lazily, writes nothing; exit 0 unless it cannot be read (2).",
                         epilog=_examples("inspect"))
    ins.add_argument("paths", nargs="+", metavar="PATH", help=where + " (one; diff compares several)")
    ins.add_argument("--json", action="store_true", help="one JSON object instead of text")
    ins.add_argument("--all", action="store_true", help="also print the per-buffer table")
    df = sub.add_parser("diff", parents=[common, check], formatter_class=_Formatter,
                        help="per buffer, whether the ranks of a checkpoint (or several files) agree; exit 1 if not",
                        description="Compare every buffer across the ranks of one checkpoint, or across several "
                        "files (each against the first). A buffer whose dtype differs (int64 -> float32) differs, "
                        "whatever its values. Exit 0 when all agree, 1 when something differs, 2 when a "
                        "checkpoint cannot be read or an --only pattern matches nothing.",
                        epilog=_examples("diff", more=(
                            ("zero-buffers diff train.pt export.safetensors", "a checkpoint against its export"),
                            ("zero-buffers diff demo --only '*running_*'", "the BatchNorm statistics only"))))
    df.add_argument("paths", nargs="+", metavar="PATH", help=where + "; several: each compared with the first")
    df.add_argument("--atol", type=float, default=0.0, help="tolerance (default 0: bitwise identical)")
    df.add_argument("--only", action="append", default=[], metavar="PATTERN",
                    help="compare only buffers whose name matches this glob (repeatable; one that matches "
                         "nothing is an error)")
    df.add_argument("--json", action="store_true", help="one JSON object, with one object per buffer")
    df.add_argument("--all", action="store_true", help="every row, also for models with many buffers")
    rp = sub.add_parser("repair", parents=[common], formatter_class=_Formatter,
                        help="write a copy where every rank holds the same buffers",
                        description="Write a copy of a per-rank checkpoint (DeepSpeed ZeRO-3, per-rank files) in "
                        "which every rank holds the same buffers: BatchNorm statistics merged exactly, other "
                        "buffers from one rank. With --dtypes-from, first cast every buffer back to the dtype a "
                        "training checkpoint holds it in (an export's int64 counters stored as float32), exactly or "
                        "not at all. The input is never written unless --in-place; a failed repair leaves nothing "
                        "behind.",
                        epilog=_examples("repair", more=(
                            ("zero-buffers repair demo --in-place", "replace the folder itself, atomically"),
                            ("zero-buffers repair export.bin --dtypes-from ckpt -o fixed.bin",
                             "an export's dtypes, as the training checkpoint holds them"))))
    rp.add_argument("path", metavar="PATH", help="the per-rank checkpoint to repair (a DeepSpeed ZeRO-3 folder or "
                    "a folder of per-rank files); with --dtypes-from also an export (one file or its folder)")
    rp.add_argument("-o", "--out", metavar="OUT", help="new folder (or, for one file, new file) for the repaired "
                    "copy (must not exist)")
    rp.add_argument("--in-place", action="store_true",
                    help="replace the input folder (one atomic exchange; a crash leaves the old or the new one)")
    rp.add_argument("--recover", action="store_true",
                    help="only clean up or restore what an interrupted repair of PATH left beside it, then stop")
    rp.add_argument("--policy", choices=["average", "broadcast"], default="average",
                    help="average: exact mixture of BatchNorm statistics, other buffers from --src (default); "
                         "broadcast: every buffer from --src")
    rp.add_argument("--src", type=int, default=0, help="rank whose buffers are taken (default 0)")
    rp.add_argument("--dtypes-from", metavar="TRAINING_CKPT", default=None,
                    help="cast every buffer whose dtype differs from this training checkpoint's back to its dtype, "
                         "exactly or not at all (an int64 counter an export stored as float32 comes back bit for "
                         "bit); PATH may then be one copy too: a zero_to_fp32 export file or folder, one state dict")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zero-buffers``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    own = args.commands.get(args.command, parser)  # a flag typo shows the command's usage, not the top level's
    if unknown:
        own.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 0
    if args.command in ("inspect", "diff", "repair"):
        return doctor(args, argv)
    if args.command == "example-checkpoint":
        return example(args)
    return repro(args, own)


def example(args: argparse.Namespace) -> int:
    """Write the example checkpoint; exit 2 when the folder is not empty or a rank fails."""
    from .doctor.example import ExampleError, write_example

    try:
        done = write_example(args.dir, args.kind, args.nproc, args.timeout)
    except ExampleError as e:
        print(f"zero-buffers example-checkpoint: {e}", file=sys.stderr)
        return 2
    print(done.format())
    return 0


def doctor(args: argparse.Namespace, argv: list[str]) -> int:
    """Run inspect / diff / repair: exit 0 when all agree (or the repair is written), 1 when buffers differ,
    2 when a checkpoint cannot be read or repaired."""
    from .doctor import _words
    from .doctor.repair import recover_checkpoint, repair_checkpoint
    from .doctor.report import checkpoint_report
    from .errors import ZeroBuffersError

    def refuse(message: str) -> int:
        print(f"zero-buffers {args.command}: {message}", file=sys.stderr)
        return 2

    if args.command == "inspect" and len(args.paths) > 1:
        again = list(argv)
        again[again.index("inspect")] = "diff"
        return refuse(f"takes one checkpoint, got {len(args.paths)} paths; diff compares several, each with the "
                      f"first:\n  zero-buffers {shlex.join(again)}")
    common = {"tag": args.tag, "trust_pickle": args.trust_pickle, "progress": args.progress}
    if args.command != "repair":
        common["verify"] = args.verify
    try:
        if args.command == "repair" and args.recover:
            if args.out is not None or args.in_place:
                return refuse("--recover does no repair; give it without -o and --in-place")
            done = recover_checkpoint(args.path)
            print("\n".join(done) if done else f"{args.path}: nothing to recover (no leftovers of an interrupted "
                                                "repair beside or inside it)")
            return 0
        if args.command == "repair":
            if (args.out is None) == (not args.in_place):
                return refuse("give exactly one of -o OUT (a new folder) and --in-place (or --recover)")
            result = repair_checkpoint(args.path, args.out, policy=args.policy, src=args.src,
                                       in_place=args.in_place, dtypes_from=args.dtypes_from, **common)
            print(result.format())
            return 0
        if args.command == "inspect":
            report = checkpoint_report(args.paths[0], **common)
        else:
            report = checkpoint_report(*args.paths, atol=args.atol, only=args.only, **common)
    except (ZeroBuffersError, OSError) as e:  # OSError: an output folder that cannot be made, a full disk ...
        return refuse(_words.error_text(e))
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    elif args.command == "inspect":
        text = report.format(full=args.all)
        for w in (*report.warnings, *report.dtype_warnings()):
            text = text.replace(str(w), _words.for_cli(w))
        print(text)
    else:
        print(report.heading())
        if not report.per_rank and len(report.sources) > 1:
            print("\n".join(f"  source {i}: {s}" for i, s in enumerate(report.sources)))
        if report.compared or args.all:
            print(report.table(full=args.all).replace("format(full=True)", "--all"))
        else:
            print(f"{report.verdict()}; --all lists them")
            print("\n".join(f"  {n}" for n in report.notes))
        for w in (*report.warnings, *report.dtype_warnings()):
            print(f"WARNING: {_words.for_cli(w)}")
    if args.command == "diff" and not report.compared:
        return 0
    return 0 if args.command == "inspect" or report.in_sync else 1


if __name__ == "__main__":
    sys.exit(main())
