"""Result files read back, put in order, and matched up: which configs a report compares.

Two comparisons, both keyed by the settings table (``core.settings.comparison_key``: the
settings marked ``compare``): a run compares every trainer with ``standard`` at the same shape
(``shape_key``), and a sweep fits how the peak grows along one swept setting among configs of one
trainer equal in every other compared setting (``series_key``).
"""

from __future__ import annotations

import glob
import os
import sys

from core.reading import UnreadableFile, read_json
from core.schema import trainer_rank
from core.settings import comparison_key
from report.result_check import result_problem

BASELINE = "standard"  # the trainer every other one is compared with


class LoadedResults(list):
    """The results read from a run directory; ``skipped``: (path, reason) of every file that was
    not read (summary.md counts them)."""

    def __init__(self, results=(), skipped=()):
        super().__init__(results)
        self.skipped = list(skipped)


def load_results(run_dir: str, warn=None) -> LoadedResults:
    """Every ``<config_dir>/result.json`` under a run directory. A file that is not a regular
    UTF-8 JSON file of a result's shape is skipped with one warning line on ``warn`` (default:
    stderr)."""
    results, skipped = [], []
    for path in sorted(glob.glob(os.path.join(run_dir, "*", "result.json"))):
        try:
            result = read_json(path)
        except UnreadableFile as error:
            problem = str(error)
        else:
            problem = result_problem(result)
        if problem is None:
            results.append(result)
        else:
            skipped.append((path, problem))
            print(f"warning: skipped {path}: {problem}", file=warn or sys.stderr)
    return LoadedResults(results, skipped)


# ---------------------------------------------------------------- a run: same-shape comparisons
def shape_key(config: dict) -> tuple:
    """Everything but the trainer: configs with the same key are compared with each other."""
    return comparison_key(config)


def shape_label(config: dict) -> str:
    """Every compared setting of a config in a few words (two shapes never share a label):
    model, logical and physical batch, sequence length, dtype, attention, LoRA rank,
    checkpointing, CUDA graph, optimizer."""
    physical = config.get("physical_batch_size") or config["batch_size"]
    rank = f"r{config.get('lora_rank')}" if config.get("use_lora") else "full"
    return " ".join(
        [
            config["model"],
            f"bs{config['batch_size']} pb{physical} T{config['seq_len']}",
            config["dtype"],
            config["attention"],
            rank,
            *(["ckpt"] if config.get("activation_checkpointing") else []),
            *(["graph"] if config.get("cuda_graph") else []),
            str(config.get("optimizer", "")),
        ]
    ).strip()


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
    """A sweep config in one line: trainer, sequence length, batches and LoRA rank."""
    rank = swept_value(config, "lora_rank")
    return (
        f"{config['trainer']} T{config['seq_len']} bs{config['batch_size']} "
        f"pb{swept_value(config, 'physical_batch_size')} " + (f"r{rank}" if rank else "full")
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
