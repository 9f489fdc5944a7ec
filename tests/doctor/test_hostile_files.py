"""Hostile files: what a checkpoint written by someone else cannot make the doctor do.

Every file kind the doctor reads (DCP ``.metadata`` and ``.distcp`` slices, DeepSpeed model and optimizer states,
``latest``, ``.pt``, ``.bin``, ``.safetensors``) is given a pickle payload, absurd declared sizes, a symlink loop,
a FIFO, ``/dev/zero`` behind a link, or a name that lies about its kind. Through ``inspect``, ``diff``, ``repair
-o`` and ``repair --in-place`` (the CLI, in this process) and the Python API, this proves:

- the payload never runs: its marker file never appears;
- each is refused: exit code 2 / CheckpointError, the message naming the file and what is wrong, no traceback;
- nothing is written: the folder and everything beside it are exactly as they were, no output exists;
- nothing blocks or runs away: every call finishes within a deadline (a FIFO, /dev/zero, huge declared sizes);
- files the doctor never needs to load (optimizer states, Accelerate's random states) are never unpickled, and a
  repair copies them as bytes.

All the checkpoints are built by hand with torch.save (tests/doctor/files.py): the suite runs in seconds.
"""
from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import types
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import zero_buffers as zb
from tests.doctor import files
from tests.doctor.files import Payload, doctor, snapshot
from tests.helpers import run_cmd

# DCP's metadata classes and torch.load's unpickler are torch's own: the torch-next stack runs this file too
pytestmark = pytest.mark.torch_next

DCP_SKIPS = "nothing to repair"  # repair refuses a DCP folder (one copy) without opening its files


def _metadata(folder: Path):
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # our own, just written by dcp.save


def _write_metadata(folder: Path, md) -> None:
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _storage(md, fqn: str):
    return next((k, v) for k, v in md.storage_data.items() if k.fqn == fqn)


# -- the cases: each builds a checkpoint under tmp_path / "ck" and says what the refusal names ----------------------

def dcp_metadata_payload(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.dcp(tmp / "ck")
    md = _metadata(folder)
    md.planner_data = {"bn.running_mean": Payload(marker)}  # a real Metadata, with code hidden inside
    _write_metadata(folder, md)
    return folder, ".metadata", "io.open"


def dcp_metadata_reduce_only(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.dcp(tmp / "ck")
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    return folder, ".metadata", "refuses to unpickle"


def dcp_metadata_is_a_zip(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.dcp(tmp / "ck")
    buf = io.BytesIO()
    torch.save({"x": torch.zeros(1)}, buf)
    (folder / ".metadata").write_bytes(buf.getvalue())
    return folder, ".metadata", "it holds a zip archive"


def dcp_metadata_fifo(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.dcp(tmp / "ck")
    (folder / ".metadata").unlink()
    os.mkfifo(folder / ".metadata")
    return folder, ".metadata", "a FIFO"


def dcp_path_escapes_the_folder(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.dcp(tmp / "ck")
    md = _metadata(folder)
    _, info = _storage(md, "bn.running_mean")
    info.relative_path = "/dev/zero"
    _write_metadata(folder, md)
    return folder, ".metadata", "not a file name inside the folder"


def dcp_slice_beyond_the_file(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.dcp(tmp / "ck")
    md = _metadata(folder)
    _, info = _storage(md, "bn.running_mean")
    info.length = 2 ** 40
    _write_metadata(folder, md)
    return folder, ".metadata", "which has"


def dcp_tensor_declares_a_terabyte(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.dcp(tmp / "ck")
    md = _metadata(folder)
    md.state_dict_metadata["bn.running_mean"].size = torch.Size([2 ** 38])
    _write_metadata(folder, md)
    return folder, ".metadata", "declares 1099511627776 bytes"


def dcp_slice_compressed(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    """One entry's slice re-packed as a deflated zip (a decompression bomb's shape), appended, the metadata moved."""
    folder = files.dcp(tmp / "ck")
    md = _metadata(folder)
    _, info = _storage(md, "bn.running_mean")
    data = (folder / info.relative_path).read_bytes()
    src = zipfile.ZipFile(io.BytesIO(data[info.offset:info.offset + info.length]))
    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as z:
        for m in src.infolist():
            z.writestr(m.filename, src.read(m.filename))
    info.offset, info.length = len(data), len(packed.getvalue())
    (folder / info.relative_path).write_bytes(data + packed.getvalue())
    _write_metadata(folder, md)
    return folder, info.relative_path, "is compressed"


def dcp_slice_payload(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    """One entry's slice replaced by a torch.save of a payload (what DCP hands to torch.load)."""
    folder = files.dcp(tmp / "ck")
    md = _metadata(folder)
    _, info = _storage(md, "bn.running_mean")
    data = (folder / info.relative_path).read_bytes()
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    info.offset, info.length = len(data), len(buf.getvalue())
    md.state_dict_metadata["bn.running_mean"].size = torch.Size([1])  # fits in the slice: only the payload is wrong
    (folder / info.relative_path).write_bytes(data + buf.getvalue())
    _write_metadata(folder, md)
    return folder, info.relative_path, "holds the Python object io.open, which weights_only=True refuses"


def ds_model_states_payload(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    root = files.zero3(tmp / "ck")
    torch.save(files.model_states(1, 2, {"hook": Payload(marker)}), root / files.TAG / files.model_file(1))
    return root, files.model_file(1), "io.open"


def ds_rank0_model_states_payload(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    root = files.zero3(tmp / "ck")  # rank 0's file is read first, to find dp_world_size
    torch.save(files.model_states(0, 2, {"hook": Payload(marker)}), root / files.TAG / files.model_file(0))
    return root, files.model_file(0), "weights_only=True refuses"


def ds_latest_climbs_out(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    root = files.zero3(tmp / "ck")
    (tmp / "elsewhere").mkdir()
    (root / "latest").write_text("../elsewhere")
    return root, "latest", "not one folder name"


def ds_latest_huge(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    root = files.zero3(tmp / "ck")
    (root / "latest").write_bytes(b"step8" + b" " * (1 << 20))
    return root, "latest", "a file of at most 4096 bytes"


def ds_latest_is_a_pickle(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    root = files.zero3(tmp / "ck")
    (root / "latest").write_bytes(pickle.dumps(Payload(marker)))
    return root, "latest", "not text"


def ds_latest_fifo(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    root = files.zero3(tmp / "ck")
    (root / "latest").unlink()
    os.mkfifo(root / "latest")
    return root, "latest", "a FIFO"


def ds_model_states_fifo(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    root = files.zero3(tmp / "ck")
    (root / files.TAG / files.model_file(1)).unlink()
    os.mkfifo(root / files.TAG / files.model_file(1))
    return root, files.model_file(1), "a FIFO"


def pt_payload(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.per_rank(tmp / "ck")
    torch.save({**files.buffers(1), "note": Payload(marker)}, folder / "rank1.pt")
    return folder, "rank1.pt", "io.open"


def bin_payload(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.per_rank(tmp / "ck", suffix=".bin")
    torch.save({**files.buffers(1), "note": Payload(marker)}, folder / "rank1.bin")
    return folder, "rank1.bin", "io.open"


def plain_pickle_named_pt(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.per_rank(tmp / "ck")
    (folder / "rank1.pt").write_bytes(pickle.dumps({"bn.running_mean": Payload(marker)}))
    return folder, "rank1.pt", "rank1.pt"


def pickle_named_safetensors(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.per_rank(tmp / "ck", suffix=".safetensors")
    (folder / "model-rank1.safetensors").write_bytes(pickle.dumps({"x": Payload(marker)}))
    return folder, "model-rank1.safetensors", "not a safetensors file: it holds a Python pickle"


def zip_named_safetensors(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.per_rank(tmp / "ck", suffix=".safetensors")
    torch.save(files.buffers(1), folder / "model-rank1.safetensors")
    return folder, "model-rank1.safetensors", "it holds a zip archive"


def safetensors_named_pt(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    from safetensors.torch import save_file
    folder = files.per_rank(tmp / "ck")
    save_file(files.buffers(1), str(folder / "rank1.pt"))
    return folder, "rank1.pt", "it holds a safetensors file"


def safetensors_header_absurd(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.per_rank(tmp / "ck", suffix=".safetensors")
    f = folder / "model-rank1.safetensors"
    f.write_bytes(struct.pack("<Q", 2 ** 60) + f.read_bytes()[8:])
    return folder, "model-rank1.safetensors", "not a safetensors file"


def safetensors_offsets_absurd(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.per_rank(tmp / "ck", suffix=".safetensors")
    f = folder / "model-rank1.safetensors"
    header = b'{"bn.running_mean":{"dtype":"F32","shape":[1073741824],"data_offsets":[0,4294967296]}}'
    f.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    return folder, "model-rank1.safetensors", "not a readable safetensors file"


def _patch_central(path: Path, member: str, size: int) -> None:
    """Make ``member``'s central-directory entry declare ``size`` bytes (stored and unpacked)."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        start = z.start_dir
    at = start
    while data[at:at + 4] == b"PK\x01\x02":
        n, m, k = struct.unpack("<HHH", data[at + 28:at + 34])
        if data[at + 46:at + 46 + n].decode().endswith(member):
            data[at + 20:at + 28] = struct.pack("<II", size, size)
        at += 46 + n + m + k
    path.write_bytes(bytes(data))


def zip_member_declares_huge_size(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.per_rank(tmp / "ck")
    _patch_central(folder / "rank1.pt", "data/0", 2 ** 31)
    return folder, "rank1.pt", "run past"


def zip_members_compressed(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.per_rank(tmp / "ck")
    f = folder / "rank1.pt"
    src = zipfile.ZipFile(io.BytesIO(f.read_bytes()))
    with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as z:
        for m in src.infolist():
            z.writestr(m.filename, src.read(m.filename))
    return folder, "rank1.pt", "is compressed"


def symlink_loop(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.per_rank(tmp / "ck")
    (folder / "rank1.pt").unlink()
    (folder / "rank1.pt").symlink_to("rank1.pt")
    return folder, "rank1.pt", "a loop of symbolic links"


def fifo_rank_file(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.per_rank(tmp / "ck")
    (folder / "rank0.pt").unlink()
    os.mkfifo(folder / "rank0.pt")
    return folder, "rank0.pt", "a FIFO"


def dev_zero_behind_a_link(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    folder = files.per_rank(tmp / "ck")
    (folder / "rank1.pt").unlink()
    (folder / "rank1.pt").symlink_to("/dev/zero")
    return folder, "rank1.pt", "a character device (behind a link to /dev/zero)"


def fifo_as_the_path(tmp: Path, marker: Path) -> tuple[Path, str, str]:
    os.mkfifo(tmp / "ck")
    return tmp / "ck", "ck", "a FIFO"


CASES: dict[str, Callable[[Path, Path], tuple[Path, str, str]]] = {
    f.__name__: f for f in (
        dcp_metadata_payload, dcp_metadata_reduce_only, dcp_metadata_is_a_zip, dcp_metadata_fifo,
        dcp_path_escapes_the_folder, dcp_slice_beyond_the_file, dcp_tensor_declares_a_terabyte, dcp_slice_compressed,
        dcp_slice_payload, ds_latest_is_a_pickle,
        ds_model_states_payload, ds_rank0_model_states_payload, ds_latest_climbs_out, ds_latest_huge,
        ds_latest_fifo, ds_model_states_fifo, pt_payload, bin_payload, plain_pickle_named_pt,
        pickle_named_safetensors, zip_named_safetensors, safetensors_named_pt, safetensors_header_absurd,
        safetensors_offsets_absurd, zip_member_declares_huge_size, zip_members_compressed, symlink_loop,
        fifo_rank_file, dev_zero_behind_a_link, fifo_as_the_path)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_file_is_refused_by_every_command_runs_nothing_and_writes_nothing(tmp_path, case):
    marker = tmp_path / "PAYLOAD-RAN"
    path, name, fragment = CASES[case](tmp_path, marker)
    before = snapshot(tmp_path)
    out = tmp_path / "out"
    is_dcp = case.startswith("dcp_")
    calls = [("inspect", path), ("diff", path), ("repair", path, "-o", out), ("repair", path, "--in-place")]
    with files.deadline(30):
        for args in calls:
            code, stdout, err = doctor(*args)
            want = DCP_SKIPS if is_dcp and args[0] == "repair" else fragment
            assert code == 2, (args, code, stdout, err)
            assert want in err and (name in err or want == DCP_SKIPS), (args, err)
            assert err.startswith(f"zero-buffers {args[0]}: ") and "Traceback" not in err, err
        with pytest.raises(zb.CheckpointError) as caught:
            zb.checkpoint_report(path)
        assert caught.value.path and name in caught.value.path
        if not is_dcp:
            with pytest.raises(zb.CheckpointError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
                zb.repair_checkpoint(path, out)
    assert not marker.exists(), "the payload ran"
    assert snapshot(tmp_path) == before and not out.exists()


def test_dcp_tensor_reads_unpickle_the_metadata_through_the_allowlist_too(tmp_path):
    """dcp.load reads .metadata again, by itself: the doctor's reader must be the one it uses."""
    from zero_buffers._compat import torch as compat

    marker = tmp_path / "PAYLOAD-RAN"
    folder, _, _ = dcp_metadata_payload(tmp_path, marker)
    with pytest.raises(zb.CheckpointError, match=r"io\.open.*--trust-pickle"):
        compat.dcp_read(str(folder), {"bn.running_mean": (torch.float32, (3,))})
    assert not marker.exists()


def test_the_dcp_allowlist_reads_real_metadata_of_every_entry_kind_as_pickle_does(tmp_path):
    """The allowlist is what real DCP metadata is made of: tensors of several dtypes and memory formats, bytes
    entries, nested containers, a Path checkpoint id; the restricted load equals pickle's."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from zero_buffers._compat import torch as compat

    state = {"f32": torch.randn(2, 3), "bf16": torch.ones(4, dtype=torch.bfloat16), "i64": torch.tensor(7),
             "bool": torch.tensor([True, False]), "cl": torch.zeros(1, 3, 2, 2).to(memory_format=torch.channels_last),
             "nested": {"step": 5, "names": ["a", "b"]}, "f8": torch.zeros(2, dtype=torch.float8_e4m3fn)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "ck", no_dist=True)
    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(tmp_path / "ck" / ".metadata", "rb") as f:
        plain = Recording(f).load()
    assert seen <= set(compat._dcp_globals()), seen - set(compat._dcp_globals())
    assert ("torch.distributed.checkpoint.filesystem", "_StorageInfo") in seen  # the real thing, not a toy
    checked = compat.dcp_metadata(str(tmp_path / "ck"))
    assert checked.state_dict_metadata == plain.state_dict_metadata
    assert checked.storage_data == plain.storage_data and checked.planner_data == plain.planner_data
    report = zb.checkpoint_report(tmp_path / "ck")
    assert {r.name for r in report.report.rows} == {"f32", "bf16", "i64", "bool", "cl", "f8"}


def test_the_allowlist_refuses_state_set_on_a_class(tmp_path):
    """BUILD on a class object (not an instance) would rewrite that class for the whole process: refused."""
    from zero_buffers._compat import torch as compat

    folder = files.dcp(tmp_path / "ck")
    # GLOBAL torch.Size, then a state dict {"__len__": 1}, BUILD: torch.Size.__len__ = 1 if it were allowed
    evil = b"\x80\x04ctorch\nSize\n}\x8c\x07__len__K\x01sb."
    (folder / ".metadata").write_bytes(evil)
    with pytest.raises(zb.CheckpointError, match="only DCP's own classes carry state"):
        compat.dcp_metadata(str(folder))
    assert len(torch.Size([1, 2])) == 2


def test_files_the_doctor_never_loads_are_never_unpickled_and_are_copied_as_bytes(tmp_path):
    """Optimizer states (DeepSpeed) and random states (Accelerate) hold pickles the doctor has no use for: a payload
    in them never runs, and a repair copies them byte for byte."""
    marker = tmp_path / "PAYLOAD-RAN"
    root = files.zero3(tmp_path / "ck")
    optim = root / files.TAG / files.optim_file(1)
    torch.save({"optimizer_state_dict": Payload(marker)}, optim)
    code, _, err = doctor("diff", root)
    assert code == 1, err  # the ranks' statistics differ: the diff itself worked
    code, text, err = doctor("repair", root, "-o", tmp_path / "fixed")
    assert code == 0 and "2 rank file(s) rewritten" in text, err
    assert (tmp_path / "fixed" / files.TAG / optim.name).read_bytes() == optim.read_bytes()
    acc = tmp_path / "acc"
    acc.mkdir()
    torch.save(files.buffers(0), acc / "pytorch_model.bin")
    (acc / "random_states_0.pkl").write_bytes(pickle.dumps(Payload(marker)))
    (acc / "optimizer.bin").write_bytes(pickle.dumps(Payload(marker)))
    report = zb.checkpoint_report(acc)
    assert report.kind == "Accelerate save_state" and len(report.report.rows) == 5
    assert not marker.exists()


def test_links_and_specials_inside_a_folder_are_never_read(tmp_path):
    """A link to /dev/zero and a link loop beside the rank files are copied as links; a FIFO there is refused by
    repair (a copy would block on it), named, before anything is written; inspect does not open either."""
    folder = files.per_rank(tmp_path / "ck")
    (folder / "notes.txt").symlink_to("/dev/zero")
    (folder / "loop").symlink_to("loop")
    with files.deadline(30):
        code, _, err = doctor("repair", folder, "-o", tmp_path / "fixed")
        assert code == 0, err
        assert os.readlink(tmp_path / "fixed" / "notes.txt") == "/dev/zero"
        assert os.readlink(tmp_path / "fixed" / "loop") == "loop"
        os.mkfifo(folder / "queue")
        before = snapshot(tmp_path)
        code, _, err = doctor("repair", folder, "--in-place")
        assert code == 2 and "queue: a FIFO (named pipe) inside the checkpoint folder" in err, err
        assert snapshot(tmp_path) == before
        code, _, err = doctor("inspect", folder)
        assert code == 0, err


# -- --trust-pickle: a class that is not here is a CheckpointError naming it ------------------------------------------

def _with_foreign_object(folder: Path, module: str, rank: int = 1) -> None:
    """Rank ``rank``'s file holds an object of class ``Gone`` from ``module`` (``__main__`` or a module that exists
    only while saving)."""
    gone = type("Gone", (), {"__module__": module})
    fake = sys.modules.get(module) or types.ModuleType(module)
    had = module in sys.modules
    sys.modules[module] = fake
    fake.Gone = gone  # type: ignore[attr-defined]
    try:
        torch.save({**files.buffers(rank), "note": gone()}, folder / f"rank{rank}.pt")
    finally:
        del fake.Gone  # type: ignore[attr-defined]
        if not had:
            del sys.modules[module]


@pytest.fixture
def warn_again():
    """trust_pickle's warning is given once per process: forget it around each test that expects it."""
    from zero_buffers._core import notice as _notice

    _notice._SEEN.discard("trust_pickle")
    yield lambda: _notice._SEEN.discard("trust_pickle")
    _notice._SEEN.discard("trust_pickle")


@pytest.mark.parametrize("module,said", [("__main__", "defined in the script that saved it (__main__)"),
                                         ("zb_module_not_installed", "'zb_module_not_installed', which is not "
                                                                     "importable here")])
def test_trust_pickle_on_a_class_that_is_not_here_is_a_checkpoint_error_naming_it(tmp_path, module, said,
                                                                                    warn_again):
    folder = files.per_rank(tmp_path / "ck")
    _with_foreign_object(folder, module)
    before = snapshot(tmp_path)
    for args in (("inspect", folder), ("diff", folder), ("repair", folder, "-o", tmp_path / "out"),
                 ("repair", folder, "--in-place")):
        warn_again()
        with pytest.warns(zb.ZeroBuffersWarning, match="arbitrary code"):
            code, _, err = doctor(*args, "--trust-pickle")
        assert code == 2 and said in err and "rank1.pt: cannot be loaded" in err, (args, err)
        assert "Traceback" not in err
    warn_again()
    with pytest.raises(zb.CheckpointError, match="Gone" if module == "__main__" else module), \
            pytest.warns(zb.ZeroBuffersWarning):
        zb.checkpoint_report(folder, trust_pickle=True)
    done = run_cmd([sys.executable, "-m", "zero_buffers.cli", "diff", str(folder), "--trust-pickle"], 120)
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert snapshot(tmp_path) == before


def test_trust_pickle_on_dcp_metadata_with_a_missing_module_is_a_checkpoint_error(tmp_path, warn_again):
    folder = files.dcp(tmp_path / "ck")
    (folder / ".metadata").write_bytes(b"\x80\x04czb_module_not_installed\nThing\n)R.")
    with pytest.raises(zb.CheckpointError, match=r"\.metadata: cannot be loaded: .*zb_module_not_installed"), \
            pytest.warns(zb.ZeroBuffersWarning):
        zb.checkpoint_report(folder, trust_pickle=True)


def _zero3_with(tmp: Path, change: Callable[[int, dict], None]) -> Path:
    """A ZeRO-3 folder whose rank files went through ``change(rank, model_states)``."""
    root = files.zero3(tmp / "ck")
    for r in range(2):
        path = root / files.TAG / files.model_file(r)
        state = torch.load(path, weights_only=False)
        change(r, state)
        torch.save(state, path)
    return root


def _legacy_config(r: int, state: dict) -> None:
    state["ds_config"]["zero_optimization"] = True  # DeepSpeed 0.19.8 still accepts the old boolean form


def _absurd_world(r: int, state: dict) -> None:
    state["dp_world_size"] = 10 ** 12


def _counter_not_a_scalar(r: int, state: dict) -> None:
    state["module"]["bn.num_batches_tracked"] = torch.tensor([21, 22])


def _mean_and_var_disagree(r: int, state: dict) -> None:
    state["module"]["bn.running_var"] = torch.ones(4)


def _counters_past_int64(r: int, state: dict) -> None:
    state["module"]["bn.num_batches_tracked"] = torch.tensor(2 ** 62 + r)


def _dcp_ranges_listed_twice(tmp: Path) -> Path:
    """A DCP entry whose storage lists the same bytes as four chunks, to pass as four times larger."""
    folder = files.dcp(tmp / "ck")
    md = _metadata(folder)
    index, info = _storage(md, "bn.running_mean")
    for k in range(1, 4):
        md.storage_data[type(index)(index.fqn, torch.Size([3 * k]), 0)] = info
    md.state_dict_metadata["bn.running_mean"].size = torch.Size([3 * 4])
    _write_metadata(folder, md)
    return folder


VALUES = {  # values a file may hold that no reader expects: exit 2, a sentence naming the file, no traceback
    "legacy zero_optimization": (lambda tmp: _zero3_with(tmp, _legacy_config), None),
    "world of 10**12": (lambda tmp: _zero3_with(tmp, _absurd_world), "missing for rank(s) [2, 3, 4, 5] and"),
    "counter not a scalar": (lambda tmp: _zero3_with(tmp, _counter_not_a_scalar), "not one integer counter"),
    "mean and var disagree": (lambda tmp: _zero3_with(tmp, _mean_and_var_disagree),
                              "bn.running_mean is float32 [3] but bn.running_var is float32 [4]"),
    "counters past int64": (lambda tmp: _zero3_with(tmp, _counters_past_int64), None),
    "dcp ranges listed twice": (_dcp_ranges_listed_twice, "overlapping bytes"),
}


@pytest.mark.parametrize("case", list(VALUES))
def test_values_no_reader_expects_are_refused_naming_the_file_never_a_traceback(tmp_path, case):
    build, text = VALUES[case]
    path = build(tmp_path)
    for command in ("inspect", "diff"):
        code, _, err = doctor(command, path)
        if text is None:  # read fine: the legacy config and saturating counters are understood
            assert code in (0, 1), (command, code, err)
            continue
        assert code == 2 and "Traceback" not in err and text in err, (command, code, err)
    if case == "counters past int64":  # the merged counter saturates at int64's largest value, as live merges do
        out_dir = tmp_path / "fixed"
        assert doctor("repair", path, "-o", out_dir)[0] == 0
        merged = torch.load(out_dir / files.TAG / files.model_file(0), weights_only=True)["module"]
        assert int(merged["bn.num_batches_tracked"]) == torch.iinfo(torch.int64).max
