"""Do the card table's host rows, measured on tiny models, hold at a real model's widths?

The time model charges each op of a planned step the host µs that benchmarks/card_rates.py
measured on its kind's tiny calibration model (the eager step's host time per phase against its
planned ops at several depths, fitted by a line). This measures the same thing, the same way
(``card_rates.host_row``), on the tiny model and on a real Hugging Face
architecture or the toolkit's own LM (random weights, its own widths, cut to the same depths),
at the calibration's batch (2, 16) or, with --shape, at a real step's batch and sequence as one
chunk: per trainer and phase, µs an op on each and their ratio. A ratio far from 1 says the
table's host rows do not carry over to real models, or to real batches, on this host.

usage: python benchmarks/host_width.py [--model meta-llama/Llama-3.2-1B-Instruct] [--lora]
           [--trainers standard ghost ...] [--depths 2 4 6] [--shape B T] [--optimizer adam]
           [--device cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = ("standard", "dpsgd", "ghost", "flash")


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="meta-llama/Llama-3.2-1B-Instruct",
        help="the real architecture (a Hugging Face config the toolkit ships, or the toolkit's LM)",
    )
    parser.add_argument(
        "--shape", nargs=2, type=int, metavar=("B", "T"),
        help="the real model's batch and sequence, one chunk (default: the calibration's 2, 16)",
    )  # fmt: skip
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                        help="both models' optimizer (the calibration's: sgd)")  # fmt: skip
    parser.add_argument("--lora", action="store_true", help="its LoRA rows (else full fine-tuning)")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument("--depths", nargs="+", type=int, default=[2, 4, 6])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", help="write every row as JSON here too")
    args = parser.parse_args(argv)
    if len(set(args.depths)) < 2 or min(args.depths) < 1:
        parser.error("--depths: two different depths at least, each one block or more")
    if args.shape and min(args.shape) < 1:
        parser.error("--shape: a batch and a sequence of one or more")
    return args


def compare(args) -> list[dict]:
    """Per trainer, the tiny calibration model's host row and the real model's, measured in
    turn in this process, and per phase the real one's µs an op over the tiny one's."""
    import card_rates as calibration
    import torch

    from dp_cost.core.hf_architectures import HF_CONFIGS

    kind = "lora" if args.lora else ("hf" if args.model in HF_CONFIGS else "lm")
    shape = {"batch_size": args.shape[0], "seq_len": args.shape[1]} if args.shape else {}
    sync_cost_us = calibration.sync_us() if args.device == "cuda" else 0.0
    rows = []
    for trainer in args.trainers:
        tiny_config = dataclasses.replace(
            calibration.calibration_config(trainer, kind, args.device), optimizer=args.optimizer
        )
        real_config = dataclasses.replace(tiny_config, model=args.model, **shape)
        tiny, real = (
            {"model": config.model, **calibration.host_row(config, args.depths, sync_cost_us)}
            for config in (tiny_config, real_config)
        )
        if args.device == "cuda":
            torch.cuda.empty_cache()
        ratio = {
            phase: real["op_us"][phase] / us if us else None for phase, us in tiny["op_us"].items()
        }
        real_shape = [real_config.batch_size, real_config.seq_len]
        rows.append({"trainer": trainer, "kind": kind, "real_shape": real_shape, "tiny": tiny,
                     "real": real, "op_us_ratio": ratio})  # fmt: skip
    return rows


def print_rows(rows: list[dict], model: str) -> None:
    print(f"| trainer | phase | tiny µs an op | {model} µs an op | ratio |")
    print("|---|---|---|---|---|")
    for row in rows:
        for phase, ratio in row["op_us_ratio"].items():
            tiny, real = row["tiny"]["op_us"][phase], row["real"]["op_us"][phase]
            shown = "-" if ratio is None else f"{ratio:.2f}"
            print(f"| {row['trainer']} | {phase} | {tiny:.2f} | {real:.2f} | {shown} |")


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import torch

    from dp_cost.core.hf_architectures import HF_CONFIGS
    from dp_cost.core.settings import LM_MODELS

    if args.model not in HF_CONFIGS and (args.lora or args.model not in LM_MODELS):
        print(f"error: --model {args.model}: not a Hugging Face config the toolkit ships "
              f"({', '.join(sorted(HF_CONFIGS))})" + ("" if args.lora else
              f" nor the toolkit's LM ({', '.join(LM_MODELS)})"), file=sys.stderr)  # fmt: skip
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device here (--device cpu runs it on the CPU)",
              file=sys.stderr)  # fmt: skip
        return 2
    rows = compare(args)
    print_rows(rows, args.model)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
