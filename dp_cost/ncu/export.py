"""``ncu --csv --page raw`` exports: units, parsing, per-step and per-category totals, the DRAM
lower bound of a standard step, and loading a directory of reports (exporting them if needed).

Units after parsing: bytes, bytes/s, ns and plain counts; GB is 10^9 bytes.
"""

from __future__ import annotations

import csv
import glob
import math
import os
import subprocess

from dp_cost.core.files import write_text
from dp_cost.core.kernel_names import categorize
from dp_cost.core.reading import MAX_BYTES, read_text
from dp_cost.core.schema import KERNEL_CATEGORIES, trainer_rank
from dp_cost.ncu.command import (
    NCU_MISSING_MESSAGE,
    TRAINERS,
    export_command,
    find_ncu,
    parse_report_name,
)

GB = 1e9  # traffic is reported in decimal GB, as ncu and bandwidth figures use
RANGE_NAME = "range"  # the "Kernel Name" of a range replay's one result per range

# ---------------------------------------------------------------- parsing

_SI = {"": 1.0, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_TIME_NS = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}
_TIME_NS.update({"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9})
_COUNTED = ("byte", "sector", "request", "inst", "cycle", "warp", "thread", "wavefront", "block")


def _unit_part(part: str) -> tuple[float, bool]:
    """(factor to base units, is it time in ns) of one side of a unit: Kbyte -> (1e3, False)."""
    if part in _TIME_NS:
        return _TIME_NS[part], True
    for base in _COUNTED:
        if part.endswith(base):
            prefix = part[: -len(base)]
            factor = _BINARY.get(prefix, _SI.get(prefix))
            if factor is not None:
                return factor, False
    return 1.0, False  # %, ratio, unknown units: keep the number


def unit_factor(unit: str) -> float:
    """Multiplier that turns a value in `unit` into bytes, bytes/s, ns or a plain count.

    ncu's prefixes are decimal (1 Kbyte = 1000 bytes); Kibyte-style ones are binary.
    """
    numerator, _, denominator = unit.strip().partition("/")
    factor, _ = _unit_part(numerator)
    if denominator:
        scale, is_time = _unit_part(denominator)
        factor /= scale / 1e9 if is_time else scale  # per time unit -> per second
    return factor


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    try:
        value = float(text)
    except ValueError:
        return None  # n/a, empty
    return value if math.isfinite(value) else None  # "inf", "nan": no measurement, shown blank


def is_metric_column(name: str) -> bool:
    return "__" in name  # ncu metric names are unit__counter...; the others are labels


def parse_raw_csv(text: str) -> list[dict]:
    """Rows of ``ncu --csv --page raw``: one dict per kernel launch (kernel replay) or per range
    (range replay: "Kernel Name" is ``range``).

    Label columns ("ID", "Kernel Name", "Context", "Stream", "Block Size", ...) stay strings;
    metric columns become floats in base units (bytes, bytes/s, ns, counts) or None for n/a.
    Lines ncu prints around the table ("==PROF== ...", "==WARNING== ...") are skipped.
    """
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("==")]
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        if lines:
            raise ValueError('not ncu --page raw CSV: no header row starting with "ID"')
        return []  # nothing but ncu messages: no kernel was profiled
    # ncu writes long kernel names (templates) whole: a field may pass csv's 128 KiB default
    csv.field_size_limit(max(csv.field_size_limit(), MAX_BYTES))
    table = list(csv.reader(lines[start:]))
    header, body = table[0], table[1:]
    if body and not any(is_metric_column(name) for name in header):
        # e.g. ``ncu --csv`` of the details page: one row per metric, the names in a column
        raise ValueError("no metric columns: export with ncu --csv --page raw")
    factors = [1.0] * len(header)
    if body and not body[0][0].strip():  # the unit row: empty under every label column
        factors = [unit_factor(u) for u in body[0]] + [1.0] * (len(header) - len(body[0]))
        body = body[1:]
    rows = []
    for cells in body:
        row = {}
        for name, cell, factor in zip(header, cells, factors):
            if is_metric_column(name):
                value = _number(cell)
                row[name] = None if value is None else value * factor
            else:
                row[name] = cell
        rows.append(row)
    return rows


# ---------------------------------------------------------------- aggregation

# aggregate key -> the metric summed over the step's kernels
TOTALS = {
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "l2_bytes": "lts__t_bytes.sum",
    "l2_read_sectors": "lts__t_sectors_op_read.sum",
    "l2_write_sectors": "lts__t_sectors_op_write.sum",
    "global_load_bytes": "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum",
    "global_store_bytes": "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum",
}
_TIME = "gpu__time_duration.sum"
_CATEGORY_TOTALS = {
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "l2_bytes": "lts__t_bytes.sum",
}


def _sum(rows: list[dict], metric: str) -> float | None:
    """Sum over rows; None when no row has the metric (not collected), n/a values skipped."""
    if not any(metric in row for row in rows):
        return None
    return math.fsum(row[metric] for row in rows if row.get(metric) is not None)


def aggregate(rows: list[dict]) -> dict:
    """Step totals of one report and, for kernel replay, per-category totals.

    ``replay`` is "kernel" (one row per kernel: ``kernel_count``, ``kernel_time_ms`` the sum of
    kernel durations, ``categories`` by categorize of "Kernel Name") or "range" (rows
    named ``range``, from ``--replay-mode app-range`` or ``range``: ``range_count``,
    ``range_time_ms``; no per-kernel numbers, so ``kernel_count``, ``kernel_time_ms`` and
    ``categories`` are None). A report that mixes both raises ValueError. Totals of a metric the
    report lacks are None; ``incomplete`` lists metrics that some rows report as n/a (their sums
    cover the other rows only).
    """
    ranges = sum(row.get("Kernel Name") == RANGE_NAME for row in rows)
    if 0 < ranges < len(rows):
        raise ValueError(
            f"the report mixes {ranges} range results with {len(rows) - ranges} kernel results; "
            "profile a config with one replay mode (kernel, or app-range / range)"
        )
    out: dict = {key: _sum(rows, metric) for key, metric in TOTALS.items()}
    time_ns = _sum(rows, _TIME)
    time_ms = None if time_ns is None else time_ns / 1e6
    out["replay"] = "range" if ranges else "kernel"
    if ranges:
        # app-range: the range's elapsed GPU time, idle gaps between kernels included (launch
        # overhead, host work), not the kernels' busy time; so is achieved_dram_gbps below.
        out.update(kernel_time_ms=None, range_time_ms=time_ms, kernel_count=None)
        out["range_count"] = ranges
    else:
        out.update(kernel_time_ms=time_ms, range_time_ms=None, kernel_count=len(rows))
        out["range_count"] = None
    dram = [out["dram_read_bytes"], out["dram_write_bytes"]]
    seconds = (time_ns or 0.0) / 1e9
    out["achieved_dram_gbps"] = (
        sum(dram) / seconds / GB if None not in dram and seconds > 0 else None
    )
    out["categories"] = None if ranges else _categories(rows, time_ns is not None)
    wanted = [*TOTALS.values(), _TIME]
    out["incomplete"] = sorted(
        m for m in wanted if any(m in row and row[m] is None for row in rows)
    )
    return out


def _categories(rows: list[dict], timed: bool) -> dict:
    """Per-category totals of a kernel replay's rows (every category, empty ones as zeros)."""
    by_category: dict[str, list[dict]] = {c: [] for c in KERNEL_CATEGORIES}
    for row in rows:
        by_category[categorize(row.get("Kernel Name", ""))].append(row)
    out = {}
    for category, members in by_category.items():
        entry = {}
        for key, metric in _CATEGORY_TOTALS.items():
            total = _sum(rows, metric)  # None for every category when the metric is missing
            entry[key] = None if total is None else (_sum(members, metric) or 0.0)
        time = (_sum(members, _TIME) or 0.0) if timed else None
        entry["time_ms"] = None if time is None else time / 1e6
        entry["count"] = len(members)
        out[category] = entry
    return out


def dram_bytes(entry: dict) -> float | None:
    """Read + write DRAM bytes of an aggregate or a category entry (None if not measured)."""
    read, write = entry.get("dram_read_bytes"), entry.get("dram_write_bytes")
    return None if read is None or write is None else read + write


def dram_lower_bound_bytes(
    num_params: int,
    batch: int,
    seq: int,
    hidden: int,
    num_layers: int,
    vocab: int,
    dtype_bytes: int = 4,
    activations_per_layer: int = 4,
) -> dict:
    """A lower bound of one standard (non-private) SGD step's DRAM traffic, in bytes.

    Counted once each, nothing else (so a measured step must move at least this much):
    - weights: read in forward, read again in backward (input gradients): 2·P
    - gradients: written once: P
    - plain SGD: read parameter and gradient, write parameter: 3·P
    - activations: per layer `activations_per_layer` tensors of B·T·hidden (default 4: the
      attention input after ln1, the attention output before out_proj, the MLP input after
      ln2, the block output), each written in forward and read once in backward; the MLP's
      inner activations and attention scores are not counted.
    - logits: B·T·V written by the LM head and read by the loss, and their gradient written
      by the loss and read by the LM head's backward: 4·B·T·V.
    Everything in `dtype_bytes` (4 for fp32). Adam, bf16 autocast copies and DP work are extra.
    """
    p = num_params * dtype_bytes
    tokens = batch * seq
    parts = {
        "weights_forward": p,
        "weights_backward": p,
        "gradients_write": p,
        "optimizer": 3 * p,
        "activations": 2 * activations_per_layer * num_layers * tokens * hidden * dtype_bytes,
        "logits": 4 * tokens * vocab * dtype_bytes,
    }
    parts["total"] = sum(parts.values())
    parts["assumptions"] = (
        f"{activations_per_layer} activations of B*T*hidden per layer written and read once; "
        "weights read twice, gradients written once, SGD reads param+grad and writes param; "
        f"logits and their gradient written and read once; {dtype_bytes}-byte elements"
    )
    return parts


# ---------------------------------------------------------------- loading reports


def _require_ncu(report_path: str, ncu: str | None) -> str:
    """``ncu``, else find_ncu(); ValueError when neither gives one (the report needs it)."""
    ncu = ncu or find_ncu()
    if ncu is None:
        raise ValueError(f"{report_path} must be exported to CSV, but {NCU_MISSING_MESSAGE}")
    return ncu


def export_report(report_path: str, ncu: str | None = None) -> str:
    """Export ``X.ncu-rep`` to ``X.csv`` next to it (atomically); return the CSV path."""
    ncu = _require_ncu(report_path, ncu)
    proc = subprocess.run(export_command(report_path, ncu), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"ncu --import {report_path} failed: {tail[0]}")
    path = report_path.removesuffix(".ncu-rep") + ".csv"
    write_text(path, proc.stdout)
    return path


def load_reports(input_dir: str) -> list[dict]:
    """One entry per report_<trainer>_bs<B>_seq<T> in input_dir: trainer, batch, seq, the
    aggregate (or ``error``). A .ncu-rep is exported first when its CSV is missing or older."""
    if not os.path.isdir(input_dir):
        raise ValueError(f"--input_dir must be an existing directory, got {input_dir!r}")
    stems = {}
    for path in glob.glob(os.path.join(input_dir, "report_*")):
        parsed = parse_report_name(path) if path.endswith((".ncu-rep", ".csv")) else None
        if parsed:
            stems[os.path.splitext(path)[0]] = parsed
    if not stems:
        raise ValueError(
            f"no report_<trainer>_bs<B>_seq<T>.ncu-rep or .csv files in {input_dir} "
            "(trainers: " + ", ".join(TRAINERS) + ")"
        )
    ncu = None
    entries = []
    for stem, (trainer, batch, seq) in stems.items():
        rep, csv_path = stem + ".ncu-rep", stem + ".csv"
        entry = {"trainer": trainer, "batch": batch, "seq": seq, "report": os.path.basename(stem)}
        stale = os.path.exists(rep) and (
            not os.path.exists(csv_path) or os.path.getmtime(csv_path) < os.path.getmtime(rep)
        )
        if stale:  # without ncu: a usage problem, not one bad report, so it stops here
            ncu = _require_ncu(rep, ncu)
        try:
            if stale:
                export_report(rep, ncu)
            # read_text: a regular file under the size cap, UTF-8 (a FIFO is refused, not read)
            entry.update(aggregate(parse_raw_csv(read_text(csv_path))))
            measured = entry["kernel_count"] or entry["range_count"]
            entry["error"] = None if measured else "no kernels in the report"
        except (OSError, RuntimeError, ValueError, csv.Error) as error:  # this report only
            entry["error"] = f"{type(error).__name__}: {error}"
        entries.append(entry)
    return sorted(entries, key=_order)


def _order(entry: dict) -> tuple:
    return (entry["batch"], entry["seq"], trainer_rank(entry["trainer"]))
