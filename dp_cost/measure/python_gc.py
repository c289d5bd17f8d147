"""Python's cyclic garbage collector around measured steps: what it did inside them."""

from __future__ import annotations

import gc
import time


class GarbageCollections:
    """Python's cyclic garbage collections while inside: how many per generation, and the host
    ms they took (gc.callbacks: each collection's start and stop)."""

    def __init__(self):
        self.counts = [0, 0, 0]
        self.ms = 0.0
        self._start = None

    def _callback(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.counts[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._start) * 1e3
            self._start = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def result(self) -> dict:
        return {"collections": list(self.counts), "ms": self.ms}
