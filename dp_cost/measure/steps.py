"""The measurements of one config, in order, each with one interface: ``run(session, result)``.

``measurements(config)`` is the sequence a config asks for. The timed steps come first and
nothing else runs during them; every later measurement runs extra steps on the last timed
step's batch and never records phase snapshots (``Session.extra_step``).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import pickle
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.cuda import _memory_viz

from dp_cost.core import files, kernel_names
from dp_cost.core.files import atomic_write
from dp_cost.core.schema import MB
from dp_cost.hf import privacy
from dp_cost.measure import breakdown, census, host_work, phases, tracing
from dp_cost.measure.python_gc import GarbageCollections
from dp_cost.noise import laws as noise_laws


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Session:
    """What the measurements of one config share, in its worker process."""

    config: object  # ExperimentConfig
    device: torch.device
    runner: object  # stepping.runner.Runner: the trainer and its steps
    workload: object  # measure.workload.Workload
    recorder: phases.PhaseRecorder
    out_dir: str
    env: dict
    inputs: torch.Tensor = None  # the last timed step's batch (its share): extra steps reuse it
    targets: torch.Tensor = None
    measured_snapshots: list = field(default_factory=list)
    step_starts: list = field(default_factory=list)
    module_census: census.ModuleCensus | None = None
    extra_steps: int = 0  # steps after the timed ones, on a batch they already sampled
    timed_replays: int = 0  # timed steps that replayed a CUDA graph (--cuda_graph)

    def reused_batch_step(self) -> None:
        """One step after the timed ones, on a batch they sampled (counted: a DP step that
        reuses a batch is accounted as such)."""
        self.extra_steps += 1
        self.runner.step(self.inputs, self.targets)

    def extra_step(self) -> None:
        """A reused-batch step that the module census (if any) observes."""
        with self.module_census.observing() if self.module_census else contextlib.nullcontext():
            self.reused_batch_step()


class TimedSteps:
    """Warm-up, then the timed steps (synchronised before and after each, not between its
    phases), with the phase snapshots they record."""

    def run(self, s: Session, result: dict) -> None:
        with s.runner.observing_phases(s.recorder):
            for _ in range(s.config.warmup_steps):
                s.runner.step(*s.workload.batch())
            synchronize(s.device)
            if s.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(s.device)
            first_measured = len(s.recorder.snapshots)
            counts_before = s.runner.graphs.counts()
            step_times, physical_times, losses = [], [], []
            with GarbageCollections() as collections:  # Python's, over the timed steps
                for _ in range(s.config.steps):
                    inputs, targets = s.workload.batch()  # sampled outside the timed region
                    # The extra steps after these reuse the last timed draw, whatever it holds:
                    # a choice by its content ("the last with samples") would include a sample
                    # more often than the sampling rate says, and under DDP a rank whose share
                    # is empty would pick an older draw than the others.
                    s.inputs, s.targets = inputs, targets
                    # The phases' ends are CUDA events: nothing waits for the GPU inside the step
                    # (timed_step waits before it)
                    with s.recorder.timed_step() as began:
                        start = time.perf_counter()
                        s.step_starts.append(began)
                        out = s.runner.step(inputs, targets)
                        synchronize(s.device)
                        step_times.append((time.perf_counter() - start) * 1e3)
                    physical_times.extend(out["physical_step_times_ms"])
                    losses.append(out["loss"])
        s.measured_snapshots = s.recorder.snapshots[first_measured:]
        described = s.runner.trainer.privacy
        result["python_gc"] = collections.result()
        timed = {k: v - counts_before[k] for k, v in s.runner.graphs.counts().items()}
        s.timed_replays = timed["replays"]
        # Poisson batches vary in size: say which one the measurements after these steps use
        # (the global batch: under DDP and FSDP2 each rank steps on its share of it).
        result["measurement_batch_size"] = s.workload.draws[-1]
        if not s.workload.draws[-1]:
            s.env["measurement_batch_note"] = (
                "the last timed batch drawn was empty: the measurements after the timed steps "
                "(CPU peak, host work, breakdown, census, trace) ran on it, a noise-only step"
            )
        if s.runner.graphs.enabled:
            result["cuda_graph"] = {
                **s.runner.graphs.result(),
                **{f"timed_{key}": value for key, value in timed.items()},
            }
        result.update(
            avg_time_ms=statistics.fmean(step_times),
            median_time_ms=statistics.median(step_times),
            step_times_ms=step_times,
            physical_step_times_ms=physical_times,
            losses=losses,
            snapshots=s.recorder.snapshots,
            **s.runner.trainer.result_extras(),
            clipping=described.clipping_record() if described else None,  # over every step
        )


class PeakMemory:
    """CUDA: the largest phase peak of the timed steps (the recorder resets the counters at
    every snapshot), and the capture's peak where they replayed a CUDA graph (a replay
    allocates nothing; its tensors live in the graph's pool, allocated at capture). CPU: the
    peak of one extra step, from the profiler's allocation events."""

    def run(self, s: Session, result: dict) -> None:
        if s.device.type == "cuda":
            peaks = [x["phase_peak_mb"] for x in s.measured_snapshots]
            if s.timed_replays:
                peaks.append(s.runner.graphs.capture_peak_bytes / MB)
            result["peak_memory_mb"] = max(peaks)
            result["peak_reserved_mb"] = max(
                x["phase_peak_reserved_mb"] for x in s.measured_snapshots
            )
        else:
            host_dataset = s.workload.host_dataset()
            try:
                peak = phases.cpu_step_peak_bytes(s.extra_step, host_dataset)
            except ValueError as error:  # the profiler's own trace could not be read back
                s.env["peak_note"] = f"the CPU peak could not be measured: {error}"
                return
            result["peak_memory_mb"] = peak / MB


class HostWork:
    """What one extra eager step asks of the host, counted (``measure.host_work``): Python
    calls, operator dispatches, CUDA kernel launches."""

    def run(self, s: Session, result: dict) -> None:
        try:
            with s.runner.eager():  # a replay has no host work to count
                counts = host_work.count_step(
                    s.reused_batch_step, s.device, s.runner.observing_phases
                )
        except torch.cuda.OutOfMemoryError as error:  # an eager step beside captured graphs
            s.env["host_work_note"] = f"the counted step ran out of memory: {error}"[:300]
            return
        if counts["python_calls_note"]:
            s.env["python_calls_note"] = counts["python_calls_note"]
        result["host_work"] = {k: v for k, v in counts.items() if k != "python_calls_note"}


class Breakdown:
    """Where the peak of one extra step goes (CUDA: the allocator's history)."""

    def run(self, s: Session, result: dict) -> None:
        if s.device.type != "cuda":
            s.env["breakdown_note"] = "the allocator history that attributes the peak is CUDA-only"
            return
        with s.runner.eager():  # the allocator's history of a step: a replay has none
            parts, check, recording, snapshot = breakdown.record_breakdown(
                s.runner, s.extra_step, s.device
            )
        result["breakdown"], result["breakdown_check"] = parts, check
        if s.config.save_snapshot:
            save_snapshot(s.out_dir, snapshot, {**recording, "check": check})


def save_snapshot(out_dir: str, snapshot: dict, recording: dict) -> None:
    """The pickle feeds ``python -m torch.cuda._memory_viz``; the HTML is its timeline; the
    trimmed recording is what the attribution read (small enough to keep as a test fixture)."""
    run_dir = os.path.dirname(out_dir)  # nothing below it is written through a link
    with atomic_write(os.path.join(out_dir, "memory_snapshot.pickle"), "wb", root=run_dir) as f:
        pickle.dump(snapshot, f)
    with atomic_write(os.path.join(out_dir, "memory_timeline.html"), root=run_dir) as f:
        f.write(_memory_viz.trace_plot(snapshot))
    path = os.path.join(out_dir, "breakdown_recording.json.gz")
    with atomic_write(path, "wt", opener=gzip.open, root=run_dir) as f:
        json.dump(recording, f)


class Census:
    """Bytes by module group and kind in one extra step, and time and memory per phase."""

    def run(self, s: Session, result: dict) -> None:
        if not s.module_census.steps_observed:  # no extra step ran yet (CUDA without breakdown)
            with s.runner.eager():  # the census reads a step's allocations
                s.extra_step()
        result["module_memory"] = s.module_census.result()
        if s.timed_replays:
            result["phase_costs"] = census.unmeasured_phase_costs()
            s.env["phase_costs_note"] = (
                f"{s.timed_replays} timed steps replayed a CUDA graph: a replay has no phase "
                "boundaries, so time and memory per phase are not measured"
            )
        else:
            result["phase_costs"] = census.phase_costs(s.measured_snapshots, s.step_starts)


TIMELINE_STEPS = 3  # traced steps (CUDA activity alone) for a config's host time and GPU busy


def median_index(host_times: list) -> int:
    """The index of the median host time (the lower middle of an even count; the first where one
    is missing)."""
    if None in host_times:
        return 0
    return sorted(range(len(host_times)), key=host_times.__getitem__)[(len(host_times) - 1) // 2]


def median_host_step(timelines: list[dict]) -> dict:
    """The step_timeline of median host time among several traced steps (the lower middle of an
    even count; the first where a host time is missing), with every step's host time under
    ``host_time_ms_of_traced_steps`` and, where recorded, Python's garbage collections inside
    each step under ``python_gc_of_traced_steps``."""
    host_times = [t["host_time_ms"] for t in timelines]
    chosen = {**timelines[median_index(host_times)], "host_time_ms_of_traced_steps": host_times}
    if all("python_gc" in t for t in timelines):
        chosen["python_gc_of_traced_steps"] = [t["python_gc"] for t in timelines]
    return chosen


class Trace:
    """torch.profiler trace of extra steps; on CUDA, GPU kernel time per category from it, and
    the host time and GPU-busy fraction of the median of TIMELINE_STEPS more steps
    (``kernel_names.step_timeline``)."""

    def run(self, s: Session, result: dict) -> None:
        config = s.config
        use_gzip = s.device.type == "cuda" if config.trace_gzip is None else config.trace_gzip
        path = tracing.trace_steps(s.reused_batch_step, s.device, s.out_dir, use_gzip)
        result["trace_file"] = os.path.basename(path) if path else None
        result["host_time_ms"] = result["gpu_busy_fraction"] = None
        if s.device.type != "cuda" or not path:
            s.env["kernels_note"] = "GPU kernel times exist only for CUDA runs"
            s.env["timeline_note"] = "host time and GPU-busy fraction need a CUDA trace"
            return
        try:
            kernels = kernel_names.kernels_from_trace(path)  # durations in µs
            summary = kernel_names.summarize(kernels)
            result["kernels"] = summary["categories"]
            result["top_kernels"] = summary["top"]
            if torch.distributed.is_initialized():
                # NCCL kernel time, waits for the other ranks included; overlapped with compute
                # where the trainer overlaps it (DDP's buckets, FSDP2's prefetches).
                nccl_us = sum(us for name, us, *_ in kernels if "nccl" in name.lower())
                result["communication_time_ms"] = nccl_us / 1000
        except ValueError as error:  # an unreadable trace (truncated, over the size cap)
            s.env["kernels_note"] = f"the trace could not be read: {error}"
        # Host time and GPU-busy fraction from a second, light trace of the step after a
        # warm-up step: CUDA activity alone (kernels and the runtime and driver calls that
        # launch them). Recording host ops costs microseconds per op on the host, more for the
        # trainer with more ops: on an H100, standard's 1b step at (8, 512) ran 82 ms untraced
        # and showed 111 ms of host time with host ops recorded. Such a trace has no host range:
        # the window is from the step's first CUDA call to its last launch (step_timeline's
        # docstring). TIMELINE_STEPS such steps, each after a warm-up step: the one of median
        # host time is reported (one step's host time varies by tens of percent on a shared
        # host). In a staging folder of its own: ranks of one config share the directory, and
        # an interrupted run's leftovers are removed like the trace's (".trace-*").
        # (files.staging: a private folder reached by its descriptor, never through a link)
        with files.staging(s.out_dir, os.path.dirname(s.out_dir), ".trace-") as stage:
            lights = []

            def export(prof):
                lights.append(os.path.join(stage.path, f"timeline{len(lights)}.json"))
                prof.export_chrome_trace(lights[-1])

            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA],
                schedule=torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=TIMELINE_STEPS),
                on_trace_ready=export,
            ) as prof:
                collections = []  # Python's garbage collections inside each step
                for _ in range(2 * TIMELINE_STEPS):
                    with GarbageCollections() as inside:
                        s.reused_batch_step()
                        synchronize(s.device)
                    collections.append(inside.result())
                    prof.step()
            try:
                # the schedule's steps alternate warm-up, active: the active ones were exported
                timelines = [
                    {
                        **kernel_names.step_timeline(kernel_names.load_trace_events(path)),
                        "python_gc": collections[2 * i + 1],
                    }
                    for i, path in enumerate(lights)
                ]
                if not timelines:
                    raise ValueError("the profiler wrote no trace")
            except ValueError as error:
                s.env["timeline_note"] = f"host time and GPU-busy fraction not measured: {error}"
                return
            median = median_index([t["host_time_ms"] for t in timelines])
            kept = tracing.keep_timeline(stage, os.path.basename(lights[median]), use_gzip)
            result["timeline_file"] = os.path.basename(kept)
        timeline = median_host_step(timelines)
        result["host_time_ms"] = timeline["host_time_ms"]
        result["gpu_busy_fraction"] = timeline["gpu_busy_fraction"]
        result["step_timeline"] = timeline


class Privacy:
    """The (epsilon, delta_total) of every DP update the model received (Poisson-sampled
    workloads), and the draws it covers."""

    def run(self, s: Session, result: dict) -> None:
        described = s.runner.trainer.privacy
        if s.workload.sample_rate is None or described is None:
            return
        config, sample_rate = s.config, s.workload.sample_rate
        # Warm-up and timed steps each drew a fresh Poisson batch (global sizes, alike on every
        # rank); the extra steps after them (CPU peak, host work, breakdown, census, trace)
        # reused the last: accounted as such.
        draws = list(s.workload.draws)
        steps_per_draw = [1] * len(draws)
        if draws:
            steps_per_draw[-1] += s.extra_steps
        steps = s.runner.steps_taken
        if sum(steps_per_draw) != steps:  # a step that neither drew nor reused: not accounted
            raise RuntimeError(
                f"the trainer took {steps} steps but the draws account for {sum(steps_per_draw)}"
            )
        sampler, dimension = described.noise_sampler, described.noised_dimension
        # A trainer whose clipped samples may reach (1 + margin) C has that sensitivity: the
        # accountant sees the noise multiplier sigma / (1 + margin)
        margin = described.sensitivity_margin
        sigma = config.noise_multiplier / (1 + margin)
        epsilon = delta_total = tail = None
        if config.poisson:
            epsilon = privacy.epsilon(sigma, sample_rate, steps_per_draw, config.delta)
            tail = noise_laws.tail_delta(sampler, dimension, sigma, sample_rate, steps)
            delta_total = config.delta + tail
        else:
            s.env["privacy_note"] = (
                "--no_poisson: fixed-size batches, which the Poisson accountant does not cover; "
                "epsilon is not reported"
            )
        result["privacy"] = {
            "epsilon": epsilon,
            "delta": config.delta,
            "delta_total": delta_total,
            "tail_delta": tail,
            "noise_sampler": sampler,
            "z_max": noise_laws.NOISE_LAWS[sampler].z_max,
            "noised_coordinates": dimension,
            "noise_multiplier": config.noise_multiplier,
            "sensitivity_margin": margin,
            "effective_noise_multiplier": sigma,
            "sample_rate": sample_rate,
            "steps": steps,
            "draw_sizes": draws,
            "steps_per_draw": steps_per_draw,
            "last_batch_uses": steps_per_draw[-1] if draws else 0,
            "poisson": config.poisson,
            "accountant": "prv",
        }


class NcuRange:
    """Warm-up, then exactly one step inside cudaProfilerStart/Stop, the range ncu profiles.

    cudaProfilerStart/Stop is process-wide, so the backward kernels that autograd launches from
    its own thread and the optimizer step are inside the range. NVTX ranges name the phases for
    ``ncu --nvtx --nvtx-include "step/"`` (NVTX ranges are per thread: with that filter, kernels
    launched by autograd's thread are not matched; the default suite does not filter). Its time
    under ncu's replay is no measurement: times and peaks stay null.
    """

    def run(self, s: Session, result: dict) -> None:
        if s.device.type != "cuda":
            raise ValueError("--ncu needs a CUDA device")
        with s.runner.observing_phases(s.recorder):
            for _ in range(s.config.warmup_steps):
                s.runner.step(*s.workload.batch())
        inputs, targets = s.workload.batch()
        nvtx = torch.cuda.nvtx
        next_range = {"forward_done": "backward", "backward_done": "optimizer"}

        def on_phase(name):
            if name in next_range:
                nvtx.range_pop()
                nvtx.range_push(next_range[name])

        synchronize(s.device)
        torch.cuda.profiler.start()
        nvtx.range_push("step")
        nvtx.range_push("forward")
        try:
            with s.runner.observing_phases(on_phase):
                s.runner.step(inputs, targets)
            synchronize(s.device)
        finally:
            nvtx.range_pop()
            nvtx.range_pop()
            torch.cuda.profiler.stop()
        s.env["ncu_note"] = (
            "one step ran inside cudaProfilerStart/Stop for Nsight Compute; its time under "
            "ncu replay is not a measurement, so times and peaks are null"
        )


def measurements(config) -> list:
    """The measurements ``config`` asks for, in the order they run."""
    if config.ncu:
        return [NcuRange()]
    sequence = [TimedSteps(), PeakMemory()]
    if config.host_work:
        sequence.append(HostWork())
    if config.breakdown:
        sequence.append(Breakdown())
    if config.detailed_memory:
        sequence.append(Census())
    if config.trace:
        sequence.append(Trace())
    return [*sequence, Privacy()]
