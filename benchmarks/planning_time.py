"""How long --mode=capacity takes to plan: the CLI run once on the given flags (the README's 1b
line by default), the wall time of the whole run, then per config the predictions it made (the
planned physical batch and every batch its searches judged) and the seconds they took (the
result's ``prediction.seconds``), from each config's result.json.

usage: python benchmarks/planning_time.py OUTPUT_DIR [--mode=capacity flags ...]
e.g.   python benchmarks/planning_time.py runs
       python benchmarks/planning_time.py runs --model_name meta-llama/Llama-3.1-8B-Instruct
           --seq_lengths 512 2048 --gpu_memory 80
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_1B = ["--model", "1b", "--seq_lens", "1024", "--dtype", "bfloat16", "--attention", "sdpa",
             "--gpu_memory", "79", "140"]  # fmt: skip
RUN_NAME = "planning_time"


def plan(output_dir: str, flags: list[str]) -> float:
    """Run the CLI's --mode=capacity on ``flags``; its wall seconds."""
    command = [sys.executable, "profiling_script.py", "--mode=capacity", *flags]
    command += ["--output_dir", output_dir, "--run_name", RUN_NAME]
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=False)
    return time.perf_counter() - started


def configs(run_dir: str) -> list[dict]:
    """Each config's name, trainer, predictions made and their seconds (None where the config
    has no prediction: skipped or failed, with its status)."""
    rows = []
    for name in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        try:
            with open(os.path.join(run_dir, name, "result.json")) as f:
                result = json.load(f)
        except (OSError, ValueError):
            continue
        prediction = result.get("prediction") or {}
        made = prediction.get("predictions") or []
        # a sequence-length search's steps beside them (its config's own length is among made)
        seq_len = (result.get("config") or {}).get("seq_len")
        lengths = prediction.get("seq_len_predictions") or []
        searched = [p for p in lengths if p["seq_len"] != seq_len]
        rows.append({
            "config": name,
            "status": result.get("status"),
            "predictions": len(made) + len(searched) or None,
            "seconds": prediction.get("seconds"),
        })  # fmt: skip
    return rows


def table(rows: list[dict], wall: float) -> str:
    lines = [
        "| config | status | predictions | seconds | seconds a prediction |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        each = (
            f"{row['seconds'] / row['predictions']:.1f}"
            if row["seconds"] is not None and row["predictions"]
            else "-"
        )
        seconds = f"{row['seconds']:.1f}" if row["seconds"] is not None else "-"
        lines.append(
            f"| {row['config']} | {row['status']} | {row['predictions'] or '-'} | {seconds} "
            f"| {each} |"
        )
    lines.append(f"\nThe whole run: {wall:.1f} s wall (workers' start-up included).")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    output_dir, flags = argv[0], argv[1:] or README_1B
    if os.path.exists(os.path.join(output_dir, RUN_NAME)):
        print(f"error: {os.path.join(output_dir, RUN_NAME)} exists: pick another OUTPUT_DIR")
        return 2
    wall = plan(output_dir, flags)
    print(table(configs(os.path.join(output_dir, RUN_NAME)), wall))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
