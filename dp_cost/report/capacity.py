"""--mode=capacity's report, from its result files alone: capacity.json (every config's
prediction, the largest physical batch per --gpu_memory budget, the margins the fit uses, the
searches by runs, and with --validate the measured peaks and the prediction's errors),
capacity.md, and visualizations/capacity.png (predicted reserved peak against physical batch per
trainer, a line per budget); report.html shows the table and the plot."""

from __future__ import annotations

import os

from dp_cost.core.files import write_json, write_text
from dp_cost.core.fmt import cell, render_table
from dp_cost.report.figures import MB as MB_UNIT
from dp_cost.report.figures import (
    TRAINER_COLORS,
    pyplot,
    save_visualization,
    whole_number_ticks,
    wrapped,
)
from dp_cost.report.results import (
    OFF_WORDS,
    distributed_words,
    dtype_words,
    lora_words,
    ordered,
    shape_parts,
)

CAPACITY_JSON = "capacity.json"


def is_capacity(results: list[dict]) -> bool:
    """A --mode=capacity run: a prediction, or a config predicted (skipped or failed ones too)."""
    return any(r.get("prediction") or r["config"].get("capacity") for r in results)


def entry(result: dict) -> dict:
    """One config's line of capacity.json."""
    config, prediction = result["config"], result.get("prediction") or {}
    measured = result.get("peak_memory_mb")
    reserved = result.get("peak_reserved_mb")
    return {
        "config_dir": result.get("config_dir"),
        "trainer": config["trainer"],
        "model": config["model"],
        "batch_size": config["batch_size"],
        "seq_len": config["seq_len"],
        "physical_batch_size": prediction.get("physical_batch_size"),
        "dtype": config["dtype"],
        "lora_rank": config.get("lora_rank") if config.get("use_lora") else None,
        "distributed": config.get("distributed", "none"),
        "world_size": config.get("world_size", 1),
        "status": result["status"],
        "error": result.get("error"),
        "predicted_peak_mb": prediction.get("peak_memory_mb"),
        "predicted_breakdown_mb": prediction.get("breakdown"),
        "measured_peak_mb": measured,
        "measured_breakdown_mb": result.get("breakdown"),
        "measured_reserved_over_allocated": reserved / measured if measured and reserved else None,
        "prediction_error": relative_error(prediction.get("peak_memory_mb"), measured),
        "predicted_reserved_mb": prediction.get("peak_reserved_mb"),
        "measured_reserved_mb": reserved,
        "reserved_prediction_error": relative_error(prediction.get("peak_reserved_mb"), reserved),
        "predicted_time": prediction.get("time"),
        "predicted_step_ms": (prediction.get("time") or {}).get("step_ms"),
        "measured_step_ms": result.get("median_time_ms"),
        "step_time_error": step_time_error(result, prediction.get("time") or {}),
        "largest_physical_batch": prediction.get("largest_physical_batch", []),
        "fit_rule": prediction.get("fit_rule"),
        "recommendation": prediction.get("recommendation"),
        "predictions": prediction.get("predictions", []),
        "card": prediction.get("card"),
        "find_max_batch": result.get("find_max_batch"),
        "find_max_seq_len": result.get("find_max_seq_len"),
        "seq_len_predictions": prediction.get("seq_len_predictions", []),
        "physical_batch_note": prediction.get("physical_batch_note"),
        "peak_note": prediction.get("peak_note"),
        "parameters": prediction.get("parameters"),
        "trainable_parameters": prediction.get("trainable_parameters"),
        "seconds": prediction.get("seconds"),
    }


# The searches by runs: (result key, what, in words; the value found; the card's predicted one)
SEARCHES = (
    ("find_max_batch", "largest physical batch", "largest_physical_batch", "physical_batch_size"),
    ("find_max_seq_len", "longest sequence", "longest_seq_len", "seq_len"),
)


def step_time_error(result: dict, predicted: dict) -> float | None:
    """Predicted / measured step time − 1, where the step was measured on the card the time
    was predicted for (a time on another card is no error of the prediction's)."""
    measured_on = (result.get("env") or {}).get("device")
    if measured_on != predicted.get("card"):
        return None
    return relative_error(predicted.get("step_ms"), result.get("median_time_ms"))


def relative_error(predicted, measured) -> float | None:
    return predicted / measured - 1 if measured and predicted is not None else None


def table(entries: list[dict], markdown: bool = False) -> str:
    return render_table(*table_cells(entries), markdown)


def entries_of(results: list[dict]) -> list[dict]:
    """capacity.json's lines of the configs that were predicted, in the report's order."""
    return [entry(r) for r in ordered(results) if isinstance(r.get("prediction"), dict)]


def table_cells(entries: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the capacity table: the text and markdown files' and report.html's."""
    budgets = sorted({b["gpu_memory_gib"] for e in entries for b in e["largest_physical_batch"]})
    validated = any(e["measured_peak_mb"] is not None or e["status"] != "ok" for e in entries)
    header = ["trainer", "model", "ranks", "batch", "seq", "physical", "dtype", "LoRA"]
    header += ["predicted MB per rank", "predicted reserved MB"]
    header += (
        ["measured MB", "error %", "measured reserved MB", "error %", "status"] if validated else []
    )
    cards = sorted({e["predicted_time"]["card"] for e in entries if e.get("predicted_time")})
    header += [f"predicted ms ({', '.join(cards) or 'no card'})", "bound by", "samples/s"]
    header += ["measured ms", "error %"] if validated else []
    fine_tune = next((e["predicted_time"]["fine_tune"] for e in entries
                      if (e.get("predicted_time") or {}).get("fine_tune")), None)  # fmt: skip
    if fine_tune:
        header += [f"{fine_tune['epochs']} epoch(s) of {fine_tune['dataset_size']}: h", "GPU-h"]
    header += [f"largest physical at {b:g} GiB" for b in budgets]
    searches = [search for search in SEARCHES if any(e.get(search[0]) for e in entries)]
    for _, words, _, _ in searches:
        header += [f"this card: predicted {words}", f"{words}: found by runs", "runs"]
    body = []
    for e in entries:
        largest = {  # "1024+": the search's cap fits, larger ones were not judged
            b["gpu_memory_gib"]: f"{b['physical_batch_size']}+"
            if b.get("search_capped")
            else b["physical_batch_size"]
            for b in e["largest_physical_batch"]
        }
        error = e["prediction_error"]
        cells = [e["trainer"], e["model"], distributed_words(e) or OFF_WORDS["distributed"]]
        cells += [str(e["batch_size"]), str(e["seq_len"])]
        cells += [str(e["physical_batch_size"]), dtype_words(e["dtype"])]
        cells += [lora_words(e["lora_rank"]), cell(e["predicted_peak_mb"], digits=0)]
        cells += [cell(e.get("predicted_reserved_mb"), digits=0)]
        if validated:
            reserved_error = e.get("reserved_prediction_error")
            cells += [cell(e["measured_peak_mb"], digits=0)]
            cells += [cell(None if error is None else 100 * error, digits=1)]
            cells += [cell(e.get("measured_reserved_mb"), digits=0)]
            cells += [cell(None if reserved_error is None else 100 * reserved_error, digits=1)]
            cells += [e["status"]]
        time = e.get("predicted_time") or {}
        cells += [cell(time.get("step_ms"), digits=1), cell(time.get("bound_by"))]
        cells += [cell(time.get("samples_per_s"), digits=1)]
        if validated:
            time_error = e.get("step_time_error")
            cells += [cell(e.get("measured_step_ms"), digits=1)]
            cells += [cell(None if time_error is None else 100 * time_error, digits=1)]
        if fine_tune:
            tune = time.get("fine_tune") or {}
            cells += [cell(tune.get("wall_hours"), digits=2), cell(tune.get("gpu_hours"), digits=2)]
        cells += [cell(largest.get(b)) for b in budgets]
        for key, _, value, predicted in searches:
            found = e.get(key) if isinstance(e.get(key), dict) else {}
            card = e["card"] if isinstance(e["card"], dict) and found else {}
            cells += [cell(card.get(predicted))]
            cells += [cell(found.get(value)), cell(len(found.get("probes", [])) or None)]
        body.append(cells)
    return header, body


NOTES = (
    "\nPredicted MB per rank: the step's own tensors as torch counts them (its peak_memory_mb; "
    "with several ranks, rank 0's, the largest share of a batch; batch is the global one, "
    "physical per rank), from the trainer's step run on fake tensors. Predicted reserved MB: "
    "what torch's caching allocator would reserve for them (max_memory_reserved), from its "
    "rules replayed over the step's allocations and frees. A physical batch fits a budget when "
    "that replay, on a card of the budget less the CUDA context (and NCCL's buffers with "
    "several ranks; margins in capacity.json), places every allocation; a Hugging Face model's "
    "Poisson-sampled batches only where the reserved peak on a card without limit is within "
    "that room, as a draw's chunks of other sizes fragment the cache (fixed-size batches, the "
    "causal LM's and --no_poisson's, and the searches by runs, whose probes are fixed-size, by "
    "the replay; each config's fit_rule in capacity.json). 0: not even one "
    "sample fits; 1024+: the search's cap fits (larger ones were not judged). Predicted ms: "
    "one logical batch's eager step (or graphed, with --cuda_graph) on the card named, from the "
    "fake step's ops and the card's measured rates (with several ranks rank 0's, its "
    "collectives from the rates measured for that many ranks; - where not predicted, the "
    "reason in capacity.json). Bound by host: the host issues the ops more slowly than the GPU "
    "runs them, and the time moves with the host's speed: -24% to +38% against measured steps "
    "of four machines of one card kind; bound by gpu: -18% to +6% where measured; bound by "
    "communication: the collectives take longer than the kernels.\n"
)


def write_capacity_files(run_dir: str, results: list[dict]) -> str:
    """capacity.json and capacity.md; returns the text table."""
    entries = entries_of(results)
    skipped = [
        {"config_dir": r.get("config_dir"), "status": r["status"], "error": r.get("error")}
        for r in results
        if not isinstance(r.get("prediction"), dict)
    ]
    margins = next((r["prediction"].get("overheads") for r in results if r.get("prediction")), None)
    write_json(
        os.path.join(run_dir, CAPACITY_JSON),
        {"configs": entries, "not_predicted": skipped, "margins": margins},
    )
    planned = "".join(
        f"- {e['config_dir']}: {e['physical_batch_note']}\n"
        for e in entries
        if e["physical_batch_note"]
    )
    planned = f"\nPlanned physical batches:\n{planned}" if planned else ""
    planned += recommendation_lines(entries, refused_entries(results))
    bounds = "".join(f"- {e['config_dir']}: {e['peak_note']}\n" for e in entries if e["peak_note"])
    planned += f"\nPeaks that are bounds:\n{bounds}" if bounds else ""
    # An error's own line breaks (torch's messages have some) would split the list's items.
    lines = "".join(
        f"- {s['config_dir']}: {s['status']}: {' '.join(str(s['error']).split())}\n"
        for s in skipped
    )
    lines = f"\nNot predicted:\n{lines}" if lines else ""
    write_text(os.path.join(run_dir, "capacity.md"), table(entries, True) + NOTES + planned + lines)
    return table(entries) + NOTES + planned + lines


def plot_capacity(run_dir: str, results: list[dict]) -> str | None:
    """visualizations/capacity.png: predicted peak against physical batch, one panel per shape
    (everything but the trainer and the physical batch), a line per trainer, a dashed line per
    --gpu_memory budget at what the caching allocator may reserve on that card (the card less
    the CUDA context): the predicted reserved peak must stay under it, or the allocator must
    make room by returning its free segments (the fit replays that)."""
    panels: dict[str, list] = {}
    for result in ordered(results):
        prediction = result.get("prediction")
        if not isinstance(prediction, dict) or len(prediction.get("predictions", [])) < 2:
            continue
        panels.setdefault(shape_label_without_batch(result["config"]), []).append(result)
    if not panels:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(9, 3.4 * len(panels)), squeeze=False, constrained_layout=True
    )
    for ax, (title, group) in zip(axes[:, 0], panels.items()):
        for result in group:
            points = result["prediction"]["predictions"]
            trainer = result["config"]["trainer"]
            x = [p["physical_batch_size"] for p in points]
            y = [p.get("peak_reserved_mb", p["peak_memory_mb"]) for p in points]
            ax.plot(x, y, "o-", lw=1.2, ms=3, label=trainer, color=TRAINER_COLORS.get(trainer))
        for budget in group[0]["prediction"].get("largest_physical_batch", []):
            usable = budget.get("allocator_room_mb")
            if not usable or usable <= 0:  # the budget is smaller than the CUDA context
                continue
            ax.axhline(usable, ls="--", lw=0.8, color="gray")
            ax.annotate(f"{budget['gpu_memory_gib']:g} GiB card", (0, usable), fontsize=7,
                        xycoords=("axes fraction", "data"), va="bottom")  # fmt: skip
        ax.set_title(wrapped(title, 120), fontsize=9)
        ax.set_xlabel("physical batch")
        whole_number_ticks(ax.xaxis)
        ax.set_ylabel(f"predicted peak reserved ({MB_UNIT})")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")  # the budget lines are labelled at the upper left
    return save_visualization(fig, run_dir, "capacity.png")


def shape_label_without_batch(config: dict) -> str:
    """``results.shape_label`` without the logical and physical batch (a panel's x axis)."""
    parts = shape_parts(config)
    return ", ".join(part for name, part in parts.items() if part and name not in BATCH_SETTINGS)


BATCH_SETTINGS = ("batch_size", "physical_batch_size")


def recommendation_groups(entries: list[dict]) -> dict[tuple, dict[tuple[str, str], dict]]:
    """capacity.json's lines with a recommendation by shape (everything the recommendation does
    not choose: model, batch, seq, dtype, LoRA rank, ranks), one line a contender (trainer,
    sharding): the trainer, the sharding and the physical batch are what it chooses among
    (every physical cap gives the same candidates)."""
    groups: dict[tuple, dict[tuple[str, str], dict]] = {}
    for e in entries:
        if e.get("recommendation"):
            group = groups.setdefault(recommendation_shape(e), {})
            group.setdefault(contender_key(e), e)
    return groups


def recommendation_shape(e: dict) -> tuple:
    """What a recommendation is made for: a capacity.json line's model, batch, seq, dtype, LoRA
    rank and ranks."""
    return (e["model"], e["batch_size"], e["seq_len"], e["dtype"], e["lora_rank"], e["world_size"])


def contender_key(e: dict) -> tuple[str, str]:
    """(trainer, sharding): what a recommendation chooses among, beside the physical batch; of
    a capacity.json line or a measured config (one process where it names no sharding)."""
    return e["trainer"], e.get("distributed", "none")


def ranked_dp_contenders(group: dict[tuple[str, str], dict]) -> list[dict]:
    """A shape's DP trainers under each sharding planned that have a best candidate, the most
    samples a second first: the first is --recommend's choice."""
    return sorted(
        (e for (t, _), e in group.items() if t != "standard" and e["recommendation"]["best"]),
        key=lambda e: -e["recommendation"]["best"]["samples_per_s"],
    )


def refused_entries(results: list[dict]) -> list[dict]:
    """capacity.json-like lines of the configs not predicted (skipped or failed), one a trainer
    and sharding of a shape, for the recommendation's paragraph; a result too broken to say
    which config it was is left to the "Not predicted" list."""
    lines: dict[tuple, dict] = {}
    for result in results:
        if isinstance(result.get("prediction"), dict):
            continue
        try:
            line = entry(result)
            key = (recommendation_shape(line), contender_key(line))
        except (KeyError, TypeError, AttributeError):
            continue
        lines.setdefault(key, line)
    return list(lines.values())


def recommendation_lines(entries: list[dict], refused: list[dict] = ()) -> str:
    """--recommend's ranking, one paragraph per shape: the DP trainers (under each sharding
    planned) by their best predicted samples a second on the card, the fastest named first,
    those with none after them with why, those the run could not plan (``refused``: lines of
    configs with no prediction) with theirs, the standard trainer's (no DP) best for
    reference."""
    paragraphs = []
    for shape, group in recommendation_groups(entries).items():
        model, batch, seq_len, dtype, *_, ranks = shape
        first = next(iter(group.values()))["recommendation"]
        head = f"{model}, batch {batch}, seq {seq_len}, {dtype_words(dtype)}"
        budget = f"{first['gpu_memory_gib']:g} GiB"
        head += f", {ranks} × {budget}" if ranks > 1 else f", {budget}"
        private = [e for (trainer, _), e in group.items() if trainer != "standard"]
        ranked = ranked_dp_contenders(group)
        line = f"- {head}: " + (f"run {_choice(ranked[0])}" if ranked else "no DP trainer to run")
        line += "".join(f"; then {_choice(e)}" for e in ranked[1:])
        unranked = [e for e in private if e not in ranked]
        line += "".join(f"; {contender_words(e)}: {e['recommendation']['why']}" for e in unranked)
        line += "".join(
            f"; {contender_words(e)}: {e['status']}: {' '.join(str(e['error']).split())}"
            for e in refused
            if recommendation_shape(e) == shape
            and e["trainer"] != "standard"
            and contender_key(e) not in group  # planned at another cap
        )
        standard = ranked_standard(group)
        if standard:
            line += f"; for reference, no DP: {_choice(standard)}"
        if first.get("peak_note"):
            line += " (graphed: what fits is judged on lower bounds of the peaks)"
        paragraphs.append(line + "\n")
    if not paragraphs:
        return ""
    return "\nRecommended (predicted samples a second on the card):\n" + "".join(paragraphs)


def ranked_standard(group: dict[tuple[str, str], dict]) -> dict | None:
    """The standard trainer's fastest line (under the sharding it runs fastest), if any fits."""
    fitting = [e for (t, _), e in group.items() if t == "standard" and e["recommendation"]["best"]]
    return max(fitting, key=lambda e: e["recommendation"]["best"]["samples_per_s"], default=None)


def contender_words(entry: dict) -> str:
    """A trainer, and its sharding where it runs over ranks ("flash under DDP")."""
    sharded = distributed_words(entry)
    return f"{entry['trainer']} under {sharded.split()[0]}" if sharded else entry["trainer"]


def _choice(entry: dict) -> str:
    best = entry["recommendation"]["best"]
    return (
        f"{contender_words(entry)} at physical batch {best['physical_batch_size']}, "
        f"{best['samples_per_s']:.1f} samples/s ({best['step_ms']:.1f} ms a step)"
    )
