"""ncu metric names: the default set, nvprof-era names and their ncu replacements, validation."""

from __future__ import annotations

import re

# Every one is valid on Hopper (sm_90); check a new one with `ncu --query-metrics`.
METRICS = (
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__bytes_read.sum.per_second",
    "dram__bytes_write.sum.per_second",
    "lts__t_bytes.sum",
    "lts__t_sectors_op_read.sum",
    "lts__t_sectors_op_write.sum",
    "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum",
    "gpu__time_duration.sum",
)

_L2_ATOM_RED = "lts__t_sectors_op_atom.sum + lts__t_sectors_op_red.sum"
_L2_ATOM_RED_RATE = "lts__t_sectors_op_atom.sum.per_second + lts__t_sectors_op_red.sum.per_second"
# nvprof-era names (older guides, profiling_script_ncu.py) -> what ncu collects instead, after
# NVIDIA's "nvprof metric comparison" table. A '+' / '2 *' formula means: collect those metrics and
# combine them; None: ncu has no equivalent.
NVPROF_TO_NCU: dict[str, str | None] = {
    "dram_read_throughput": "dram__bytes_read.sum.per_second",
    "dram_write_throughput": "dram__bytes_write.sum.per_second",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "dram_read_transactions": "dram__sectors_read.sum",
    "dram_write_transactions": "dram__sectors_write.sum",
    "dram_utilization": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_read_throughput": "lts__t_sectors_op_read.sum.per_second + " + _L2_ATOM_RED_RATE,
    "l2_write_throughput": "lts__t_sectors_op_write.sum.per_second + " + _L2_ATOM_RED_RATE,
    "l2_read_transactions": "lts__t_sectors_op_read.sum + " + _L2_ATOM_RED,
    "l2_write_transactions": "lts__t_sectors_op_write.sum + " + _L2_ATOM_RED,
    "l2_utilization": "lts__t_sectors.avg.pct_of_peak_sustained_elapsed",
    "l2_tex_read_throughput": "lts__t_sectors_srcunit_tex_op_read.sum.per_second",
    "l2_tex_write_throughput": "lts__t_sectors_srcunit_tex_op_write.sum.per_second",
    "l2_tex_read_transactions": "lts__t_sectors_srcunit_tex_op_read.sum",
    "l2_tex_write_transactions": "lts__t_sectors_srcunit_tex_op_write.sum",
    "l2_tex_hit_rate": "lts__t_sector_hit_rate.pct",
    "gld_throughput": "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum.per_second",
    "gst_throughput": "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum.per_second",
    "gld_transactions": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "gst_transactions": "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "gld_transactions_per_request": (
        "l1tex__average_t_sectors_per_request_pipe_lsu_mem_global_op_ld.ratio"
    ),
    "gst_transactions_per_request": (
        "l1tex__average_t_sectors_per_request_pipe_lsu_mem_global_op_st.ratio"
    ),
    "gld_efficiency": "smsp__sass_average_data_bytes_per_sector_mem_global_op_ld.pct",
    "gst_efficiency": "smsp__sass_average_data_bytes_per_sector_mem_global_op_st.pct",
    "gld_requested_throughput": None,
    "gst_requested_throughput": None,
    "local_load_throughput": "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum.per_second",
    "shared_load_transactions": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "shared_store_transactions": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
    "shared_load_throughput": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum.per_second",
    "shared_store_throughput": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum.per_second",
    "sysmem_read_throughput": "lts__t_sectors_aperture_sysmem_op_read.sum.per_second",
    "sysmem_write_throughput": "lts__t_sectors_aperture_sysmem_op_write.sum.per_second",
    "tex_cache_hit_rate": "l1tex__t_sector_hit_rate.pct",
    "achieved_occupancy": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "sm_efficiency": "smsp__cycles_active.avg.pct_of_peak_sustained_elapsed",
    "warp_execution_efficiency": "smsp__thread_inst_executed_per_inst_executed.ratio",
    "eligible_warps_per_cycle": "smsp__warps_eligible.sum.per_cycle_active",
    "branch_efficiency": "smsp__sass_average_branch_targets_threads_uniform.pct",
    "ipc": "smsp__inst_executed.avg.per_cycle_active",
    "issued_ipc": "smsp__inst_issued.avg.per_cycle_active",
    "inst_executed": "smsp__inst_executed.sum",
    "issue_slot_utilization": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "flop_count_sp": (
        "smsp__sass_thread_inst_executed_op_fadd_pred_on.sum + "
        "smsp__sass_thread_inst_executed_op_fmul_pred_on.sum + "
        "2 * smsp__sass_thread_inst_executed_op_ffma_pred_on.sum"
    ),
    "flop_sp_efficiency": (
        "smsp__sass_thread_inst_executed_ops_fadd_fmul_ffma_pred_on.avg.pct_of_peak_sustained_elapsed"
    ),
    "stall_memory_dependency": "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct",
}

# unit__counter[.rollup[.submetric]]: dram__bytes_read.sum.per_second, launch__grid_size
NCU_METRIC_NAME = re.compile(r"^[a-z0-9]+__[a-z0-9_]+(\.[a-z0-9_]+)*$")
_METRIC_PREFIXES = ("regex:", "group:", "breakdown:")  # also accepted by `ncu --metrics`


def metrics_in_formula(formula: str) -> list[str]:
    """The ncu metric names of a NVPROF_TO_NCU replacement ("a + b", "2 * c")."""
    return [t for t in re.split(r"[\s+*()]+", formula) if t and not t.isdigit()]


def translate_metrics(names) -> list[str]:
    """Validated ncu metric names from a list or a comma-separated string.

    ncu names pass through (duplicates dropped); an nvprof name raises ValueError naming its ncu
    replacement, and so does anything that is not shaped like an ncu metric.
    """
    if isinstance(names, str):
        names = names.split(",")
    out: list[str] = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if name in NVPROF_TO_NCU:
            replacement = NVPROF_TO_NCU[name]
            if replacement is None:
                raise ValueError(f"{name!r} is an nvprof metric with no ncu equivalent")
            raise ValueError(f"{name!r} is an nvprof metric; in ncu use {replacement}")
        if not (name.startswith(_METRIC_PREFIXES) or NCU_METRIC_NAME.match(name)):
            raise ValueError(
                f"{name!r} is not an ncu metric name (they look like dram__bytes_read.sum; "
                "list them with ncu --query-metrics)"
            )
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError("no metric names given")
    return out
