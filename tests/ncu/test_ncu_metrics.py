"""ncu.metrics: the default metrics, nvprof-era names and their ncu replacements, validation."""

import pytest

from dp_cost.ncu import metrics


@pytest.mark.parametrize("name", sorted(metrics.NVPROF_TO_NCU))
def test_nvprof_names_map_to_ncu_names(name):
    replacement = metrics.NVPROF_TO_NCU[name]
    if replacement is None:
        with pytest.raises(ValueError, match="no ncu equivalent"):
            metrics.translate_metrics([name])
        return
    for metric in metrics.metrics_in_formula(replacement):
        assert metric in metrics.METRICS or metrics.NCU_METRIC_NAME.match(metric), metric
        assert metric not in metrics.NVPROF_TO_NCU
    with pytest.raises(ValueError) as error:
        metrics.translate_metrics(f"dram__bytes_read.sum,{name}")
    assert str(error.value) == f"{name!r} is an nvprof metric; in ncu use {replacement}"


def test_seed_names_are_known():
    for name in ("dram_read_throughput", "dram_write_throughput", "l2_read_throughput",
                 "l2_write_throughput", "gld_throughput", "gst_throughput", "achieved_occupancy",
                 "sm_efficiency", "dram_read_bytes", "gld_transactions",
                 "gst_transactions"):  # fmt: skip
        assert name in metrics.NVPROF_TO_NCU
    assert metrics.NVPROF_TO_NCU["dram_read_throughput"] == "dram__bytes_read.sum.per_second"
    assert metrics.NVPROF_TO_NCU["dram_write_bytes"] == "dram__bytes_write.sum"
    assert metrics.NVPROF_TO_NCU["gst_throughput"] == (
        "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum.per_second"
    )
    assert metrics.NVPROF_TO_NCU["achieved_occupancy"] == (
        "sm__warps_active.avg.pct_of_peak_sustained_active"
    )
    assert metrics.metrics_in_formula(metrics.NVPROF_TO_NCU["l2_read_throughput"]) == [
        "lts__t_sectors_op_read.sum.per_second",
        "lts__t_sectors_op_atom.sum.per_second",
        "lts__t_sectors_op_red.sum.per_second",
    ]


def test_valid_names_pass():
    assert metrics.translate_metrics(list(metrics.METRICS)) == list(metrics.METRICS)
    assert metrics.translate_metrics(
        " dram__bytes_read.sum , dram__bytes_read.sum,regex:lts__.*"
    ) == ["dram__bytes_read.sum", "regex:lts__.*"]
    with pytest.raises(ValueError, match="not an ncu metric"):
        metrics.translate_metrics("dram_bytes")
    with pytest.raises(ValueError, match="no metric"):
        metrics.translate_metrics(" , ")
