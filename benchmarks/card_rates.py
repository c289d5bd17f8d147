"""Measure this card's time calibration for --mode=capacity's time model and write it as
dp_cost/capacity/cards/<card>.json (the file the toolkit ships for the card kind).

What it measures (the kernels by ``benchmarks/kernel_rates.py``), each kernel replayed in a CUDA
graph so that its GPU time is timed apart from the host's launches:
- GEMMs (torch.mm) on a grid of (M, N, K) per dtype (bf16; fp32 as torch runs it by default);
- fused attention (F.scaled_dot_product_attention, causal), forward and backward, by sequence
  length and head size, as TFLOP/s by torch's FLOP counter's formulas;
- an elementwise kernel's time by the bytes it moves, and the own rates of the memory-bound ops
  that are slower per byte (norms, reductions, torch.optim's foreach steps);
and, in eager steps on the tiny LM, the tiny Llama and the tiny Llama's LoRA, each at HOST_DEPTHS
(host-bound: their kernels are shorter than their launches), each trainer's host time in each
phase of a chunk, per op of the planned step and besides (in rounds over every row: --rounds),
and what a host sync (.item()) costs.
Usage: python benchmarks/card_rates.py [--out PATH] [--quick] [--rounds N]
       python benchmarks/card_rates.py --memory_ops_into TABLE (the memory ops' rates alone)
       python benchmarks/card_rates.py --host_into TABLE [--rounds N] (the host rows alone)
(benchmarks/card_tables.py fits a table again, or merges several machines', without a GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Rounds of the host rows' calibration steps. A round measures every row at every depth in turn,
# and each point is its median over the rounds: a host's speed can drift during one run, and
# interleaving puts the drift on every row alike, where row after row puts it on some rows.
HOST_ROUNDS = 3


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="where to write the table (default: the shipped file)")
    parser.add_argument("--quick", action="store_true", help="a coarse grid (a check, not a table)")
    parser.add_argument(
        "--memory_ops_into", metavar="TABLE",
        help="measure only the memory ops' rates and write them into TABLE, an existing table "
        "of this card",
    )  # fmt: skip
    parser.add_argument(
        "--host_into", metavar="TABLE",
        help="measure only the host rows (and a sync's cost) and write them into TABLE, an "
        "existing table of this card",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int,
        help=f"rounds of the host rows' steps, each over every row (default {HOST_ROUNDS})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.memory_ops_into and args.host_into:
        parser.error("--memory_ops_into and --host_into: one part of a table at a time")
    if args.memory_ops_into and args.rounds is not None:
        parser.error("--rounds: the host rows' rounds; --memory_ops_into measures no host rows")
    if (args.memory_ops_into or args.host_into) and (args.out or args.quick):
        parser.error("--memory_ops_into and --host_into write into their TABLE alone: drop "
                     "--out and --quick")  # fmt: skip
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds: one or more")
    args.rounds = args.rounds or HOST_ROUNDS
    return args


if __name__ == "__main__":  # --help answers before torch is imported
    parse()
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from kernel_rates import (  # noqa: E402  (this script's sibling: the kernels' measurements)
    ATTENTION_HEADS,
    ATTENTION_LENGTHS,
    GEMM_SIDES,
    MEMORY_ELEMENTS,
    QUICK_SIDES,
    THIN_BATCHES,
    THIN_LENGTHS,
    attention_rows,
    gemm_rows,
    memory_op_rates,
    memory_rows,
    thin_gemm_rows,
)

TRAINERS = ("standard", "dpsgd", "ghost", "flash")
HOST_STEPS = 15


def sync_us() -> float:
    x = torch.zeros((), device="cuda")
    times = []
    for _ in range(200):
        torch.cuda.synchronize()
        start = time.perf_counter()
        x.item()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _stamp(stamps: dict, name: str) -> None:
    stamps.setdefault(name, time.perf_counter())


def into_table(path: str, key: str, measure, command: str) -> dict | None:
    """Measure one part of the table at ``path``, a table of this card: ``measure(table)``
    writes it in and returns what the record adds; the table says when and how under
    ``measured[key]`` and replaces the file only once it reads back as a card table. None, with
    one error line, for a table that cannot be read (checked before measuring) or another
    card's."""
    from card_tables import write_checked  # this script's sibling: the staged, checked write

    from dp_cost.capacity.card_rates import CardRatesError, read_card
    from dp_cost.measure.run import git_commit

    try:
        card = read_card(path).card
        with open(path) as f:
            table = json.load(f)
    except (CardRatesError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return None
    if card != torch.cuda.get_device_name():
        print(f"error: {path} is {card!r}'s table, this card is "
              f"{torch.cuda.get_device_name()!r}", file=sys.stderr)  # fmt: skip
        return None
    started = time.perf_counter()
    how = measure(table)
    table["measured"][key] = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(ROOT) or "not recorded",
        "torch": torch.__version__,
        **how,
        "seconds": round(time.perf_counter() - started, 1),
        "command": command,
    }
    try:
        write_checked(table, path)
    except CardRatesError as error:
        print(f"error: {error} (the table was left as it was)", file=sys.stderr)
        return None
    return table


def memory_ops_into(path: str) -> int:
    """Measure the memory ops' rates alone (``memory_op_rates``) into the table at ``path``."""

    def measure(table: dict) -> dict:
        table["memory_ops"] = memory_op_rates()
        return {}

    command = f"python benchmarks/card_rates.py --memory_ops_into {path}"
    table = into_table(path, "memory_ops_remeasured", measure, command)
    if table is None:
        return 2
    print(json.dumps({"card": table["card"], "path": path, "memory_ops": table["memory_ops"]}))
    return 0


# The host costs' calibration models: each kind's tiny model at several depths. The host's time
# against the planned ops, fitted by a line, gives what an op costs (its slope) and what a
# chunk's phase costs whatever the depth (its intercept). One depth cannot tell them apart: from
# two blocks alone a 32-block LoRA model's per-op cost came out 1.3-1.7 x too high; two depths
# four blocks apart gave slopes the timing noise moved by tens of percent.
HOST_DEPTHS = (2, 6, 12)
CALIBRATION_MODELS = {
    "lm": {"model": "tiny"},
    "hf": {"model": "tiny-llama"},
    "lora": {"model": "tiny-llama", "use_lora": True, "lora_rank": 8},
}


def calibration_config(trainer: str, model_kind: str, device: str = "cuda"):
    """The host-bound config a trainer's host costs are measured on: ``model_kind``'s
    calibration model (CALIBRATION_MODELS) at (2, 16), bf16 SDPA, fixed batches."""
    from dp_cost.measure.config import ExperimentConfig

    return ExperimentConfig(
        trainer=trainer, batch_size=2, seq_len=16, dtype="bfloat16", attention="sdpa",
        device=device, poisson=False, dataset_size=64, **CALIBRATION_MODELS[model_kind],
    )  # fmt: skip


@contextlib.contextmanager
def depth(config, blocks: int):
    """``config`` with its model ``blocks`` deep (the LM by its override; a Hugging Face
    architecture's config patched while inside: it has no override; one plan at a time in a
    process). benchmarks/depth_fold.py takes any config's model to a depth this way too."""
    from dp_cost.core.hf_architectures import HF_CONFIGS

    if config.model not in HF_CONFIGS:
        yield dataclasses.replace(config, model_overrides={**config.model_overrides,
                                                           "num_layers": blocks})  # fmt: skip
        return
    architecture = HF_CONFIGS[config.model]
    before = architecture["num_hidden_layers"]
    architecture["num_hidden_layers"] = blocks
    try:
        yield config
    finally:
        architecture["num_hidden_layers"] = before


def phased_ops(planned: dict):
    """Each op of a planned step with the phase the time model charges it in."""
    from dp_cost.capacity.step_time import chunk_groups

    chunks, finish = chunk_groups(planned["ops"], planned["marks"])
    for group in [*chunks, finish]:
        yield from group


def planned_op_counts(planned: dict) -> tuple[dict[str, int], int]:
    """(ops of a planned step per phase, its syncs), as the time model charges them at the
    phase's µs an op: syncs and collectives, charged their own costs, apart."""
    from dp_cost.capacity.op_list import COLLECTIVE
    from dp_cost.capacity.step_time import waits_for_gpu

    ops = {"forward": 0, "backward": 0, "finish": 0}
    syncs = 0
    for op, phase in phased_ops(planned):
        if waits_for_gpu(op):
            syncs += 1
        elif op.kind != COLLECTIVE:
            ops[phase] += 1
    return ops, syncs


def host_phase_us(config, sync_cost_us: float, planned: dict | None = None) -> tuple[dict, dict]:
    """(the host's µs in each phase of a chunk of ``config``'s eager step: its forward, its
    backward call, the rest (clipping, noise, optimizer) less its syncs' waits, the median of
    HOST_STEPS steps; the planned step's ops (the same config on fake tensors,
    ``capacity.fake_step``; ``planned`` where planned before, as several ranks' steps are,
    before their process group exists) dispatched in each). Under torchrun, this rank's."""
    from dp_cost.capacity import fake_step
    from dp_cost.capacity.step_time import FINISH
    from dp_cost.measure import worker
    from dp_cost.measure.workload import Workload

    device = torch.device(config.device)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    workload = Workload(config, device, lambda name: None, {}, rank, config.world_size)
    runner = worker.build_trainer(
        config, workload.model, workload.loss_fn, lambda name: None, workload.materialize
    )
    inputs, targets = workload.batch()
    for _ in range(3):
        runner.step(inputs, targets)
    if device.type == "cuda":
        torch.cuda.synchronize()
    planned = planned or fake_step.predict(config, worker.build_trainer, record_ops=True)
    backward_end = planned["marks"][1]  # the phase mark after the backward call
    phase_us: dict[str, list[float]] = {"forward": [], "backward": [], "finish": []}
    for _ in range(HOST_STEPS):
        stamps: dict[str, float] = {}
        with runner.observing_phases(functools.partial(_stamp, stamps)):
            start = time.perf_counter()
            runner.step(inputs, targets)
            end = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
        phase_us["forward"].append((stamps["forward_done"] - start) * 1e6)
        phase_us["backward"].append((stamps[backward_end] - stamps["forward_done"]) * 1e6)
        phase_us["finish"].append((end - stamps[backward_end]) * 1e6)
    ops, syncs = planned_op_counts(planned)
    host = {phase: statistics.median(times) for phase, times in phase_us.items()}
    host[FINISH] -= syncs * sync_cost_us
    return host, ops


def host_rows_by_rounds(
    rows: dict, sync_cost_us: float, rounds: int, depths=HOST_DEPTHS, measure=None
) -> dict[str, dict]:
    """Each row's host costs (``fitted_row``; ``rows``: row name -> its config) at ``depths``,
    from ``rounds`` rounds that each measure every row at every depth in turn (``measure``:
    ``host_phase_us``), each point's host µs the median over the rounds. Each point's step is
    planned once."""
    from dp_cost.capacity import fake_step
    from dp_cost.measure import worker

    measure = measure or host_phase_us
    points = [(name, blocks) for name in rows for blocks in depths]
    planned: dict = {}
    times: dict = {point: [] for point in points}
    ops: dict = {}
    for round_number in range(rounds):
        for name, blocks in points:
            with depth(rows[name], blocks) as config:
                if (name, blocks) not in planned:
                    planned[name, blocks] = fake_step.predict(
                        config, worker.build_trainer, record_ops=True
                    )
                host, ops[name, blocks] = measure(config, sync_cost_us, planned[name, blocks])
            times[name, blocks].append(host)
        if rounds > 1:
            print(f"host rows: round {round_number + 1} of {rounds} done", file=sys.stderr)
    fitted = {
        name: fitted_row({
            blocks: ({phase: statistics.median(host[phase] for host in times[name, blocks])
                      for phase in times[name, blocks][0]}, ops[name, blocks])
            for blocks in depths
        })
        for name in rows
    }  # fmt: skip
    for (name, blocks), step in planned.items():  # the waits taken off, as a recount checks
        fitted[name]["by_depth"][str(blocks)]["syncs"] = planned_op_counts(step)[1]
    return fitted


def calibration_rows() -> dict:
    """Every host row a table has: row name -> its calibration config on this card."""
    from dp_cost.capacity.card_rates import MODEL_KINDS

    return {trainer + suffix: calibration_config(trainer, kind) for kind, suffix in
            MODEL_KINDS.items() for trainer in TRAINERS}  # fmt: skip


def host_into(path: str, rounds: int) -> int:
    """Measure the host rows alone (``host_rows_by_rounds``) and a sync's cost into the table
    at ``path``."""

    def measure(table: dict) -> dict:
        sync_cost_us = round(sync_us(), 3)
        by_trainer = host_rows_by_rounds(calibration_rows(), sync_cost_us, rounds)
        table["host"] = {**table["host"], "sync_us": sync_cost_us, "by_trainer": by_trainer}
        return {"host": platform.processor() or platform.machine(), "rounds": rounds}

    command = f"python benchmarks/card_rates.py --host_into {path} --rounds {rounds}"
    table = into_table(path, "host_remeasured", measure, command)
    if table is None:
        return 2
    print(json.dumps({"card": table["card"], "path": path, "sync_us": table["host"]["sync_us"]}))
    return 0


def host_row(config, depths, sync_cost_us: float) -> dict:
    """``config``'s host row (``fitted_row``) from its eager step's host time at each of
    ``depths``, measured once (``host_rows_by_rounds`` of one row, one round)."""
    return host_rows_by_rounds({"row": config}, sync_cost_us, 1, depths)["row"]


def fitted_row(by_depth: dict[int, tuple[dict, dict]]) -> dict:
    """A table's host row: the fit (``fit_host``) over ``by_depth`` (depth: (host µs, planned
    ops) by phase) and what it was fitted on."""
    from dp_cost.capacity.card_rates import fit_host

    return {
        **fit_host(by_depth),
        "by_depth": {
            str(blocks): {
                "host_us": {phase: round(us, 1) for phase, us in host.items()},
                "planned_ops": ops,
            }
            for blocks, (host, ops) in by_depth.items()
        },
    }


def kernel_rates(quick: bool) -> dict:
    """A table's kernel sections, measured on this card (``--quick``: a coarse grid)."""
    sides = QUICK_SIDES if quick else GEMM_SIDES
    lengths = ATTENTION_LENGTHS[::3] if quick else ATTENTION_LENGTHS
    dtypes = (("bfloat16", torch.bfloat16), ("float32", torch.float32))
    return {
        "gemm": {name: gemm_rows(dtype, sides) for name, dtype in dtypes},
        "thin_gemm": {
            name: thin_gemm_rows(dtype, THIN_BATCHES, THIN_LENGTHS) for name, dtype in dtypes
        },  # fmt: skip
        "attention": {
            name: {str(d): attention_rows(dtype, d, lengths) for d in ATTENTION_HEADS}
            for name, dtype in dtypes
        },
        "memory": memory_rows(MEMORY_ELEMENTS),
        "memory_ops": memory_op_rates(),
    }


def main() -> int:
    args = parse()
    if not torch.cuda.is_available():
        print("error: this measures a CUDA card; none is available", file=sys.stderr)
        return 2
    if args.memory_ops_into:
        return memory_ops_into(args.memory_ops_into)
    if args.host_into:
        return host_into(args.host_into, args.rounds)
    from card_tables import write_checked  # this script's sibling: the staged, checked write

    from dp_cost.capacity.card_rates import CARDS_DIR, SCHEMA, card_file_name
    from dp_cost.measure.run import git_commit

    card = torch.cuda.get_device_name()
    started = time.perf_counter()
    table = {
        "schema": SCHEMA,
        "card": card,
        "measured": {
            "date": datetime.date.today().isoformat(),
            "commit": git_commit(ROOT) or "not recorded",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "host": platform.processor() or platform.machine(),
            "command": "python benchmarks/card_rates.py" + (" --quick" if args.quick else ""),
            "host_rounds": args.rounds,
        },
        **kernel_rates(args.quick),
    }
    sync_cost_us = round(sync_us(), 3)
    by_trainer = host_rows_by_rounds(calibration_rows(), sync_cost_us, args.rounds)
    table["host"] = {"sync_us": sync_cost_us, "by_trainer": by_trainer}
    table["measured"]["seconds"] = round(time.perf_counter() - started, 1)
    path = args.out or os.path.join(CARDS_DIR, card_file_name(card))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_checked(table, path)  # the toolkit reads it back before it replaces the file
    summary = {"card": card, "path": path, "seconds": table["measured"]["seconds"]}
    print(json.dumps({**summary, "host": table["host"], "memory_ops": table["memory_ops"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
