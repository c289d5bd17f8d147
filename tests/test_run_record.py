"""What produced a run is recorded beside it (run.json) and opens report.html: the command
line (a token on it hidden), the date, the versions; a resume adds its own command."""

import datetime
import json
import platform

import opacus
import torch
from cli_helpers import in_process, small_run_args


def test_run_json_records_the_command_date_and_versions(tmp_path):
    args = small_run_args(tmp_path, "standard")
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    proc = in_process(*args, "--token", "hf_abcdefghijklmnopqrstuvwxyz123456")
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "r" / "run.json").read_text())
    assert record["command"][0] == "profiling_script.py"
    assert record["command"][1:-2] == args and record["command"][-2:] == ["--token", "<hidden>"]
    assert before <= datetime.datetime.fromisoformat(record["date"])
    versions = record["versions"]
    assert versions["torch"] == torch.__version__ and versions["opacus"] == opacus.__version__
    assert versions["python"] == platform.python_version()
    page = (tmp_path / "r" / "report.html").read_text()
    assert "profiling_script.py --mode=test" in page and "hf_abcdef" not in page

    proc = in_process(*args, "--resume")
    assert proc.returncode == 0, proc.stderr
    resumed = json.loads((tmp_path / "r" / "run.json").read_text())
    assert resumed["command"] == record["command"] and resumed["date"] == record["date"]
    assert resumed["resumed"][0]["command"][-1] == "--resume"
