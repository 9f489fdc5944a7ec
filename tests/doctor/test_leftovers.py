"""What an interrupted repair leaves, told apart and undone: each state a crash can leave (made here by hand, the
way the crash suite's kills leave them), what ``inspect`` / ``diff`` say about it (naming the state and the command,
changing nothing), and what the next repair or ``--recover`` does. A journal that does not name this folder's own
hidden copies is never followed; two repairs in one folder at once are refused."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import zero_buffers as zb
from tests.doctor import files
from tests.doctor.files import doctor, snapshot
from zero_buffers.doctor import _atomic as _atomic_dir


def _ino(p: Path) -> list[int]:
    st = os.lstat(p)
    return [st.st_dev, st.st_ino]


def _journal(ck: Path, stage: str, aside: str, new: Path, old: Path) -> None:
    record = {"zero_buffers_repair": 1, "target": ck.name, "stage": stage, "aside": aside, "new": _ino(new),
              "old": _ino(old)}
    (ck.parent / f".{ck.name}.zb-journal").write_text(json.dumps(record))


def _repaired_copy(ck: Path, name: str) -> Path:
    copy = ck.parent / name
    shutil.copytree(ck, copy)
    zb.repair_checkpoint(copy, in_place=True)
    return copy


STAGE, ASIDE = ".ck.zb-repair-0123abcd", ".ck.zb-old-0123abcd"


def not_swapped(ck: Path) -> str:
    new = _repaired_copy(ck, STAGE)
    _journal(ck, STAGE, ASIDE, new, ck)
    return "it had not swapped: ck is the original checkpoint, unchanged"


def swapped(ck: Path) -> str:
    new = _repaired_copy(ck, "tmp-new")
    _journal(ck, STAGE, ASIDE, new, ck)
    os.rename(ck, ck.parent / STAGE)  # what RENAME_EXCHANGE did: the old copy now has the staging name
    os.rename(new, ck)
    return "it had swapped the repaired copy in: ck is the repaired checkpoint"


def between_renames(ck: Path) -> str:
    new = _repaired_copy(ck, STAGE)
    _journal(ck, STAGE, ASIDE, new, ck)
    os.rename(ck, ck.parent / ASIDE)
    return f"it stopped between its two renames: ck is missing and the original checkpoint is in {ASIDE}"


def incomplete(ck: Path) -> str:
    (ck.parent / STAGE).mkdir()
    torch_file = ck.parent / STAGE / "rank0.pt"
    torch_file.write_bytes((ck / "rank0.pt").read_bytes()[:100])
    return f"ck is as it was; {STAGE}: an incomplete copy"


def older_version_mid_swap(ck: Path) -> str:
    """What the two-rename swap before the journal left when killed between its renames: no journal."""
    os.rename(ck, ck.parent / ASIDE)
    return f"ck is missing and the original checkpoint is in {ASIDE} (an interrupted swap)"


STATES = {f.__name__: f for f in (not_swapped, swapped, between_renames, incomplete, older_version_mid_swap)}


@pytest.mark.parametrize("state", list(STATES))
def test_inspect_names_the_state_and_the_command_and_the_next_repair_recovers(tmp_path, state):
    ck = files.per_rank(tmp_path / "ck")
    original = snapshot(ck)
    said = STATES[state](ck)
    before = snapshot(tmp_path)
    for args in (("inspect", ck), ("diff", ck)):
        code, text, err = doctor(*args)
        shown = text + err
        assert said in shown and f"`zero-buffers repair {ck} --recover`" in shown, shown
        assert "This command changed nothing" in shown
        assert code in (0, 1, 2) and (code == 2) == (not ck.exists())
    assert snapshot(tmp_path) == before
    code, text, err = doctor("repair", ck, "--in-place")
    assert code == 0 and f"recovered an interrupted repair of {ck}: {said}" in text, (text, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert zb.checkpoint_report(ck).in_sync and not zb.checkpoint_report(ck).warnings
    if state in ("not_swapped", "between_renames", "incomplete", "older_version_mid_swap"):
        assert snapshot(ck) != original and "1 BatchNorm layer(s) merged" in text  # restored, then repaired
    else:
        assert "nothing to repair" in text  # it had been repaired before the crash


@pytest.mark.parametrize("state", list(STATES))
def test_recover_restores_or_cleans_up_and_does_nothing_else(tmp_path, state):
    ck = files.per_rank(tmp_path / "ck")
    original = snapshot(ck)
    STATES[state](ck)
    code, text, _ = doctor("repair", ck, "--recover")
    assert code == 0 and text.startswith(f"recovered an interrupted repair of {ck}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert (snapshot(ck) == original) == (state != "swapped")  # never repaired by --recover itself
    code, text, _ = doctor("repair", ck, "--recover")
    assert code == 0 and "nothing to recover" in text


def test_an_output_never_placed_is_named_when_inspected_and_removed_by_the_next_repair(tmp_path):
    ck = files.per_rank(tmp_path / "ck")
    (tmp_path / ".out.zb-repair-89abcdef").mkdir()
    code, _, err = doctor("inspect", tmp_path / "out")
    assert code == 2 and "no such file or folder" in err and ".out.zb-repair-89abcdef: an incomplete copy" in err
    assert f"`zero-buffers repair {tmp_path / 'out'} --recover`" in err
    result = zb.repair_checkpoint(ck, tmp_path / "out")
    assert "recovered an interrupted repair of" in result.format() and (tmp_path / "out").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out"]


def test_a_journal_that_names_anything_but_its_own_copies_is_never_followed(tmp_path):
    ck = files.per_rank(tmp_path / "ck")
    victim = files.per_rank(tmp_path / "victim")
    (tmp_path / ".ck.zb-journal").write_text(json.dumps(
        {"zero_buffers_repair": 1, "target": "ck", "stage": "../victim", "aside": "victim", "new": _ino(ck),
         "old": _ino(victim)}))
    before = snapshot(tmp_path)
    report = zb.checkpoint_report(ck)
    assert any("is not one zero-buffers wrote for ck" in w and "Left alone" in w for w in report.warnings)
    with pytest.raises(zb.CheckpointError, match="not one zero-buffers wrote"):
        zb.repair_checkpoint(ck, in_place=True)
    code, _, err = doctor("repair", ck, "--recover")
    assert code == 2 and "remove the others by hand" in err
    assert snapshot(tmp_path) == before


def test_the_two_rename_fallback_repairs_in_place_and_leaves_nothing(tmp_path, monkeypatch):
    """Where RENAME_EXCHANGE is refused (EINVAL on some file systems), two renames do the swap."""
    monkeypatch.setattr(_atomic_dir, "exchange", lambda a, b: False)
    ck = files.per_rank(tmp_path / "ck")
    result = zb.repair_checkpoint(ck, in_place=True)
    assert result.merged == ("bn",) and zb.checkpoint_report(ck).in_sync
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_exchange_refused_by_the_file_system_reports_false_not_an_error(tmp_path, monkeypatch):
    """renameat2 answering EINVAL (a file system without RENAME_EXCHANGE) means: use the fallback."""
    import ctypes
    import errno

    class Renameat2:
        argtypes = None

        def __call__(self, *args):
            ctypes.set_errno(errno.EINVAL)
            return -1

    class Libc:
        renameat2 = Renameat2()

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: Libc())
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _atomic_dir.exchange(tmp_path / "a", tmp_path / "b") is False


def test_a_second_repair_in_the_same_folder_at_the_same_time_is_refused(tmp_path):
    ck = files.per_rank(tmp_path / "ck")
    before = snapshot(tmp_path)
    with _atomic_dir.locked(tmp_path), pytest.raises(zb.CheckpointError, match="another zero-buffers repair"):
        zb.repair_checkpoint(ck, in_place=True)
    assert snapshot(tmp_path) == before
