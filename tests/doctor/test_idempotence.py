"""Repairing a repaired checkpoint changes nothing: a BatchNorm layer (or any buffer) already bitwise identical on
every rank is left alone. In place, nothing on disk changes at all ("nothing to repair"); ``-o`` still writes a
copy, every file copied as bytes."""
from __future__ import annotations

import os

import torch

import zero_buffers as zb
from tests.doctor import files
from tests.doctor.files import doctor, snapshot


def _stats(folder, name="rank0.pt"):
    return torch.load(folder / name, weights_only=True)


def test_repairing_a_repaired_checkpoint_changes_nothing(tmp_path):
    folder = files.per_rank(tmp_path / "ck")
    code, text, err = doctor("repair", folder, "-o", tmp_path / "once")
    assert code == 0 and "1 BatchNorm layer(s) merged" in text, err
    assert int(_stats(tmp_path / "once")["bn.num_batches_tracked"]) == 42  # 21 + 21
    once = snapshot(tmp_path / "once")
    inode = os.stat(tmp_path / "once").st_ino
    code, text, err = doctor("repair", tmp_path / "once", "--in-place")
    assert code == 0 and "nothing to repair" in text and "nothing was written" in text, err
    assert snapshot(tmp_path / "once") == once and os.stat(tmp_path / "once").st_ino == inode  # not even swapped
    assert int(_stats(tmp_path / "once")["bn.num_batches_tracked"]) == 42  # not 84
    code, text, err = doctor("repair", tmp_path / "once", "-o", tmp_path / "twice")
    assert code == 0 and "nothing to repair" in text and "copied as bytes (2)" in text, err
    assert snapshot(tmp_path / "twice") == once  # byte for byte
    result = zb.repair_checkpoint(tmp_path / "once", in_place=True)
    assert (result.merged, result.from_src, result.rewritten, result.written, result.changed) == ((), (), (), False,
                                                                                                  False)


def test_a_layer_identical_on_every_rank_is_left_alone_while_a_differing_one_is_merged(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    for r in range(2):
        sd = {f"a.{k.split('.', 1)[1]}": v for k, v in files.buffers(r, same=True).items()}  # identical everywhere
        sd.update({f"b.{k.split('.', 1)[1]}": v for k, v in files.buffers(r).items()})  # differs across ranks
        sd["a.num_batches_tracked"] = torch.tensor(5)
        torch.save(sd, folder / f"rank{r}.pt")
    result = zb.repair_checkpoint(folder, tmp_path / "out")
    assert result.merged == ("b",) and result.from_src == ()
    for r in range(2):
        sd = _stats(tmp_path / "out", f"rank{r}.pt")
        assert int(sd["a.num_batches_tracked"]) == 5 and int(sd["b.num_batches_tracked"]) == 42
        assert torch.equal(sd["a.running_mean"], _stats(folder, f"rank{r}.pt")["a.running_mean"])


def test_zero3_in_place_twice_the_second_run_writes_nothing(tmp_path):
    root = files.zero3(tmp_path / "ck")
    zb.repair_checkpoint(root, in_place=True)
    before = snapshot(tmp_path)
    result = zb.repair_checkpoint(root, in_place=True)
    assert not result.written and "nothing to repair: every buffer is bitwise identical on all 2 ranks" in \
        result.format()
    assert snapshot(tmp_path) == before
