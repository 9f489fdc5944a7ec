"""Private: put a repaired folder in place so that a crash at any instant leaves the old or the new one whole, and
find, describe and undo what an interrupted repair left behind: the mechanism of [Note: what the doctor may write]
(repair.py).

Names, all hidden beside the folder ``NAME`` they belong to (same parent, so same file system):

- ``.NAME.zb-repair-XXXXXXXX``: the copy being built (staging). Complete once the journal exists.
- ``.NAME.zb-journal``: written (tmp + fsync + rename + fsync of the parent) once the staging copy and its folders
  are fsynced, before the swap. JSON: the staging and aside names and the (st_dev, st_ino) of the new copy and of
  the original. A folder keeps its inode through rename and exchange, so ``NAME``'s inode says whether the swap
  happened.
- ``.NAME.zb-old-XXXXXXXX``: the original, renamed aside, where the file system cannot exchange two names.

In place: ``renameat2(stage, NAME, RENAME_EXCHANGE)`` swaps the two folders in one step (Linux 3.15+, ext4, xfs,
btrfs, tmpfs ...); where it is refused (EINVAL, ENOSYS ...) two renames do it, NAME missing between them (the
journal says how to restore it). Then the parent is fsynced, the old copy deleted, the journal deleted.
Recovery, by the journal and NAME's inode: swap done -> delete the old copy; not done -> delete the unswapped
copy (NAME is the original); NAME missing -> rename the original back. No journal: a staging copy is incomplete ->
delete it. A new folder (``-o OUT``): staged beside OUT, fsynced, renamed into place (never over an existing one),
parent fsynced; a staging copy left behind is incomplete or unplaced -> delete it.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import platform
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError
from . import _words

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.zb-(?:(?P<role>repair|old)-[0-9a-f]{8}|(?P<journal>journal)(?P<tmp>\.tmp)?)$")
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "arm64": 276, "riscv64": 276, "ppc64le": 357, "ppc64": 357,
                  "s390x": 347, "i686": 353, "i386": 353, "armv7l": 382}
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV)


def stage_name(name: str) -> str:
    return f".{name}.zb-repair-{uuid.uuid4().hex[:8]}"


def journal_path(target: Path) -> Path:
    return target.parent / f".{target.name}.zb-journal"


# -- the system calls ------------------------------------------------------------------------------------------------

def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """``renameat2(a, b, flags)``: True when done, False where this system cannot (no such call, or a file system
    without the flag); OSError for anything else (ENOENT, EEXIST, EACCES ...)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    args = (_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags)
    fn = getattr(libc, "renameat2", None)  # glibc 2.28+
    if fn is not None:
        fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
        rc = fn(*args)
    elif platform.machine() in _SYS_RENAMEAT2:
        libc.syscall.restype = ctypes.c_long
        rc = libc.syscall(ctypes.c_long(_SYS_RENAMEAT2[platform.machine()]), ctypes.c_long(_AT_FDCWD), args[1],
                          ctypes.c_long(_AT_FDCWD), args[3], ctypes.c_uint(flags))
    else:
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def exchange(a: Path, b: Path) -> bool:
    """Swap the names of folders ``a`` and ``b`` atomically; False where the system cannot."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def rename_new(a: Path, b: Path) -> None:
    """Rename ``a`` to ``b``, which must not exist (an empty folder created meanwhile is not replaced)."""
    if _renameat2(a, b, _RENAME_NOREPLACE):
        return
    if os.path.lexists(b):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(b))
    os.rename(a, b)


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (its entries)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() and not path.is_symlink() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folders(root: Path) -> None:
    """fsync every folder under ``root`` and ``root`` itself, deepest first (files are fsynced as written)."""
    for here, _, _ in os.walk(root, topdown=False, followlinks=False):
        fsync_path(Path(here))


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _remove(path: Path) -> None:
    """Delete a leftover: a folder with everything in it (links are not followed), or a file or link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """An exclusive flock on ``folder`` (held by one repair at a time); CheckpointError when another holds it. File
    systems without flock on folders: no lock."""
    import fcntl

    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise CheckpointError(f"{folder}: another zero-buffers repair is working in this folder; wait for it to "
                                  "finish", str(folder)) from e
        except OSError:
            pass
        yield
    finally:
        os.close(fd)


# -- the two ways of putting a copy in place -------------------------------------------------------------------------

def put_new(stage: Path, target: Path) -> None:
    """``stage`` (complete, its files fsynced) becomes the new folder ``target``."""
    fsync_folders(stage)
    rename_new(stage, target)
    fsync_path(target.parent)


def swap(stage: Path, target: Path) -> str:
    """``stage`` (complete, its files fsynced) replaces the folder ``target``, journaled; returns how ("exchanged",
    "renamed twice"). A failure before the swap removes the staging copy and the journal; the original is intact."""
    parent = target.parent
    fsync_folders(stage)
    aside = parent / f".{target.name}.zb-old-{uuid.uuid4().hex[:8]}"
    new, old = _inode(stage), _inode(target)
    assert new is not None and old is not None
    record = {"zero_buffers_repair": 1, "target": target.name, "stage": stage.name, "aside": aside.name,
              "new": list(new), "old": list(old)}
    journal = journal_path(target)
    tmp = journal.with_name(journal.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, journal)
    fsync_path(parent)  # the journal is durable before anything moves
    try:
        if exchange(stage, target):
            how, old_copy = "exchanged", stage
        else:
            os.rename(target, aside)  # the window: target missing until the next rename; the journal restores it
            try:
                os.rename(stage, target)
            except BaseException:
                os.rename(aside, target)
                raise
            how, old_copy = "renamed twice", aside
    except BaseException:
        if _inode(target) == old:  # the original is in place: nothing to recover from
            _remove(stage)
            journal.unlink()
            fsync_path(parent)
        raise
    fsync_path(parent)  # the swap is durable before the old copy is deleted
    _remove(old_copy)
    journal.unlink()
    fsync_path(parent)
    return how


# -- leftovers of an interrupted repair ------------------------------------------------------------------------------

@dataclass
class Plan:
    """What an interrupted repair of ``target`` left (``found``), what state that is in (``state``), and what
    recovery does (``remedy``, ``steps``); ``stuck`` when it cannot tell and leaves everything alone."""

    target: Path
    found: list[Path]
    state: str = ""
    remedy: str = ""
    steps: list[Callable[[], None]] = field(default_factory=list)
    stuck: bool = False

    def names(self) -> str:
        return ", ".join(p.name for p in self.found)

    def warning(self, path: str) -> str:
        what = f"an interrupted zero-buffers repair of {self.target} left {self.names()}: {self.state}"
        if self.stuck:
            return f"{what}. Left alone: check which copy you want and remove the others by hand"
        return _words.Said(f"{what}. This command changed nothing; `", _words.recover(path), f"` {self.remedy} "
                           "(any repair of it does so first)")


def _leftovers(folder: Path) -> dict[str, list[Path]]:
    """name -> the leftovers in ``folder`` that belong to ``folder / name``."""
    out: dict[str, list[Path]] = {}
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return out
    for p in entries:
        m = _LEFTOVER.match(p.name)
        if m:
            out.setdefault(m.group("name"), []).append(p)
    return out


def plans(path: Path) -> list[Plan]:
    """Every interrupted repair found beside ``path`` or inside it (a DeepSpeed root's tag folders), and what
    recovery of each would do; looked up through links (a link's folder is repaired where it really is)."""
    real = Path(os.path.realpath(path))
    out = []
    places = [(real.parent, real.name)]
    if real.is_dir():
        places += [(real, name) for name in _leftovers(real)]
    for folder, name in places:
        found = _leftovers(folder).get(name)
        if found:
            out.append(_plan(folder / name, found))
    return out


def _read_journal(journal: Path, target: Path) -> dict | None:
    """The journal's record when it is one this code wrote for ``target`` (names checked: recovery never deletes
    a path the journal could point anywhere else)."""
    try:
        with open(journal, "rb") as f:
            record = json.loads(f.read(65536))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("target") != target.name:
        return None
    for key, role in (("stage", "repair"), ("aside", "old")):
        m = _LEFTOVER.match(str(record.get(key)))
        if not m or m.group("name") != target.name or m.group("role") != role:
            return None
    if not all(isinstance(record.get(k), list) and len(record[k]) == 2 for k in ("new", "old")):
        return None
    return record


def _plan(target: Path, found: list[Path]) -> Plan:
    plan = Plan(target, found)
    journal = journal_path(target)
    roles = {p: _LEFTOVER.match(p.name) for p in found}
    stages = [p for p, m in roles.items() if m and m.group("role") == "repair"]
    asides = [p for p, m in roles.items() if m and m.group("role") == "old"]
    tmp = [p for p, m in roles.items() if m and m.group("tmp")]
    here = _inode(target)
    if journal in found:
        record = _read_journal(journal, target)
        if record is None:
            plan.state, plan.stuck = f"its journal {journal.name} is not one zero-buffers wrote for {target.name}", True
            return plan
        new, old = tuple(record["new"]), tuple(record["old"])
        stage, aside = target.parent / record["stage"], target.parent / record["aside"]
        if here == new:
            plan.state = f"it had swapped the repaired copy in: {target.name} is the repaired checkpoint"
            plan.remedy = "deletes the old copy left beside it"
            plan.steps = [lambda: _remove(stage), lambda: _remove(aside)]
        elif here == old:
            plan.state = (f"it had not swapped: {target.name} is the original checkpoint, unchanged; "
                          f"{stage.name} is a repaired copy never put in place")
            plan.remedy = "deletes that copy"
            plan.steps = [lambda: _remove(stage)]
        elif here is None and _inode(aside) == old:
            plan.state = (f"it stopped between its two renames: {target.name} is missing and the original "
                          f"checkpoint is in {aside.name}")
            plan.remedy = f"renames it back to {target.name} and deletes the repaired copy"
            plan.steps = [lambda: os.rename(aside, target), lambda: _remove(stage)]
        else:
            plan.state = (f"{target.name} is neither the original nor the repaired copy the journal records "
                          f"({'missing' if here is None else 'replaced since'})")
            plan.stuck = True
            return plan
        others = [p for p in stages + asides if p not in (stage, aside)]  # incomplete: no journal of their own
        plan.steps += [functools.partial(_remove, p) for p in others + tmp] + [lambda: _remove(journal)]
        return plan
    # no journal: no staging copy was complete; an aside is the original, renamed by an older version's swap
    if here is None and len(asides) == 1:
        plan.state = (f"{target.name} is missing and the original checkpoint is in {asides[0].name} (an interrupted "
                      "swap)")
        rest = [p for p in found if p != asides[0]]
        plan.remedy = f"renames it back to {target.name}" + (" and deletes the rest" if rest else "")
        plan.steps = [lambda: os.rename(asides[0], target)]
    elif here is None and asides:
        plan.state, plan.stuck = f"{target.name} is missing and {len(asides)} old copies are beside it", True
        return plan
    else:
        parts = []
        if stages:
            parts.append(f"{', '.join(p.name for p in stages)}: an incomplete copy (interrupted while writing it, "
                         "before it could be swapped in)")
        if asides:
            parts.append(f"{', '.join(p.name for p in asides)}: an old copy left after a swap")
        if tmp:
            parts.append(f"{', '.join(p.name for p in tmp)}: a journal never completed")
        where = f"{target.name} is as it was" if here is not None else f"{target.name} was never created"
        plan.state = f"{where}; {'; '.join(parts)}"
        plan.remedy = "deletes " + ("it" if len(found) == 1 else "them")
        rest = found
    plan.steps += [functools.partial(_remove, p) for p in rest]
    return plan


def recover(path: Path) -> list[str]:
    """Carry out every plan for ``path`` (each under its folder's lock); returns what was done, in words.
    CheckpointError when one cannot tell what happened (nothing is touched then)."""
    done = []
    for plan in plans(path):
        if plan.stuck:
            raise CheckpointError(plan.warning(str(path)), str(plan.target))
        with locked(plan.target.parent):
            again = _plan(plan.target, _leftovers(plan.target.parent).get(plan.target.name, []))
            if not again.found:
                continue
            if again.stuck:
                raise CheckpointError(again.warning(str(path)), str(again.target))
            for step in again.steps:
                step()
            fsync_path(again.target.parent)
        done.append(f"recovered an interrupted repair of {again.target}: {again.state}; "
                    f"{_past(again.remedy)}")
    return done


def _past(remedy: str) -> str:
    """"deletes the old copy" -> "deleted the old copy"."""
    return re.sub(r"\b(deletes|renames)\b", lambda m: {"deletes": "deleted", "renames": "renamed"}[m.group(1)], remedy)
