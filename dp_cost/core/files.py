"""Every file the toolkit writes goes through here; results are written as strict JSON.

A write names a root, the folder it must stay inside (by default the file's own folder; for a
run, the run directory). The root is opened as given (``--output_dir`` may be a link the user
made); every folder below it is entered through the descriptor of the one above, never following
a symbolic link, and the file itself is a fresh temporary (``O_CREAT|O_EXCL``, a random name)
renamed over its name. A link planted where the toolkit writes, file or folder, is refused with
``UnsafePath``: one line, nothing written through it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import shutil
import stat

from dp_cost.core.reading import stat_at
from dp_cost.core.settings import UsageError

# atomic_write's temporaries, <name>.tmp<20 random digits>: the only names leftover removal
# deletes.
TEMPORARY_NAME = re.compile(r".+\.tmp\d{20}")
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_UTF8 = {"encoding": "utf-8"}


class UnsafePath(UsageError):
    """A symbolic link (or an entry of the wrong kind) where the toolkit writes: refused."""


def temporary_name(name: str) -> str:
    """``<name>.tmp<20 random digits>``: no one can plant a link at it beforehand."""
    return f"{name}.tmp{secrets.randbits(64):020d}"


def _refusal(parent_fd: int, name: str, shown: str, kind: str) -> UnsafePath:
    """Why the entry ``name`` of the folder ``parent_fd`` cannot be written as a ``kind``."""
    try:
        mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        mode = 0
    if stat.S_ISLNK(mode):
        return UnsafePath(f"{shown} is a symbolic link: refusing to write through it")
    return UnsafePath(f"{shown} is not a {kind}: refusing to write there")


def _parts_below(path: str, root: str) -> list[str]:
    """The folder names leading from ``root`` to ``path`` (lexically: no link is resolved)."""
    relative = os.path.relpath(path, root)
    if relative == os.curdir:
        return []
    parts = relative.split(os.sep)
    if parts[0] == os.pardir:
        raise UnsafePath(f"{path} is not inside {root}: refusing to write there")
    return parts


@contextlib.contextmanager
def folder(path: str, root: str | None = None, create: bool = False):
    """A descriptor of the folder ``path``: ``root`` (default: ``path`` itself) opened as given,
    each folder below it entered without following a link (``create``: made when missing)."""
    path = path or os.curdir
    root = path if root is None else (root or os.curdir)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        shown = root
        for part in _parts_below(path, root):
            shown = os.path.join(shown, part)
            if create:
                with contextlib.suppress(FileExistsError):  # a link there is refused below
                    os.mkdir(part, 0o777, dir_fd=fd)
            try:
                below = os.open(part, _FOLDER_FLAGS, dir_fd=fd)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refusal(fd, part, shown, "folder") from None
                raise
            os.close(fd)
            fd = below
        yield fd
    finally:
        os.close(fd)


def make_folder(path: str, root: str) -> None:
    """Create the folder ``path`` and those between it and ``root``; UnsafePath for a link."""
    with folder(path, root=root, create=True):
        pass


def _split_file(path: str) -> tuple[str, str]:
    parent, name = os.path.split(path)
    if name in ("", os.curdir, os.pardir):
        raise UnsafePath(f"{path} is not a file name: refusing to write there")
    return parent, name


def _refuse_link(parent_fd: int, name: str, shown: str) -> None:
    """UnsafePath when ``name`` is a symbolic link. A rename never follows one, but a planted
    link is refused, not silently replaced; anything else there (a FIFO) is only a name the
    rename replaces."""
    try:
        mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise _refusal(parent_fd, name, shown, "regular file")


def _new_temporary(parent_fd: int, name: str) -> tuple[str, int]:
    for _ in range(100):  # a name taken (by chance, or planted): draw another
        temporary = temporary_name(name)
        try:
            return temporary, os.open(temporary, _NEW_FILE_FLAGS, 0o666, dir_fd=parent_fd)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name beside it", name)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", opener=None, root: str | None = None):
    """Write ``path`` through a temporary beside it, renamed to ``path`` once written, so a
    reader (or an interrupted run) never sees a half-written file. ``root``: the folder it must
    stay inside (default: its own folder); missing folders between are created. ``opener``:
    wraps the binary file, ``opener(file, mode)`` (``gzip.open``). Text is UTF-8."""
    parent, name = _split_file(path)
    with folder(parent, root=root, create=True) as parent_fd:
        _refuse_link(parent_fd, name, path)
        temporary, fd = _new_temporary(parent_fd, name)
        binary = opener is not None or "b" in mode
        try:
            with os.fdopen(fd, "wb" if binary else mode, **({} if binary else _UTF8)) as f:
                if opener is None:
                    yield f
                else:
                    with opener(f, mode) as wrapped:
                        yield wrapped
            os.replace(temporary, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary, dir_fd=parent_fd)
            raise


def open_file(path: str, flags: int, root: str | None = None, mode: int = 0o644) -> int:
    """A descriptor of the regular file ``path`` (``flags`` as ``os.open``'s), opened without
    following a link, its folders as in ``atomic_write``. Opened for writing, a file with other
    hard links is refused too: writing it would change them."""
    parent, name = _split_file(path)
    with folder(parent, root=root, create=bool(flags & os.O_CREAT)) as parent_fd:
        # O_NONBLOCK: a FIFO planted there is refused below instead of blocking the open.
        extra = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(name, flags | extra, mode, dir_fd=parent_fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise _refusal(parent_fd, name, path, "regular file") from None
            raise
    info = os.fstat(fd)
    writes = flags & (os.O_WRONLY | os.O_RDWR)
    if not stat.S_ISREG(info.st_mode) or (writes and info.st_nlink != 1):
        os.close(fd)
        why = "is not a regular file" if not stat.S_ISREG(info.st_mode) else "has other hard links"
        raise UnsafePath(f"{path} {why}: refusing to open it")
    return fd


def refuse_links(path: str, root: str) -> None:
    """UnsafePath when an existing entry on the way from ``root`` to ``path`` (``path`` itself
    included) is a symbolic link: a check before a run starts; every write checks again, on
    the descriptors it writes through."""
    current = root
    for part in _parts_below(path, root):
        current = os.path.join(current, part)
        try:  # relative to root: a path longer than PATH_MAX is checked too
            mode = stat_at(current, root, follow=False).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISLNK(mode):
            raise UnsafePath(f"{current} is a symbolic link: refusing to write through it")


class Staging:
    """A new private folder (mode 0o700, a random name) inside a folder, for a writer that takes
    only a path (torch.profiler's trace handler). ``path``: the folder as ``/proc/self/fd/N``
    where there is one, so the writer reaches this very folder even if its name is swapped for a
    link; ``publish`` moves a file from it into the folder, as ``atomic_write`` would."""

    def __init__(self, parent_fd: int, parent: str, prefix: str):
        self.parent_fd, self.parent = parent_fd, parent
        for _ in range(100):
            self.name = f"{prefix}{secrets.token_hex(8)}"
            try:
                os.mkdir(self.name, 0o700, dir_fd=parent_fd)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(errno.EEXIST, "no free staging folder name", parent)
        self.fd = os.open(self.name, _FOLDER_FLAGS, dir_fd=parent_fd)
        by_descriptor = f"/proc/self/fd/{self.fd}"
        self.path = (
            by_descriptor if os.path.isdir(by_descriptor) else os.path.join(parent, self.name)
        )

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def publish(self, name: str) -> str:
        """Move ``name`` into the folder; its path there."""
        shown = os.path.join(self.parent, name)
        _refuse_link(self.parent_fd, name, shown)
        os.replace(name, name, src_dir_fd=self.fd, dst_dir_fd=self.parent_fd)
        return shown

    def remove(self) -> None:
        """Remove the folder and everything left in it (a writer's files and folders)."""
        remove_tree(self.parent_fd, self.parent, self.name)
        os.close(self.fd)


def remove_tree(parent_fd: int, parent: str, name: str) -> None:
    """Remove the folder ``name`` of the folder ``parent_fd`` (``parent``) and all in it, found
    by the descriptor where /proc has it (no link swapped in for a folder on the way is
    followed: shutil.rmtree never follows one below its top); an error leaves the rest."""
    by_descriptor = f"/proc/self/fd/{parent_fd}"
    where = by_descriptor if os.path.isdir(by_descriptor) else parent
    shutil.rmtree(os.path.join(where, name), ignore_errors=True)


@contextlib.contextmanager
def staging(path: str, root: str, prefix: str):
    """A ``Staging`` folder inside the folder ``path`` (entered from ``root`` as in
    ``atomic_write``), removed on the way out whatever happened."""
    with folder(path, root=root) as parent_fd:
        stage = Staging(parent_fd, path, prefix)
        try:
            yield stage
        finally:
            stage.remove()


def write_text(path: str, text: str, root: str | None = None) -> None:
    with atomic_write(path, root=root) as f:
        f.write(text)


def write_json(path: str, data, root: str | None = None) -> None:
    """Strict JSON: a non-finite float is written as null (see ``non_finite_paths``)."""
    with atomic_write(path, root=root) as f:
        json.dump(finite(data), f, indent=2, allow_nan=False)


def finite(data):
    """``data`` with every NaN or infinite float replaced by None (strict JSON has neither)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: finite(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(value) for value in data]
    return data


def non_finite_paths(data, prefix: str = "") -> list[str]:
    """Where ``data`` holds NaN or infinite floats, as ``key.sub[index]`` paths."""
    if isinstance(data, float):
        return [] if math.isfinite(data) else [prefix or "value"]
    if isinstance(data, dict):
        items = ((f"{prefix}.{key}" if prefix else str(key), v) for key, v in data.items())
    elif isinstance(data, (list, tuple)):
        items = ((f"{prefix}[{i}]", v) for i, v in enumerate(data))
    else:
        return []
    return [path for key, value in items for path in non_finite_paths(value, key)]
