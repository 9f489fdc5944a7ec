"""The zero-buffers CLI: list and run the bundled repro scripts on real ranks."""
from __future__ import annotations

import subprocess
import sys

import pytest

from zero_buffers import cli


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zero_buffers.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_list_names_every_repro_with_its_summary():
    out = _cli("list")
    assert out.returncode == 0
    assert set(cli.scripts(cli.repro_dir())) == {line.split()[0] for line in out.stdout.splitlines()}
    assert "buffers_diverge" in out.stdout and "diverge on sharded data" in out.stdout


@pytest.mark.parametrize("name,bugs,fixes", [("zero3_load_buffers", 3, 3), ("zero3_frozen_tokenizer", 1, 4),
                                             ("zero3_frozen_hf_accelerate", 3, 2)])
def test_zero3_repro_shows_every_bug_and_fix(name, bugs, fixes):
    out = _cli("repro", name, "--nproc", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith(("BUG", "FIX"))]
    assert "RESULT: all fixes hold" in out.stdout
    assert sum(r.startswith("BUG") for r in rows) == bugs and sum(r.startswith("FIX") for r in rows) == fixes
    assert all(r.rstrip().endswith("yes") for r in rows)


@pytest.mark.parametrize("nproc", [2, 4])
def test_buffers_diverge_shows_the_bug_and_each_fix(nproc):
    out = _cli("repro", "buffers_diverge", "--nproc", str(nproc))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = {line.split("  ")[0]: line for line in out.stdout.splitlines() if line.startswith(("BUG", "FIX"))}
    assert "RESULT: all fixes hold" in out.stdout and f"{nproc} ranks" in out.stdout
    bug = next(line for line in out.stdout.splitlines() if line.startswith("BUG"))
    assert "4/6" in bug and bug.rstrip().endswith("yes")
    fixes = [line for line in out.stdout.splitlines() if line.startswith("FIX")]
    assert len(fixes) == 2 and all("0/6" in f and f.rstrip().endswith("yes") for f in fixes) and lines


def test_unknown_repro_is_a_usage_error():
    out = _cli("repro", "no_such_script")
    assert out.returncode == 2 and "unknown repro 'no_such_script'" in out.stderr


@pytest.mark.parametrize("name,rows", [("zero3_frozen_hf_accelerate", 5), ("zero3_frozen_tokenizer", 5)])
def test_incident_1_repros_run_under_accelerate_launch_with_deepspeed_zero3(name, rows):
    out = _cli("repro", name, "--nproc", "2", "--launcher", "accelerate")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "--launcher accelerate" in out.stdout and "RESULT: all fixes hold" in out.stdout
    found = [line for line in out.stdout.splitlines() if line.startswith(("BUG", "FIX"))]
    assert len(found) == rows and all(r.rstrip().endswith("yes") for r in found)
