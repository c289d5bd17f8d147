"""README.md's example table: the summary.md table of a --mode=test run, rendered by the report's
own code (report.tables) from the run's stored result files (benchmarks/readme_run.json), with
a paragraph saying where and when the run was made, and README's picture of the run
(docs/images/performance_tradeoff.png, drawn by report.plots). A change of the summary's
columns or format is one command away from README, and tests/test_readme_table.py fails until
it is run.

usage: python benchmarks/readme_table.py            # README's table again, from the stored run
       python benchmarks/readme_table.py --measure  # run --mode=test here first (about a minute
                                                    # on 2 quiet cores) and store its results
       python benchmarks/readme_table.py --check    # exit 1 if README's table is not the one
                                                    # today's code renders (nothing written)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dp_cost.report import plots, summary, tables  # noqa: E402
from dp_cost.report.run_info import RUN_FILE, run_busy_note  # noqa: E402

README = os.path.join(ROOT, "README.md")
STORED = os.path.join(ROOT, "benchmarks", "readme_run.json")
PICTURE = os.path.join(ROOT, "docs", "images", "performance_tradeoff.png")
COMMAND = ["--mode=test"]  # README's first command, as the run is made
START = "<!-- readme_table.py: the paragraph and table below are written by it -->"
END = "<!-- /readme_table.py -->"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or "unknown CPU"


def measure() -> dict:
    """A --mode=test run made here, in a temporary folder: its results, run.json, and what
    the machine was (its CPU and the cores this process may use)."""
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "profiling_script.py", *COMMAND, "--output_dir", out]
        subprocess.run([*argv, "--run_name", "readme"], cwd=ROOT, check=True)
        run_dir = os.path.join(out, "readme")
        results = [dict(r) for r in summary.load_results(run_dir)]
        with open(os.path.join(run_dir, RUN_FILE)) as f:
            run = json.load(f)
        busy = run_busy_note(run_dir)
    machine = {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "busy_note": busy}
    return {"results": results, "run": run, "machine": machine}


def provenance(stored: dict) -> str:
    """The paragraph above the table: the command, the machine, the date and the commit."""
    machine, run = stored["machine"], stored["run"]
    date = datetime.datetime.fromisoformat(run["date"]).date().isoformat()
    commit = run.get("versions", {}).get("git_commit")
    dirty = bool(commit) and commit.endswith("+dirty")
    commit = (
        commit[:7] + (" (with uncommitted changes)" if dirty else "") if commit else "not recorded"
    )
    load = "busy: the run said so under its table" if machine["busy_note"] else "quiet"
    text = (
        f"The table below is the `summary.md` table of `python profiling_script.py "
        f"{' '.join(COMMAND)}`, run on {machine['cores']} cores of an {machine['cpu']} ({load}) "
        f"on {date}, commit {commit}. Its result files are "
        "stored in `benchmarks/readme_run.json`; `python benchmarks/readme_table.py` renders this "
        "table from them with the summary code of the day:"
    )
    return textwrap.fill(text, 100, break_long_words=False, break_on_hyphens=False)


def block(stored: dict) -> str:
    """README's lines between the markers: the paragraph and the Markdown table."""
    table = tables.format_table(tables.summary_rows(stored["results"]), markdown=True)
    return f"{START}\n{provenance(stored)}\n\n{table.rstrip()}\n{END}"


def draw_picture(stored: dict) -> None:
    """README's picture: the run's performance_tradeoff.png, drawn again from the stored results."""
    with tempfile.TemporaryDirectory() as run_dir:
        drawn = plots.plot_tradeoff(run_dir, stored["results"])
        with open(drawn, "rb") as f, open(PICTURE, "wb") as out:
            out.write(f.read())


def readme_block(text: str) -> str:
    """The marked block of README's text (ValueError without both markers)."""
    start, end = text.index(START), text.index(END) + len(END)
    return text[start:end]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true", help="run --mode=test here first")
    parser.add_argument("--check", action="store_true", help="compare only: exit 1 if stale")
    args = parser.parse_args(argv)
    if args.measure:
        stored = measure()
        with open(STORED, "w") as f:
            json.dump(stored, f, separators=(",", ":"))
            f.write("\n")
    with open(STORED) as f:
        stored = json.load(f)
    with open(README, encoding="utf-8") as f:
        text = f.read()
    new = block(stored)
    if args.check:
        same = readme_block(text) == new
        print("README.md's table is up to date" if same else "README.md's table is stale")
        return 0 if same else 1
    with open(README, "w", encoding="utf-8") as f:
        f.write(text.replace(readme_block(text), new))
    draw_picture(stored)
    print(f"README.md: {len(stored['results'])} rows from {os.path.relpath(STORED, ROOT)}; "
          f"{os.path.relpath(PICTURE, ROOT)} drawn again")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
