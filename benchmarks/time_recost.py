"""The step-time model against steps already measured: every config of the given
``--mode=capacity --validate`` runs (or measuring runs of fixed-size batches in one process)
planned again on this CPU (the fake step's op list, as the toolkit records it now) and costed
with each card table given, beside the step the run measured (its ``median_time_ms``). A
change to the time model or a table measured again is checked this way against every measured
step kept, on every machine they came from, without a GPU. Where a run was traced (its
result's ``kernels``), the GPU ms of its traced step by kind (GEMMs, attention, torch.optim's
step, every other kernel) is printed beside the plan's, and the host's and the GPU's busy time
of its light trace's step (``step_timeline``) beside the plan's host and GPU time: where a
miss lies.

With --pool, each RUN_DIR is one machine's runs (e.g. `benchmarks/time_grid.sh`'s folder on
that machine), and a config run on two or more of them is also compared as the goal measures
it: its measured step the median of all its steps on every machine.

With --recorded RECORD, configs an earlier session measured on other machines (their runs not
kept: RECORD is the JSON its history keeps, each config's medians by machine and its pooled
step, e.g. benchmarks/history/2026-12-01-time-grid.json) are costed again with today's tables:
against the record's pooled steps, and against the median of every machine's median, the
record's and these runs'. So a new table meets machines measured before.

usage: python benchmarks/time_recost.py RUN_DIR [RUN_DIR ...] [--tables TABLE ...] [--out F]
                                        [--pool] [--recorded RECORD]
  RUN_DIR: a run's folder (its configs' result.json one level down), or a folder of runs
  TABLE: card tables (default: the shipped table of the card each run was measured on)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BANDS = (0.15, 0.25)  # the time goal's ±15% (one GPU), and ±25%


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="measured run folders (or folders of them)")
    parser.add_argument("--tables", nargs="+", default=[], help="card tables to cost with")
    parser.add_argument("--out", help="write every row as JSON here too")
    parser.add_argument(
        "--pool", action="store_true",
        help="each RUN_DIR one machine's: also a config's steps on every machine pooled",
    )  # fmt: skip
    parser.add_argument(
        "--recorded", metavar="RECORD",
        help="earlier machines' medians of the same configs (a history JSON), pooled with these",
    )  # fmt: skip
    return parser.parse_args(argv)


def measured_configs(folders: list[str]) -> list[dict]:
    """Each ok config with a measured step whose chunks are known: its result.json's path, its
    config, the measured median and steps, the chunks it ran as and its own prediction."""
    from dp_cost.core.reading import read_result

    paths = {}  # result.json -> the folder given that holds it (with --pool, its machine)
    for folder in folders:
        for pattern in (("*", "result.json"), ("*", "*", "result.json")):
            for path in glob.glob(os.path.join(folder, *pattern)):
                paths.setdefault(path, folder)
    rows = []
    for path, folder in sorted(paths.items()):
        try:
            result = read_result(path)
            if result.get("status") != "ok" or not result.get("median_time_ms"):
                continue  # a failed or unmeasured config: nothing to compare
            chunks, predicted_then = chunks_and_prediction(result)
            if not chunks:
                continue  # several ranks, or batches drawn at random with no plan of them
            rows.append({
                "result": path, "machine": folder, "config": result["config"],
                "device": result["env"]["device"],
                "measured_ms": result["median_time_ms"], "steps_ms": result["step_times_ms"],
                "chunks": chunks, "predicted_then_ms": predicted_then,
                "kernels_ms": measured_kernels(result),
                "timeline_ms": measured_timeline(result),
            })  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            print(f"warning: {path}: not a measured time prediction ({error})", file=sys.stderr)
    return rows


# The kernel categories a traced run reports (result["kernels"]) as the planned ops' kinds
KINDS = ("gemm", "attention", "optimizer", "other")


def measured_kernels(result: dict) -> dict[str, float] | None:
    """A traced run's GPU ms of one step by KINDS (its kernel categories; the memory-bound
    ones, elementwise, reductions, norms and the rest, as "other", less NCCL's kernels, which
    the plan times as collectives), None if not traced."""
    kernels = result.get("kernels")
    if not kernels:
        return None
    by_kind = dict.fromkeys(KINDS, 0.0)
    for category, entry in kernels.items():
        by_kind[category if category in KINDS else "other"] += entry["time_ms"]
    by_kind["other"] -= result.get("communication_time_ms") or 0.0
    return {kind: round(ms, 3) for kind, ms in by_kind.items()}


def measured_timeline(result: dict) -> dict[str, float] | None:
    """A traced run's host and GPU, from its light trace's step of median host time
    (``step_timeline``): the host's ms from its first CUDA call to its last launch (``host``),
    of them waiting on the GPU (``host_wait``), and the GPU's busy ms (``gpu_busy``); None if
    not traced on CUDA."""
    timeline = result.get("step_timeline") or {}
    keys = {"host": "host_time_ms", "host_wait": "host_wait_ms", "gpu_busy": "gpu_busy_ms"}
    if any(timeline.get(key) is None for key in keys.values()):
        return None
    return {name: round(float(timeline[key]), 3) for name, key in keys.items()}


def planned_kind(op) -> str:
    """An op's kind as the trace's categories name its kernel (``core.kernel_names``): a
    foreach op's (the optimizer's step, flash's sums of chunks) "optimizer" but for its norms
    ("norm_clip", here "other"), a GEMM or an attention by its kind, the rest "other". (An
    eager attention's GEMMs, "attention" in the trace by their profiler range, are GEMMs here.)"""
    if "_foreach_" in op.name and "norm" not in op.name:
        return "optimizer"
    return op.kind if op.kind in ("gemm", "attention") else "other"


def planned_kernels(ops: list, marks: list, costs, chunk_count: int) -> dict[str, float]:
    """The planned step's GPU ms by KINDS (``planned_kind``), as the time model costs them,
    over the logical batch as ``predicted_time`` sums it (``step_time.logical_batch``)."""
    from dp_cost.capacity.step_time import chunk_groups, logical_batch

    chunks, finish = chunk_groups(ops, marks)
    groups = []
    for group in [*chunks, finish]:
        by_kind = dict.fromkeys(KINDS, 0.0)
        for op, phase in group:
            if op.kind == "collective":
                continue
            by_kind[planned_kind(op)] += costs.op(op, phase)[1] / 1e3
        groups.append(by_kind)
    total = logical_batch(groups, len(chunks), chunk_count)
    return {kind: round(ms, 3) for kind, ms in total.items()}


def chunks_and_prediction(result: dict) -> tuple[int | None, float | None]:
    """(the chunks a step of the measured config ran as on rank 0, the run's own predicted ms):
    a --validate run's from its prediction where it predicted a time; else from its config,
    where its batches were of fixed size. None where not known."""
    from dp_cost.capacity.step_time import chunk_count
    from dp_cost.hf.configs import HF_CONFIGS
    from dp_cost.parallel.ranks import share

    time = (result.get("prediction") or {}).get("time") or {}
    if time.get("step_ms"):
        return time["chunks"], time["step_ms"]
    config = result["config"]
    if config["model"] in HF_CONFIGS and config.get("poisson", True):
        return None, None
    mine = len(share(config["batch_size"], 0, config.get("world_size", 1)))
    physical = min(config.get("max_physical_batch_size") or mine, mine)
    return chunk_count(mine, physical), None


def costed(row: dict, tables: dict, card_rates, step_time) -> dict:
    """``row``'s config planned here and costed with each table (``None``: the shipped table
    of the card it was measured on): predicted ms by table."""
    config, planned = _planned(config_key(row["config"]))  # a config run twice: planned once
    predicted = {}
    for name, rates in tables.items():
        rates = rates or card_rates.card_rates(row["device"])
        times = step_time.config_time(config, planned, rates, row["chunks"])
        predicted[name] = {k: round(v, 3) for k, v in times.items()}
        if row["kernels_ms"] is not None:  # traced: where the GPU's time goes, beside it
            costs = step_time.step_costs(config, rates)
            predicted[name]["kernels_ms"] = planned_kernels(
                planned["ops"], planned["marks"], costs, row["chunks"]
            )
    return predicted


def print_where(row: dict) -> None:
    """Where a traced run's miss lies: its GPU time by kind, and its host's time and the GPU's
    busy time, each beside the plan's (one number a table)."""
    predicted = row["predicted_ms"].values()
    if row["kernels_ms"] is not None:
        print("  GPU ms of its traced step by kind, predicted / measured: " + "; ".join(
            f"{kind} " + " ".join(f"{v['kernels_ms'][kind]:.1f}" for v in predicted)
            + f" / {row['kernels_ms'][kind]:.1f}" for kind in KINDS
        ))  # fmt: skip
    timeline = row["timeline_ms"]
    if timeline is not None:
        host = " ".join(f"{v['host_ms']:.1f}" for v in predicted)
        gpu = " ".join(f"{v['gpu_ms']:.1f}" for v in predicted)
        print(f"  host and GPU-busy ms of its traced step (the light trace's), predicted / "
              f"measured: host {host} / {timeline['host']:.1f} (waiting on the GPU "
              f"{timeline['host_wait']:.1f}); GPU {gpu} / {timeline['gpu_busy']:.1f}")  # fmt: skip


def config_key(fields: dict) -> str:
    """One config's identity across runs and machines: its settings, as JSON."""
    return json.dumps(fields, sort_keys=True)


@functools.lru_cache(maxsize=1)  # the rows come sorted by config: one plan held at a time
def _planned(key: str):
    return planned_step(json.loads(key))


def planned_step(fields: dict):
    """The config planned on this CPU's fake step, its ops recorded."""
    from dp_cost.capacity import fake_step
    from dp_cost.measure import worker
    from dp_cost.measure.config import ExperimentConfig

    config = ExperimentConfig.from_dict(fields)
    config = dataclasses.replace(config, device="cpu")  # planned here, as --mode=capacity does
    return config, fake_step.predict(config, worker.build_trainer, record_ops=True)


def within_bands(errors: list[float]) -> str:
    """How many of ``errors`` (predicted / measured - 1) lie in each of BANDS, and their median."""
    within = ", ".join(
        f"{sum(abs(e) <= band for e in errors)}/{len(errors)} within ±{band:.0%}" for band in BANDS
    )
    return f"{within}; median error {statistics.median(errors):+.1%}"


def pooled(rows: list[dict]) -> list[dict]:
    """Each config measured on two or more machines (``row["machine"]``): its rows, the
    machines, and its measured step, the median of every step it ran on all of them."""
    by_config: dict[str, list[dict]] = {}
    for row in rows:
        by_config.setdefault(config_key(row["config"]), []).append(row)
    out = []
    for same in by_config.values():
        machines = sorted({row["machine"] for row in same})
        if len(machines) < 2:
            continue
        steps = [ms for row in same for ms in row["steps_ms"]]
        out.append({"rows": same, "machines": machines, "measured_ms": statistics.median(steps)})
    return out


def pooled_report(rows: list[dict], tables: list[str]) -> None:
    """Print each config's pooled measured step against its prediction, then the bands."""
    groups = pooled(rows)
    if not groups:
        print("pooled: no config was measured on two or more of the folders given")
        return
    for group in groups:
        predicted = group["rows"][0]["predicted_ms"]
        cost = " ".join(
            f"{predicted[name]['step_ms']:.1f} "
            f"({predicted[name]['step_ms'] / group['measured_ms'] - 1:+.1%})"
            for name in tables
        )
        per_machine = ", ".join(f"{row['measured_ms']:.1f}" for row in group["rows"])
        where = os.path.dirname(group["rows"][0]["result"])
        print(
            f"pooled {where}: measured {group['measured_ms']:.1f} ms (the median of every step "
            f"on {len(group['machines'])} machines; theirs {per_machine}); predicted {cost}"
        )
    for name in tables:
        errors = [
            group["rows"][0]["predicted_ms"][name]["step_ms"] / group["measured_ms"] - 1
            for group in groups
        ]
        print(f"{name}, pooled over machines: {within_bands(errors)}")


def run_and_config(row: dict) -> str:
    """A row's name in a record: its run's folder and its config's, as RUN/CONFIG."""
    config_folder = os.path.dirname(row["result"])
    return f"{os.path.basename(os.path.dirname(config_folder))}/{os.path.basename(config_folder)}"


def read_record(path: str) -> dict:
    """A record of earlier machines' measured configs (--recorded): each config's pooled step
    and its machines' medians, ms above zero (else ValueError, KeyError, TypeError or
    AttributeError)."""
    from dp_cost.core.reading import read_json

    def positive(ms) -> bool:
        return isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0

    record = read_json(path)
    for name, kept in record["configs"].items():
        medians = kept["machine_medians_ms"]
        if not (positive(kept["pooled_ms"]) and isinstance(medians, list) and medians
                and all(map(positive, medians))):  # fmt: skip
            raise ValueError(f"{name}: pooled_ms and machine_medians_ms must be ms above zero")
    return record


def recorded_report(rows: list[dict], tables: list[str], record: dict) -> None:
    """Each config of ``record`` (``configs``: RUN/CONFIG -> ``pooled_ms`` and
    ``machine_medians_ms``) that these runs measured, costed with ``tables``: against the
    record's pooled step, and against the median of every machine's median (the record's, then
    each of these runs')."""
    by_name: dict[str, list[dict]] = {}
    for row in rows:
        by_name.setdefault(run_and_config(row), []).append(row)
    names = [name for name in record["configs"] if name in by_name]
    if not names:
        print("recorded: none of the record's configs is among these runs")
        return
    for name in tables:
        theirs, every = [], []
        for config in names:
            kept, mine = record["configs"][config], by_name[config]
            predicted = mine[0]["predicted_ms"][name]["step_ms"]
            theirs.append(predicted / kept["pooled_ms"] - 1)
            medians = [*kept["machine_medians_ms"], *(row["measured_ms"] for row in mine)]
            every.append(predicted / statistics.median(medians) - 1)
        print(f"{name}, against the record's pooled steps: {within_bands(theirs)}")
        print(f"{name}, against the median of every machine's median (the record's and these "
              f"runs'): {within_bands(every)}")  # fmt: skip


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, ROOT)
    from dp_cost.capacity import card_rates, step_time

    try:
        record = read_record(args.recorded) if args.recorded else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        print(f"error: --recorded {args.recorded}: not a record of measured configs ({error})",
              file=sys.stderr)  # fmt: skip
        return 2
    rows = measured_configs(args.runs)
    if not rows:
        print("error: no measured steps to cost under the folders given", file=sys.stderr)
        return 2
    try:
        tables = {path: card_rates.load_card(path) for path in args.tables} or {"shipped": None}
    except card_rates.CardRatesError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    errors = {name: [] for name in tables}
    rows.sort(key=lambda row: (config_key(row["config"]), row["result"]))
    for row in list(rows):
        try:
            row["predicted_ms"] = costed(row, tables, card_rates, step_time)
        except Exception as error:  # a kept config this code cannot plan: say so, go on
            print(f"warning: {row['result']}: not planned ({type(error).__name__}: "
                  f"{' '.join(str(error).split())[:200]})", file=sys.stderr)  # fmt: skip
            rows.remove(row)
            continue
        for name, times in row["predicted_ms"].items():
            errors[name].append(times["step_ms"] / row["measured_ms"] - 1)
        cost = " ".join(
            f"{v['step_ms']:.1f} ({v['step_ms'] / row['measured_ms'] - 1:+.1%})"
            for v in row["predicted_ms"].values()
        )
        then = row["predicted_then_ms"]
        print(
            f"{row['result']}: measured {row['measured_ms']:.1f} ms; predicted {cost} (the run's "
            f"own prediction: {'none' if then is None else f'{then:.1f}'})",
            flush=True,
        )
        print_where(row)
    if not rows:
        print("error: none of the measured configs could be planned", file=sys.stderr)
        return 2
    for name, found in errors.items():
        print(f"{name}: {within_bands(found)}")
    if args.pool:
        pooled_report(rows, list(tables))
    if record is not None:
        recorded_report(rows, list(tables), record)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
