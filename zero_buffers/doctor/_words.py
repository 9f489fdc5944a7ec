"""Private: the doctor's messages name an argument the way its reader passed it.

A message is built as parts: plain text, and :class:`Arg` wherever it names an argument (``in_place=True`` in Python,
``--in-place`` on the command line) or a command to run. :class:`Said` is that message as a ``str`` (the Python
spelling, what ``str(error)`` and ``report.warnings`` hold) that keeps its parts, so the CLI prints the same message
with its own flags (:func:`for_cli`). The structure travels with the message; the spelling is chosen when printed.
"""
from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Arg:
    """One argument or command, as Python code writes it and as the command line does."""

    python: str
    cli: str


Part = str | Arg


class Said(str):
    """A message in its Python spelling that remembers its parts (:func:`for_cli` spells them as flags)."""

    parts: tuple[Part, ...]

    def __new__(cls, *parts: Part) -> Said:
        flat: list[Part] = []
        for p in parts:
            flat.extend(p.parts if isinstance(p, Said) else (p,))
        self = super().__new__(cls, "".join(p if isinstance(p, str) else p.python for p in flat))
        self.parts = tuple(flat)
        return self

    def __reduce__(self) -> tuple[type, tuple[Part, ...]]:
        return (Said, self.parts)


def for_cli(text: object) -> str:
    """``text`` with every argument spelled as the command line's flag (plain text as it is)."""
    parts = getattr(text, "parts", None)
    if isinstance(text, Said) and parts is not None:
        return "".join(p if isinstance(p, str) else p.cli for p in parts)
    return str(text)


def error_text(e: BaseException) -> str:
    """An exception's message for the command line."""
    return for_cli(e.args[0]) if e.args and isinstance(e.args[0], Said) else str(e)


def join(parts: Iterable[Part], sep: str) -> Said:
    out: list[Part] = []
    for i, p in enumerate(parts):
        out += [sep, p] if i else [p]
    return Said(*out)


# -- the arguments the doctor's messages name ------------------------------------------------------------------------

IN_PLACE = Arg("in_place=True", "--in-place")
OUT = Arg("out=...", "-o OUT")
TRUST_PICKLE = Arg("trust_pickle=True", "--trust-pickle")
WITH_TRUST_PICKLE = Arg(" with trust_pickle=True", " with --trust-pickle")


def tag(value: str) -> Arg:
    return Arg(f"tag={value!r}", f"--tag {shlex.quote(value)}")


def only(patterns: Sequence[str]) -> Arg:
    return Arg(f"only={list(patterns)!r}", " ".join(f"--only {shlex.quote(p)}" for p in patterns))


def recover(path: object) -> Arg:
    """The call, or the command, that only recovers what an interrupted repair of ``path`` left."""
    return Arg(f"zero_buffers.recover_checkpoint({str(path)!r})", f"zero-buffers repair {shlex.quote(str(path))} "
               "--recover")


def dtypes_from(path: object) -> Arg:
    return Arg(f"dtypes_from={str(path)!r}", f"--dtypes-from {shlex.quote(str(path))}")


# -- dtype findings, in words (the report holds them as data: doctor/report.py) -------------------------------------

def dtype_change(name: str, dtypes: Sequence[str], who: Callable[[int], str]) -> str:
    """"0.num_batches_tracked int64 -> float32 (source 1)": the reference's dtype, then each other one and where."""
    others: dict[str, list[int]] = {}
    for i, d in enumerate(dtypes[1:], 1):
        if d != dtypes[0]:
            others.setdefault(d, []).append(i)
    return f"{name} " + "; ".join(f"{dtypes[0]} -> {d} ({', '.join(who(i) for i in at)})" for d, at in others.items())


def dtype_cell(dtypes: Sequence[str], who: Callable[[int], str]) -> str:
    """A table's dtype column for a buffer whose dtype differs: "int64 (source 1: float32)"."""
    return dtypes[0] + " (" + ", ".join(f"{who(i)}: {d}" for i, d in enumerate(dtypes) if d != dtypes[0]) + ")"


RESTORE = Arg("zero_buffers.repair_checkpoint(PATH, OUT, dtypes_from=TRAINING_CKPT)",
              "zero-buffers repair PATH --dtypes-from TRAINING_CKPT -o OUT")


def dtype_changes(lines: Sequence[str], integers: bool) -> Said:
    head = f"{len(lines)} buffer(s) change dtype between the copies (a difference whatever their values): "
    shown = "; ".join(lines[:6]) + (f" and {len(lines) - 6} more" if len(lines) > 6 else "")
    if not integers:
        return Said(head + shown)
    return Said(head + shown, ". An integer buffer stored as a float is what an export that casts every buffer with "
                ".float() writes (DeepSpeed 0.16's zero_to_fp32); `", RESTORE, "` casts it back, exactly or not at all")


def float_counters(names: Sequence[str], held: str, expected: str, where: str, evidence: str) -> Said:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    if evidence == "name":
        how = (f"they are integer counters wherever BatchNorm keeps them ({expected}); this was inferred from their "
               "names alone")
    else:
        how = f"the training checkpoint beside it, {evidence}, holds them as {expected}"
    return Said(f"{len(names)} integer buffer(s) held as {held} on {where}: {shown}; {how}. This is what an export "
                "that casts every buffer with .float() writes (DeepSpeed 0.16's zero_to_fp32); `", RESTORE,
                "` restores the dtype, exactly or not at all")


def degraded(names: Sequence[str], held: str, declared: str, why: str, where: str) -> str:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"{len(names)} buffer(s) held in {held} on {where} that must stay {declared}: {shown} ({why}). An "
            "update computed in 16 bits drops every increment below half a step of the value, so these stagnate; "
            "offline there is no module, so this was inferred from the names. Keep them in "
            f"{declared} while training: zero_buffers.keep_precision(model)")


# -- why a reader stopped, in words ----------------------------------------------------------------------------------

_WHY = ((KeyError, "a record inside it refers to data it does not hold"),
        (IndexError, "a record inside it refers to data it does not hold"),
        (EOFError, "it ends before its data does (a truncated file?)"),
        (UnicodeDecodeError, "it holds text that is not UTF-8 where a name belongs"),
        (MemoryError, "it declares more data than fits in memory"),
        (OverflowError, "a size or count inside it is out of range"),
        (AttributeError, "it holds a value of a type no checkpoint holds there"),
        (TypeError, "it holds a value of a type no checkpoint holds there"))


def reason(e: BaseException) -> str:
    """Why a reader stopped on a file, in words: never the exception's class name (``KeyError: 101`` says nothing to
    the reader of a message); the exception's own first line where it is a sentence (torch's and the OS's are)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    for cls, words in _WHY:
        if isinstance(e, cls):
            return words
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text.split(". This is an internal miniz error")[0].strip()
    if len(text) < 8 or " " not in text:  # a bare key, a number, a code: nothing a person can act on
        return "the reader stopped on it"
    return text[:200]
