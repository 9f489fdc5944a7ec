"""repair_checkpoint / recover_checkpoint: a copy of a per-rank checkpoint in which every rank holds the same
buffers, written so that no crash can cost the checkpoint; the ``zero-buffers repair`` command calls these.

Reading and comparing the ranks' copies is :mod:`.report`'s (a repair compares them first, as ``diff`` does); where
the copy is built and how it is put in place, ``_copy`` and ``_atomic``'s. What all of that may write:

[Note: what the doctor may write]
- ``checkpoint_report`` (``inspect``, ``diff``) writes nothing: what an interrupted repair left is a warning naming
  its state and the command that recovers it, never touched.
- ``repair_checkpoint`` never writes into its input unless ``in_place=True``. An ``out`` folder must be new: not an
  existing path, not a link, not inside the input (``_destination``).
- Everything is built in a hidden staging folder beside the target, ``.NAME.zb-repair-XXXXXXXX`` (same parent, so
  same file system), after every input rank file passed its CRC-32 check: rank files whose buffers change are
  rewritten and re-read (the repaired entries hold the new values, every other entry its old bytes), everything
  else is copied (files as bytes, links as links, never followed). Every file written is fsynced, then every folder
  of the copy, deepest first.
- ``out``: one rename that never replaces (``RENAME_NOREPLACE``), then the parent fsynced. In place: a journal
  ``.NAME.zb-journal`` (tmp, fsync, rename, fsync of the parent) records the staging and aside names and the
  (st_dev, st_ino) of both copies, then one ``renameat2(RENAME_EXCHANGE)`` swaps the folders; where the exchange is
  refused, two renames (the original aside as ``.NAME.zb-old-XXXXXXXX``, then the copy in). Through a link, the
  folder it points to is repaired and the link kept. Two repairs in one folder at once: the second is refused.
- Any failure short of a crash (a full disk included) removes the staging folder: the input is unchanged and
  nothing is left behind.
- A crash at any instant leaves the path holding the complete old or the complete new checkpoint (missing only
  between the fallback's two renames, which the journal undoes), plus hidden leftovers beside it (a staging copy, a
  journal, an aside) and nothing anywhere else. Every repair of the path recovers them first, and
  ``recover_checkpoint`` does only that, by the journal and ``NAME``'s inode; a journal that names anything but
  this folder's own hidden copies is never followed (recovery refuses and touches nothing).

``docs/checkpoint_doctor.md`` tells the same from the command line, with the table of leftovers and their recovery.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .._core import compare as _compare
from ..errors import CheckpointError, InvalidArgumentError
from . import _atomic as _atomic_dir, _copy as _ckpt_copy, _dtypes, _files as _ckpt_files, _words
from .report import (
    _STATS,
    _bar,
    _bn_layers,
    _common_names,
    _describe,
    _names,
    _opened,
    _path_arg,
    _PathLike,
    _Source,
    _sources,
    _trust,
    unreadable,
)


@dataclass(frozen=True)
class RepairResult:
    """What :func:`repair_checkpoint` wrote: ``merged`` BatchNorm layers (exact mixture), ``from_src`` buffers
    that now hold rank ``src``'s values, ``rewritten`` rank files (the rest of the folder was copied as bytes).
    ``written`` is False for an in-place repair that found every buffer identical on every rank (nothing on disk
    changed); ``recovered`` says what was cleaned up or restored of an earlier, interrupted repair first;
    ``notes``: links resolved or replaced."""

    path: str
    out: str
    kind: str
    tag: str | None
    ranks: int
    policy: str
    src: int
    merged: tuple[str, ...]
    from_src: tuple[str, ...]
    rewritten: tuple[str, ...]
    copied: int
    written: bool = True
    recovered: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    restored: tuple[tuple[str, str, str], ...] = ()
    dtypes_from: str | None = None
    per_rank: bool = True

    @property
    def changed(self) -> bool:
        """Whether any buffer differed across the ranks (and so was merged or taken from ``src``) or was cast back
        to the dtype ``dtypes_from`` holds it in (``restored``: name, dtype found, dtype restored)."""
        return bool(self.merged or self.from_src or self.restored)

    def format(self) -> str:
        lines = list(self.recovered)
        what = f"{self.kind}, {self.ranks} ranks" if self.per_rank else f"{self.kind}, one copy"
        same = f"every buffer is bitwise identical on all {self.ranks} ranks" if self.per_rank else ""
        if self.dtypes_from is not None:
            held = f"every buffer has the dtype {self.dtypes_from} holds it in"
            same = f"{same} and {held}" if same else held
        if not self.changed and not self.written:
            lines.append(f"{self.out}: nothing to repair: {same} ({what}); nothing was written")
        elif not self.changed:
            lines.append(f"{self.out}: copy of {self.path} ({what}): nothing to repair, {same}, so every file was "
                         f"copied as bytes ({self.copied})")
        elif not self.merged and not self.from_src:
            lines.append(f"{self.out}: repaired copy of {self.path} ({what}): {len(self.restored)} buffer(s) cast back "
                         f"to the dtypes of {self.dtypes_from}, exactly; {len(self.rewritten)} file(s) rewritten and "
                         f"verified, {self.copied} other file(s) copied")
        else:
            lines.append(
                f"{self.out}: repaired copy of {self.path} ({what}, policy {self.policy!r}"
                f"{f', src {self.src}' if self.policy == 'broadcast' or self.from_src else ''}): "
                f"{len(self.merged)} BatchNorm layer(s) merged, {len(self.from_src)} buffer(s) from rank {self.src}, "
                f"{len(self.rewritten)} rank file(s) rewritten and verified, {self.copied} other file(s) copied"
                + (f"; {len(self.restored)} buffer(s) cast back to the dtypes of {self.dtypes_from} first"
                   if self.restored else ""))
        lines += [f"  {name}: {held} -> {want}" for name, held, want in self.restored[:20]]
        if len(self.restored) > 20:
            lines.append(f"  and {len(self.restored) - 20} more")
        return "\n".join(lines + [f"  {n}" for n in self.notes])


# -- repairing -------------------------------------------------------------------------------------------------------

_POLICIES = ("average", "broadcast")


def repair_checkpoint(path: _PathLike, out: _PathLike | None = None, *, policy: str = "average", src: int = 0,
                      tag: str | None = None, in_place: bool = False, trust_pickle: bool = False,
                      progress: bool | None = None, dtypes_from: _PathLike | None = None) -> RepairResult:
    """Write a copy of a per-rank checkpoint in which every rank holds the same buffers.

    ``policy="average"``: each BatchNorm layer's statistics become the exact mixture of the ranks'
    (``average_bn_stats``' float64 merge, weighted by ``num_batches_tracked``, its spread term included;
    the counters summed); every other buffer that differs takes rank ``src``'s value. ``"broadcast"``:
    every buffer takes rank ``src``'s. A layer or buffer already bitwise identical on every rank is left
    alone, so repairing a repaired checkpoint changes nothing (in place: nothing is written at all). Works on
    DeepSpeed ZeRO-3 folders (every rank's model-states file is rewritten, so ``engine.load_checkpoint`` on
    every rank and ``zero_to_fp32`` both see the repaired values; optimizer files and the rest are copied as
    bytes) and on folders of per-rank ``.pt`` / ``.bin`` / ``.safetensors`` files. Nothing is written into
    ``path``: the copy is built in a hidden folder beside ``out`` (or beside the input with ``in_place=True``),
    after every input rank file passed its CRC-32 check (``.pt`` archives); every rewritten file is re-read
    and checked, every file and folder fsynced, then the folder is renamed into place (``in_place``
    exchanges it with the input folder in one atomic step, journaled; through a link, the folder the link
    points to is repaired). A crash at any point leaves the old or the new checkpoint whole; what it left
    beside is cleaned up or restored by the next repair of ``path`` (:func:`recover_checkpoint` does only
    that). On any failure, a full disk included, nothing is left behind and the input is unchanged;
    :class:`CheckpointError` says what failed where.

    ``dtypes_from`` (a training checkpoint of any kind the doctor reads, read as untrusted as ``path``) restores
    the dtypes an export changed: every buffer whose dtype differs from the one ``dtypes_from`` holds it in (its
    rank 0; its ranks must agree) is cast back first, exactly or not at all: an int64 counter an export stored as
    float32 comes back bit for bit when every value is an integer within 2**24, and the repair refuses, naming the
    buffer, the value and both files, when one is not (nothing is written then). With it, ``path`` may also hold
    one copy (a ``zero_to_fp32`` export file or folder, an Accelerate folder, one state-dict file): that file is
    rewritten in a copy (``out`` is then the new file's or folder's path), the same way and as crash-safe as rank
    files are. Entries ``dtypes_from`` lacks are left as they are; one it holds in another shape is refused. Against
    a plain state dict (no DeepSpeed ``buffer_names``) every tensor counts, weights included.

    Example::

        zero_buffers.repair_checkpoint("ckpt/", "ckpt_fixed/", policy="average")
        zero_buffers.repair_checkpoint("export/pytorch_model.bin", "fixed.bin", dtypes_from="ckpt/")
    """
    _path_arg(path, "repair_checkpoint", "path")
    if out is not None:
        _path_arg(out, "repair_checkpoint", "out")
    if policy not in _POLICIES:
        raise InvalidArgumentError(f"repair_checkpoint(): policy must be one of {_POLICIES}, got {policy!r}")
    if not isinstance(in_place, bool):
        raise InvalidArgumentError(f"repair_checkpoint(): in_place must be True or False, got {in_place!r}")
    if (out is None) == (not in_place):
        raise InvalidArgumentError(_words.Said("repair_checkpoint(): give exactly one of ", _words.OUT, " (a new "
                                               "folder) and ", _words.IN_PLACE))
    if dtypes_from is not None:
        _path_arg(dtypes_from, "repair_checkpoint", "dtypes_from")
    _trust(trust_pickle)
    recovered = _atomic_dir.recover(Path(path))
    lay = _ckpt_files.locate(path, tag, trust_pickle)
    if not lay.per_rank and (dtypes_from is None or lay.kind == "torch DCP"):
        hint = _words.Said("; to restore the dtypes an export changed, give ", _words.Arg(
            "dtypes_from=TRAINING_CKPT", "--dtypes-from TRAINING_CKPT")) if lay.kind != "torch DCP" else ""
        raise CheckpointError(_words.Said(f"{lay.path}: a {lay.kind} checkpoint holds one copy of each buffer "
                                          f"({lay.notes[0] if lay.notes else 'not per rank'}): nothing to repair",
                                          hint), str(lay.path))
    if not lay.per_rank and not lay.path.is_dir():
        lay = dataclasses.replace(lay, unit=lay.path)  # one file: the copy is that file, not the folder around it
    reference = _reference(dtypes_from, trust_pickle, progress) if dtypes_from is not None else None
    n = len(lay.files)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < n:
        raise InvalidArgumentError(_words.Said(_words.Arg("src", "--src"), f" must be a rank of the checkpoint "
                                               f"(0..{n - 1}), got {src!r}"))
    target, notes = _destination(lay, out, in_place)  # [Note: what the doctor may write]: never the input
    recovered += _atomic_dir.recover(target)  # beside a linked tag folder, or an -o output's staging folders
    _ckpt_copy.refuse_specials(lay.unit)
    for f in _bar(lay.files, "checking", progress):  # the copy must not carry a corrupt input along
        _ckpt_files.check_crc(f)
    sources = _sources([lay])
    with unreadable(lay.path), _opened(sources, trust_pickle, progress) as views:
        names, _ = _common_names(sources, views, True)
        restored: list[tuple[str, str, str]] = []
        held = views  # as the files hold them: what the copy is written from and checked against
        if reference is not None:
            views, restored = _restore(sources, held, names, reference, dtypes_from)
        _same_dtypes(sources, views, names)
        _bn_layers(names, sources, views)  # a layer whose statistics no BatchNorm could hold is refused, by file
        values, merged, from_src = _repaired_values(views, names, policy, src)
        for name, _, _ in restored:  # cast back and identical on every rank: every rank gets rank 0's
            values.setdefault(name, views[0].get(name))
        result = RepairResult(str(lay.path), str(lay.unit if in_place else target),
                              lay.kind, lay.tag, n, policy, src, tuple(merged), tuple(from_src), (), 0, False,
                              tuple(recovered), tuple(notes), tuple(restored),
                              None if dtypes_from is None else str(dtypes_from), lay.per_rank)
        if in_place and not values:
            return result  # every buffer identical on every rank: nothing on disk changes
        with _atomic_dir.locked(target.parent):
            rewritten, copied, more = _write(lay, held, values, target, in_place, trust_pickle, progress)
    return dataclasses.replace(result, rewritten=tuple(rewritten), copied=copied, written=True,
                               notes=tuple(notes + more))


def _reference(path: _PathLike, trust_pickle: bool, progress: bool | None
               ) -> tuple[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
    """``dtypes_from``: the dtype and shape of each of its buffers (DeepSpeed's ``buffer_names`` where recorded, else
    every tensor), from metadata, after the same checks as any input (regular files, content of the kind named,
    zip layout and CRC-32, no unpickling beyond tensors); its ranks must agree."""
    ref = _ckpt_files.locate(path, None, trust_pickle)
    for f in ref.files:
        _ckpt_files.check_crc(f)
    sources = _sources([ref])
    with unreadable(ref.path), _opened(sources, trust_pickle, progress) as views:
        per = [{n: v.meta[n] for n in _names(v)} for v in views]
    for s, theirs in zip(sources[1:], per[1:]):
        for name, meta in per[0].items():
            if name in theirs and theirs[name][0] != meta[0]:
                raise CheckpointError(
                    _words.Said(_words.Arg("dtypes_from", "--dtypes-from"), f" {ref.path}: its ranks disagree on the "
                                f"dtype of {name} ({_describe(meta)} on {sources[0].label}, {_describe(theirs[name])} "
                                f"on {s.label}), so it cannot say which dtype to restore; nothing was written"),
                    str(s.file.path))
    return str(ref.path), per[0]


def _restore(sources: Sequence[_Source], views: Sequence[_ckpt_files.Tensors], names: Sequence[str],
             reference: tuple[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]], given: _PathLike | None
             ) -> tuple[list[_ckpt_files.Tensors], list[tuple[str, str, str]]]:
    """The views with every buffer whose dtype differs from the reference's cast back (``_dtypes.cast_back``: exact,
    or CheckpointError naming the buffer, the value, the file and the reference), and what was cast."""
    where, theirs = reference
    restored: dict[str, tuple[str, str]] = {}
    out = []
    for s, view in zip(sources, views):
        cast: dict[str, torch.Tensor] = {}
        for name in names:
            want = theirs.get(name)
            if want is None or view.meta[name][0] == want[0]:
                continue
            if tuple(view.meta[name][1]) != tuple(want[1]):
                raise CheckpointError(_words.Said(
                    f"{s.file.path}: {name} is {_describe(view.meta[name])} on {s.label} but {_describe(want)} in ",
                    _words.Arg("dtypes_from", "--dtypes-from"), f" {where}: not a checkpoint of the same model; "
                    "nothing was written"), str(s.file.path))
            done = _dtypes.cast_back(view.get(name), want[0])
            if isinstance(done, _dtypes.Inexact):
                at = f" at index {done.index}" if math.prod(view.meta[name][1]) > 1 else ""
                raise CheckpointError(_words.Said(
                    f"{s.file.path}: {name} holds {done.value!r}{at} on {s.label} as "
                    f"{_dtypes.dtype_name(view.meta[name][0])}; ", _words.Arg("dtypes_from", "--dtypes-from"),
                    f" {where} holds it as {_dtypes.dtype_name(want[0])}, but that value is {done.why}: refusing to "
                    "cast it back; nothing was written"), str(s.file.path))
            cast[name] = done
            restored.setdefault(name, (_dtypes.dtype_name(view.meta[name][0]), _dtypes.dtype_name(want[0])))
        out.append(_ckpt_files.Tensors({**view.meta, **{k: (t.dtype, tuple(t.shape)) for k, t in cast.items()}},
                                       _overlay(cast, view.get), view.buffer_names) if cast else view)
    return out, [(name, held, want) for name, (held, want) in restored.items()]


def _overlay(cast: dict[str, torch.Tensor], get: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    return lambda name: cast[name] if name in cast else get(name)


def _same_dtypes(sources: Sequence[_Source], views: Sequence[_ckpt_files.Tensors], names: Sequence[str]) -> None:
    """The ranks must hold each buffer in one dtype before any merge: CheckpointError naming it otherwise."""
    for s, view in zip(sources[1:], views[1:]):
        for name in names:
            if view.meta[name][0] != views[0].meta[name][0]:
                raise CheckpointError(_words.Said(
                    f"{s.file.path}: {name} is {_describe(view.meta[name])} on {s.label} but "
                    f"{_describe(views[0].meta[name])} on {sources[0].label}: the ranks disagree on its dtype, so "
                    "there is no one value to give them; ", _words.Arg("dtypes_from=TRAINING_CKPT",
                                                                        "--dtypes-from TRAINING_CKPT"),
                    " casts each rank's copy to the dtype a training checkpoint holds it in first"), str(s.file.path))


def recover_checkpoint(path: _PathLike) -> tuple[str, ...]:
    """Clean up or restore what an interrupted :func:`repair_checkpoint` of ``path`` left beside it (or inside it,
    for a DeepSpeed root), and nothing else: returns what was done, in words (empty when nothing was left).
    ``checkpoint_report`` warns about such leftovers; every repair of ``path`` does this first.
    CheckpointError when the leftovers do not say what happened (then nothing is touched)."""
    _path_arg(path, "recover_checkpoint", "path")
    return tuple(_atomic_dir.recover(Path(path)))


def _write(lay: _ckpt_files.Layout, views: Sequence[_ckpt_files.Tensors], values: dict[str, torch.Tensor],
           target: Path, in_place: bool, trust_pickle: bool, progress: bool | None) -> tuple[list[str], int, list[str]]:
    """Build the copy in a staging folder beside ``target`` and put it in place (a new folder, or exchanged with
    the input's); on failure remove it and raise CheckpointError."""
    stage = target.parent / _atomic_dir.stage_name(target.name)  # [Note: what the doctor may write]
    single = not lay.unit.is_dir()  # one state-dict file: the staging copy is that file
    try:
        if not single:
            stage.mkdir()
    except OSError as e:
        raise CheckpointError(f"cannot create a folder beside {target}: {_words.reason(e)}; nothing was written",
                              str(target)) from e
    try:
        if single:
            done = _ckpt_copy.write_file(lay.files[0], views[0], values, stage, trust_pickle)
        else:
            unit = stage if in_place or lay.unit == lay.path else stage / lay.unit.name
            done = _ckpt_copy.write_copy(lay, views, values, unit, stage, in_place, trust_pickle,
                                         lambda items, what: _bar(items, what, progress))
        if in_place:
            _atomic_dir.swap(stage, target)
        else:
            _atomic_dir.put_new(stage, target)
    except BaseException as e:
        if _atomic_dir.journal_path(target).exists():  # the swap had begun: the journal settles it, not us
            raise CheckpointError(_words.Said(f"repairing {lay.path} in place stopped during the swap "
                                              f"({_stopped(e)}); `", _words.recover(lay.path), "` restores a whole "
                                              "checkpoint"), str(target)) from e
        if single:
            with contextlib.suppress(OSError):
                stage.unlink(missing_ok=True)
        else:
            shutil.rmtree(stage, ignore_errors=True)
        if isinstance(e, CheckpointError) or not isinstance(e, (_ckpt_copy.WriteFailed, *_ckpt_files.write_errors())):
            raise
        file, cause = (e.file, e.error) if isinstance(e, _ckpt_copy.WriteFailed) else (target, e)
        raise CheckpointError(f"repairing {lay.path} failed while writing {file.name}: {_words.reason(cause)} (a "
                              f"full disk or a file size limit?); the input is unchanged and nothing was written to "
                              f"{target}", str(file)) from cause
    return done


def _stopped(e: BaseException) -> str:
    """Why a swap stopped, in words."""
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return _words.reason(e)


def _destination(lay: _ckpt_files.Layout, out: _PathLike | None, in_place: bool) -> tuple[Path, list[str]]:
    """Where the repaired copy goes, and notes; refuses an existing output, a link, or one inside the input. In
    place, the folder itself, links resolved: the folder a link points to is repaired and the link kept."""
    if in_place:
        real = lay.unit.resolve()
        notes = [] if real == lay.unit.absolute() else [f"{lay.unit} is reached through a link: repaired the "
                                                        f"folder it points to, {real}; the link is unchanged"]
        return real, notes
    assert out is not None
    target = Path(out)
    if target.is_symlink():
        raise CheckpointError(f"{target}: the output is a symbolic link (to {os.readlink(target)}); name a new folder",
                              str(target))
    if target.exists():
        raise CheckpointError(_words.Said(f"{target}: the output already exists; name a new folder (or repair the "
                                          "input with ", _words.IN_PLACE, ")"), str(target))
    inp = lay.path.resolve()
    resolved = target.resolve()
    if resolved == inp or resolved.is_relative_to(inp) or resolved.is_relative_to(lay.unit.resolve()):
        raise CheckpointError(f"{target}: the output is inside the input {lay.path}; write it elsewhere",
                              str(target))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{target}: cannot create its parent folder: {_words.reason(e)}", str(target)) from e
    return target, []


def _repaired_values(views: Sequence[_ckpt_files.Tensors], names: Sequence[str], policy: str, src: int
                     ) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """The value every rank gets, for each buffer that is not already identical everywhere (a BatchNorm layer whose
    statistics are bitwise identical on every rank is not merged again: a repair of a repaired checkpoint changes
    nothing)."""
    values: dict[str, torch.Tensor] = {}
    merged: list[str] = []
    if policy == "average":
        for prefix, counted in _bn_layers(names).items():
            if all(_identical(views, prefix + s) for s in _STATS[:2 + counted]):
                continue
            stats = _mixture(views, prefix, counted)
            if stats is not None:
                values.update(stats)
                merged.append(prefix.rstrip("."))
    from_src = []
    for name in names:
        if name in values:
            continue
        if not _identical(views, name):
            values[name] = views[src].get(name).clone()
            from_src.append(name)
    return values, merged, from_src


def _identical(views: Sequence[_ckpt_files.Tensors], name: str) -> bool:
    """Whether every rank's copy of ``name`` is bitwise identical to rank 0's."""
    ref = views[0].get(name)
    return all(_compare.bitwise_equal(v.get(name), ref) for v in views[1:])


def _mixture(views: Sequence[_ckpt_files.Tensors], prefix: str, counted: bool) -> dict[str, torch.Tensor] | None:
    """average_bn_stats' merge of one layer across the ranks' files (None when no rank has counted a batch)."""
    mean_k, var_k, count_k = (prefix + s for s in _STATS)
    n = torch.tensor([float(v.get(count_k)) if counted else 1.0 for v in views], dtype=torch.float64)
    total = float(n.sum())
    if total <= 0:
        return None
    means = torch.stack([v.get(mean_k).double() for v in views])
    second = torch.stack([v.get(var_k).double() for v in views]) + means * means
    w = n.view(-1, *([1] * (means.dim() - 1)))
    mean = (w * means).sum(0) / total
    var = ((w * second).sum(0) / total - mean * mean).clamp_min(0)
    ref = views[0]
    out = {mean_k: mean.to(ref.get(mean_k).dtype), var_k: var.to(ref.get(var_k).dtype)}
    if counted:
        dtype = ref.get(count_k).dtype  # saturating, as the live merges do: the counters' sum may pass the dtype
        out[count_k] = torch.tensor(min(round(total), torch.iinfo(dtype).max), dtype=dtype)
    return out
