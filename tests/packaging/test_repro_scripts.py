"""The zero-buffers CLI's ``list`` and ``repro``: every bundled repro script runs on real ranks (its quick run, the
default) and shows each bug and its fix in a table with its title first and a legend, quietly (no other library's
DeepSpeed accelerator line, FutureWarning or progress bar unless ``ZB_VERBOSE=1``); each declares its
``BUDGET_SECONDS``; ``--timeout`` kills the launcher and every rank; the ddp_bn_checkpoint repro (incident 2 on the
ResNet-34 architecture, quick) prints the honest table."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cmd
from zero_buffers import cli

# Other libraries' known noise in a repro's output: DeepSpeed's accelerator line, FutureWarnings / DeprecationWarnings,
# tqdm progress bars (a carriage return, or "NN%|" once text mode turned the carriage returns into newlines).
NOISE = re.compile(r"Setting accelerator to CPU|FutureWarning|DeprecationWarning|\r|\d+%\|")
LEGEND = "as expected: BUG rows reproduce the failure without the fix"


def _cli(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """The CLI in its own session; a repro gets a ``--timeout`` 30 s under the test's so the CLI's own cleanup
    (kill the launcher's group and every rank) fires first."""
    if args[:1] == ("repro",) and "--timeout" not in args:
        args = (*args, "--timeout", f"{timeout - 30:g}")
    return run_cmd([sys.executable, "-m", "zero_buffers.cli", *args], timeout, **kw)


def _noise(out: subprocess.CompletedProcess) -> list[str]:
    """The lines of stdout and stderr that are other libraries' known noise."""
    return [line for line in (out.stdout + out.stderr).splitlines() if NOISE.search(line)]


def _shows_one_table(out: subprocess.CompletedProcess, name: str, launcher_lines: int = 0) -> None:
    """A passing run printed one table: its title before its column header, a BUG row before the first FIX row,
    the legend, one RESULT line, and none of other libraries' noise (``launcher_lines`` DeepSpeed accelerator lines
    may come from the launcher's own process)."""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    titles = [i for i, line in enumerate(lines) if line.startswith(f"{name}: ")]
    headers = [i for i, line in enumerate(lines) if " case " in line and line.rstrip().endswith("as expected")]
    assert len(titles) == 1 and len(headers) == 1 and titles[0] < headers[0], f"{name}: title, then table\n" + \
        out.stdout
    kinds = [line.split()[0] for line in lines[headers[0]:] if line.startswith(("BUG", "FIX"))]
    assert kinds and kinds[0] == "BUG" and "FIX" in kinds, f"{name}: BUG rows, then FIX rows: {kinds}"
    assert sum(line.startswith(LEGEND) for line in lines) == 1, f"{name}: no legend under the table\n" + out.stdout
    assert out.stdout.count("RESULT: ") == 1 and "RESULT: all fixes hold" in out.stdout
    noise = [line for line in _noise(out) if not (launcher_lines and "Setting accelerator to CPU" in line)]
    assert not noise, f"{name}: other libraries' noise in the output without ZB_VERBOSE: {noise}"
    assert sum("Setting accelerator to CPU" in line for line in _noise(out)) <= launcher_lines, _noise(out)


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
def test_zero3_repro_shows_every_bug_and_fix_quietly(name, bugs, fixes):
    out = _cli("repro", name, "--nproc", "2")
    _shows_one_table(out, name)
    rows = [line for line in out.stdout.splitlines() if line.startswith(("BUG", "FIX"))]
    assert "RESULT: all fixes hold" in out.stdout
    # DeepSpeed < 0.15 may leave zero.Init's __init__ on BatchNorm1d (which classes varies per process): one BUG row
    # and its FIX more, or an n/a row on 0.15+ and where no rank has it
    extra = int(any("keeps zero.Init's __init__" in r for r in rows))
    assert extra == 0 or name == "zero3_load_buffers", rows
    assert sum(r.startswith("BUG") for r in rows) == bugs + extra, rows
    assert sum(r.startswith("FIX") for r in rows) == fixes + extra, rows
    assert all(r.rstrip().endswith("yes") for r in rows)


@pytest.mark.parametrize("nproc", [2, 4])
def test_buffers_diverge_shows_the_bug_and_each_fix_title_first(nproc):
    out = _cli("repro", "buffers_diverge", "--nproc", str(nproc))
    _shows_one_table(out, "buffers_diverge")
    report = out.stdout.index("buffer_report of the BUG case")
    assert out.stdout.index("buffers_diverge: ") < out.stdout.index(LEGEND) < report < out.stdout.index("RESULT")
    assert "4 of 6 buffers differ across ranks" in out.stdout[report:]
    lines = {line.split("  ")[0]: line for line in out.stdout.splitlines() if line.startswith(("BUG", "FIX"))}
    assert "RESULT: all fixes hold" in out.stdout and f"{nproc} ranks" in out.stdout
    bug = next(line for line in out.stdout.splitlines() if line.startswith("BUG"))
    assert "4/6" in bug and bug.rstrip().endswith("yes")
    fixes = [line for line in out.stdout.splitlines() if line.startswith("FIX")]
    assert len(fixes) == 2 and all("0/6" in f and f.rstrip().endswith("yes") for f in fixes) and lines


def test_fsdp2_repro_shows_each_bug_and_its_fix():
    out = _cli("repro", "fsdp2_buffers", "--nproc", "2")
    _shows_one_table(out, "fsdp2_buffers")
    rows = [line for line in out.stdout.splitlines() if line.startswith(("BUG", "FIX"))]
    assert "RESULT: all fixes hold" in out.stdout and "2 ranks" in out.stdout
    assert [r[:3] for r in rows] == ["BUG", "FIX"] * 5 and all(r.rstrip().endswith("yes") for r in rows)
    frozen = [r for r in rows if "all-gathers/forward" in r]
    assert "0 all-gathers" not in frozen[0] and "0 all-gathers" in frozen[1]


def test_ema_codebook_repro_shows_the_lost_updates_and_the_exact_fix():
    out = _cli("repro", "ema_codebook", "--nproc", "2")
    _shows_one_table(out, "ema_codebook")
    rows = [line for line in out.stdout.splitlines() if line.startswith(("BUG", "FIX", "REF"))]
    assert "RESULT: all fixes hold" in out.stdout and [r[:3] for r in rows] == ["BUG", "BUG", "FIX", "REF"]
    assert all(r.rstrip().endswith("yes") for r in rows[:3])


def test_unknown_repro_is_a_usage_error():
    out = _cli("repro", "no_such_script")
    assert out.returncode == 2 and "unknown repro 'no_such_script'" in out.stderr


@pytest.mark.parametrize("name,rows", [("zero3_frozen_hf_accelerate", 5), ("zero3_frozen_tokenizer", 5)])
def test_incident_1_repros_run_under_accelerate_launch_with_deepspeed_zero3(name, rows):
    out = _cli("repro", name, "--nproc", "2", "--launcher", "accelerate")
    _shows_one_table(out, name, launcher_lines=1)  # accelerate launch imports DeepSpeed in its own process too
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
@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_timeout_kills_the_launcher_and_every_rank(tmp_path, launcher):
    (tmp_path / "repro").mkdir()
    (tmp_path / "repro" / "hang.py").write_text(HANG)
    (tmp_path / "pids").mkdir()
    env = dict(os.environ, ZERO_BUFFERS_REPRO_DIR=str(tmp_path / "repro"), ZB_TEST_PIDS=str(tmp_path / "pids"))
    out = _cli("repro", "hang", "--nproc", "2", "--timeout", "12", "--launcher", launcher, timeout=120, env=env)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "hang did not finish within 12 s" in out.stderr and "KILLED after 12 s (--timeout 12)" in out.stdout
    pids = [int(p.name) for p in (tmp_path / "pids").iterdir()]
    assert len(pids) == 2 and not any(map(_alive, pids)), pids  # torchrun put each rank in its own session


RANKS = '''"""Each rank writes what torchrun would tell it; rank 1 fails with 3 if ZB_TEST_FAIL is set, rank 0 waits."""
import json
import os
import pathlib
import time

keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
out = pathlib.Path(os.environ["ZB_TEST_PIDS"])
(out / f"{os.environ['RANK']}.json").write_text(json.dumps({k: os.environ.get(k) for k in keys} | {"pid": os.getpid()}))
if os.environ.get("ZB_TEST_FAIL"):
    if os.environ["RANK"] == "1":
        raise SystemExit(3)
    time.sleep(600)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_local_launcher_sets_torchruns_variables_and_one_failing_rank_stops_the_others():
    import json
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as tmp:
        script, pids = Path(tmp, "ranks.py"), Path(tmp, "pids")
        script.write_text(RANKS)
        pids.mkdir()
        cmd = cli.launch_command(script, 3, "local")
        env = dict(os.environ, ZB_TEST_PIDS=str(pids))
        assert subprocess.run(cmd, env=env, timeout=120).returncode == 0
        seen = [json.loads((pids / f"{r}.json").read_text()) for r in range(3)]
        port = seen[0]["MASTER_PORT"]
        for r, vars_ in enumerate(seen):
            assert vars_ | {"pid": 0} == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3",
                                         "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                         "MASTER_PORT": port, "pid": 0}, vars_
        started = time.monotonic()
        done = subprocess.run(cmd, env=dict(env, ZB_TEST_FAIL="1"), timeout=120)
        assert done.returncode == 3 and time.monotonic() - started < 60  # rank 1's status; rank 0 did not sleep on
        assert not any(_alive(json.loads((pids / f"{r}.json").read_text())["pid"]) for r in range(3))


def _rows(stdout: str) -> dict[tuple[str, str], list[str]]:
    """Table rows by (case, broadcast_buffers): [kind, case, broadcast, accuracy, vs oracle, vs default, holds]."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith(("REF ", "BUG ", "FIX ", "PART ", "SAME ")):
            cells = re.split(r"\s{2,}", line.strip())
            out[(cells[1].removesuffix(" (warned: nothing to merge)"), cells[2])] = cells
    return out


def test_resnet34_repro_quick_by_default_global_recompute_reaches_the_oracle_and_averaging_same_stats_says_so():
    out = run_cmd([sys.executable, "-m", "zero_buffers.cli", "repro", "ddp_bn_checkpoint", "--nproc", "2",
                   "--timeout", "270"], timeout=300)
    _shows_one_table(out, "ddp_bn_checkpoint")
    assert "ResNet-34 (quick" in out.stdout and "2 ranks" in out.stdout
    rows = _rows(out.stdout)
    acc = {key: float(r[3]) for key, r in rows.items()}
    for b in ("False", "True"):
        oracle = acc[("oracle: population statistics (all data, one train-mode batch)", b)]
        default = acc[("save_state as is (rank 0's statistics)", b)]
        fix = rows[("recompute_bn_stats(global_batch=True)", b)]
        assert fix[0] == "FIX" and fix[-1] == "yes"
        assert abs(float(fix[3]) - oracle) <= 2 and float(fix[3]) >= default + 5
        assert oracle >= default + 5  # the default checkpoint (rank 0's statistics) clearly loses accuracy
        assert rows[("save_state as is (rank 0's statistics)", b)][-1] == "yes"  # the BUG row: reproduced
    # the incident: with broadcast off the distributed eval during training (each rank its own site) looked fine
    assert acc[("distributed eval during training (own site, the statistics each rank holds)", "False")] >= \
        acc[("save_state as is (rank 0's statistics)", "False")] + 5
    same = rows[("average_bn_stats / sync_buffers_on_save(acc, 'average')", "True")]
    assert same[0] == "SAME" and same[-1] == "yes" and "warned: nothing to merge" in out.stdout
    assert acc[("average_bn_stats / sync_buffers_on_save(acc, 'average')", "True")] == \
        acc[("save_state as is (rank 0's statistics)", "True")]


def test_every_repro_declares_its_budget_for_the_quick_and_the_full_run():
    """``BUDGET_SECONDS = {"quick": int, "full": int}``, a literal the CLI reads with ast (its timeout)."""
    for name in cli.scripts(cli.repro_dir()):
        tree = ast.parse((cli.repro_dir() / f"{name}.py").read_text())
        found = [node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "BUDGET_SECONDS" for t in node.targets)]
        assert len(found) == 1, f"{name}.py: no top-level BUDGET_SECONDS"
        budget = ast.literal_eval(found[0])
        assert set(budget) == {"quick", "full"} and all(isinstance(v, int) and v > 0 for v in budget.values()), \
            f"{name}.py: BUDGET_SECONDS = {budget!r}"
        assert budget["quick"] <= budget["full"], f"{name}.py: the quick run's budget exceeds the full run's"


def _in_repro_dir(code: str, unset: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with the repro folder first on sys.path (as a running repro script has it),
    the variables in ``unset`` removed from its environment and ``env`` added."""
    prelude = f"import sys; sys.path.insert(0, {str(cli.repro_dir())!r})\n"
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    out = run_cmd([sys.executable, "-c", prelude + code], 120, env={**environ, **env})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_quick_is_the_default_and_zb_full_selects_the_full_width_ddp_run():
    code = "import ddp_bn_checkpoint as d; print(d.WIDTHS, d.BATCH, d.BN_MOMENTUM)"
    unset = ("ZB_FULL", "ZB_QUICK")
    assert _in_repro_dir(code, unset).stdout.split("\n")[0] == "[16, 32, 64, 128] 32 0.3"
    assert _in_repro_dir(code, unset, ZB_QUICK="1").stdout.split("\n")[0] == "[16, 32, 64, 128] 32 0.3"
    assert _in_repro_dir(code, unset, ZB_FULL="1").stdout.split("\n")[0] == "[64, 128, 256, 512] 16 None"


QUIET = """
import _common, warnings
import zero_buffers as zb
_common.quiet()
torch_warns = compile("import warnings; warnings.warn('old torch API', FutureWarning)", "torch_mod", "exec")
exec(torch_warns, {"__name__": "torch.distributed.c10d_logger"})  # a FutureWarning issued inside torch
exec(compile("import warnings; warnings.warn('old DeepSpeed API', FutureWarning)", "ds_mod", "exec"),
     {"__name__": "deepspeed.runtime.zero"})
exec(compile("import warnings, zero_buffers as zb; warnings.warn(zb.ZeroBuffersWarning('ours'))", "zb_mod", "exec"),
     {"__name__": "zero_buffers.bn.average"})
exec(compile("import warnings; warnings.warn('our deprecation', FutureWarning)", "zb_mod2", "exec"),
     {"__name__": "zero_buffers.sync"})
import os
print(os.environ.get("TQDM_DISABLE"), os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"), os.environ.get("DS_ACCELERATOR"))
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_quiet_hides_other_libraries_deprecations_and_bars_but_never_zero_buffers_warnings(verbose):
    import torch

    out = _in_repro_dir(QUIET, ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "DS_ACCELERATOR", "ZB_VERBOSE"),
                        **({"ZB_VERBOSE": "1"} if verbose else {}))
    assert "ZeroBuffersWarning: ours" in out.stderr and "FutureWarning: our deprecation" in out.stderr
    assert ("old torch API" in out.stderr) == verbose and ("old DeepSpeed API" in out.stderr) == verbose
    ds = "cpu" if not torch.cuda.is_available() else "None"  # DeepSpeed finds a GPU itself, without a warning
    assert out.stdout.split() == (["None", "None", "None"] if verbose else ["1", "1", ds])


def test_zb_verbose_keeps_other_libraries_noise():
    """The same script as above with ZB_VERBOSE=1: DeepSpeed's accelerator line (on each rank), torch's
    FutureWarning and transformers' progress bars are back, which is what the quiet runs above do not show."""
    out = _cli("repro", "zero3_frozen_hf_accelerate", "--nproc", "2", env={**os.environ, "ZB_VERBOSE": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    import torch

    noise = "\n".join(_noise(out))
    assert "FutureWarning" in noise and "%|" in noise, noise
    assert noise.count("Setting accelerator to CPU") == (0 if torch.cuda.is_available() else 2), noise


def test_moe_router_bias_repro_shows_no_update_diverged_biases_doubled_counts_and_the_exact_fix():
    out = _cli("repro", "moe_router_bias", "--nproc", "2")
    _shows_one_table(out, "moe_router_bias")
    rows = [line for line in out.stdout.splitlines() if line.startswith(("BUG", "FIX", "REF"))]
    assert [r[:3] for r in rows] == ["BUG", "BUG", "BUG", "FIX", "REF"]
    assert all(r.rstrip().endswith("yes") for r in rows[:4])


def _cells(stdout: str) -> list[list[str]]:
    """The BUG / FIX / n/a rows of a table, split into cells (two spaces or more apart)."""
    return [re.split(r"\s{2,}", line.strip()) for line in stdout.splitlines()
            if line.startswith(("BUG ", "FIX ", "n/a "))]


LOADS = ["set_model_state_dict(broadcast_from_rank0)", "dcp.load (get/set_model_state_dict)",
         "Accelerate fsdp2_load_full_state_dict", "hand-written loop over parameters"]


@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp2_loading_repro_shows_each_loads_wrong_buffers_and_tokens_then_the_fixes_matching_the_plain_model(nproc):
    out = _cli("repro", "fsdp2_loading", "--nproc", str(nproc))
    _shows_one_table(out, "fsdp2_loading")
    assert f"fsdp2_loading: {nproc} ranks" in out.stdout
    plain = re.search(r"plain model, one process: llama ([\d ]+); resnet ([\d ]+)", out.stdout)
    assert plain, out.stdout
    want = {"llama": plain.group(1).strip(), "resnet": plain.group(2).strip()}
    everyone = "0,1: " if nproc == 2 else f"0-{nproc - 1}: "
    rows, bugs = _cells(out.stdout), {}
    for kind, case, model, differing, worst, nans, output, held in rows:
        if kind == "BUG":
            bugs[case, model] = (differing, output)
            assert held == "yes" and (differing.startswith("load raised") or " on meta (rank" in differing
                                      or not differing.startswith("0/")), (case, model, differing)
        elif kind == "FIX":
            assert held == "yes" and differing.startswith("0/") and worst == "0" and nans == "0", (case, model)
            assert output == everyone + want[model], (case, model, output)  # every rank: the plain model's output
        else:
            assert (kind, held, output) == ("n/a", "n/a", everyone + want[model]) and model == "resnet", case
    # what each load leaves wrong, by model (rank 0 always right; every other rank wrong)
    for case in LOADS[:2]:
        differing, output = bugs[case, "llama"]
        assert differing == "2/2" and output.startswith(f"0: {want['llama']} | "), (case, output)  # inv_freq x2
        assert want["llama"] not in output.split(" | ", 1)[1], (case, output)  # the other ranks generate other text
    assert bugs[LOADS[2], "llama"][0] == bugs[LOADS[3], "llama"][0] == \
        f"{2 * (nproc - 1)} on meta (rank{'s' if nproc > 2 else ''} {'1' if nproc == 2 else f'1-{nproc - 1}'})"
    assert bugs[LOADS[2], "resnet"] == (f"load raised on {nproc}/{nproc} ranks",
                                        "AttributeError: 'Tensor' object has no attribute 'device_mesh'")
    assert bugs[LOADS[3], "resnet"][0].startswith(f"{12 * (nproc - 1)} on meta")
    assert set(bugs) == {(c, "llama") for c in LOADS} | {(c, "resnet") for c in LOADS[2:]}
    fixes = [(r[1], r[2]) for r in rows if r[0] == "FIX"]
    assert len(fixes) == 9 and sum("zb.install()" in c for c, _ in fixes) == 4, fixes


def test_fsdp2_loading_repro_exits_1_naming_each_fix_row_when_the_fixes_are_taken_out(tmp_path):
    """The script with its two fixes removed (install() made a no-op context, the one line a no-op), from a copy of
    the repro folder: every FIX row reads NO, the RESULT line names them, the CLI exits 1."""
    import shutil

    folder = tmp_path / "repro"
    shutil.copytree(cli.repro_dir(), folder, ignore=shutil.ignore_patterns("__pycache__"))
    script = folder / "fsdp2_loading.py"
    text = script.read_text()
    line = 'if fix == "line":\n            '
    fixes = ('zb.install() if fix == "install"', line + "zb.broadcast_buffers(model, materialize=True)")
    assert all(text.count(f) == 1 for f in fixes), "the fixes are no longer where this test takes them out"
    script.write_text(text.replace(fixes[0], 'contextlib.nullcontext() if fix == "install"')
                      .replace(fixes[1], line + "pass"))
    out = _cli("repro", "fsdp2_loading", "--nproc", "2", env={**os.environ, "ZERO_BUFFERS_REPRO_DIR": str(folder)})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _cells(out.stdout)
    assert [r[-1] for r in rows if r[0] == "FIX"] == ["NO"] * 9 and all(r[-1] == "yes" for r in rows if r[0] == "BUG")
    result = next(line for line in out.stdout.splitlines() if line.startswith("RESULT: "))
    assert result.startswith("RESULT: NOT AS EXPECTED: ") and result.count("(fix does not hold)") == 9, result
    assert "fsdp2_loading  FAILED (exit 1): a fix did not hold" in out.stdout
