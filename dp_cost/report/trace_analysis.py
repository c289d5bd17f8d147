"""trace_analysis.csv: what Holistic Trace Analysis (HTA, ``pip install holistictraceanalysis``,
imported as ``hta``) computes from the torch.profiler traces of a run, one row per config and
rank.

Each config directory's traces (one per rank in a distributed run, named ``rank<N>.*``; the
newest of each rank when there are several) are read by HTA one rank at a time: a rank's light
trace (``*.timeline.json[.gz]``: CUDA activity alone, of a step whose host no Python stacks,
shapes or memory events slowed, so what overlaps what on its GPU is as in the untraced steps)
where the run kept one, else its full trace (``*.pt.trace.json[.gz]``, whose recording can make a
host-bound step's GPU wait, and its collectives wait on the other ranks, more than untraced).
A row holds HTA's temporal breakdown of the rank's GPU time: the span from the first GPU
kernel's start to the last one's end, and in it the idle time (no kernel running), the compute
time (a computation kernel running) and the non-compute time (only communication or memory
kernels running), each in microseconds and as a percentage of the span; the communication time
(an NCCL kernel running, from HTA's kernel-type breakdown) and HTA's communication-computation
overlap (the share of the communication time during which a computation kernel ran too).

HTA has no differential-privacy categories: those stay in the kernel table (``result.json``'s
``kernels``, from ``core.kernel_names``). A CPU trace has no GPU kernels, so nothing to analyse:
its row says so (without reading it when the result's ``env`` says the device was the CPU).
HTA imports pandas, plotly and networkx (not torch): it is imported here only when a run has GPU
traces. Without it no trace_analysis.csv is written, for a CPU run too: the report writes
everything else and says, once, what to install.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
import warnings

from dp_cost.core.files import write_text
from dp_cost.core.kernel_names import TIMELINE_SUFFIXES, TRACE_SUFFIXES
from dp_cost.core.reading import folder_names, is_file_at, stat_at
from dp_cost.report.results import ordered
from dp_cost.report.tables import csv_text

TRACE_CSV = "trace_analysis.csv"
INSTALL_HINT = (
    "trace analysis (trace_analysis.csv) skipped: it needs `pip install holistictraceanalysis`"
)
COLUMNS = (
    "config_dir",
    "trainer",
    "rank",
    "trace_file",
    "gpu_span_us",
    "idle_us",
    "idle_pct",
    "compute_us",
    "compute_pct",
    "non_compute_us",
    "non_compute_pct",
    "communication_us",
    "communication_pct",
    "comm_comp_overlap_pct",
    "note",
)
# A trace this large would take minutes and many GiB as a pandas frame: left to HTA by hand.
MAX_TRACE_BYTES = 512 * 2**20
NO_GPU_NOTE = "no GPU kernels in the trace (a CPU run): nothing to analyse"
_RANK_FILE = re.compile(r"^rank(\d+)\.")  # measure.tracing's worker name under torch.distributed


def hta_installed() -> bool:
    return importlib.util.find_spec("hta") is not None


def _on_cpu(result: dict) -> bool:
    """Measured on the CPU (its worker said so): its trace has no GPU kernels, HTA not needed."""
    env = result.get("env")
    return isinstance(env, dict) and env.get("device") == "cpu"


def config_traces(run_dir: str, result: dict) -> dict[int, str]:
    """rank -> path of the config's trace to analyse: the rank's newest full trace, or its light
    trace where that is not older (the worker writes it after the full one: an older one is an
    earlier attempt's); {} without any."""
    directory = os.path.join(run_dir, result.get("config_dir") or "")
    if not result.get("config_dir"):
        return {}
    names = [n for n in folder_names(directory, run_dir) if not n.startswith(".")]
    paths = [os.path.join(directory, n) for n in names]
    paths = [p for p in paths if p.endswith(TRACE_SUFFIXES + TIMELINE_SUFFIXES)]
    paths = [p for p in paths if is_file_at(p, run_dir)]
    newest: dict[tuple[int, bool], tuple[float, str]] = {}  # (rank, light) -> (mtime, path)
    for path in paths:
        match = _RANK_FILE.match(os.path.basename(path))
        key = (int(match.group(1)) if match else 0, path.endswith(TIMELINE_SUFFIXES))
        newest[key] = max(newest.get(key, (-math.inf, "")), (stat_at(path, run_dir).st_mtime, path))
    traces = {}
    for rank in sorted({rank for rank, _ in newest}):
        full, light = newest.get((rank, False)), newest.get((rank, True))
        traces[rank] = (light if light and (not full or light[0] >= full[0]) else full)[1]
    return traces


def _number(value, digits: int = 2):
    """A finite float rounded (HTA's frames hold numpy numbers); None for NaN or missing."""
    if value is None:
        return None
    value = float(value)
    return round(value, digits) if math.isfinite(value) else None


def analyse_trace(path: str, rank: int = 0) -> dict:
    """HTA's temporal breakdown, communication time and communication-computation overlap of one
    rank's trace (the columns of ``COLUMNS`` from ``gpu_span_us`` on). Needs ``hta``."""
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis
    from hta.analyzers.communication_analysis import CommunicationAnalysis
    from hta.common.trace import Trace

    path = os.path.abspath(path)
    # One rank at a time in this process: HTA parses several ranks in a fork()ed pool.
    trace = Trace(trace_files={rank: path}, trace_dir=os.path.dirname(path))
    trace.load_traces(include_last_profiler_step=True, use_multiprocessing=False)
    events = trace.get_trace(rank)
    if "stream" not in events.columns or not events["stream"].ne(-1).any():
        return {"note": NO_GPU_NOTE}
    temporal = BreakdownAnalysis.get_temporal_breakdown(trace, visualize=False).iloc[0]
    kinds, _ = BreakdownAnalysis.get_gpu_kernel_breakdown(
        trace, visualize=False, include_memory_kernels=True
    )
    # exclusive time of each combination of kernel types running ("COMPUTATION overlapping
    # COMMUNICATION", ...): an NCCL kernel runs in every combination that names communication
    communication = float(kinds[kinds["kernel_type"].str.contains("COMMUNICATION")]["sum"].sum())
    span = float(temporal["kernel_time(us)"])
    row = {
        "gpu_span_us": _number(span),
        "idle_us": _number(temporal["idle_time(us)"]),
        "idle_pct": _number(temporal["idle_time_pctg"]),
        "compute_us": _number(temporal["compute_time(us)"]),
        "compute_pct": _number(temporal["compute_time_pctg"]),
        "non_compute_us": _number(temporal["non_compute_time(us)"]),
        "non_compute_pct": _number(temporal["non_compute_time_pctg"]),
        "communication_us": _number(communication),
        "communication_pct": _number(100 * communication / span) if span else None,
        "comm_comp_overlap_pct": None,
        "note": "",
    }
    if communication > 0:
        overlap = CommunicationAnalysis.get_comm_comp_overlap(trace, visualize=False)
        row["comm_comp_overlap_pct"] = _number(overlap["comp_comm_overlap_pctg"].iloc[0])
    else:
        row["note"] = "no communication kernels"
    return row


def _analysed(path: str, rank: int, run_dir: str) -> dict:
    """``analyse_trace``, or a note saying why not (HTA's logging and warnings kept quiet)."""
    if stat_at(path, run_dir).st_size > MAX_TRACE_BYTES:
        return {"note": f"not analysed: larger than {MAX_TRACE_BYTES // 2**20} MiB"}
    logger = logging.getLogger("hta")
    level = logger.level
    logger.setLevel(logging.ERROR)  # HTA logs every parse as a warning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return analyse_trace(path, rank)
    except Exception as error:  # any trace HTA cannot read must not stop the report
        return {"note": f"not analysed: {type(error).__name__}: {error}"}
    finally:
        logger.setLevel(level)


def trace_rows(run_dir: str, results: list[dict]) -> tuple[list[dict], str | None]:
    """One row per config and rank with a trace, and a line to print when HTA is needed but not
    installed ([] and None for a run without traces)."""
    traced = [(r, config_traces(run_dir, r)) for r in ordered(results)]
    traced = [(r, traces) for r, traces in traced if traces]
    if not traced:
        return [], None
    if not hta_installed():
        return [], INSTALL_HINT
    rows = []
    for result, traces in traced:
        for rank, path in traces.items():
            row = {
                "config_dir": result.get("config_dir"),
                "trainer": result["config"]["trainer"],
                "rank": rank,
                "trace_file": os.path.relpath(path, run_dir),
            }
            analysed = {"note": NO_GPU_NOTE} if _on_cpu(result) else _analysed(path, rank, run_dir)
            rows.append(row | analysed)
    return rows, None


def write_trace_analysis(run_dir: str, results: list[dict]) -> tuple[list[dict], str | None]:
    """Write ``<run_dir>/trace_analysis.csv`` when the run has traces and HTA is installed;
    return its rows and the line to print when HTA is missing."""
    rows, note = trace_rows(run_dir, results)
    if rows:
        write_text(os.path.join(run_dir, TRACE_CSV), csv_text(COLUMNS, rows))
    return rows, note
