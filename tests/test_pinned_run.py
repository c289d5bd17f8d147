"""Nothing in behaviour changes: ``--mode=test`` (every trainer, the tiny model, its default
grid) against what the code before the move into ``dp_cost/`` wrote (commit 1770d28), pinned in
tests/fixtures/test_grid_pinned.json: the same config directories, the same result.json and
config keys, the same statuses, and every loss equal to 1e-6 relative (flash's losses re-pinned
once, when its CPU noise became the 64-bit Box-Muller transform: a meant change of its draws).

The losses are deterministic: the same seed gives bit-identical losses run after run, with 1 or
2 intra-op threads alike (the reference code's run with 1 thread equalled its run with 2, every
loss bit for bit). The fixture was made with one thread, the count conftest.py gives the test
processes, so the run here is made in this process (cli_helpers.in_process: its workers fork
from it with its thread count).

To pin again (only where a change of behaviour is meant), from a checkout of the reference code:
    OMP_NUM_THREADS=1 python profiling_script.py --mode=test --output_dir /tmp/p --run_name grid
    python tests/test_pinned_run.py /tmp/p/grid "commit ..."   # rewrites the fixture
"""

import copy
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # when run as a script

from cli_helpers import ROOT, in_process, results_in  # noqa: E402

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "test_grid_pinned.json")
COMMAND = ["--mode=test", "--run_name", "grid"]  # and --output_dir
REL = 1e-6
# Result keys the current code may write beyond the pinned ones. Add a key here (with the change
# that adds it) when a new result field is meant.
# python_gc: collections over the timed steps; clipping: the DP trainers' clipping rule;
# flash_checkpointing: what flash does with checkpointed blocks (null without checkpointing)
KNOWN_ADDITIONS: frozenset[str] = frozenset({"python_gc", "clipping", "flash_checkpointing"})
# Config keys added since, with the value a measuring run must record for them: the capacity
# mode's settings (a --mode=test run predicts nothing).
KNOWN_CONFIG_ADDITIONS = {
    "capacity": False, "gpu_memory": None, "find_max_batch": False, "validate": False,
    "find_max_seq_len": False, "fsdp_sync": "chunk", "clipping": "flat", "host_work": False,
    "noise_sampler": "opacus", "card": "NVIDIA H200", "epochs": None,
    "recommend": False,
}  # fmt: skip


def summarise(run_dir) -> dict:
    """Config directory -> {result_keys, config_keys, status, losses} of a finished run."""
    return {
        name: {
            "result_keys": sorted(result),
            "config_keys": sorted(set(result["config"]) - set(KNOWN_CONFIG_ADDITIONS)),
            "config_additions": {k: result["config"].get(k) for k in KNOWN_CONFIG_ADDITIONS},
            "status": result["status"],
            "losses": result["losses"],
        }
        for name, result in results_in(run_dir).items()
    }


def threads_of(run_dir) -> int:
    """The intra-op thread count the run's workers had (env.threads, the same in every config)."""
    (threads,) = {result["env"]["threads"] for result in results_in(run_dir).values()}
    return threads


def load_pinned(path=FIXTURE) -> dict:
    with open(path) as f:
        return json.load(f)


def differences(pinned: dict, got: dict, known_additions=KNOWN_ADDITIONS, rel=REL) -> list[str]:
    """Every way ``got`` (a summarise() of a run) departs from ``pinned["configs"]``: one line
    each; empty when the run behaves as pinned."""
    want = pinned["configs"]
    out = []
    if sorted(got) != sorted(want):
        out.append(f"config directories: missing {sorted(set(want) - set(got))}, "
                   f"new {sorted(set(got) - set(want))}")  # fmt: skip
    for name in sorted(set(want) & set(got)):
        w, g = want[name], got[name]
        added = set(g["result_keys"]) - set(w["result_keys"])
        removed = set(w["result_keys"]) - set(g["result_keys"])
        if removed or added - set(known_additions):
            out.append(f"{name}: result keys removed {sorted(removed)}, "
                       f"added {sorted(added - set(known_additions))}")  # fmt: skip
        if g["config_keys"] != w["config_keys"]:
            out.append(f"{name}: config keys {g['config_keys']} != {w['config_keys']}")
        if g["status"] != w["status"]:
            out.append(f"{name}: status {g['status']!r} != {w['status']!r}")
        if len(g["losses"]) != len(w["losses"]):
            out.append(f"{name}: {len(g['losses'])} losses != {len(w['losses'])}")
            continue
        for step, (a, b) in enumerate(zip(g["losses"], w["losses"], strict=True)):
            if a is None or b is None or abs(a - b) > rel * abs(b):
                out.append(f"{name}: loss of step {step} {a!r} != {b!r} (rel {rel})")
    return out


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    """The current code's ``--mode=test`` run, with the fixture's thread count."""
    pinned = load_pinned()
    assert torch.get_num_threads() == pinned["threads"]  # what the forked workers inherit
    out = tmp_path_factory.mktemp("pinned")
    proc = in_process(*COMMAND, "--output_dir", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / "grid"


def test_test_mode_grid_behaves_as_pinned(grid_run):
    """The grid against the fixture; then what else its one run shows (a run of the grid costs
    most of a minute on 2 cores: one test, so pytest-xdist never runs it twice)."""
    pinned = load_pinned()
    assert threads_of(grid_run) == pinned["threads"]
    got = summarise(grid_run)
    assert differences(pinned, got) == []
    assert all(g["config_additions"] == KNOWN_CONFIG_ADDITIONS for g in got.values())
    # in this test, not tests of their own: pytest-xdist could run those on the other worker,
    # which would make the whole grid run again
    measured_configs_record_python_collections_over_their_timed_steps(grid_run)
    readmes_test_and_report_lines_are_this_run(grid_run)


def measured_configs_record_python_collections_over_their_timed_steps(grid_run):
    measured = [r for r in results_in(grid_run).values() if r.get("median_time_ms") is not None]
    assert measured
    for result in measured:
        collections = result["python_gc"]
        assert len(collections["collections"]) == 3 and collections["ms"] >= 0
        assert all(isinstance(n, int) and n >= 0 for n in collections["collections"])


def readmes_test_and_report_lines_are_this_run(grid_run):
    """README's --mode=test line is the pinned run's command, and its report line, given this
    run, renders it again."""
    from test_readme_commands import page_commands

    readme = page_commands("README.md")
    assert f"python profiling_script.py {COMMAND[0]}" in readme
    (report_line,) = [c for c in readme if "--mode=report" in c]
    assert report_line == "python profiling_script.py --mode=report --input_dir runs/<run>"
    proc = in_process("--mode=report", "--input_dir", grid_run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"Summary written to {grid_run}/summary.csv" in proc.stdout


def test_the_comparison_fails_on_each_kind_of_change(tmp_path):
    """The comparison of the test above, fed perturbed copies of the fixture."""
    pinned = load_pinned()
    configs = pinned["configs"]
    assert len(configs) == 16 and all(c["status"] == "ok" for c in configs.values())
    assert all(len(c["losses"]) == 3 for c in configs.values())
    same = copy.deepcopy(configs)
    assert differences(pinned, same) == []
    name = sorted(configs)[0]

    def perturbed(change) -> list[str]:
        """The differences of the fixture from a copy of it (written to and read back from
        tmp_path) that ``change`` altered."""
        altered = copy.deepcopy(pinned)
        change(altered["configs"])
        path = tmp_path / "altered.json"
        path.write_text(json.dumps(altered))
        return differences(pinned, load_pinned(str(path))["configs"])

    def scale_loss(factor):
        def change(c):
            c[name]["losses"][1] *= factor

        return change

    assert perturbed(scale_loss(1 + 1e-7)) == []  # within 1e-6
    assert perturbed(scale_loss(1 + 1e-5)) == [
        f"{name}: loss of step 1 {configs[name]['losses'][1] * (1 + 1e-5)!r} != "
        f"{configs[name]['losses'][1]!r} (rel 1e-06)"
    ]
    assert len(perturbed(lambda c: c[name]["losses"].pop())) == 1
    assert len(perturbed(lambda c: c[name]["losses"].__setitem__(0, None))) == 1
    assert perturbed(lambda c: c[name].update(status="error")) == [
        f"{name}: status 'error' != 'ok'"
    ]
    assert len(perturbed(lambda c: c.pop(name))) == 1
    assert len(perturbed(lambda c: c.update(extra=c[name]))) == 1
    assert len(perturbed(lambda c: c[name]["config_keys"].append("new_setting"))) == 1
    assert len(perturbed(lambda c: c[name]["result_keys"].remove("losses"))) == 1
    added = lambda c: c[name]["result_keys"].append("new_field")
    assert "new_field" in perturbed(added)[0]
    # A new result key passes only where the test lists it as a known addition.
    altered = copy.deepcopy(configs)
    altered[name]["result_keys"].append("new_field")
    assert differences(pinned, altered, known_additions={"new_field"}) == []


if __name__ == "__main__":  # python tests/test_pinned_run.py RUN_DIR [SOURCE]: rewrite the fixture
    run_dir = sys.argv[1]
    fixture = {
        "source": sys.argv[2] if len(sys.argv) > 2 else None,  # the code that made it
        "command": "python profiling_script.py " + " ".join(COMMAND) + " --output_dir DIR",
        "threads": threads_of(run_dir),
        "configs": summarise(run_dir),
    }
    with open(FIXTURE, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"{FIXTURE}: {len(fixture['configs'])} configs")
