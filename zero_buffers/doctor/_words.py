"""Private: the doctor's messages name an argument the way its reader passed it.

A message is built as parts: plain text, and :class:`Arg` wherever it names an argument (``in_place=True`` in Python,
``--in-place`` on the command line) or a command to run. :class:`Said` is that message as a ``str`` (the Python
spelling, what ``str(error)`` and ``report.warnings`` hold) that keeps its parts, so the CLI prints the same message
with its own flags (:func:`for_cli`). The structure travels with the message; the spelling is chosen when printed.
"""
from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
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
