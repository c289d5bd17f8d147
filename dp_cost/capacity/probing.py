"""--find_max_batch and --find_max_seq_len: the largest physical batch, or the longest
sequence at the planned physical batch, that runs on this card, found by runs (probes) from the
predicted one; every probe recorded."""

from __future__ import annotations

import dataclasses

from dp_cost.capacity.fake_step import rank_share
from dp_cost.capacity.predictions import with_physical_batch
from dp_cost.capacity.searches import largest_passing, largest_physical, longest_model_seq_len
from dp_cost.measure.plan_checks import SEQ_LEN_STEP


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
