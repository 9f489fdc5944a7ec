"""checkpoint_report: find diverged buffers in checkpoints already written, offline; and the reading and comparing
that :mod:`.repair` shares (the copies of a checkpoint, opened lazily; names, shapes and BatchNorm layers compared).

No process group, no GPU: files are read lazily (``torch.load(mmap=True, weights_only=True)``, safetensors'
``safe_open``, DCP's metadata), so a folder of multi-GB rank files costs memory for the buffers compared, not
for the weights. The ``zero-buffers inspect | diff`` commands call :func:`checkpoint_report`; it writes nothing
([Note: what the doctor may write] in repair.py).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .._core import compare as _compare, notice as _notice
from ..errors import CheckpointError, InvalidArgumentError
from ..report import BufferReport, BufferRow
from . import _atomic as _atomic_dir, _dtypes, _files as _ckpt_files, _words

_STATS = ("running_mean", "running_var", "num_batches_tracked")
_PathLike = str | os.PathLike


@dataclass(frozen=True)
class DtypeChange:
    """A buffer whose dtype differs across the copies compared: ``dtypes`` holds its dtype on each source, in the
    order of ``CheckpointReport.sources`` ("int64", "float32"); the first is the reference. Such a buffer's row is
    out of sync whatever its values."""

    name: str
    dtypes: tuple[str, ...]

    @property
    def differing(self) -> tuple[int, ...]:
        """The sources whose dtype is not the reference's."""
        return tuple(i for i, d in enumerate(self.dtypes) if d != self.dtypes[0])

    @property
    def integer_to_floating(self) -> bool:
        """Whether some source holds as a float what another holds as an integer or a flag (an export's cast)."""
        kinds = {_is_float(d) for d in self.dtypes}
        return kinds == {True, False}


@dataclass(frozen=True)
class Degraded:
    """A buffer held in a 16-bit dtype on ``sources`` whose name says it must be ``declared`` (float32): ``why`` is
    the rule, by name (``doctor/_dtypes.py`` mirrors the defaults of ``precision.declared``)."""

    name: str
    held: str
    declared: str
    why: str
    sources: tuple[int, ...]


@dataclass(frozen=True)
class FloatCounter:
    """An integer buffer (by its name, or by a training checkpoint beside the file) held as a float on ``sources``:
    the mark of an export that cast every buffer with ``.float()`` (DeepSpeed 0.16's ``zero_to_fp32``).
    ``evidence``: "name", or the path of the training checkpoint whose copy is ``expected``."""

    name: str
    held: str
    expected: str
    sources: tuple[int, ...]
    evidence: str


def _is_float(dtype: str) -> bool:
    found = _dtypes.dtype_of(dtype)
    return found is not None and (found.is_floating_point or found.is_complex)


@dataclass(frozen=True)
class CheckpointReport:
    """What one checkpoint (or several files) holds, and how its copies of each buffer compare.

    ``sources`` label the copies compared: the ranks of one checkpoint, or the files named, in order; the
    ``differing_ranks`` and ``untrained_ranks`` of ``report``'s rows index into it (0 is the reference).
    ``counters`` gives, per source, the smallest and largest ``num_batches_tracked``; ``untrained`` the
    BatchNorm layers still at mean 0 / var 1 / count 0 and the sources where they are; ``not_compared`` the
    entries only some sources hold. ``buffer_names``: every file records which of its entries are buffers
    (DeepSpeed's ``buffer_names``), so ``report`` compares buffers only and ``parameters`` counts the entries left
    out; otherwise it compares every tensor (a plain state dict does not say which are buffers).
    Dtypes, as data (:meth:`dtype_warnings` says them in words): ``dtype_changes`` the buffers whose dtype differs
    across the sources (out of sync whatever their values: ``diff`` exits 1); ``float_counters`` integer buffers held
    as floats, known by name (``num_batches_tracked``) or, for one copy inside or beside a DeepSpeed checkpoint,
    by that checkpoint's dtypes (an export that cast every buffer with ``.float()``); ``degraded`` buffers held in a
    16-bit dtype that their names say must be float32 (the defaults of ``precision.declared``, by name: offline there
    is no module).
    """

    kind: str
    paths: tuple[str, ...]
    tag: str | None
    sources: tuple[str, ...]
    per_rank: bool
    report: BufferReport
    kinds: tuple[tuple[str, int], ...]
    counters: tuple[tuple[int, int] | None, ...]
    untrained: tuple[tuple[str, tuple[int, ...]], ...]
    notes: tuple[str, ...]
    warnings: tuple[str, ...]
    not_compared: tuple[str, ...]
    buffer_names: bool = False
    parameters: int = 0
    dtype_changes: tuple[DtypeChange, ...] = ()
    degraded: tuple[Degraded, ...] = ()
    float_counters: tuple[FloatCounter, ...] = ()

    @property
    def in_sync(self) -> bool:
        return self.report.in_sync

    @property
    def compared(self) -> bool:
        """Whether there were at least two copies to compare."""
        return len(self.sources) > 1

    def __str__(self) -> str:
        return self.format()

    def heading(self) -> str:
        where = ", ".join(self.paths)
        tag = f", tag {self.tag!r}" if self.tag else ""
        copies = (f"{len(self.sources)} ranks" if self.per_rank else "one copy" if len(self.sources) == 1
                  else f"{len(self.sources)} copies")
        return f"{where}: {self.kind}{tag}, {copies}"

    @property
    def what(self) -> str:
        """What the rows are: "buffers" where the files record which entries are, else "tensors"."""
        return "buffers" if self.buffer_names else "tensors"

    def verdict(self) -> str:
        rows = self.report.rows
        if not self.compared:
            return f"{len(rows)} {self.what}, one copy each: nothing to compare"
        versus = "rank 0" if self.per_rank else f"the first file ({self.sources[0]})"
        if self.buffer_names:
            why = f"; {self.parameters} parameters not compared" if self.parameters else ""
        else:
            why = (f"; {'the files do' if len(self.paths) > 1 or len(self.sources) > 1 else 'the file does'} not "
                   "record which entries are buffers, so weights are compared too")
        return (f"{len(self.report.out_of_sync)} of {len(rows)} {self.what} differ (compared with {versus}, "
                f"atol={self.report.atol:g}{why})")

    def table(self, full: bool = False) -> str:
        """The per-buffer table ``buffer_report`` prints: under 40 lines unless ``full`` (every row up to 30 buffers;
        past that the differing rows, or the 20 worst and the rest by module: ``BufferReport.format``). A buffer
        whose dtype differs shows each source's: ``int64 (source 1: float32)``."""
        report = self.report
        if self.dtype_changes:
            cells = {c.name: _words.dtype_cell(c.dtypes, self._who) for c in self.dtype_changes}
            report = dataclasses.replace(report, rows=tuple(
                dataclasses.replace(r, dtype=cells[r.name]) if r.name in cells else r for r in report.rows))
        return report.format(head=self.verdict(), full=full)

    def dtype_warnings(self) -> tuple[str, ...]:
        """The dtype findings in words: changes between the copies, integer buffers held as floats, buffers held in
        16 bits that must be float32 (by name)."""
        out: list[str] = []
        if self.dtype_changes:
            out.append(_words.dtype_changes([_words.dtype_change(c.name, c.dtypes, self._who)
                                             for c in self.dtype_changes],
                                            any(c.integer_to_floating for c in self.dtype_changes)))
        for group, items in _grouped(self.float_counters, lambda f: (f.held, f.expected, f.sources, f.evidence)):
            held, expected, sources, evidence = group
            out.append(_words.float_counters([f.name for f in items], held, expected, self._where(sources), evidence))
        for group, items in _grouped(self.degraded, lambda d: (d.held, d.declared, d.why, d.sources)):
            held, declared, why, sources = group
            out.append(_words.degraded([d.name for d in items], held, declared, why, self._where(sources)))
        return tuple(out)

    def _where(self, sources: Sequence[int]) -> str:
        if len(self.sources) == 1:
            return str(self.paths[0])
        return ", ".join(self._who(i) for i in sources)

    def format(self, full: bool = False) -> str:
        """What ``zero-buffers inspect`` prints."""
        lines = [self.heading()]
        if not self.per_rank and len(self.sources) > 1:
            lines += [f"  source {i}: {s}" for i, s in enumerate(self.sources)]
        lines += [f"  {note}" for note in self.notes]
        kinds = ", ".join(f"{k} {n}" for k, n in self.kinds) or "none"
        what = "buffers (DeepSpeed's buffer_names)" if self.buffer_names else "tensors (buffers and any weights)"
        params = (f"; {self.parameters} parameters, not compared (ZeRO-3 keeps their values in the optimizer files)"
                  if self.parameters else "")
        lines.append(f"  {what} per copy: {sum(n for _, n in self.kinds)}: {kinds}{params}")
        known = [(i, c) for i, c in enumerate(self.counters) if c is not None]
        if known:
            lines.append("  num_batches_tracked: " + "; ".join(
                f"{self._who(i)} {lo}" + (f"..{hi}" if hi != lo else "") for i, (lo, hi) in known))
        if self.untrained:
            where = sorted({s for _, ss in self.untrained for s in ss})
            lines.append(f"  untrained BatchNorm statistics (mean 0, var 1, count 0) in {len(self.untrained)} "
                         f"layer(s) on {', '.join(self._who(s) for s in where)}: loaded or trained on some ranks "
                         "only (incident 1's signature)")
        else:
            lines.append("  untrained BatchNorm statistics: none")
        lines.append(f"  {self.verdict()}")
        if self.compared and not self.in_sync:
            bad = self.report.out_of_sync
            lines.append("    " + ", ".join(r.name for r in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8
                                                                           else ""))
        if self.not_compared:
            lines.append(f"  {len(self.not_compared)} entries held by some sources only, not compared: "
                         + ", ".join(self.not_compared[:5]) + (" ..." if len(self.not_compared) > 5 else ""))
        lines += [f"  WARNING: {w}" for w in (*self.warnings, *self.dtype_warnings())]
        if full:
            lines.append(self.table(full=True))
        return "\n".join(lines)

    def _who(self, i: int) -> str:
        return f"rank {i}" if self.per_rank else f"source {i}"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data: the fields, with one object per buffer (``BufferRow``'s fields) under ``buffers``."""
        def clean(v: float) -> float | str:
            return v if math.isfinite(v) else str(v)
        rows = [{**asdict(r), "shape": list(r.shape), "max_abs_diff": clean(r.max_abs_diff),
                 "max_rel_diff": clean(r.max_rel_diff), "differing_ranks": list(r.differing_ranks),
                 "untrained_ranks": list(r.untrained_ranks)} for r in self.report.rows]
        return {"kind": self.kind, "paths": list(self.paths), "tag": self.tag, "sources": list(self.sources),
                "per_rank": self.per_rank, "compared": self.compared, "in_sync": self.in_sync,
                "atol": self.report.atol, "buffers": rows, "kinds": dict(self.kinds),
                "counters": [list(c) if c else None for c in self.counters],
                "untrained": {k: list(v) for k, v in self.untrained}, "notes": list(self.notes),
                "warnings": list(self.warnings), "not_compared": list(self.not_compared),
                "buffer_names": self.buffer_names, "parameters": self.parameters,
                "dtype_changes": [{"name": c.name, "dtypes": list(c.dtypes), "differing": list(c.differing)}
                                  for c in self.dtype_changes],
                "degraded": [{**asdict(d), "sources": list(d.sources)} for d in self.degraded],
                "float_counters": [{**asdict(f), "sources": list(f.sources)} for f in self.float_counters],
                "dtype_warnings": list(self.dtype_warnings())}


def _grouped(items: Iterable[Any], key: Any) -> list[tuple[Any, list[Any]]]:
    """``items`` grouped by ``key``, groups in order of first appearance."""
    out: dict[Any, list[Any]] = {}
    for item in items:
        out.setdefault(key(item), []).append(item)
    return list(out.items())


# -- reading and comparing -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Source:
    """One copy: its label and its file."""

    label: str
    file: _ckpt_files.StateFile


def _sources(layouts: Sequence[_ckpt_files.Layout]) -> list[_Source]:
    if len(layouts) == 1:
        return [_Source(f.label, f) for f in layouts[0].files]
    out = []
    for lay in layouts:
        for f in lay.files:
            out.append(_Source(f"{lay.path} [{f.label}]" if len(lay.files) > 1 else str(lay.path), f))
    return out


@contextmanager
def _opened(sources: Sequence[_Source], trust_pickle: bool, progress: bool | None
            ) -> Iterator[list[_ckpt_files.Tensors]]:
    """Every source opened lazily (metadata only), with a progress bar for many files."""
    with ExitStack() as stack:
        views = []
        for s in _bar(sources, "reading", progress):
            views.append(stack.enter_context(_ckpt_files.open_tensors(s.file, trust_pickle)))
        yield views


def _bar(items: Sequence[Any], what: str, progress: bool | None, unit: str = "file") -> Iterable[Any]:
    """``items`` with a progress report on stderr when ``progress`` is true, or by default (None) for 8 or more
    files on a terminal: a tqdm bar on a terminal; anywhere else never a carriage return, but a plain line at most
    every 10 seconds and a last one (``_core/notice.py``: ``LINE_SECONDS``)."""
    show = bool(progress) if progress is not None else (len(items) >= 8 and _notice.is_terminal(sys.stderr))
    if not show:
        return items
    return _notice.iterate(items, what, unit, True)


def _names(view: _ckpt_files.Tensors) -> list[str]:
    """The buffers of one copy: DeepSpeed's ``buffer_names`` when recorded, else every tensor entry."""
    if view.buffer_names is not None:
        return [n for n in view.buffer_names if n in view.meta]
    return list(view.meta)


def _common_names(sources: Sequence[_Source], views: Sequence[_ckpt_files.Tensors], same_checkpoint: bool
                  ) -> tuple[list[str], list[str]]:
    """(names compared, names some sources lack). Ranks of one checkpoint must hold the same set and shapes."""
    per = [_names(v) for v in views]
    first = set(per[0])
    if same_checkpoint:
        for s, names, v in zip(sources[1:], per[1:], views[1:]):
            if set(names) != first:
                extra, lost = sorted(set(names) - first), sorted(first - set(names))
                raise CheckpointError(
                    f"{s.file.path}: {s.label} holds a different set of buffers than {sources[0].label} "
                    f"({sources[0].file.path.name}): only on {s.label}: {extra[:5] or '-'}; missing on {s.label}: "
                    f"{lost[:5] or '-'}", str(s.file.path))
            for n in per[0]:
                if v.meta[n][1] != views[0].meta[n][1]:  # a dtype that differs is a finding (DtypeChange)
                    raise CheckpointError(
                        f"{s.file.path}: {n} is {_describe(v.meta[n])} on {s.label} but "
                        f"{_describe(views[0].meta[n])} on {sources[0].label}", str(s.file.path))
        return per[0], []
    common = [n for n in per[0] if all(n in set(p) for p in per[1:])]
    union = {n for p in per for n in p}
    return common, sorted(union - set(common))


def _describe(meta: tuple[torch.dtype, tuple[int, ...]]) -> str:
    return f"{str(meta[0]).removeprefix('torch.')} {list(meta[1])}"


def _compare_one(tensors: Sequence[torch.Tensor], atol: float) -> tuple[tuple[int, ...], float, float]:
    """(indices differing from tensors[0], max |diff|, relative to the reference's largest magnitude)."""
    ref, bad, worst = tensors[0], [], 0.0
    for i, x in enumerate(tensors[1:], 1):
        if x.shape != ref.shape:
            bad.append(i)
            worst = math.inf
            continue
        if atol == 0 and x.dtype == ref.dtype and _compare.bitwise_equal(x, ref):
            continue
        d = _compare.max_abs_diff(x, ref)
        if x.dtype != ref.dtype or atol == 0 or not d <= atol:  # a dtype change differs whatever the values
            bad.append(i)
        worst = max(worst, d)
    scale = _compare.max_abs(ref) if worst else 0.0
    rel = 0.0 if worst == 0 else math.inf if scale == 0 else worst / scale
    return tuple(bad), worst, rel


def _bn_layers(names: Iterable[str], sources: Sequence[_Source] = (),
               views: Sequence[_ckpt_files.Tensors] = (), float_counters: bool = False) -> dict[str, bool]:
    """BatchNorm layers among ``names`` (prefix with running_mean and running_var) -> whether they have a counter.
    With the ``views`` of the ``sources``, each layer is checked as a BatchNorm's statistics must be (mean and var of
    one shape, a counter of one integer, or with ``float_counters`` of one real number, as an export that cast it
    writes): CheckpointError naming the file and the entry for what is not."""
    ordered = list(names)
    have = set(ordered)
    layers = {n.removesuffix("running_mean"): n.removesuffix("running_mean") + "num_batches_tracked" in have
              for n in ordered if n.endswith("running_mean") and n.removesuffix("running_mean") + "running_var" in have}
    for source, view in zip(sources, views):
        for prefix, counted in layers.items():
            mean, var = view.meta[prefix + "running_mean"], view.meta[prefix + "running_var"]
            why = None
            if mean[1] != var[1]:
                why = f"{prefix}running_mean is {_describe(mean)} but {prefix}running_var is {_describe(var)}"
            elif counted:
                dtype, shape = view.meta[prefix + "num_batches_tracked"]
                if math.prod(shape) != 1 or dtype.is_complex or dtype == torch.bool or (
                        dtype.is_floating_point and not float_counters):
                    why = f"{prefix}num_batches_tracked is {_describe((dtype, shape))}, not one integer counter"
                    if dtype.is_floating_point and math.prod(shape) == 1:
                        why = _words.Said(why, " (an export's cast? ", _words.Arg("dtypes_from=TRAINING_CKPT",
                                          "--dtypes-from TRAINING_CKPT"), " restores it)")
            if why is not None:
                raise CheckpointError(_words.Said(f"{source.file.path}: not a BatchNorm layer's statistics on "
                                                  f"{source.label}: ", why), str(source.file.path))
    return layers


@contextmanager
def unreadable(what: Any) -> Iterator[None]:
    """Anything but a CheckpointError while reading ``what`` (values a file holds that no reader expects) becomes a
    CheckpointError naming it: the doctor's callers get one error type, the CLI exit 2 rather than a traceback."""
    try:
        yield
    except (CheckpointError, InvalidArgumentError, KeyboardInterrupt):
        raise
    except (ValueError, TypeError, AttributeError, RuntimeError, OverflowError, MemoryError, KeyError, IndexError,
            EOFError, AssertionError) as e:
        raise CheckpointError(f"{what}: holds values that cannot be read as a checkpoint ({_words.reason(e)})",
                              str(what)) from e


def _untrained(view: _ckpt_files.Tensors, prefix: str, counted: bool) -> bool:
    mean, var = view.get(prefix + "running_mean"), view.get(prefix + "running_var")
    counter = view.get(prefix + "num_batches_tracked") if counted else torch.zeros(())
    if counter.numel() != 1:
        return False  # not a counter: _bn_layers names it once every entry was read
    return float(counter) == 0 and not bool(mean.any()) and bool((var == 1).all())


def _kind_of(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    return "BatchNorm statistics" if leaf in _STATS else leaf


def checkpoint_report(path: _PathLike, *more: _PathLike, atol: float = 0.0, only: Iterable[str] = (),
                      tag: str | None = None, trust_pickle: bool = False, progress: bool | None = None,
                      verify: bool | None = None) -> CheckpointReport:
    """Compare every buffer across the ranks of one checkpoint, or across several files, offline.

    ``path`` may be a DeepSpeed folder (its ``latest`` tag, or ``tag``), a tag folder, a folder of per-rank
    ``.pt`` / ``.bin`` / ``.safetensors`` files named alike but for the rank number, a DCP folder, an
    Accelerate ``save_state`` folder, or one state-dict file. With ``more`` paths, each copy is compared with
    the first (a training checkpoint against the exported model, two runs...), over the entries all hold.
    The entries compared are DeepSpeed's ``buffer_names`` where the file records them (its parameters are
    placeholders), else every tensor of the state dict: without the model, a plain file does not say which
    entries are buffers, and weights that differ across ranks are worth knowing about too.
    A buffer is in sync when bitwise identical (``atol == 0``) or within ``atol`` of the reference. ``only``
    keeps the names matching any of these globs. Files are never unpickled beyond tensors unless
    ``trust_pickle`` (which warns). ``verify`` checks each ``.pt`` archive's CRC-32 first, so corrupt data
    is an error rather than a difference (None: files up to 256 MiB, the larger ones are not read whole).
    Raises :class:`CheckpointError` (naming the file) for what cannot be read, missing or extra rank files,
    or ranks whose buffers differ in name, dtype or shape. Per-rank files record no world size: a missing
    last rank cannot be told from a smaller run.

    Example::

        report = zero_buffers.checkpoint_report("checkpoints/")   # a DeepSpeed save_checkpoint folder
        print(report.table())
    """
    for i, p in enumerate((path, *more)):
        _path_arg(p, "checkpoint_report", "path" if i == 0 else f"path {i + 1}")
    atol = _atol(atol)
    patterns = _patterns(only)
    _trust(trust_pickle)
    # reported, never touched ([Note: what the doctor may write] in repair.py)
    leftovers = [plan.warning(str(p)) for p in (path, *more) for plan in _atomic_dir.plans(Path(p))]
    try:
        layouts = [_ckpt_files.locate(p, tag, trust_pickle) for p in (path, *more)]
    except CheckpointError as e:
        if leftovers:  # the checkpoint may be missing because a repair was interrupted: say so
            raise CheckpointError(_words.Said(e.args[0], ". WARNING: ", _words.join(leftovers, " WARNING: ")),
                                  e.path) from e
        raise
    sources = _sources(layouts)
    for s in sources:
        if verify or (verify is None and s.file.format == "torch" and s.file.path.is_file()
                      and s.file.path.stat().st_size <= _VERIFY_BYTES):
            _ckpt_files.check_crc(s.file)
    same = len(layouts) == 1 and layouts[0].per_rank
    warnings: list[str] = list(leftovers)
    with unreadable(", ".join(map(str, (path, *more)))), _opened(sources, trust_pickle, progress) as views:
        names, partial = _common_names(sources, views, same)
        recorded = all(v.buffer_names is not None for v in views)
        if patterns:
            kept = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
            if not kept:  # a typo in a CI check must not pass as "0 of 0 differ"
                what = "buffers" if recorded else "tensors"
                some = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
                raise InvalidArgumentError(_words.Said(
                    _words.only(patterns), f" matched none of the {len(names)} {what} of "
                    f"{', '.join(map(str, (path, *more)))}" + (f" (they include {some})" if names else "")))
            names = kept
        layers = _bn_layers(names)
        held = {n: tuple(_dtypes.dtype_name(v.meta[n][0]) for v in views) for n in names}
        changes = tuple(DtypeChange(n, d) for n, d in held.items() if len(set(d)) > 1)
        degraded, floats = _dtype_findings(held)
        fresh = {p: tuple(i for i, v in enumerate(views) if _untrained(v, p, c)) for p, c in layers.items()}
        rows = []
        for name in _bar(names, "comparing", progress is True and len(names) > 50, "buffer"):
            tensors = [v.get(name) for v in views]
            bad, worst, rel = _compare_one(tensors, atol)
            layer = next((name.removesuffix(s) for s in _STATS if name.endswith(s)), None)
            rows.append(BufferRow(name, str(tensors[0].dtype).removeprefix("torch."), tuple(tensors[0].shape), True,
                                  not bad, worst, bad, rel, fresh.get(layer, ()) if layer is not None else ()))
            del tensors
        _bn_layers(names, sources, views, float_counters=True)  # after every entry was read: what cannot be read
        # is named first
        counters = tuple(_counter_range(v, [p + "num_batches_tracked" for p, c in layers.items() if c])
                         for v in views)
        if any(lay.kind == "torch DCP" for lay in layouts):
            warnings += _dcp_warnings(layouts, layers, trust_pickle)
    kinds: dict[str, int] = {}
    for n in names:
        kinds[_kind_of(n)] = kinds.get(_kind_of(n), 0) + 1
    notes = tuple(n for lay in layouts for n in lay.notes)
    report = BufferReport(tuple(rows), tuple(range(len(sources))), 0, atol, checked=len(sources) > 1)
    parameters = len(views[0].meta) - len(_names(views[0])) if recorded else 0
    kind, tag = (layouts[0].kind, layouts[0].tag) if len(layouts) == 1 else ("files compared", None)
    if len(layouts) == 1 and not layouts[0].per_rank:
        found, note = _beside(layouts[0], {n: d[0] for n, d in held.items()}, trust_pickle)
        floats = tuple(f for f in floats if f.name not in {b.name for b in found}) + found
        notes += note
    return CheckpointReport(kind, tuple(str(lay.path) for lay in layouts), tag,
                            tuple(s.label for s in sources), same, report, tuple(sorted(kinds.items())), counters,
                            tuple((p, s) for p, s in fresh.items() if s), notes, tuple(warnings), tuple(partial),
                            recorded, parameters, changes, degraded, floats)


def _dtype_findings(held: dict[str, tuple[str, ...]]) -> tuple[tuple[Degraded, ...], tuple[FloatCounter, ...]]:
    """By name (``doctor/_dtypes.py``): buffers held in 16 bits that must be float32, integer counters held as
    floats; each with the sources where."""
    degraded, floats = [], []
    for name, dtypes in held.items():
        rule = _dtypes.declared_by_name(name)
        if rule is not None:
            at = tuple(i for i, d in enumerate(dtypes) if (t := _dtypes.dtype_of(d)) is not None and rule.degraded(t))
            if at:
                degraded.append(Degraded(name, dtypes[at[0]], _dtypes.dtype_name(rule.dtype), rule.why, at))
        if _dtypes.integer_by_name(name):
            at = tuple(i for i, d in enumerate(dtypes) if _is_float(d))
            if at:
                floats.append(FloatCounter(name, dtypes[at[0]], "int64", at, "name"))
    return tuple(degraded), tuple(floats)


def _beside(lay: _ckpt_files.Layout, held: dict[str, str], trust_pickle: bool
            ) -> tuple[tuple[FloatCounter, ...], tuple[str, ...]]:
    """One copy (an export) inside or beside a DeepSpeed checkpoint (a ``latest`` file in its folder or the folder
    above): the buffers it holds as floats that the checkpoint's rank 0 holds as integers or flags. Its dtypes are
    read from metadata only; a checkpoint there that cannot be read is a note, never an error of this report."""
    here = lay.path if lay.path.is_dir() else lay.path.parent
    for root in (here, here.parent):
        if root == lay.path or not os.path.lexists(root / "latest"):
            continue
        try:
            found = _ckpt_files.locate(root, None, trust_pickle)
            if not found.per_rank:
                continue
            with unreadable(root), _ckpt_files.open_tensors(found.files[0], trust_pickle) as view:
                theirs = {n: view.meta[n][0] for n in _names(view)}
        except CheckpointError as e:
            return (), (f"a DeepSpeed checkpoint is beside it ({root}) but could not be read to compare dtypes: "
                        f"{e.args[0] if e.args else e}",)
        out = []
        for name, dtype in held.items():
            want = theirs.get(name)
            if want is not None and _is_float(dtype) and not (want.is_floating_point or want.is_complex):
                out.append(FloatCounter(name, dtype, _dtypes.dtype_name(want), (0,),
                                        f"{root} ({found.files[0].label})"))
        return tuple(out), ()
    return (), ()


def _counter_range(view: _ckpt_files.Tensors, names: Sequence[str]) -> tuple[int, int] | None:
    values = [int(view.get(n)) for n in names]
    return (min(values), max(values)) if values else None


def _dcp_warnings(layouts: Sequence[_ckpt_files.Layout], layers: dict[str, bool], trust_pickle: bool) -> list[str]:
    """Which ranks wrote each BatchNorm layer's statistics in a DCP folder; a warning when they mix."""
    out = []
    for lay in layouts:
        if lay.kind != "torch DCP":
            continue
        writers = _ckpt_files.dcp_writers(lay.files[0], trust_pickle)
        if not writers:
            out.append(f"{lay.path}: DCP keeps one copy of each replicated entry from whichever rank its planner "
                       "picks, and this folder does not say which: its BatchNorm statistics may mix ranks")
            continue
        mixed = []
        for prefix, counted in layers.items():
            keys = [prefix + s for s in _STATS[:2 + counted]]
            who = {k: sorted(writers.get(k, ())) for k in keys}
            if len({tuple(v) for v in who.values()}) > 1:
                mixed.append(f"{prefix.rstrip('.')} (" + ", ".join(
                    f"{k.rsplit('.', 1)[-1]} from rank {'/'.join(map(str, v))}" for k, v in who.items()) + ")")
        ranks = sorted({r for v in writers.values() for r in v})
        if mixed:
            out.append(f"{lay.path}: {len(mixed)} BatchNorm layer(s) hold statistics written by different ranks, "
                       f"a mixture no rank ever had: {'; '.join(mixed[:3])}{' ...' if len(mixed) > 3 else ''}")
        elif layers:
            out.append(f"{lay.path}: the entries were written by rank(s) {ranks}; each BatchNorm layer's "
                       "statistics come from one rank's copy, not from all ranks' data")
    return out


_VERIFY_BYTES = 256 * 2 ** 20


def _trust(trust_pickle: bool) -> None:
    if trust_pickle:
        _notice.warn("trust_pickle=True: unpickling the Python objects in these files can run arbitrary code; only for "
                     "files you trust", once="trust_pickle", stacklevel=4, here=True)  # not a collective: said here


def _path_arg(value: Any, fn: str, name: str) -> None:
    """InvalidArgumentError (a TypeError) naming ``fn``'s argument unless ``value`` is a path: a str or os.PathLike."""
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, (str, os.PathLike)):
        raise InvalidArgumentError(f"{fn}(): {name} must be a checkpoint's path, a str or os.PathLike (a file or "
                                   f"folder), got {type(value).__name__} {value!r:.80}")
    if isinstance(value, str) and not value:
        raise InvalidArgumentError(f"{fn}(): {name} is the empty string; give a checkpoint's file or folder")


def _atol(atol: Any) -> float:
    if isinstance(atol, bool) or not isinstance(atol, (int, float)) or not atol >= 0:
        raise InvalidArgumentError(_words.Said(_words.Arg("atol", "--atol"), f" must be a number >= 0, got {atol!r}"))
    return float(atol)


def _patterns(only: Iterable[str]) -> tuple[str, ...]:
    if isinstance(only, str):
        return (only,)
    try:
        pats = tuple(only)
    except TypeError:
        pats = (only,)  # type: ignore[assignment]
    if not all(isinstance(p, str) for p in pats):
        raise InvalidArgumentError(f"only must be a glob string or a list of them, got {only!r:.80}")
    return pats
