"""Private: build the repaired copy of a per-rank checkpoint in a staging folder.

Rank files whose buffers change are rewritten and re-read; everything else is copied as it is: regular files as
bytes, symbolic links as links (never followed: a link to ``/dev/zero`` or a loop is copied, not read), folders
with what they hold. Every file written is fsynced (the folders are, by ``_atomic``, before the copy is put in
place). A FIFO, socket or device inside the folder is refused before anything is written.
"""
from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .._core import compare as _compare
from ..errors import CheckpointError
from . import _checks as _file_checks, _files as _ckpt_files

Bar = Callable[[Sequence[Any], str], Iterable[Any]]


class WriteFailed(Exception):
    """A writer's exception (OSError, torch's RuntimeError, SafetensorError) and the file it was writing."""

    def __init__(self, file: Path, error: BaseException):
        super().__init__(str(error))
        self.file, self.error = file, error


def refuse_specials(folder: Path) -> None:
    """CheckpointError naming the first entry under ``folder`` (links not followed) that is not a regular file, a
    folder or a link: a copy would block on a FIFO or read a device forever."""
    for here, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs + files):
            p = Path(here) / name
            mode = os.lstat(p).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                raise CheckpointError(f"{p}: {_file_checks.describe_mode(mode)} inside the checkpoint folder; a "
                                      "repair copies regular files, folders and links only (move it out first)",
                                      str(p))


def write_copy(lay: _ckpt_files.Layout, views: Sequence[_ckpt_files.Tensors], values: Mapping[str, torch.Tensor],
               unit: Path, stage: Path, in_place: bool, trust_pickle: bool, bar: Bar
               ) -> tuple[list[str], int, list[str]]:
    """Fill ``unit`` (inside ``stage``): rank files rewritten and verified, everything else copied.
    Returns (rank files rewritten, entries copied, notes about links)."""
    unit.mkdir(exist_ok=True)
    ranks = {f.path.name: (f, v) for f, v in zip(lay.files, views)}
    rewritten: list[str] = []
    notes: list[str] = []
    copied = 0
    keep = None if in_place else lay.unit  # -o: a relative link out of the folder is written with its absolute target
    for entry in bar(sorted(lay.unit.iterdir()), "writing"):
        dest = unit / entry.name
        try:
            if entry.name in ranks and _rewrite_rank(entry, dest, *ranks[entry.name], values, trust_pickle):
                rewritten.append(str(entry.relative_to(lay.path)) if entry.is_relative_to(lay.path) else entry.name)
                if entry.is_symlink():
                    notes.append(f"{entry.name} was a link to {os.readlink(entry)}: the repaired copy holds the "
                                 "repaired file itself; the file the link named is unchanged")
                continue
            copy_entry(entry, dest, keep)
            copied += 1
        except _ckpt_files.write_errors() as e:
            if isinstance(e, CheckpointError):
                raise
            raise WriteFailed(dest, e) from e
    if not in_place and unit != stage:  # a DeepSpeed root: its own files (latest, zero_to_fp32.py), this tag only
        for entry in sorted(lay.path.iterdir()):
            dest = stage / entry.name
            try:
                if entry.name == "latest":
                    write_text(dest, str(lay.tag))
                elif entry.is_symlink() and not entry.is_dir():
                    copy_link(entry, dest, lay.path)
                elif stat.S_ISREG(os.lstat(entry).st_mode):
                    copy_file(entry, dest)
                else:
                    continue  # other tags' folders (not copied), anything that is not a file (never opened)
            except _ckpt_files.write_errors() as e:
                raise WriteFailed(dest, e) from e
            copied += 1
    return rewritten, copied, notes


def write_file(sf: _ckpt_files.StateFile, view: _ckpt_files.Tensors, values: Mapping[str, torch.Tensor],
               dest: Path, trust_pickle: bool) -> tuple[list[str], int, list[str]]:
    """A one-file checkpoint's copy at ``dest``: rewritten and verified when an entry changes, else its bytes (a link
    is read through: the input was checked to be a regular file behind it). Returns what ``write_copy`` does."""
    try:
        if _rewrite_rank(sf.path, dest, sf, view, values, trust_pickle):
            return [sf.path.name], 0, []
        shutil.copy2(sf.path, dest)
        fsync(dest)
    except _ckpt_files.write_errors() as e:
        if isinstance(e, CheckpointError):
            raise
        raise WriteFailed(dest, e) from e
    return [], 1, []


def _rewrite_rank(entry: Path, dest: Path, sf: _ckpt_files.StateFile, view: _ckpt_files.Tensors,
                  values: Mapping[str, torch.Tensor], trust_pickle: bool) -> bool:
    """Rewrite (and verify) one rank file if any of its buffers changes; False (nothing written) otherwise."""
    mine = {k: t for k, t in values.items() if not _compare.bitwise_equal(view.get(k), t)}
    if not mine:
        return False
    _ckpt_files.rewrite(sf, dest, mine, trust_pickle)
    _verify(sf, dest, view, values, trust_pickle)
    return True


def copy_entry(entry: Path, dest: Path, keep: Path | None) -> None:
    """Copy a file as bytes, a link as a link, a folder with what it holds."""
    mode = os.lstat(entry).st_mode
    if stat.S_ISLNK(mode):
        copy_link(entry, dest, keep)
    elif stat.S_ISDIR(mode):
        dest.mkdir()
        for child in sorted(entry.iterdir()):
            copy_entry(child, dest / child.name, keep)
        shutil.copystat(entry, dest)
    else:
        copy_file(entry, dest)


def copy_file(src: Path, dest: Path) -> None:
    shutil.copy2(src, dest, follow_symlinks=False)
    fsync(dest)


def copy_link(entry: Path, dest: Path, keep: Path | None) -> None:
    """The same link at ``dest``. With ``keep`` (a copy elsewhere), a relative link pointing out of ``keep`` is
    written with its absolute target, so it names the same file from its new place."""
    target = os.readlink(entry)
    if keep is not None and not os.path.isabs(target):
        absolute = os.path.normpath(os.path.join(os.path.abspath(entry.parent), target))
        if not Path(absolute).is_relative_to(os.path.abspath(keep)):
            target = absolute
    os.symlink(target, dest)


def write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _verify(sf: _ckpt_files.StateFile, written: Path, before: _ckpt_files.Tensors,
            values: Mapping[str, torch.Tensor], trust_pickle: bool) -> None:
    """Re-read a rewritten file: the repaired entries hold the new values, every other entry its old bytes."""
    again = _ckpt_files.StateFile(written, sf.label, sf.rank, sf.format, sf.inner)
    with _ckpt_files.open_tensors(again, trust_pickle) as view:
        if set(view.meta) != set(before.meta):
            raise CheckpointError(f"{written}: re-read after writing, it holds other entries than {sf.path}",
                                  str(written))
        for k in view.meta:
            want = values[k] if k in values else before.get(k)
            if not _compare.bitwise_equal(view.get(k), want):
                raise CheckpointError(f"{written}: re-read after writing, {k} does not hold what was written",
                                      str(written))
