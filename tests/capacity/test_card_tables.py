"""benchmarks/card_tables.py: a card table's host costs fitted again, and several machines'
tables made one (each calibration step's host time the median), checked against medians and
lines worked out by hand; a table it cannot make is one error line and nothing written."""

import json
import os

import pytest

from dp_cost.capacity import card_rates
from tests.capacity.card_table import card_table
from tests.cli_helpers import ROOT, benchmark_script

SCRIPT = os.path.join(ROOT, "benchmarks", "card_tables.py")
PHASES = ("forward", "backward", "finish")


def run(*argv, capsys) -> tuple[int, str]:
    script = benchmark_script("card_tables.py")
    status = script.main([str(a) for a in argv])
    return status, capsys.readouterr().err


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
