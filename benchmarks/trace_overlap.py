"""Communication against computation in the traces of one distributed config, by Holistic Trace
Analysis (HTA): per rank, the share of communication kernel time that overlaps computation,
and the GPU's time in communication alone, computation alone and both (over the traced span).

HTA is not a dependency of the toolkit; it needs pandas < 3 (HTA 0.5 reads a DataFrame's ``cat``
column as an attribute, which pandas 3 no longer gives), so run it from its own environment:
    python -m venv /tmp/hta && /tmp/hta/bin/pip install HolisticTraceAnalysis "pandas<3"
    /tmp/hta/bin/python benchmarks/trace_overlap.py RUN_DIR/CONFIG_DIR [RUN_DIR/CONFIG_DIR ...]

A config directory holds, per rank, the traced step's full trace (rank<N>.<id>.pt.trace.json[.gz])
and, on CUDA, the light trace of one more step (rank<N>.timeline.json[.gz]: CUDA activity alone,
so the host no slower than untraced and the GPU timeline as in the timed steps) beside its
result files, which HTA would take for traces: the traces are passed to it by rank, the light
ones where the config has them (the full trace's Python stacks, shapes and memory events slowed
a 1b FSDP2 step from about 190 to 300 ms on 2 H200s, its GPU waiting on the host).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_cost.report.trace_analysis import config_traces  # noqa: E402 (no torch: HTA's env)


def rank_traces(config_dir: str) -> dict[int, str]:
    """rank -> the trace the report's trace analysis reads: its light trace, or its full trace
    where it has no light one as new (dp_cost.report.trace_analysis.config_traces)."""
    run_dir, name = os.path.split(os.path.normpath(config_dir))
    return config_traces(run_dir, {"config_dir": name})


def overlap(config_dir: str) -> str:
    from hta.trace_analysis import TraceAnalysis  # its own environment: see the docstring

    traces = rank_traces(config_dir)
    if not traces:
        return f"{config_dir}: no rank traces"
    analysis = TraceAnalysis(trace_files=traces, trace_dir=config_dir)
    shares = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    kernels = analysis.get_gpu_kernel_breakdown(visualize=False)[0].set_index("kernel_type")
    ms = kernels["sum"] / 1e3 / len(traces)  # HTA sums over the ranks: per rank
    kind = "light" if ".timeline.json" in next(iter(traces.values())) else "full"
    lines = [f"{config_dir} ({len(traces)} ranks, {kind} traces)"]
    lines.append(
        "  communication overlapped by computation, per rank: "
        + ", ".join(f"{r}: {p:.1f}%" for r, p in shares["comp_comm_overlap_pctg"].items())
    )
    for kind in ("COMMUNICATION", "COMPUTATION", "COMPUTATION overlapping COMMUNICATION"):
        lines.append(f"  {kind.lower()} alone" if " " not in kind else f"  {kind.lower()}")
        lines[-1] += f": {ms.get(kind, 0.0):.1f} ms a rank"
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    for config_dir in argv:
        print(overlap(config_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
