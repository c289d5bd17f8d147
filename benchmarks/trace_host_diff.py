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
The host events counted are those of the recorded step's ``train_step`` range (all of a trace
without one): the wait for the GPU after it is not the step's host work.

``--gpu``: the GPU's time instead, each kernel, copy and fill summed by its name and the Python
function that launched it (the innermost one around its launch on the host), so that one kernel
launched from two places (a foreach add in the optimizer and in the clipping) counts as two.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_cost.core import kernel_names  # noqa: E402
from dp_cost.core.reading import UnreadableFile  # noqa: E402

HOST_CATEGORIES = ("python_function", "cpu_op")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def trace_path(given: str) -> str:
    """The trace file ``given`` names, or the one trace in the config directory it names (a
    distributed config's: rank 0's)."""
    if os.path.isfile(given):
        return given
    found = sorted(glob.glob(os.path.join(given, "*.pt.trace.json*")))
    if len(found) > 1:
        found = [path for path in found if os.path.basename(path).startswith("rank0.")]
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


def _timed(event: dict) -> bool:
    return (
        event.get("ph") == "X"
        and isinstance(event.get("ts"), (int, float))
        and isinstance(event.get("dur"), (int, float))
    )


def by_thread(events: list[dict], categories: tuple[str, ...]) -> list[list[dict]]:
    """Each host thread's timed events of ``categories``, in order of start, outer events first
    where two start together (so nesting follows the intervals)."""
    threads: dict = defaultdict(list)
    for event in events:
        if _timed(event) and event.get("cat") in categories:
            threads[(event.get("pid"), event.get("tid"))].append(event)
    return [sorted(thread, key=lambda e: (e["ts"], -e["dur"])) for thread in threads.values()]


def in_recorded_step(events: list[dict]) -> list[dict]:
    """The events that start inside the trace's ``train_step`` ranges (the recorded step, on
    every thread: autograd's backward too), or all of them where it has none. Outside them the
    toolkit's traces wait for the GPU after the step (``measure.tracing``), which is no host
    work of the step's."""
    spans = [
        span
        for e in events
        if e.get("name") == "train_step"
        and e.get("ph") == "X"
        and not str(e.get("cat", "")).startswith("gpu_")
        and (span := kernel_names.event_span(e))
    ]
    if not spans:
        return events
    return [e for e in events if _timed(e) and any(a <= e["ts"] < b for a, b in spans)]


def host_self_times(events: list[dict]) -> tuple[dict[str, float], Counter]:
    """Self time in µs and call count by event_name over the host events of a trace's recorded
    step (``in_recorded_step``)."""
    self_us: dict[str, float] = defaultdict(float)
    calls: Counter = Counter()
    for thread_events in by_thread(in_recorded_step(events), HOST_CATEGORIES):
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


def launch_callers(events: list[dict]) -> dict:
    """The innermost Python function around each launch (a CUDA runtime or driver call), by the
    launch's correlation id."""
    callers: dict = {}
    for thread_events in by_thread(events, ("python_function", *LAUNCH_CATEGORIES)):
        open_functions: list[dict] = []
        for event in thread_events:
            while (
                open_functions
                and event["ts"] >= open_functions[-1]["ts"] + open_functions[-1]["dur"]
            ):
                open_functions.pop()
            if event.get("cat") == "python_function":
                open_functions.append(event)
            elif open_functions:
                correlation = (event.get("args") or {}).get("correlation")
                callers[correlation] = event_name(open_functions[-1])
    return callers


def gpu_times(events: list[dict]) -> tuple[dict[str, float], Counter]:
    """GPU µs and count by "kernel name <- launching Python function" over a trace's GPU
    events (a kernel's name cut at its first parenthesis or template bracket)."""
    callers = launch_callers(events)
    busy_us: dict[str, float] = defaultdict(float)
    counts: Counter = Counter()
    for event in events:
        if _timed(event) and event.get("cat") in kernel_names.GPU_ACTIVITY_CATEGORIES:
            kernel = re.split(r"[(<]", str(event.get("name", "")), maxsplit=1)[0].strip()[:60]
            caller = callers.get((event.get("args") or {}).get("correlation"), "?")
            name = f"{kernel} <- {caller}"
            busy_us[name] += event["dur"]
            counts[name] += 1
    return dict(busy_us), counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", help="trace file or config directory (e.g. standard's)")
    parser.add_argument("other", help="trace file or config directory (e.g. flash's)")
    parser.add_argument("--top", type=int, default=40, help="names listed, by difference")
    parser.add_argument("--gpu", action="store_true", help="the GPU's time, by kernel and caller")
    args = parser.parse_args(argv)
    summarise, what = (gpu_times, "GPU events") if args.gpu else (host_self_times, "host events")
    kind = "GPU time" if args.gpu else "self time"
    profiles = []
    for given in (args.baseline, args.other):
        try:
            path = trace_path(given)
            profiles.append(summarise(kernel_names.load_trace_events(path)))
        except (ValueError, UnreadableFile) as error:
            print(f"trace_host_diff.py: {error}", file=sys.stderr)
            return 2
        print(f"{given}: {sum(profiles[-1][1].values())} {what}, "
              f"{sum(profiles[-1][0].values()) / 1e3:.1f} ms of {kind}")  # fmt: skip
    (base, base_calls), (other, other_calls) = profiles
    names = sorted(set(base) | set(other), key=lambda n: other.get(n, 0) - base.get(n, 0))
    print(f"\nms of {kind}, other - baseline, the {args.top} largest each way")
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
