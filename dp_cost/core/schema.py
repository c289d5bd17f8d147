"""The result file and the names measuring and reporting share (one place for each).

A config's ``result.json`` is the one seam between measuring (``measure/``) and reporting
(``report/``, ``ncu/``): this module says what keys it has and what the names in it mean.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dp_cost.core.fmt import did_you_mean

MB = 2**20  # bytes per MB, as torch reports memory

# ---------------------------------------------------------------- statuses and exit codes
STATUSES = ("ok", "oom", "error", "skipped")
FINISHED = ("ok", "oom", "skipped")  # statuses --resume does not run again
EXIT_OK, EXIT_CONFIG_ERROR, EXIT_BAD_ARGS, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


def exit_code_of(results: list[dict]) -> int:
    """A run's exit code from its results: a config that failed with an error fails the run."""
    return EXIT_CONFIG_ERROR if any(r["status"] == "error" for r in results) else EXIT_OK


# ---------------------------------------------------------------- distribution over ranks
# --distributed: one process, torch's DDP, FSDP2 (each a mode object: dp_cost.parallel.mode)
DISTRIBUTED_MODES = ("none", "ddp", "fsdp")
# FSDP2's gradient sync (--fsdp_sync): reduce-scatter after every physical chunk, or hold the
# unsharded gradients over the chunks and reduce-scatter once, after the logical batch's last.
FSDP_SYNCS = ("chunk", "logical")

# ---------------------------------------------------------------- trainers, as reports show them
# Canonical order and titles; a trainer not listed (a new one) sorts last, titled by its name.
TRAINER_ORDER = ("standard", "dpsgd", "ghost", "flash")
# The DP trainers' clipping rules (--clipping): one bound on each sample's whole gradient, or
# Opacus' per-layer rule (dp_cost.training.clipping)
CLIPPINGS = ("flat", "per_layer")
TRAINER_TITLES = {
    "standard": "Standard (no DP)",
    "dpsgd": "DP-SGD, per-sample grads (Opacus hooks)",
    "ghost": "Ghost Clipping (Opacus)",
    "flash": "Flash Clipping (ours)",
}


def trainer_rank(name: str) -> int:
    return TRAINER_ORDER.index(name) if name in TRAINER_ORDER else len(TRAINER_ORDER)


def trainer_title(name: str) -> str:
    return TRAINER_TITLES.get(name, name)


# ---------------------------------------------------------------- memory breakdown at the peak
# Roles a trainer's tensors can have (``Trainer.memory().tensors``), a breakdown key "<role>_mb".
ROLES = (
    "model_parameters",
    "optimizer_states",
    "gradients",
    "per_sample_gradients",
    "activation_hooks",  # inputs/outputs kept by DP hooks (Opacus' activations, flash's A and G)
    "activations",
    "norm_samples",
    "temp_matrices",
    "other",
)
BREAKDOWN_KEYS = tuple(f"{role}_mb" for role in ROLES)
BREAKDOWN_LABELS = {
    "model_parameters_mb": "Model Parameters",
    "optimizer_states_mb": "Optimizer States",
    "gradients_mb": "Gradients",
    "per_sample_gradients_mb": "Per-sample Gradients",
    "activation_hooks_mb": "Activation Hooks (DP-saved A, G)",
    "activations_mb": "Activations",
    "norm_samples_mb": "Norm Samples",
    "temp_matrices_mb": "Temp Matrices (ggT/aaT, Gram tiles)",
    "other_mb": "Other",
}

# ---------------------------------------------------------------- GPU kernel categories
KERNEL_CATEGORIES = (
    "gemm",
    "attention",
    "elementwise",
    "reduction",
    "norm_clip",
    "optimizer",
    "other",
)

# ---------------------------------------------------------------- module groups (HF sweeps)
# By the qualified name of a module or parameter: the first matching row wins.
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
OTHER_GROUP = "other"  # the model's glue (rotary tables, pooling) and the loss
GROUPS = (*(name for name, _ in MODULE_GROUPS), OTHER_GROUP)
# What the module census counts per group. Parameters are static; the others are taken at every
# phase event of the observed step and kept at the phase where their total is largest.
CENSUS_KINDS = (
    "parameters",
    "trainable_parameters",
    "gradients",
    "optimizer_states",
    "per_sample_gradients",  # Opacus hooks: p.grad_sample; flash: the per-sample grads it keeps
    "norm_samples",  # Opacus ghost: p._norm_sample
    "dp_saved_tensors",  # inputs/outputs kept by DP hooks, not saved by autograd
    "activations",  # tensors autograd saved for backward in one physical chunk's forward
)
# The training step's operations and the phase event that ends each.
OPERATIONS = (
    ("forward", "forward_done"),
    ("backward", "backward_done"),
    ("optimizer_step", "step_done"),
)


def module_group(name: str) -> str | None:
    """The group of a qualified module or parameter name; None when no row matches."""
    for group, pattern in MODULE_GROUPS:
        if pattern.search(name):
            return group
    return None


# ---------------------------------------------------------------- the result file
def empty_result(config: dict, config_dir: str, status: str, error: str | None = None) -> dict:
    """A result with every schema key, nothing measured yet (``config``: the config's dict)."""
    return {
        "experiment": config["trainer"],
        "config_dir": config_dir,
        "status": status,
        "error": error,
        "config": config,
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
        "flash_checkpointing": None,
        "clipping": None,
    }


# ---------------------------------------------------------------- where allocations come from
@dataclass(frozen=True)
class AllocationSite:
    """Allocations made while a matching Python function is on the stack have ``role``.

    ``functions``: a regex searched in the function's name. ``package``: a dotted third-party
    package whose files the frame must be in (opacus, torch.optim...); None for the project's
    own functions, matched by name wherever they live (renaming a file changes nothing).
    Trainers declare their sites (``Trainer.memory().sites``) next to the code that allocates.
    """

    role: str
    functions: str = ""
    package: str | None = None

    @classmethod
    def of(cls, role: str, *functions) -> AllocationSite:
        """A site for these function objects (their code names, exactly)."""
        names = sorted({f.__code__.co_name for f in functions})
        return cls(role, "^(" + "|".join(re.escape(n) for n in names) + ")$")

    def matches(self, filename: str, name: str) -> bool:
        if self.package is not None:
            if "/" + self.package.replace(".", "/") + "/" not in filename.replace("\\", "/"):
                return False
        return re.search(self.functions, name) is not None


# Names users already type, mapped on input and never written out.
TRAINER_ALIASES = {
    "vanilla": "standard",
    "hooks": "dpsgd",
    "dpsgd_ghost": "ghost",
    "flash_clip": "flash",
}


def canonical_trainer_name(name: str, known) -> str:
    """The canonical name of a trainer name or alias among ``known`` (ValueError if unknown)."""
    canonical = TRAINER_ALIASES.get(name, name)
    if canonical not in known:
        names = sorted(known) + sorted(TRAINER_ALIASES)
        guess = did_you_mean(name, names)
        raise ValueError(f"unknown trainer {name!r}{guess}; known: {', '.join(names)}")
    return canonical
