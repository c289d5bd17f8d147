"""Where a distributed step's GPU time is exposed: in one rank's trace (a config directory's
rank 0 light trace, as the report reads it, or a trace file), each kind of collective's kernels
(count, time, when the first started and the last ended), the time the GPU spent in
communication with no computation beside it and in computation with no communication beside it,
the computation kernels that ran alone the longest, and both exposed times window by window
through the step. Holistic Trace Analysis (benchmarks/trace_overlap.py) gives the overlap shares;
this says which kernels and which part of the step make them, without HTA.

A communication kernel is one whose name holds "nccl"; every other kernel, copy and fill is
computation. Times are in ms from the trace's first GPU event.

    python benchmarks/trace_exposed.py RUN/standard_..._fsdp4x RUN/flash_..._fsdp4x --window_ms 25
"""

from __future__ import annotations

import argparse
import bisect
import os
import sys
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trace_overlap import rank_traces  # noqa: E402 (a sibling: the report's choice per rank)

from dp_cost.core import kernel_names  # noqa: E402
from dp_cost.core.reading import UnreadableFile  # noqa: E402

COLLECTIVES = ("AllGather", "ReduceScatter", "AllReduce", "Broadcast", "SendRecv")


def gpu_events(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, name) in µs of every GPU kernel, copy and fill, by start."""
    found = [
        (*span, str(e.get("name", "")))
        for e in events
        if str(e.get("cat", "")).lower() in kernel_names.GPU_ACTIVITY_CATEGORIES
        and (span := kernel_names.event_span(e))
    ]
    return sorted(found)


def is_communication(name: str) -> bool:
    return "nccl" in name.lower()


def collective_kind(name: str) -> str:
    return next((kind for kind in COLLECTIVES if kind in name), "other")


class Union:
    """The union of intervals, asked how much of [start, end) it covers."""

    def __init__(self, intervals):
        self.starts, self.ends = kernel_names._merged(list(intervals))

    def covered(self, start: float, end: float) -> float:
        i, total = max(0, bisect.bisect_right(self.starts, start) - 1), 0.0
        while i < len(self.starts) and self.starts[i] < end:
            total += max(0.0, min(end, self.ends[i]) - max(start, self.starts[i]))
            i += 1
        return total

    def total(self) -> float:
        return sum(e - s for s, e in zip(self.starts, self.ends))

    def pieces(self):
        return zip(self.starts, self.ends)


def exposure(events: list[dict], window_ms: float = 25.0, top: int = 10) -> dict:
    """What ``events`` (one rank's trace) say of its communication and computation, in ms."""
    gpu = gpu_events(events)
    if not gpu:
        raise ValueError("no GPU kernels in the trace")
    origin = gpu[0][0]
    comm = [g for g in gpu if is_communication(g[2])]
    compute = [g for g in gpu if not is_communication(g[2])]
    comm_union, compute_union = Union(g[:2] for g in comm), Union(g[:2] for g in compute)
    kinds: dict = defaultdict(lambda: {"count": 0, "ms": 0.0, "first_ms": None, "last_ms": 0.0})
    for start, end, name in comm:
        kind = kinds[collective_kind(name)]
        kind["count"] += 1
        kind["ms"] += (end - start) / 1e3
        if kind["first_ms"] is None:
            kind["first_ms"] = (start - origin) / 1e3
        kind["last_ms"] = max(kind["last_ms"], (end - origin) / 1e3)
    windows: dict = defaultdict(lambda: [0.0, 0.0])  # start ms -> [compute alone, comm alone]
    width = window_ms * 1e3
    alone_by_kernel: Counter = Counter()
    for union, other, column in ((compute_union, comm_union, 0), (comm_union, compute_union, 1)):
        for start, end in union.pieces():  # each piece split at the window edges
            first, last = int((start - origin) // width), int((end - origin) // width)
            for index in range(first, last + 1):
                low = max(start, origin + index * width)
                high = min(end, origin + (index + 1) * width)
                if high > low:
                    alone = (high - low) - other.covered(low, high)
                    windows[index * window_ms][column] += alone / 1e3
    for start, end, name in compute:  # by kernel: its own time with no collective beside it
        alone = (end - start) - comm_union.covered(start, end)
        if alone > 0:
            alone_by_kernel[kernel_names.short_name(name)] += alone / 1e3
    return {
        "span_ms": (max(g[1] for g in gpu) - origin) / 1e3,
        "collectives": dict(sorted(kinds.items())),
        "communication_ms": comm_union.total() / 1e3,
        "computation_ms": compute_union.total() / 1e3,
        "communication_alone_ms": sum(w[1] for w in windows.values()),
        "computation_alone_ms": sum(w[0] for w in windows.values()),
        "alone_kernels": alone_by_kernel.most_common(top),
        "windows": {start: tuple(w) for start, w in sorted(windows.items())},
    }


def report(label: str, found: dict) -> str:
    lines = [
        f"{label}",
        f"  span {found['span_ms']:.1f} ms; communication {found['communication_ms']:.1f} ms "
        f"({found['communication_alone_ms']:.1f} alone), computation "
        f"{found['computation_ms']:.1f} ms ({found['computation_alone_ms']:.1f} alone)",
    ]
    for kind, k in found["collectives"].items():
        lines.append(
            f"  {kind}: {k['count']} kernels, {k['ms']:.1f} ms, from {k['first_ms']:.1f} to "
            f"{k['last_ms']:.1f} ms"
        )
    lines.append("  computation alone, by kernel (ms):")
    lines += [f"    {ms:8.2f}  {name}" for name, ms in found["alone_kernels"]]
    lines.append("  by window (start ms: computation alone / communication alone, ms):")
    for start, (alone_compute, alone_comm) in found["windows"].items():
        lines.append(f"    {start:7.0f}: {alone_compute:6.1f} / {alone_comm:6.1f}")
    return "\n".join(lines)


def trace_of(given: str) -> str:
    """The trace file ``given`` names, or rank 0's in the config directory it names."""
    if os.path.isfile(given):
        return given
    traces = rank_traces(given)
    if not traces:
        raise ValueError(f"{given}: no trace in it")
    return traces[min(traces)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", nargs="+", help="config directories or trace files")
    parser.add_argument("--window_ms", type=float, default=25.0, help="window width, ms")
    parser.add_argument("--top", type=int, default=10, help="kernels listed")
    args = parser.parse_args(argv)
    if args.window_ms <= 0 or args.top < 0:
        parser.error("--window_ms must be positive and --top not negative")
    for given in args.traces:
        try:
            path = trace_of(given)
            found = exposure(kernel_names.load_trace_events(path), args.window_ms, args.top)
        except (OSError, UnreadableFile, ValueError) as error:
            print(f"error: {given}: {error}", file=sys.stderr)
            return 1
        print(report(path, found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
