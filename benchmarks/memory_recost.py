"""The memory plan against peaks already measured: every config that ran on a GPU in the given
runs (measuring runs, or ``--mode=capacity --validate`` ones) planned again on this CPU with
the toolkit as it is now, its predicted allocated and reserved peaks beside the ones the run
measured. A change to the planner is checked this way against every measured peak kept, without
a GPU; a planner's goal is checked on a grid of configs measured once.

What it prints: a line per config (predicted / measured − 1, allocated and reserved), then per
class (all; fixed-size batches; Poisson draws, whose chunks vary in size from draw to draw where
the plan's are one size) how many are within ±5% and how many are under by more than 2%. With
``--card_gib GIB`` also whether the plan's fit on a card of GIB GiB agrees with what the run did:
every config that ran must fit, every one that ran out of memory must not.

usage: python benchmarks/memory_recost.py RUN_DIR [RUN_DIR ...] [--card_gib GIB] [--jobs N]
           [--out F]
  RUN_DIR: a run's folder (its configs' result.json one level down), or a folder of runs
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import glob
import json
import math
import multiprocessing
import os
import signal
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WITHIN = 0.05  # the memory goal: within ±5%, allocated and reserved
UNDER = -0.02  # and none under by more than 2%


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (or folders of them)")
    parser.add_argument(
        "--card_gib", type=float, help="judge each plan's fit on this card (runs of one card kind)"
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="plans at once")
    parser.add_argument("--out", help="write every row as JSON here too")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.card_gib is not None and not args.card_gib > 0:
        parser.error("--card_gib must be a positive number of GiB")
    return args


def measured_configs(folders: list[str]) -> list[dict]:
    """Each config that ran on a GPU (ok: its peaks measured; or out of memory), once: the
    same config with the same peaks in two copies of a run is one row."""
    from dp_cost.core.reading import read_result

    paths = set()
    for folder in folders:
        paths.update(glob.glob(os.path.join(folder, "*", "result.json")))
        paths.update(glob.glob(os.path.join(folder, "*", "*", "result.json")))
    rows, seen = [], set()
    for path in sorted(paths):
        try:
            result = read_result(path)
            row = measured_row(path, result)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            print(f"warning: {path}: not a measured peak ({error})", file=sys.stderr)
            continue
        if row is None:
            continue
        measured = row["measured_mb"] and tuple(round(v, 3) for v in row["measured_mb"])
        key = (json.dumps(row["config"], sort_keys=True), row["status"], row["card"], measured)
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


def measured_row(path: str, result: dict) -> dict | None:
    """The row of one result file, or None where it measured no peak on a GPU (a CPU run, a
    skipped or failed config, the host's memory run out: nothing to compare). An out-of-memory
    result keeps no env: its card is the config's device and CUDA's own error."""
    status, config = result.get("status"), dict(result["config"])
    if status == "oom":
        if config.get("device") != "cuda" or "CUDA out of memory" not in str(result.get("error")):
            return None
        measured, card = None, None
    elif status == "ok" and "NVIDIA" in str((result.get("env") or {}).get("device", "")):
        measured = (result.get("peak_memory_mb"), result.get("peak_reserved_mb"))
        if not all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in measured):
            raise ValueError(f"its peaks are not measured MB: {measured}")
        card = result["env"]["device"]
    else:
        return None
    config.update(capacity=False, validate=False, gpu_memory=None, find_max_batch=False,
                  find_max_seq_len=False, recommend=False)  # fmt: skip
    return {"result": path, "config": config, "status": status, "card": card,
            "measured_mb": measured}  # fmt: skip


def planned(fields: dict) -> dict:
    """The config planned on this CPU as --mode=capacity plans it: allocated and reserved MB at
    its planned physical batch, and the prediction itself and its config (for a fit)."""
    from dp_cost.capacity.card import reserved_peak
    from dp_cost.capacity.predictions import Predictions
    from dp_cost.core.schema import MB
    from dp_cost.measure import worker
    from dp_cost.measure.config import ExperimentConfig

    config = ExperimentConfig.from_dict(fields)
    config = dataclasses.replace(config, device="cpu", capacity=True)
    predictions = Predictions(config, worker.build_trainer)
    step = predictions.at(predictions.planned)
    return {"allocated": step["peak"] / MB, "reserved": reserved_peak(step) / MB,
            "physical_batch_size": predictions.planned, "step": step, "config": config}  # fmt: skip


def plan_row(job: tuple[dict, float | None]) -> dict:
    """One row planned, in a worker process (a plan patches torch's globals and undoes them on its
    way out: one plan at a time in a process)."""
    row, card_gib = job
    warnings.filterwarnings("ignore")
    try:
        plan = planned(row["config"])
        predicted = {k: round(plan[k], 3) for k in ("allocated", "reserved")}
        out = {**row, "error": None, "predicted_mb": predicted,
               "planned_physical_batch_size": plan["physical_batch_size"]}  # fmt: skip
        if row["measured_mb"]:
            measured = dict(zip(("allocated", "reserved"), row["measured_mb"], strict=True))
            out["errors"] = {k: plan[k] / measured[k] - 1 for k in measured}
        if card_gib is not None and not graphed(row["config"]):
            from dp_cost.capacity.card import fits, releases_cache

            ranks, release = plan["config"].world_size, releases_cache(plan["config"])
            out["plan_fits"] = fits(plan["step"], card_gib, ranks, release)
        return out
    except Exception as error:  # a kept config this code cannot plan: say so, go on
        return {**row, "error": f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"}


def graphed(config: dict) -> bool:
    """A CUDA graph's step, whose plan is a lower bound (its pool is not planned)."""
    return bool(config.get("cuda_graph"))


def sampled(config: dict) -> bool:
    """Are the config's batches Poisson draws (a Hugging Face model's, unless --no_poisson; the
    causal LM trains on one fixed batch whatever its config says): the configs whose fit keeps
    the cache (``card.releases_cache``, which reads these two fields)?"""
    import types

    from dp_cost.capacity.card import releases_cache

    fields = types.SimpleNamespace(model=config.get("model"), poisson=config.get("poisson", True))
    return not releases_cache(fields)


def where(row: dict) -> str:
    """The row's run and config folders (a config folder's name says its shape)."""
    folder = os.path.dirname(row["result"])
    return os.path.join(os.path.basename(os.path.dirname(folder)), os.path.basename(folder))


def summary(rows: list[dict]) -> list[str]:
    """Per class: within ±5% and under by more than 2%, allocated and reserved."""
    lines = []
    classes = (("all, graphed steps apart", lambda c: not graphed(c)),
               ("fixed-size batches", lambda c: not (sampled(c) or graphed(c))),
               ("Poisson draws", lambda c: sampled(c) and not graphed(c)),
               ("graphed steps (the plan a lower bound)", graphed))  # fmt: skip
    for name, member in classes:
        found = [r for r in rows if r.get("errors") and member(r["config"])]
        if not found:
            continue
        parts = []
        for kind in ("allocated", "reserved"):
            errors = [r["errors"][kind] for r in found]
            within = sum(abs(e) <= WITHIN for e in errors)
            under = sum(e < UNDER for e in errors)
            parts.append(f"{kind} {within}/{len(errors)} within ±5%, {under} under by more "
                         f"than 2% (lowest {min(errors):+.2%})")  # fmt: skip
        lines.append(f"{name}: " + "; ".join(parts))
    judged = [r for r in rows if "plan_fits" in r]
    if judged:
        wrong = [r for r in judged if r["plan_fits"] != (r["status"] == "ok")]
        unsafe = sum(r["plan_fits"] for r in wrong)  # planned to fit, ran out of memory
        lines.append(f"fit on the card: {len(judged) - len(wrong)}/{len(judged)} agree with the run"
                     f" ({unsafe} planned to fit that ran out of memory, {len(wrong) - unsafe}"
                     f" planned not to that ran)"
                     + "".join(f"; {where(r)}: plan says "
                               f"{'fits' if r['plan_fits'] else 'does not fit'}, the run "
                               f"{'ran' if r['status'] == 'ok' else 'ran out of memory'}"
                               for r in wrong))  # fmt: skip
    return lines


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, ROOT)
    rows = measured_configs(args.runs)
    if not rows:
        print("error: no peaks measured on a GPU under the folders given", file=sys.stderr)
        return 2
    # imported here, once: each plan's process is forked from this one
    import dp_cost.capacity.card  # noqa: F401
    import dp_cost.capacity.predictions  # noqa: F401
    import dp_cost.measure.worker  # noqa: F401

    done = []
    try:
        with concurrent.futures.ProcessPoolExecutor(
            min(args.jobs, len(rows)), mp_context=multiprocessing.get_context("fork"),
            initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN),
        ) as pool:  # fmt: skip
            futures = [pool.submit(plan_row, (row, args.card_gib)) for row in rows]
            for row, future in zip(rows, futures, strict=True):
                try:
                    planned_row = future.result()
                except concurrent.futures.process.BrokenProcessPool as error:
                    planned_row = {**row, "error": f"its planning process died ({error})"}
                report(planned_row, done)
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    if not done:
        print("error: none of the measured configs could be planned", file=sys.stderr)
        return 2
    for line in summary(done):
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(done, f, indent=1)
    return 0


def report(row: dict, done: list[dict]) -> None:
    """One planned row printed (or warned about) and kept."""
    if row.get("error"):
        print(f"warning: {row['result']}: not planned ({row['error']})", file=sys.stderr)
        return
    done.append(row)
    if row["measured_mb"]:
        peaks = ", ".join(
            f"{kind} {row['predicted_mb'][kind]:.0f} / {measured:.0f} MB "
            f"({row['errors'][kind]:+.2%})"
            for kind, measured in zip(("allocated", "reserved"), row["measured_mb"], strict=True)
        )
    else:
        peaks = f"ran out of memory; planned {row['predicted_mb']['reserved']:.0f} MB reserved"
    graph = " (graphed: the plan a lower bound)" if graphed(row["config"]) else ""
    print(f"{where(row)}: {peaks}{graph}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
