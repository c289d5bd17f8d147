"""Where the peak goes: the live allocator blocks at the peak of one recorded step, by role.

A block's role comes from the trainer first (``Trainer.memory``: what it holds, by
identity, at the phase events around the peak), else from the Python functions on the stack that
allocated it (``Trainer.memory().sites``: the first matching site wins). CUDA only: it reads
the caching allocator's history.
"""

from __future__ import annotations

import gc

import torch
from torch.distributed.tensor import DTensor

from dp_cost.core.schema import BREAKDOWN_KEYS, MB, AllocationSite

MARKER_FUNCTION = "_phase_marker"


def _phase_marker(device: torch.device) -> None:
    """A tiny allocation whose stack names this function: a phase boundary in the history."""
    marker = torch.empty(1, device=device)
    del marker


def tensor_identities(runner, device_type: str = "cuda", key=None) -> dict[int, str]:
    """Storage address -> role for every tensor on ``device_type`` the runner's trainer holds;
    the first role listed wins (a storage can be reachable several ways, e.g. Opacus' saved
    activations are views of the model's activations). ``key(tensor)``: another number per
    storage than its address (fake tensors have none)."""
    roles: dict[int, str] = {}
    for role, tensor in held_tensors(runner):
        if tensor.device.type == device_type:
            address = key(tensor) if key else tensor.untyped_storage().data_ptr()
            roles.setdefault(address, role)
    return roles


def held_tensors(runner):
    """(role, tensor) of every tensor the runner's trainer holds, in ``memory``'s order (FSDP2:
    the shard this rank holds of a DTensor)."""
    for role, _, tensor in runner.trainer.memory().tensors:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        if isinstance(tensor, torch.Tensor):
            yield role, tensor


def classify_frames(frames: list[dict], sites: list[AllocationSite]) -> str:
    if not any(f.get("filename") or f.get("name") for f in frames):
        # No Python frame: allocated by autograd's backward thread (activation gradients,
        # parameter-gradient buffers not yet known by identity) or by C++ internals.
        return "activations"
    for site in sites:
        if any(site.matches(f.get("filename", ""), f.get("name", "")) for f in frames):
            return site.role
    return "other"


def attribute_peak(
    trace: list[dict],
    initial_blocks: dict[int, int],
    identities: list[dict[int, str]],
    sites: list[AllocationSite],
) -> dict:
    """Replay one recorded step and split the live bytes at its peak into categories.

    ``trace``: the allocator's device trace (``alloc`` / ``free_completed`` events with ``addr``,
    ``size``, ``frames``) including the phase-marker allocations; ``initial_blocks``: addr -> size
    of the blocks alive when recording began; ``identities[k]``: addr -> role at marker k
    (``identities[0]``: when recording began); ``sites``: the trainer's allocation sites. A block
    alive at the peak takes its role from the identity map of the first marker after the peak if
    it lived until then, else of the last marker before the peak if it existed then, else from its
    allocating stack.
    Pure function: unit-tested on CPU with recorded fixtures and synthetic cases.
    """
    peak, freed_before_next_marker = replay_to_peak(trace, initial_blocks)
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
            role = classify_frames(frames, sites) if event_index is not None else "other"
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


def is_marker(event: dict) -> bool:
    """A phase marker's allocation (``_phase_marker``'s, or the fake step's stand-in)."""
    return event["action"] == "alloc" and any(
        frame.get("name") == MARKER_FUNCTION for frame in event.get("frames", [])
    )


def replay_to_peak(
    trace: list[dict], initial_blocks: dict[int, int]
) -> tuple[dict, set[tuple[int, int | None]]]:
    """The live blocks at the trace's peak (``{"total", "live", "markers"}``: bytes, addr ->
    (size, index of the alloc event or None if alive at the start, markers seen before its
    alloc), the markers passed by then), and the (addr, alloc index) of the blocks freed between
    the peak and the next marker. Marker allocations count as markers, not bytes."""
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
        if is_marker(event):
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
    return peak, freed_before_next_marker


def peaks_by_phase(trace: list[dict], initial_blocks: dict[int, int]) -> list[int]:
    """The most bytes live within each phase of a recorded step: one number per stretch between
    its markers (the first before any), as ``replay_to_peak`` counts them. A step's peak is their
    largest; the phase it lies in can change with the model's size where two phases come close."""
    live = dict(initial_blocks)
    total = sum(live.values())
    peaks, marker_blocks = [total], set()
    for event in trace:
        action, addr = event["action"], event["addr"]
        if is_marker(event):
            marker_blocks.add(addr)
            peaks.append(total)
        elif action == "alloc":
            live[addr] = event["size"]
            total += event["size"]
            peaks[-1] = max(peaks[-1], total)
        elif action == "free_completed":
            if addr in marker_blocks:  # the marker's own block: its address may come again
                marker_blocks.discard(addr)
                continue
            total -= live.pop(addr, 0)
    return peaks


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


def record_breakdown(runner, step, device: torch.device):
    """Run ``step()`` once under the allocator's history recorder; attribute its peak.

    Returns (breakdown in MB keyed by ``core.schema.BREAKDOWN_KEYS``, a check dict, the trimmed
    recording the attribution read, the allocator snapshot itself). The check compares the
    replayed peak with torch's own ``max_memory_allocated`` for the same step and the replayed
    starting bytes with ``memory_allocated`` before it.
    """
    torch.cuda.synchronize(device)
    gc.collect()
    identities = [tensor_identities(runner)]
    phases = ["step start"]

    def on_phase(name):
        identities.append(tensor_identities(runner))
        phases.append(name)
        _phase_marker(device)

    torch.cuda.reset_peak_memory_stats(device)
    allocated_at_start = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=10_000_000, stacks="python")
    try:
        with runner.observing_phases(on_phase):
            step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    torch_peak = torch.cuda.max_memory_allocated(device)
    trace = trim_trace(snapshot["device_traces"][device.index or 0])
    start = initial_blocks(snapshot, trace)
    attributed = attribute_peak(trace, start, identities, runner.trainer.memory().sites)
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
