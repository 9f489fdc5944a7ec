"""Private: start ``nproc`` local ranks of a script the way torchrun does for one node, without its agent.

Run by path (``python .../zero_buffers/_launch.py NPROC SCRIPT [ARGS...]``, or ``NPROC -m MODULE [ARGS...]``), so that
neither torch nor the package is imported here: torchrun's agent costs a torch import, a rendezvous and a wait at exit
per run, which on a busy 2-core machine was most of a quick repro's time. Each rank gets the ``env://`` variables
torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and this process's stdout and stderr. As torchrun does, when one rank fails the others are stopped
(SIGTERM, then SIGKILL after 5 s) and the exit status is the first failing rank's; SIGTERM or SIGINT here stops every
rank first. The ranks stay in this process's group and inherit its environment, so ``_proc.kill_tree`` reaches them as
it reaches torchrun's.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(ranks: list[subprocess.Popen], grace: float = 5.0) -> None:
    for p in ranks:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in ranks:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: _launch.py NPROC SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    nproc, script, args = int(argv[0]), argv[1], argv[2:]
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK="0", ROLE_WORLD_SIZE=str(nproc))
    base.setdefault("OMP_NUM_THREADS", "1")
    ranks: list[subprocess.Popen] = []

    def on_signal(signum: int, _frame: object) -> None:
        _stop(ranks)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for r in range(nproc):
        env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        ranks.append(subprocess.Popen([sys.executable, script, *args], env=env))
    while True:
        codes = [p.poll() for p in ranks]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            _stop(ranks)
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
