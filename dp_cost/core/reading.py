"""Reading input files that may be anything: only regular files, a size cap, UTF-8, bounded JSON
nesting. Every reader raises ``UnreadableFile`` with a short reason instead of hanging on a FIFO,
filling memory, or failing deep inside json with a RecursionError."""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
import sys

MAX_BYTES = 512 * 2**20  # a result is a few kB and a trace tens of MB; a file over this is not ours
MAX_DEPTH = 64  # a result nests 5 levels; json itself recurses (and fails) near 1000
_GZIP_MAGIC = b"\x1f\x8b"


class UnreadableFile(ValueError):
    """A file that cannot be read as what it should be; ``str()`` is the reason, one line."""


def _open_regular(path: str):
    """``path`` opened in binary, if it is a regular file under the size cap.

    O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever; it is then
    refused by the regular-file check on the open descriptor (no race with a renamed file).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        raise UnreadableFile(error.strerror or str(error)) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UnreadableFile("not a regular file")
    if info.st_size > MAX_BYTES:
        os.close(fd)
        raise UnreadableFile(f"larger than {MAX_BYTES // 2**20} MiB")
    return os.fdopen(fd, "rb")


def read_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of a regular file of at most MAX_BYTES; gzip content is decompressed (by
    extension or magic bytes), to at most MAX_BYTES as well."""
    path = os.fspath(path)
    with _open_regular(path) as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise UnreadableFile(f"larger than {MAX_BYTES // 2**20} MiB")
    if path.endswith(".gz") or data[:2] == _GZIP_MAGIC:
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as g:
                data = g.read(MAX_BYTES + 1)
        except (OSError, EOFError) as error:
            raise UnreadableFile(f"broken gzip ({error})") from None
        if len(data) > MAX_BYTES:
            raise UnreadableFile(f"larger than {MAX_BYTES // 2**20} MiB uncompressed")
    return data


def read_text(path: str | os.PathLike) -> str:
    """The file as UTF-8 text (see ``read_bytes``)."""
    try:
        return read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as error:
        raise UnreadableFile(f"not UTF-8 (byte {error.start})") from None


def nesting_depth(value) -> int:
    """How deep lists and dicts nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def read_json(path: str | os.PathLike, max_depth: int | None = MAX_DEPTH):
    """The parsed JSON of a regular UTF-8 file (plain or gzipped), without bare NaN/Infinity,
    nested at most ``max_depth`` deep (None: no check, for large traces). Raises UnreadableFile
    with the reason."""
    text = read_text(path)
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise UnreadableFile("JSON nested too deep to parse") from None
    except ValueError as error:
        raise UnreadableFile(f"not JSON ({error})") from None
    if max_depth is not None and nesting_depth(value) > max_depth:
        raise UnreadableFile(f"JSON nested deeper than {max_depth} levels")
    return value


def read_json_or_none(path: str | os.PathLike, warn=None):
    """``read_json``, or None: silently for a missing file, with one warning line on ``warn``
    (default stderr) naming the file and the reason for any other (for --resume's checks)."""
    if not os.path.lexists(path):
        return None
    try:
        return read_json(path)
    except UnreadableFile as error:
        print(f"warning: skipped {os.fspath(path)}: {error}", file=warn or sys.stderr)
        return None
