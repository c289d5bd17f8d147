"""How a planned step grows with the model's depth: each config planned at its own depth and at
two smaller ones (``--depths``, the transformer's blocks), and the full depth's numbers drawn
from the two small ones by a straight line, beside the full plan's: the allocated peak within
each phase of the step (``prediction["phase_peaks"]``) and the step's peak as their largest,
the reserved peak on a card without limit, the room the step needs (``card.needed_room``, by the
config's fit rule) and the predicted step time on the card's shipped table. A plan made from two
shallow steps costs a fraction of the deep one (``seconds``); this says which of its numbers
such a plan could draw and which it could not.

usage: python benchmarks/depth_fold.py RESULT_OR_RUN_DIR [...] [--depths 3 4] [--out F]
       python benchmarks/depth_fold.py --rows F [F ...]   (rows an --out wrote, printed again)
  RESULT_OR_RUN_DIR: a config's result.json, or a run's folder (its configs one level down);
  each config is planned at its planned physical batch, on this CPU. Last, per number, how many
  drawn configs came within ±1% of the deep plan, and the worst.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="configs' result.json files or run folders")
    parser.add_argument("--rows", nargs="+", default=[], help="--out files to print again")
    parser.add_argument("--depths", nargs=2, type=int, default=[3, 4], metavar="BLOCKS")
    parser.add_argument("--out", help="write every row as JSON here too")
    args = parser.parse_args(argv)
    if not 1 <= args.depths[0] < args.depths[1]:
        parser.error("--depths: two numbers of blocks, the first at least 1 and below the second")
    if not args.paths and not args.rows:
        parser.error("give result.json files or run folders, or --rows")
    return args


def result_files(paths: list[str]) -> list[str]:
    files = []
    for path in paths:
        if path.endswith(".json"):
            files.append(path)
        else:
            files += sorted(glob.glob(os.path.join(path, "*", "result.json")))
    return files


def planned(config, physical: int, blocks: int | None) -> dict:
    """The step of ``config`` at ``physical`` and ``blocks`` deep: its numbers in MiB and ms
    (the time too at ``physical``: for an uncapped Poisson batch its rare largest draw, where
    --mode=capacity times the expected one)."""
    import card_rates  # its calibration models' depth: any model's, the same way

    from dp_cost.capacity import card
    from dp_cost.capacity.fake_step import predict, rank_share
    from dp_cost.capacity.predictions import with_physical_batch
    from dp_cost.capacity.step_time import planned_time
    from dp_cost.measure import worker

    at_physical = with_physical_batch(config, physical)
    depth = card_rates.depth(at_physical, blocks) if blocks else contextlib.nullcontext(at_physical)
    with depth as deep:
        started = time.perf_counter()
        step = predict(deep, worker.build_trainer, record_ops=True)
        seconds = time.perf_counter() - started
        timed = planned_time(deep, step, physical, rank_share(deep))
    return {
        "blocks": blocks,
        "seconds": seconds,
        "phase_peaks": [peak / MIB for peak in step["phase_peaks"]],
        "peak": step["peak"] / MIB,
        "reserved": card.reserved_peak(step) / MIB,
        "needed_room": card.needed_room(step, card.releases_cache(config)) / MIB,
        "step_ms": timed.get("step_ms"),
    }


def drawn(low: dict, high: dict, blocks: int) -> dict:
    """The numbers at ``blocks`` on the line through two shallower steps' (the phases' peaks one
    by one, the step's peak their largest)."""

    def line(a, b):
        return a + (b - a) * (blocks - low["blocks"]) / (high["blocks"] - low["blocks"])

    phases = [line(a, b) for a, b in zip(low["phase_peaks"], high["phase_peaks"], strict=True)]
    numbers = {key: line(low[key], high[key]) for key in ("reserved", "needed_room")}
    step_ms = None
    if low["step_ms"] is not None and high["step_ms"] is not None:
        step_ms = line(low["step_ms"], high["step_ms"])
    return {"phase_peaks": phases, "peak": max(phases), **numbers, "step_ms": step_ms}


def errors(line: dict, full: dict) -> dict:
    """(drawn / planned − 1) of each number; the phases' as their largest in size."""
    out = {key: (line[key] / full[key] - 1 if line[key] and full[key] else None)
           for key in ("peak", "reserved", "needed_room", "step_ms")}  # fmt: skip
    phases = [a / b - 1 for a, b in zip(line["phase_peaks"], full["phase_peaks"], strict=True) if b]
    out["phase_peaks_worst"] = max(phases, key=abs) if phases else None
    return out


def row(path: str, depths: list[int]) -> dict:
    from dp_cost.capacity.model_facts import model_shape
    from dp_cost.capacity.predictions import Predictions
    from dp_cost.core.reading import UnreadableFile, read_result
    from dp_cost.measure.config import ExperimentConfig

    try:
        config = ExperimentConfig.from_dict(read_result(path)["config"])
    except (UnreadableFile, KeyError, TypeError, ValueError) as error:
        return {"path": path, "error": f"unreadable: {error}"}
    config = dataclasses.replace(config, device="cpu", capacity=True)
    try:
        _, _, blocks, _ = model_shape(config.model, config.model_overrides)
        if blocks <= depths[1]:
            return {"path": path, "error": f"{blocks} blocks: not deeper than --depths"}
        physical = Predictions(config, None).planned
        full = planned(config, physical, None)
        low, high = (planned(config, physical, depth) for depth in depths)
        line = drawn(low, high, blocks)
    except Exception as error:  # noqa: BLE001 - a config this tree cannot plan: its own line
        return {"path": path, "error": f"{type(error).__name__}: {' '.join(str(error).split())}"}
    return {
        "path": path, "error": None, "trainer": config.trainer, "model": config.model,
        "blocks": blocks, "physical_batch_size": physical, "full": full, "shallow": [low, high],
        "drawn": line, "errors": errors(line, full),
    }  # fmt: skip


def printed(entry: dict) -> str:
    if entry["error"]:
        return f"{entry['path']}: not planned: {entry['error']}"
    parts = [f"{key} {value:+.2%}" if value is not None else f"{key} -"
             for key, value in entry["errors"].items()]  # fmt: skip
    seconds = entry["full"]["seconds"], sum(s["seconds"] for s in entry["shallow"])
    return (f"{entry['trainer']} {entry['model']} ({entry['blocks']} blocks, physical "
            f"{entry['physical_batch_size']}): {', '.join(parts)}; "
            f"{seconds[0]:.1f} s planned whole, {seconds[1]:.1f} s the two shallow")  # fmt: skip


def summary(rows: list[dict]) -> list[str]:
    """Per number: how many drawn configs came within ±1% of the deep plan, and the worst."""
    drawn = [r for r in rows if not r["error"]]
    lines = []
    for key in ("peak", "phase_peaks_worst", "reserved", "needed_room", "step_ms"):
        values = [r["errors"][key] for r in drawn if r["errors"][key] is not None]
        if values:
            close = sum(abs(v) <= 0.01 for v in values)
            lines.append(f"{key}: {close}/{len(values)} within ±1%, worst "
                         f"{max(values, key=abs):+.2%}")  # fmt: skip
    return lines


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # card_rates: a model at a depth
    warnings.filterwarnings("ignore")  # torch's and transformers' notes on fake tensors
    rows = []
    for kept in args.rows:
        try:
            with open(kept) as f:
                entries = json.load(f)
            if not isinstance(entries, list):
                raise TypeError("not a list of rows")
            lines = [printed(entry) for entry in entries]
            summary(entries)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            print(f"depth_fold: {kept}: not rows this script wrote ({error!r})", file=sys.stderr)
            return 1
        rows += entries
        print("\n".join(lines))
    files = result_files(args.paths)
    if args.paths and not files:
        print("depth_fold: no result.json found in the paths given", file=sys.stderr)
        return 1
    for path in files:
        entry = row(path, args.depths)
        rows.append(entry)
        print(printed(entry), flush=True)
    print("\n".join(summary(rows)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
