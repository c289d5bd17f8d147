"""Is --recommend's choice the fastest step on the card? A ``--mode=capacity --recommend`` plan
(its capacity.json) beside the same shapes measured: each candidate (trainer, sharding,
physical batch) of each shape with the plan's fit and predicted time next to the step a
measuring run took (its ``median_time_ms``), then per shape the plan's choice (the DP trainer,
sharding and physical batch with the most predicted samples a second, as the report names it)
against the measured fastest of the DP candidates the plan says fit. A candidate is a trainer
under a sharding (one process, or DDP and FSDP2 where the plan is of several ranks) at a
physical batch; the measured runs have the plan's settings (a run with another attention,
optimizer, sampling, ... is named and left out).

usage: python benchmarks/recommend_check.py PLAN_RUN MEASURED_RUN [MEASURED_RUN ...] [--out F]
  PLAN_RUN: a --recommend run's folder (its capacity.json and its configs' result.json)
  MEASURED_RUN: runs of the same shapes on the card, one config a candidate (--mode=profile,
    --mode=hf or --mode=capacity --validate, under torchrun with --distributed for several
    ranks, --max_physical_batch_sizes the candidates' physical batches), or folders of such
    runs; predictions alone among them are skipped
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dp_cost.core.reading import read_json, read_result  # noqa: E402
from dp_cost.report.capacity import (  # noqa: E402
    contender_key,
    contender_words,
    ranked_dp_contenders,
    recommendation_groups,
    recommendation_shape,
)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", help="the --recommend run's folder")
    parser.add_argument("measured", nargs="+", help="--validate run folders (or folders of them)")
    parser.add_argument("--out", help="write every shape's rows and verdict as JSON here too")
    return parser.parse_args(argv)


# Settings that change a step's time beside its shape: a measured config must have the plan's.
STEP_SETTINGS = ("attention", "activation_checkpointing", "cuda_graph", "optimizer", "poisson",
                 "clipping", "flash_route", "noise_sampler", "model_overrides",
                 "fsdp_sync")  # fmt: skip


def shape_key(config: dict) -> tuple:
    """What a recommendation is made for, as ``recommendation_groups`` keys it: a measured
    config as capacity.json's line of it reads."""
    lora_rank = config.get("lora_rank") if config.get("use_lora") else None
    return recommendation_shape(
        {**config, "lora_rank": lora_rank, "world_size": config.get("world_size", 1)}
    )


def measured_steps(folders: list[str]) -> dict[tuple, dict]:
    """(shape, (trainer, sharding), physical batch) -> the measured config's status, median step ms,
    reserved peak MB and config. A file that cannot be read, or a second result for the same
    candidate, gets a one-line warning (of two, the one that ran is kept, else the later)."""
    paths = set()
    for folder in folders:
        for depth in ("*", "*/*"):
            paths.update(glob.glob(os.path.join(folder, depth, "result.json")))
    steps = {}
    for path in sorted(paths):
        try:
            result = read_result(path)
            config = result["config"]
            if config.get("capacity") and not config.get("validate"):
                continue  # a prediction, not a step measured (the plan's own configs)
            share = config["batch_size"] // config.get("world_size", 1)  # a rank's (they divide)
            physical = min(config.get("max_physical_batch_size") or share, share)
            key = (shape_key(config), contender_key(config), physical)
            step = {
                "status": result["status"], "measured_ms": result.get("median_time_ms"),
                "measured_reserved_mb": result.get("peak_reserved_mb"), "result": path,
                "config": config,
            }  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            print(f"warning: {path}: not a measured config ({error})", file=sys.stderr)
            continue
        held = steps.get(key)
        if held is not None:
            print(f"warning: {path}: the same candidate as {held['result']}", file=sys.stderr)
            if held["status"] == "ok" and step["status"] != "ok":
                continue
        steps[key] = step
    return steps


def plan_config(plan_dir: str, entry: dict) -> dict | None:
    """The plan's config of a capacity.json line, from its result.json (None: unreadable)."""
    try:
        return read_result(os.path.join(plan_dir, entry["config_dir"], "result.json"))["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def shape_rows(group: dict[tuple, dict], shape: tuple, measured: dict, plan_dir: str):
    """Every candidate of every contender (trainer, sharding) of one shape, planned and
    measured (a measured step whose settings are not the plan's is named and left out)."""
    rows = []
    for (trainer, sharding), entry in group.items():
        planned = plan_config(plan_dir, entry) or {}
        for candidate in entry["recommendation"]["candidates"]:
            physical = candidate["physical_batch_size"]
            step = measured.get((shape, (trainer, sharding), physical), {})
            differ = [k for k in STEP_SETTINGS if step and k in planned
                      and step["config"].get(k) != planned[k]]  # fmt: skip
            if differ:
                print(f"warning: {step['result']}: not the plan's step ({', '.join(differ)} "
                      "differ); left out", file=sys.stderr)  # fmt: skip
                step = {}
            rows.append({
                "trainer": trainer, "contender": contender_words(entry),
                "physical_batch_size": physical,
                "fits": candidate.get("fits"), "error": candidate.get("error"),
                "predicted_reserved_mb": candidate.get("peak_reserved_mb"),
                "predicted_ms": candidate.get("step_ms"),
                "status": step.get("status"), "measured_ms": step.get("measured_ms"),
                "measured_reserved_mb": step.get("measured_reserved_mb"),
            })  # fmt: skip
    return rows


def verdict(group: dict[tuple, dict], rows: list[dict]) -> dict:
    """The plan's choice against the measured fastest DP candidate that the plan says fits:
    ``agrees`` (the choice ran, none faster), ``differs``, or ``choice not measured`` (not run,
    or it failed on the card). Candidates it says fit that were not measured, or did not run,
    are named, and so are those it says do not fit that ran faster than every fitting one."""
    ranked = ranked_dp_contenders(group)
    choice = None  # (trainer and its sharding in words, physical batch)
    if ranked:
        best = ranked[0]["recommendation"]["best"]
        choice = (contender_words(ranked[0]), best["physical_batch_size"])
    private = [r for r in rows if r["trainer"] != "standard"]
    fitting = [r for r in private if r["fits"]]
    ran = [r for r in fitting if r["status"] == "ok" and r["measured_ms"]]
    fastest = min(ran, key=lambda r: r["measured_ms"], default=None)
    chosen = next((r for r in ran if (r["contender"], r["physical_batch_size"]) == choice), None)
    if choice is None or fastest is None:
        said = "nothing to compare"
    elif chosen is None:
        said = "choice not measured"
    else:
        said = "agrees" if chosen["measured_ms"] <= fastest["measured_ms"] else "differs"
    best_ms = fastest["measured_ms"] if fastest else float("inf")
    return {
        "choice": choice,
        "fastest": fastest and (fastest["contender"], fastest["physical_batch_size"]),
        "fastest_ms": fastest and fastest["measured_ms"],
        "choice_measured_ms": chosen and chosen["measured_ms"],
        "verdict": said,
        "agrees": said == "agrees",
        "not_measured": [
            (r["contender"], r["physical_batch_size"]) for r in fitting if r not in ran
        ],
        "faster_though_not_fitting": [
            (r["contender"], r["physical_batch_size"])
            for r in private
            if not r["fits"] and r["status"] == "ok" and (r["measured_ms"] or best_ms) < best_ms
        ],  # fmt: skip
        "predicted_order": [contender_words(e) for e in ranked],
        "measured_order": measured_order(ran),
    }


def measured_order(ran: list[dict]) -> list[str]:
    """The DP contenders (trainer, sharding) by their fastest measured candidate, fastest
    first."""
    best: dict[str, float] = {}
    for r in ran:
        best[r["contender"]] = min(best.get(r["contender"], float("inf")), r["measured_ms"])
    return sorted(best, key=best.get)


def number(value, digits=1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_shape(shape: tuple, rows: list[dict], found: dict) -> None:
    model, batch, seq_len, dtype, lora_rank, ranks = shape
    lora = f", LoRA r{lora_rank}" if lora_rank else ""
    print(f"\n{model}{lora}, batch {batch}, seq {seq_len}, {dtype}, {ranks} rank(s)")
    print("| trainer (sharding) | physical | plan fits | predicted reserved MB "
          "| measured reserved MB | predicted ms | measured ms | time error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        predicted, took = r["predicted_ms"], r["measured_ms"]
        error = "-" if not (predicted and took) else f"{predicted / took - 1:+.1%}"
        measured = number(took) if r["status"] in ("ok", None) else r["status"]
        print(f"| {r['contender']} | {r['physical_batch_size']} | {r['error'] or r['fits']} "
              f"| {number(r['predicted_reserved_mb'], 0)} | {number(r['measured_reserved_mb'], 0)} "
              f"| {number(predicted)} | {measured} | {error} |")  # fmt: skip
    choice, fastest = found["choice"], found["fastest"]
    line = "recommended: " + (
        "none" if not choice else f"{choice[0]} at physical batch {choice[1]}"
    )
    if fastest:
        line += (f"; measured fastest that the plan says fits: {fastest[0]} at physical batch "
                 f"{fastest[1]} ({found['fastest_ms']:,.1f} ms)")  # fmt: skip
    if found["verdict"] == "differs":
        slower = found["choice_measured_ms"] / found["fastest_ms"] - 1
        line += f": differs (the choice {slower:+.1%})"
    else:
        line += f": {found['verdict']}"
    print(line)
    print(f"contenders by their best: predicted {', '.join(found['predicted_order'])}; measured "
          f"{', '.join(found['measured_order'])}")  # fmt: skip
    named = {
        "not_measured": "planned to fit but not measured (or did not run)",
        "faster_though_not_fitting": "planned not to fit, yet ran faster",
    }
    for key, words in named.items():
        if found[key]:
            print(f"{words}: {', '.join(f'{t} at {p}' for t, p in found[key])}")


def main(argv=None) -> int:
    args = parse(argv)
    path = os.path.join(args.plan, "capacity.json")
    try:
        entries = read_json(path)["configs"]
        groups = recommendation_groups(entries)
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"error: {path}: not a --mode=capacity run's capacity ({error})", file=sys.stderr)
        return 2
    if not groups:
        print(f"error: {path}: no config has a recommendation (--recommend)", file=sys.stderr)
        return 2
    measured = measured_steps(args.measured)
    shapes = []
    for shape, group in groups.items():
        rows = shape_rows(group, shape, measured, args.plan)
        found = verdict(group, rows)
        print_shape(shape, rows, found)
        shapes.append({"shape": list(shape), "rows": rows, **found})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(shapes, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
