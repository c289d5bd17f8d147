"""The run directory: a contained name, a usable output directory, one process at a time.

Every file a run writes lies under ``<output_dir>/<run_name>/``: the run name is one plain path
component, no entry below the output directory on the way to a file may be a symbolic link
(checked here before a run starts; ``core.files`` refuses one again as it writes). A run holds
an ``flock`` on ``<run_dir>/.lock`` for as long as it runs, so two processes never measure into
one directory (and beside each other).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import tempfile

from dp_cost.core import files, scratch
from dp_cost.core.settings import UsageError

MAX_RUN_NAME = 100
LOCK_FILE = ".lock"
# Kernel pseudo filesystems: writing results there is never what was meant (/dev/shm is fine).
SYSTEM_DIRS = ("/proc", "/sys")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_run_name(name: str) -> None:
    """UsageError unless ``name`` is one plain path component."""
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or _CONTROL.search(name)
        or len(name) > MAX_RUN_NAME
    ):
        raise UsageError(
            f"--run_name must be one plain folder name (no '/', '\\', '.', '..' or control "
            f"characters, at most {MAX_RUN_NAME} characters), got {name!r}"
        )


def check_output_dir(output_dir: str) -> None:
    """UsageError when runs cannot be written under ``output_dir``; creates nothing (a missing
    directory is checked at its nearest existing parent, where it would be created)."""
    check_not_broken_link(output_dir)
    real = os.path.realpath(output_dir)
    if any(real == d or real.startswith(d + os.sep) for d in SYSTEM_DIRS):
        raise UsageError(f"--output_dir {output_dir} is under a system directory ({real})")
    existing = real
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"--output_dir {output_dir}: {existing} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):  # root passes access(); only a write tells
            pass
    except OSError as error:
        raise UsageError(f"--output_dir {output_dir} is not writable: {error.strerror}") from None


def check_not_broken_link(output_dir: str) -> None:
    """UsageError when ``output_dir`` goes through a symbolic link loop or a link to nothing:
    creating it would fail with a bare "File exists"."""
    try:
        os.stat(output_dir)
        return
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UsageError(
                f"--output_dir {output_dir} goes through a symbolic link loop: fix the link or "
                "pick another directory"
            ) from None
    nearest = output_dir  # the deepest part of it that exists, a link included
    while nearest and not os.path.lexists(nearest) and os.path.dirname(nearest) != nearest:
        nearest = os.path.dirname(nearest)
    if nearest and os.path.islink(nearest) and not os.path.exists(nearest):
        raise UsageError(
            f"--output_dir {output_dir}: {nearest} is a symbolic link to a missing path "
            f"({os.readlink(nearest)}): create its target or pick another directory"
        )


def check_resumable(output_dir: str, run_name: str | None) -> str:
    """The run directory --resume continues; UsageError unless --run_name names one that exists
    (a mistyped name would otherwise start a new run, measuring every config again)."""
    if run_name is None:
        raise UsageError("--resume continues a run: name it with --run_name")
    path = os.path.join(output_dir, run_name)
    if not os.path.isdir(path):
        raise UsageError(
            f"--resume: no run directory {path} to continue (drop --resume to start a new run)"
        )
    return path


def contained(root: str, path: str) -> bool:
    """Whether ``path`` resolves (symlinks followed) to ``root`` or below it."""
    root, path = os.path.realpath(root), os.path.realpath(path)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_contained(root: str, path: str) -> None:
    """UsageError unless ``path`` resolves inside ``root`` and no entry below ``root`` on the way
    to it (``path`` included) is a symbolic link."""
    if not contained(root, path):
        raise UsageError(
            f"{path} resolves outside {root} (through a symbolic link?): refusing to write there"
        )
    files.refuse_links(path, root)


def new_run_dir(output_dir: str, run_name: str, numbered: bool) -> str:
    """Create ``<output_dir>/<run_name>``; ``numbered`` (a default name): when it exists, the
    first free ``<run_name>_<n>``, so two runs started in the same second both run."""
    base = os.path.join(output_dir, run_name)
    candidate, n = base, 1
    while True:
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            if not numbered:
                raise UsageError(
                    f"run directory {base} exists: pick another --run_name or add --resume"
                ) from None
            n += 1
            candidate = f"{base}_{n}"


def kept_after_close(path: str) -> bool:
    """Whether the run directory ``path`` is there once the runs open now are closed: what
    --resume, in the command that continues an interrupted run, needs."""
    for run in RunDir.open_now:
        if run.path == path:
            return run.kept()
    return os.path.isdir(path)


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock``, held until ``release`` (or the process
    ends: the kernel drops it, so a killed run never leaves a stale lock)."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_FILE)
        # Never through a link, nor a file with other hard links: it is truncated below.
        fd = files.open_file(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(f"{run_dir} is in use by another run (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def remove_stale_temporaries(run_dir: str, lock_held: bool = False) -> bool:
    """Remove what a killed run left of its temporaries: its scratch folders
    (``scratch.PREFIX``) and its atomic writes' temporaries (``files.TEMPORARY_NAME``, regular
    files only) in the run directory and its folders (config directories, visualizations/),
    reached through descriptors without following a link; unless a live run may be writing
    them: ``lock_held``, the caller holds the run's lock (--resume); else it is taken for the
    removal, and nothing is removed while a run holds it (nor where no run's lock is). Whether
    they were removed."""
    if not lock_held:
        with _lock_unless_held(run_dir) as free:
            return free and remove_stale_temporaries(run_dir, lock_held=True)
    with files.folder(run_dir) as fd:
        _remove_temporaries(fd)
        for name in os.listdir(fd):
            try:
                below = os.open(name, _FOLDER_FLAGS, dir_fd=fd)
            except OSError:  # a file, or a link: not a folder of the run's
                continue
            if name.startswith(scratch.PREFIX):
                os.close(below)
                files.remove_tree(fd, run_dir, name)
                continue
            try:
                _remove_temporaries(below)
            finally:
                os.close(below)
    return True


def _remove_temporaries(fd: int) -> None:
    for name in os.listdir(fd):
        if files.TEMPORARY_NAME.fullmatch(name):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=fd)


@contextlib.contextmanager
def _lock_unless_held(run_dir: str):
    """The lock of ``run_dir`` held inside, unless a live run holds it: yields whether it is
    (False for a directory without a lock file: no run's, e.g. a folder of runs, whose runs'
    own locks are not taken here)."""
    try:
        fd = files.open_file(os.path.join(run_dir, LOCK_FILE), os.O_RDONLY)
    except FileNotFoundError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a run is writing there now
            yield False
        else:
            yield True
    finally:
        os.close(fd)  # closing drops the flock


class RunDir:
    """This run's directory, made (or found, with --resume) and locked. ``close`` releases the
    lock and removes the directory if this run made it and nothing but the lock and
    ``kept_names`` (the run's own record) was written into it: an interrupt or an error before
    any config wrote a file leaves no run directory holding only a lock."""

    open_now: list[RunDir] = []  # not closed yet: the CLI closes them, whatever ends the run

    def __init__(self, path: str, made: bool, kept_names: tuple[str, ...] = ()):
        self.path, self.made, self.lock = path, made, None
        self.bookkeeping = {LOCK_FILE, *kept_names}
        RunDir.open_now.append(self)
        try:
            self.lock = RunLock(path)
        except BaseException:
            self.close()
            raise

    def kept(self) -> bool:
        """Whether ``close`` keeps the directory: only one this run made and locked (a lock
        that failed means another process holds it, and may be writing into it) holding
        nothing but the bookkeeping (and its scratch folder, gone when the run ends) is
        removed."""
        try:
            if not (self.made and self.lock is not None):
                return True
            with files.folder(self.path) as fd:  # its names: below PATH_MAX however deep
                names = {n for n in os.listdir(fd) if not n.startswith(scratch.PREFIX)}
            return not names <= self.bookkeeping
        except OSError:
            return False

    def close(self) -> None:
        if self not in RunDir.open_now:
            return
        RunDir.open_now.remove(self)
        try:
            if not self.kept():
                with files.folder(self.path) as fd:  # its names: below PATH_MAX however deep
                    for name in self.bookkeeping:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(name, dir_fd=fd)
                os.rmdir(self.path)
        except OSError:
            pass  # something else is in it now: kept
        finally:
            if self.lock is not None:
                self.lock.release()
