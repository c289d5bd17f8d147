"""benchmarks/time_recost.py: a kept run's configs planned again and costed with a table, beside
the step each run measured. Checked against the CLI's own prediction of the same config with the
same table (the planned step does not depend on which process plans it), and the error against
a measured time set by hand."""

import json
import os

import pytest

from dp_cost.capacity import card_rates, fake_step
from tests.cli_helpers import ROOT, SMALL_MODEL, benchmark_main, in_process

SCRIPT = os.path.join(ROOT, "benchmarks", "time_recost.py")


def recost(*argv, capsys) -> tuple[int, str, str]:
    """The script's main in this process (its imports are the test's): (exit, stdout, stderr)."""
    return benchmark_main("time_recost.py", *argv, capsys=capsys)


def test_a_kept_runs_steps_are_costed_again_beside_what_they_measured(tmp_path, capsys):
    run = in_process("--mode=capacity", "--trainers", "standard", "flash", "--batch_sizes", "4",
                     "--seq_lens", "16", *SMALL_MODEL, "--max_physical_batch_sizes", "4", "2",
                     "--output_dir", tmp_path, "--run_name", "r")  # fmt: skip
    assert run.returncode == 0, run.stderr
    predicted = {}
    for name in os.listdir(tmp_path / "r"):
        path = tmp_path / "r" / name / "result.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        step_ms = result["prediction"]["time"]["step_ms"]
        physical = result["config"]["max_physical_batch_size"]
        predicted[result["config"]["trainer"], physical] = step_ms
        # as a --validate run on the card keeps it: measured twice the prediction; at physical
        # 2, as a measuring run (--mode=profile) keeps it, with no prediction: its 2 chunks
        # are read from its config
        result.update(median_time_ms=2 * step_ms, step_times_ms=[2 * step_ms] * 3)
        if physical == 2:
            del result["prediction"]
        else:
            validated = result  # the other files below are made from one with its prediction
        path.write_text(json.dumps(result))
    # measured with batches drawn at random and no plan of them: nothing to cost, no warning
    sampled = {key: value for key, value in validated.items() if key != "prediction"}
    sampled["config"] = {**validated["config"], "model": "tiny-llama", "poisson": True}
    (tmp_path / "r" / "sampled").mkdir()
    (tmp_path / "r" / "sampled" / "result.json").write_text(json.dumps(sampled))
    (tmp_path / "r" / "broken").mkdir()
    (tmp_path / "r" / "broken" / "result.json").write_text("{not json")
    # measured, cannot be planned
    unplannable = {**validated, "config": {**validated["config"], "model": "no-such-model"}}
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
    costed = {(r["config"]["trainer"], r["config"]["max_physical_batch_size"]): r for r in rows}
    assert len(rows) == 4 and sorted(costed) == sorted(predicted)
    for key, row in costed.items():
        again = row["predicted_ms"][table]["step_ms"]
        assert row["chunks"] == 4 // key[1]
        assert again == pytest.approx(predicted[key], rel=1e-3)
        assert again / row["measured_ms"] - 1 == pytest.approx(-0.5, abs=1e-3)
        assert row["kernels_ms"] is None and row["timeline_ms"] is None  # untraced
    assert "GPU-busy" not in out
    assert f"{table}: 0/4 within ±15%, 0/4 within ±25%; median error -50.0%" in out
    status, _, err = recost(tmp_path / "empty", capsys=capsys)
    assert status == 2 and err.startswith("error: no measured")


def test_a_traced_runs_gpu_time_is_split_by_kind_beside_the_plans(tmp_path, capsys):
    """A traced run's kernel categories (result["kernels"]) summed into GEMMs, attention,
    torch.optim's step and the rest, beside the plan's GPU ms of the same kinds, which add up
    to the GPU's busy time the time model plays; the optimizer's foreach step costs time."""
    # 5 chunks: the plan records 3, the 2 others cost as its middle one
    run = in_process("--mode=capacity", "--trainers", "standard", "--batch_sizes", "10",
                     "--seq_lens", "16", *SMALL_MODEL, "--max_physical_batch_sizes", "2",
                     "--output_dir", tmp_path, "--run_name", "r")  # fmt: skip
    assert run.returncode == 0, run.stderr
    (path,) = (tmp_path / "r").glob("*/result.json")
    result = json.loads(path.read_text())
    step_ms = result["prediction"]["time"]["step_ms"]
    categories = {"gemm": 1.0, "attention": 0.0, "elementwise": 2.0, "reduction": 0.5,
                  "norm_clip": 0.0, "optimizer": 0.25, "other": 0.125}  # fmt: skip
    result["kernels"] = {name: {"time_ms": ms, "count": 1} for name, ms in categories.items()}
    # the light trace's step: the host's span, its waits on the GPU, the GPU's busy time
    result["step_timeline"] = {"wall_time_ms": 9.0, "host_time_ms": 7.5, "host_wait_ms": 0.75,
                               "gpu_busy_ms": 3.25, "gpu_busy_fraction": 3.25 / 9.0}  # fmt: skip
    # NCCL's kernels (a rank's) are the collectives' time, not the other kernels'
    result.update(median_time_ms=step_ms, step_times_ms=[step_ms] * 3, communication_time_ms=0.5)
    path.write_text(json.dumps(result))
    rows_file = tmp_path / "rows.json"
    capsys.readouterr()
    table = card_rates.card_rates("NVIDIA H200").path
    status, out, err = recost(tmp_path / "r", "--tables", table, "--out", rows_file, capsys=capsys)
    assert status == 0, err
    (row,) = json.loads(rows_file.read_text())
    assert row["kernels_ms"] == {"gemm": 1.0, "attention": 0.0, "optimizer": 0.25, "other": 2.125}
    assert row["chunks"] == 5 and result["prediction"]["time"]["chunks"] == 5
    predicted = row["predicted_ms"][table]
    planned = predicted["kernels_ms"]
    assert sum(planned.values()) == pytest.approx(predicted["gpu_ms"], rel=1e-3, abs=2e-3)
    assert planned["gemm"] > 0 and planned["optimizer"] > 0
    line = next(line for line in out.splitlines() if "by kind" in line)
    assert f"optimizer {planned['optimizer']:.1f} / 0.2" in line and "other" in line
    assert row["timeline_ms"] == {"host": 7.5, "host_wait": 0.75, "gpu_busy": 3.25}
    line = next(line for line in out.splitlines() if "GPU-busy" in line)
    assert f"host {predicted['host_ms']:.1f} / 7.5 (waiting on the GPU 0.8)" in line
    assert line.endswith(f"GPU {predicted['gpu_ms']:.1f} / 3.2")


def test_pooled_machines_measure_a_config_by_the_median_of_all_its_steps(
    tmp_path, capsys, monkeypatch
):
    """--pool: a config run on two machines (a folder each) is measured as the goal does, the
    median of its steps on both; planned once; one run on one machine alone is not pooled."""
    run = in_process("--mode=capacity", "--trainers", "standard", "flash", "--batch_sizes", "4",
                     "--seq_lens", "16", *SMALL_MODEL, "--output_dir", tmp_path,
                     "--run_name", "r")  # fmt: skip
    assert run.returncode == 0, run.stderr
    made = {}
    for path in (tmp_path / "r").glob("*/result.json"):
        result = json.loads(path.read_text())
        made[result["config"]["trainer"]] = (path.parent.name, result)
    # standard on both machines: A's steps 0.5, 0.6, 0.7 and B's 1.3, 1.4, 1.5 x the prediction,
    # so each machine alone is 40% off and the six steps' median (0.7 + 1.3) / 2 is exact;
    # flash on machine A only
    steps = {("A", "standard"): [0.5, 0.6, 0.7], ("B", "standard"): [1.3, 1.4, 1.5],
             ("A", "flash"): [1.0, 1.0, 1.0]}  # fmt: skip
    predicted = {}
    for (machine, trainer), factors in steps.items():
        name, result = made[trainer]
        predicted[trainer] = step_ms = result["prediction"]["time"]["step_ms"]
        times = [f * step_ms for f in factors]
        folder = tmp_path / machine / "r" / name
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(
            json.dumps({**result, "median_time_ms": times[1], "step_times_ms": times})
        )
    table = card_rates.card_rates("NVIDIA H200").path
    planned = []  # the configs the script plans: standard's once for both machines
    monkeypatch.setattr(fake_step, "predict", lambda config, *a, _predict=fake_step.predict, **k:
                        planned.append(config.trainer) or _predict(config, *a, **k))  # fmt: skip
    capsys.readouterr()
    status, out, err = recost(tmp_path / "A", tmp_path / "B", "--tables", table, "--pool",
                              capsys=capsys)  # fmt: skip
    assert status == 0, err
    assert sorted(planned) == ["flash", "standard"]
    assert f"{table}: 1/3 within ±15%, 1/3 within ±25%" in out  # per machine: 3 rows
    (line,) = [line for line in out.splitlines() if line.startswith("pooled ")]
    assert made["standard"][0] in line and "on 2 machines" in line
    assert f"measured {predicted['standard']:.1f} ms" in line
    assert f"{table}, pooled over machines: 1/1 within ±15%" in out
    # without --pool: no pooled lines
    _, out, _ = recost(tmp_path / "A", tmp_path / "B", "--tables", table, capsys=capsys)
    assert not [line for line in out.splitlines() if line.startswith("pooled ")]
    assert "pooled over machines" not in out


def test_a_record_of_earlier_machines_is_pooled_with_these_runs(tmp_path, capsys):
    """--recorded: configs an earlier session measured elsewhere (their medians by machine and
    pooled step, kept as JSON) are costed again against the record's pooled step and against the
    median of every machine's median, the record's and these runs'; a record naming configs not
    run here skips them; a broken record is one error line, exit 2."""
    run = in_process("--mode=capacity", "--trainers", "standard", "flash", "--batch_sizes", "4",
                     "--seq_lens", "16", *SMALL_MODEL, "--output_dir", tmp_path,
                     "--run_name", "r")  # fmt: skip
    assert run.returncode == 0, run.stderr
    predicted, names = {}, {}
    for path in (tmp_path / "r").glob("*/result.json"):
        result = json.loads(path.read_text())
        trainer = result["config"]["trainer"]
        predicted[trainer] = step_ms = result["prediction"]["time"]["step_ms"]
        names[trainer] = f"r/{path.parent.name}"
        # this machine: standard as predicted, flash twice as slow
        times = [step_ms * (1.0 if trainer == "standard" else 2.0)] * 3
        folder = tmp_path / "A" / "r" / path.parent.name
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(
            json.dumps({**result, "median_time_ms": times[1], "step_times_ms": times})
        )
    # the record: standard pooled 2 x slow (its machines 1.0 and 1.1 x), flash as predicted
    standard = predicted["standard"]
    record = {"configs": {
        names["standard"]: {"pooled_ms": 2.0 * standard,
                            "machine_medians_ms": [standard, 1.1 * standard]},
        names["flash"]: {"pooled_ms": predicted["flash"],
                         "machine_medians_ms": [predicted["flash"], predicted["flash"]]},
        "r/not_run_here": {"pooled_ms": 1.0, "machine_medians_ms": [1.0]},
    }}  # fmt: skip
    kept = tmp_path / "record.json"
    kept.write_text(json.dumps(record))
    table = card_rates.card_rates("NVIDIA H200").path
    status, out, err = recost(tmp_path / "A", "--tables", table, "--recorded", kept,
                              capsys=capsys)  # fmt: skip
    assert status == 0, err
    assert f"{table}: 1/2 within ±15%" in out  # this machine alone: flash 50% fast
    assert f"{table}, against the record's pooled steps: 1/2 within ±15%" in out
    # standard: medians 1.0, 1.1 and 1.0 x; flash: 1.0, 1.0 and 2.0 x: both 1.0 x
    assert (
        f"{table}, against the median of every machine's median (the record's and these "
        "runs'): 2/2 within ±15%, 2/2 within ±25%; median error +0.0%" in out
    )
    broken = tmp_path / "broken.json"
    for configs in ({"r/x": {"pooled_ms": "fast"}}, [1, 2],
                    {"r/x": {"pooled_ms": 1.0, "machine_medians_ms": "123"}},
                    {"r/x": {"pooled_ms": 0, "machine_medians_ms": [1.0]}},
                    {"r/x": {"pooled_ms": 1.0, "machine_medians_ms": []}},
                    {"r/x": {"pooled_ms": 1.0}}):  # fmt: skip
        broken.write_text(json.dumps({"configs": configs}))
        status, _, err = recost(tmp_path / "A", "--recorded", broken, capsys=capsys)
        assert status == 2 and err.startswith("error: --recorded"), (configs, err)
        assert len(err.splitlines()) == 1
