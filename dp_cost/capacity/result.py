"""--mode=capacity: the largest physical batch that fits a card, from the predicted peak of
each physical batch (``capacity.fake_step``: the config's step on fake tensors, no GPU), and
--find_max_batch, the largest one that runs, found by runs; --find_max_seq_len, the same for
the sequence length at the planned physical batch.

What the fake step does not see is the CUDA side: the cuBLAS workspaces, the CUDA context and
NCCL's buffers (``GPU_OVERHEADS``: measured, with the card and the scripts that measured them),
and the caching allocator, whose rules ``capacity.allocator`` replays over the step's requests:
a physical batch fits when every request finds a place on the card.
"""

from __future__ import annotations

import dataclasses
import time

from dp_cost.capacity import allocator
from dp_cost.capacity.fake_step import predict, rank_share
from dp_cost.capacity.model_facts import model_max_seq_len
from dp_cost.core.schema import MB
from dp_cost.hf.configs import HF_CONFIGS
from dp_cost.measure.plan import SEQ_LEN_STEP, draw_above_probability
from dp_cost.parallel.ranks import share

GIB = 2**30

# What a CUDA process holds beside the step's own tensors, measured on an H200 with torch 2.11
# (benchmarks/README.md, "Will it fit?"): the cuBLAS workspaces a forward and a backward matmul
# allocate through the caching allocator (benchmarks/cuda_overheads.py) and the CUDA context and
# libraries (outside torch's counters; the same script), and with several ranks NCCL's buffers
# (outside torch's counters too: the same script under torchrun, 2 ranks over NVLink with
# NCCL_NVLS_ENABLE=0, after an all-reduce, an all-gather and a reduce-scatter; NVLink SHARP,
# NCCL's default on NVSwitch hosts, and more ranks can take more). What the allocator's
# fragmentation takes is not a margin: ``capacity.allocator`` replays the step's requests.
GPU_OVERHEADS = {
    "cublas_workspace_bytes": 64 * MB,  # two of 32 MiB (Hopper): forward and backward thread
    "cuda_context_bytes": 785_186_816,  # about 749 MiB
    "nccl_buffers_bytes": 878_706_688,  # about 838 MiB a rank, 2 x H200 over NVLink
    "measured_on": "NVIDIA H200, torch 2.11.0+cu130, NCCL 2.28.3, 2026-11-27",
}
POISSON_QUANTILE = 1e-6  # an uncapped Poisson batch is planned at its 1 - 1e-6 quantile
MAX_PROBES = 64  # a guard: galloping and bisecting take about 2 log2(|guess - answer|)


def planned_physical_batch(config) -> tuple[int, str | None]:
    """The physical batch (per rank) a config's peak is planned at, and why when it is not the
    asked one: a Poisson-sampled batch without a physical cap runs whole, as large as it is
    drawn (each rank its share of the draw; rank 0 the largest)."""
    physical = config.physical_batch_size
    if config.model not in HF_CONFIGS or not config.poisson or config.max_physical_batch_size:
        return physical, None
    drawn = config.batch_size
    while draw_above_probability(drawn, config.batch_size, config.dataset_size) > POISSON_QUANTILE:
        drawn += 1
    mine = len(share(drawn, 0, config.world_size))
    note = (
        f"Poisson sampling without --max_physical_batch_size: planned at {drawn} samples"
        f"{f' ({mine} on rank 0)' if mine != drawn else ''}, the draw exceeded with probability "
        f"{POISSON_QUANTILE:g} at batch {config.batch_size} of {config.dataset_size}"
    )
    return mine, note


def with_physical_batch(config, physical: int):
    """``config`` at physical batch ``physical`` (per rank): one chunk of ``physical`` samples
    on each rank when that is at least a rank's share of the logical batch (which is raised to
    it), else chunks of it."""
    batch = max(config.batch_size, physical * config.world_size)
    return dataclasses.replace(config, batch_size=batch, max_physical_batch_size=physical)


def allocator_room_bytes(budget_gib: float, world_size: int = 1) -> int:
    """What torch's caching allocator can reserve on a card of ``budget_gib`` GiB: the card
    less the CUDA context, and NCCL's buffers when there are several ranks."""
    nccl = GPU_OVERHEADS["nccl_buffers_bytes"] if world_size > 1 else 0
    return int(budget_gib * GIB) - GPU_OVERHEADS["cuda_context_bytes"] - nccl


def planned_requests(prediction: dict) -> list[tuple[int, int]]:
    """The requests the caching allocator gets: the fake step's (the model and trainer built,
    a warm-up step, the recorded step), with the two cuBLAS workspaces the warm-up's first
    forward and backward matmul allocate (negative keys: no storage has them)."""
    workspace = GPU_OVERHEADS["cublas_workspace_bytes"] // 2
    return [*prediction["requests"], (-1, workspace), (-2, workspace), *prediction["step_requests"]]


def reserved_peak(prediction: dict) -> int:
    """The most the caching allocator would reserve for the step on an unlimited card."""
    return allocator.replay(planned_requests(prediction)).peak_reserved_bytes


def fits(prediction: dict, budget_gib: float, world_size: int = 1) -> bool:
    """The step runs on the card: the allocator places every request within its room (returning
    its wholly free segments to the card first where it must, as torch's does)."""
    room = allocator_room_bytes(budget_gib, world_size)
    return not allocator.replay(planned_requests(prediction), room).out_of_memory


def largest_passing(passes, first_guess: int) -> tuple[int, list[int]]:
    """(the largest physical batch P >= 1 with ``passes(P)``, 0 if not even 1 passes; the
    batches judged, in order). ``passes`` is monotone: true up to some P, false above. From
    ``first_guess`` it gallops up or down until it brackets the answer, then bisects: about
    2 log2(|guess - answer|) + 2 judgements, 2 when the guess is right."""
    judged: list[int] = []

    def judge(physical):
        judged.append(physical)
        return passes(physical)

    guess, step = max(1, first_guess), 1
    low, high = 0, None  # low passes (0: none known to); high does not
    if judge(guess):
        low = guess
        while high is None and len(judged) < MAX_PROBES:
            if judge(low + step):
                low, step = low + step, step * 2
            else:
                high = low + step
    else:
        high = guess
        while low == 0 and high > 1 and len(judged) < MAX_PROBES:
            candidate = max(1, high - step)
            if judge(candidate):
                low = candidate
            else:
                high, step = candidate, step * 2
    while high is not None and high - low > 1 and len(judged) < MAX_PROBES:
        middle = (low + high) // 2
        low, high = (middle, high) if judge(middle) else (low, middle)
    return low, judged


def largest_physical(passes, first_guess: int, batch: int) -> tuple[int, list[int]]:
    """``largest_passing`` over a config's physical batches, in two monotone pieces: at or above
    the logical batch ``batch`` the step is one chunk; below it, chunks whose gradients add up
    (a peak above the one-chunk step's at ``batch``). A guess at or above ``batch`` searches the
    upper piece first (no extra judgement when the answer is there)."""
    judged: list[int] = []

    def judge(physical):
        judged.append(physical)
        return passes(physical)

    if first_guess >= batch or judge(batch):
        start = max(first_guess, batch) - batch + 1
        found, _ = largest_passing(lambda p: judge(batch - 1 + p), start)
        if found:
            return batch - 1 + found, judged
    found, _ = largest_passing(lambda p: p < batch and judge(p), min(first_guess, batch - 1))
    return found, judged


def probe_config(config, physical: int, seq_len: int | None = None):
    """A --find_max_batch / --find_max_seq_len probe: ``config`` measured at physical batch
    ``physical`` (and ``seq_len``: the config's by default), two steps after one warm-up, no
    trace, no breakdown. Its batches have a fixed size: a Poisson draw below ``physical`` would
    run a smaller chunk, and the probe would pass by chance."""
    at_seq_len = dataclasses.replace(config, seq_len=seq_len or config.seq_len)
    return dataclasses.replace(
        with_physical_batch(at_seq_len, physical),
        capacity=False, validate=False, find_max_batch=False, find_max_seq_len=False, trace=False,
        breakdown=False, steps=2, warmup_steps=1, poisson=False,
    )  # fmt: skip


def _search_by_runs(search, run_probe, probe_of, name_of, searched: str, found: str, predictions):
    """A search's result entry: every probe, under ``found`` the value ``search(runs)`` settles
    on (None, with the ``error``, after a probe that failed for another reason than memory), and
    there the measured peak and the predicted one (from ``predictions``). ``runs(value)``:
    whether the probe ``probe_of(value)``, run by ``run_probe`` into ``name_of(value)``, ran."""
    probes: list[dict] = []

    def runs(value: int) -> bool:
        probed = run_probe(probe_of(value), name_of(value))
        probes.append(
            {
                searched: value,
                "status": probed["status"],
                "peak_memory_mb": probed.get("peak_memory_mb"),
                "error": probed.get("error"),
            }
        )
        if probed["status"] not in ("ok", "oom"):  # not a question of memory: stop here
            what = searched.replace("_", " ").replace("size", "").strip()
            raise ProbeFailed(f"probe at {what} {value}: {probed.get('error')}")
        return probed["status"] == "ok"

    try:
        value = search(runs)
    except ProbeFailed as error:
        return {"probes": probes, found: None, "error": str(error)}
    return {
        "probes": probes,
        found: value,
        "measured_peak_mb": _peak_at(probes, searched, value),
        "predicted_peak_mb": _peak_at(predictions, searched, value),
    }


def _peak_at(points: list[dict], searched: str, value) -> float | None:
    return next((p["peak_memory_mb"] for p in points if p[searched] == value), None)


def find_max_batch(config, prediction: dict, run_probe) -> dict:
    """--find_max_batch: the largest physical batch that runs on this card, found by runs.
    ``run_probe(probe_config, name)`` runs one probe in its own worker (an out-of-memory stays
    there) and returns its result. The search starts at the predicted largest batch for the
    card's whole memory, and records every probe."""
    predicted = prediction["card"]["physical_batch_size"]
    searched = _search_by_runs(
        lambda runs: largest_physical(runs, predicted, rank_share(config))[0],
        run_probe,
        lambda physical: probe_config(config, physical),
        lambda physical: f"probe_pb{physical}.json",
        "physical_batch_size",
        "largest_physical_batch",
        prediction["predictions"],
    )
    return {"predicted_largest": predicted, **searched}


def find_max_seq_len(config, prediction: dict, run_probe) -> dict:
    """--find_max_seq_len: the longest sequence (a multiple of SEQ_LEN_STEP tokens, at most the
    model's) that runs on this card at the config's physical batch, found by runs from the
    predicted longest, as find_max_batch searches the batch."""
    predicted = prediction["card"]["seq_len"]
    physical = prediction["physical_batch_size"]
    limit = longest_model_seq_len(config) // SEQ_LEN_STEP
    searched = _search_by_runs(
        lambda runs: SEQ_LEN_STEP * largest_passing(
            lambda steps: steps <= limit and runs(steps * SEQ_LEN_STEP),
            max(1, predicted // SEQ_LEN_STEP),
        )[0],
        run_probe,
        lambda seq_len: probe_config(config, physical, seq_len),
        lambda seq_len: f"probe_seq{seq_len}.json",
        "seq_len",
        "longest_seq_len",
        prediction["seq_len_predictions"],
    )  # fmt: skip
    return {"predicted_longest": predicted, **searched}


def longest_model_seq_len(config) -> int:
    return model_max_seq_len(config.model, config.attention, config.model_overrides)


@dataclasses.dataclass(frozen=True)
class Search:
    """A search by runs: ``run(config, prediction, run_probe)`` gives the result's entry under
    the setting's name; ``found`` / ``probed`` are the keys of its answer and of a probe's value."""

    goal: str  # what it searches, in words
    words: str  # what it finds, as a run's messages say it
    found: str
    probed: str
    run: object


SEARCHES = {  # the setting (and result key) -> its search
    "find_max_batch": Search(
        "largest physical batch",
        "physical batch",
        "largest_physical_batch",
        "physical_batch_size",
        find_max_batch,
    ),
    "find_max_seq_len": Search(
        "longest sequence", "sequence length", "longest_seq_len", "seq_len", find_max_seq_len
    ),
}


class ProbeFailed(RuntimeError):
    """A --find_max_batch or --find_max_seq_len probe ended in an error that is not an
    out-of-memory."""


def capacity_result(config, build_trainer, card_gib: float | None = None) -> dict:
    """``result["prediction"]`` of one config: its predicted peak (what torch would count for
    the step's own tensors) and roles at the planned physical batch, and for each
    ``--gpu_memory`` budget the largest physical batch that fits, with every prediction made.
    ``card_gib``: this process's card, searched as one more budget: for the largest physical
    batch (--find_max_batch), or the longest sequence at the planned one (--find_max_seq_len)."""
    started = time.perf_counter()
    planned, note = planned_physical_batch(config)
    ranks = config.world_size
    steps: dict[tuple[int, int], dict] = {}  # (physical batch, sequence length) -> prediction
    seq_lens_searched: set[int] = set()

    def predicted(physical: int, seq_len: int = config.seq_len) -> dict:
        if (physical, seq_len) not in steps:
            at_seq_len = dataclasses.replace(config, seq_len=seq_len)
            steps[physical, seq_len] = predict(
                with_physical_batch(at_seq_len, physical), build_trainer
            )
        return steps[physical, seq_len]

    def peak_at(physical: int) -> int:
        return predicted(physical)["peak"]

    def largest_for(budget: float) -> dict:
        # The first guess: where a straight line through two peaks of the same kind of step
        # crosses the budget. One chunk of a rank's share or more if that share fits (the
        # peak then grows by the same bytes a sample), else chunks of 1 and 2 samples.
        share = rank_share(config)
        low = share if fits(predicted(share), budget, ranks) else 1
        slope = peak_at(low + 1) - peak_at(low)
        room = allocator_room_bytes(budget, ranks) - reserved_peak(predicted(low))
        guess = low + int(room // slope) if slope > 0 else planned
        batch, judged = largest_physical(lambda p: fits(predicted(p), budget, ranks), guess, share)
        return {
            "gpu_memory_gib": budget,
            "physical_batch_size": batch,
            "predicted_peak_mb": peak_at(batch) / MB if batch else None,
            "predicted_reserved_mb": reserved_peak(predicted(batch)) / MB if batch else None,
            "allocator_room_mb": allocator_room_bytes(budget, ranks) / MB,
            "batch_sizes_judged": len(judged),
        }

    def predicted_at_seq_len(seq_len: int) -> dict:
        seq_lens_searched.add(seq_len)
        return predicted(planned, seq_len)  # the config's own length: the main prediction

    def longest_for(budget: float) -> dict:
        # In steps of SEQ_LEN_STEP tokens, up to the model's longest; the first guess from the
        # config's length and the next step, as the batch search's.
        limit = longest_model_seq_len(config) // SEQ_LEN_STEP
        start = max(1, min(limit, config.seq_len // SEQ_LEN_STEP))
        below = start - 1 if start == limit else start  # two steps the model takes
        peak = predicted_at_seq_len(max(1, below) * SEQ_LEN_STEP)
        slope = predicted_at_seq_len((below + 1) * SEQ_LEN_STEP)["peak"] - peak["peak"]
        room = allocator_room_bytes(budget, ranks) - reserved_peak(peak)
        guess = below + int(room // slope) if below and slope > 0 else start
        guess = max(1, min(guess, limit))

        def passes(steps: int) -> bool:
            return steps <= limit and fits(
                predicted_at_seq_len(steps * SEQ_LEN_STEP), budget, ranks
            )

        steps, judged = largest_passing(passes, guess)
        longest = steps * SEQ_LEN_STEP
        at_longest = predicted_at_seq_len(longest) if longest else None
        return {
            "gpu_memory_gib": budget,
            "seq_len": longest,
            "physical_batch_size": planned,
            "predicted_peak_mb": at_longest["peak"] / MB if at_longest else None,
            "predicted_reserved_mb": reserved_peak(at_longest) / MB if at_longest else None,
            "allocator_room_mb": allocator_room_bytes(budget, ranks) / MB,
            "seq_lens_judged": len(judged),
        }

    main = predicted(planned)
    largest = [largest_for(budget) for budget in config.gpu_memory or []]
    card = None
    if card_gib:
        card = longest_for(card_gib) if config.find_max_seq_len else largest_for(card_gib)
    return {
        "method": "the trainer's step on fake tensors (CPU code paths), storages recorded",
        "physical_batch_size": planned,
        "physical_batch_note": note,
        "peak_memory_mb": main["peak"] / MB,
        "peak_reserved_mb": reserved_peak(main) / MB,
        "breakdown": {key: value / MB for key, value in main["roles"].items()},
        "held_after_step_mb": {role: size / MB for role, size in main["state"].items()},
        "parameters": main["parameters"],
        "trainable_parameters": main["trainable_parameters"],
        "flash_routes": main.get("flash_routes"),
        "largest_physical_batch": largest,
        "card": card,
        "predictions": [
            {
                "physical_batch_size": physical,
                "peak_memory_mb": step["peak"] / MB,
                "peak_reserved_mb": reserved_peak(step) / MB,
            }
            for (physical, seq_len), step in sorted(steps.items())
            if seq_len == config.seq_len
        ],
        "seq_len_predictions": [
            {
                "seq_len": seq_len,
                "peak_memory_mb": steps[planned, seq_len]["peak"] / MB,
                "peak_reserved_mb": reserved_peak(steps[planned, seq_len]) / MB,
            }
            for seq_len in sorted(seq_lens_searched)
        ],
        "overheads": dict(GPU_OVERHEADS),
        "seconds": time.perf_counter() - started,
    }
