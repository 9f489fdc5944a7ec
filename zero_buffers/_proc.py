"""Private: run a launcher (torchrun, accelerate launch) so that a timeout leaves no rank process behind.

The launcher starts in its own session, so ``os.killpg`` reaches it and whatever stays in its group. torchrun
starts every rank in a session of its own (out of reach of that ``killpg``), so each run also tags the
environment it hands down with a unique variable, and the cleanup kills every process that carries it (Linux
``/proc``; elsewhere only the group is killed).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment holds ``tag=1`` (zombies show an empty environment)."""
    needle = f"{tag}=1".encode()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    pids = []
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _signal(fn, target: int) -> None:
    try:
        fn(target, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def local_launch(nproc: int, *program: str) -> list[str]:
    """The command that starts ``nproc`` local ranks of ``program`` (a script path and its arguments, or ``-m
    MODULE ...``) through ``_launch.py``, run by path: torchrun's variables, without its agent."""
    import sys
    from pathlib import Path

    return [sys.executable, str(Path(__file__).resolve().with_name("_launch.py")), str(nproc), *program]


def kill_tree(proc: subprocess.Popen, tag: str, wait: float = 10.0) -> None:
    """SIGKILL ``proc``'s process group, then every process tagged ``tag`` and the group of each."""
    mine = os.getpgrp()
    _signal(os.killpg, proc.pid)
    deadline = time.monotonic() + wait
    while (pids := _tagged(tag)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                group = os.getpgid(pid)
            except ProcessLookupError:
                continue
            if group not in (mine, 0, 1):
                _signal(os.killpg, group)
            _signal(os.kill, pid)
        time.sleep(0.05)


def run(cmd: Sequence[str], timeout: float | None, *, env: dict[str, str] | None = None,
        **popen_kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, timeout=timeout, ...)`` with the child in its own session; on timeout, on
    KeyboardInterrupt and after a normal exit, the child's group and all its tagged descendants are killed.

    Raises ``subprocess.TimeoutExpired`` (carrying whatever output was captured) once they are dead.
    """
    tag = f"ZERO_BUFFERS_RUN_{uuid.uuid4().hex}"
    env = dict(os.environ if env is None else env, **{tag: "1"})
    with subprocess.Popen(cmd, env=env, start_new_session=True, **popen_kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc, tag)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a pipe still held by something outside the tree
                out = err = None
            raise subprocess.TimeoutExpired(cmd, timeout or 0.0, out, err) from None
        finally:
            kill_tree(proc, tag)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
