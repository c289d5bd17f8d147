"""The several-GPUs table from the result.json files under a directory (benchmarks/scaling.sh's
and fsdp_8b.sh's runs): per mode (one GPU, DDP or FSDP2 on W ranks, eager or graphed), each
trainer's median step, flash / standard, per-layer flash / standard and ghost / flash in that
mode, and each trainer's scaling efficiency against its own 1-GPU run at global (8, T) in the
same clipping and graph setting:
weak scaling (W times the global batch) t1 / tW, strong scaling (the same global batch)
t1 / (W tW).

usage: python benchmarks/scaling_table.py OUTPUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_cost.parallel.mode import distributed_mode  # noqa: E402

COLUMNS = [
    ("standard", "flat"),
    ("flash", "flat"),
    ("flash", "per_layer"),
    ("dpsgd", "per_layer"),
    ("ghost", "flat"),
]


def results(root: str) -> list[dict]:
    """Every config's result.json under ``root`` (a torchrun run's aggregate, not the ranks'), in
    the order of their folders' paths, each with its folder under "folder"."""
    found = []
    for folder, _, files in sorted(os.walk(root)):
        if "result.json" in files:
            try:
                with open(os.path.join(folder, "result.json")) as f:
                    found.append({**json.load(f), "folder": folder})
            except (OSError, ValueError) as error:
                print(f"warning: {folder}/result.json unreadable ({error}); left out")
    return found


def mode_key(config: dict) -> tuple:
    mode = distributed_mode(config.get("distributed", "none"), config.get("world_size", 1))
    return (
        mode,
        mode.world_size,
        config["batch_size"],
        config["seq_len"],
        bool(config.get("cuda_graph")),
        config.get("fsdp_sync", "chunk"),
    )


def table(found: list[dict]) -> str:
    times: dict[tuple, dict] = {}
    peaks: dict[tuple, dict] = {}
    for result in found:
        config = result["config"]
        clipping = config.get("clipping", "flat") if config["trainer"] != "standard" else "flat"
        cell = (config["trainer"], clipping)
        ok = result["status"] == "ok"
        if cell in times.get(mode_key(config), {}):  # a repeat run: rows pair one run's configs
            print(
                f"warning: {result.get('folder')} repeats {'/'.join(cell)} of a mode already "
                "in the table: it replaces the earlier one (one run per mode in a folder, or "
                "a table per run)",
                file=sys.stderr,
            )
        times.setdefault(mode_key(config), {})[cell] = (
            result.get("median_time_ms") if ok else result["status"]
        )
        peaks.setdefault(mode_key(config), {})[cell] = result.get("peak_memory_mb") if ok else None
    header = (
        "| mode | global (B, T) | per rank | standard ms | flash ms | flash per-layer ms | "
        "dpsgd per-layer ms | ghost ms | flash / standard | flash per-layer / standard | "
        "ghost / flash | "
        "efficiency standard / flash / flash per-layer | peak MB per rank standard / flash / "
        "flash per-layer / ghost |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for key in sorted(times, key=lambda k: (k[1], k[0].shards, k[4], k[2])):
        distributed, ranks, batch, seq, graph, sync = key
        row = times[key]
        name = f"{'FSDP2' if distributed.shards else 'DDP'} x{ranks}" if ranks > 1 else "1 GPU"
        name += ", graph" if graph else ""
        name += ", logical sync" if sync == "logical" else ""
        one = times.get((distributed_mode("none"), 1, 8, seq, graph, "chunk"), {})
        efficiency = []
        for cell in COLUMNS[:3]:
            t1, tw = one.get(cell), row.get(cell)
            if ranks == 1 or not isinstance(t1, float) or not isinstance(tw, float):
                efficiency.append("–")
            elif batch == 8 * ranks:  # weak scaling
                efficiency.append(f"{100 * t1 / tw:.0f}%")
            else:  # strong scaling
                efficiency.append(f"{100 * t1 / (ranks * tw):.0f}%")
        lines.append(
            f"| {name} | ({batch}, {seq}) | {batch // ranks} | "
            + " | ".join(_ms(row.get(cell)) for cell in COLUMNS)
            + f" | {_ratio(row.get(COLUMNS[1]), row.get(COLUMNS[0]))}"
            + f" | {_ratio(row.get(COLUMNS[2]), row.get(COLUMNS[0]))}"
            + f" | {_ratio(row.get(COLUMNS[4]), row.get(COLUMNS[1]))}"
            + f" | {' / '.join(efficiency)}"
            + f" | {' / '.join(_ms(peaks[key].get(cell)) for cell in (*COLUMNS[:3], COLUMNS[4]))} |"
        )
    return "\n".join(lines)


def _ms(value) -> str:
    if value is None:
        return "–"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) else "–"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    found = results(argv[0])
    if not found:
        print(f"error: no result.json under {argv[0]}", file=sys.stderr)
        return 1
    print(table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
