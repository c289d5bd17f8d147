"""benchmarks/card_tables.py: a card table's host costs fitted again, and several machines'
tables made one (each calibration step's host time the median), checked against medians and
lines worked out by hand; a table it cannot make is one error line and nothing written."""

import json
import os

import pytest
import torch

from dp_cost.capacity import card_rates
from tests.capacity.card_table import card_table
from tests.cli_helpers import ROOT, benchmark_main, benchmark_script

SCRIPT = os.path.join(ROOT, "benchmarks", "card_tables.py")
PHASES = ("forward", "backward", "finish")


def run(*argv, capsys) -> tuple[int, str]:
    status, _, err = benchmark_main("card_tables.py", *argv, capsys=capsys)
    return status, err


def measured(tmp_path, name: str, host_at: dict, ops_at: dict, sync_us=20.0):
    """A table whose standard row was measured at two depths: ``host_at`` / ``ops_at`` per
    depth, the same for every phase."""
    table = card_table(sync_us=sync_us)
    table["host"]["by_trainer"]["standard"]["by_depth"] = {
        str(blocks): {"host_us": dict.fromkeys(PHASES, float(host_at[blocks])),
                      "planned_ops": dict.fromkeys(PHASES, ops_at[blocks])}
        for blocks in host_at
    }  # fmt: skip
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(table))
    return path


def test_several_machines_tables_are_one_by_medians_then_fitted(tmp_path, capsys):
    ops = {2: 100, 6: 300}
    # three hosts: at 2 blocks 900, 600, 700 µs; at 6 blocks 1500, 1400, 1100
    paths = [measured(tmp_path, name, {2: at2, 6: at6}, ops, sync_us=sync)
             for name, at2, at6, sync in (("a", 900, 1500, 30.0), ("b", 600, 1400, 10.0),
                                          ("c", 700, 1100, 20.0))]  # fmt: skip
    out = tmp_path / "median.json"
    status, err = run("median", *paths, "--out", out, capsys=capsys)
    assert status == 0, err
    table = json.loads(out.read_text())
    row = table["host"]["by_trainer"]["standard"]
    assert row["by_depth"]["2"]["host_us"]["forward"] == 700  # median of 900, 600, 700
    assert row["by_depth"]["6"]["host_us"]["forward"] == 1400
    assert row["op_us"]["forward"] == pytest.approx((1400 - 700) / 200)  # the line through them
    assert row["fixed_us"]["forward"] == pytest.approx(700 - 3.5 * 100)
    assert table["host"]["sync_us"] == 20.0 and len(table["measured"]["host_median_of"]) == 3
    assert card_rates.load_card(str(out)).host_us("standard", "forward")[0] == pytest.approx(3.5)
    # a table that planned other steps (other op counts) is not merged: one line, nothing written
    other = measured(tmp_path, "other", {2: 700, 6: 1400}, {2: 100, 6: 301})
    refused = tmp_path / "refused.json"
    status, err = run("median", paths[0], other, "--out", refused, capsys=capsys)
    assert status == 2 and err.startswith("error: median:") and len(err.strip().splitlines()) == 1
    assert not refused.exists()


def test_a_refit_gives_the_shipped_tables_own_costs_and_refuses_a_table_without_depths(
    tmp_path, capsys
):
    shipped = card_rates.card_rates("NVIDIA H200").path
    out = tmp_path / "refit.json"
    status, err = run("refit", shipped, "--out", out, capsys=capsys)
    assert status == 0, err
    again = json.loads(out.read_text())["host"]["by_trainer"]
    for name, row in json.loads(open(shipped).read())["host"]["by_trainer"].items():
        assert (again[name]["op_us"], again[name]["fixed_us"]) == (row["op_us"], row["fixed_us"])
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(card_table()))  # no host times by depth
    before = bare.read_text()
    status, err = run("refit", bare, capsys=capsys)
    assert status == 2 and "by_depth" in err and bare.read_text() == before


def test_a_recount_counts_each_rows_calibration_step_again_and_keeps_its_host_times(
    tmp_path, capsys
):
    """Rows whose planned ops are wrong (twice the counts), recounted: each row's ops are again
    those the card counted when the shipped table was measured (one process: the tiny LM's
    standard, the tiny Llama's flash with LoRA; two ranks: standard under DDP), within 5% (a
    few ops differ between torch versions); the host times stay as measured and the fit is the
    line through them over the new counts."""
    shipped = json.loads(open(card_rates.card_rates("NVIDIA H200").path).read())
    depths = ("2", "6")

    def wrong(row: dict) -> dict:
        by_depth = {blocks: {"host_us": dict(row["by_depth"][blocks]["host_us"]),
                             "planned_ops": {phase: 2 * count for phase, count
                                             in row["by_depth"][blocks]["planned_ops"].items()}}
                    for blocks in depths}  # fmt: skip
        return {**row, "by_depth": by_depth}

    rows = ("standard", "flash+lora")
    table = json.loads(json.dumps(shipped))
    table["host"]["by_trainer"] = {
        name: wrong(shipped["host"]["by_trainer"][name]) for name in rows
    }
    ranks = table["collectives"] = {"2": table["collectives"]["2"]}
    ranks["2"]["host_by_trainer"] = {
        "standard@ddp": wrong(ranks["2"]["host_by_trainer"]["standard@ddp"])
    }
    path = tmp_path / "wrong.json"
    path.write_text(json.dumps(table))
    status, err = run("recount", path, capsys=capsys)
    assert status == 0, err
    again = json.loads(path.read_text())
    assert again["measured"]["host_recounted"]["command"].endswith("recount TABLE")
    assert again["measured"]["host_recounted"]["torch"] == torch.__version__
    pairs = [(again["host"]["by_trainer"][name], shipped["host"]["by_trainer"][name])
             for name in rows]  # fmt: skip
    pairs.append((again["collectives"]["2"]["host_by_trainer"]["standard@ddp"],
                  shipped["collectives"]["2"]["host_by_trainer"]["standard@ddp"]))  # fmt: skip
    for row, measured in pairs:
        for blocks in depths:
            counted, kept = row["by_depth"][blocks], measured["by_depth"][blocks]
            assert counted["host_us"] == kept["host_us"]
            for phase, count in kept["planned_ops"].items():
                assert counted["planned_ops"][phase] == pytest.approx(count, rel=0.05, abs=2)
            assert counted["syncs"] >= 0  # recorded for the next recount's check
        for phase in PHASES:
            fixed, per_op = row["fixed_us"][phase], row["op_us"][phase]
            if fixed > 0 and per_op > 0:  # the line through both depths' points
                for blocks in depths:
                    at = row["by_depth"][blocks]
                    line = fixed + per_op * at["planned_ops"][phase]
                    assert line == pytest.approx(at["host_us"][phase], rel=1e-3)


def test_a_recount_that_finds_other_syncs_than_it_recorded_refuses(tmp_path, capsys):
    """A sync's wait was taken off the host time it was measured with: a step that now waits for
    another number of syncs than the one recorded cannot be recounted (one line, nothing
    written)."""
    shipped = json.loads(open(card_rates.card_rates("NVIDIA H200").path).read())
    row = shipped["host"]["by_trainer"]["standard"]
    row["by_depth"]["2"]["syncs"] = 999
    shipped["host"]["by_trainer"] = {"standard": row}
    shipped.pop("collectives")
    path = tmp_path / "synced.json"
    path.write_text(json.dumps(shipped))
    before = path.read_text()
    status, err = run("recount", path, capsys=capsys)
    assert status == 2 and "'standard' at 2 blocks" in err and "999" in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and path.read_text() == before


def test_the_memory_ops_alone_go_into_a_table_without_other_outputs(capsys):
    """card_rates.py --memory_ops_into writes into the table it names: with --out or --quick
    it says so in one line and exits 2 before anything is measured."""
    script = benchmark_script("card_rates.py")
    for extra in (["--quick"], ["--out", "other.json"]):
        with pytest.raises(SystemExit) as stopped:
            script.parse(["--memory_ops_into", "table.json", *extra])
        assert stopped.value.code == 2
        assert "--memory_ops_into and --host_into write into their TABLE alone" in (
            capsys.readouterr().err
        )
    assert script.parse(["--memory_ops_into", "table.json"]).memory_ops_into == "table.json"
    for argv, said in (
        (["--host_into", "t.json", "--quick"], "write into their TABLE alone"),
        (["--host_into", "t.json", "--memory_ops_into", "t.json"], "one part of a table"),
        (["--memory_ops_into", "t.json", "--rounds", "2"], "measures no host rows"),
        (["--rounds", "0"], "--rounds: one or more"),
    ):
        with pytest.raises(SystemExit) as stopped:
            script.parse(argv)
        assert stopped.value.code == 2 and said in capsys.readouterr().err
    assert script.parse(["--host_into", "t.json"]).rounds == script.HOST_ROUNDS
    assert script.parse(["--host_into", "t.json", "--rounds", "5"]).rounds == 5


def test_host_rows_are_measured_in_interleaved_rounds_and_fitted_on_medians(monkeypatch):
    """card_rates.host_rows_by_rounds: each round measures every row at every depth in turn (so
    a host that slows down mid-run slows every row alike), each point is planned once, and each
    row is card_rates.fit_host of its points' medians over the rounds."""
    script = benchmark_script("card_rates.py")
    from dp_cost.capacity import fake_step

    plans = []

    def plan(config, *args, **kwargs):
        plans.append(config)
        return {"plan": len(plans)}

    monkeypatch.setattr(fake_step, "predict", plan)
    monkeypatch.setattr(script, "planned_op_counts", lambda step: ({}, step["plan"]))
    calls = []
    # the host's speed: 1x in round one, 2x slower in round two, 4x in round three: each
    # point's median is round two's (its mean 2.33x, its last round 4x)
    slowdown = {0: 1.0, 1: 2.0, 2: 4.0}
    per_op = {"standard": 10.0, "ghost": 20.0}

    def measure(config, sync_cost_us, planned):
        round_number = len(calls) // (2 * len(script.HOST_DEPTHS))
        calls.append((config.trainer, config.model, planned["plan"]))
        ops = {phase: 100 * depth_of(config) for phase in PHASES}
        host = {phase: slowdown[round_number] * per_op[config.trainer] * count + 500.0
                for phase, count in ops.items()}  # fmt: skip
        return host, ops

    def depth_of(config):
        from dp_cost.core.hf_architectures import HF_CONFIGS

        return HF_CONFIGS["tiny-llama"]["num_hidden_layers"]  # patched by card_rates.depth

    rows = {name: script.calibration_config(trainer, "hf", "cpu")
            for name, trainer in (("standard+hf", "standard"), ("ghost+hf", "ghost"))}  # fmt: skip
    fitted = script.host_rows_by_rounds(rows, 0.0, 3, measure=measure)
    depths = len(script.HOST_DEPTHS)
    assert len(plans) == 2 * depths and len(calls) == 3 * 2 * depths  # planned once a point
    trainers = [trainer for trainer, _, _ in calls]
    assert trainers == (["standard"] * depths + ["ghost"] * depths) * 3  # every row each round
    for name, config in rows.items():
        trainer = config.trainer
        # the medians: a line of slope 2x, fixed 500 µs
        assert fitted[name]["op_us"] == dict.fromkeys(PHASES, pytest.approx(2 * per_op[trainer]))
        assert fitted[name]["fixed_us"] == dict.fromkeys(PHASES, pytest.approx(500.0, abs=0.2))
        assert sorted(map(int, fitted[name]["by_depth"])) == sorted(script.HOST_DEPTHS)
    # each point's syncs are its own plan's (the stand-in counts a plan's number as its syncs)
    syncs = [point["syncs"] for name in rows for point in fitted[name]["by_depth"].values()]
    assert sorted(syncs) == list(range(1, 2 * depths + 1))


def host_width_rows(out, *flags, capsys) -> tuple[list[dict], str]:
    """benchmarks/host_width.py on the CPU for the standard trainer at 1 and 2 blocks: its rows
    (written to ``out``) and what it printed."""
    status, printed, err = benchmark_main(
        "host_width.py", "--device", "cpu", "--depths", "1", "2", "--trainers", "standard",
        "--out", out, *flags, capsys=capsys,
    )  # fmt: skip
    assert status == 0, err
    return json.loads(out.read_text()), printed


def test_host_width_fits_the_tiny_and_the_real_model_the_calibration_way(
    tmp_path, capsys, monkeypatch
):
    """benchmarks/host_width.py: per trainer and phase, each model's µs an op is card_rates'
    fit of its own points (the host time against the planned ops at each depth), and the ratio
    is the real model's over the tiny one's; a bad --model or --depths is one line, exit 2."""
    from dp_cost.core.hf_architectures import HF_CONFIGS

    # a "real" model the CPU steps quickly: the tiny Llama with a wider MLP (the same ops)
    tiny = HF_CONFIGS["tiny-llama"]
    wide = {**tiny, "intermediate_size": 2 * tiny["intermediate_size"]}
    monkeypatch.setitem(HF_CONFIGS, "tiny-llama-wide", wide)
    (row,), printed = host_width_rows(tmp_path / "rows.json", "--model", "tiny-llama-wide",
                                      capsys=capsys)  # fmt: skip
    assert row["trainer"] == "standard" and row["kind"] == "hf"
    assert (row["tiny"]["model"], row["real"]["model"]) == ("tiny-llama", "tiny-llama-wide")
    for model in ("tiny", "real"):
        points = {
            int(blocks): (point["host_us"], point["planned_ops"])
            for blocks, point in row[model]["by_depth"].items()
        }
        assert sorted(points) == [1, 2]
        assert points[2][1]["forward"] > points[1][1]["forward"]  # a block more, more ops
        fit = card_rates.fit_host(points)
        assert row[model]["op_us"] == pytest.approx(fit["op_us"], abs=2e-3)
    # the same architecture but its width both ways here: the same planned ops
    planned = [row[model]["by_depth"]["2"]["planned_ops"] for model in ("tiny", "real")]
    assert planned[0] == planned[1]
    for phase, ratio in row["op_us_ratio"].items():
        tiny, real = row["tiny"]["op_us"][phase], row["real"]["op_us"][phase]
        assert ratio == (real / tiny if tiny else None)
    assert "| standard | forward |" in printed and "tiny-llama-wide µs an op" in printed
    status, _, err = benchmark_main("host_width.py", "--model", "no-such", "--device", "cpu",
                                    capsys=capsys)  # fmt: skip
    assert status == 2 and err.startswith("error: --model no-such") and len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as stopped:
        benchmark_main("host_width.py", "--depths", "2", "2", capsys=capsys)
    assert stopped.value.code == 2


def test_one_part_of_a_table_is_measured_into_it_with_a_record_or_refused(
    tmp_path, capsys, monkeypatch
):
    """card_rates.into_table (--memory_ops_into, --host_into): the part measured goes into the
    table with a record of when and how, and the table reads back; another card's table is one
    error line and stays as it was."""
    script = benchmark_script("card_rates.py")
    shipped = json.loads(open(card_rates.card_rates("NVIDIA H200").path).read())
    path = tmp_path / "table.json"
    path.write_text(json.dumps(shipped))
    monkeypatch.setattr(script.torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")

    def measure(table):
        table["host"]["sync_us"] = 12.5
        return {"rounds": 3}

    table = script.into_table(str(path), "host_remeasured", measure, "the command")
    written = json.loads(path.read_text())
    assert table == written and written["host"]["sync_us"] == 12.5
    record = written["measured"]["host_remeasured"]
    assert record["rounds"] == 3 and record["command"] == "the command"
    assert {"date", "commit", "torch", "seconds"} <= set(record)
    assert card_rates.read_card(str(path)).host["sync_us"] == 12.5
    monkeypatch.setattr(script.torch.cuda, "get_device_name", lambda *a: "NVIDIA H100")
    before = path.read_text()
    capsys.readouterr()
    assert script.into_table(str(path), "host_remeasured", measure, "the command") is None
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'NVIDIA H100'" in err and len(err.splitlines()) == 1
    assert path.read_text() == before
    # a table that does not read (before measuring), or one the measurement broke: one line
    monkeypatch.setattr(script.torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert script.into_table(str(tmp_path / "none.json"), "k", measure, "c") is None
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1

    def breaks(table):
        del table["host"]
        return {}

    assert script.into_table(str(path), "host_remeasured", breaks, "the command") is None
    err = capsys.readouterr().err
    assert "left as it was" in err and len(err.splitlines()) == 1
    assert path.read_text() == before and not os.path.exists(str(path) + ".staged")


def test_host_width_steps_the_toolkits_lm_at_a_real_batch_with_its_optimizer(tmp_path, capsys):
    """benchmarks/host_width.py --model tiny --shape 3 8 --optimizer adam: the LM kind's rows,
    the real model stepped at (3, 8) against the calibration's (2, 16), both with Adam (its
    foreach ops in the finish); --lora with the LM is one error line."""
    (row,), _ = host_width_rows(tmp_path / "adam.json", "--model", "tiny", "--shape", "3", "8",
                                "--optimizer", "adam", capsys=capsys)  # fmt: skip
    assert row["kind"] == "lm" and row["real_shape"] == [3, 8]
    (plain,), _ = host_width_rows(tmp_path / "sgd.json", "--model", "tiny", capsys=capsys)
    assert plain["real_shape"] == [2, 16]
    finish = [r["tiny"]["by_depth"]["1"]["planned_ops"]["finish"] for r in (row, plain)]
    assert finish[0] > finish[1]  # Adam's step dispatches more than SGD's
    status, _, err = benchmark_main("host_width.py", "--model", "tiny", "--lora", "--device",
                                    "cpu", capsys=capsys)  # fmt: skip
    assert status == 2 and err.startswith("error: --model tiny") and len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as stopped:
        benchmark_main("host_width.py", "--shape", "0", "16", capsys=capsys)
    assert stopped.value.code == 2
