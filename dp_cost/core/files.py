"""Every file the toolkit writes goes through ``atomic_write``; results are read back safely."""

from __future__ import annotations

import contextlib
import json
import math
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
    """Strict JSON: a non-finite float is written as null (see ``non_finite_paths``)."""
    with atomic_write(path) as f:
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
