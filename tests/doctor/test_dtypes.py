"""The checkpoint doctor and buffer dtypes: ``diff`` flags a dtype change (a ``zero_to_fp32`` export's
``num_batches_tracked int64 -> float32``) as a difference, ``inspect`` warns on an export whose integer buffers became
floats and on buffers held in 16 bits that must be float32 (by name), ``repair --dtypes-from`` casts an export's
buffers back to the training checkpoint's dtypes, exactly or not at all, and reads that checkpoint as untrusted.

The round trip is real: DeepSpeed ZeRO-3 trains on 2 gloo ranks and saves, DeepSpeed's own ``zero_to_fp32`` exports.
DeepSpeed 0.16 casts every buffer with ``.float()``; 0.19 keeps integer buffers, so there its export must be reported
clean and the cast export is built with ``.float()`` to stand in for 0.16's.
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zero_buffers as zb
from tests import ckpt_kinds
from tests.doctor import files
from tests.doctor.files import doctor, snapshot

COUNTERS = ("0.num_batches_tracked", "2.num_batches_tracked")


def _train_and_save(rank: int, world: int, folder: str) -> dict[str, torch.Tensor]:
    """ZeRO-3 on every rank with the same data (so the ranks' buffers agree), saved; this rank's buffers."""
    from tests.helpers import init_deepspeed

    deepspeed = init_deepspeed()
    model = ckpt_kinds.site_net()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                                      config={"train_micro_batch_size_per_gpu": 16, "steps_per_print": 10 ** 9,
                                              "zero_optimization": {"stage": 3}})
    engine.train()
    for i in range(3):
        x, y = ckpt_kinds.site_batch(0, 16, seed=i)
        engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
        engine.step()
    engine.save_checkpoint(folder, tag="t")
    out = {k: v.detach().clone() for k, v in engine.module.named_buffers()}
    engine.destroy()
    return out


def _zero_to_fp32(folder: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    with contextlib.redirect_stdout(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(folder))


@pytest.mark.stack
def test_zero_to_fp32_round_trip_diff_flags_the_cast_inspect_warns_and_dtypes_from_restores_int64(ranks2, tmp_path):
    import deepspeed
    from packaging.version import Version

    ckpt = tmp_path / "ckpt"
    trained = ranks2.run(_train_and_save, str(ckpt), timeout=240)
    assert all(torch.equal(trained[1][k], v) for k, v in trained[0].items())  # the ranks agree: one truth
    exported = _zero_to_fp32(ckpt)
    casts = Version(deepspeed.__version__) < Version("0.19")
    assert {exported[k].dtype for k in COUNTERS} == ({torch.float32} if casts else {torch.int64}), \
        f"DeepSpeed {deepspeed.__version__}'s zero_to_fp32 wrote the counters as {exported[COUNTERS[0]].dtype}"
    if not casts:  # 0.19's own export is reported clean: same dtypes, same values as every rank
        own = tmp_path / "own.pt"
        torch.save(exported, own)
        code, text, err = doctor("diff", ckpt, own)
        assert code == 0 and "WARNING" not in text, text + err
        assert not zb.checkpoint_report(own).dtype_warnings()
        exported = {k: v.float() for k, v in exported.items()}  # DeepSpeed 0.16's cast, standing in
    export = tmp_path / "export" / "pytorch_model.bin"
    export.parent.mkdir()
    torch.save(exported, export)

    report = zb.checkpoint_report(ckpt, export)  # the training checkpoint first: the reference
    changes = {c.name: c.dtypes for c in report.dtype_changes}
    assert changes == {k: ("int64", "int64", "float32") for k in COUNTERS}, changes
    assert {r.name for r in report.report.out_of_sync} == set(COUNTERS)  # the values agree: only the cast differs
    assert all(r.max_abs_diff == 0 for r in report.report.rows)
    code, text, _ = doctor("diff", ckpt, export)
    assert code == 1 and "0.num_batches_tracked int64 -> float32 (source 2)" in text, text
    assert "int64 (source 2: float32)" in text  # the table's dtype column

    code, text, _ = doctor("inspect", export)
    assert code == 0 and "2 integer buffer(s) held as float32" in text and "inferred from their names" in text, text
    assert "--dtypes-from TRAINING_CKPT" in text
    one = zb.checkpoint_report(export)
    assert [(f.name, f.held, f.evidence) for f in one.float_counters] == [(k, "float32", "name") for k in COUNTERS]

    fixed = tmp_path / "fixed.bin"
    before = snapshot(tmp_path / "export")
    code, text, err = doctor("repair", export, "--dtypes-from", ckpt, "-o", fixed)
    assert code == 0, err
    assert snapshot(tmp_path / "export") == before  # the export itself is untouched
    back = torch.load(fixed, weights_only=True)
    for k in COUNTERS:
        assert back[k].dtype == torch.int64 and torch.equal(back[k], trained[0][k]), (k, back[k], trained[0][k])
    for k, v in exported.items():
        if k not in COUNTERS:
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k  # everything else as the export held it
    code, text, _ = doctor("diff", ckpt, fixed)
    assert code == 0 and "WARNING" not in text, text


def _counter_export(tmp: Path, value: float) -> tuple[Path, Path]:
    """A ZeRO-3-shaped training checkpoint and an export of it whose counter is the float32 ``value``."""
    ckpt = files.zero3(tmp / "ckpt")
    sd = {k: v.float() for k, v in files.model_states(0, 2)["module"].items() if k in files.BUFFERS}
    sd["bn.num_batches_tracked"] = torch.tensor(value, dtype=torch.float32)
    torch.save(sd, tmp / "export.pt")
    return ckpt, tmp / "export.pt"


@pytest.mark.parametrize("value, shown", [(21.5, "21.5"), (2.0 ** 24 + 2, "16777218.0"), (float("nan"), "nan")])
def test_a_counter_no_integer_dtype_holds_exactly_is_refused_naming_buffer_value_and_files(tmp_path, value, shown):
    ckpt, export = _counter_export(tmp_path, value)
    before = snapshot(tmp_path)
    with pytest.raises(zb.CheckpointError) as caught:
        zb.repair_checkpoint(export, tmp_path / "fixed.pt", dtypes_from=ckpt)
    said = str(caught.value)
    for part in (str(export), "bn.num_batches_tracked", f"holds {shown}", f"dtypes_from {ckpt}", "int64",
                 "nothing was written"):
        assert part in said, (part, said)
    code, _, err = doctor("repair", export, "--in-place", "--dtypes-from", ckpt)
    assert code == 2 and f"--dtypes-from {ckpt}" in err and "refusing to cast it back" in err, err
    assert snapshot(tmp_path) == before


def test_a_float_that_the_training_dtype_cannot_hold_exactly_is_refused_and_one_it_can_comes_back(tmp_path):
    train = tmp_path / "train.pt"
    torch.save({"bn.running_mean": torch.tensor([1.0, 0.5]).bfloat16(), "bn.running_var": torch.ones(2)}, train)
    torch.save({"bn.running_mean": torch.tensor([1.0, 0.5]), "bn.running_var": torch.ones(2)}, tmp_path / "ok.pt")
    torch.save({"bn.running_mean": torch.tensor([1.0, 0.1]), "bn.running_var": torch.ones(2)}, tmp_path / "no.pt")
    with pytest.raises(zb.CheckpointError, match=r"holds 0\.1000.* at index 1 .*bfloat16 cannot hold it exactly"):
        zb.repair_checkpoint(tmp_path / "no.pt", tmp_path / "no_fixed.pt", dtypes_from=train)
    assert not (tmp_path / "no_fixed.pt").exists()
    done = zb.repair_checkpoint(tmp_path / "ok.pt", tmp_path / "ok_fixed.pt", dtypes_from=train)
    assert done.restored == (("bn.running_mean", "float32", "bfloat16"),) and not done.per_rank
    back = torch.load(tmp_path / "ok_fixed.pt", weights_only=True)
    assert back["bn.running_mean"].dtype == torch.bfloat16 and back["bn.running_mean"].tolist() == [1.0, 0.5]
    assert back["bn.running_var"].dtype == torch.float32
    # the training checkpoint's own 16-bit statistics are flagged, by name
    flags = zb.checkpoint_report(train).degraded
    assert [(d.name, d.held, d.declared) for d in flags] == [("bn.running_mean", "bfloat16", "float32")]
    assert "recognised by the name" in flags[0].why


def test_ranks_that_disagree_on_a_dtype_are_a_difference_and_dtypes_from_settles_them(tmp_path):
    ckpt = files.per_rank(tmp_path / "ck", same=True)
    truth = torch.load(ckpt / "rank0.pt", weights_only=True) | {"bn.running_mean": torch.tensor([0.5, -1.25, 3.0])}
    torch.save(truth, ckpt / "rank0.pt")
    sd = dict(truth)
    sd["bn.num_batches_tracked"] = sd["bn.num_batches_tracked"].float()
    sd["bn.running_mean"] = sd["bn.running_mean"].bfloat16()  # values bfloat16 holds exactly: only the dtype differs
    torch.save(sd, ckpt / "rank1.pt")
    report = zb.checkpoint_report(ckpt)
    assert {c.name: c.differing for c in report.dtype_changes} == {"bn.num_batches_tracked": (1,),
                                                                    "bn.running_mean": (1,)}
    assert [(d.name, d.sources) for d in report.degraded] == [("bn.running_mean", (1,))]
    assert [(f.name, f.sources) for f in report.float_counters] == [("bn.num_batches_tracked", (1,))]
    code, text, _ = doctor("diff", ckpt)
    assert code == 1 and "bn.num_batches_tracked int64 -> float32 (rank 1)" in text, text
    before = snapshot(tmp_path)
    with pytest.raises(zb.CheckpointError, match="dtypes_from=TRAINING_CKPT"):
        zb.repair_checkpoint(ckpt, tmp_path / "fixed")
    assert snapshot(tmp_path) == before
    train = files.per_rank(tmp_path / "train", same=True)
    done = zb.repair_checkpoint(ckpt, in_place=True, dtypes_from=train)
    assert {n for n, _, _ in done.restored} == {"bn.num_batches_tracked", "bn.running_mean"}
    again = zb.checkpoint_report(ckpt)
    assert again.in_sync and not again.dtype_changes and not again.dtype_warnings()
    assert not done.merged and not done.from_src  # cast back, the ranks agree bit for bit: nothing to merge
    for r in (0, 1):
        got = torch.load(ckpt / f"rank{r}.pt", weights_only=True)
        assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in truth.items()), r


def test_an_export_beside_its_deepspeed_checkpoint_is_judged_by_that_checkpoint_not_by_names(tmp_path):
    ckpt = files.zero3(tmp_path / "ckpt")
    sd = files.model_states(0, 2)["module"]
    sd = {k: v.float() for k, v in sd.items() if k in files.BUFFERS} | {"bn.flag": torch.tensor(1.0)}
    torch.save(sd, ckpt / "pytorch_model.bin")  # where `python zero_to_fp32.py . pytorch_model.bin` writes it
    code, text, _ = doctor("inspect", ckpt / "pytorch_model.bin")
    assert code == 0 and f"the training checkpoint beside it, {ckpt} (rank 0), holds them as int64" in text, text
    found = zb.checkpoint_report(ckpt / "pytorch_model.bin").float_counters
    assert [(f.name, f.expected, f.evidence) for f in found] == [("bn.num_batches_tracked", "int64",
                                                                  f"{ckpt} (rank 0)")]


def _hostile_cases():
    from tests.doctor.test_hostile_files import CASES

    # DCP cases whose hostile part is tensor data: a reference is read for its metadata only, never its data
    data_only = {"dcp_path_escapes_the_folder", "dcp_slice_beyond_the_file", "dcp_tensor_declares_a_terabyte",
                 "dcp_slice_compressed", "dcp_slice_payload"}
    return {k: v for k, v in CASES.items() if k not in data_only}


@pytest.mark.parametrize("case", list(_hostile_cases()))
def test_a_hostile_training_checkpoint_given_to_dtypes_from_is_refused_runs_nothing_and_writes_nothing(tmp_path,
                                                                                                       case):
    marker = tmp_path / "PAYLOAD-RAN"
    hostile, name, fragment = _hostile_cases()[case](tmp_path, marker)
    _, export = _counter_export(tmp_path / "e", 21.0)
    before = snapshot(tmp_path)
    with files.deadline(30):
        code, _, err = doctor("repair", export, "--dtypes-from", hostile, "-o", tmp_path / "out.pt")
        assert code == 2 and fragment in err and name in err and "Traceback" not in err, (code, err)
        with pytest.raises(zb.CheckpointError):
            zb.repair_checkpoint(export, in_place=True, dtypes_from=hostile)
    assert not marker.exists(), "the payload ran"
    assert snapshot(tmp_path) == before


def test_a_training_checkpoint_of_another_shape_or_with_ranks_disagreeing_on_a_dtype_is_refused(tmp_path):
    _, export = _counter_export(tmp_path, 21.0)
    other = tmp_path / "other.pt"
    torch.save({"bn.num_batches_tracked": torch.tensor([21, 21])}, other)  # the right name, another shape
    with pytest.raises(zb.CheckpointError, match=r"int64 \[2\] in dtypes_from .*not a checkpoint of the same model"):
        zb.repair_checkpoint(export, tmp_path / "a.pt", dtypes_from=other)
    split = files.per_rank(tmp_path / "split")
    sd = torch.load(split / "rank1.pt", weights_only=True)
    sd["bn.num_batches_tracked"] = sd["bn.num_batches_tracked"].int()
    torch.save(sd, split / "rank1.pt")
    with pytest.raises(zb.CheckpointError, match=r"its ranks disagree on the dtype of bn\.num_batches_tracked"):
        zb.repair_checkpoint(export, tmp_path / "b.pt", dtypes_from=split)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "export.pt", "other.pt", "split"]


def test_repair_dtypes_from_in_place_killed_at_its_journal_rename_or_its_exchange_leaves_old_or_new(tmp_path):
    """The one-file copy goes through the repair's staging and swap: SIGKILL before the journal's rename or before
    the exchange leaves the old or the new file whole, and the next repair recovers and finishes."""
    import shutil
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed: crash injection needs strace -e inject=...:signal=KILL")
    ckpt, export = _counter_export(tmp_path, 21.0)
    pristine = export.read_bytes()
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    steps = "rename,renameat,renameat2"

    def run(*strace: str) -> subprocess.CompletedProcess:
        export.write_bytes(pristine)
        return subprocess.run(["strace", "-f", "-qq", *strace, "-e", f"trace={steps}", "--", sys.executable, "-m",
                               "zero_buffers.cli", "repair", str(export), "--in-place", "--dtypes-from", str(ckpt)],
                              capture_output=True, text=True, timeout=120, env=env)
    kills = [("rename", 1), ("renameat2", 1)]  # the journal's rename, then the exchange (the -9 proves each ran)
    for name, n in kills:  # strace counts each syscall on its own
        done = run("-o", os.devnull, "-e", f"inject={name}:signal=KILL:when={n}")
        assert done.returncode == -9, (name, n, done.returncode, done.stderr[-2000:])
        held = torch.load(export, weights_only=True)["bn.num_batches_tracked"]
        assert held.dtype in (torch.float32, torch.int64) and float(held) == 21.0, n  # old or new, whole
        result = zb.repair_checkpoint(export, in_place=True, dtypes_from=ckpt)
        assert torch.load(export, weights_only=True)["bn.num_batches_tracked"].dtype == torch.int64
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], (n, result.recovered)
