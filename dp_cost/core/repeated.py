"""A stretch of code whose ops stand for several repetitions of themselves, as the planner
counts them.

A loop that does the same ops on same-shaped slices N times (flash's tile pairs of a layer's
Gram norms) can run once on a planned step's fake tensors: its peak is one repetition's (each
frees its temporaries before the next), and the op record (``capacity.op_list.OpRecord``)
counts each op inside the range N times, so the step's time is still the loop's. The range is a
``torch.profiler.record_function`` of the name ``range_name`` gives, which the op record sees
as it sees the optimizer's, and which costs nothing elsewhere.
"""

from __future__ import annotations

REPEATED_RANGE = "dp_cost.repeated#"


def range_name(times: int) -> str:
    """The name of a range whose ops the planner counts ``times`` times."""
    return f"{REPEATED_RANGE}{times}"


def repeats(range_names: list[str]) -> int:
    """How many times an op inside these open ranges counts."""
    count = 1
    for name in range_names:
        if name.startswith(REPEATED_RANGE):
            count *= int(name.removeprefix(REPEATED_RANGE))
    return count
