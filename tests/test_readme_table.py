"""README.md's example table is what the summary code prints today: the table of the stored
--mode=test run (benchmarks/readme_run.json) rendered by report.tables, with the same columns
as summary.md and the CLI's table, in the same format. A change of the columns fails here until
``python benchmarks/readme_table.py`` writes README again."""

import json

from cli_helpers import benchmark_script

from dp_cost.report import tables


def readme_table_script():
    return benchmark_script("readme_table.py")


def test_readmes_table_is_the_summary_codes_table_of_the_stored_run():
    script = readme_table_script()
    with open(script.STORED) as f:
        stored = json.load(f)
    with open(script.README, encoding="utf-8") as f:
        text = f.read()
    assert script.START in text and script.END in text, "README has no table the script wrote"
    readme = script.readme_block(text)
    assert readme == script.block(stored), "stale: run python benchmarks/readme_table.py"
    header = next(line for line in readme.splitlines() if line.startswith("| trainer |"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == list(tables.SHOWN)
    assert {"epsilon", "delta_total", "dp_steps"} <= set(tables.SHOWN)
    # a --mode=test run: every trainer at the test grid, each config its own row
    assert stored["run"]["command"][1:2] == ["--mode=test"]
    assert len(stored["results"]) == 16 and all(r["status"] == "ok" for r in stored["results"])
