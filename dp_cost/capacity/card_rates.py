"""What a card does per op, measured once per card kind (``benchmarks/card_rates.py``) and
shipped as ``capacity/cards/<card>.json``: GEMM times on a grid of shapes per dtype, fused
attention rates by sequence length, an elementwise kernel's time by the bytes it moves, and the
host's time in each phase of an eager step, per trainer and kind of model: µs per op of the
planned step, and µs a chunk's phase costs whatever the model's depth (fitted over calibration
models of several depths). The time model (``capacity.step_time``) reads ops' costs off it; a card
without a table gets no time.

What is not measured but assumed, and why: between the grid's points a GEMM's time is
interpolated in log space (a large GEMM's time is proportional to M·N·K, so the interpolation is
exact there); beyond the grid's largest side it grows in proportion to the side (a GEMM that
large runs at the card's rate already); a thin GEMM's products of several outputs cost one dot
product each; an attention outside the measured lengths takes the nearest one's rate, of the
nearest head size measured (causal attention only); a dtype without rates takes fp32's.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import os
import statistics
from collections.abc import Sequence

CARDS_DIR = os.path.join(os.path.dirname(__file__), "cards")
SCHEMA = 2
PHASES = ("forward", "backward", "finish")  # capacity.step_time's phases of a chunk
# The host costs' rows by the kind of model a step trains: the calibration model of each (the
# tiny LM; the tiny Llama, whole or with LoRA adapters) runs that kind's Python per layer
MODEL_KINDS = {"lm": "", "hf": "+hf", "lora": "+lora"}
# What benchmarks/collective_rates.py measures, the kinds op_list records collectives as
COLLECTIVE_KINDS = {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}
THIN_OUTPUT = 256  # a GEMM's products of at most this many outputs each: dot products


def fit_host(by_depth: dict[int, tuple[dict, dict]]) -> dict:
    """A table's host costs from its calibration steps (``benchmarks/card_rates.py``). Per
    phase, µs an op (``op_us``) and µs besides (``fixed_us``): the least-squares line of
    the host time against the planned ops over ``by_depth`` (depth: (host µs, ops) by phase),
    neither part negative (where the free line's would be, the line through the origin, or
    for ops that do not grow, a constant: their mean time). Two depths at least."""
    points = list(by_depth.values())
    if len(points) < 2:
        raise ValueError(f"host times at {len(points)} depth(s): a line needs two")
    op_us, fixed_us = {}, {}
    for phase in points[0][0]:
        ops = [float(counts[phase]) for _, counts in points]
        host = [float(times[phase]) for times, _ in points]
        mean_ops, mean_host = statistics.fmean(ops), statistics.fmean(host)
        spread = sum((o - mean_ops) ** 2 for o in ops)
        slope = (
            sum((o - mean_ops) * (h - mean_host) for o, h in zip(ops, host)) / spread
            if spread
            else 0.0
        )
        fixed = mean_host - slope * mean_ops
        if slope <= 0:
            slope, fixed = 0.0, mean_host
        elif fixed < 0:
            slope, fixed = sum(o * h for o, h in zip(ops, host)) / sum(o * o for o in ops), 0.0
        op_us[phase], fixed_us[phase] = round(max(slope, 0.0), 3), round(max(fixed, 0.0), 1)
    return {"op_us": op_us, "fixed_us": fixed_us}


class CardRatesError(ValueError):
    """A calibration table that cannot be read or lacks what the time model needs."""


def card_file_name(card: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200.json``."""
    slug = "".join(c if c.isalnum() else "-" for c in card.lower()).strip("-")
    return "-".join(part for part in slug.split("-") if part) + ".json"


def shipped_cards() -> list[str]:
    """The cards whose tables ship with the toolkit, by name."""
    names = []
    for name in sorted(os.listdir(CARDS_DIR)) if os.path.isdir(CARDS_DIR) else []:
        if name.endswith(".json"):
            try:
                names.append(load_card(os.path.join(CARDS_DIR, name)).card)
            except CardRatesError:
                continue
    return names


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float, hold: bool = False) -> float:
    """Piecewise-linear ys(x) on sorted xs; beyond the ends, the end segments extended (or with
    ``hold``, the end values kept)."""
    if len(xs) == 1:
        return ys[0]
    if hold:
        x = min(max(x, xs[0]), xs[-1])
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    t = (x - xs[i]) / (xs[i + 1] - xs[i])
    return ys[i] + t * (ys[i + 1] - ys[i])


class LogGrid:
    """Times measured on a full grid of shapes, read between its points multilinearly in log
    space (log time in the log of each side): below an axis's first value that value's time (a
    kernel's floor), above its last the last segment extended."""

    def __init__(self, axes: list[list[int]], log_times: dict[tuple[int, ...], float]):
        self.axes, self.log_times = axes, log_times
        self._log_axes = [[math.log(v) for v in values] for values in axes]

    @classmethod
    def of(cls, rows, what: str, dims: int) -> LogGrid:
        """The grid of table ``rows`` (each ``dims`` sides, then µs). A GEMM grid has the same
        sides on every axis (the cube of them); a thin grid, its own per axis."""
        times = {tuple(int(v) for v in row[:dims]): float(row[dims]) for row in rows}
        if dims == 3:
            sides = sorted({side for shape in times for side in shape})
            axes = [sides] * dims
        else:
            axes = [sorted({shape[a] for shape in times}) for a in range(dims)]
        if min(len(values) for values in axes) < 2 or min(times.values()) <= 0:
            raise CardRatesError(f"the {what} needs two values or more a side and positive times")
        for shape in itertools.product(*axes):
            if shape not in times:
                raise CardRatesError(f"the {what} lacks {shape}")
        return cls(axes, {shape: math.log(t) for shape, t in times.items()})

    def time(self, point: tuple[int, ...]) -> float:
        """Predicted µs at ``point`` (one value an axis)."""
        corners, weights = [], []
        for values, logs, value in zip(self.axes, self._log_axes, point):
            x = math.log(max(value, 1))
            i = min(max(bisect.bisect_right(logs, x) - 1, 0), len(logs) - 2)
            weights.append(0.0 if x < logs[0] else (x - logs[i]) / (logs[i + 1] - logs[i]))
            corners.append((values[i], values[i + 1]))
        log_time = 0.0
        for picks in itertools.product((0, 1), repeat=len(point)):
            w = math.prod(t if p else 1 - t for t, p in zip(weights, picks))
            if w:
                log_time += w * self.log_times[tuple(c[p] for c, p in zip(corners, picks))]
        return math.exp(log_time)


def ranked_sections(table: dict) -> tuple[dict, dict]:
    """The table's sections by number of ranks (``collectives``): {ranks: (GPU µs rows by
    collective, sorted by bytes; host µs a call by collective)} and {ranks: host rows of
    trainers under DDP or FSDP2, "flash@fsdp"}."""
    sections = {int(world): section for world, section in table.get("collectives", {}).items()}
    collectives = {
        world: (
            {name: sorted((int(b), float(us)) for b, us in rows)
             for name, rows in section["gpu_us"].items()},
            {name: float(us) for name, us in section["host_us"].items()},
        )
        for world, section in sections.items()
    }  # fmt: skip
    host_by_ranks = {
        world: host_rows(section.get("host_by_trainer", {})) for world, section in sections.items()
    }
    return collectives, host_by_ranks


def host_rows(by_trainer: dict) -> dict[str, dict[str, tuple[float, float]]]:
    """A table's host rows: row -> phase -> (µs an op, µs once)."""
    return {
        row: {phase: (float(costs["op_us"][phase]), float(costs["fixed_us"][phase]))
              for phase in PHASES}
        for row, costs in by_trainer.items()
    }  # fmt: skip


class CardRates:
    """One card's table (``load_card``)."""

    def __init__(self, table: dict, path: str):
        self.path = path
        try:
            if table["schema"] != SCHEMA:
                raise CardRatesError(f"schema {table['schema']!r}, expected {SCHEMA}")
            self.card = str(table["card"])
            self.measured = dict(table["measured"])
            self.host = {"sync_us": float(table["host"]["sync_us"])}
            self.host_by_trainer = host_rows(table["host"]["by_trainer"])
            self.host_by_trainer["standard"]  # every table has the standard trainer's
            self._op_rates = {name: float(rate) for name, rate in table["memory_ops"].items()}
            self._gemm = {dtype: LogGrid.of(rows, "GEMM grid", 3) for dtype, rows in
                          table["gemm"].items()}  # fmt: skip
            self._thin = {dtype: LogGrid.of(rows, "thin GEMM grid", 2) for dtype, rows in
                          table["thin_gemm"].items()}  # fmt: skip
            self._attention = {
                (dtype, direction, int(head_dim)): sorted((int(t), float(r)) for t, r in rows)
                for dtype, by_head in table["attention"].items()
                for head_dim, by_direction in by_head.items()
                for direction, rows in by_direction.items()
            }
            memory = sorted((int(b), float(us)) for b, us in table["memory"])
            self._memory_log = ([math.log(b) for b, _ in memory], [math.log(u) for _, u in memory])
            self._memory_floor_us = min(us for _, us in memory)
            largest_bytes, largest_us = memory[-1]
            self._bytes_per_us = largest_bytes / largest_us
            self._collectives, self.host_by_ranks = ranked_sections(table)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
            raise CardRatesError(f"{path}: not a card table ({error})") from None
        if any(us < 0 for rows in (self.host_by_trainer, *self.host_by_ranks.values())
               for row in rows.values() for pair in row.values() for us in pair):  # fmt: skip
            raise CardRatesError(f"{path}: a host cost is negative")
        for name, part in (("gemm", self._gemm), ("thin_gemm", self._thin)):
            if "float32" not in part:
                raise CardRatesError(f"{path}: no float32 {name} grid (the fallback dtype)")
        for world, (gpu, host) in self._collectives.items():
            if set(gpu) != COLLECTIVE_KINDS or set(host) != COLLECTIVE_KINDS:
                raise CardRatesError(f"{path}: {world} ranks' collectives are not all of "
                                     f"{', '.join(sorted(COLLECTIVE_KINDS))}")  # fmt: skip
            if any(not rows or rows[0][0] <= 0 or min(us for _, us in rows) <= 0
                   or any(a[0] >= b[0] for a, b in itertools.pairwise(rows))
                   for rows in gpu.values()) or min(host.values()) < 0:  # fmt: skip
                raise CardRatesError(
                    f"{path}: a collective's row is empty, not positive or has a size twice"
                )
        if not self._attention or any(
            not rows or min(r for _, r in rows) <= 0 for rows in self._attention.values()
        ):
            raise CardRatesError(f"{path}: an attention row is empty or not positive")

    def host_us(
        self, trainer: str, phase: str, model_kind: str = "lm", ranks: tuple[str, int] = ("none", 1)
    ) -> tuple[float, float]:
        """(µs per op of the planned step dispatched in ``phase`` (one of PHASES), µs the phase
        costs once a chunk beside them) of ``trainer``'s eager step on a model of
        ``model_kind`` (one of MODEL_KINDS), on ``ranks`` (distributed mode, ranks): its own
        row where measured, else the trainer's on the tiny LM, else the standard trainer's;
        under DDP or FSDP2 the trainer's row measured under it first (its hooks' Python)."""
        suffix, (distributed, world_size) = MODEL_KINDS[model_kind], ranks
        under = self.host_by_ranks.get(world_size, {})  # one process: no rows under ranks
        for row in (f"{trainer}{suffix}@{distributed}", f"{trainer}@{distributed}"):
            if row in under:
                return under[row][phase]
        costs = self.host_by_trainer
        for row in (trainer + suffix, trainer, "standard" + suffix):
            if row in costs:
                return costs[row][phase]
        return costs["standard"][phase]

    def gemm_us(self, dtype: str, batch: int, m: int, n: int, k: int) -> float:
        """Predicted µs of a GEMM of ``batch`` (M, N, K) products: over the grid (the batch
        folded into M), or where each product is a few dot products longer than the grid's
        sides (Opacus' ghost norms: [B, 1, T²]·[B, T², 1]), over the thin GEMMs' grid."""
        grid = self._gemm.get(dtype) or self._gemm["float32"]
        if m * n <= THIN_OUTPUT and k > grid.axes[-1][-1]:
            thin = self._thin.get(dtype) or self._thin["float32"]
            return m * n * thin.time((batch, k))
        return grid.time((batch * m, n, k))

    def attention_us(self, dtype: str, direction: str, head_dim: int, seq_len: int, flops: int):
        """Predicted µs of a fused attention of ``flops`` FLOPs: its rate at ``seq_len``
        (interpolated in log length; the nearest calibrated head size and dtype)."""
        keys = [key for key in self._attention if key[1] == direction]
        same = [key for key in keys if key[0] == dtype] or keys
        key = min(same, key=lambda k: abs(math.log(k[2]) - math.log(max(head_dim, 1))))
        rows = self._attention[key]
        log_lengths = [math.log(t) for t, _ in rows]
        # beyond the lengths measured, the nearest one's rate: a rate is not extrapolated
        rate = _interpolate(log_lengths, [r for _, r in rows], math.log(max(seq_len, 1)), True)
        return flops / rate / 1e6  # rate in TFLOP/s: FLOPs / (rate·1e12) s

    def memory_us(self, moved: int, name: str = "") -> float:
        """Predicted µs of a kernel moving ``moved`` bytes (read and written): an elementwise
        kernel's at that size, or where the op ``name`` was measured and is slower per byte
        (a reduction, a norm, a scatter), its own rate."""
        if moved <= 0:
            return self._memory_floor_us
        xs, ys = self._memory_log
        if moved >= math.exp(xs[-1]):
            elementwise = moved / self._bytes_per_us
        else:
            elementwise = max(
                math.exp(_interpolate(xs, ys, math.log(moved))), self._memory_floor_us
            )
        rate = self._op_rates.get(name)  # bytes a µs
        return max(elementwise, moved / rate) if rate else elementwise

    def collective_ranks(self) -> list[int]:
        """The numbers of ranks whose collectives the table measured."""
        return sorted(self._collectives)

    def collective_us(self, name: str, moved: int, world_size: int) -> tuple[float, float]:
        """(host µs to issue, GPU µs) of a ``name`` collective of ``moved`` bytes (its whole
        tensor) over ``world_size`` ranks (KeyError where not measured): between the sizes
        measured interpolated in log space, below them the smallest's time (its latency),
        above them in proportion to the bytes (the link's bandwidth)."""
        gpu, host = self._collectives[world_size]
        rows = gpu[name]
        largest_bytes, largest_us = rows[-1]
        if moved >= largest_bytes:
            return host[name], moved * largest_us / largest_bytes
        xs, ys = [math.log(b) for b, _ in rows], [math.log(us) for _, us in rows]
        return host[name], math.exp(_interpolate(xs, ys, math.log(max(moved, 1)), hold=True))


@functools.cache
def load_card(path: str) -> CardRates:
    """``read_card``, once a path: a table does not change while the toolkit runs."""
    return read_card(path)


def read_card(path: str) -> CardRates:
    """The table at ``path``, read now (CardRatesError, one line, if it cannot be read)."""
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError) as error:
        raise CardRatesError(f"{path}: {error}") from None
    if not isinstance(table, dict):
        raise CardRatesError(f"{path}: not a card table (not a JSON object)")
    return CardRates(table, path)


def card_rates(card: str) -> CardRates:
    """The shipped table of ``card`` by name, spelt any case (CardRatesError naming the
    shipped ones, or why the table cannot be read)."""
    path = os.path.join(CARDS_DIR, card_file_name(card))
    if not os.path.exists(path):
        known = ", ".join(shipped_cards()) or "none"
        raise CardRatesError(f"no time calibration for card {card!r}; calibrated: {known}")
    return load_card(path)
