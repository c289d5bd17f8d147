"""GPU kernel names -> kernel categories, and summaries of torch.profiler (Kineto) traces.

Kernel names are matched as they appear in Kineto traces (demangled by the C++ ABI:
``void at::native::reduce_kernel<512, 1, ...>(...)``) and in Nsight Systems / Compute
(``void at::native::<unnamed>::...<(int)4, ...>(T3)``); the rules only look for words that both
spellings share.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
import re
from collections.abc import Iterable

from dp_cost.core.reading import UnreadableFile, read_json, read_text
from dp_cost.core.schema import KERNEL_CATEGORIES as CATEGORIES

# One ordered table: a kernel gets the category of the FIRST row whose pattern it contains
# (case-insensitive search), else "other". Why the order:
#  1. attention before gemm: fused attention kernels name cutlass/gemm types in their templates
#     (fmha_cutlassF_..., pytorch_flash::flash_fwd_kernel<... cutlass::half_t ...>).
#  2. library GEMMs (cuBLAS/cuBLASLt/CUTLASS) before norm_clip: a CUTLASS epilogue may say Clamp,
#     and cublasLt::splitKreduce_kernel is the tail of a GEMM, not a reduction.
#  3. norm_clip before optimizer, reduction and elementwise: DP-SGD's per-sample norms and clipping
#     run inside generic kernels -- _foreach_norm in a multi_tensor_apply_kernel (LpNormFunctor),
#     torch.norm / linalg_vector_norm in a reduce_kernel (NormTwoOps), the clip factor's clamp in a
#     vectorized_elementwise_kernel -- and the word in the template is what tells them apart.
#     "normal" is Gaussian noise (normal_kernel), not a norm; "gram" must start a word, so
#     cub's DeviceRadixSortHistogramKernel is not a Gram matrix.
#  4. Triton GEMM templates after norm_clip: an Inductor mm fused with a norm/clip is norm work.
#  5. optimizer before elementwise/reduction: foreach kernels are elementwise in shape.
#  6. reduction before elementwise: triton_red_/triton_per_ vs triton_poi_, softmax, losses.
# Caveat: ReLU's forward also runs launch_clamp_scalar, so a ReLU model's activations land in
# norm_clip; the models profiled here use GELU.
RULES: list[tuple[str, str]] = [
    # dot_do_o / convert_dq: the softmax-grad and dQ-cast steps of FA2's and cuDNN SDPA's backward
    ("attention", r"attention|attn|fmha|sdpa|flash_fwd|flash_bwd|flash::|dot_do_o|convert_dq"),
    ("gemm", r"gemm|gemv|nvjet|xmma|cutlass|cublas|splitKreduce"),
    ("norm_clip", r"norm(?!al)|clip|clamp|einsum|GammaBeta|RowwiseMoments|(?<![a-z])gram"),
    ("gemm", r"^triton_tem_|matmul"),
    ("optimizer", r"multi_tensor_apply|_foreach_|adam(?!ard)|sgd"),
    (
        "reduction",
        r"reduce_kernel|softmax|cross_entropy|nll_loss|ClassNLLCriterion|DeviceReduce"
        r"|DeviceSegmentedReduce|^triton_(red|per)_",
    ),
    (
        "elementwise",
        r"elementwise|CatArray|copy|fill|dropout|indexSelect|index_|gather|scatter|embedding"
        r"|PointwiseApply|^triton_poi_|noise",
    ),
]
_COMPILED_RULES = [(category, re.compile(pattern, re.IGNORECASE)) for category, pattern in RULES]

# The files a config's traces are written to (measure.tracing): the full trace of a step, read by
# TensorBoard, and the light trace of one more (CUDA activity alone), its GPU timeline as untraced
TRACE_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")
TIMELINE_SUFFIXES = ("timeline.json", "timeline.json.gz")  # rank<N>.timeline.json, or alone
KERNEL_CATEGORY = "kernel"  # Kineto's "cat" of GPU kernel events
MEMORY_EVENT = "[memory]"
CPU_DEVICE, CUDA_DEVICE = 0, 1  # c10::DeviceType values in "[memory]" events
# The record_function range around the attention proper (q·kᵀ, mask, softmax, probs·v; not the
# projections): kernels launched inside it, or by the backward of an op recorded inside it, are
# attention whatever their names say (an explicit q·kᵀ is a plain GEMM kernel).
ATTENTION_RANGE = "attention"
BACKWARD_PREFIX = "autograd::engine::evaluate_function"


@functools.lru_cache(maxsize=4096)  # a trace repeats a few hundred names thousands of times
def categorize(name: str) -> str:
    """The category (``core.schema.KERNEL_CATEGORIES``) of one CUDA kernel name."""
    for category, pattern in _COMPILED_RULES:
        if pattern.search(name):
            return category
    return "other"


def _strip_templates(name: str) -> str:
    """Drop every <...> group, nested ones included; a '>' with nothing open (as in '->') stays."""
    out, depth = [], 0
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    return "".join(out)


def short_name(name: str) -> str:
    """A readable name: no template arguments, no parameter list, no return type.

    ``void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::Half, ...>(...)``
    -> ``at::native::cunn_SoftMaxForward``. Names that are not C++ signatures
    (``nvjet_tst_...``, ``Memcpy DtoD (Device -> Device)``) are kept whole.
    """
    s = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    s = _strip_templates(s).strip()
    signature = re.search(r"\w\(", s)  # a '(' right after an identifier opens the parameters
    if signature:
        # Before the parameters: "[return type] qualified::name"; keep the name.
        s = s[: signature.start() + 1].split()[-1]
    s = s.removeprefix("void ")  # a name cut short before its parameters keeps its "void "
    return s or name


def summarize(kernels: Iterable[tuple[str, float]], top: int = 10) -> dict:
    """Time and launch count per category, and the `top` kernels by total time.

    `kernels` are (name, duration in microseconds) pairs, or (name, duration, category) where
    the trace knows better than the name (``kernels_from_trace``: attention by its range);
    kernels are grouped by full name and category.
    """
    by_name: dict[tuple[str, str], list[float]] = {}  # (name, category) -> [total µs, launches]
    for name, duration_us, *known in kernels:
        category = known[0] if known and known[0] else categorize(name)
        entry = by_name.setdefault((name, category), [0.0, 0])
        entry[0] += duration_us
        entry[1] += 1

    categories = {category: {"time_ms": 0.0, "count": 0} for category in CATEGORIES}
    for (_, category), (total_us, count) in by_name.items():
        bucket = categories[category]
        bucket["time_ms"] += total_us / 1000
        bucket["count"] += count

    ranked = sorted(by_name.items(), key=lambda item: (-item[1][0], item[0]))[:top]
    return {
        "categories": categories,
        "total_time_ms": math.fsum(c["time_ms"] for c in categories.values()),
        "count": sum(c["count"] for c in categories.values()),
        "top": [
            {
                "name": short_name(name),
                "full_name": name,
                "category": category,
                "time_ms": total_us / 1000,
                "count": count,
            }
            for (name, category), (total_us, count) in ranked
        ],
    }


def category_deltas(summary: dict, baseline: dict) -> dict[str, float]:
    """Extra ms per category of `summary` over `baseline` (e.g. a DP trainer vs the standard one).

    Either argument may be a summarize() result or just its "categories" mapping.
    """

    def time_ms(s: dict, category: str) -> float:
        return s.get("categories", s).get(category, {}).get("time_ms", 0.0)

    return {c: time_ms(summary, c) - time_ms(baseline, c) for c in CATEGORIES}


def load_trace_events(path: str | os.PathLike, root: str | None = None) -> list[dict]:
    """The events of a Chrome/Kineto trace, plain or gzipped (by extension or magic bytes);
    ``root``: see ``core.reading.open_at``.

    Raises ``core.reading.UnreadableFile`` (a ValueError) for a file that is not a regular,
    UTF-8, complete JSON trace (a truncated trace is not JSON); entries that are not objects
    are dropped.
    """
    # a trace nests 4 deep but has millions of items
    trace = read_json(path, max_depth=None, root=root)
    # The Chrome trace format allows a bare event list as well as {"traceEvents": [...]}.
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise UnreadableFile("no list of trace events")
    return [event for event in events if isinstance(event, dict)]


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _merged(intervals: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Starts and ends of the union of (start, end) intervals, sorted, for bisect."""
    starts: list[float] = []
    ends: list[float] = []
    for start, end in sorted(intervals):
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return starts, ends


def attention_spans(events: list[dict]) -> dict:
    """Per CPU thread, the merged time spans whose kernel launches are attention work: every
    ``ATTENTION_RANGE`` range, and the backward (``autograd::engine::evaluate_function``) of
    every op recorded inside one, matched by the op's autograd "Sequence number"."""
    ranges: dict = {}
    for e in events:
        ts, dur = _number(e.get("ts")), _number(e.get("dur"))
        if e.get("name") == ATTENTION_RANGE and e.get("ph") == "X" and None not in (ts, dur):
            ranges.setdefault(e.get("tid"), []).append((ts, ts + dur))
    merged = {tid: _merged(spans) for tid, spans in ranges.items()}
    sequences = set()
    for e in events:
        seq = (e.get("args") or {}).get("Sequence number")
        if seq is not None and e.get("cat") == "cpu_op" and _inside(merged, e):
            if not str(e.get("name", "")).startswith(BACKWARD_PREFIX):
                sequences.add(seq)
    for e in events:
        ts, dur = _number(e.get("ts")), _number(e.get("dur"))
        name, seq = str(e.get("name", "")), (e.get("args") or {}).get("Sequence number")
        if name.startswith(BACKWARD_PREFIX) and seq in sequences and None not in (ts, dur):
            ranges.setdefault(e.get("tid"), []).append((ts, ts + dur))
    return {tid: _merged(spans) for tid, spans in ranges.items()}


def _inside(spans: dict, event: dict) -> bool:
    """Does the event start inside one of ``spans`` (attention_spans) of its thread?"""
    ts = _number(event.get("ts"))
    if ts is None or event.get("tid") not in spans:
        return False
    starts, ends = spans[event.get("tid")]
    i = bisect.bisect_right(starts, ts) - 1
    return i >= 0 and ts <= ends[i]


def kernels_from_trace(path: str | os.PathLike) -> list[tuple[str, float, str | None]]:
    """(name, duration µs, category or None) of every GPU kernel event in a
    *.pt.trace.json[.gz] file. The category is "attention" for a kernel whose launch (the CPU
    runtime call with its "correlation" id) lies in ``attention_spans``; None lets ``summarize``
    go by the name. Raises UnreadableFile for a file that is not a complete trace."""
    events = load_trace_events(path)
    spans = attention_spans(events)
    attention_launches = {
        (e.get("args") or {}).get("correlation")
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and _inside(spans, e)
    }
    attention_launches.discard(None)
    out = []
    for event in events:
        name, dur = event.get("name"), _number(event.get("dur"))
        if str(event.get("cat", "")).lower() != KERNEL_CATEGORY or dur is None:
            continue
        if not isinstance(name, str):
            continue
        correlation = (event.get("args") or {}).get("correlation")
        out.append((name, dur, "attention" if correlation in attention_launches else None))
    return out


_MEMORY_NAME = f'"{MEMORY_EVENT}"'
_ONE_VALUE = json.JSONDecoder()


def memory_events(path: str | os.PathLike, root: str | None = None) -> list[dict]:
    """The trace's "[memory]" events, as ``load_trace_events`` would give them (``root``: see
    ``core.reading.open_at``). A CPU step's trace is mostly other events (50,000 ops with their
    shapes and stacks, 20 MB: 1.4 s to parse whole on a 2-core machine): where the text is whole
    (its braces and brackets pair up: a truncated trace's do not) and every occurrence of the
    name opens an event object of its own, only those objects are parsed. Otherwise the whole
    trace is, with its errors."""
    text = read_text(path, None, root)
    if text.count("{") == text.count("}") and text.count("[") == text.count("]"):
        events, at = [], text.find(_MEMORY_NAME)
        while at >= 0:
            start = text.rfind("{", 0, at)
            if start < 0 or "}" in text[start:at]:  # the name after a nested object: not ours
                break
            try:
                event, end = _ONE_VALUE.raw_decode(text, start)
            except ValueError:
                break
            if not isinstance(event, dict) or event.get("name") != MEMORY_EVENT:
                break
            events.append(event)
            at = text.find(_MEMORY_NAME, end)
        else:
            return events
    return [e for e in load_trace_events(path, root) if e.get("name") == MEMORY_EVENT]


def memory_curve_from_trace(
    path: str | os.PathLike, device_type: int | None = None, root: str | None = None
) -> list[tuple[float, float]]:
    """Allocated memory over time from the trace's "[memory]" events (profile_memory=True).

    Returns (ms since the first kept event, allocated MiB) sorted by time, for one device type
    (0 = CPU, 1 = CUDA); by default CUDA when the trace has CUDA events, else CPU.
    """
    samples = []  # (device type, ts µs, allocated bytes)
    for event in memory_events(path, root):
        args = event.get("args") if isinstance(event.get("args"), dict) else {}
        ts, allocated = _number(event.get("ts")), _number(args.get("Total Allocated"))
        if None not in (ts, allocated):  # every event memory_events gives is a "[memory]" one
            device = args.get("Device Type", -1)
            samples.append((device, ts, allocated))
    if device_type is None:
        has_cuda = any(device == CUDA_DEVICE for device, _, _ in samples)
        device_type = CUDA_DEVICE if has_cuda else CPU_DEVICE
    curve = sorted((ts, allocated) for device, ts, allocated in samples if device == device_type)
    if not curve:
        return []
    start_us = curve[0][0]
    return [((ts - start_us) / 1000, allocated / 2**20) for ts, allocated in curve]


# step_timeline: GPU activity kinds, and the host calls that launch GPU work (runtime and driver
# API: cudaLaunchKernel[ExC], cuLaunchKernel[Ex], cudaGraphLaunch, cudaMemsetAsync...). Blocking
# copies (.item()'s cudaMemcpyAsync to pageable memory) and synchronisations are host waits.
GPU_ACTIVITY_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH = re.compile(r"launch|memset", re.IGNORECASE)
_HOST_WAIT = re.compile(r"synchronize|memcpy", re.IGNORECASE)
STEP_RANGE = "train_step"  # measure.tracing's record_function around each traced step


def step_timeline(events: list[dict], step_range: str = STEP_RANGE) -> dict:
    """Host time and GPU-busy fraction of one step in a Kineto trace's events.

    The window is the LAST host range named ``step_range`` (a record_function; the GPU-side copy
    Kineto adds, cat "gpu_user_annotation", is not it); without one, the last "ProfilerStep#N";
    without either (a trace of CUDA activity alone, which records no host ranges), from its first
    runtime or driver call to the end of its last launch (the waits after it, for the step's
    end and the profiler's own, are not the step's).
    The step's GPU work is every kernel, memcpy and memset whose launch (runtime or driver call,
    on any thread: autograd launches the backward from its own) starts inside the window, matched
    by "correlation" id. With t0 the window's start:

    - ``wall_time_ms``: t0 to the later of the window's end and the end of the step's last GPU
      activity;
    - ``host_time_ms``: t0 to the end of the last launch call (kernel, graph or memset launches;
      blocking copies are waits, not launches); it includes the host's waits in between;
    - ``host_wait_ms``: time inside the window spent in synchronisations and memcpy calls
      (``.item()`` waits in these);
    - ``gpu_busy_ms`` and ``gpu_busy_fraction``: the union of the step's GPU activity intervals,
      and that over ``wall_time_ms``.

    Raises ValueError when the trace has no such range or no GPU activity in it (a CPU trace).
    """
    start, end = step_window(events, step_range)
    launches, launch_end, wait_us = host_calls_in(events, start, end)
    gpu = [
        span
        for e in events
        if str(e.get("cat", "")).lower() in GPU_ACTIVITY_CATEGORIES
        and (e.get("args") or {}).get("correlation") in launches
        and (span := event_span(e))
    ]
    if not gpu:
        raise ValueError(f"no GPU activity launched inside the {step_range!r} range")
    wall_end = max(end, max(stop for _, stop in gpu))
    starts, ends = _merged([(max(a, start), min(b, wall_end)) for a, b in gpu])
    busy_us = math.fsum(b - a for a, b in zip(starts, ends, strict=True))
    wall_us = wall_end - start
    return {
        "wall_time_ms": wall_us / 1000,
        "host_time_ms": None if launch_end is None else (launch_end - start) / 1000,
        "host_wait_ms": wait_us / 1000,
        "gpu_busy_ms": busy_us / 1000,
        "gpu_busy_fraction": busy_us / wall_us if wall_us > 0 else None,
    }


def event_span(event: dict) -> tuple[float, float] | None:
    """(start, end) of a complete event in microseconds; None without both numbers."""
    ts, dur = _number(event.get("ts")), _number(event.get("dur"))
    return None if ts is None or dur is None else (ts, ts + dur)


def step_window(events: list[dict], step_range: str) -> tuple[float, float]:
    """(start, end) of the step: the last host range named ``step_range``, else the last
    "ProfilerStep#N", else the first CUDA runtime or driver call to the end of the last launch
    (see ``step_timeline``)."""
    windows = [
        span
        for e in events
        if e.get("name") == step_range
        and e.get("ph") == "X"
        and not str(e.get("cat", "")).startswith("gpu_")
        and (span := event_span(e))
    ]
    if not windows:
        windows = [
            span
            for e in events
            if str(e.get("name", "")).startswith("ProfilerStep#")
            and e.get("ph") == "X"
            and (span := event_span(e))
        ]
    if not windows:
        calls = [
            (span, bool(_LAUNCH.search(str(e.get("name", "")))))
            for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and (span := event_span(e))
        ]
        ends = [b for (_, b), launch in calls if launch] or [b for (_, b), _ in calls]
        if calls:
            windows = [(min(a for (a, _), _ in calls), max(ends))]
    if not windows:
        raise ValueError(f"no {step_range!r} or ProfilerStep range, nor CUDA calls, in the trace")
    return max(windows)


def host_calls_in(events: list[dict], start: float, end: float) -> tuple[set, float | None, float]:
    """The CUDA runtime and driver calls that start inside [start, end]: their correlation ids
    (the GPU work they launch), the end of the last launch call (None without one) and the
    microseconds spent waiting (synchronisations, memcpy calls) inside the window."""
    launches, launch_end, wait_us = set(), None, 0.0
    for e in events:
        span = event_span(e)
        if e.get("cat") not in ("cuda_runtime", "cuda_driver") or not span:
            continue
        if not start <= span[0] <= end:
            continue
        name = str(e.get("name", ""))
        if _LAUNCH.search(name):
            launch_end = span[1] if launch_end is None else max(launch_end, span[1])
        if _HOST_WAIT.search(name):
            wait_us += min(span[1], end) - span[0]
        correlation = (e.get("args") or {}).get("correlation")
        if correlation is not None:
            launches.add(correlation)
    return launches, launch_end, wait_us
