"""Crash injection: ``repair --in-place`` and ``repair -o`` killed with SIGKILL before each of their steps.

strace (``-e inject=SYSCALL:signal=KILL:when=N``) kills the CLI, a subprocess, at the N-th call of one syscall.
An untouched, traced run counts the calls; the sweep then kills at every mkdir, fsync, rename and renameat2 of
``repair --in-place`` (per-rank files) and every fsync and rename of ``repair -o``, one run per N = 1 .. count;
then the two-rename fallback (exchange refused) at each of its renames, a ZeRO-3-shaped folder at a few steps
(its deletions after the swap among them), and seeded random points among the file opens (file creation
included). 27 runs of about 2 s: about 60 s on two idle cores. After each kill:

- the checkpoint path holds the complete old or the complete new checkpoint, never a mixture, never missing
  (missing only between the fallback's two renames, and then the journal restores it);
- ``checkpoint_report`` (inspect / diff) warns about what was left, naming its state and the command to run, and
  changes nothing;
- the next ``repair`` cleans up or restores what was left, says so, and succeeds: the path then holds the
  repaired checkpoint and no hidden leftover remains beside it.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zero_buffers as zb
from tests.doctor import files
from tests.doctor.files import snapshot

STRACE = shutil.which("strace")
pytestmark = pytest.mark.skipif(STRACE is None, reason="strace is not installed: crash injection needs "
                                                        "strace -e inject=...:signal=KILL")
STEPS = ("mkdir", "fsync", "rename", "renameat2", "unlink", "unlinkat", "rmdir", "symlink")
NO_EXCHANGE = ("import sys; import zero_buffers.doctor._atomic as a; a.exchange = lambda x, y: False; "
               "from zero_buffers import cli; sys.exit(cli.main(sys.argv[1:]))")


def _cli(args: list[str], inject: str | None = None, no_exchange: bool = False, trace: Path | None = None
         ) -> subprocess.CompletedProcess:
    """The CLI in its own process under strace: SIGKILLed where ``inject`` says, or with ``trace`` every step and
    file open logged there."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")  # no .pyc renames among the counted syscalls
    py = [sys.executable, "-c", NO_EXCHANGE] if no_exchange else [sys.executable, "-m", "zero_buffers.cli"]
    traced = ",".join((*STEPS, "openat")) if trace else inject.split(":")[0] if inject else "fsync"
    cmd = [STRACE, "-f", "-qq", "-o", str(trace or os.devnull), "-e", f"trace={traced}"]
    if inject:
        cmd += ["-e", f"inject={inject}"]
    return subprocess.run([*cmd, "--", *py, *args], capture_output=True, text=True, timeout=120, env=env)


def _calls(trace: Path) -> list[str]:
    """The syscalls a trace logged, in order, without pid prefixes and split-call continuations."""
    out = []
    for line in trace.read_text().splitlines():
        line = re.sub(r"^\[pid +\d+\] |^\d+ +", "", line)
        if not line.startswith(("+++", "---", "<...")):
            out.append(line)
    return out


def _state(folder: Path) -> dict[str, object]:
    """What a checkpoint folder holds, comparable across writes: each .pt file's tensors (torch.save's bytes carry
    a random serialization id), every other file's bytes."""
    if not folder.is_dir():
        return {}
    out: dict[str, object] = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            key = str(p.relative_to(folder))
            if p.name.endswith("model_states.pt"):
                out[key] = {k: v.tolist() for k, v in torch.load(p, weights_only=True)["module"].items()}
            elif p.suffix == ".pt":
                obj = torch.load(p, weights_only=True)
                out[key] = {k: v.tolist() for k, v in obj.items()} if "bn.running_mean" in obj else p.read_bytes()
            else:
                out[key] = p.read_bytes()
    return out


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


class Kind:
    """A small checkpoint to repair, where its old and new states are, and where leftovers go."""

    def __init__(self, root: Path, name: str):
        self.root, self.name = root, name
        self.pristine = root / "pristine"
        if name == "zero3":
            files.zero3(self.pristine)
        else:
            files.per_rank(self.pristine)
        self.old = _state(self.pristine / files.TAG if name == "zero3" else self.pristine)
        done = root / "done"
        shutil.copytree(self.pristine, done)
        zb.repair_checkpoint(done, in_place=True)
        self.new = _state(done / files.TAG if name == "zero3" else done)
        assert self.new != self.old
        shutil.rmtree(done)

    def fresh(self, n: int) -> Path:
        """A new copy of the input, in a folder of its own (its parent holds nothing else)."""
        where = self.root / f"run{n}"
        where.mkdir()
        shutil.copytree(self.pristine, where / "ck")
        return where / "ck"

    def unit(self, ck: Path) -> Path:
        return ck / files.TAG if self.name == "zero3" else ck


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return Kind(tmp_path_factory.mktemp("crash_per_rank"), "per_rank")


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    return Kind(tmp_path_factory.mktemp("crash_zero3"), "zero3")


def _check_in_place_after_kill(kind: Kind, ck: Path, killed: bool, where: str) -> None:
    unit = kind.unit(ck)
    state = _state(unit)
    leftovers = _hidden(unit.parent)
    if not unit.exists():
        assert leftovers, f"{where}: the checkpoint is missing and nothing says where it went"
    else:
        assert state in (kind.old, kind.new), f"{where}: the checkpoint is neither the old nor the new one"
    if not killed:
        assert state == kind.new and not leftovers, where
    before = snapshot(ck.parent)
    try:
        report = zb.checkpoint_report(ck)
        warned = [w for w in report.warnings if "interrupted zero-buffers repair" in w]
        read_error = None
    except zb.CheckpointError as e:  # only when the fallback's two renames left the tag folder missing
        warned, read_error = re.findall(r"interrupted zero-buffers repair[^\n]*", str(e)), e
    assert bool(warned) == bool(leftovers), (where, leftovers, warned)
    if warned:
        assert f"zero_buffers.recover_checkpoint({str(ck)!r})" in warned[0], warned[0]  # the Python API's words
    assert read_error is None or not unit.exists(), (where, read_error)
    assert snapshot(ck.parent) == before, f"{where}: inspect wrote something"
    result = zb.repair_checkpoint(ck, in_place=True)
    assert bool(result.recovered) == bool(leftovers), (where, result.recovered)
    assert _state(unit) == kind.new, where
    assert _hidden(unit.parent) == [] and sorted(p.name for p in ck.parent.iterdir()) == ["ck"], where
    if state == kind.new and unit.exists():
        assert not result.written and "nothing to repair" in result.format(), where  # idempotent


def _traced(kind: Kind, args: list[str], n: int) -> list[str]:
    """One run, untouched, every step and file open logged: the syscalls it made, in order (its outcome checked)."""
    ck = kind.fresh(n)
    trace = ck.parent.parent / f"trace{n}.log"
    done = _cli(_args(args, ck), trace=trace)
    assert done.returncode == 0, done.stderr[-2000:]
    calls = _calls(trace)
    trace.unlink()
    _check(kind, ck, False, "untouched", args)
    return calls


@pytest.fixture(scope="module")
def in_place_calls(per_rank) -> list[str]:
    return _traced(per_rank, ["repair", "CK", "--in-place"], 0)


def _sweep(kind: Kind, args: list[str], first: int, calls: list[str], syscalls: tuple[str, ...]) -> int:
    """One run per step, killed at it: N = 1 .. the count of each syscall of ``syscalls`` among ``calls`` (an
    untouched run's). Checks every outcome; returns the number of kills."""
    counts = {name: sum(c.startswith(name + "(") for c in calls) for name in syscalls}
    kills = 0
    for name, count in counts.items():
        for n in range(1, count + 1):
            kills += 1
            ck = kind.fresh(first + kills)
            done = _cli(_args(args, ck), f"{name}:signal=KILL:when={n}")
            assert done.returncode == -9, (name, n, done.returncode, done.stderr[-2000:])  # the count held
            _check(kind, ck, True, f"killed at {name} #{n} of {count}", args)
    return kills


def _args(args: list[str], ck: Path) -> list[str]:
    return [a.replace("OUT", str(ck.parent / "out")).replace("CK", str(ck)) for a in args]


def _check(kind: Kind, ck: Path, killed: bool, where: str, args: list[str]) -> None:
    if "--in-place" in args:
        _check_in_place_after_kill(kind, ck, killed, where)
    else:
        _check_output_after_kill(kind, ck, killed, where)


def _check_output_after_kill(kind: Kind, ck: Path, killed: bool, where: str) -> None:
    out = ck.parent / "out"
    assert _state(kind.unit(ck)) == kind.old, f"{where}: -o changed its input"
    state = _state(kind.unit(out))
    assert state in ({}, kind.new), f"{where}: a partial output"
    leftovers = [n for n in _hidden(ck.parent) if n.startswith(".out.")]
    if not killed:
        assert state == kind.new and not leftovers, where
    if leftovers:
        with pytest.raises(zb.CheckpointError, match=r"interrupted zero-buffers repair.*recover_checkpoint\("):
            zb.checkpoint_report(out)  # out does not exist yet: the error says why, and what to run
    if state == kind.new:
        assert not leftovers, where
        return
    result = zb.repair_checkpoint(ck, out)
    assert bool(result.recovered) == bool(leftovers), where
    assert _state(kind.unit(out)) == kind.new and _hidden(ck.parent) == [], where


def test_in_place_killed_before_every_step_leaves_old_or_new_and_the_next_run_cleans_up(per_rank, in_place_calls):
    """Every mkdir, fsync and rename-family call (the deletions after the swap: a few in the zero3 test)."""
    kills = _sweep(per_rank, ["repair", "CK", "--in-place"], 0, in_place_calls, ("mkdir", "fsync", "rename",
                                                                                  "renameat2"))
    assert kills == 11  # 2 mkdir, 7 fsync (2 files, the copy, the journal, 3 of the parent), 2 renames


def test_in_place_with_the_two_rename_fallback_killed_between_the_renames_is_restored(per_rank):
    """Where the file system refuses RENAME_EXCHANGE: rename #1 commits the journal, #2 moves the input aside,
    #3 moves the copy in. Killed at #3 the path is missing; inspect says so and where the original is; the next
    repair renames it back first."""
    ck = per_rank.fresh(100)
    done = _cli(["repair", str(ck), "--in-place"], "rename:signal=KILL:when=3", no_exchange=True)
    assert done.returncode == -9, done.stderr
    assert not ck.exists() and any(n.startswith(".ck.zb-old-") for n in _hidden(ck.parent))
    with pytest.raises(zb.CheckpointError, match=r"stopped between its two renames.*original checkpoint is in "
                                                 r"\.ck\.zb-old-"):
        zb.checkpoint_report(ck)
    code, text, _ = files.doctor("repair", ck, "--recover")
    assert code == 0 and "renamed it back to ck" in text
    assert _state(ck) == per_rank.old and _hidden(ck.parent) == []
    for n in (1, 2):  # before the journal is committed; before the input is moved aside
        ck = per_rank.fresh(100 + n)
        done = _cli(["repair", str(ck), "--in-place"], f"rename:signal=KILL:when={n}", no_exchange=True)
        assert done.returncode == -9, done.stderr
        _check_in_place_after_kill(per_rank, ck, True, f"fallback, killed at rename #{n}")


def test_output_killed_before_every_step_leaves_nothing_or_the_whole_copy(per_rank):
    args = ["repair", "CK", "-o", "OUT"]
    kills = _sweep(per_rank, args, 200, _traced(per_rank, args, 200), ("fsync", "renameat2"))
    assert kills == 5  # 2 files, the copy's folder, the rename (RENAME_NOREPLACE), the parent


def test_zero3_in_place_and_random_points_among_file_opens(zero3, per_rank, in_place_calls):
    """A ZeRO-3-shaped folder (2 ranks, optimizer files copied), killed at a few of its steps, and per-rank files
    killed at seeded random file opens after the imports (creating the rank files and the journal among them)."""
    for k, (syscall, n) in enumerate((("fsync", 4), ("renameat2", 1), ("unlinkat", 3), ("unlink", 1))):
        ck = zero3.fresh(300 + k)
        done = _cli(["repair", str(ck), "--in-place"], f"{syscall}:signal=KILL:when={n}")
        assert done.returncode == -9, done.stderr
        _check_in_place_after_kill(zero3, ck, True, f"zero3 {syscall} #{n}")
    opens = [c for c in in_place_calls if c.startswith("openat(")]
    start = next(i for i, c in enumerate(opens) if "/run0/" in c)  # the imports are over by then
    for k, n in enumerate(sorted(random.Random(1234).sample(range(start + 1, len(opens) + 1), 2))):
        ck = per_rank.fresh(311 + k)
        done = _cli(["repair", str(ck), "--in-place"], f"openat:signal=KILL:when={n}")
        assert done.returncode == -9, done.stderr
        _check_in_place_after_kill(per_rank, ck, True, f"openat #{n} of {len(opens)}")


def test_the_swap_is_one_exchange_after_every_file_and_folder_is_fsynced(per_rank, in_place_calls):
    """The syscall order of an in-place repair: the rank files and the copy's folder fsynced, the journal made
    durable, one renameat2(RENAME_EXCHANGE), the parent fsynced before the old copy is deleted."""
    ck = per_rank.root / "run0" / "ck"
    calls = [c for c in in_place_calls if not c.startswith("openat(")]
    kinds = [c.split("(")[0] for c in calls]
    swap = next(i for i, c in enumerate(calls) if c.startswith("renameat2(") and "RENAME_EXCHANGE" in c)
    journal = next(i for i, c in enumerate(calls) if c.startswith("rename(") and ".ck.zb-journal\"" in c)
    assert kinds[:journal].count("fsync") >= 4  # two rank files, the copy's folder, the journal's own file
    assert journal < swap and kinds[journal + 1] == "fsync"  # the parent: the journal is durable before the swap
    assert kinds[swap + 1] == "fsync" and "unlinkat" in kinds[swap + 2:]  # durable before the old copy goes
    assert not any(c.startswith("rename(") and f'"{ck}"' in c for c in calls)  # no two-rename swap
