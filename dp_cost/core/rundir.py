"""The run directory: a contained name, a usable output directory, one process at a time.

Every file a run writes lies under ``<output_dir>/<run_name>/``: the run name is one plain path
component, and every path is checked again after resolving symlinks. A run holds an ``flock``
on ``<run_dir>/.lock`` for as long as it runs, so two processes never measure into one
directory (and beside each other).
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile

from dp_cost.core.settings import UsageError

MAX_RUN_NAME = 100
LOCK_FILE = ".lock"
# Kernel pseudo filesystems: writing results there is never what was meant (/dev/shm is fine).
SYSTEM_DIRS = ("/proc", "/sys")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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


def contained(root: str, path: str) -> bool:
    """Whether ``path`` resolves (symlinks followed) to ``root`` or below it."""
    root, path = os.path.realpath(root), os.path.realpath(path)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_contained(root: str, path: str) -> None:
    if not contained(root, path):
        raise UsageError(f"{path} resolves outside {root} (a symlink?): refusing to write there")


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


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock``, held until ``release`` (or the process
    ends: the kernel drops it, so a killed run never leaves a stale lock)."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_FILE)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
