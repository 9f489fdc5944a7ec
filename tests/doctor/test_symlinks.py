"""Links: ``repair --in-place`` through a linked folder repairs the folder the link points to and keeps the link
(every other link and job sees the repair); an ``-o`` output that is a link is refused; links inside the folder
are copied as links, and a rank file that is a link is read through it, its repaired copy written as a file
(the file it named is left alone)."""
from __future__ import annotations

import os
import sys

import torch

import zero_buffers as zb
from tests.doctor import files
from tests.doctor.files import doctor, snapshot
from tests.helpers import run_cmd

_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 26, 1 << 26))
from zero_buffers import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def _in_sync(path) -> bool:
    return zb.checkpoint_report(path).in_sync


def test_in_place_through_a_linked_folder_repairs_the_real_folder_and_keeps_the_link(tmp_path):
    real = files.per_rank(tmp_path / "store" / "ck")
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "other").symlink_to(real)  # another job's link to the same checkpoint
    code, text, err = doctor("repair", tmp_path / "link", "--in-place")
    assert code == 0 and "1 BatchNorm layer(s) merged" in text, err
    assert f"repaired the folder it points to, {real}" in text
    assert os.readlink(tmp_path / "link") == str(real) and os.readlink(tmp_path / "other") == str(real)
    assert real.is_dir() and not real.is_symlink() and _in_sync(real) and _in_sync(tmp_path / "other")
    assert int(torch.load(real / "rank1.pt")["bn.num_batches_tracked"]) == 42
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["ck"]  # nothing left beside the real folder


def test_in_place_through_a_linked_deepspeed_root_repairs_its_real_tag_folder(tmp_path):
    real = files.zero3(tmp_path / "store" / "ck")
    (tmp_path / "link").symlink_to(real)
    zb.repair_checkpoint(tmp_path / "link", in_place=True)
    assert (tmp_path / "link").is_symlink() and _in_sync(real)
    assert sorted(p.name for p in real.iterdir()) == ["latest", files.TAG, "zero_to_fp32.py"]


def test_an_output_that_is_a_link_is_refused_and_nothing_is_written(tmp_path):
    folder = files.per_rank(tmp_path / "ck")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty")
    before = snapshot(tmp_path)
    for out in ("dangling", "to-empty"):
        code, _, err = doctor("repair", folder, "-o", tmp_path / out)
        assert code == 2 and f"{tmp_path / out}: the output is a symbolic link" in err, err
    assert snapshot(tmp_path) == before


def test_links_inside_the_folder_stay_links_and_a_linked_rank_file_is_read_through_it(tmp_path):
    folder = files.per_rank(tmp_path / "ck")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.replace(folder / "rank1.pt", shared / "rank1.pt")
    (folder / "rank1.pt").symlink_to("../shared/rank1.pt")  # a rank file that is a (relative) link
    (folder / "README").symlink_to("../shared/notes.txt")  # dangling: never read, copied as it is
    (folder / "zeros").symlink_to("/dev/zero")
    target_before = (shared / "rank1.pt").read_bytes()
    done = run_cmd([sys.executable, "-c", _LIMITED, "repair", str(folder), "-o", str(tmp_path / "out" / "fixed")], 120)
    assert done.returncode == 0, done.stderr  # a 64 MiB file-size limit: /dev/zero was not copied as data
    out = tmp_path / "out" / "fixed"
    assert (out / "rank1.pt").is_file() and not (out / "rank1.pt").is_symlink() and _in_sync(out)
    assert "rank1.pt was a link to ../shared/rank1.pt" in done.stdout
    assert os.readlink(out / "README") == str(tmp_path / "shared" / "notes.txt")  # made absolute: it left ck/
    assert os.readlink(out / "zeros") == "/dev/zero"
    assert (shared / "rank1.pt").read_bytes() == target_before
    zb.repair_checkpoint(folder, in_place=True)
    assert os.readlink(folder / "README") == "../shared/notes.txt"  # in place, beside itself: kept verbatim
    assert (shared / "rank1.pt").read_bytes() == target_before and _in_sync(folder)
