"""Every file the toolkit writes goes through ``atomic_write``; results are read back safely."""

from __future__ import annotations

import contextlib
import json
import os


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", opener=open):
    """Open a temporary name beside ``path``; rename it to ``path`` once written, so a reader
    (or an interrupted run) never sees a half-written file. ``opener``: e.g. ``gzip.open``."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with opener(tmp, mode) as f:
            yield f
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def write_json(path: str, data) -> None:
    with atomic_write(path) as f:
        json.dump(data, f, indent=2)


def read_json(path: str):
    """The parsed file, or None when it is missing or not JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
