"""Private: what the checkpoint doctor checks before it opens a file someone else wrote.

- Only regular files are opened: a FIFO named ``rank0.pt`` would block the reader forever, ``/dev/zero`` behind
  a link would never end. Links are followed (a rank file may be a link); a link loop is an error.
- A file's content must be the kind its name says (a pickle named ``.safetensors``, a safetensors file named
  ``.pt``, a zip archive named ``.metadata`` are refused, never read as another kind).
- A torch zip archive must be laid out as ``torch.save`` writes it: every member stored (torch never compresses),
  inside the file, no two overlapping. Then checking every member's CRC-32 or mapping it costs at most the file's
  size, whatever sizes its directory declares.
- Small text files (DeepSpeed's ``latest``) are read up to a cap.

Every refusal is a :class:`CheckpointError` naming the file and what is wrong with it.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import struct
import sys
import zipfile
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointError
from . import _words

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header: 30 bytes, then the name and the extra field
_LOCAL_SIGNATURE = 0x04034B50
_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}


def describe_mode(mode: int) -> str:
    """What a non-regular file is, in words."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def regular(path: Path) -> int:
    """The size of ``path``, a regular file (through links); CheckpointError for anything else."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: a loop of symbolic links, not a file", str(path)) from e
        if e.errno == errno.ENOENT:
            what = "a symbolic link to nothing" if os.path.islink(path) else "no such file"
            raise CheckpointError(f"{path}: {what}", str(path)) from e
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})", str(path)) from e
    if not stat.S_ISREG(st.st_mode):
        link = f" (behind a link to {os.readlink(path)})" if os.path.islink(path) else ""
        raise CheckpointError(f"{path}: {describe_mode(st.st_mode)}{link}, not a regular file: the doctor opens "
                              "regular files only", str(path))
    return st.st_size


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of a small regular file, at most ``limit`` of them (CheckpointError when it is larger)."""
    size = regular(path)
    if size > limit:
        raise CheckpointError(f"{path}: {size} bytes; a file of at most {limit} bytes was expected here", str(path))
    with open(path, "rb") as f:
        return f.read(limit + 1)[:limit]


def sniff(head: bytes, size: int) -> str:
    """What a file's first 9 bytes say it is: "zip", "safetensors", "pickle" or "other"."""
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if len(head) >= 9 and head[8:9] == b"{":
        (n,) = struct.unpack("<Q", head[:8])
        if 2 <= n <= size - 8:
            return "safetensors"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    return "other"


_WORDS = {"zip": "a zip archive (torch.save's format)", "safetensors": "a safetensors file",
          "pickle": "a Python pickle", "other": "neither a zip archive, a pickle nor a safetensors file"}


def expect_kind(path: Path, allowed: tuple[str, ...], named: str) -> tuple[str, int]:
    """(kind, size) of the regular file ``path``; CheckpointError when its content is not one of ``allowed``
    (``named``: what its name promised, "a torch checkpoint" ...)."""
    size = regular(path)
    with open(path, "rb") as f:
        head = f.read(9)
    kind = sniff(head, size)
    if kind not in allowed:
        hint = {"safetensors": " (rename it .safetensors)", "zip": " (rename it .pt)"}.get(kind, "")
        what = _WORDS[kind]
        if kind == "other" and head[8:9] == b"{":
            what = f"a header declaring {struct.unpack('<Q', head[:8])[0]} bytes, in a file of {size}"
        raise CheckpointError(f"{path}: not {named}: it holds {what}; a file is read only as the kind its name "
                              f"says{hint if 'metadata' not in named else ''}", str(path))
    return kind, size


def check_zip(f: BinaryIO, size: int, where: str) -> None:
    """``f`` (``size`` bytes) is a zip archive laid out as torch writes one: every member stored, its data inside the
    file before the next member, so no member declares more bytes than the file has. CheckpointError otherwise."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: a truncated or corrupt torch checkpoint: {what}", where)

    try:
        with zipfile.ZipFile(f) as z:
            members = sorted(z.infolist(), key=lambda i: i.header_offset)
            end_of_data = z.start_dir
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, struct.error,
            NotImplementedError, UnicodeDecodeError) as e:
        raise bad(f"not a readable zip archive ({_words.reason(e)})") from e
    if end_of_data > size:
        raise bad(f"its directory starts at byte {end_of_data}, past the end of the file ({size} bytes)")
    for i, m in enumerate(members):
        if m.compress_type != zipfile.ZIP_STORED:
            raise bad(f"member {m.filename!r} is compressed (method {m.compress_type}); torch.save stores every "
                      "member uncompressed")
        if m.compress_size != m.file_size:
            raise bad(f"member {m.filename!r} declares {m.file_size} bytes but stores {m.compress_size}")
        limit = members[i + 1].header_offset if i + 1 < len(members) else end_of_data
        f.seek(m.header_offset)
        header = f.read(_LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(header)[0] != _LOCAL_SIGNATURE:
            raise bad(f"member {m.filename!r} has no local header at byte {m.header_offset}")
        *_, name_len, extra_len = _LOCAL_HEADER.unpack(header)
        end = m.header_offset + _LOCAL_HEADER.size + name_len + extra_len + m.compress_size
        if end > limit:
            past = "the end of the file" if limit == end_of_data else f"the start of member {members[i + 1].filename!r}"
            raise bad(f"member {m.filename!r} declares {m.compress_size} bytes, which run past {past} (byte {limit})")


_MISSING_ATTRIBUTE = re.compile(r"Can't get attribute '([^']+)' on <module '([^']+)'")


def unpickling_failed(path: Path, error: BaseException, trusted: bool) -> CheckpointError:
    """The CheckpointError for a pickle that could not be loaded: a class whose code is not here (defined in the
    script that saved it, or in a module not installed) is named as such."""
    found = _MISSING_ATTRIBUTE.search(str(error))
    how: str | _words.Arg = _words.WITH_TRUST_PICKLE if trusted else ""
    main = sys.modules.get("__main__")
    mains = {"__main__", getattr(getattr(main, "__spec__", None), "name", None)}  # python -m shows the spec's name
    if isinstance(error, ModuleNotFoundError):
        why = _words.Said(f"it refers to the Python module {error.name!r}, which is not importable here: unpickling",
                          how, " needs the code that wrote it installed")
    elif found and found.group(2) in mains:
        why = _words.Said(f"it refers to the class {found.group(1)}, defined in the script that saved it (__main__): "
                          "unpickling", how, " needs that class, which this process does not have")
    elif found:
        why = _words.Said(f"it refers to {found.group(2)}.{found.group(1)}, which that module does not define here")
    else:
        why = _words.Said("unpickling it", how, f" failed: {_words.reason(error)}")
    return CheckpointError(_words.Said(f"{path}: cannot be loaded: ", why), str(path))
