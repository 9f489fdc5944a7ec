"""The ddp_bn_checkpoint repro (incident 2 on the ResNet-34 architecture, --quick) through the CLI: the honest table."""
from __future__ import annotations

import re
import sys

from tests.helpers import run_cmd


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
