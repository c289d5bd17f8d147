"""--mode=capacity's prediction of one config: its peak at the planned physical batch, the
largest physical batch per --gpu_memory budget, and, searched for this process's card, the
largest physical batch (--find_max_batch) or the longest sequence (--find_max_seq_len)."""

from __future__ import annotations

import dataclasses
import time

from dp_cost.capacity.card import (
    FIT_RULES,
    GPU_OVERHEADS,
    GRAPH_PEAK_NOTE,
    releases_cache,
    reserved_peak,
)
from dp_cost.capacity.fake_step import rank_share
from dp_cost.capacity.predictions import Predictions
from dp_cost.capacity.recommend import recommendation
from dp_cost.capacity.searches import batch_axis, largest_on_card, seq_len_axis
from dp_cost.capacity.step_time import planned_time
from dp_cost.core.schema import MB


def capacity_result(config, build_trainer, card_gib: float | None = None) -> dict:
    """``result["prediction"]`` of one config: its predicted peak (what torch would count for
    the step's own tensors) and roles at the planned physical batch, and for each
    ``--gpu_memory`` budget the largest physical batch that fits, with every prediction made.
    ``card_gib``: this process's card, searched as one more budget: for the largest physical
    batch (--find_max_batch), or the longest sequence at the planned one (--find_max_seq_len)."""
    started = time.perf_counter()
    predictions = Predictions(config, build_trainer)
    main = predictions.at(predictions.planned, ops=predictions.note is None)
    # timed at the batch a step runs on average: an uncapped Poisson batch's memory is planned
    # at its rare largest draw, its time at the expected one
    samples = rank_share(config)
    timed = predictions.planned if predictions.note is None else min(samples, predictions.planned)
    step_time = planned_time(config, predictions.at(timed, ops=True), timed, samples)
    # before the searches: its candidates, predicted with their ops, serve them too
    recommended = recommendation(config, predictions) if config.recommend else None
    batch = batch_axis(predictions)
    ranks = config.world_size
    largest = [largest_on_card(batch, budget, ranks) for budget in config.gpu_memory or []]
    card = None
    if card_gib:
        axis = seq_len_axis(predictions) if config.find_max_seq_len else batch
        # the runs that search this card probe fixed-size batches (capacity.probing): its
        # prediction is judged by their rule, the allocator releasing cached segments
        card = largest_on_card(dataclasses.replace(axis, release=True), card_gib, ranks)
    return {
        "method": "the trainer's step on fake tensors (CPU code paths but for attention's kernel, "
        "RMSNorm's fused kernel, flash's weighted sums and torch.optim's foreach path, taken as "
        "on CUDA), storages recorded",
        "physical_batch_size": predictions.planned,
        "physical_batch_note": predictions.note,
        "peak_note": GRAPH_PEAK_NOTE if config.cuda_graph else None,
        "peak_memory_mb": main["peak"] / MB,
        "peak_reserved_mb": reserved_peak(main) / MB,
        "breakdown": {key: value / MB for key, value in main["roles"].items()},
        "time": step_time,
        "held_after_step_mb": {role: size / MB for role, size in main["state"].items()},
        "parameters": main["parameters"],
        "trainable_parameters": main["trainable_parameters"],
        "flash_routes": main.get("flash_routes"),
        "attention_kernels": main.get("attention_backends"),
        "largest_physical_batch": largest,
        "fit_rule": FIT_RULES[releases_cache(config)],
        "card": card,
        "predictions": predictions.by_physical_batch(),
        "recommendation": recommended,
        "seq_len_predictions": predictions.by_seq_len(),
        "overheads": dict(GPU_OVERHEADS),
        "seconds": time.perf_counter() - started,
    }
