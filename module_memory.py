"""Memory of one training step by module group, and time and memory per phase (HF sweeps).

Measured in the worker (``runner.run_experiment`` for configs with ``detailed_memory``), two
result keys:
- ``module_memory``: parameters, gradients, optimizer states, per-sample state and the tensors
  autograd saves for backward, split by module group (``MODULE_GROUPS``: a table of name
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
import re
import statistics
from collections import Counter

import torch

from memory import MB

# Module groups, by the qualified name of a module or parameter: the first matching row wins.
MODULE_GROUPS: tuple[tuple[str, re.Pattern], ...] = (
    # LoRA first: peft's adapters sit inside the attention and MLP projections.
    ("lora", re.compile(r"(^|\.)lora_\w+(\.|$)")),
    ("classifier_head", re.compile(r"(^|\.)(score|classifier|lm_head)(\.|$)")),
    ("embedding", re.compile(r"(^|\.)(embed_tokens|tok_emb|pos_emb|wte|wpe)(\.|$)")),
    # Before attention: "post_attention_layernorm" is a norm.
    ("norm", re.compile(r"(^|\.)(\w*norm\w*|ln\w*)(\.|$)")),
    ("attention", re.compile(r"(^|\.)(self_attn|attn|attention)(\.|$)")),
    ("mlp", re.compile(r"(^|\.)(mlp|ffn|feed_forward)(\.|$)")),
)
OTHER = "other"  # the model's glue (rotary tables, pooling) and the loss
GROUPS = (*(name for name, _ in MODULE_GROUPS), OTHER)
# What the census counts per group. Parameters are static; the others are taken at every phase
# event of the observed step and kept at the phase where their total is largest.
KINDS = (
    "parameters",
    "trainable_parameters",
    "gradients",
    "optimizer_states",
    "per_sample_gradients",  # Opacus hooks: p.grad_sample
    "norm_samples",  # Opacus ghost: p._norm_sample
    "dp_saved_tensors",  # inputs/outputs kept by Opacus' or flash's hooks, not saved by autograd
    "activations",  # tensors autograd saved for backward in one physical chunk's forward
)


def module_group(name: str) -> str | None:
    """The group of a qualified module or parameter name; None when no row matches."""
    for group, pattern in MODULE_GROUPS:
        if pattern.search(name):
            return group
    return None


def _storage(tensor) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage; None for tensors without one."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


class ModuleCensus:
    """Bytes by module group and kind during one observed training step.

    Identity, not estimates: every count is the size of distinct tensor storages found where the
    trainer keeps them (``p.grad``, ``p.grad_sample``, ``p._norm_sample``, optimizer states,
    ``module.activations``, flash's saved A/G) or handed to autograd's pack hook
    (``torch.autograd.graph.saved_tensors_hooks``) while a module of that group ran its forward.
    Parameters are excluded from the saved tensors. The census reads sizes only, allocates no
    device memory and keeps no tensor alive, so the step it observes measures the same.
    Flash's output gradients G and the per-sample gradients it keeps exist from the end of its
    backward to its clipping: they are counted at its internal ``_clip_inputs_saved`` event.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        model = trainer.model
        trainable = {id(p) for g in trainer.base_optimizer.param_groups for p in g["params"]}
        self.params = [(module_group(n) or OTHER, p) for n, p in model.named_parameters()]
        self.param_addresses = {s[0] for _, p in self.params if (s := _storage(p))}
        self.static = {"parameters": Counter(), "trainable_parameters": Counter()}
        for group, p in self.params:
            self.static["parameters"][group] += p.numel() * p.element_size()
            if id(p) in trainable:
                self.static["trainable_parameters"][group] += p.numel() * p.element_size()
        self.modules = [(m, g) for n, m in model.named_modules() if (g := module_group(n))]
        self.group_of_module = {id(m): g for m, g in self.modules}
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
        observer = self.trainer.on_phase
        handles = []
        for module, group in self.modules:
            handles.append(module.register_forward_pre_hook(lambda *_, g=group: self._enter(g)))
            handles.append(module.register_forward_hook(self._leave, always_call=True))

        def on_phase(name):
            self._on_phase(name)
            observer(name)

        try:
            with (
                self.trainer.observing_phases(on_phase),
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
        counts = {kind: Counter() for kind in KINDS[2:-1]}
        seen: dict[str, set] = {kind: set() for kind in counts}

        def add(kind, group, obj, exclude=()):
            for tensor in _tensors(obj):
                storage = _storage(tensor)
                if storage and storage[0] not in seen[kind] and storage[0] not in exclude:
                    seen[kind].add(storage[0])
                    counts[kind][group] += storage[1]

        state = self.trainer.base_optimizer.state
        for group, p in self.params:
            add("gradients", group, [p.grad, getattr(p, "summed_grad", None)])
            add("optimizer_states", group, list(state[p].values()) if p in state else [])
            add("per_sample_gradients", group, getattr(p, "grad_sample", None))
            add("norm_samples", group, getattr(p, "_norm_sample", None))
        # Hook-kept tensors that autograd saved anyway cost nothing extra: count the others.
        exclude = set(self.saved) | self.param_addresses
        for module, group in self._hooked_modules():
            add("dp_saved_tensors", group, getattr(module, "activations", None), exclude)
        engine = getattr(self.trainer, "engine", None)
        for layer in getattr(engine, "layers", []):
            group = self.group_of_module.get(id(layer.module), OTHER)
            add("dp_saved_tensors", group, layer.calls, exclude)
            add("per_sample_gradients", group, list(layer.per_sample.values()))
        return counts

    def _hooked_modules(self):
        for name, module in self.trainer.model.named_modules():
            if getattr(module, "activations", None):
                yield module, self.group_of_module.get(id(module)) or module_group(name) or OTHER

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

OPERATIONS = (
    ("forward", "forward_done"),
    ("backward", "backward_done"),
    ("optimizer_step", "step_done"),
)
_OPERATION_OF_PHASE = {phase: op for op, phase in OPERATIONS}


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
