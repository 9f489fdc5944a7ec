"""The ddp_bn_checkpoint repro (incident 2) through the CLI: a clear accuracy gap, and every fix closes it."""
from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import run_cmd


def _rows(stdout: str) -> dict[str, list[str]]:
    """Table rows by case: [kind, case, accuracy, gap, holds]."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith(("REF ", "BUG ", "FIX ")):
            cells = re.split(r"\s{2,}", line.strip())
            out[cells[1]] = cells
    return out


@pytest.mark.parametrize("nproc", [2, 4])
def test_default_checkpoint_loses_accuracy_and_every_fix_restores_it(nproc):
    out = run_cmd([sys.executable, "-m", "zero_buffers.cli", "repro", "ddp_bn_checkpoint", "--nproc", str(nproc),
                   "--timeout", "270"], timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT: all fixes hold" in out.stdout and f"{nproc} ranks" in out.stdout
    assert len(re.findall(r"step +\d+ .* distributed eval accuracy", out.stdout)) == 4
    rows = _rows(out.stdout)
    ref = float(rows["distributed eval during training (own shard, own stats)"][2])
    bug = rows["accelerator.save_state, default (rank 0's BN stats)"]
    assert ref >= 90 and bug[0] == "BUG" and float(bug[2]) <= ref - 5 and bug[-1] == "yes"
    fixes = [r for r in rows.values() if r[0] == "FIX"]
    assert {r[1] for r in fixes} >= {"average_bn_stats, then save_state", "recompute_bn_stats, then save_state",
                                     "sync_buffers_on_save(accelerator, 'average')",
                                     "sync_buffers(model, 'recompute') + torch.save"}
    for r in fixes:
        if r[2] == "n/a on gloo":
            assert r[1] == "SyncBatchNorm during training" and r[-1] == "n/a"
        else:
            assert float(r[2]) >= ref - 0.5 and r[-1] == "yes", r
