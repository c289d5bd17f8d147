"""The table of docs/capacity.md's worked example, made from a --mode=capacity run's
capacity.json: prints it, or with --check says whether the docs hold it as made (exit 1 if
not). tests/capacity/test_capacity_docs.py checks the docs against the run stored in
tests/fixtures/capacity_worked_example.json; after running the worked example again, store its
capacity.json there (--store) and paste the printed table into the docs.

Usage: python benchmarks/capacity_docs.py RUN_DIR_OR_CAPACITY_JSON [--check DOC] [--store PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# What the table reads of each config of capacity.json: what --store keeps
KEPT = (
    "trainer", "physical_batch_size", "predicted_peak_mb", "predicted_reserved_mb",
    "predicted_breakdown_mb", "largest_physical_batch", "model", "seq_len", "world_size",
    "fit_rule",
)  # fmt: skip
ROLES = (  # the parts of a peak the docs name, in their words (result-schema.md's keys)
    ("activations_mb", "activations"),
    ("activation_hooks_mb", "kept inputs and output gradients"),
    ("per_sample_gradients_mb", "per-sample gradients"),
    ("model_parameters_mb", "parameters"),
    ("gradients_mb", "gradients"),
    ("optimizer_states_mb", "optimizer states"),
    ("norm_samples_mb", "norm samples"),
    ("temp_matrices_mb", "temporaries"),
)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a --mode=capacity run's directory or its capacity.json")
    parser.add_argument("--check", metavar="DOC", help="check that DOC holds the table")
    parser.add_argument("--store", metavar="PATH", help="keep the configs' fields the table reads")
    return parser.parse_args(argv)


def load(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "capacity.json")
    with open(path) as f:
        return json.load(f)


def parts(breakdown: dict, count: int = 3) -> str:
    largest = sorted(
        ((breakdown.get(key) or 0, words) for key, words in ROLES), key=lambda p: -p[0]
    )
    return ", ".join(f"{words} {mb:.0f}" for mb, words in largest[:count] if mb)


def table(capacity: dict) -> str:
    """The worked example's table: per trainer, its predicted peak a rank at the planned
    physical batch (its three largest parts) and reserved peak, and the largest physical batch
    a rank that fits each budget."""
    configs = capacity["configs"]
    budgets = sorted({b["gpu_memory_gib"] for c in configs for b in c["largest_physical_batch"]})
    physical = configs[0]["physical_batch_size"]
    header = ["trainer", f"predicted peak a rank at physical {physical} (largest parts), MB"]
    header += ["predicted reserved, MB"]
    header += [f"largest physical batch a rank, {b:g} GiB" for b in budgets]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in configs:
        largest = {
            b["gpu_memory_gib"]: b["physical_batch_size"] for b in c["largest_physical_batch"]
        }
        peak = f"{c['predicted_peak_mb']:.0f} ({parts(c['predicted_breakdown_mb'])})"
        cells = [c["trainer"], peak, f"{c['predicted_reserved_mb']:.0f}"]
        cells += [str(largest.get(b, "-")) for b in budgets]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    try:
        capacity = load(args.run)
        made = table(capacity)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
        print(f"error: {args.run}: not a capacity run's capacity.json ({error})", file=sys.stderr)
        return 2
    if args.store:
        kept = {"configs": [{k: c.get(k) for k in KEPT} for c in capacity["configs"]]}
        with open(args.store, "w") as f:
            json.dump(kept, f, indent=1)
            f.write("\n")
    if args.check:
        with open(args.check) as f:
            held = made in f.read()
        print(f"{args.check}: {'holds' if held else 'does not hold'} the table")
        return 0 if held else 1
    print(made, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
