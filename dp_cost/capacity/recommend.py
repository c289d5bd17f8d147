"""--recommend: for each config, its predicted samples a second at the physical batches a
rank's share runs in halving (its whole share, half of it, ...), on the largest --gpu_memory
budget, and the fastest that fits; the run's report ranks the configs' best
(``report.capacity``)."""

from __future__ import annotations

import math

from dp_cost.capacity.card import GRAPH_PEAK_NOTE, fits, releases_cache, reserved_peak
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
    budget and, where it fits, its predicted time (a candidate whose prediction failed: its
    ``error``); ``best``: the most samples a second (None where none fits or none is timed,
    ``why`` then says which). A graphed config's fits are of a lower bound (``peak_note``)."""
    budget = max(config.gpu_memory)
    share = rank_share(config)
    candidates, untimed = [], []
    for physical in candidate_batches(share):
        candidate: dict = {"physical_batch_size": physical}
        candidates.append(candidate)
        try:
            step = predictions.at(physical, ops=True)
        except Exception as error:  # noqa: BLE001 - one candidate's failure is its own line
            candidate["error"] = " ".join(f"{type(error).__name__}: {error}".split())[:300]
            continue
        candidate["fits"] = fits(step, budget, config.world_size, releases_cache(config))
        candidate["peak_reserved_mb"] = reserved_peak(step) / MB
        if candidate["fits"]:
            time = planned_time(with_physical_batch(config, physical), step, physical, share)
            candidate.update(step_ms=time["step_ms"], samples_per_s=time.get("samples_per_s"))
            if time["step_ms"] is None:
                untimed.append(time["why"])
    timed = [c for c in candidates if c.get("samples_per_s")]
    best = max(timed, key=lambda c: c["samples_per_s"], default=None)
    why = None
    if best is None:
        why = untimed[0] if untimed else f"no physical batch fits {budget:g} GiB"
    return {
        "gpu_memory_gib": budget, "candidates": candidates, "best": best, "why": why,
        "peak_note": GRAPH_PEAK_NOTE if config.cuda_graph else None,
    }  # fmt: skip
