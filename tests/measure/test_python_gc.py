"""GarbageCollections against Python's own per-generation counters (gc.get_stats)."""

import gc

from dp_cost.measure.python_gc import GarbageCollections


def _cycles(n):
    for _ in range(n):
        a = []
        a.append(a)  # unreachable once the loop moves on: only the cyclic collector frees it


def test_counts_each_generation_as_python_does():
    was_enabled = gc.isenabled()
    gc.disable()  # only the collections asked for below
    try:
        before = [s["collections"] for s in gc.get_stats()]
        with GarbageCollections() as inside:
            _cycles(100)
            gc.collect(0)
            gc.collect(1)
            gc.collect(1)
            gc.collect(2)
        after = [s["collections"] for s in gc.get_stats()]
        gc.collect()  # outside: not counted
    finally:
        if was_enabled:
            gc.enable()
    assert inside.counts == [b - a for a, b in zip(before, after)] == [1, 2, 1]
    assert inside.result()["collections"] == [1, 2, 1]
    assert inside.ms > 0
