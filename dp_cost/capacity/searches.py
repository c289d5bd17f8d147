"""The searches for the largest value that fits: of a monotone test from a first guess
(galloping, then bisecting), of a config's physical batch (two monotone pieces, either side of
the logical batch), and of one setting on a card, batch or sequence length (``Axis``), judged by
the predicted step's fit."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dp_cost.capacity.card import (
    ROOM_STEP,
    allocator_room_bytes,
    fits,
    needed_room,
    releases_cache,
    reserved_peak,
)
from dp_cost.capacity.fake_step import rank_share
from dp_cost.capacity.model_facts import model_max_seq_len
from dp_cost.capacity.predictions import Predictions, runs_as
from dp_cost.core.schema import MB
from dp_cost.measure.plan_checks import SEQ_LEN_STEP

MAX_PROBES = 64  # a guard: galloping and bisecting take about 2 log2(|guess - answer|)
# The largest physical batch a card's search judges: where that fits, the result says so
# ("search_capped": more may fit) instead of finding the exact answer (a small model on a large
# card fits tens of thousands, and each prediction is a step on fake tensors).
MAX_PHYSICAL_BATCH = 1024
SECANT_STEPS = 3  # refinements of a search's first guess (``refined_guess``)


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


def longest_model_seq_len(config) -> int:
    return model_max_seq_len(config.model, config.attention, config.model_overrides)


@dataclasses.dataclass(frozen=True)
class Axis:
    """One setting a card's search varies, the others held at the config's: the step predicted
    at a value (in the search's units), the two values whose peaks draw the line the first guess
    comes from, with the guess where that line does not rise (``line(passes)``), the search from
    the guess, and the value found as the result's keys."""

    judged: str  # the result's key: how many values were judged
    predicted: Callable[[int], dict]
    line: Callable[[Callable[[int], bool]], tuple[int, int, int]]
    search: Callable[[Callable[[int], bool], int], tuple[int, list[int]]]
    entry: Callable[[int], dict]
    cap: int | None = None  # the largest value judged (None: the search's own limit)
    # (low, guess) -> may the first guess be refined through the step at the guess (both on
    # one monotone piece of the axis, the guess within its limit)
    refinable: Callable[[int, int], bool] = lambda low, guess: False
    release: bool = True  # a fit may release cached segments (card.releases_cache)


def batch_axis(predictions: Predictions) -> Axis:
    """The physical batch, at the config's sequence length. The line: one chunk of a rank's
    share or more if that share fits (the peak then grows by the same bytes a sample), else
    chunks of 1 and 2 samples."""
    share = rank_share(predictions.config)

    def line(passes):
        low = share if passes(share) else 1
        return low, low + 1, predictions.planned

    def search(passes, guess):
        def capped(physical):
            return physical <= MAX_PHYSICAL_BATCH and passes(physical)

        return largest_physical(capped, min(guess, MAX_PHYSICAL_BATCH), share)

    return Axis(
        judged="batch_sizes_judged",
        predicted=predictions.at,
        release=releases_cache(predictions.config),
        line=line,
        search=search,
        entry=lambda physical: {"physical_batch_size": runs_as(physical, share)},
        cap=MAX_PHYSICAL_BATCH,
        refinable=lambda low, guess: (
            1 <= low < guess <= MAX_PHYSICAL_BATCH and (low >= share) == (guess >= share)
        ),
    )


def seq_len_axis(predictions: Predictions) -> Axis:
    """The sequence length in steps of SEQ_LEN_STEP tokens, up to the model's longest, at the
    planned physical batch. The line: the config's length and the next step (the two steps
    below the model's longest where the config is there)."""
    limit = longest_model_seq_len(predictions.config) // SEQ_LEN_STEP
    start = max(1, min(limit, predictions.config.seq_len // SEQ_LEN_STEP))
    below = start - 1 if start == limit else start  # two steps the model takes

    def search(passes, guess):
        within = max(1, min(guess, limit))
        return largest_passing(lambda steps: steps <= limit and passes(steps), within)

    return Axis(
        judged="seq_lens_judged",
        predicted=lambda steps: predictions.at_seq_len(steps * SEQ_LEN_STEP),
        release=releases_cache(predictions.config),
        line=lambda passes: (max(1, below), below + 1, start),
        search=search,
        entry=lambda steps: {
            "seq_len": steps * SEQ_LEN_STEP,
            "physical_batch_size": predictions.planned,
        },
    )


def refined_guess(axis: Axis, room: int, low: int, guess: int) -> int:
    """The first guess moved by secant steps on the room each step needs (``needed_room``),
    from the line through ``low`` and the guess, to where it crosses the card's room: the
    allocated peak's slope misses the allocator's fragmentation, which grows with the batch
    (ghost's first guesses of the 1b model were 4 to 7 samples over, each miss a search step
    of a fake step's seconds). Each step predicts one value more; the steps stay between the
    largest value known to fit and the smallest known not to, and stop where two values' rooms
    are too close (``needed_room`` is exact to ROOM_STEP) to draw a line through."""
    fitting, failing = 0, None  # the bracket the steps have shown
    previous, current = low, guess
    for _ in range(SECANT_STEPS):
        if previous == current or not axis.refinable(*sorted((previous, current))):
            break
        at_previous, at_current = (room_needed(axis, value) for value in (previous, current))
        for value, needed in ((previous, at_previous), (current, at_current)):
            if needed <= room:
                fitting = max(fitting, value)
            else:
                failing = value if failing is None else min(failing, value)
        if abs(at_current - at_previous) <= 2 * ROOM_STEP:
            break
        following = previous + (room - at_previous) * (current - previous) // (
            at_current - at_previous
        )
        following = max(fitting, following if failing is None else min(following, failing - 1))
        if following in (previous, current):
            return following
        previous, current = current, max(1, following)
    return current


def room_needed(axis: Axis, value: int) -> int:
    """``needed_room`` of the step at ``value``, kept with its prediction (a dozen replays)."""
    step = axis.predicted(value)
    key = "needed_room" if axis.release else "needed_room_kept_cache"  # one a rule
    if key not in step:
        step[key] = needed_room(step, axis.release)
    return step[key]


def largest_on_card(axis: Axis, budget: float, ranks: int) -> dict:
    """The largest value of ``axis`` whose predicted step fits a card of ``budget`` GiB (beside
    NCCL's buffers with several ``ranks``), with its predicted peaks and how many values were
    judged; ``search_capped``: it is the axis's cap, and larger ones were not judged. The first
    guess: where a straight line through the peaks of two steps of the same kind crosses the
    card's room."""
    room = allocator_room_bytes(budget, ranks)

    def passes(value: int) -> bool:
        return fits(axis.predicted(value), budget, ranks, axis.release)

    low, high, flat_guess = axis.line(passes)
    if low == 1 and not passes(1):  # not even the smallest value fits: no line to draw
        guess = 1
    else:
        slope = axis.predicted(high)["peak"] - axis.predicted(low)["peak"]
        left = room - reserved_peak(axis.predicted(low))
        guess = low + int(left // slope) if slope > 0 else flat_guess
        guess = refined_guess(axis, room, low, guess)
    found, judged = axis.search(passes, guess)
    at_found = axis.predicted(found) if found else None
    return {
        "gpu_memory_gib": budget,
        **axis.entry(found),
        "predicted_peak_mb": at_found["peak"] / MB if at_found else None,
        "predicted_reserved_mb": reserved_peak(at_found) / MB if at_found else None,
        "allocator_room_mb": room / MB,
        axis.judged: len(judged),
        "search_capped": axis.cap is not None and found == axis.cap,
    }
