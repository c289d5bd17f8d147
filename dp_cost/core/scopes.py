"""Where a setting takes effect: the scope a row of the settings table names (``Setting.scope``).

A setting given where it takes no effect (``--lora_rank`` without ``--use_lora``,
``--gpu_memory`` outside --mode=capacity, ``--no_trace`` in a mode that never traces) would run
as if ignored and be recorded as if used: the plan refuses it, in one check for every setting
with a scope (``measure.plan_checks.check_scopes``), before torch is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dp_cost.core.hf_architectures import HF_CONFIGS
from dp_cost.core.modes import MODES, Mode
from dp_cost.core.schema import TRAINER_ORDER


@dataclass(frozen=True)
class PlannedRun:
    """What a scope is asked about: the mode asked for, the plan's values (one per setting) and
    its axes (the settings that take several values: trainers, batch sizes, ...)."""

    mode: Mode
    values: dict
    axes: dict

    @property
    def hf_model(self) -> bool:
        return self.values["model"] in HF_CONFIGS


@dataclass(frozen=True)
class Scope:
    """Where a setting takes effect: ``holds(run)``. ``where`` ends "<flag> applies only to ...",
    and ``instead(run)`` says what the run is."""

    where: str
    holds: Callable[[PlannedRun], bool]
    instead: Callable[[PlannedRun], str]


def _model(run: PlannedRun) -> str:
    return f"model is {run.values['model']!r}"


def _mode(run: PlannedRun) -> str:
    return f"mode is {run.mode.name}"


def _trainers(run: PlannedRun) -> str:
    return f"trainers: {', '.join(run.axes['trainer'])}"


HF_MODEL = Scope("Hugging Face models (--model tiny-llama or a Llama name)",
                 lambda run: run.hf_model, _model)  # fmt: skip
NAMED_LM = Scope(
    "the named LM configs (tiny, 1b); a Hugging Face model keeps its shipped config",
    lambda run: not run.hf_model,
    _model,
)
LORA = Scope(
    "LoRA runs of a Hugging Face model (--use_lora)",
    lambda run: run.hf_model and run.values["use_lora"],
    lambda run: "without --use_lora every weight is trained" if run.hf_model else _model(run),
)

SYNTHETIC_DATA = Scope(
    "Hugging Face models' synthetic dataset (a --dataset_path file's labelled pairs are N) "
    "and --mode=capacity's fine-tune (--epochs)",
    lambda run: (
        (run.hf_model and not run.values["dataset_path"])
        or (run.mode.predicts and run.values["epochs"] is not None)
    ),
    lambda run: "--dataset_path is given" if run.hf_model else _model(run),
)
POISSON_EPSILON = Scope(
    "Hugging Face models with Poisson sampling (the delta of their epsilon)",
    lambda run: run.hf_model and run.values["poisson"],
    lambda run: "--no_poisson reports no epsilon" if run.hf_model else _model(run),
)
CAPACITY = Scope("--mode=capacity", lambda run: run.mode.predicts, _mode)
TRACING_MODE = Scope(
    "the modes that trace (" + ", ".join(m.name for m in MODES.values() if m.traces) + ")",
    lambda run: run.mode.traces,
    _mode,
)
MEASURED_STEPS = Scope(
    "runs that measure steps (in --mode=capacity: with --validate)",
    lambda run: not run.mode.predicts or run.values["validate"],
    lambda run: "this run predicts, without a step",
)
BREAKDOWN_HISTORY = Scope(
    "runs that measure a breakdown (--mode=memory or --mode=hf_sweep; --mode=capacity with "
    "--validate)",
    lambda run: run.values["breakdown"] and (not run.mode.predicts or run.values["validate"]),
    lambda run: _mode(run) + (" without --validate" if run.mode.predicts else ""),
)
TRACED = Scope(
    "traced runs",
    lambda run: run.values["trace"],
    lambda run: "this run traces nothing (--no_trace, --ncu, or a mode that never traces)",
)
FLASH = Scope("runs of the flash trainer", lambda run: "flash" in run.axes["trainer"], _trainers)
OPACUS = Scope(
    "runs of Opacus' trainers (dpsgd, ghost; flash always draws the 64-bit transform)",
    lambda run: any(name in ("dpsgd", "ghost") for name in run.axes["trainer"]),
    _trainers,
)
PRIVATE = Scope(
    f"runs of a DP trainer ({', '.join(TRAINER_ORDER[1:])}; standard neither clips nor adds noise)",
    lambda run: any(name != TRAINER_ORDER[0] for name in run.axes["trainer"]),
    _trainers,
)
# The scopes within the Hugging Face models: their settings are one --help group.
HF_ONLY = (HF_MODEL, LORA, SYNTHETIC_DATA, POISSON_EPSILON)
