"""A run's report (report/summary.py and what it draws on) from result files alone: same-shape
comparisons, the tables, the files it writes, and a report that needs neither torch nor measure/."""

import csv
import json
import subprocess
import sys

from cli_helpers import ROOT

from dp_cost.core.schema import BREAKDOWN_KEYS, KERNEL_CATEGORIES
from dp_cost.report import summary as report
from dp_cost.report import tables
from dp_cost.report.results import shape_key, shape_label, shape_labels


def run_result(trainer, batch, peak, ms, lora=False, status="ok"):
    """A CUDA-like result.json of a run; the numbers are made up, not measurements."""
    config = {
        "trainer": trainer,
        "model": "1b",
        "batch_size": batch,
        "seq_len": 16,
        "physical_batch_size": None,
        "dtype": "bfloat16",
        "attention": "sdpa",
        "optimizer": "adamw",
        "use_lora": lora,
        "lora_rank": 8,
    }
    ok = status == "ok"
    return {
        "experiment": trainer,
        "config_dir": f"{trainer}_bs{batch}_seq16" + ("_lora" if lora else ""),
        "status": status,
        "error": None if ok else f"{status} why",
        "config": config,
        "avg_time_ms": ms if ok else None,
        "median_time_ms": ms if ok else None,
        "peak_memory_mb": peak if ok else None,
        "peak_reserved_mb": peak if ok else None,
        "breakdown": {k: peak / len(BREAKDOWN_KEYS) for k in BREAKDOWN_KEYS} if ok else None,
        "snapshots": [],
        "kernels": {c: {"time_ms": ms / 10, "count": 1} for c in KERNEL_CATEGORIES} if ok else None,
    }


RESULTS = [
    run_result("dpsgd", 2, 3000.0, 30.0),
    run_result("standard", 2, 1000.0, 10.0),
    run_result("standard", 2, 500.0, 5.0, lora=True),
    run_result("dpsgd", 2, 2000.0, 20.0, lora=True),
    run_result("ghost", 4, 0.0, 0.0, status="oom"),
]


def write_run(run_dir, results):
    for r in results:
        (run_dir / r["config_dir"]).mkdir(parents=True)
        (run_dir / r["config_dir"] / "result.json").write_text(json.dumps(r))


def test_each_config_is_compared_with_standard_at_its_own_shape():
    assert shape_key(RESULTS[0]["config"]) == shape_key(RESULTS[1]["config"])
    assert shape_key(RESULTS[1]["config"]) != shape_key(RESULTS[2]["config"])  # LoRA: its own
    rows = {(r["trainer"], r["model"]): r for r in tables.summary_rows(RESULTS)}
    assert rows["dpsgd", "1b"]["mem_vs_standard"] == 3.0
    assert rows["dpsgd", "1b r8"]["time_vs_standard"] == 4.0
    assert rows["ghost", "1b"]["mem_vs_standard"] is None  # no standard at batch 4
    assert [r["trainer"] for r in tables.summary_rows(RESULTS)[:2]] == ["standard", "dpsgd"]


def test_shape_label_spells_out_the_config_directory_abbreviations():
    """A plot title reads as words: no pb2, T16, r8, full or bfloat16 from the config directory."""
    lora = run_result("dpsgd", 4, 10.0, 5.0, lora=True)
    lora["config"] |= {"physical_batch_size": 2, "distributed": "ddp", "world_size": 2}
    assert shape_label(lora["config"]) == (
        "model 1b, batch 4, physical batch 2, sequence length 16, bf16, SDPA attention, "
        "LoRA r8, DDP on 2 ranks, AdamW"
    )
    full = run_result("dpsgd", 4, 10.0, 5.0)["config"] | {"dtype": "float32"}
    assert shape_label(full) == (
        "model 1b, batch 4, physical batch 4, sequence length 16, fp32, SDPA attention, "
        "full fine-tuning, AdamW"
    )


def test_shape_labels_split_what_configs_share_from_what_tells_them_apart():
    eager, lora = run_result("flash", 4, 10.0, 5.0), run_result("flash", 4, 10.0, 5.0, lora=True)
    graphed = run_result("flash", 4, 10.0, 4.0)
    graphed["config"]["cuda_graph"] = True
    common, labels = shape_labels([eager["config"], lora["config"], graphed["config"]])
    assert common == "model 1b, batch 4, physical batch 4, sequence length 16, bf16, " + (
        "SDPA attention, AdamW"
    )
    assert labels == [
        "full fine-tuning, eager (no CUDA graph)",
        "LoRA r8, eager (no CUDA graph)",
        "full fine-tuning, CUDA graph",
    ]
    assert shape_labels([eager["config"]]) == (shape_label(eager["config"]), [""])


def test_a_graphed_config_is_its_own_shape_with_its_own_label():
    """--cuda_graph changes what a step time means: eager and graphed configs are compared apart,
    and their labels and table rows say which is which."""
    eager, graphed = run_result("flash", 4, 10.0, 5.0), run_result("flash", 4, 10.0, 4.0)
    graphed["config"]["cuda_graph"] = True
    assert shape_key(eager["config"]) != shape_key(graphed["config"])
    assert shape_label(graphed["config"]) == shape_label(eager["config"]).replace(
        ", AdamW", ", CUDA graph, AdamW"
    )
    models = [row["model"] for row in tables.summary_rows([eager, graphed])]
    assert models == ["1b", "1b graph"]


def test_tables_share_one_renderer_with_a_rule_under_the_header():
    kernel = tables.format_kernel_table(tables.kernel_rows(RESULTS)).splitlines()
    assert kernel[0].split() == ["trainer", "batch", "seq", *KERNEL_CATEGORIES]
    assert set(kernel[1].replace(" ", "")) == {"-"}
    # full fine-tuning dpsgd: 3 ms per category, 2 more than standard; with LoRA: 2, 1.5 more
    assert kernel[3].startswith("dpsgd") and "2.0 (+1.5)" in kernel[3]
    assert kernel[5].startswith("dpsgd") and "3.0 (+2.0)" in kernel[5]
    summary = tables.format_table(tables.summary_rows(RESULTS)).splitlines()
    assert set(summary[1].replace(" ", "")) == {"-"}
    assert all(line == line.rstrip() for line in kernel + summary)
    markdown = tables.format_kernel_table(tables.kernel_rows(RESULTS), markdown=True)
    assert markdown.startswith("| trainer | batch | seq | gemm |")


BUSY = {"at_start": {"cpus": 2, "load": 3.5}, "at_end": {"cpus": 2, "load": 1.9}}


def test_write_summary_writes_every_file_from_the_result_files(tmp_path):
    write_run(tmp_path, RESULTS)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "result.json").write_text("{not json")
    (tmp_path / "run.json").write_text(json.dumps({"command": ["x"], "machine_load": BUSY}))
    results = report.load_results(str(tmp_path))
    assert len(results) == len(RESULTS)  # the unreadable file is skipped
    text = report.write_summary(str(tmp_path), results)
    assert "time_vs_standard" in text and "GPU kernel time per category" in text
    # the busy machine said where the table goes: the console, summary.md and report.html
    busy = "note: the machine was busy while this run measured (1-minute load average 3.5 at"
    assert busy in text.split("GPU kernel time")[0]
    assert busy in (tmp_path / "summary.md").read_text()
    assert busy in (tmp_path / "report.html").read_text()
    with open(tmp_path / "summary.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == tables.COLUMNS and len(list(reader)) == len(RESULTS)
    markdown = (tmp_path / "summary.md").read_text()
    assert "| trainer |" in markdown and "- ghost bs4 seq16: oom: oom why" in markdown
    assert "COMPONENT-LEVEL BREAKDOWN" in (tmp_path / "summary.txt").read_text()
    for name in ("memory_breakdown_comparison.png", "performance_tradeoff.png"):
        assert (tmp_path / "visualizations" / name).stat().st_size > 0
    assert not list(tmp_path.glob("memory_profile_*"))  # no sweep here


def test_report_imports_neither_torch_nor_measure():
    code = (
        "import sys\n"
        "from dp_cost.report import figures, html_report, plots, run_info, summary, sweep\n"
        "from dp_cost.report import trace_analysis\n"
        "heavy = ('torch', 'dp_cost.measure', 'trainers', 'models', 'matplotlib', 'numpy',\n"
        "         'hta', 'pandas', 'plotly')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_time_ratio_with_a_noisy_timing_is_not_shown_as_a_plain_number():
    """Steps spread over 10% of their median: the config's ratio against standard, and every
    ratio against a noisy standard, is shown flagged; the CSV keeps the number and the flag."""

    def with_steps(result, steps):
        return {**result, "step_times_ms": steps, "median_time_ms": sorted(steps)[1]}

    quiet_standard = with_steps(run_result("standard", 2, 1000.0, 10.0), [9.9, 10.0, 10.1])
    noisy_dpsgd = with_steps(run_result("dpsgd", 2, 3000.0, 30.0), [20.0, 30.0, 40.0])
    quiet_ghost = with_steps(run_result("ghost", 2, 2000.0, 20.0), [19.9, 20.0, 20.1])
    noisy_standard = with_steps(run_result("standard", 2, 500.0, 5.0, lora=True), [4.0, 5.0, 6.0])
    quiet_lora = with_steps(run_result("dpsgd", 2, 900.0, 15.0, lora=True), [15.0, 15.0, 15.1])
    rows = tables.summary_rows(
        [quiet_standard, noisy_dpsgd, quiet_ghost, noisy_standard, quiet_lora]
    )
    flagged = {(r["trainer"], r["model"]): r["time_ratio_noisy"] for r in rows}
    assert flagged == {("standard", "1b"): False, ("dpsgd", "1b"): True, ("ghost", "1b"): False,
                       ("standard", "1b r8"): False, ("dpsgd", "1b r8"): True}  # fmt: skip
    header, cells = tables.summary_cells(rows)
    shown = {(row[0], row[6]): row[header.index("time_vs_standard")] for row in cells}
    assert shown["dpsgd", "1b"] == "~3.00 NOISY" and shown["ghost", "1b"] == "2.00"
    assert shown["dpsgd", "1b r8"] == "~3.00 NOISY" and shown["standard", "1b"] == "1.00"
    assert "time_ratio_noisy" not in header  # its flag is in the ratio's cell
