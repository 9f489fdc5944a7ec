"""Run a test body on N real gloo ranks, reusing long-lived rank workers across tests.

One spawned process and one task queue per rank, rendezvous through a FileStore, a deadline per call.
The first rank that raises fails the test at once with its traceback (peers blocked in a collective
are not waited for); a call past its deadline fails with every stalled rank's stack. After any failure
the pool is torn down and rebuilt on the next call. ``pytest.skip`` inside a body skips the test.

Bodies are module-level functions ``fn(rank, world_size, *args)``; their return values (anything
picklable, tensors included) come back as a list indexed by rank.

Fault-injection tests pass ``allow_dead=[r, ...]``: those ranks may die (``os._exit``) or stall for good.
The call returns once every other rank has answered, with ``None`` for each listed rank that has not;
listed ranks still running are killed, and the pool (whose process group has seen a fault) is rebuilt
on the next call. Every other failure (a rank raises, an unlisted rank dies, the deadline) still fails.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CTX = mp.get_context("spawn")


class RankFailure(AssertionError):
    """A rank raised, died, or a call overran its deadline."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, store_path: str, port: int, stack_path: str, tasks: Any, results: Any) -> None:
    """Rank main loop: join the group, then run tasks until told to stop."""
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), ZB_TEST_WORKER="1")
    import faulthandler
    faulthandler.register(signal.SIGUSR1, file=open(stack_path, "w"), all_threads=True)  # noqa: SIM115 - lives as long as the worker
    import datetime

    import torch
    import torch.distributed as dist

    from tests import leaks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results.put((0, rank, "ready", None))
    while True:
        task_id, payload = tasks.get()
        if task_id is None:
            break
        before = leaks.snapshot()
        try:
            fn, args, kwargs = pickle.loads(payload)
            value = fn(rank, world, *args, **kwargs)
            out = (task_id, rank, "ok", pickle.dumps(value))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            if type(e).__name__ == "Skipped":
                out = (task_id, rank, "skip", str(getattr(e, "msg", e)))
            else:
                out = (task_id, rank, "error", f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        left = leaks.leaked(before, leaks.snapshot())
        if left and out[2] != "error":  # the body changed a global the next test would inherit
            out = (task_id, rank, "error", f"LeakError: the test body left these changed: {', '.join(left)}")
        leaks.clear_caches()
        leaks.clear_deepspeed_init_leftovers()
        results.put(out)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class RankPool:
    """``world_size`` long-lived rank workers; ``run`` executes one body on all of them."""

    def __init__(self, world_size: int, start_timeout: float = 120.0):
        self.world_size = world_size
        self.start_timeout = start_timeout
        self._procs: list[Any] = []
        self._task_id = 0
        self.starts = 0

    # -- lifecycle -------------------------------------------------------------------------------------
    def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix=f"zb_pool{self.world_size}_")
        store, port = os.path.join(self._dir, "store"), _free_port()
        self._tasks = [_CTX.Queue() for _ in range(self.world_size)]
        self._results = _CTX.Queue()
        self._stacks = [os.path.join(self._dir, f"stack{r}.txt") for r in range(self.world_size)]
        self._procs = [
            _CTX.Process(target=_worker, args=(r, self.world_size, store, port, self._stacks[r], self._tasks[r],
                                               self._results), daemon=True, name=f"zb-rank{r}")
            for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self.starts += 1
        ready = set()
        deadline = time.monotonic() + self.start_timeout
        while len(ready) < self.world_size:
            msg = self._get(deadline, set(range(self.world_size)) - ready, "starting the rank pool")
            ready.add(msg[1])

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force)."""
        for q, p in zip(getattr(self, "_tasks", []), self._procs):
            if p.is_alive():
                try:
                    q.put((None, None))
                except Exception:  # noqa: BLE001
                    pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        self._procs = []
        self._remove_dir()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs = []
        self._remove_dir()

    def _remove_dir(self) -> None:
        """Delete this pool's FileStore and stack files (a rebuilt pool gets a fresh folder)."""
        if getattr(self, "_dir", None):
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    # -- running ---------------------------------------------------------------------------------------
    def _get(self, deadline: float, waiting: set[int], what: str) -> tuple:
        """Next result message; raise RankFailure on a dead rank or the deadline."""
        while True:
            try:
                return self._results.get(timeout=0.05)
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if r in waiting and not p.is_alive()]
            if dead:
                codes = {r: self._procs[r].exitcode for r in dead}
                self._kill()
                raise RankFailure(f"{what}: rank(s) {dead} died (exit codes {codes}) before answering")
            if time.monotonic() > deadline:
                stacks = self._dump_stacks(sorted(waiting))
                self._kill()
                raise RankFailure(f"{what}: deadline passed; rank(s) {sorted(waiting)} did not finish "
                                  f"(the pool was rebuilt).\n{stacks}")

    def _dump_stacks(self, ranks: list[int]) -> str:
        """Ask stalled ranks for their Python stacks (faulthandler on SIGUSR1)."""
        for r in ranks:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(0.5)
        parts = []
        for r in ranks:
            text = Path(self._stacks[r]).read_text(errors="replace")[-3000:] if os.path.exists(self._stacks[r]) else ""
            parts.append(f"--- stack of rank {r} ---\n{text}")
        return "\n".join(parts)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, allow_dead: Any = (),
            **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results by rank.

        Ranks in ``allow_dead`` may die or stall: they are not waited for (``None`` unless they answered
        first), are killed once the others have answered, and the pool is rebuilt on the next call.
        """
        import pytest

        allowed = frozenset(allow_dead)
        if not allowed < frozenset(range(self.world_size)):
            raise ValueError(f"allow_dead={sorted(allowed)} must be a proper subset of ranks 0..{self.world_size - 1}")
        if not self.alive:
            self._kill()
            self._start()
        self._task_id += 1
        tid = self._task_id
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((tid, payload))
        results: dict[int, Any] = {}
        skips: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        waiting = set(range(self.world_size))
        name = getattr(fn, "__name__", repr(fn))
        while waiting - allowed:
            try:
                _, rank, status, value = self._get(deadline, waiting - allowed, f"{name} on {self.world_size} ranks")
            except RankFailure:
                if skips:  # the skipping rank left its peers waiting in a collective
                    pytest.skip(next(iter(skips.values())))
                raise
            if _ != tid:
                continue  # a stale answer from an earlier, abandoned task
            waiting.discard(rank)
            if status == "error":
                for r in waiting:  # a peer that died is the cause, not the connection error it caused here
                    self._procs[r].join(timeout=0.2)
                dead = {r: self._procs[r].exitcode for r in sorted(waiting) if not self._procs[r].is_alive()}
                self._kill()
                cause = f"rank(s) {list(dead)} died (exit codes {dead}); then " if dead else ""
                raise RankFailure(f"{cause}rank {rank} of {self.world_size} raised in {name} (first failure; the "
                                  f"pool was rebuilt):\n{value}")
            if status == "skip":
                skips[rank] = value
                deadline = min(deadline, time.monotonic() + 5)
            else:
                results[rank] = pickle.loads(value)
        if allowed:
            self._kill()  # the process group saw a dead or stalled rank: rebuild the pool on the next call
        if skips:
            pytest.skip(next(iter(skips.values())))
        return [results.get(r) for r in range(self.world_size)]
