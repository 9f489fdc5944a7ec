"""What the library itself writes on stderr: its warnings once per job (the group's first rank) without a collective,
and progress reports that never write a carriage return where stderr is not a terminal.

Warnings are captured on every rank of real gloo groups (2 and 4 ranks, and the subgroup [1, 3] of 4, whose first
rank is global rank 1). Progress runs in a subprocess whose stderr is a file, a pipe or a pseudo-terminal: the real
``recompute_bn_stats``, ``sync_buffers(policy="recompute")``, ``checkpoint_report`` and ``repair_checkpoint`` with
every ``progress=`` value."""
from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
import termios
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import bn_net, log_collectives, restore_collectives

ROOT = Path(__file__).resolve().parents[2]


# ---- warnings: once per job ----------------------------------------------------------------------------------------
def _same_stats_model() -> nn.Module:
    """The same BatchNorm statistics on every rank, trained (counters > 0): averaging them changes nothing."""
    model = bn_net()
    torch.manual_seed(7)
    model(torch.randn(8, 3))
    return model


def _warnings_by_rank(rank, world, members):
    """Every warning source the library has on a group, run with every rank recording: the messages this rank saw."""
    from zero_buffers._core import group as _group, notice as _notice

    group = dist.new_group(members) if members is not None else None  # every rank calls new_group
    inside = members is None or rank in members
    seen: dict[str, list[str]] = {}
    calls = {
        "average_bn_stats, every rank already the same": lambda: zb.average_bn_stats(_same_stats_model(), group=group),
        "sync_buffers average, every rank already the same":
            lambda: zb.sync_buffers(_same_stats_model(), "average", group=group),
        "a rule that matches nothing": lambda: zb.sync_buffers(bn_net(), rules={"*.nowhere": "max"}, group=group),
        "keep_in_sync, a rule that matches nothing":
            lambda: zb.keep_in_sync(bn_net(), rules={"*.nowhere.either": "max"}, group=group).remove(),
    }
    for what, call in calls.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        seen[what] = [str(w.message) for w in caught if issubclass(w.category, zb.ZeroBuffersWarning)]
    log: list = []
    real = log_collectives(log)
    try:  # the helper itself decides from this rank's number: no collective, members and non-members alike
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _notice.warn("the helper, with the call's group", group=group)
            if inside and group is not None:
                _notice.warn("the helper, with the resolved group", group=_group.resolve(group, "t"))
    finally:
        restore_collectives(real)
    seen["helper"] = [str(w.message) for w in caught]
    return seen, log


def _check_once(out, first: int, members=None):
    world = len(out)
    for what in out[first][0]:
        said = [r for r in range(world) if out[r][0][what]]
        assert said == [first], f"{what}: warned on rank(s) {said}, expected only rank {first}"
        if what != "helper":
            assert len(out[first][0][what]) == 1, (what, out[first][0][what])
    assert "matches no buffer" in out[first][0]["a rule that matches nothing"][0]
    assert "already held the same BatchNorm statistics" in out[first][0][
        "average_bn_stats, every rank already the same"][0]
    assert "already held the same" in out[first][0]["sync_buffers average, every rank already the same"][0]
    assert "'*.nowhere.either' matches no buffer" in out[first][0]["keep_in_sync, a rule that matches nothing"][0]
    assert all(log == [] for _, log in out), [log for _, log in out]  # warning added no collective


def test_the_librarys_warnings_are_said_once_per_job_by_the_first_rank(ranks):
    out = ranks.run(_warnings_by_rank, None, timeout=120)
    _check_once(out, 0)
    assert out[0][0]["helper"] == ["the helper, with the call's group"]


def test_on_a_subgroup_the_warnings_come_from_its_first_rank_not_global_rank_0(ranks4):
    out = ranks4.run(_warnings_by_rank, [1, 3], timeout=120)
    _check_once(out, 1)
    assert out[1][0]["helper"] == ["the helper, with the call's group", "the helper, with the resolved group"]


def test_without_a_process_group_the_warnings_still_show():
    from zero_buffers._core import notice as _notice

    assert not dist.is_initialized()
    _notice._SEEN.clear()
    try:
        with pytest.warns(zb.ZeroBuffersWarning, match="without a torch.distributed process group"):
            zb.average_bn_stats(bn_net())
        with pytest.warns(zb.ZeroBuffersWarning, match="'[*].nowhere' matches no buffer"):
            zb.sync_buffers(bn_net(), rules={"*.nowhere": "max"})
        with pytest.warns(zb.ZeroBuffersWarning, match="plain"):
            _notice.warn("plain")
        with pytest.warns(zb.ZeroBuffersWarning, match="once"):
            _notice.warn("once", once="test:once")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _notice.warn("once", once="test:once")  # the once-per-process dedup is kept
    finally:
        _notice._SEEN.clear()


# ---- progress: never a carriage return off a terminal ----------------------------------------------------------------
_SCRIPT = r'''
import sys, warnings
from pathlib import Path
import torch
from torch import nn
import zero_buffers as zb
from zero_buffers._core import notice

warnings.simplefilter("ignore")
if sys.argv[2] != "default":
    notice.LINE_SECONDS = float(sys.argv[2])
folder, out = Path(sys.argv[1]) / "ckpt", Path(sys.argv[1]) / "repaired"
folder.mkdir()
for r in range(8):  # 8 rank files (a default bar on a terminal), 60 buffers (a "comparing" report when asked)
    torch.save({f"m{i}.codebook": torch.full((3,), float(r + i)) for i in range(60)}, folder / f"rank{r}.pt")
torch.manual_seed(0)
data = [torch.randn(8, 3) for _ in range(5)]

def net():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))

calls = {
    "recompute_bn_stats": lambda p: zb.recompute_bn_stats(net(), data, progress=p),
    "sync_buffers": lambda p: zb.sync_buffers(net(), "recompute", data=data, progress=p),
    "checkpoint_report": lambda p: zb.checkpoint_report(folder, progress=p),
    "repair_checkpoint": lambda p: zb.repair_checkpoint(folder, out / str(p), policy="broadcast", progress=p),
}
for value in (None, False, True):
    for name, call in calls.items():
        sys.stderr.write(f"=== {name} progress={value}\n")
        sys.stderr.flush()
        call(value)
sys.stderr.write("=== end\n")
'''
_CALLS = ("recompute_bn_stats", "sync_buffers", "checkpoint_report", "repair_checkpoint")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1"}


def _sections(text: str) -> dict[str, str]:
    """stderr cut at the script's markers: {'recompute_bn_stats progress=True': what that call wrote}."""
    out = {}
    for part in text.split("=== ")[1:]:
        title, _, body = part.partition("\n")
        out[title] = body
    assert "end" in out, text[-2000:]
    return out


def _run(tmp_path: Path, stderr, every: str = "default") -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path), every], stderr=stderr,
                          stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, getattr(done, "stderr", b"")[-3000:]


def _check_lines(parts: dict[str, str], every_update: bool) -> None:
    for name in _CALLS:
        for value in (None, False):  # not a terminal: None reports nothing, False never does
            assert parts[f"{name} progress={value}"] == "", (name, value, parts[f"{name} progress={value}"])
    recompute = parts["recompute_bn_stats progress=True"].splitlines()
    assert recompute[-1].startswith("recompute_bn_stats: 5 batches in "), recompute
    if every_update:  # LINE_SECONDS 0: a line per batch, then the last one
        assert recompute[:5] == [f"recompute_bn_stats: {k}/5 batches ({20 * k}%), " + line.rsplit(", ", 1)[1]
                                 for k, line in zip(range(1, 6), recompute)], recompute
        assert len(recompute) == 6
    else:  # the default 10 s: a quick call writes its last line only
        assert len(recompute) == 1, recompute
    assert parts["sync_buffers progress=True"].splitlines()[-1].startswith("recompute_bn_stats: 5 batches in ")
    report = parts["checkpoint_report progress=True"]
    assert "reading: 8 files in " in report and "comparing: 60 buffers in " in report, report
    assert "checking: 8 files in " in parts["repair_checkpoint progress=True"], parts["repair_checkpoint progress=True"]


def test_progress_into_a_file_has_no_carriage_return_and_a_last_line_when_asked(tmp_path):
    log = tmp_path / "stderr.log"
    with open(log, "wb") as f:
        _run(tmp_path, f)
    text = log.read_bytes().decode()
    assert "\r" not in text
    _check_lines(_sections(text), every_update=False)


def test_progress_into_a_pipe_writes_plain_lines_at_most_every_line_seconds(tmp_path):
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path), "0"], capture_output=True, env=_env(),
                          cwd=ROOT, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stderr.decode()
    assert "\r" not in text
    _check_lines(_sections(text), every_update=True)


def test_progress_on_a_terminal_draws_the_bar(tmp_path):
    main, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's size (tqdm needs one)
    attrs = termios.tcgetattr(child)
    attrs[1] &= ~termios.OPOST  # no "\n" -> "\r\n" translation: every "\r" read back is the bar's own
    termios.tcsetattr(child, termios.TCSANOW, attrs)
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(tmp_path), "default"], stderr=child,
                            stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=_env(), cwd=ROOT)
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert proc.wait(timeout=300) == 0, b"".join(chunks)[-3000:]
    parts = _sections(b"".join(chunks).decode(errors="replace"))
    for value in (None, True):  # a terminal: the default draws the bar, True too
        bar = parts[f"recompute_bn_stats progress={value}"]
        assert "\r" in bar and "recompute_bn_stats" in bar and "batch" in bar, (value, bar)
    assert "\r" in parts["checkpoint_report progress=None"] and "reading" in parts["checkpoint_report progress=None"]
    for name in _CALLS:
        assert parts[f"{name} progress=False"] == "", name
