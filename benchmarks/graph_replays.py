"""What the CUDA graphs of a run replayed, per config and rank, and flash's time against
standard's over the same Poisson draws: one row per result file of ``RUN_DIR``.

    python benchmarks/graph_replays.py RUN_DIR

Columns: the config, the rank, the mean timed step (the draws are the same for every trainer
of the run: same seed), the share of the timed steps' physical chunks that replayed a graph (a
step run eagerly timed each of its chunks), the padding rows the replays ran, and flash's mean
over standard's of the same rank."""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from dp_cost.report import step_goals  # noqa: E402


def rows(run_dir: str) -> list[dict]:
    out = []
    for config_dir in sorted(glob.glob(os.path.join(run_dir, "*", ""))):
        # torchrun: one result per rank (result.json repeats rank 0's); else result.json
        paths = sorted(glob.glob(os.path.join(config_dir, "result.rank*.json")))
        out += [row(path) for path in paths or glob.glob(os.path.join(config_dir, "result.json"))]
    return out


def row(path: str) -> dict:
    """One result file's row (its status where the config did not run)."""
    with open(path) as f:
        result = json.load(f)
    config = os.path.basename(os.path.dirname(path))
    if result.get("status") != "ok":
        return {"config": config, "status": result}
    graph = result.get("cuda_graph")
    replayed = graph["timed_chunk_replays"] if graph else 0
    name = os.path.basename(path)
    return {
        "config": config,
        # the config's name less its trainer's: flash is compared with standard's of the same
        "shape": config.split("_", 1)[1],
        "trainer": result["config"]["trainer"],
        "rank": int(name.split(".rank")[1].split(".")[0]) if ".rank" in name else 0,
        "mean_ms": result["avg_time_ms"],
        "steps": len(result["step_times_ms"]),
        "replayed": step_goals.replayed_share(result),
        "chunks": replayed + len(result.get("physical_step_times_ms") or []),
        "padding": graph["timed_padding_samples"] if graph else None,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory (<output_dir>/<run_name>)")
    run_dir = parser.parse_args(argv).run_dir
    if not os.path.isdir(run_dir):
        print(f"error: no run directory at {run_dir}", file=sys.stderr)
        return 2
    table = rows(run_dir)
    standard = {
        (r["shape"], r["rank"]): r["mean_ms"] for r in table if r.get("trainer") == "standard"
    }
    columns = ["config", "rank", "steps", "mean ms", "chunks replayed", "chunks", "padding rows"]
    print("| " + " | ".join([*columns, "flash / standard"]) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        if "status" in r:
            print(f"| {r['config']} | - | - | - | - | - | - | {r['status'].get('status')} |")
            continue
        base = standard.get((r["shape"], r["rank"]))
        versus = f"{r['mean_ms'] / base:.3f}" if r["trainer"] == "flash" and base else "-"
        share = "-" if r["replayed"] is None else f"{r['replayed']:.1%}"
        print(
            f"| {r['config']} | {r['rank']} | {r['steps']} | {r['mean_ms']:.1f} | {share} "
            f"| {r['chunks']} | {r['padding']} | {versus} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
