"""A planned step's time on a card: its ops (``capacity.op_list``, recorded on the fake step)
costed from the card's calibration (``capacity.card_rates``) and played through a model of an
eager step, a host that issues ops and a GPU that runs them in order.

Each op costs the host its dispatch (the µs an op of the planned step cost in that phase of a
chunk, forward, backward call or the rest, of the trainer's real eager step on the card, on a
model of its kind: the card's table) and the GPU its kernel, if it has one: a GEMM by its
shape, a fused attention by its FLOPs at its sequence length, anything else by the bytes it
moves. The GPU starts a kernel when the host has issued it and the kernel before it has
finished; a host sync (``.item()``) waits for the GPU. So a step whose kernels are short is
bound by its host, one whose kernels are long by its GPU, and a step that is each in turn is
both, as a trace shows them.

Beside its ops, each chunk's forward and backward call, and the step's finish once, cost the
host what the table's calibration models spent there whatever their depth (the trainer's and
the model's Python around the layers: a chunk's masks, the loss, the optimizer's and the
clipping's book-keeping); a chunk's own finish (Opacus' clipping between chunks, flash's
clipping of all but the last chunk) is charged its ops only. Under CUDA graphs
(``--cuda_graph``) the host issues nothing.

The fake step runs at most three chunks; a logical batch of more runs its other chunks as the
middle one recorded (each chunk ends with a sync: its loss read on the host; the last one
alone syncs DDP's gradients, or FSDP2's held to the last chunk).
"""

from __future__ import annotations

import dataclasses
import math
import os

from dp_cost.capacity.card_rates import CardRates, CardRatesError, card_rates
from dp_cost.capacity.op_list import ATTENTION, COLLECTIVE, GEMM, MEMORY, SYNC, Op
from dp_cost.core.hf_architectures import HF_CONFIGS

CHUNK_END = "backward_done"  # the phase that ends a chunk's backward
# A step whose host is busier than its GPU moves with the host's speed, and hosts of one card
# kind differ: two H200 machines' calibration steps ran 1.15-1.7 x apart per row, and the time
# grid's host-bound steps on four machines came out -24% to +38% against the shipped table
# (whose host rows are the median of two machines'), its GPU-bound ones -18% to +5%
HOST_BOUND_NOTE = (
    "host-bound: such steps came out -24% to +38% against measured ones on four machines of "
    "one card kind (the host's speed differs between machines and runs, and the calibration's "
    "host costs are a median of two machines')"
)
FORWARD, BACKWARD, FINISH = "forward", "backward", "finish"
GATHER = "all_gather"
TIMES = ("step", "host", "gpu", "comm")


def waits_for_gpu(op: Op) -> bool:
    """A host sync the host waits at: it reads a value the GPU computes (a loss's .item()).
    torch.optim reads its step counts with .item() on the fake step's CPU tensors; on CUDA
    they live on the host: no wait."""
    return op.kind == SYNC and not op.optimizer


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Whose step is costed on which card: the card's table, the trainer, whether its step is
    one CUDA graph (the host then issues nothing), the table's kind of model for its host rows,
    and its ranks (distributed mode, number of ranks; one process: ("none", 1))."""

    rates: CardRates
    trainer: str
    graphed: bool = False
    model_kind: str = "lm"
    ranks: tuple[str, int] = ("none", 1)

    def host_us(self, phase: str) -> tuple[float, float]:
        """(µs an op, µs once) of the host in ``phase``, from the trainer's row."""
        return self.rates.host_us(self.trainer, phase, self.model_kind, self.ranks)

    def op(self, op: Op, phase: str) -> tuple[float, float]:
        """(host µs, GPU µs) of one op dispatched in ``phase`` (a collective's: ``collective``)."""
        if self.graphed:
            host = 0.0
        elif op.kind == SYNC:
            host = self.rates.host["sync_us"]
        else:
            host = self.host_us(phase)[0]
        rates = self.rates
        if op.kind == GEMM:  # no kernel moves its bytes faster than a copy does
            return host, max(rates.gemm_us(op.dtype, *op.gemm), rates.memory_us(op.bytes))
        if op.kind == ATTENTION:  # by the op: a checkpointed block's recomputation is a forward
            direction = "backward" if "backward" in op.name else "forward"
            return host, rates.attention_us(op.dtype, direction, op.head_dim, op.seq_len, op.flops)
        if op.kind == MEMORY:
            return host, rates.memory_us(op.bytes, op.name)
        return host, 0.0

    def collective(self, op: Op) -> tuple[float, float]:
        """(host µs, link µs) of a collective over this step's ranks."""
        host, link = self.rates.collective_us(op.collective, op.bytes, self.ranks[1])
        return (0.0 if self.graphed else host), link


def play(
    ops: list[tuple[Op, str]], costs: StepCosts, phases_once: tuple[str, ...] = ()
) -> dict[str, float]:
    """µs of ``ops`` (each with its phase) from an idle host, GPU and link until all are done:
    ``step``, and the host's, the GPU's and the link's busy time (``host``, ``gpu``, ``comm``).
    The host spends each of ``phases_once``'s fixed µs (the table's) before the first op of
    that phase. Collectives run beside the kernels, one at a time (NCCL's stream): a gather
    starts once issued (its input, a parameter's shard, is there) and the kernels after it wait
    for it (in the backward, those after the next gather: FSDP2 issues the next layer's before
    running this one's); a reduction starts once the kernels before it are done (its input is
    theirs) and is waited for by the first op after the backward where the backward issued it
    (DDP's buckets, FSDP2's reduce-scatters), at once where Python did (flash's, Opacus'
    optimizer's); anything outstanding at the end, by the end."""
    host = gpu = comm = gate = host_busy = gpu_busy = comm_busy = 0.0
    prefetched = 0.0  # the end of the backward's last gather, for the layer after it
    in_backward = False  # reductions the backward issued, not yet waited for
    unpaid = set() if costs.graphed else set(phases_once)
    for op, phase in ops:
        if phase in unpaid:
            unpaid.discard(phase)
            fixed_us = costs.host_us(phase)[1]
            host, host_busy = host + fixed_us, host_busy + fixed_us
        if in_backward and not op.backward:  # the backward's end waits for its reductions
            gate, in_backward = max(gate, comm), False
        if op.kind == COLLECTIVE:
            host_us, comm_us = costs.collective(op)
            host, host_busy, comm_busy = host + host_us, host_busy + host_us, comm_busy + comm_us
            gathers = op.collective == GATHER
            comm = max(comm, host if gathers else max(host, gpu)) + comm_us
            if gathers and op.backward:  # FSDP2 gathers the next layer before this one runs
                gate, prefetched = max(gate, prefetched), comm
            elif gathers or not op.backward:
                gate = comm
            else:
                in_backward = True
            continue
        host_us, gpu_us = costs.op(op, phase)
        host_busy += host_us
        if waits_for_gpu(op):  # the host waits for the GPU, then reads the value
            host = max(host, gpu, gate) + host_us
            continue
        host += host_us
        if gpu_us:
            gpu = max(gpu, host, gate) + gpu_us
            gpu_busy += gpu_us
    return {"step": max(host, gpu, comm), "host": host_busy, "gpu": gpu_busy, "comm": comm_busy}


def chunk_groups(
    ops: list[Op], marks: list[str]
) -> tuple[list[list[tuple[Op, str]]], list[tuple[Op, str]]]:
    """(the recorded step's chunks, and its finish: the ops after the last chunk's backward),
    each op with the phase it was dispatched in. A chunk starts where the previous one's
    backward ended; its ops up to the sync that reads the previous chunk's loss are that
    chunk's finish (Opacus clips there), then its ops before its first phase mark its
    forward, those before its second its backward call, the rest (flash's clipping) of the
    finish's kind."""
    ends = [i for i, name in enumerate(marks) if name == CHUNK_END]
    chunks: list[list[tuple[Op, str]]] = [[] for _ in ends]
    finish: list[tuple[Op, str]] = []
    chunk, tail = 0, False
    for op in ops:
        # op.segment marks came before it: it is past chunk c's end once op.segment > ends[c]
        while chunk < len(ends) and op.segment > ends[chunk]:
            chunk, tail = chunk + 1, True
        if chunk == len(ends):
            finish.append((op, FINISH))
            continue
        position = op.segment - (ends[chunk - 1] + 1 if chunk else 0)
        phase = (FORWARD, BACKWARD)[position] if position < 2 else FINISH
        chunks[chunk].append((op, FINISH if tail and position == 0 else phase))
        tail = tail and not waits_for_gpu(op)
    return chunks, finish


def predicted_time(
    ops: list[Op], marks: list[str], costs: StepCosts, chunk_count: int
) -> dict[str, float]:
    """ms of one logical batch of ``chunk_count`` chunks, on rank 0 where there are several
    (``step_ms``; ``host_ms``, ``gpu_ms``, ``comm_ms``: each one's busy time), from the
    recorded step's ops."""
    chunks, finish = chunk_groups(ops, marks)
    played = [
        play(group, costs, phases)
        for group, phases in [*((c, (FORWARD, BACKWARD)) for c in chunks), (finish, (FINISH,))]
    ]
    total = logical_batch(played, len(chunks), chunk_count)
    return {f"{key}_ms": value / 1e3 for key, value in total.items()}


def logical_batch(
    per_group: list[dict[str, float]], recorded: int, chunk_count: int
) -> dict[str, float]:
    """The sums of ``per_group`` (the ``recorded`` chunks' numbers, then the finish's) over a
    logical batch of ``chunk_count`` chunks: each chunk beyond the recorded ones as a middle
    one (no sync of DDP's or FSDP2's logical one), the second recorded, a middle one of three."""
    total = {key: sum(group[key] for group in per_group) for key in per_group[0]}
    extra = max(chunk_count - recorded, 0)
    if recorded and extra:
        middle = per_group[min(1, recorded - 1)]
        for key in total:
            total[key] += extra * middle[key]
    return total


def chunk_count(samples: int, physical: int) -> int:
    """How many chunks a rank's ``samples`` run as, at most ``physical`` each."""
    return max(math.ceil(samples / max(physical, 1)), 1)


def model_kind(config) -> str:
    """Which of the table's host rows describes ``config``'s model (card_rates.MODEL_KINDS)."""
    if config.use_lora:
        return "lora"
    return "hf" if config.model in HF_CONFIGS else "lm"


def config_time(config, step: dict, rates: CardRates, chunks: int) -> dict[str, float]:
    """``predicted_time`` of ``config``'s planned ``step`` (its ``ops`` and ``marks``) in
    ``chunks`` chunks on ``rates``' card, as the config's trainer, model, graphs and ranks run
    it."""
    return predicted_time(step["ops"], step["marks"], step_costs(config, rates), chunks)


def step_costs(config, rates: CardRates) -> StepCosts:
    """``config``'s step on ``rates``' card, as its trainer, model, graphs and ranks run it."""
    return StepCosts(
        rates, config.trainer, bool(config.cuda_graph), model_kind(config),
        (config.distributed, config.world_size),
    )  # fmt: skip


def planned_time(config, step: dict, physical: int, samples: int) -> dict:
    """``prediction["time"]``: the step of ``config`` at physical batch ``physical``, ``samples``
    on rank 0, on ``config.card``: ms, samples and tokens a second, and with ``--epochs`` the
    fine-tune's wall time and GPU-hours; ``step_ms`` None with ``why`` where it is not
    predicted."""
    try:
        rates = card_rates(config.card)
    except CardRatesError as error:  # the memory plan stands without its time
        return {"card": config.card, "step_ms": None, "why": str(error)}
    time = {"card": rates.card, "calibration": os.path.basename(rates.path), **rates.measured}
    if config.world_size > 1 and config.world_size not in rates.collective_ranks():
        measured = ", ".join(map(str, rates.collective_ranks())) or "none"
        why = (f"no calibration of {config.world_size} ranks' collectives on {rates.card} "
               f"(ranks measured: {measured})")  # fmt: skip
        return {**time, "step_ms": None, "why": why}
    chunks = chunk_count(samples, physical)
    graphed = bool(config.cuda_graph)
    times = config_time(config, step, rates, chunks)
    seconds = times["step_ms"] / 1e3
    time.update(times, physical_batch_size=physical, chunks=chunks, graphed=graphed)
    busiest = max(("host", "gpu", "comm"), key=lambda side: times[f"{side}_ms"])
    time["bound_by"] = {"comm": "communication"}.get(busiest, busiest)
    time["bound_note"] = HOST_BOUND_NOTE if time["bound_by"] == "host" else None
    time["samples_per_s"] = config.batch_size / seconds
    time["tokens_per_s"] = config.batch_size * config.seq_len / seconds
    if config.epochs:
        steps = math.ceil(config.dataset_size / config.batch_size) * config.epochs
        time["fine_tune"] = {
            "dataset_size": config.dataset_size,
            "epochs": config.epochs,
            "steps": steps,
            "wall_hours": steps * seconds / 3600,
            "gpu_hours": steps * seconds * config.world_size / 3600,
        }
    return time
