"""Measure the collectives of this host's ranks for --mode=capacity's time model and write them
into the card's table (dp_cost/capacity/cards/<card>.json, under "collectives" by the number of
ranks): per collective (all_reduce, reduce_scatter, all_gather, broadcast), the GPU µs of one
call by the bytes of its whole (unsharded) tensor, and the host µs a call costs to issue; and
each trainer's host costs under DDP and FSDP2 (``host_by_trainer``, rows "flash@fsdp"), fitted
as benchmarks/card_rates.py fits one process's, on the tiny LM at its depths (host-bound: what
the hooks of DDP and FSDP2 add per layer is in them).

Run under torchrun, one rank per GPU (NCCL); rank 0 writes. Each size is timed on the GPU alone:
every rank queues its calls behind a spin kernel (``torch.cuda._sleep``) and one call that
lines the ranks up, so the events around the timed calls see no host launch gaps. On the CPU
(``--device cpu``, gloo) it checks itself: the same table, host clocks, nothing written to the
shipped table unless ``--out`` names it.
Usage: torchrun --nproc_per_node GPUS benchmarks/collective_rates.py [--out PATH] [--quick]
(--quick: two sizes, the standard trainer's host rows at two small depths: a check)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [2**e for e in range(10, 31, 2)]  # 1 KiB .. 1 GiB of the whole tensor
QUICK_SIZES = [2**10, 2**20]
QUICK_DEPTHS = (1, 2)
HOST_CALLS = 50  # calls timed on the host per collective (1 KiB each)
SPIN_CYCLES = 20_000_000  # about 10 ms of one SM spinning: longer than queueing the timed calls


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the card table to write into (default: the shipped one)")
    parser.add_argument("--quick", action="store_true", help="two sizes (a check, not a table)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    return parser.parse_args(argv)


if __name__ == "__main__":  # --help answers before torch is imported
    parse()
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dp_cost.capacity.card_rates import COLLECTIVE_KINDS  # noqa: E402


def call(name: str, whole: torch.Tensor, shard: torch.Tensor):
    """One ``name`` collective of the ``whole`` tensor (this rank's ``shard`` of it for the
    sharding ones), as FSDP2, DDP and our trainers issue them (synchronous)."""
    if name == "all_reduce":
        dist.all_reduce(whole)
    elif name == "reduce_scatter":
        dist.reduce_scatter_tensor(shard, whole)
    elif name == "all_gather":
        dist.all_gather_into_tensor(whole, shard)
    else:
        dist.broadcast(whole, src=0)


def tensors(size_bytes: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole tensor of ``size_bytes`` (fp32, rounded to the ranks) and a rank's shard's room."""
    world = dist.get_world_size()
    elements = max(size_bytes // 4 // world, 1) * world
    whole = torch.ones(elements, device=device)
    return whole, torch.empty(elements // world, device=device)


def gpu_us(name: str, size_bytes: int, calls: int) -> float:
    """µs of one call on the GPU: ``calls`` back to back, queued behind a spin kernel."""
    whole, shard = tensors(size_bytes, "cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda._sleep(SPIN_CYCLES)
    call(name, whole, shard)  # lines the ranks up: each waits for the others here
    start.record()
    for _ in range(calls):
        call(name, whole, shard)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def cpu_us(name: str, size_bytes: int, calls: int) -> float:
    """µs of one call on gloo's CPU ranks (the check's clock: the host's)."""
    whole, shard = tensors(size_bytes, "cpu")
    dist.barrier()
    started = time.perf_counter()
    for _ in range(calls):
        call(name, whole, shard)
    return (time.perf_counter() - started) * 1e6 / calls


def agreed(calls: int, device: str) -> int:
    """The most calls any rank asks for: every rank must make the same calls, or they hang."""
    count = torch.tensor([calls], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def rows(name: str, sizes: list[int], device: str) -> list[list]:
    """[bytes, µs] of ``name`` at each size: the median of three timings of enough calls to make
    about 2 ms (at least 3, at most 50)."""
    timed = gpu_us if device == "cuda" else cpu_us
    table = []
    for size in sizes:
        calls = agreed(max(3, min(50, int(2000 / max(timed(name, size, 1), 1.0)))), device)
        table.append(
            [size, round(statistics.median(timed(name, size, calls) for _ in range(3)), 3)]
        )
    return table


def host_us(name: str, device: str) -> float:
    """µs the host spends issuing one call of 1 KiB (the GPU keeps up: it is not waited for)."""
    whole, shard = tensors(1024, device)
    for _ in range(5):
        call(name, whole, shard)
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(HOST_CALLS):
        call(name, whole, shard)
    seconds = time.perf_counter() - started
    if device == "cuda":
        torch.cuda.synchronize()
    return seconds * 1e6 / HOST_CALLS


def host_configs(args, world_size: int) -> dict:
    """{(mode, trainer, depth): (config, its planned step)}: every trainer under DDP and FSDP2
    on the calibration LM at each depth, a rank's batch as one process's. Planned before the
    process group exists (the plan makes its own, a fake one)."""
    from dp_cost.capacity import fake_step
    from dp_cost.measure import worker

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import card_rates as calibration

    depths = QUICK_DEPTHS if args.quick else calibration.HOST_DEPTHS
    planned = {}
    for mode, trainer in ranked_trainers(args.quick):
        base = calibration.calibration_config(trainer, "lm", args.device)
        base = dataclasses.replace(
            base, distributed=mode, world_size=world_size, batch_size=base.batch_size * world_size
        )
        for blocks in depths:
            with calibration.depth(base, blocks) as config:
                step = fake_step.predict(config, worker.build_trainer, record_ops=True)
                planned[mode, trainer, blocks] = config, step
    return planned


def ranked_trainers(quick: bool) -> list[tuple[str, str]]:
    """(distributed mode, trainer) of every trainer each mode over ranks can run (dpsgd has no
    FSDP2 path): the registry's refusals, at the calibration config's settings; ``quick``: the
    standard trainer alone."""
    from dp_cost.measure.config import ExperimentConfig
    from dp_cost.parallel.mode import sharded_modes
    from dp_cost.training import registry

    defaults = ExperimentConfig(trainer="standard", batch_size=2, seq_len=16)
    return [
        (mode, trainer)
        for mode in sharded_modes()
        for trainer in (["standard"] if quick else registry.TRAINERS)
        if registry.refusal(trainer, mode, False, False, defaults.fsdp_sync, defaults.clipping)
        is None
    ]


def host_rows(planned: dict, sync_cost_us: float, collective_host_us: dict) -> dict:
    """Each (trainer, mode)'s host costs fitted over its depths (``fit_host``), as
    benchmarks/card_rates.py's one-process rows, and what they were fitted on: each phase's
    host time less its collectives' issue (the time model charges each collective its own
    ``collective_host_us``), its planned ops without them."""
    import card_rates as calibration

    by_row: dict[str, dict] = {}
    for (mode, trainer, blocks), (config, step) in planned.items():
        host, ops = calibration.host_phase_us(config, sync_cost_us, step)
        for phase, issued_us in collectives_host_us(step, collective_host_us).items():
            host[phase] -= issued_us
        by_row.setdefault(f"{trainer}@{mode}", {})[blocks] = host, ops
    return {row: calibration.fitted_row(by_depth) for row, by_depth in by_row.items()}


def collectives_host_us(step: dict, collective_host_us: dict) -> dict[str, float]:
    """µs the host spends issuing a planned step's collectives, by phase."""
    import card_rates as calibration

    from dp_cost.capacity.op_list import COLLECTIVE

    issued = {"forward": 0.0, "backward": 0.0, "finish": 0.0}
    for op, phase in calibration.phased_ops(step):
        if op.kind == COLLECTIVE:
            issued[phase] += collective_host_us[op.collective]
    return issued


def measured(args, planned: dict, sync_cost_us: float) -> dict:
    """This host's collectives' section of the card table."""
    from dp_cost.measure.run import git_commit

    sizes = QUICK_SIZES if args.quick else SIZES
    started = time.perf_counter()
    section = {
        "gpu_us": {name: rows(name, sizes, args.device) for name in sorted(COLLECTIVE_KINDS)},
        "host_us": {
            name: round(host_us(name, args.device), 3) for name in sorted(COLLECTIVE_KINDS)
        },
    }
    section["host_by_trainer"] = host_rows(planned, sync_cost_us, section["host_us"])
    section["measured"] = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(ROOT) or "not recorded",
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None,
        "backend": dist.get_backend(),
        "command": "torchrun --nproc_per_node GPUS benchmarks/collective_rates.py"
        + (" --quick" if args.quick else ""),
        "seconds": round(time.perf_counter() - started, 1),
    }
    return section


def write(path: str, section: dict, world_size: int) -> None:
    """``section`` into the card table at ``path`` under collectives[world_size], the rest kept."""
    with open(path) as f:
        table = json.load(f)
    table.setdefault("collectives", {})[str(world_size)] = section
    temporary = path + ".part"
    with open(temporary, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(temporary, path)


def main() -> int:
    args = parse()
    if "RANK" not in os.environ:
        print("error: run it under torchrun, one rank per GPU", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: this measures CUDA cards; none is available", file=sys.stderr)
        return 2
    from dp_cost.capacity.card_rates import CARDS_DIR, CardRatesError, card_file_name, load_card

    if args.quick and args.device == "cuda" and not args.out:
        print("error: --quick is a check, not a table: give --out PATH", file=sys.stderr)
        return 2
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        path = args.out or os.path.join(CARDS_DIR, card_file_name(torch.cuda.get_device_name()))
    else:
        path = args.out
    # a host sync's cost: the one-process calibration's, in the table written into
    try:
        sync_cost_us = load_card(path).host["sync_us"] if path else 0.0
    except CardRatesError as error:  # the one-process table comes first: card_rates.py
        if os.environ["RANK"] == "0":  # every rank fails here; one line says why
            print(f"error: {error} (measure it first: benchmarks/card_rates.py)", file=sys.stderr)
        return 2
    planned = host_configs(args, int(os.environ["WORLD_SIZE"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        section = measured(args, planned, sync_cost_us)
        world_size, rank = dist.get_world_size(), dist.get_rank()
    finally:
        dist.destroy_process_group()
    if rank:
        return 0
    if not path:
        print(json.dumps(section))
        return 0
    write(path, section, world_size)
    load_card.cache_clear()
    load_card(path)  # the toolkit reads it back
    print(json.dumps({"path": path, "world_size": world_size, **section}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
