"""Host work of one eager training step, per trainer: what the CPU spends launching a step when
the GPU is not what it waits for.

At a tiny shape (1b model, (1, 16)) every kernel is shorter than its launch, so a step's wall
time is its host work. For each trainer and shape this prints the median step time (synchronised
before and after each step), the kernel launches per step and every CUDA runtime and driver call
by name (a CUDA-activity trace: runtime and driver launch calls, Triton's included), the GPU
time of that traced step by kernel category and name (the top KERNEL_TOP), its idle time (the
part spent waiting for the host's launches, and where), the host's and the GPU's time at each
phase event of a step (where the GPU reaches an event soon after the host queued it, it was
waiting for the host), Python's garbage collections over the timed steps and, with --profile,
the Python functions with the most own time over the profiled steps (cProfile). Each trainer
is built as the CLI's worker builds it (measure.worker.build_trainer on
measure.workload.Workload).

    python benchmarks/host_work.py --shapes 1x16 8x512 --trainers standard flash --profile

Runs on CPU too (``--device cpu``, e.g. with ``--hidden_dim 64``): then the times are the ops'
own and no launches are counted.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_cost.core.settings import MODEL_OVERRIDES  # noqa: E402  (torch-free)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1b")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "explicit"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", default=["1x16", "8x512"], help="BxT")
    parser.add_argument("--trainers", nargs="+", default=["standard", "flash"])
    parser.add_argument("--repeats", type=int, default=3, help="processes per trainer and shape")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup_steps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile some more steps")
    parser.add_argument("--profile_steps", type=int, default=5)
    parser.add_argument("--profile_top", type=int, default=30)
    parser.add_argument("--profile_sort", default="tottime", choices=("tottime", "cumtime"))
    parser.add_argument(
        "--gc",
        default="default",
        choices=("default", "freeze", "off"),
        help="Python's garbage collector over the timed steps: as is, gc.freeze() after the "
        "warm-up steps, or disabled",
    )
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # trainer,B,T: a child's own config
    for name in MODEL_OVERRIDES:
        parser.add_argument(f"--{name}", type=int)
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and argument mistakes answer before torch is imported


import torch  # noqa: E402

from dp_cost.core import kernel_names  # noqa: E402
from dp_cost.measure.config import ExperimentConfig  # noqa: E402
from dp_cost.measure.python_gc import GarbageCollections  # noqa: E402
from dp_cost.measure.steps import synchronize  # noqa: E402
from dp_cost.measure.worker import build_trainer  # noqa: E402
from dp_cost.measure.workload import Workload  # noqa: E402

KERNEL_TOP = 40  # kernels (by name) listed per traced step, by GPU time
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def launches_per_step(step, device: torch.device) -> dict | None:
    """Launch calls of one step and the host time spent inside them (a CUDA-activity trace)."""
    if device.type != "cuda":
        return None
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            synchronize(device)
        prof.export_chrome_trace(path)
        events = kernel_names.load_trace_events(path)
    # every runtime and driver call the trace records (each costs host time while traced):
    # name -> [calls, ms]; the launch calls are some of them
    api: dict[str, list] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            entry = api.setdefault(e.get("name"), [0, 0.0])
            entry[0] += 1
            entry[1] += float(e.get("dur", 0)) / 1000
    launches = {name: api[name] for name in LAUNCH_CALLS if name in api}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    return {
        "gpu_idle": gpu_idle(events),
        "api_calls": sum(n for n, _ in api.values()),
        "api_calls_by_name": dict(sorted(api.items(), key=lambda item: -item[1][0])),
        "launch_calls": sum(n for n, _ in launches.values()),
        "launch_calls_by_api": {name: n for name, (n, _) in launches.items()},
        "launch_call_ms": sum(ms for _, ms in launches.values()),
        "kernels": len(kernels),
        "kernel_ms": sum(float(e.get("dur", 0)) for e in kernels) / 1000,
        # GPU time by kernel name and category: where one trainer's GPU work exceeds another's
        "kernel_summary": kernel_names.summarize(
            ((e.get("name", ""), float(e.get("dur", 0))) for e in kernels), top=KERNEL_TOP
        ),
    }


def gpu_idle(events: list[dict], top: int = 12) -> dict:
    """Where the GPU idled inside a traced step: each gap in its activity (kernels, copies and
    memsets) before the next one starts, and the part of it the GPU waited for the host (the
    next activity's launch call ended after the GPU had gone idle: from then to the call's end,
    at most the gap). The largest such waits, by the activity that waited, with its start in ms
    from the step's first activity."""
    launch_calls = {}  # correlation id -> (start, end) of its launch call on the host, µs
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            correlation = (e.get("args") or {}).get("correlation")
            if correlation is not None:
                begin = float(e.get("ts", 0))
                launch_calls[correlation] = (begin, begin + float(e.get("dur", 0)))
    activity = sorted(
        (
            (float(e.get("ts", 0)), float(e.get("ts", 0)) + float(e.get("dur", 0)), e)
            for e in events
            if e.get("cat") in kernel_names.GPU_ACTIVITY_CATEGORIES
        ),
        key=lambda item: item[:2],  # by start, then end: never compare two events
    )
    if not activity:
        return {"idle_ms": 0.0, "waiting_for_host_ms": 0.0, "largest_waits": []}
    idle = waiting = 0.0
    waits = []
    busy_until = activity[0][1]
    for start, end, event in activity[1:]:
        gap = start - busy_until
        if gap > 0:
            idle += gap
            launch = launch_calls.get((event.get("args") or {}).get("correlation"))
            if launch is not None and launch[1] > busy_until:
                wait = min(gap, launch[1] - busy_until)
                waiting += wait
                name = kernel_names.short_name(event.get("name", ""))
                waits.append((wait, (start - activity[0][0]) / 1000, name))
        busy_until = max(busy_until, end)
    waits.sort(reverse=True)
    return {
        "idle_ms": idle / 1000,
        "waiting_for_host_ms": waiting / 1000,
        "largest_waits": [
            {"wait_ms": w / 1000, "at_ms": at, "kernel": name} for w, at, name in waits[:top]
        ],
    }


def python_profile(step, steps: int, top: int, sort: str = "tottime") -> str:
    """cProfile of ``steps`` steps: the functions with the most own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(top)
    return text.getvalue()


class PhaseClock:
    """on_phase: the host clock at each phase event of a step, and on CUDA an event queued there
    (no device sync). Per phase: the host's ms since the step began, and the GPU's (when it
    reached the event): where the two are close, the GPU was waiting for the host's launches."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, float, object]] = []

    def __call__(self, name: str) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((name.lstrip("_"), time.perf_counter(), event))

    def timeline(self) -> list[tuple[str, float, float | None]]:
        """(phase, host ms, GPU ms) of each event of the last step, from its first (after a
        synchronize: the GPU idle then); the GPU's once the step has synchronised."""
        _, start, first = self.marks[0]
        return [
            (name, (at - start) * 1e3, first.elapsed_time(event) if event is not None else None)
            for name, at, event in self.marks[1:]
        ]


def measure(trainer_name: str, batch: int, seq: int, args) -> dict:
    """One trainer at one shape, in this process: timed steps, phases, launches, profile."""
    overrides = {n: getattr(args, n) for n in MODEL_OVERRIDES if getattr(args, n) is not None}
    config = ExperimentConfig(
        trainer=trainer_name,
        batch_size=batch,
        seq_len=seq,
        model=args.model,
        dtype=args.dtype,
        attention=args.attention,
        device=args.device,
        model_overrides=overrides,
    )
    device = torch.device(args.device)
    torch.manual_seed(config.seed)
    clock = PhaseClock(device)
    workload = Workload(config, device, lambda name: None, {})
    trainer = build_trainer(config, workload.model, workload.loss_fn, clock)
    inputs, targets = workload.batch()

    def step():
        trainer.step(inputs, targets)

    for _ in range(args.warmup_steps):
        step()
    synchronize(device)
    if args.gc == "freeze":  # what exists now (model, trainer, caches) is never scanned again
        gc.freeze()
    elif args.gc == "off":
        gc.disable()
    times, timelines = [], []
    with GarbageCollections() as collections:
        for _ in range(args.steps):
            synchronize(device)
            clock.marks = []
            clock("start")
            step()
            synchronize(device)
            clock("end")
            timeline = clock.timeline()
            times.append(timeline[-1][1])
            timelines.append(timeline)
    row = {
        "trainer": trainer_name,
        "batch": batch,
        "seq": seq,
        "step_ms_median": statistics.median(times),
        "step_ms": times,
        # each phase event's host and GPU ms since the step began (median over the steps);
        # a name repeats where a step has several chunks
        "timeline_ms_median": [
            [name, statistics.median(t[i][1] for t in timelines)]
            + [None if gpu is None else statistics.median(t[i][2] for t in timelines)]
            for i, (name, _, gpu) in enumerate(timelines[0])
        ],
        "launches": launches_per_step(step, device),
        # Python's garbage collections over the timed steps: per generation, and their ms
        "gc": {
            "mode": args.gc,
            "collections": collections.counts,
            "ms": collections.ms,
            "heap_objects": len(gc.get_objects()),
            "frozen": gc.get_freeze_count(),
        },
    }
    if args.profile:
        row["python_profile"] = python_profile(
            step, args.profile_steps, args.profile_top, args.profile_sort
        )
    return row


def parse_shapes(values: list[str]) -> list[tuple[int, int]]:
    """["8x512", ...] -> [(8, 512), ...]; ValueError unless each is two integers BxT."""
    shapes = []
    for value in values:
        batch, seq = value.split("x")
        shapes.append((int(batch), int(seq)))
    return shapes


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("host_work.py: --device cuda needs a GPU (use --device cpu)", file=sys.stderr)
        return 2
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError:
        print(f"host_work.py: --shapes takes BxT, e.g. 8x512; got {args.shapes}", file=sys.stderr)
        return 2
    if args.one:
        name, batch, seq = args.one.split(",")
        print(json.dumps(measure(name, int(batch), int(seq), args)))
        return 0
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"card: {card}; torch {torch.__version__}; model {args.model} {args.dtype}", flush=True)
    # Each trainer in a fresh process, the trainers alternating, so a slow spell of the host
    # falls on both.
    given = list(argv if argv is not None else sys.argv[1:])
    own = [a for i, a in enumerate(given) if "--json" not in (a, given[i - 1] if i else None)]
    rows = []
    for batch, seq in shapes:
        for repeat in range(args.repeats):
            for name in args.trainers:
                child = [sys.executable, os.path.abspath(__file__), *own, "--one",
                         f"{name},{batch},{seq}"]  # fmt: skip
                done = subprocess.run(child, capture_output=True, text=True)
                if done.returncode:
                    print(done.stderr[-2000:], file=sys.stderr)
                    return 1
                row = json.loads(done.stdout.strip().splitlines()[-1])
                row["repeat"] = repeat
                rows.append(row)
                launches = row["launches"] or {}
                phases = " ".join(
                    f"{phase} {host:.1f}" + ("" if gpu is None else f"/{gpu:.1f}")
                    for phase, host, gpu in row["timeline_ms_median"]
                )
                print(
                    f"({batch}, {seq}) {name:9s} #{repeat} step {row['step_ms_median']:7.2f} ms"
                    f" median | at, ms host/GPU: {phases} | launches "
                    f"{launches.get('launch_calls', '-')} | gc {row['gc']['mode']}: "
                    f"{row['gc']['collections']} collections, {row['gc']['ms']:.1f} ms over "
                    f"{args.steps} steps, heap {row['gc']['heap_objects']} objects",
                    flush=True,
                )
                if launches.get("api_calls_by_name"):
                    top = list(launches["api_calls_by_name"].items())[:8]
                    print(
                        f"    CUDA API calls per traced step: {launches['api_calls']}; most: "
                        + ", ".join(f"{api} {n} ({ms:.1f} ms)" for api, (n, ms) in top)
                    )
                if launches.get("kernel_summary"):
                    categories = launches["kernel_summary"]["categories"]
                    print(
                        f"    GPU kernel ms per traced step: {launches['kernel_ms']:.1f}; "
                        + ", ".join(
                            f"{category} {c['time_ms']:.1f}"
                            for category, c in categories.items()
                            if c["count"]
                        )
                    )
                if launches.get("gpu_idle"):
                    idle = launches["gpu_idle"]
                    print(
                        f"    GPU idle in the traced step {idle['idle_ms']:.1f} ms, of which "
                        f"waiting for the host {idle['waiting_for_host_ms']:.1f} ms; largest: "
                        + ", ".join(
                            f"{w['wait_ms']:.2f} at {w['at_ms']:.1f} ({w['kernel'][:40]})"
                            for w in idle["largest_waits"][:6]
                        )
                    )
                if args.profile:
                    print(row["python_profile"])
        for name in args.trainers:
            mine = [r["step_ms_median"] for r in rows if (r["trainer"], r["batch"], r["seq"])
                    == (name, batch, seq)]  # fmt: skip
            print(f"({batch}, {seq}) {name}: median of medians {statistics.median(mine):.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"card": card, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
