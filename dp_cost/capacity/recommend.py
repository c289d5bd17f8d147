"""--recommend: for each config, its predicted samples a second at every physical batch a
rank's share splits into evenly, on the largest --gpu_memory budget, and the fastest that
fits; the run's report ranks the configs' best (``report.capacity``)."""

from __future__ import annotations

import math

from dp_cost.capacity.card import fits, reserved_peak
from dp_cost.capacity.fake_step import rank_share
from dp_cost.capacity.predictions import Predictions, with_physical_batch
from dp_cost.capacity.step_time import planned_time
from dp_cost.core.schema import MB


def candidate_batches(share: int) -> list[int]:
    """The physical batches a rank's ``share`` of samples runs as near-equal chunks of, halving:
    ``share``, ⌈share/2⌉, ⌈share/4⌉, ... 1 (8 -> 8, 4, 2, 1; 6 -> 6, 3, 2, 1)."""
    batches, chunks = [], 1
    while not batches or batches[-1] > 1:
        physical = math.ceil(share / chunks)
        if not batches or physical < batches[-1]:
            batches.append(physical)
        chunks *= 2
    return batches


def recommendation(config, predictions: Predictions) -> dict:
    """``prediction["recommendation"]``: each candidate physical batch's fit on the largest
    budget and, where it fits, its predicted time; ``best``: the most samples a second (None
    where none fits or no time is predicted, ``why`` then says which)."""
    budget = max(config.gpu_memory)
    share = rank_share(config)
    candidates = []
    for physical in candidate_batches(share):
        step = predictions.at(physical, ops=True)
        candidate = {
            "physical_batch_size": physical,
            "fits": fits(step, budget, config.world_size),
            "peak_reserved_mb": reserved_peak(step) / MB,
        }
        if candidate["fits"]:
            at = with_physical_batch(config, physical)
            time = planned_time(at, step, physical, share)
            candidate.update(step_ms=time["step_ms"], samples_per_s=time.get("samples_per_s"))
        candidates.append(candidate)
    timed = [c for c in candidates if c.get("samples_per_s")]
    best = max(timed, key=lambda c: c["samples_per_s"], default=None)
    why = None
    if best is None:
        why = (
            f"no physical batch fits {budget:g} GiB"
            if not any(c["fits"] for c in candidates)
            else "no time is predicted for this config (several ranks)"
        )
    return {"gpu_memory_gib": budget, "candidates": candidates, "best": best, "why": why}
