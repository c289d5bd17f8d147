"""docs/capacity.md's worked-example table against the run it was made from
(tests/fixtures/capacity_worked_example.json, that run's capacity.json as
benchmarks/capacity_docs.py --store keeps it): the docs cannot drift from what the tool said."""

import json
import os

from dp_cost.capacity.card import FIT_RULES
from tests.cli_helpers import benchmark_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "capacity_worked_example.json")
DOC = os.path.join(ROOT, "docs", "capacity.md")


def script():
    return benchmark_script("capacity_docs.py")


def test_the_docs_hold_the_worked_examples_table_as_the_tool_planned_it(capsys):
    docs = script()
    assert docs.main([FIXTURE, "--check", DOC]) == 0, capsys.readouterr().out
    with open(FIXTURE) as f:
        configs = json.load(f)["configs"]
    assert {c["trainer"] for c in configs} == {"standard", "ghost", "flash"}
    assert {(c["model"], c["seq_len"], c["world_size"]) for c in configs} == {
        ("meta-llama/Llama-3.1-8B-Instruct", 2048, 8)
    }
    # the docs' reading of it: planned by the Poisson rule (a fit within the reserved peak)
    assert {c["fit_rule"] for c in configs} == {FIT_RULES[False]}


def test_a_changed_number_or_a_broken_run_is_caught(tmp_path, capsys):
    docs = script()
    with open(FIXTURE) as f:
        capacity = json.load(f)
    capacity["configs"][0]["predicted_peak_mb"] += 1000
    changed = tmp_path / "capacity.json"
    changed.write_text(json.dumps(capacity))
    assert docs.main([str(changed), "--check", DOC]) == 1
    broken = tmp_path / "broken.json"
    broken.write_text('{"configs": [{"trainer": "flash"}]}')
    capsys.readouterr()
    assert docs.main([str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
