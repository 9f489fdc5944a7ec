"""The zero-buffers CLI's ``list`` and ``repro``: every bundled repro script runs on real ranks and shows each bug and
its fix, ``--timeout`` kills the launcher and every rank, and the ddp_bn_checkpoint repro (incident 2 on the
ResNet-34 architecture, ``--quick``) prints the honest table."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cmd
from zero_buffers import cli


def _cli(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """The CLI in its own session; a repro gets a ``--timeout`` 30 s under the test's so the CLI's own cleanup
    (kill the launcher's group and every rank) fires first."""
    if args[:1] == ("repro",) and "--timeout" not in args:
        args = (*args, "--timeout", f"{timeout - 30:g}")
    return run_cmd([sys.executable, "-m", "zero_buffers.cli", *args], timeout, **kw)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_list_names_every_repro_with_its_summary():
    out = _cli("list")
    assert out.returncode == 0
    assert set(cli.scripts(cli.repro_dir())) == {line.split()[0] for line in out.stdout.splitlines()}
    assert "buffers_diverge" in out.stdout and "diverge on sharded data" in out.stdout


@pytest.mark.parametrize("name,bugs,fixes", [("zero3_load_buffers", 4, 6), ("zero3_frozen_tokenizer", 1, 4),
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


def test_fsdp2_repro_shows_each_bug_and_its_fix():
    out = _cli("repro", "fsdp2_buffers", "--nproc", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith(("BUG", "FIX"))]
    assert "RESULT: all fixes hold" in out.stdout and "2 ranks" in out.stdout
    assert [r[:3] for r in rows] == ["BUG", "FIX"] * 5 and all(r.rstrip().endswith("yes") for r in rows)
    frozen = [r for r in rows if "all-gathers/forward" in r]
    assert "0 all-gathers" not in frozen[0] and "0 all-gathers" in frozen[1]


def test_ema_codebook_repro_shows_the_lost_updates_and_the_exact_fix():
    out = _cli("repro", "ema_codebook", "--nproc", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith(("BUG", "FIX", "REF"))]
    assert "RESULT: all fixes hold" in out.stdout and [r[:3] for r in rows] == ["BUG", "BUG", "FIX", "REF"]
    assert all(r.rstrip().endswith("yes") for r in rows[:3])


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


HANG = '''"""Hangs: each rank records its pid, then sleeps."""
import os
import pathlib
import time

pathlib.Path(os.environ["ZB_TEST_PIDS"], str(os.getpid())).touch()
time.sleep(600)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_timeout_kills_the_launcher_and_every_rank(tmp_path):
    (tmp_path / "repro").mkdir()
    (tmp_path / "repro" / "hang.py").write_text(HANG)
    (tmp_path / "pids").mkdir()
    env = dict(os.environ, ZERO_BUFFERS_REPRO_DIR=str(tmp_path / "repro"), ZB_TEST_PIDS=str(tmp_path / "pids"))
    out = _cli("repro", "hang", "--nproc", "2", "--timeout", "12", timeout=120, env=env)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "hang did not finish within 12 s" in out.stderr and "FAILED (exit 124)" in out.stdout
    pids = [int(p.name) for p in (tmp_path / "pids").iterdir()]
    assert len(pids) == 2 and not any(map(_alive, pids)), pids  # torchrun put each rank in its own session


def _rows(stdout: str) -> dict[tuple[str, str], list[str]]:
    """Table rows by (case, broadcast_buffers): [kind, case, broadcast, accuracy, vs oracle, vs default, holds]."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith(("REF ", "BUG ", "FIX ", "PART ", "SAME ")):
            cells = re.split(r"\s{2,}", line.strip())
            out[(cells[1].removesuffix(" (warned: nothing to merge)"), cells[2])] = cells
    return out


def test_resnet34_repro_quick_global_batch_recompute_reaches_the_oracle_and_averaging_identical_stats_says_so():
    out = run_cmd([sys.executable, "-m", "zero_buffers.cli", "repro", "ddp_bn_checkpoint", "--nproc", "2", "--quick",
                   "--timeout", "270"], timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT: all fixes hold" in out.stdout and "ResNet-34 (quick" in out.stdout and "2 ranks" in out.stdout
    rows = _rows(out.stdout)
    acc = {key: float(r[3]) for key, r in rows.items()}
    for b in ("False", "True"):
        oracle = acc[("oracle: population statistics (all data, one train-mode batch)", b)]
        default = acc[("save_state as is (rank 0's statistics)", b)]
        fix = rows[("recompute_bn_stats(global_batch=True)", b)]
        assert fix[0] == "FIX" and fix[-1] == "yes"
        assert abs(float(fix[3]) - oracle) <= 2 and float(fix[3]) >= default + 5
        assert oracle >= default + 5  # the default checkpoint (rank 0's statistics) clearly loses accuracy
    same = rows[("average_bn_stats / sync_buffers_on_save(acc, 'average')", "True")]
    assert same[0] == "SAME" and same[-1] == "yes" and "warned: nothing to merge" in out.stdout
    assert acc[("average_bn_stats / sync_buffers_on_save(acc, 'average')", "True")] == \
        acc[("save_state as is (rank 0's statistics)", "True")]
