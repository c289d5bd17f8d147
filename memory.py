"""Memory measurement: phase snapshots, the peak of a step, and what counts as "measured".

CUDA: torch's caching-allocator counters (``memory_allocated`` / ``max_memory_allocated`` after a
reset, and their ``reserved`` twins). CPU has no such counters, so there the peak of a step is
the bytes of every live tensor storage when the step starts plus the highest running total of
the allocations and frees torch.profiler reports during the step (``memory_source =
"cpu-profiler"``); CPU snapshots and reserved bytes are ``null``: nothing measures them.
"""

from __future__ import annotations

import gc
import json
import os
import re
import tempfile
import time
import warnings

import torch

MB = 2**20


def memory_source(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu-profiler"


class PhaseRecorder:
    """Snapshots of allocated/reserved memory at the contract's phase names.

    Each snapshot also carries the peak allocated since the previous snapshot (the peak inside
    that phase), read from the allocator's peak counter, which is reset at every snapshot.
    """

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device = device
        self.enabled = enabled
        self.snapshots: list[dict] = []
        self.start = time.perf_counter()

    def __call__(self, name: str) -> None:
        if not self.enabled or name.startswith("_"):  # internal markers are no snapshots
            return
        if self.device.type == "cuda":
            # Kernels run asynchronously: the phase ends when the GPU is done with it, not when
            # the CPU has launched it (a timestamp taken before this wait lags one phase behind).
            torch.cuda.synchronize(self.device)
        snapshot = {"name": name, "timestamp": time.perf_counter() - self.start}
        if self.device.type == "cuda":
            snapshot["allocated_mb"] = torch.cuda.memory_allocated(self.device) / MB
            snapshot["reserved_mb"] = torch.cuda.memory_reserved(self.device) / MB
            snapshot["phase_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / MB
            snapshot["phase_peak_reserved_mb"] = torch.cuda.max_memory_reserved(self.device) / MB
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            snapshot.update(
                allocated_mb=None, reserved_mb=None, phase_peak_mb=None, phase_peak_reserved_mb=None
            )
        self.snapshots.append(snapshot)


def live_tensor_bytes() -> int:
    """Bytes of every distinct storage reachable from a Python tensor object (and its .grad)."""
    storages: dict[int, int] = {}

    def add(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

    with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for tensor in tensors:
        add(tensor)
        add(tensor.grad)
    return sum(storages.values())


def cpu_step_peak_bytes(step) -> int:
    """Peak bytes during ``step()`` on CPU, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    baseline = live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    memory_events = sorted(
        (e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
        key=lambda e: e["ts"],
    )
    running = peak = 0
    for event in memory_events:
        running += event["args"]["Bytes"]
        peak = max(peak, running)
    return baseline + peak


# ----------------------------------------------------------------------------------------------
# Where the peak goes: attribution of the live allocator blocks at the peak of a recorded step.

BREAKDOWN_KEYS = (
    "model_parameters_mb",
    "optimizer_states_mb",
    "gradients_mb",
    "per_sample_gradients_mb",
    "activation_hooks_mb",
    "activations_mb",
    "norm_samples_mb",
    "temp_matrices_mb",
    "other_mb",
)
MARKER_FUNCTION = "_phase_marker"

# Blocks allocated during the recorded step whose role no identity snapshot tells, classified by
# the Python frames that allocated them: first matching row wins; "file:function" is searched.
STACK_RULES = [
    # Ghost clipping's B x T x T ggT/aaT, Opacus' rescaled copies of each layer's output
    # gradient (B x T x p, made for the norm or per-sample computation), Flash's Gram tiles.
    ("temp_matrices", re.compile(r"opacus/grad_sample/\w+\.py:\w*norm_sample")),
    ("temp_matrices", re.compile(r"opacus/grad_sample/\w+\.py:rearrange_grad_samples")),
    ("temp_matrices", re.compile(r"flash_clip\.py:(gram_squared_norms|direct_squared_norms)")),
    ("norm_samples", re.compile(r"flash_clip\.py:\w*squared_norms|:get_clipping_coef|:get_norm_")),
    # Opacus' per-sample gradients and their clipped copies in the optimizer.
    (
        "per_sample_gradients",
        re.compile(
            r"opacus/grad_sample/\w+\.py:(compute_\w+_grad_sample|create_or_accumulate_grad_sample)"
        ),
    ),
    ("per_sample_gradients", re.compile(r"opacus/optimizers/\w+\.py:clip")),
    # Flash's per-sample grads of the layers that keep them (formed in the backward hook).
    ("per_sample_gradients", re.compile(r"flash_clip\.py:(per_sample_grads|_add_per_sample)")),
    # Clipped gradients written by flash; Opacus' summed / noised gradients; flash's noise.
    ("gradients", re.compile(r"flash_clip\.py:\w*clipped_grads|opacus/optimizers/")),
    ("gradients", re.compile(r"trainers\.py:optimizer_step")),
    ("optimizer_states", re.compile(r"torch/optim/")),
    # Allocated by a module's forward (or the loss): activations kept for backward.
    ("activations", re.compile(r"torch/nn/|models\.py:|hf_models\.py:|transformers/|peft/")),
]


def _phase_marker(device: torch.device) -> None:
    """A tiny allocation whose stack names this function: a phase boundary in the history."""
    marker = torch.empty(1, device=device)
    del marker


def tensor_identities(trainer) -> dict[int, str]:
    """Storage address -> category for every CUDA tensor whose role is known by identity.

    The most specific role wins (a storage can be reachable several ways, e.g. Opacus' saved
    activations are views of the model's activations).
    """
    roles: dict[int, str] = {}

    def tag(tensors, role):
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                roles.setdefault(t.untyped_storage().data_ptr(), role)

    def flat(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                yield from flat(item)

    model = trainer.model
    params = list(model.parameters())
    tag((x for p in params for x in flat(getattr(p, "grad_sample", None))), "per_sample_gradients")
    tag((x for p in params for x in flat(getattr(p, "_norm_sample", None))), "norm_samples")
    tag(
        (x for m in model.modules() for x in flat(getattr(m, "activations", None))),
        "activation_hooks",
    )
    engine = getattr(trainer, "engine", None)  # flash: the saved A and G of each layer
    if engine is not None:
        tag((x for layer in engine.layers for x in flat(layer.calls)), "activation_hooks")
        tag(
            (g for layer in engine.layers for g in layer.per_sample.values()),
            "per_sample_gradients",
        )
    tag((p.grad for p in params if p.grad is not None), "gradients")
    tag((getattr(p, "summed_grad", None) for p in params), "gradients")
    states = trainer.base_optimizer.state.values()
    tag((t for state in states for t in state.values()), "optimizer_states")
    tag(params, "model_parameters")
    return roles


def classify_frames(frames: list[dict]) -> str:
    text = "\n".join(f"{f.get('filename', '')}:{f.get('name', '')}" for f in frames)
    if not text.strip():
        # No Python frame: allocated by autograd's backward thread (activation gradients,
        # parameter-gradient buffers not yet known by identity) or by C++ internals.
        return "activations"
    for role, pattern in STACK_RULES:
        if pattern.search(text):
            return role
    return "other"


def attribute_peak(
    trace: list[dict], initial_blocks: dict[int, int], identities: list[dict[int, str]]
) -> dict:
    """Replay one recorded step and split the live bytes at its peak into categories.

    ``trace``: the allocator's device trace (``alloc`` / ``free_completed`` events with ``addr``,
    ``size``, ``frames``) including the phase-marker allocations; ``initial_blocks``: addr -> size
    of the blocks alive when recording began; ``identities[k]``: addr -> role at marker k
    (``identities[0]``: when recording began). A block alive at the peak takes its role from the
    identity map of the first marker after the peak if it lived until then, else of the last
    marker before the peak if it existed then, else from its allocating stack.
    Pure function: unit-tested on CPU with recorded fixtures and synthetic cases.
    """
    # addr -> (size, index of the alloc event or None if alive at the start, markers seen before)
    live: dict[int, tuple[int, int | None, int]] = {
        addr: (size, None, -1) for addr, size in initial_blocks.items()
    }
    total = sum(initial_blocks.values())
    markers = 0
    marker_blocks: set[int] = set()
    peak = {"total": total, "live": dict(live), "markers": 0}
    freed_before_next_marker: set[tuple[int, int | None]] = set()
    for index, event in enumerate(trace):
        action, addr = event["action"], event["addr"]
        if action == "alloc" and any(
            frame.get("name") == MARKER_FUNCTION for frame in event.get("frames", [])
        ):
            markers += 1
            marker_blocks.add(addr)
            continue
        if action == "alloc":
            live[addr] = (event["size"], index, markers)
            total += event["size"]
            if total > peak["total"]:
                peak = {"total": total, "live": dict(live), "markers": markers}
                freed_before_next_marker = set()
        elif action == "free_completed":
            if addr in marker_blocks:
                marker_blocks.discard(addr)
                continue
            block = live.pop(addr, None)
            if block is None:
                continue
            total -= block[0]
            if markers == peak["markers"]:  # between the peak and the next marker
                freed_before_next_marker.add((addr, block[1]))
    breakdown = {key: 0 for key in BREAKDOWN_KEYS}
    sources: dict[tuple[str, str], int] = {}
    before, after = peak["markers"], peak["markers"] + 1
    for addr, (size, event_index, alloc_markers) in peak["live"].items():
        role = None
        if after < len(identities) and (addr, event_index) not in freed_before_next_marker:
            role = identities[after].get(addr)
        if role is None and alloc_markers < before and before < len(identities):
            role = identities[before].get(addr)
        if role is None and alloc_markers < 0:
            role = identities[0].get(addr) if identities else None
        how = "identity"
        if role is None:
            frames = trace[event_index].get("frames", []) if event_index is not None else []
            role = classify_frames(frames) if event_index is not None else "other"
            how = _signature(frames) if event_index is not None else "(alive before the step)"
        breakdown[f"{role}_mb"] += size
        sources[(role, how)] = sources.get((role, how), 0) + size
    top = sorted(sources.items(), key=lambda item: -item[1])[:15]
    return {
        "peak_bytes": peak["total"],
        "peak_phase": before,
        "breakdown_bytes": breakdown,
        # Where each category's bytes came from: "identity" or the allocating frames.
        "top_sources": [{"role": r, "source": h, "bytes": b} for (r, h), b in top],
    }


def _signature(frames: list[dict]) -> str:
    if not frames:
        return "(no Python frame: autograd backward or C++)"
    return " < ".join(
        f"{f.get('filename', '').rsplit('/', 1)[-1]}:{f.get('name', '')}" for f in frames[:3]
    )


def initial_blocks(snapshot: dict, trace: list[dict]) -> dict[int, int]:
    """addr -> size of the blocks that were alive when the history recording began."""
    allocated_in_trace = {e["addr"] for e in trace if e["action"] == "alloc"}
    blocks = {}
    seen_alloc: set[int] = set()
    for event in trace:  # freed during the step without being allocated in it: pre-existing
        if event["action"] == "alloc":
            seen_alloc.add(event["addr"])
        elif event["action"] == "free_completed" and event["addr"] not in seen_alloc:
            blocks[event["addr"]] = event["size"]
    for segment in snapshot["segments"]:  # alive at the end and never allocated in the step
        addr = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and addr not in allocated_in_trace:
                blocks[addr] = block["size"]
            addr += block["size"]
    return blocks


def trim_trace(trace: list[dict]) -> list[dict]:
    """The fields attribution needs (the recorded history also holds C++ frames, streams...)."""
    keep = ("alloc", "free_completed")
    return [
        {
            "action": e["action"],
            "addr": e["addr"],
            "size": e["size"],
            "frames": [
                {"filename": f.get("filename", ""), "name": f.get("name", "")}
                for f in e.get("frames", [])
                if f.get("filename", "").endswith(".py")
            ],
        }
        for e in trace
        if e["action"] in keep
    ]


def record_breakdown(trainer, step, device: torch.device):
    """Run ``step()`` once under the allocator's history recorder; attribute its peak.

    Returns (breakdown in MB keyed as the contract says, a check dict, the trimmed recording the
    attribution read, the allocator snapshot itself). The check compares the
    replayed peak with torch's own ``max_memory_allocated`` for the same step and the replayed
    starting bytes with ``memory_allocated`` before it.
    """
    torch.cuda.synchronize(device)
    gc.collect()
    identities = [tensor_identities(trainer)]
    phases = ["step start"]

    def on_phase(name):
        identities.append(tensor_identities(trainer))
        phases.append(name)
        _phase_marker(device)

    torch.cuda.reset_peak_memory_stats(device)
    allocated_at_start = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=10_000_000, stacks="python")
    try:
        with trainer.observing_phases(on_phase):
            step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    torch_peak = torch.cuda.max_memory_allocated(device)
    trace = trim_trace(snapshot["device_traces"][device.index or 0])
    start = initial_blocks(snapshot, trace)
    attributed = attribute_peak(trace, start, identities)
    breakdown = {k: v / MB for k, v in attributed["breakdown_bytes"].items()}
    check = {
        "replayed_peak_mb": attributed["peak_bytes"] / MB,
        "torch_peak_mb": torch_peak / MB,
        "replayed_start_mb": sum(start.values()) / MB,
        "torch_start_mb": allocated_at_start / MB,
        "peak_after_phase": phases[attributed["peak_phase"]],
        "top_sources": [
            {**source, "mb": source.pop("bytes") / MB} for source in attributed["top_sources"]
        ],
    }
    recording = {"trace": trace, "initial": start, "identities": identities}
    return breakdown, check, recording, snapshot
