"""What a card does per op, measured once per card kind (``benchmarks/card_rates.py``) and
shipped as ``capacity/cards/<card>.json``: GEMM times on a grid of shapes per dtype, fused
attention rates by sequence length, an elementwise kernel's time by the bytes it moves, and the
host's time per op of the planned step in each phase of an eager step, per trainer. The time
model (``capacity.step_time``) reads ops' costs off it; a card without a table gets no time.

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
import json
import math
import os
from collections.abc import Sequence

CARDS_DIR = os.path.join(os.path.dirname(__file__), "cards")
SCHEMA = 1
PHASES = ("forward", "backward", "finish")  # capacity.step_time's phases of a chunk
THIN_OUTPUT = 256  # a GEMM's products of at most this many outputs each: dot products


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
            self.host_by_trainer = {
                trainer: {phase: float(costs["op_us"][phase]) for phase in PHASES}
                for trainer, costs in table["host"]["by_trainer"].items()
            }
            self.host_by_trainer["standard"]  # every table has the standard trainer's
            self._op_rates = {name: float(rate) for name, rate in table["memory_ops"].items()}
            self._gemm = {dtype: self._gemm_grid(rows) for dtype, rows in table["gemm"].items()}
            self._thin = {
                dtype: self._thin_grid(rows) for dtype, rows in table["thin_gemm"].items()
            }
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
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise CardRatesError(f"{path}: not a card table ({error})") from None
        for name, part in (("gemm", self._gemm), ("thin_gemm", self._thin)):
            if "float32" not in part:
                raise CardRatesError(f"{path}: no float32 {name} grid (the fallback dtype)")
        if not self._attention or any(
            not rows or min(r for _, r in rows) <= 0 for rows in self._attention.values()
        ):
            raise CardRatesError(f"{path}: an attention row is empty or not positive")

    @staticmethod
    def _gemm_grid(rows) -> tuple[list[float], dict[tuple[int, int, int], float]]:
        times = {(int(m), int(n), int(k)): float(us) for m, n, k, us in rows}
        sides = sorted({side for shape in times for side in shape})
        if len(sides) < 2 or min(times.values()) <= 0:
            raise CardRatesError("a GEMM grid needs two sides or more and positive times")
        for shape in ((m, n, k) for m in sides for n in sides for k in sides):
            if shape not in times:
                raise CardRatesError(f"the GEMM grid lacks {shape}")
        return [math.log(s) for s in sides], {s: math.log(t) for s, t in times.items()}

    def host_us(self, trainer: str, phase: str, lora: bool = False) -> float:
        """The host's µs per op of the planned step dispatched in ``phase`` (one of PHASES) of
        ``trainer``'s eager step (``lora``: of a LoRA fine-tune, whose ops are smaller and
        more of them Python's): its own where measured, else the standard trainer's."""
        costs = self.host_by_trainer
        key = trainer + "+lora" if lora and trainer + "+lora" in costs else trainer
        return costs.get(key, costs["standard"])[phase]

    @staticmethod
    def _thin_grid(rows) -> tuple[list[float], list[float], dict[tuple[int, int], float]]:
        times = {(int(b), int(k)): float(us) for b, k, us in rows}
        batches, lengths = sorted({b for b, _ in times}), sorted({k for _, k in times})
        if len(batches) < 2 or len(lengths) < 2 or min(times.values()) <= 0:
            raise CardRatesError("the thin GEMM grid needs two batches and two lengths or more")
        for shape in ((b, k) for b in batches for k in lengths):
            if shape not in times:
                raise CardRatesError(f"the thin GEMM grid lacks {shape}")
        logs = {shape: math.log(t) for shape, t in times.items()}
        return [math.log(b) for b in batches], [math.log(k) for k in lengths], logs

    def gemm_us(self, dtype: str, batch: int, m: int, n: int, k: int) -> float:
        """Predicted µs of a GEMM of ``batch`` (M, N, K) products: over the grid (the batch
        folded into M), or where each product is a few dot products longer than the grid's
        sides (Opacus' ghost norms: [B, 1, T²]·[B, T², 1]), over the thin GEMMs' grid."""
        if m * n <= THIN_OUTPUT and k > self._largest_side(dtype):
            return m * n * self._thin_us(dtype, batch, k)
        return self._grid_us(dtype, batch * m, n, k)

    def _largest_side(self, dtype: str) -> int:
        log_sides, _ = self._gemm.get(dtype) or self._gemm["float32"]
        return round(math.exp(log_sides[-1]))

    def _thin_us(self, dtype: str, batch: int, k: int) -> float:
        """µs of ``batch`` dot products of length ``k``: bilinear in log space."""
        log_batches, log_lengths, log_times = self._thin.get(dtype) or self._thin["float32"]
        axes = (log_batches, log_lengths)
        corners, weights = [], []
        for values, x in zip(axes, (math.log(max(batch, 1)), math.log(max(k, 1)))):
            i = min(max(bisect.bisect_right(values, x) - 1, 0), len(values) - 2)
            corners.append((round(math.exp(values[i])), round(math.exp(values[i + 1]))))
            weights.append((x - values[i]) / (values[i + 1] - values[i]))
        log_time = 0.0
        for pick_b in (0, 1):
            for pick_k in (0, 1):
                w = (weights[0] if pick_b else 1 - weights[0]) * (
                    weights[1] if pick_k else 1 - weights[1]
                )
                if w:
                    log_time += w * log_times[corners[0][pick_b], corners[1][pick_k]]
        return math.exp(log_time)

    def _grid_us(self, dtype: str, m: int, n: int, k: int) -> float:
        """µs of an (M, N, K) GEMM: trilinear in log space over the grid."""
        log_sides, log_times = self._gemm.get(dtype) or self._gemm["float32"]
        sides = [round(math.exp(s)) for s in log_sides]
        corners, weights = [], []
        for value in (m, n, k):
            x = math.log(max(value, 1))
            i = min(max(bisect.bisect_right(log_sides, x) - 1, 0), len(log_sides) - 2)
            t = (x - log_sides[i]) / (log_sides[i + 1] - log_sides[i])
            if x < log_sides[0]:  # below the grid: the smallest side's time (a kernel's floor)
                t = 0.0
            corners.append((sides[i], sides[i + 1]))
            weights.append(t)
        log_time = 0.0
        for bits in range(8):
            picks = [(bits >> axis) & 1 for axis in range(3)]
            w = math.prod(weights[a] if p else 1 - weights[a] for a, p in enumerate(picks))
            if w:
                shape = tuple(corners[a][p] for a, p in enumerate(picks))
                log_time += w * log_times[shape]
        return math.exp(log_time)

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


@functools.cache
def load_card(path: str) -> CardRates:
    """The table at ``path`` (CardRatesError, one line, if it cannot be read)."""
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
