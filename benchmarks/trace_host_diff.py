"""Where one trainer's host time goes beyond another's: the host self time of every Python
function and torch op in two torch.profiler traces taken with Python stacks (the bench's and
``--mode=profile``'s full traces are), summed by name, and the difference.

Self time is an event's duration less that of the events nested in it on its thread (Python
functions and torch ops alike), so each microsecond counts once; CUDA runtime and driver calls
are not host events here, so their time is their caller's. Tracing with stacks slows the
host several-fold, and more for Python-heavy code: compare names and counts, and take the ms as
proportions, not as an untraced step's time.

    python benchmarks/trace_host_diff.py RUN/standard_bs8_seq512_bf16_sdpa \
        RUN/flash_bs8_seq512_bf16_sdpa --top 40

Each argument is a trace file or a config directory holding one (``trace*.pt.trace.json[.gz]``).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_cost.core import kernel_names  # noqa: E402
from dp_cost.core.reading import UnreadableFile  # noqa: E402

HOST_CATEGORIES = ("python_function", "cpu_op")


def trace_path(given: str) -> str:
    """The trace file ``given`` names, or the one trace in the config directory it names."""
    if os.path.isfile(given):
        return given
    found = sorted(glob.glob(os.path.join(given, "*.pt.trace.json*")))
    if len(found) != 1:
        raise ValueError(f"{given}: expected one *.pt.trace.json[.gz] in it, found {len(found)}")
    return found[0]


def event_name(event: dict) -> str:
    """A Python function's file(line): name, or "op " and a torch op's name; the address in a
    bound method's name dropped (it differs per object)."""
    name = str(event.get("name", ""))
    if event.get("cat") == "cpu_op":
        return "op " + name
    return name.split(" object at ")[0]


def host_self_times(events: list[dict]) -> tuple[dict[str, float], Counter]:
    """Self time in µs and call count by event_name over the host events of a trace."""
    by_thread: dict = defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in HOST_CATEGORIES:
            if isinstance(event.get("ts"), (int, float)) and isinstance(
                event.get("dur"), (int, float)
            ):
                by_thread[(event.get("pid"), event.get("tid"))].append(event)
    self_us: dict[str, float] = defaultdict(float)
    calls: Counter = Counter()
    for thread_events in by_thread.values():
        # Outer events first where two start together, so nesting follows the intervals.
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_events: list[tuple[dict, str]] = []
        for event in thread_events:
            while (
                open_events and event["ts"] >= open_events[-1][0]["ts"] + open_events[-1][0]["dur"]
            ):
                open_events.pop()
            name = event_name(event)
            if open_events:
                self_us[open_events[-1][1]] -= event["dur"]
            self_us[name] += event["dur"]
            calls[name] += 1
            open_events.append((event, name))
    return dict(self_us), calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", help="trace file or config directory (e.g. standard's)")
    parser.add_argument("other", help="trace file or config directory (e.g. flash's)")
    parser.add_argument("--top", type=int, default=40, help="names listed, by difference")
    args = parser.parse_args(argv)
    profiles = []
    for given in (args.baseline, args.other):
        try:
            path = trace_path(given)
            profiles.append(host_self_times(kernel_names.load_trace_events(path)))
        except (ValueError, UnreadableFile) as error:
            print(f"trace_host_diff.py: {error}", file=sys.stderr)
            return 2
        print(f"{given}: {sum(profiles[-1][1].values())} host events, "
              f"{sum(profiles[-1][0].values()) / 1e3:.1f} ms of self time")  # fmt: skip
    (base, base_calls), (other, other_calls) = profiles
    names = sorted(set(base) | set(other), key=lambda n: other.get(n, 0) - base.get(n, 0))
    print(f"\nms of self time, other - baseline, the {args.top} largest each way")
    print(f"{'diff':>8} {'baseline':>9} {'calls':>6} {'other':>9} {'calls':>6}  name")
    if len(names) > 2 * args.top:
        shown = names[::-1][: args.top] + ["..."] + names[: args.top][::-1]
    else:  # every name once
        shown = names[::-1]
    for name in shown:
        if name == "...":
            print("     ...")
            continue
        b, o = base.get(name, 0.0) / 1e3, other.get(name, 0.0) / 1e3
        counts = f"{base_calls[name]:6d} {o:9.2f} {other_calls[name]:6d}"
        print(f"{o - b:8.2f} {b:9.2f} {counts}  {name[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
