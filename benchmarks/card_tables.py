"""Card tables (what benchmarks/card_rates.py measures) reworked without a GPU:

- refit TABLE [--out PATH]: the host costs fitted again (capacity.card_rates.fit_host) from the
  host times the table keeps by depth, after a change to the fit.
- recount TABLE [--out PATH]: each calibration step's planned ops counted again with today's
  planner (its host times kept as measured), then fitted: after a change to what a planned step
  dispatches (an op planned as CUDA runs it), the rows describe the steps they are charged to.
  The syncs and collectives a step waits for must be the ones it measured (their time was taken
  off its host time then); a change to those needs the table measured again.
- median TABLE TABLE [TABLE ...] --out PATH: one table from several machines' tables of one card
  kind: each calibration step's host time the median over the machines, then fitted. The host's
  speed differs between machines of one kind (three H200 machines' calibration steps ran up to
  2 x apart per op), so one machine's table is one host's; the median is a typical one. The
  kernel rates (GEMM, attention, memory) are the first table's: they differ far less.

Either writes the table only once it reads back as a card table.
usage: python benchmarks/card_tables.py refit TABLE [--out PATH]
       python benchmarks/card_tables.py recount TABLE [--out PATH]
       python benchmarks/card_tables.py median TABLE TABLE [TABLE ...] --out PATH
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    refit = commands.add_parser("refit", help="fit a table's host costs again")
    refit.add_argument("table")
    refit.add_argument("--out", help="where to write it (default: over TABLE)")
    recount = commands.add_parser("recount", help="count a table's planned ops again, then fit")
    recount.add_argument("table")
    recount.add_argument("--out", help="where to write it (default: over TABLE)")
    median = commands.add_parser("median", help="one table from several machines' tables")
    median.add_argument("tables", nargs="+")
    median.add_argument("--out", required=True, help="where to write it")
    return parser.parse_args(argv)


def read(path: str) -> dict:
    from dp_cost.core.reading import read_json

    return read_json(path)


def host_rows(table: dict):
    """(world size, row name, row) of every host row: one process's (world size 1), then each
    number of ranks' (``trainer@mode``)."""
    for name, row in table["host"]["by_trainer"].items():
        yield 1, name, row
    for world_size, section in table.get("collectives", {}).items():
        for name, row in section.get("host_by_trainer", {}).items():
            yield int(world_size), name, row


def fitted(table: dict, how: dict, key: str = "host_refitted") -> dict:
    """``table`` with every host row fitted from its ``by_depth``, and ``how`` it was made."""
    from dp_cost.capacity.card_rates import fit_host
    from dp_cost.measure.run import git_commit

    table["measured"][key] = {"commit": git_commit(ROOT) or "not recorded", **how}
    for _, _, row in host_rows(table):
        points = {int(blocks): (measured["host_us"], measured["planned_ops"])
                  for blocks, measured in row["by_depth"].items()}  # fmt: skip
        row.update(fit_host(points))
    return table


def calibration_step(world_size: int, name: str, blocks: int) -> dict:
    """The planned step (ops recorded) of the calibration config a host row was measured on:
    benchmarks/card_rates.py's for one process, benchmarks/collective_rates.py's under ranks (a
    rank's batch as one process's, in a fake process group)."""
    import card_rates as calibration

    from dp_cost.capacity import fake_step
    from dp_cost.capacity.card_rates import MODEL_KINDS
    from dp_cost.measure import worker

    base, _, mode = name.partition("@")
    trainer, plus, kind = base.partition("+")
    model_kind = {suffix: kind for kind, suffix in MODEL_KINDS.items()}[plus + kind]
    config = calibration.calibration_config(trainer, model_kind, "cpu")
    if mode:
        config = dataclasses.replace(config, distributed=mode, world_size=world_size,
                                     batch_size=config.batch_size * world_size)  # fmt: skip
    with calibration.depth(config, blocks) as config:
        return fake_step.predict(config, worker.build_trainer, record_ops=True)


def recounted(table: dict) -> dict:
    """``table`` with each host row's planned ops at each depth counted again, host times kept.
    The syncs a step waits for are recorded beside its counts: their waits were taken off its
    host time when it was measured, so a recount that finds another number than one recorded
    refuses (ValueError): the table must be measured again."""
    import card_rates as calibration

    for world_size, name, row in host_rows(table):
        for blocks, measured in row["by_depth"].items():
            try:
                step = calibration_step(world_size, name, int(blocks))
            except (KeyError, ValueError, RuntimeError) as error:
                raise ValueError(f"row {name!r} at {blocks} blocks: {error}") from error
            ops, syncs = calibration.planned_op_counts(step)
            if measured.get("syncs", syncs) != syncs:
                raise ValueError(
                    f"row {name!r} at {blocks} blocks now waits for {syncs} syncs, "
                    f"{measured['syncs']} when counted before: measure the table again"
                )
            measured["planned_ops"], measured["syncs"] = ops, syncs
    return table


def median_of(tables: list[dict]) -> dict:
    """The first table, its host times by depth (and its sync's cost) the medians over
    ``tables``, which must have planned the same steps: the same card, rows, depths and ops."""
    first = tables[0]
    merged = copy.deepcopy(first)
    for other in tables[1:]:
        if other["card"] != first["card"]:
            raise ValueError(f"tables of {first['card']!r} and {other['card']!r}")
        for name, row in first["host"]["by_trainer"].items():
            theirs = other["host"]["by_trainer"].get(name, {}).get("by_depth", {})
            for blocks, measured in row["by_depth"].items():
                if theirs.get(blocks, {}).get("planned_ops") != measured["planned_ops"]:
                    raise ValueError(f"{name} at {blocks} blocks: other planned ops (or none)")
    host = merged["host"]
    host["sync_us"] = statistics.median(t["host"]["sync_us"] for t in tables)
    for name, row in host["by_trainer"].items():
        for blocks, measured in row["by_depth"].items():
            measured["host_us"] = {
                phase: round(statistics.median(
                    t["host"]["by_trainer"][name]["by_depth"][blocks]["host_us"][phase]
                    for t in tables
                ), 1)
                for phase in measured["host_us"]
            }  # fmt: skip
    merged["measured"]["host_median_of"] = [t["measured"] for t in tables]
    return merged


def write_checked(table: dict, target: str) -> None:
    """Write ``table`` to ``target`` once it reads back as a card table (CardRatesError if not:
    nothing replaced)."""
    from dp_cost.capacity.card_rates import CardRatesError, read_card

    staged = target + ".staged"
    with open(staged, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    try:
        read_card(staged)  # read now: a table staged here before may have been another
    except CardRatesError:
        os.remove(staged)
        raise
    os.replace(staged, target)


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # card_rates: the calibration steps
    from dp_cost.capacity.card_rates import CardRatesError

    try:
        if args.command == "median":
            command = "python benchmarks/card_tables.py median TABLE ..."
            table = fitted(median_of([read(p) for p in args.tables]), {"command": command})
            target = args.out
        else:
            command = f"python benchmarks/card_tables.py {args.command} TABLE"
            table, target = read(args.table), args.out or args.table
            if args.command == "recount":
                import torch

                measured_with = table.get("measured", {}).get("torch")
                if measured_with and measured_with != torch.__version__:
                    print(f"warning: recount: counted with torch {torch.__version__}, the host "
                          f"times measured with {measured_with}: a few ops a step may differ "
                          "between versions", file=sys.stderr)  # fmt: skip
                how = {"command": command, "torch": torch.__version__}
                table = fitted(recounted(table), how, "host_recounted")
            else:
                table = fitted(table, {"command": command})
        write_checked(table, target)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CardRatesError) as error:
        print(f"error: {args.command}: {' '.join(str(error).split())[:300]}", file=sys.stderr)
        return 2
    print(json.dumps({"written": target, "host": table["host"]["by_trainer"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
