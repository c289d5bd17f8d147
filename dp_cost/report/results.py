"""Result files read back, put in order, and matched up: which configs a report compares.

Two comparisons, both keyed by the settings table (``comparison_key``: the settings marked
``compare``): a run compares every trainer with ``standard`` at the same shape
(``shape_key``), and a sweep fits how the peak grows along one swept setting among configs of one
trainer equal in every other compared setting (``series_key``).
"""

from __future__ import annotations

import os
import sys

from dp_cost.core.hf_architectures import HF_CONFIGS
from dp_cost.core.reading import UnreadableFile, folder_names, lexists_at, read_result
from dp_cost.core.schema import trainer_rank
from dp_cost.core.settings import SETTINGS
from dp_cost.parallel.mode import MODES
from dp_cost.report.result_check import result_problem

BASELINE = "standard"  # the trainer every other one is compared with


class LoadedResults(list):
    """The results read from a run directory; ``skipped``: (path, reason) of every file that was
    not read (summary.md counts them)."""

    def __init__(self, results=(), skipped=()):
        super().__init__(results)
        self.skipped = list(skipped)


def load_results(run_dir: str, warn=None) -> LoadedResults:
    """Every ``<config_dir>/result.json`` under a run directory. A file that is not a regular
    UTF-8 JSON file of a result's shape, or is over the cap of results (``MAX_RESULT_BYTES``,
    judged by its size before a byte is read), is skipped with one warning line on ``warn``
    (default: stderr); so is one that is not its folder's config's (copied from another)."""
    results, skipped = [], []
    for name in folder_names(run_dir):
        path = os.path.join(run_dir, name, "result.json")
        if name.startswith(".") or not lexists_at(path, run_dir):
            continue
        try:
            result = read_result(path, root=run_dir)
        except UnreadableFile as error:
            problem = str(error)
        else:
            problem = result_problem(result, name)
        if problem is None:
            results.append(result)
        else:
            skipped.append((path, problem))
            print(f"warning: skipped {path}: {problem}", file=warn or sys.stderr)
    return LoadedResults(results, skipped)


# ---------------------------------------------------------------- a run: same-shape comparisons
def comparison_key(config: dict, leave_out: str | None = None) -> tuple:
    """Everything but the trainer that reports compare on: configs with equal keys (from
    ``result.json``'s config) are the same shape, measured by different trainers. ``leave_out``:
    a setting's name, for configs that differ at most in that setting (a sweep's series)."""
    return tuple(s.value_in(config) for s in SETTINGS if s.compare and s.name != leave_out)


def shape_key(config: dict) -> tuple:
    """Everything but the trainer: configs with the same key are compared with each other."""
    return comparison_key(config)


# Words for plot titles, legends and headings: a config directory's abbreviations (pb2, r16,
# full, bf16, T256) spelled out.
DTYPE_WORDS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
ATTENTION_WORDS = {"explicit": "explicit-softmax attention", "sdpa": "SDPA attention"}
OPTIMIZER_WORDS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}


def lora_words(rank) -> str:
    """``LoRA r16``, or ``full fine-tuning`` without a LoRA rank."""
    return f"LoRA r{rank}" if rank else "full fine-tuning"


def dtype_words(dtype) -> str:
    return DTYPE_WORDS.get(dtype, str(dtype))


def shape_parts(config: dict) -> dict[str, str]:
    """Every compared setting of a config in words, by setting ("" for an optional setting that
    is off): model, logical and physical batch, sequence length, dtype, attention, LoRA rank or
    full fine-tuning, checkpointing, CUDA graph, distribution, FSDP2's sync, clipping rule,
    optimizer."""
    physical = config.get("physical_batch_size") or config["batch_size"]
    rank = config.get("lora_rank") if config.get("use_lora") else None
    optimizer = config.get("optimizer")
    return {
        "model": f"model {config['model']}",
        "batch_size": f"batch {config['batch_size']}",
        "physical_batch_size": f"physical batch {physical}",
        "seq_len": f"sequence length {config['seq_len']}",
        "dtype": dtype_words(config["dtype"]),
        "attention": ATTENTION_WORDS.get(config["attention"], f"{config['attention']} attention"),
        "lora_rank": lora_words(rank),
        "activation_checkpointing": (
            "activation checkpointing" if config.get("activation_checkpointing") else ""
        ),
        "cuda_graph": "CUDA graph" if config.get("cuda_graph") else "",
        "distributed": distributed_words(config),
        "fsdp_sync": (
            "FSDP2 sync once per logical batch" if config.get("fsdp_sync") == "logical" else ""
        ),
        "clipping": "per-layer clipping" if config.get("clipping") == "per_layer" else "",
        "optimizer": OPTIMIZER_WORDS.get(optimizer, str(optimizer)) if optimizer else "",
    }


def distributed_words(config: dict) -> str:
    """The distribution in words ("FSDP on 8 ranks"; "" for one process)."""
    distributed = str(config.get("distributed") or "none")
    mode = MODES.get(distributed)  # None: a name this toolkit does not know (shown as it is)
    if mode is None or mode.is_distributed:
        return f"{distributed.upper()} on {config.get('world_size', 1)} ranks"
    return ""


# An optional setting that is off, where it tells configs apart.
OFF_WORDS = {
    "activation_checkpointing": "no activation checkpointing",
    "cuda_graph": "eager (no CUDA graph)",
    "distributed": "one process",
    "fsdp_sync": "FSDP2 sync per chunk",
    "clipping": "flat clipping",
}


def shape_label(config: dict) -> str:
    """Every compared setting of a config in words (two shapes never share a label)."""
    return ", ".join(part for part in shape_parts(config).values() if part)


def shape_labels(configs: list[dict]) -> tuple[str, list[str]]:
    """What ``configs`` share, in words, and for each config the settings that tell it apart
    ("" for all when they share every one): a plot's title and its tick or legend labels."""
    parts = [shape_parts(c) for c in configs]
    keys = list(dict.fromkeys(k for p in parts for k in p))
    differ = [k for k in keys if len({p.get(k, "") for p in parts}) > 1]
    common = ", ".join(parts[0][k] for k in keys if k not in differ and parts[0].get(k))
    labels = [", ".join(p.get(k) or OFF_WORDS.get(k, "") for k in differ) for p in parts]
    return common, labels


def baselines(results) -> dict[tuple, dict]:
    """The ``standard`` result of each shape among ``results`` (by ``shape_key``)."""
    return {shape_key(r["config"]): r for r in results if r["config"]["trainer"] == BASELINE}


def ordered(results: list[dict]) -> list[dict]:
    """Run order: by model, batch and sequence length, then shape, then trainer."""

    def order(r):
        c = r["config"]
        return (
            c["model"],
            c["batch_size"],
            c["seq_len"],
            str(shape_key(c)),
            trainer_rank(c["trainer"]),
        )

    return sorted(results, key=order)


def trainers_in(results: list[dict]) -> list[str]:
    """The trainers of ``results``, in the canonical order (unknown ones last, by name)."""
    names = {r["config"]["trainer"] for r in results}
    return sorted(names, key=lambda name: (trainer_rank(name), name))


def allocated_snapshots(result: dict) -> list[dict]:
    """The phase snapshots that measured allocated memory (none on CPU)."""
    return [s for s in result.get("snapshots") or [] if s.get("allocated_mb") is not None]


# ---------------------------------------------------------------- a sweep: series of configs
SWEPT = (
    ("seq_len", "sequence length (tokens)"),
    ("batch_size", "logical batch (samples)"),
    ("physical_batch_size", "physical batch (samples)"),
    ("lora_rank", "LoRA rank"),
)
# The fields that name a config in the sweep's CSV, in its column order.
SWEEP_FIELDS = ("trainer", "model", "seq_len", "batch_size", "physical_batch_size", "lora_rank")
# The settings-table row of each swept parameter (result keys name the physical batch itself).
SETTING_OF = {"physical_batch_size": "max_physical_batch_size"}


def swept_value(config: dict, param: str):
    """A config's value of a swept parameter; the LoRA rank is None for full fine-tuning."""
    if param == "lora_rank":
        return config.get("lora_rank") if config.get("use_lora") else None
    if param == "physical_batch_size":
        return config.get("physical_batch_size") or config["batch_size"]
    return config.get(param)


def series_key(config: dict, param: str) -> tuple:
    """Configs with the same key differ at most in ``param``: one series along it."""
    return (config["trainer"], *comparison_key(config, leave_out=SETTING_OF.get(param, param)))


def sweep_order(result: dict) -> tuple:
    c = result["config"]
    return (
        c["trainer"],
        c["model"],
        *(swept_value(c, p) or 0 for p, _ in SWEPT),
        c.get("dtype", ""),
    )


def config_label(config: dict) -> str:
    """A sweep config in one line of words: trainer, sequence length, batches and LoRA rank (or
    full fine-tuning)."""
    return (
        f"{config['trainer']}, sequence length {config['seq_len']}, "
        f"batch {config['batch_size']}, "
        f"physical batch {swept_value(config, 'physical_batch_size')}, "
        + lora_words(swept_value(config, "lora_rank"))
    )


def ok_peak(result: dict) -> float | None:
    """The peak allocated memory of an ok result; None otherwise."""
    return result.get("peak_memory_mb") if result["status"] == "ok" else None


def longest_series(results: list[dict], param: str) -> list[dict]:
    """The ok configs of the longest series along ``param`` with every other setting equal."""
    series: dict[tuple, dict] = {}
    for r in results:
        x = swept_value(r["config"], param)
        if r["status"] == "ok" and x:
            series.setdefault(series_key(r["config"], param), {})[x] = r
    if not series:
        return []
    keys = sorted(series, key=lambda k: [(v is None, v) for v in k])  # None: full FT
    key = max(keys, key=lambda k: len(series[k]))  # ties: the first in that order
    return [series[key][x] for x in sorted(series[key])]


# Why a DP config that ran has no epsilon, where its result does not say: the causal LM's
# workload is one fixed batch, not drawn from a dataset, so there is no sampling rate; a result
# written before the draws and the tails were accounted (no delta_total) is not shown.
NO_SAMPLING = (
    "the causal LM trains on one fixed batch, not Poisson-sampled from a dataset: there is no "
    "sampling rate to account (--mode=hf runs report epsilon)"
)
OLDER_RECORD = (
    "the result predates delta_total and the record of its draws (its epsilon took the measurement "
    "steps' batch by another rule): rerun the config"
)
NO_RECORD = "the result has no privacy record"


def privacy_summary(result: dict) -> dict:
    """epsilon, delta_total and dp_steps (every DP step the model took: warm-up, timed and
    measurement steps) of a DP config, and ``why`` where epsilon is null (None for a
    non-private or failed config: nothing to say)."""
    record = result.get("privacy")
    summary = {"epsilon": None, "delta_total": None, "dp_steps": None, "why": None}
    if record and "delta_total" not in record:
        summary["why"] = OLDER_RECORD
    elif record:
        summary.update(
            epsilon=record.get("epsilon"),
            delta_total=record.get("delta_total"),
            dp_steps=record.get("steps"),
        )
        if record.get("epsilon") is None:  # --no_poisson, or infinite (no noise: not JSON)
            env = result.get("env", {})
            summary["why"] = env.get("privacy_note") or env.get("non_finite_note") or "not computed"
    elif result["status"] == "ok" and result.get("clipping") is not None:  # a DP config
        hf = result["config"].get("model") in HF_CONFIGS
        summary["why"] = NO_RECORD if hf else NO_SAMPLING
    return summary


def privacy_notes(results: list[dict]) -> str:
    """What the privacy columns cover, and one line per DP config whose epsilon is null."""
    rows = [(r, privacy_summary(r)) for r in ordered(results)]
    if not any(summary["epsilon"] is not None or summary["why"] for _, summary in rows):
        return ""
    lines = [
        "\nepsilon: (epsilon, delta_total)-DP over dp_steps, every DP step the model took "
        "(warm-up, timed, and the measurement steps that reuse the last timed draw); "
        "delta_total = delta + the noise sampler's tail term (docs/privacy.md).\n"
    ]
    by_reason: dict[str, list[str]] = {}
    for r, summary in rows:
        if summary["why"]:
            c = r["config"]
            by_reason.setdefault(summary["why"], []).append(
                f"{c['trainer']} bs{c['batch_size']} seq{c['seq_len']}"
            )
    lines += [f"- epsilon null for {', '.join(names)}: {why}\n" for why, names in by_reason.items()]
    lines += tail_over_delta_lines(results)
    return "".join(lines)


def tail_over_delta_lines(results: list[dict]) -> list[str]:
    """One line per noise sampler whose tail term exceeded delta itself in some config: there
    the guarantee is (epsilon, delta_total) with delta_total far above the delta asked for."""
    by_sampler: dict[str, list[str]] = {}
    for r in ordered(results):
        record = r.get("privacy") or {}
        tail, delta = record.get("tail_delta"), record.get("delta")
        if isinstance(tail, (int, float)) and isinstance(delta, (int, float)) and tail > delta:
            c = r["config"]
            by_sampler.setdefault(str(record.get("noise_sampler")), []).append(
                f"{c['trainer']} bs{c['batch_size']} seq{c['seq_len']} ({tail:.2g})"
            )
    return [
        f"- the noise sampler's tail term exceeds delta for {', '.join(names)}: {sampler}'s "
        "largest radius is an atom a shifted output can leave from, so delta_total, not delta, "
        "is the guarantee; --noise_sampler exact64 draws dpsgd's and ghost's noise with flash's "
        "64-bit transform (docs/privacy.md)\n"
        for sampler, names in by_sampler.items()
    ]
