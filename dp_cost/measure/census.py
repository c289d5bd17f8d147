"""Memory of one training step by module group, and time and memory per phase (HF sweeps).

Measured in the worker (``measure.steps.ModuleCensus`` for configs with ``detailed_memory``), two
result keys:
- ``module_memory``: parameters, gradients, optimizer states, per-sample state and the tensors
  autograd saves for backward, split by module group (``core.schema.MODULE_GROUPS``: a table of name
  patterns) by a census of one measurement step (``ModuleCensus``);
- ``phase_costs``: time and memory of forward, backward and optimizer step (``phase_costs``).

Limits:
- Groups come from qualified names (the first matching pattern wins): what no pattern names
  (rotary tables, pooling, the loss) counts as ``other``.
- Each kind is taken at the phase event where its total is largest, so one group's kinds need not
  exist at the same moment: their sum is not the step's peak (that is ``peak_memory_mb``,
  attributed by ``breakdown``).
- The census counts distinct tensor storages, each whole, where the trainer keeps them and in
  autograd's pack hook: temporaries freed inside a phase, kernel workspaces and the caching
  allocator's reserve are not counted. Flash's output gradients G and kept per-sample gradients
  are counted at its internal ``_clip_inputs_saved`` event. Activations are one physical chunk's.
- Memory per phase needs the CUDA allocator: on CPU, ``phase_costs`` has times only.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections import Counter

import torch
from torch.distributed.tensor import DTensor

from dp_cost.core.schema import CENSUS_KINDS as KINDS
from dp_cost.core.schema import GROUPS, MB, OPERATIONS, module_group
from dp_cost.core.schema import OTHER_GROUP as OTHER

# The census kind of each trainer state role (the rest are not counted per phase).
KIND_OF_ROLE = {
    "gradients": "gradients",
    "optimizer_states": "optimizer_states",
    "per_sample_gradients": "per_sample_gradients",
    "norm_samples": "norm_samples",
    "activation_hooks": "dp_saved_tensors",
}


def _storage(tensor) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage; None for tensors without one."""
    try:
        if isinstance(tensor, DTensor):  # FSDP2: the shard this rank holds
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class ModuleCensus:
    """Bytes by module group and kind during one observed training step.

    Identity, not estimates: every count is the size of distinct tensor storages the trainer says
    it holds (``Trainer.memory().tensors``: gradients, optimizer states, Opacus' per-sample
    gradients and norm samples, tensors kept by DP hooks, flash's saved A/G) or handed to
    autograd's pack hook (``torch.autograd.graph.saved_tensors_hooks``) while a module of that
    group ran its forward.
    Parameters are excluded from the saved tensors. The census reads sizes only, allocates no
    device memory and keeps no tensor alive, so the step it observes measures the same.
    Flash's output gradients G and the per-sample gradients it keeps exist from the end of its
    backward to its clipping: they are counted at its internal ``_clip_inputs_saved`` event.
    """

    def __init__(self, runner):
        self.runner = runner
        model = runner.model
        trainable = {id(p) for p in runner.trainer.parameters}
        self.params = [(module_group(n) or OTHER, p) for n, p in model.named_parameters()]
        self.param_addresses = {s[0] for _, p in self.params if (s := _storage(p))}
        self.static = {"parameters": Counter(), "trainable_parameters": Counter()}
        for group, p in self.params:
            # FSDP2: the shard this rank holds (a DTensor's numel() is the whole parameter's)
            shard = _storage(p) if isinstance(p, DTensor) else None
            nbytes = shard[1] if shard else p.numel() * p.element_size()
            self.static["parameters"][group] += nbytes
            if id(p) in trainable:
                self.static["trainable_parameters"][group] += nbytes
        self.modules = [(m, g) for n, m in model.named_modules() if (g := module_group(n))]
        self.group_of_module = {id(m): g for m, g in self.modules}
        self.modules_by_name = dict(model.named_modules())
        self.stack: list[str] = []  # groups of the modules whose forward is running
        self.saved: dict[int, tuple[str, int]] = {}  # address -> (group, bytes), this chunk
        self.largest: dict[str, tuple[int, str, Counter]] = {}  # kind -> (total, phase, bytes)
        self.steps_observed = 0

    def _pack(self, tensor):
        storage = _storage(tensor)
        if storage and storage[1] and storage[0] not in self.param_addresses:
            group = self.stack[-1] if self.stack else OTHER
            self.saved.setdefault(storage[0], (group, storage[1]))
        return tensor

    @contextlib.contextmanager
    def observing(self):
        """Observe the trainer step run inside; phase events still reach the current observer."""
        handles = []
        for module, group in self.modules:
            handles.append(module.register_forward_pre_hook(lambda *_, g=group: self._enter(g)))
            handles.append(module.register_forward_hook(self._leave, always_call=True))

        try:
            with (
                self.runner.observing_phases(self._on_phase, also_current=True),
                torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor),
            ):
                yield
            self.steps_observed += 1
        finally:
            for handle in handles:
                handle.remove()
            self.stack.clear()
            self.saved.clear()

    def _enter(self, group):
        self.stack.append(group)

    def _leave(self, *_):
        if self.stack:
            self.stack.pop()

    def _by_identity(self) -> dict[str, Counter]:
        counts = {kind: Counter() for kind in KIND_OF_ROLE.values()}
        seen: dict[str, set] = {kind: set() for kind in counts}
        # Hook-kept tensors that autograd saved anyway cost nothing extra: count the others.
        not_extra = set(self.saved) | self.param_addresses
        for role, owner, tensor in self.runner.trainer.memory().tensors:
            kind = KIND_OF_ROLE.get(role)
            storage = _storage(tensor) if kind else None
            if not storage or storage[0] in seen[kind]:
                continue
            if kind == "dp_saved_tensors" and storage[0] in not_extra:
                continue
            seen[kind].add(storage[0])
            counts[kind][self._group_of(owner)] += storage[1]
        return counts

    def _group_of(self, owner: str) -> str:
        module = self.modules_by_name.get(owner)
        if module is not None and id(module) in self.group_of_module:
            return self.group_of_module[id(module)]
        return module_group(owner) or OTHER

    def _on_phase(self, phase: str) -> None:
        counts = self._by_identity()
        if phase == "forward_done":
            activations = Counter()
            for group, nbytes in self.saved.values():
                activations[group] += nbytes
            counts["activations"] = activations
        for kind, by_group in counts.items():
            total = sum(by_group.values())
            if total > self.largest.get(kind, (0,))[0]:  # a kind never seen stays absent
                self.largest[kind] = (total, phase, by_group)
        if phase == "backward_done":  # the next physical chunk saves its own activations
            self.saved.clear()

    def result(self) -> dict:
        """The ``module_memory`` result key: MB per group and kind, and when each was taken."""
        counts = {**self.static, **{kind: entry[2] for kind, entry in self.largest.items()}}
        groups = {
            group: {f"{kind}_mb": counts.get(kind, Counter())[group] / MB for kind in KINDS}
            for group in GROUPS
        }
        return {
            "groups": groups,
            "phase_of": {
                f"{kind}_mb": (self.largest[kind][1] if kind in self.largest else None)
                for kind in KINDS[2:]
            },
            "method": "distinct tensor storages by identity and by autograd's pack hook during "
            "one measurement step; each kind at the phase event where its total is largest",
        }


# ---------------------------------------------------------------- operation level

_OPERATION_OF_PHASE = {phase: op for op, phase in OPERATIONS}


def unmeasured_phase_costs() -> dict:
    """The ``phase_costs`` key where no phase was measured: every value null."""
    return {op: dict.fromkeys(("time_ms", "peak_mb", "allocated_after_mb")) for op, _ in OPERATIONS}


def phase_costs(snapshots: list[dict], step_starts: list[float]) -> dict:
    """The ``phase_costs`` result key: per operation, the median over the measured steps of its
    time (summed over physical chunks) and, where the allocator measures it (CUDA), the largest
    peak inside that phase and the allocated bytes when it ended.

    ``snapshots``: the measured steps' phase snapshots; ``step_starts``: when each measured step
    began, on the snapshots' clock. With physical chunks, an Opacus trainer clips and
    accumulates chunk k between its ``backward_done`` and chunk k+1's ``forward_done``: that time
    counts as forward of chunk k+1.
    """
    bounds = [*step_starts, math.inf]
    per_step = []
    for start, end in zip(bounds, bounds[1:]):
        times, previous = dict.fromkeys(_OPERATION_OF_PHASE.values(), 0.0), start
        for snap in snapshots:
            if start <= snap["timestamp"] < end and snap["name"] in _OPERATION_OF_PHASE:
                times[_OPERATION_OF_PHASE[snap["name"]]] += (snap["timestamp"] - previous) * 1e3
                previous = snap["timestamp"]
        per_step.append(times)
    costs = {}
    for op, phase in OPERATIONS:
        snaps = [s for s in snapshots if s["name"] == phase and s.get("phase_peak_mb") is not None]
        costs[op] = {
            "time_ms": statistics.median(t[op] for t in per_step) if per_step else None,
            "peak_mb": max((s["phase_peak_mb"] for s in snaps), default=None),
            "allocated_after_mb": max((s["allocated_mb"] for s in snaps), default=None),
        }
    if not any(c["peak_mb"] is not None for c in costs.values()):
        costs["memory_note"] = "memory per phase needs the CUDA allocator: not measured on CPU"
    return costs
