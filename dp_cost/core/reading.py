"""Reading input files that may be anything: only regular files, a size cap, UTF-8, bounded JSON
nesting. Every reader raises ``UnreadableFile`` with a short reason instead of hanging on a FIFO,
filling memory, or failing deep inside json with a RecursionError. The caps are by what a file
holds; each flag's --help states its own.

A reader given a ``root`` (a run directory) opens the root as given and the rest of the path
relative to its descriptor, as ``core.files`` writes: a file of a run whose full path is longer
than the system's limit (PATH_MAX, 4096 bytes on Linux) is read back as it was written."""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
import sys
import zlib

MAX_BYTES = 512 * 2**20  # a trace is tens of MB; a file over this is not ours
# A result (result.json, result.rank<k>.json) or run.json: a few kB, more with many steps (their
# times, losses and snapshots). Checked on the size before reading: parsing a 200 MB list of
# floats took a minute and 4.6 GB.
MAX_RESULT_BYTES = 16 * 2**20
MAX_TOKEN_BYTES = 4096  # --token_file: a Hugging Face token is about 40 characters
# --dataset_path: SNLI's JSONL with its parse trees is about 470 MB, a line about 2 kB. Over
# these caps a file is not a dataset of this task (and reading it would exhaust memory).
DATASET_MAX_BYTES = 2**30
DATASET_MAX_LINE_BYTES = 2**20
MAX_DEPTH = 64  # a result nests 5 levels; json itself recurses (and fails) near 1000
_GZIP_MAGIC = b"\x1f\x8b"


class UnreadableFile(ValueError):
    """A file that cannot be read as what it should be; ``str()`` is the reason, one line."""


def size_words(size: int) -> str:
    """A cap in words: ``16 MiB``, ``4 KiB``, ``100 bytes``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} bytes"


def open_at(path: str | os.PathLike, flags: int, root: str | None = None) -> int:
    """``os.open(path, flags)``; with ``root``, ``path`` opened relative to ``root``'s
    descriptor (only the part below ``root`` is a name the system resolves)."""
    if root is None:
        return os.open(path, flags | os.O_CLOEXEC)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return os.open(os.path.relpath(path, root), flags | os.O_CLOEXEC, dir_fd=root_fd)
    finally:
        os.close(root_fd)


def stat_at(path: str | os.PathLike, root: str | None = None, follow: bool = True):
    """``os.stat`` of ``path`` (``follow``: through a final symbolic link), relative to
    ``root`` as in ``open_at``; OSError when there is nothing there."""
    if root is None:
        return os.stat(path, follow_symlinks=follow)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return os.stat(os.path.relpath(path, root), dir_fd=root_fd, follow_symlinks=follow)
    finally:
        os.close(root_fd)


def lexists_at(path: str | os.PathLike, root: str | None = None) -> bool:
    """Whether anything (a dangling link included) is at ``path``, as ``open_at`` reaches it."""
    try:
        stat_at(path, root, follow=False)
        return True
    except OSError:
        return False


def is_file_at(path: str | os.PathLike, root: str | None = None) -> bool:
    """Whether ``path`` (relative to ``root`` as in ``open_at``) is a regular file."""
    try:
        return stat.S_ISREG(stat_at(path, root).st_mode)
    except OSError:
        return False


def folder_names(path: str | os.PathLike, root: str | None = None) -> list[str]:
    """The names in the folder ``path`` (relative to ``root`` as in ``open_at``), sorted; []
    when it is no folder one can list."""
    try:
        fd = open_at(path, os.O_RDONLY | os.O_DIRECTORY, root)
    except OSError:
        return []
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)


def open_regular(path: str | os.PathLike, max_bytes: int, root: str | None = None):
    """``path`` opened in binary, if it is a regular file of at most ``max_bytes`` (relative
    to ``root`` as in ``open_at``).

    O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever; it is then
    refused by the regular-file check on the open descriptor (no race with a renamed file). The
    size is checked before anything is read; callers still read at most ``max_bytes`` + 1 (a
    regular file may grow while it is read).
    """
    try:
        fd = open_at(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0), root)
    except OSError as error:
        raise UnreadableFile(error.strerror or str(error)) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UnreadableFile("not a regular file")
    if info.st_size > max_bytes:
        os.close(fd)
        raise UnreadableFile(
            f"larger than the cap of {size_words(max_bytes)}: {info.st_size} bytes"
        )
    return os.fdopen(fd, "rb")


def read_bytes(
    path: str | os.PathLike, max_bytes: int | None = None, root: str | None = None
) -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` (default MAX_BYTES); gzip content is
    decompressed (by extension or magic bytes), to at most ``max_bytes`` as well. ``root``: see
    ``open_at``."""
    path = os.fspath(path)
    max_bytes = MAX_BYTES if max_bytes is None else max_bytes
    with open_regular(path, max_bytes, root) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnreadableFile(f"larger than the cap of {size_words(max_bytes)}")
    if path.endswith(".gz") or data[:2] == _GZIP_MAGIC:
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as g:
                data = g.read(max_bytes + 1)
        except (OSError, EOFError, zlib.error) as error:
            raise UnreadableFile(f"broken gzip ({error})") from None
        if len(data) > max_bytes:
            raise UnreadableFile(f"larger than the cap of {size_words(max_bytes)} uncompressed")
    return data


def read_text(
    path: str | os.PathLike, max_bytes: int | None = None, root: str | None = None
) -> str:
    """The file as UTF-8 text (see ``read_bytes``)."""
    try:
        return read_bytes(path, max_bytes, root).decode("utf-8")
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


def read_json(
    path: str | os.PathLike,
    max_depth: int | None = MAX_DEPTH,
    max_bytes: int | None = None,
    root: str | None = None,
):
    """The parsed JSON of a regular UTF-8 file (plain or gzipped) of at most ``max_bytes``
    (default MAX_BYTES), without bare NaN/Infinity, nested at most ``max_depth`` deep (None: no
    check, for large traces). Raises UnreadableFile with the reason. ``root``: see
    ``open_at``."""
    text = read_text(path, max_bytes, root)
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise UnreadableFile("JSON nested too deep to parse") from None
    except ValueError as error:
        raise UnreadableFile(f"not JSON ({error})") from None
    if max_depth is not None and nesting_depth(value) > max_depth:
        raise UnreadableFile(f"JSON nested deeper than {max_depth} levels")
    return value


def read_result(path: str | os.PathLike, root: str | None = None):
    """A result file's (or run.json's) parsed JSON: ``read_json`` under MAX_RESULT_BYTES."""
    return read_json(path, max_bytes=MAX_RESULT_BYTES, root=root)


# The unreadable files already warned about, as (path, device, inode, size, mtime, reason):
# --resume reads an earlier result in two checks, and a bad one is one warning, not two.
_warned: set[tuple] = set()


def read_json_or_none(path: str | os.PathLike, warn=None, root: str | None = None):
    """``read_result``, or None: silently for a missing file, with one warning line on ``warn``
    (default stderr) naming the file and the reason for any other (for --resume's checks and
    run.json). The same unchanged file with the same problem warns once per process. ``root``:
    see ``open_at``."""
    path = os.fspath(path)
    if not lexists_at(path, root):  # nothing there (a dangling link is there: warned about)
        return None
    try:
        return read_result(path, root)
    except UnreadableFile as error:
        try:
            info = stat_at(path, root)
            seen = (path, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, str(error))
        except OSError:  # a dangling link: nothing to tell one reading from the next
            seen = None
        if seen is None or seen not in _warned:
            print(f"warning: skipped {path}: {error}", file=warn or sys.stderr)
        if seen is not None:
            _warned.add(seen)
        return None
