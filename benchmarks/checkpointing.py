"""What activation checkpointing frees and costs, per trainer: the CLI run twice on the same
configs, without and with --activation_checkpointing (the same seed and batches), then one table
of each config's peak allocated memory and median step, checkpointed / not, and each trainer
against standard in the same setting.

usage: python benchmarks/checkpointing.py OUTPUT_DIR [--ranks N] [CLI flags of the configs ...]
       python benchmarks/checkpointing.py OUTPUT_DIR --table   (the table of runs made before)
--ranks N: each run a torchrun job of N ranks on this host (with --distributed ddp or fsdp).
e.g.   python benchmarks/checkpointing.py runs --mode=profile --model 1b --dtype bfloat16
           --attention sdpa --batch_sizes 8 --seq_lens 4096 --trainers standard dpsgd ghost
           --steps 3 --no_trace
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"plain": [], "ckpt": ["--activation_checkpointing"]}


def run(output_dir: str, flags: list[str], ranks: int | None = None) -> None:
    launcher = [sys.executable]
    if ranks:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    for run_name, extra in RUNS.items():
        command = [*launcher, "profiling_script.py", *flags, *extra]
        command += ["--output_dir", output_dir, "--run_name", run_name]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, cwd=ROOT, check=False)


def load(run_dir: str) -> dict[tuple, dict]:
    """(trainer, batch, seq, physical) -> result.json of each config of a run."""
    found = {}
    for name in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        path = os.path.join(run_dir, name, "result.json")
        try:
            with open(path) as f:
                result = json.load(f)
            config = result["config"]
            key = (config["trainer"], config["batch_size"], config["seq_len"],
                   config.get("max_physical_batch_size"))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found[key] = result
    return found


def ratio(a, b) -> str:
    numbers = isinstance(a, (int, float)) and isinstance(b, (int, float))
    return f"{a / b:.2f}" if numbers and b else "-"


def cell(result: dict | None, field: str) -> str:
    if result is None:
        return "absent"
    if result.get("status") != "ok":
        return result.get("status", "?")
    value = result.get(field)
    return f"{value:.1f}" if isinstance(value, (int, float)) else "-"


def table(output_dir: str) -> str:
    plain, ckpt = (load(os.path.join(output_dir, name)) for name in RUNS)
    lines = [
        "| trainer | batch | seq | physical | peak MB | peak MB ckpt | ckpt / not | ms | ms ckpt "
        "| ckpt / not | peak vs standard, ckpt | ms vs standard, ckpt |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(set(plain) | set(ckpt)):
        p, c = plain.get(key), ckpt.get(key)
        standard = ckpt.get(("standard", *key[1:]))

        def value(result, field):
            return result.get(field) if result and result.get("status") == "ok" else None

        peak, peak_c = value(p, "peak_memory_mb"), value(c, "peak_memory_mb")
        ms, ms_c = value(p, "median_time_ms"), value(c, "median_time_ms")
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3] or '-'} | {cell(p, 'peak_memory_mb')} "
            f"| {cell(c, 'peak_memory_mb')} | {ratio(peak_c, peak)} | {cell(p, 'median_time_ms')} "
            f"| {cell(c, 'median_time_ms')} | {ratio(ms_c, ms)} "
            f"| {ratio(peak_c, value(standard, 'peak_memory_mb'))} "
            f"| {ratio(ms_c, value(standard, 'median_time_ms'))} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    output_dir, flags = argv[0], argv[1:]
    ranks = None
    if flags[:1] == ["--ranks"]:
        if len(flags) < 2 or not flags[1].isdigit() or int(flags[1]) < 1:
            print("checkpointing.py: --ranks takes a number, e.g. --ranks 2", file=sys.stderr)
            return 2
        ranks, flags = int(flags[1]), flags[2:]
    if flags != ["--table"]:
        run(output_dir, flags, ranks)
    print(table(output_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
