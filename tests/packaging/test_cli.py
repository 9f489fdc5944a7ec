"""The zero-buffers command speaks plainly: --version, a bare command's help, help for every argument, errors that say
what exists (an --only pattern or a --tag that matches nothing), "tensors" or "buffers" by what the file records, the
Python API naming Python arguments and the CLI naming flags, no exception class names; example-checkpoint writes a
checkpoint the doctor finds diverged; repro's time budgets and its summary in words (fake scripts of our own)."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

import zero_buffers as zb
from tests.doctor import files
from tests.helpers import run_cmd
from zero_buffers import cli


def _cli(*args: object, timeout: float = 120, **kw):
    return run_cmd([sys.executable, "-m", "zero_buffers.cli", *map(str, args)], timeout, **kw)


# -- help and version ------------------------------------------------------------------------------------------------

def test_version_prints_the_package_version():
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout == f"zero-buffers {zb.__version__}\n", out


def test_bare_command_prints_the_help_with_every_subcommand_and_an_example_of_each():
    out = _cli()
    assert out.returncode == 0 and out.stderr == "", out
    for name in ("example-checkpoint", "inspect", "diff", "repair", "list", "repro"):
        assert re.search(rf"^    {name}\b", out.stdout, re.M), name  # listed under commands
        assert re.search(rf"^  zero-buffers {name}\b", out.stdout, re.M), name  # and one example
    assert out.stdout.startswith("usage: zero-buffers")


def _parsers(parser: argparse.ArgumentParser):
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_argument_of_every_subcommand_has_help_and_no_rest_markup():
    seen = 0
    for prog, parser in _parsers(cli.build_parser()):
        for text in (parser.description, parser.epilog):
            assert text and "`" not in text and "::" not in text, (prog, text)
        for action in parser._actions:
            name = "/".join(action.option_strings) or action.dest
            if action.help == argparse.SUPPRESS:
                assert name == "--quick", f"{prog} {name}: hidden"  # the deprecated no-op alias only
                continue
            assert action.help and action.help.strip(), f"{prog} {name}: no help"
            assert "`" not in action.help and "::" not in action.help, (prog, name, action.help)
            for choice in getattr(action, "_choices_actions", ()):
                assert choice.help and "`" not in choice.help, (prog, choice.dest)
            seen += 1
        assert parser.format_help()
    assert seen > 30


# -- doctor messages -------------------------------------------------------------------------------------------------

def test_diff_only_matching_nothing_exits_2_naming_the_patterns_and_buffers_that_exist(tmp_path):
    ck = files.zero3(tmp_path / "ck")
    code, text, err = files.doctor("diff", ck, "--only", "*.runing_mean", "--only", "*.tagg")
    assert code == 2 and text == "", (code, text, err)
    assert "--only '*.runing_mean' --only '*.tagg' matched none of the 3 buffers" in err, err
    assert "bn.running_mean" in err and "bn.num_batches_tracked" in err
    with pytest.raises(zb.InvalidArgumentError, match=re.escape("only=['*.tagg'] matched none of the 3 buffers")):
        zb.checkpoint_report(ck, only="*.tagg")
    code, _, _ = files.doctor("diff", ck, "--only", "*.running_mean")
    assert code == 1


def test_unknown_tag_lists_the_tags_found(tmp_path):
    ck = files.zero3(tmp_path / "ck")
    shutil.copytree(ck / files.TAG, ck / "step4")
    code, _, err = files.doctor("inspect", ck, "--tag", "nope")
    assert code == 2 and f"--tag nope: there is no folder {ck / 'nope'}; the tags in {ck}: step4, step8" in err, err
    with pytest.raises(zb.CheckpointError, match=r"^tag='nope': there is no folder .*the tags in .*: step4, step8$"):
        zb.checkpoint_report(ck, tag="nope")


def test_diff_says_tensors_for_plain_state_dicts_and_buffers_for_zero3_with_the_parameters_not_compared(tmp_path):
    code, text, _ = files.doctor("diff", files.per_rank(tmp_path / "pt"))
    assert code == 1 and "2 of 5 tensors differ" in text and "do not record which entries are buffers" in text, text
    code, text, _ = files.doctor("diff", files.zero3(tmp_path / "z3"))
    assert code == 1 and "2 of 3 buffers differ (compared with rank 0, atol=0; 2 parameters not compared)" in text
    report = zb.checkpoint_report(tmp_path / "z3")
    assert (report.buffer_names, report.parameters, report.what) == (True, 2, "buffers")
    assert "2 parameters, not compared" in report.format()
    assert zb.checkpoint_report(tmp_path / "pt").what == "tensors"


def test_inspect_of_several_paths_is_refused_naming_the_diff_to_run(tmp_path):
    ck = files.per_rank(tmp_path / "pt")
    code, text, err = files.doctor("inspect", ck / "rank0.pt", ck / "rank1.pt", "--all")
    assert code == 2 and text == ""
    assert "zero-buffers inspect: takes one checkpoint, got 2 paths" in err
    assert f"\n  zero-buffers diff {ck / 'rank0.pt'} {ck / 'rank1.pt'} --all\n" in err, err


def _corrupt_pickle(path: Path) -> Path:
    """A torch zip archive whose data.pkl refers to a pickle memo entry it never made (torch raises KeyError: 101)."""
    torch.save({"bn.running_mean": torch.zeros(3)}, path)
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, b"\x80\x02h\x65." if name.endswith("data.pkl") else data)
    return path


def test_messages_name_no_exception_class_and_a_non_path_is_a_clear_type_error(tmp_path):
    bad = _corrupt_pickle(tmp_path / "bad.pt")
    with pytest.raises(zb.CheckpointError) as caught:
        zb.checkpoint_report(bad)
    message = str(caught.value)
    assert message.startswith(f"{bad}: ") and "refers to data it does not hold" in message, message
    torch.save({101: torch.zeros(3)}, tmp_path / "int_key.pt")
    with pytest.raises(zb.CheckpointError) as named:
        zb.checkpoint_report(tmp_path / "int_key.pt")
    assert "names an entry by the int 101" in str(named.value)
    for text in (message, str(named.value)):
        assert not re.search(r"\b[A-Z]\w*(Error|Exception)\b", text), text
    with pytest.raises(TypeError, match=r"^checkpoint_report\(\): path must be a checkpoint's path, a str or "
                                        r"os\.PathLike \(a file or folder\), got int 3$"):
        zb.checkpoint_report(3)
    with pytest.raises(TypeError, match=r"^checkpoint_report\(\): path 2 must be .* got NoneType None$"):
        zb.checkpoint_report(tmp_path, None)
    with pytest.raises(TypeError, match=r"^repair_checkpoint\(\): out must be .* got int 5$"):
        zb.repair_checkpoint(tmp_path, 5)


def test_the_python_api_names_arguments_and_the_cli_names_flags(tmp_path):
    ck = files.per_rank(tmp_path / "ck")
    (tmp_path / "taken").mkdir()
    with pytest.raises(zb.CheckpointError, match=r"already exists; .*with in_place=True\)$"):
        zb.repair_checkpoint(ck, tmp_path / "taken")
    code, _, err = files.doctor("repair", ck, "-o", tmp_path / "taken")
    assert code == 2 and err.rstrip().endswith("with --in-place)") and "in_place" not in err, err
    with pytest.raises(zb.InvalidArgumentError, match=r"give exactly one of out=\.\.\. \(a new folder\) and "
                                                      r"in_place=True"):
        zb.repair_checkpoint(ck)
    with pytest.raises(zb.InvalidArgumentError, match=r"^src must be a rank"):
        zb.repair_checkpoint(ck, tmp_path / "out", src=7)
    code, _, err = files.doctor("repair", ck, "-o", tmp_path / "out", "--src", "7")
    assert code == 2 and "--src must be a rank of the checkpoint (0..1), got 7" in err
    (tmp_path / ".ck.zb-repair-89abcdef").mkdir()  # what an interrupted repair leaves
    warning = " ".join(zb.checkpoint_report(ck).warnings)
    assert f"`zero_buffers.recover_checkpoint({str(ck)!r})`" in warning and "--recover" not in warning, warning
    code, text, _ = files.doctor("diff", ck)
    assert f"`zero-buffers repair {ck} --recover`" in text and "recover_checkpoint" not in text, text


# -- example-checkpoint ----------------------------------------------------------------------------------------------

def test_example_checkpoint_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "notes.txt").write_text("mine\n")
    out = _cli("example-checkpoint", tmp_path / "demo")
    assert out.returncode == 2 and "exists and is not empty; name a new folder (nothing was written)" in out.stderr
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == ["notes.txt"]


BN_DIFFER = ("0.running_mean", "0.running_var", "2.running_mean", "2.running_var")


def _in_process(capsys):
    """The doctor's commands through ``cli.main`` in this process (the installed command and its exit statuses are
    tested above; a subprocess per command cost a torch import each)."""
    def run(*args: object) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = cli.main([str(a) for a in args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)
    return run


@pytest.mark.parametrize("kind", [pytest.param("zero3", marks=pytest.mark.stack), "per-rank", "dcp"])
def test_example_checkpoint_is_one_the_doctor_finds_diverged_and_repairs(tmp_path, kind, capsys):
    demo, fixed = tmp_path / "demo", tmp_path / "fixed"
    doctor = _in_process(capsys)
    started = time.monotonic()
    out = _cli("example-checkpoint", demo, "--kind", kind, timeout=300)
    seconds = time.monotonic() - started
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(f"example-checkpoint --kind {kind}: {seconds:.1f} s")
    assert out.stdout.startswith(f"wrote {demo}: ") and "try next:\n  # " in out.stdout
    assert f"zero-buffers inspect {demo}" in out.stdout and f"zero-buffers diff {demo}" in out.stdout
    inspect = doctor("inspect", demo)
    assert inspect.returncode == 0, inspect.stderr
    diff = doctor("diff", demo)
    if kind == "dcp":  # one copy of each entry: which rank wrote each statistic, nothing per rank to compare
        assert "written by" in inspect.stdout and "one copy each: nothing to compare" in diff.stdout
        assert diff.returncode == 0
        repair = doctor("repair", demo, "-o", fixed)
        assert repair.returncode == 2 and "nothing to repair" in repair.stderr and not fixed.exists()
        return
    what = "buffers" if kind == "zero3" else "tensors"
    assert f"4 of {6 if kind == 'zero3' else 13} {what} differ" in inspect.stdout, inspect.stdout
    assert diff.returncode == 1, diff.stdout + diff.stderr
    differing = {line.split()[0] for line in diff.stdout.splitlines() if re.search(r"\sNO\s", line)}
    assert differing == set(BN_DIFFER), diff.stdout
    repair = doctor("repair", demo, "-o", fixed)
    assert repair.returncode == 0 and "2 BatchNorm layer(s) merged" in repair.stdout, repair.stdout + repair.stderr
    again = doctor("diff", fixed)
    assert again.returncode == 0 and "0 of" in again.stdout, again.stdout + again.stderr


# -- repro: time budgets and the summary -----------------------------------------------------------------------------

OK = '''"""Always holds (records its environment)."""
import json
import os
import pathlib

BUDGET_SECONDS = {"quick": 30, "full": 60}
if os.environ.get("RANK") == "0":
    keys = ["ZB_FULL", "ZB_VERBOSE", "ZB_QUICK", "TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS",
            "TRANSFORMERS_VERBOSITY", "DS_ACCELERATOR"]
    pathlib.Path(os.environ["ZB_TEST_DIR"], "env.json").write_text(json.dumps({k: os.environ.get(k) for k in keys}))
    print("RESULT: all fixes hold", flush=True)
'''
FAILS = '''"""A fix that does not hold."""
import os
import sys

if os.environ.get("RANK") == "0":
    print("RESULT: A FIX DOES NOT HOLD", flush=True)
sys.exit(1)
'''
CRASHES = '''"""Stops before its table."""
raise SystemExit("no table today")
'''
SLOW = '''"""Runs past its budget: each rank records its pid, then sleeps."""
import os
import pathlib
import time

BUDGET_SECONDS = {"quick": 3, "full": 100}
pathlib.Path(os.environ["ZB_TEST_DIR"], "pids", str(os.getpid())).touch()
time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


FIRST = '''"""Listed first, finishes last: writes a line on each stream after a while."""
import os
import pathlib
import sys
import time

if os.environ.get("RANK") == "0":
    time.sleep(4)
    print("A-OUT", flush=True)
    print("A-ERR", file=sys.stderr, flush=True)
    pathlib.Path(os.environ["ZB_TEST_DIR"], "a_end").write_text(repr(time.time()))
'''
SECOND = '''"""Listed second, done at once."""
import os
import pathlib
import sys
import time

if os.environ.get("RANK") == "0":
    pathlib.Path(os.environ["ZB_TEST_DIR"], "b_start").write_text(repr(time.time()))
    print("B-OUT", flush=True)
    print("B-ERR", file=sys.stderr, flush=True)
'''


@pytest.mark.parametrize("jobs", [1, 2])
def test_repros_run_side_by_side_with_their_output_in_the_listed_order(tmp_path, jobs):
    repro = tmp_path / "repro"
    repro.mkdir()
    (repro / "a_first.py").write_text(FIRST)
    (repro / "b_second.py").write_text(SECOND)
    env = dict(os.environ, ZERO_BUFFERS_REPRO_DIR=str(repro), ZB_TEST_DIR=str(tmp_path))
    out = _cli("repro", "--backend", "gloo", "--jobs", str(jobs), timeout=120, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("=== zero-buffers repro", "A-", "B-"))]
    assert [line.split()[2] if line.startswith("===") else line for line in lines] == [
        "repro", "A-OUT", "repro", "B-OUT"] and "a_first" in lines[0] and "b_second" in lines[2], out.stdout
    assert out.stderr.index("A-ERR") < out.stderr.index("B-ERR"), out.stderr
    overlapped = float((tmp_path / "b_start").read_text()) < float((tmp_path / "a_end").read_text())
    assert overlapped == (jobs == 2)  # with 2 jobs the second ran while the first slept


def test_budget_is_read_without_importing_the_script(tmp_path):
    (tmp_path / "a.py").write_text('raise SystemExit("imported!")\nBUDGET_SECONDS = {"quick": 120, "full": 900}\n')
    (tmp_path / "b.py").write_text('"""No budget."""\n')
    (tmp_path / "c.py").write_text('BUDGET_SECONDS = {"quick": "soon", "full": 9}\n')
    assert cli.budget(tmp_path / "a.py") == {"quick": 120, "full": 900}
    assert cli.budget(tmp_path / "b.py") is None and cli.budget(tmp_path / "c.py") is None
    assert cli.Limit.of(tmp_path / "a.py", "quick", None).seconds == 480
    assert cli.Limit.of(tmp_path / "a.py", "full", None).seconds == 3600
    assert cli.Limit.of(tmp_path / "b.py", "quick", None).seconds == 900
    assert cli.Limit.of(tmp_path / "a.py", "quick", 7.0) == cli.Limit(7.0, "--timeout 7")
    small = tmp_path / "d.py"
    small.write_text('BUDGET_SECONDS = {"quick": 5, "full": 10}\n')
    assert cli.Limit.of(small, "quick", None).seconds == 120  # max(120, 4 x budget)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_repro_summary_says_killed_failed_and_ok_in_words_and_the_killed_ranks_are_gone(tmp_path):
    repro = tmp_path / "repro"
    repro.mkdir()
    for name, text in (("a_ok", OK), ("b_fails", FAILS), ("c_crashes", CRASHES), ("d_slow", SLOW)):
        (repro / f"{name}.py").write_text(text)
    (tmp_path / "pids").mkdir()
    env = dict(os.environ, ZERO_BUFFERS_REPRO_DIR=str(repro), ZB_TEST_DIR=str(tmp_path),
               ZERO_BUFFERS_MIN_TIMEOUT="1")
    for k in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "DS_ACCELERATOR"):
        env.pop(k, None)
    env["TRANSFORMERS_VERBOSITY"] = "info"  # set by the user: kept
    out = _cli("repro", "--nproc", "2", "--backend", "gloo", timeout=240, env=env)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    summary = out.stdout.split("=== summary\n", 1)[1].splitlines()
    assert re.fullmatch(r"a_ok       ok \(\d+\.\d s\)", summary[0]), summary
    assert summary[1] == "b_fails    FAILED (exit 1): a fix did not hold, see its table above", summary
    assert summary[2].startswith("c_crashes  FAILED (exit 1): it stopped before its table, see its error above; "
                                 "rerun alone: zero-buffers repro c_crashes --backend gloo"), summary
    assert summary[3] == ("d_slow     KILLED after 12 s (its time budget, 4x its 3 s on an idle machine); rerun "
                          "alone: zero-buffers repro d_slow --backend gloo --timeout 60"), summary
    assert summary[4] == "3 of 4 did not pass: b_fails, c_crashes, d_slow"
    assert "d_slow did not finish within 12 s" in out.stderr
    pids = [int(p.name) for p in (tmp_path / "pids").iterdir()]
    assert len(pids) == 2 and not any(map(_alive, pids)), pids
    import json

    seen = json.loads((tmp_path / "env.json").read_text())
    assert seen == {"ZB_FULL": None, "ZB_VERBOSE": None, "ZB_QUICK": None, "TQDM_DISABLE": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "info", "DS_ACCELERATOR": "cpu"}

    out = _cli("repro", "a_ok", "--full", "--verbose", "--quick", timeout=120, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.rstrip().endswith("it ran and every fix held") and "(full run, at most 240 s)" in out.stdout
    assert "--quick is the default now and does nothing" in out.stderr
    seen = json.loads((tmp_path / "env.json").read_text())
    assert seen["ZB_FULL"] == "1" and seen["ZB_VERBOSE"] == "1" and seen["TQDM_DISABLE"] is None


def test_zb_full_and_zb_verbose_in_the_environment_mean_the_flags(tmp_path):
    # A caller's ZB_VERBOSE=1 reaches the script and keeps other libraries' output; ZB_FULL=1 picks the full
    # budget as --full does (the timeout would otherwise kill a full run at its quick budget).
    (tmp_path / "repro").mkdir()
    (tmp_path / "repro" / "envcheck.py").write_text(
        '"""prints its environment"""\nBUDGET_SECONDS = {"quick": 3, "full": 40}\nimport os\n'
        'if int(os.environ.get("RANK", 0)) == 0:\n'
        '    print("ENV", os.environ.get("ZB_FULL"), os.environ.get("ZB_VERBOSE"), os.environ.get("TQDM_DISABLE"))\n'
        '    print("RESULT: all fixes hold")\n')
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "ZB_FULL", "ZB_VERBOSE")}
    env.update(ZERO_BUFFERS_REPRO_DIR=str(tmp_path / "repro"), ZB_FULL="1", ZB_VERBOSE="1")
    out = _cli("repro", "envcheck", "--nproc", "2", "--backend", "gloo", timeout=120, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "ENV 1 1 None" in out.stdout and "(full run, at most 160 s)" in out.stdout, out.stdout


def test_repro_refuses_one_rank_and_a_flag_typo_shows_the_commands_usage():
    # every repro compares ranks: --nproc 1 used to run, then report FAILED; a typo showed the top-level usage
    out = _cli("repro", "buffers_diverge", "--nproc", "1", timeout=60)
    assert out.returncode == 2 and "--nproc must be >= 2" in out.stderr, out.stderr
    out = _cli("repro", "--nprc", "2", timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("usage: zero-buffers repro "), out.stderr
    assert "unrecognized arguments: --nprc" in out.stderr
    out = _cli("inspect", "--bogus", "x", timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("usage: zero-buffers inspect "), out.stderr


def test_list_shows_each_summary_whole():
    out = _cli("list", timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(s for s in out.stdout.splitlines() if s.startswith("moe_router_bias "))
    assert line.rstrip().endswith("against a single-process float64 run on the global batch."), line


def test_a_repro_needing_what_is_not_installed_is_skipped_with_the_reason(tmp_path, monkeypatch, capsys):
    # NEEDS names capabilities of zero_buffers._compat.versions; a missing one skips the script (exit 0, it never
    # starts), and the summary says what it needs and what is installed; a script that ran still counts
    from zero_buffers import cli
    from zero_buffers._compat import versions

    monkeypatch.setitem(versions.CAPABILITIES, "_test_absent",
                        versions.Capability("torch", "an API no torch has", "nothing", lambda: False))
    (tmp_path / "repro").mkdir()
    (tmp_path / "repro" / "needy.py").write_text(
        '"""needs what nobody has"""\nNEEDS = ("_test_absent",)\nraise SystemExit(3)\n')
    (tmp_path / "repro" / "plain.py").write_text(
        '"""runs"""\nimport os\nif int(os.environ.get("RANK", 0)) == 0:\n    print("RESULT: all fixes hold")\n')
    monkeypatch.setenv("ZERO_BUFFERS_REPRO_DIR", str(tmp_path / "repro"))
    assert cli.main(["repro", "--backend", "gloo"]) == 0
    out = capsys.readouterr().out
    assert (f"needy  skipped: it needs an API no torch has (tested on nothing); torch "
            f"{versions.version('torch')} is installed") in out, out
    assert out.rstrip().endswith("it ran and every fix held; 1 skipped: the installed versions lack what they "
                                 "need"), out
    assert cli.main(["repro", "needy", "--backend", "gloo"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("none ran; 1 skipped: the installed versions lack what they need")


def test_every_bundled_repro_needs_only_known_capabilities():
    # a NEEDS name that is not in the table would be ignored and the script run anyway: keep them in step
    from zero_buffers import cli
    from zero_buffers._compat import versions

    declared = {name: cli._literal(cli.repro_dir() / f"{name}.py", "NEEDS") for name in cli.scripts(cli.repro_dir())}
    needs = {name: value for name, value in declared.items() if value is not None}
    assert {"fsdp2_buffers", "fsdp2_loading", "moe_router_bias", "ema_codebook"} <= set(needs), needs
    for name, value in needs.items():
        assert isinstance(value, tuple) and set(value) <= set(versions.CAPABILITIES), (name, value)
