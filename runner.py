"""One isolated worker process per experiment config; status, resume, atomic result files.

The CLI process imports torch and opacus once and never touches CUDA; each config runs in a
child forked from it, so the import cost is paid once, the caching allocator starts empty for
every config (no pool pollution between trainers) and an OOM or crash stays inside its child.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import multiprocessing
import os
import pickle
import signal
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch

import kernels
import memory
import models
import module_memory
import tracing
import trainers
from report import atomic_write

MB = memory.MB
FINISHED = ("ok", "oom", "skipped")  # statuses --resume does not run again


@dataclass
class ExperimentConfig:
    trainer: str
    batch_size: int
    seq_len: int
    model: str = "tiny"
    max_physical_batch_size: int | None = None
    dtype: str = "float32"
    attention: str = "explicit"
    optimizer: str = "sgd"
    lr: float = 1e-4
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    steps: int = 3
    warmup_steps: int = 1
    seed: int = 0
    device: str = "cpu"
    flash_route: str = "auto"
    trace: bool = True  # torch.profiler trace of extra steps after the timed ones
    trace_gzip: bool | None = None  # None: gzip on GPU (large traces), plain JSON on CPU
    breakdown: bool = False  # one extra step under the allocator history: where the peak goes
    save_snapshot: bool = False  # keep the allocator snapshot (pickle + HTML timeline)
    activation_checkpointing: bool = False
    ncu: bool = False  # one step inside cudaProfilerStart/Stop: ncu's profiled range (ncu.py)
    detailed_memory: bool = False  # hf_sweep: module_memory and phase_costs result keys
    # Hugging Face models (--mode=hf): LoRA, data, sampling, accounting.
    use_lora: bool = False
    lora_rank: int = 16
    pretrained: bool = False
    dataset_path: str | None = None
    dataset_size: int = 10000
    poisson: bool = True
    delta: float = 1e-5
    model_overrides: dict = field(default_factory=dict)  # vocab_size, hidden_dim, ...
    default_model: str = "tiny"  # the mode's default: the directory name omits it

    @property
    def physical_batch_size(self) -> int:
        return self.max_physical_batch_size or self.batch_size

    @property
    def default_attention(self) -> str:
        """Hugging Face models default to SDPA, the seeds' LM to explicit softmax."""
        return "sdpa" if is_hf_model(self.model) else "explicit"

    @property
    def config_dir(self) -> str:
        """``<trainer>_bs<B>_seq<T>`` plus the non-default parts, as the contract names them."""
        name = f"{self.trainer}_bs{self.batch_size}_seq{self.seq_len}"
        if self.physical_batch_size != self.batch_size:
            name += f"_pb{self.physical_batch_size}"
        if self.use_lora:
            name += f"_r{self.lora_rank}"
        if self.dtype == "bfloat16":
            name += "_bf16"
        if self.attention != self.default_attention:
            name += f"_{self.attention}"
        if self.activation_checkpointing:
            name += "_ckpt"
        if self.model != self.default_model:
            name += "_" + self.model.replace("/", "-")
        return name

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("default_model")
        data["physical_batch_size"] = self.physical_batch_size
        return data


def write_json_atomic(path: str, data) -> None:
    with atomic_write(path) as f:
        json.dump(data, f, indent=2)


def read_result(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def environment(device: torch.device) -> dict:
    import opacus

    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "opacus": opacus.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "memory_source": memory.memory_source(device),
    }
    if device.type == "cpu":
        env["threads"] = torch.get_num_threads()
        env["reserved_note"] = "no caching allocator on CPU: reserved memory is not measured"
    return env


def empty_result(config: ExperimentConfig, status: str, error: str | None = None) -> dict:
    return {
        "experiment": config.trainer,
        "config_dir": config.config_dir,
        "status": status,
        "error": error,
        "config": config.to_dict(),
        "env": None,
        "avg_time_ms": None,
        "median_time_ms": None,
        "step_times_ms": [],
        "physical_step_times_ms": [],
        "peak_memory_mb": None,
        "peak_reserved_mb": None,
        "breakdown": None,
        "snapshots": [],
        "kernels": None,
        "flash_routes": None,
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)


class Workload:
    """What a config trains on: the model, its per-sample loss and a batch source.

    The causal LM trains on one fixed synthetic batch of tokens (inputs and next-token targets);
    a Hugging Face classifier on a synthetic (or local) SNLI-shaped dataset, with Poisson
    sampling of each logical batch unless disabled.
    """

    def __init__(self, config: ExperimentConfig, device: torch.device, recorder, env: dict):
        self.config, self.device = config, device
        generator = torch.Generator().manual_seed(config.seed)
        if is_hf_model(config.model):
            import hf_models

            self.model, info = hf_models.build_hf_model(
                config.model,
                device=device,
                use_lora=config.use_lora,
                lora_rank=config.lora_rank,
                pretrained=config.pretrained,
                attention="explicit" if config.attention == "explicit" else "sdpa",
            )
            env["model_info"] = info
            recorder("0_model_loaded")
            vocab = self.model.config.vocab_size
            if config.dataset_path:
                self.inputs, self.labels = hf_models.load_snli(
                    config.dataset_path, config.seq_len, vocab
                )
            else:
                self.inputs, self.labels = hf_models.synthetic_snli(
                    config.dataset_size, config.seq_len, vocab, config.seed
                )
            recorder("dataset_prepared")
            self.loss_fn = hf_models.sequence_classification_loss
            self.sample_rate = config.batch_size / len(self.inputs)
            self.generator = generator
        else:
            self.model = models.build_model(
                config.model,
                device=device,
                attention=config.attention,
                activation_checkpointing=config.activation_checkpointing,
                **config.model_overrides,
            )
            recorder("0_model_loaded")
            tokens = torch.randint(
                self.model.config.vocab_size,
                (config.batch_size, config.seq_len + 1),
                generator=generator,
            ).to(device)
            self.inputs, self.labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            self.loss_fn = None  # the trainers' default: mean token cross-entropy
            self.sample_rate = None
        env["parameters"] = models.count_parameters(self.model)

    def batch(self):
        """The next logical batch (inputs, targets) on the device."""
        if self.sample_rate is None:
            return self.inputs, self.labels
        import hf_models

        if self.config.poisson:
            index = torch.empty(0, dtype=torch.long)
            while len(index) == 0:  # an empty Poisson batch (probability (1-q)^N) is redrawn
                index = hf_models.poisson_batch(len(self.inputs), self.sample_rate, self.generator)
        else:
            index = torch.randperm(len(self.inputs), generator=self.generator)[
                : self.config.batch_size
            ]
        return self.inputs[index].to(self.device), self.labels[index].to(self.device)


def is_hf_model(name: str) -> bool:
    import hf_models

    return name in hf_models.HF_CONFIGS


def run_experiment(config: ExperimentConfig, out_dir: str) -> dict:
    """Build, warm up and measure one config in this process; returns its result dict.

    Order: warm-up steps, timed steps (synchronised), then on CPU one step under the memory
    profiler, then the traced steps: neither measurement disturbs the timed steps.
    """
    device = torch.device(config.device)
    torch.manual_seed(config.seed)
    result = empty_result(config, "ok")
    result["env"] = env = environment(device)
    recorder = memory.PhaseRecorder(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    workload = Workload(config, device, recorder, env)
    model = workload.model
    trainer = trainers.make_trainer(
        config.trainer,
        model,
        lr=config.lr,
        max_grad_norm=config.max_grad_norm,
        noise_multiplier=config.noise_multiplier,
        batch_size=config.batch_size,
        optimizer=config.optimizer,
        dtype=getattr(torch, config.dtype),
        max_physical_batch_size=config.max_physical_batch_size,
        loss_fn=workload.loss_fn,
        on_phase=recorder,
        **({"flash_route": config.flash_route} if config.trainer == "flash" else {}),
    )
    inputs, targets = workload.batch()

    for _ in range(config.warmup_steps):
        trainer.step(*workload.batch())
    synchronize(device)
    if config.ncu:
        recorder.enabled = False
        ncu_profiled_step(trainer, inputs, targets, device)
        env["ncu_note"] = (
            "one step ran inside cudaProfilerStart/Stop for Nsight Compute; its time under "
            "ncu replay is not a measurement, so times and peaks are null"
        )
        return result
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first_measured = len(recorder.snapshots)
    step_times, physical_times, losses, step_starts = [], [], [], []
    for _ in range(config.steps):
        inputs, targets = workload.batch()  # sampled outside the timed region
        synchronize(device)
        start = time.perf_counter()
        step_starts.append(start - recorder.start)
        out = trainer.step(inputs, targets)
        synchronize(device)
        step_times.append((time.perf_counter() - start) * 1e3)
        physical_times.extend(out["physical_step_times_ms"])
        losses.append(out["loss"])

    measured = recorder.snapshots[first_measured:]
    census = module_memory.ModuleCensus(trainer) if config.detailed_memory else None

    def measurement_step():
        """An extra step after the timed ones; the module census (if any) observes it."""
        with census.observing() if census else contextlib.nullcontext():
            trainer.step(inputs, targets)

    if device.type == "cuda":
        # The recorder resets the peak counters at every snapshot, so the measured steps' peak
        # is the largest phase peak among their snapshots.
        result["peak_memory_mb"] = max(s["phase_peak_mb"] for s in measured)
        result["peak_reserved_mb"] = max(s["phase_peak_reserved_mb"] for s in measured)
    else:
        recorder.enabled = False
        result["peak_memory_mb"] = memory.cpu_step_peak_bytes(measurement_step) / MB
    result.update(
        avg_time_ms=statistics.fmean(step_times),
        median_time_ms=statistics.median(step_times),
        step_times_ms=step_times,
        physical_step_times_ms=physical_times,
        losses=losses,
        snapshots=recorder.snapshots,
    )
    if hasattr(trainer, "routes"):
        result["flash_routes"] = trainer.routes()
    if config.breakdown:
        recorder.enabled = False
        result["breakdown"] = breakdown_of_one_step(
            trainer, measurement_step, device, out_dir, config
        )
        if result["breakdown"] is None:
            env["breakdown_note"] = "the allocator history that attributes the peak is CUDA-only"
        else:
            result["breakdown"], result["breakdown_check"] = result["breakdown"]
    if census is not None:
        if not census.steps_observed:  # no measurement step ran yet (CUDA without breakdown)
            recorder.enabled = False
            measurement_step()
        result["module_memory"] = census.result()
        result["phase_costs"] = module_memory.phase_costs(measured, step_starts)
    if config.trace:
        recorder.enabled = False
        use_gzip = device.type == "cuda" if config.trace_gzip is None else config.trace_gzip
        path = tracing.trace_steps(lambda: trainer.step(inputs, targets), device, out_dir, use_gzip)
        result["trace_file"] = os.path.basename(path) if path else None
        if device.type == "cuda" and path:
            summary = kernels.summarize(kernels.kernels_from_trace(path))
            result["kernels"] = summary["categories"]
            result["top_kernels"] = summary["top"]
        else:
            env["kernels_note"] = "GPU kernel times exist only for CUDA runs"
    if workload.sample_rate is not None and trainer.is_private:
        import hf_models

        # Every DP update the model received: warm-up, measured, and the measurement steps
        # after them (CPU peak, breakdown, traces), which reuse the last sampled batch.
        steps = trainer.steps_taken
        result["privacy"] = {
            "epsilon": hf_models.epsilon(
                config.noise_multiplier, workload.sample_rate, steps, config.delta
            ),
            "delta": config.delta,
            "sample_rate": workload.sample_rate,
            "steps": steps,
            "poisson": config.poisson,
            "accountant": "prv",
        }
    return result


def ncu_profiled_step(trainer, inputs, targets, device) -> None:
    """Exactly one training step inside the profiler range; warm-up stays outside it.

    cudaProfilerStart/Stop is process-wide, so the backward kernels that autograd launches from
    its own thread and the optimizer step are inside the range. NVTX ranges name the phases for
    ``ncu --nvtx --nvtx-include "step/"`` (NVTX ranges are per thread: with that filter, kernels
    launched by autograd's thread are not matched; the default suite does not filter).
    """
    if device.type != "cuda":
        raise ValueError("--ncu needs a CUDA device")
    nvtx = torch.cuda.nvtx
    next_range = {"forward_done": "backward", "backward_done": "optimizer"}

    def on_phase(name):
        if name in next_range:
            nvtx.range_pop()
            nvtx.range_push(next_range[name])

    synchronize(device)
    torch.cuda.profiler.start()
    nvtx.range_push("step")
    nvtx.range_push("forward")
    try:
        with trainer.observing_phases(on_phase):
            trainer.step(inputs, targets)
        synchronize(device)
    finally:
        nvtx.range_pop()
        nvtx.range_pop()
        torch.cuda.profiler.stop()


def breakdown_of_one_step(trainer, step, device, out_dir, config):
    """(breakdown, check) of ``step()`` recorded with the allocator history; None on CPU."""
    if device.type != "cuda":
        return None
    breakdown, check, recording, snapshot = memory.record_breakdown(trainer, step, device)
    if config.save_snapshot:
        from torch.cuda import _memory_viz

        # The pickle feeds `python -m torch.cuda._memory_viz`; the HTML is its timeline, ready.
        with atomic_write(os.path.join(out_dir, "memory_snapshot.pickle"), "wb") as f:
            pickle.dump(snapshot, f)
        with atomic_write(os.path.join(out_dir, "memory_timeline.html")) as f:
            f.write(_memory_viz.trace_plot(snapshot))
        # The trimmed recording is what the attribution reads: small enough to keep as a fixture.
        recording_path = os.path.join(out_dir, "breakdown_recording.json.gz")
        with atomic_write(recording_path, "wt", opener=gzip.open) as f:
            json.dump({**recording, "check": check}, f)
    return breakdown, check


def worker_main(config: ExperimentConfig, config_path: str) -> None:
    """Entry point of the forked child: run, classify the outcome, write result.json."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C stops
    # Opacus' hooks warn on every backward of a model whose inputs need no grad (token ids).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    try:
        result = run_experiment(config, config_path)
    except Exception as error:  # noqa: BLE001 - every failure becomes a recorded status
        status = "oom" if is_oom(error) else "error"
        result = empty_result(config, status, f"{type(error).__name__}: {error}")
        if status == "error":
            result["traceback"] = traceback.format_exc()
    write_json_atomic(os.path.join(config_path, "result.json"), result)


class Interrupted(Exception):
    """Ctrl-C during a run: the finished configs are summarised, the running one dropped."""


def run_configs(
    configs: list[ExperimentConfig],
    run_dir: str,
    resume: bool = False,
    log=print,
    progress: bool = False,
) -> list[dict]:
    """Run every config in its own forked worker; returns the results in config order.
    ``progress``: a progress bar over the configs on stderr (``ProgressBar``)."""
    try:
        return _run_configs(configs, run_dir, resume, log, progress)
    except KeyboardInterrupt:  # between two configs: nothing is running
        raise Interrupted("between configs") from None


def _finished(result_path: str, resume: bool) -> dict | None:
    previous = read_result(result_path) if resume else None
    if previous and previous.get("config", {}).get("ncu"):
        # An ncu config is never done: ncu runs the app to profile it now (again in each metric
        # pass of app-range replay); skipping it would leave an empty report in place of one.
        return None
    return previous if previous and previous.get("status") in FINISHED else None


def _run_configs(configs, run_dir, resume, log, progress) -> list[dict]:
    context = multiprocessing.get_context("fork")
    paths = [os.path.join(run_dir, c.config_dir, "result.json") for c in configs]
    to_run = sum(not _finished(p, resume) and not skip_reason(c) for c, p in zip(configs, paths))
    bar = ProgressBar(len(configs), to_run) if progress else None
    if bar:
        log = bar.wrap(log)
    results = []
    for index, (config, result_path) in enumerate(zip(configs, paths), 1):
        config_path = os.path.dirname(result_path)
        previous = _finished(result_path, resume)
        if previous:
            log(f"[{index}/{len(configs)}] {config.config_dir}: {previous['status']} (resumed)")
            results.append(previous)
            if bar:
                bar.advance(None)
            continue
        os.makedirs(config_path, exist_ok=True)
        reason = skip_reason(config)
        started = time.monotonic()
        if reason:
            result = empty_result(config, "skipped", reason)
            write_json_atomic(result_path, result)
        else:
            log(f"[{index}/{len(configs)}] {config.config_dir}: running")
            result = run_in_child(context, config, config_path, result_path)
        log(f"[{index}/{len(configs)}] {config.config_dir}: {describe(result)}")
        results.append(result)
        if bar:
            bar.advance(None if reason else time.monotonic() - started)
    if bar:
        bar.close()
    return results


class ProgressBar:
    """Configs done and left, elapsed time and an estimate of the rest, on stderr.

    The estimate is the mean time of the configs that ran a worker times the workers still to
    run (resumed and skipped configs take no time). A terminal gets one line redrawn in place;
    anything else (a pipe, a log file) one plain line per config, with no carriage returns.
    """

    def __init__(self, total: int, to_run: int, stream=None, width: int = 24):
        self.total, self.to_run, self.width = total, to_run, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done = self.ran = 0
        self.run_seconds = 0.0
        self.start = time.monotonic()

    def advance(self, seconds: float | None) -> None:
        """One config finished; ``seconds``: how long its worker ran, None if none ran."""
        self.done += 1
        if seconds is not None:
            self.ran += 1
            self.run_seconds += seconds
        self.draw()

    def line(self) -> str:
        filled = self.width * self.done // max(1, self.total)
        if self.ran:
            estimate = _duration(self.run_seconds / self.ran * max(0, self.to_run - self.ran))
        else:
            estimate = "estimating" if self.to_run else "0s"
        return (
            f"[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total} configs "
            f"done, {self.total - self.done} left, elapsed "
            f"{_duration(time.monotonic() - self.start)}, estimate {estimate} left"
        )

    def draw(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + self.line())
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def wrap(self, log):
        """``log`` that lifts the redrawn line out of the way of the message (terminals)."""

        def logged(message):
            if self.tty:
                self.stream.write("\r\033[K")
                self.stream.flush()
            log(message)
            sys.stdout.flush()
            if self.tty:
                self.draw()

        return logged

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def skip_reason(config: ExperimentConfig) -> str | None:
    """Why a combination of the plan cannot run (the others still do), or None."""
    if config.physical_batch_size > config.batch_size:
        return f"physical batch {config.physical_batch_size} > logical batch {config.batch_size}"
    trainer = trainers.TRAINERS[config.trainer]
    if config.activation_checkpointing and not trainer.supports_activation_checkpointing:
        return trainers.checkpointing_refusal(config.trainer)
    return None


def run_in_child(context, config, config_path, result_path) -> dict:
    if os.path.exists(result_path):  # an unfinished earlier attempt (--resume reruns it)
        os.replace(result_path, result_path + ".previous")
    process = context.Process(target=worker_main, args=(config, config_path))
    process.start()
    try:
        process.join()
    except KeyboardInterrupt:
        process.terminate()
        process.join()
        raise Interrupted(config.config_dir) from None
    result = read_result(result_path)
    if result is None:  # killed or crashed before writing (segfault, SIGKILL from the OOM killer)
        code = process.exitcode
        reason = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        result = empty_result(config, "error", f"worker died without a result ({reason})")
        write_json_atomic(result_path, result)
    return result


def describe(result: dict) -> str:
    if result["status"] != "ok":
        return f"{result['status']}: {result.get('error')}"
    if result["median_time_ms"] is None:  # an --ncu step: its time under replay is no measurement
        return "ok (" + result["env"].get("ncu_note", "not timed") + ")"
    median, peak = result["median_time_ms"], result["peak_memory_mb"]
    return f"ok, median {median:.1f} ms, peak " + ("n/a" if peak is None else f"{peak:.1f} MB")


def probe_device(requested: str) -> dict:
    """Ask a forked child whether CUDA is usable, so this process never initialises CUDA."""
    context = multiprocessing.get_context("fork")
    parent_end, child_end = context.Pipe(duplex=False)

    def probe():
        available = torch.cuda.is_available()
        child_end.send(
            {"cuda": available, "name": torch.cuda.get_device_name(0) if available else None}
        )

    process = context.Process(target=probe)
    process.start()
    info = parent_end.recv() if parent_end.poll(120) else {"cuda": False, "name": None}
    process.join()
    return info
