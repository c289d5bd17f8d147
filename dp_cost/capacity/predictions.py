"""The config's step predicted (``capacity.fake_step``) at the physical batches and sequence
lengths the searches ask for, each once; the physical batch a config is planned at."""

from __future__ import annotations

import dataclasses
import math

from dp_cost.capacity.card import reserved_peak
from dp_cost.capacity.fake_step import predict, rank_share
from dp_cost.core.schema import MB
from dp_cost.hf.configs import HF_CONFIGS
from dp_cost.hf.draws import draw_above_probability
from dp_cost.parallel.ranks import share

POISSON_QUANTILE = 1e-6  # an uncapped Poisson batch is planned at its 1 - 1e-6 quantile


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


def runs_as(physical: int, share: int) -> int:
    """The chunk a physical batch cap runs a rank's ``share`` of samples as: near-equal chunks
    (Runner.eager_step), so below the share a cap that does not divide it runs smaller ones
    (4 samples at a cap of 3: chunks of 2 and 2, which is what the plan at 3 planned);
    at or above the share, one chunk of that size (the logical batch raised to it)."""
    if physical >= share or physical < 1:
        return physical
    return math.ceil(share / math.ceil(share / physical))


def with_physical_batch(config, physical: int):
    """``config`` at physical batch ``physical`` (per rank): one chunk of ``physical`` samples
    on each rank when that is at least a rank's share of the logical batch (which is raised to
    it), else chunks of it."""
    batch = max(config.batch_size, physical * config.world_size)
    return dataclasses.replace(config, batch_size=batch, max_physical_batch_size=physical)


class Predictions:
    """The config's step predicted at (physical batch, sequence length) points, each once: at
    the planned physical batch (``planned``, why it is not the asked one: ``note``), at the
    physical batches a search judges and at the sequence lengths one judges (``at_seq_len``)."""

    def __init__(self, config, build_trainer):
        self.config, self.build_trainer = config, build_trainer
        self.planned, self.note = planned_physical_batch(config)
        self.steps: dict[tuple[int, int], dict] = {}  # (physical batch, sequence length) -> step
        self.seq_lens_searched: set[int] = set()

    def at(self, physical: int, seq_len: int | None = None, *, ops: bool = False) -> dict:
        """The step at physical batch ``physical`` and ``seq_len`` (the config's by default);
        ``ops``: with its ops recorded, for its time (a search needs only its memory)."""
        seq_len = self.config.seq_len if seq_len is None else seq_len
        step = self.steps.get((physical, seq_len))
        if step is None or (ops and step["ops"] is None):
            at_seq_len = dataclasses.replace(self.config, seq_len=seq_len)
            self.steps[physical, seq_len] = predict(
                with_physical_batch(at_seq_len, physical), self.build_trainer, record_ops=ops
            )
        return self.steps[physical, seq_len]

    def at_seq_len(self, seq_len: int) -> dict:
        """The step at the planned physical batch and ``seq_len``, a length searched."""
        self.seq_lens_searched.add(seq_len)
        return self.at(self.planned, seq_len)  # the config's own length: the main prediction

    def by_physical_batch(self) -> list[dict]:
        """Every physical batch predicted at the config's sequence length, in order, each as
        the chunk it runs as (a cap of 3 over 4 samples plans chunks of 2: it is listed as 2,
        once)."""
        share = rank_share(self.config)
        runnable: dict[int, dict] = {}
        for (physical, seq_len), step in sorted(self.steps.items()):
            if seq_len == self.config.seq_len:
                runnable.setdefault(runs_as(physical, share), step)
        return [
            {
                "physical_batch_size": physical,
                "peak_memory_mb": step["peak"] / MB,
                "peak_reserved_mb": reserved_peak(step) / MB,
            }
            for physical, step in sorted(runnable.items())
        ]

    def by_seq_len(self) -> list[dict]:
        """Every sequence length searched, at the planned physical batch, in order."""
        return [
            {
                "seq_len": seq_len,
                "peak_memory_mb": self.steps[self.planned, seq_len]["peak"] / MB,
                "peak_reserved_mb": reserved_peak(self.steps[self.planned, seq_len]) / MB,
            }
            for seq_len in sorted(self.seq_lens_searched)
        ]
