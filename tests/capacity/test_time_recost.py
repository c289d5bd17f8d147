"""benchmarks/time_recost.py: a kept run's configs planned again and costed with a table, beside
the step each run measured. Checked against the CLI's own prediction of the same config with the
same table (the planned step does not depend on which process plans it), and the error against
a measured time set by hand."""

import importlib.util
import json
import os

import pytest

from dp_cost.capacity import card_rates
from tests.cli_helpers import ROOT, SMALL_MODEL, in_process

SCRIPT = os.path.join(ROOT, "benchmarks", "time_recost.py")


def recost(*argv, capsys) -> tuple[int, str, str]:
    """The script's main in this process (its imports are the test's): (exit, stdout, stderr)."""
    spec = importlib.util.spec_from_file_location("time_recost", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    status = script.main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_a_kept_runs_steps_are_costed_again_beside_what_they_measured(tmp_path, capsys):
    run = in_process("--mode=capacity", "--trainers", "standard", "flash", "--batch_sizes", "4",
                     "--seq_lens", "16", *SMALL_MODEL, "--output_dir", tmp_path,
                     "--run_name", "r")  # fmt: skip
    assert run.returncode == 0, run.stderr
    predicted = {}
    for name in os.listdir(tmp_path / "r"):
        path = tmp_path / "r" / name / "result.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        step_ms = result["prediction"]["time"]["step_ms"]
        predicted[result["config"]["trainer"]] = step_ms
        # as a --validate run on the card keeps it: measured twice the prediction
        result.update(median_time_ms=2 * step_ms, step_times_ms=[2 * step_ms] * 3)
        path.write_text(json.dumps(result))
    (tmp_path / "r" / "broken").mkdir()
    (tmp_path / "r" / "broken" / "result.json").write_text("{not json")
    unplannable = {**result, "config": {"model": "no-such-model"}}  # measured, cannot be planned
    (tmp_path / "r" / "unplannable").mkdir()
    (tmp_path / "r" / "unplannable" / "result.json").write_text(json.dumps(unplannable))
    table = card_rates.card_rates("NVIDIA H200").path
    rows_file = tmp_path / "rows.json"
    capsys.readouterr()
    status, out, err = recost(tmp_path / "r", "--tables", table, "--out", rows_file, capsys=capsys)
    assert status == 0, err
    warnings = err.strip().splitlines()  # one line each, the rest costed
    assert len(warnings) == 2 and "broken" in warnings[0] and "unplannable" in warnings[1]
    rows = json.loads(rows_file.read_text())
    assert sorted(r["config"]["trainer"] for r in rows) == ["flash", "standard"]
    for row in rows:
        again = row["predicted_ms"][table]["step_ms"]
        assert again == pytest.approx(predicted[row["config"]["trainer"]], rel=1e-3)
        assert again / row["measured_ms"] - 1 == pytest.approx(-0.5, abs=1e-3)
    assert f"{table}: 0/2 within ±15%, 0/2 within ±25%; median error -50.0%" in out
    status, _, err = recost(tmp_path / "empty", capsys=capsys)
    assert status == 2 and err.startswith("error: no measured")
