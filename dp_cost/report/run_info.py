"""What produced a run, for the head of report.html: the command line, the date, the device and
the versions (torch, opacus, CUDA, Python, the toolkit's git commit).

Two sources, both optional:

- ``<run_dir>/run.json``, written by the CLI when the run starts (``RUN_FILE``), with
  ``command`` (a string, or the argv list), ``date`` (ISO 8601) and ``versions`` (a mapping:
  ``python``, ``torch``, ``opacus``, ``git_commit``, ...);
- each ``result.json``'s ``env``, written by the worker that measured the config: ``device``,
  ``torch``, ``opacus``, ``cuda`` (and ``python``, ``git_commit`` when recorded there).

What neither records is shown as "not recorded"; a date then falls back to the newest result
file's modification time, said to be that.
"""

from __future__ import annotations

import datetime
import os
import shlex

from dp_cost.core.reading import is_file_at, read_json_or_none, stat_at

RUN_FILE = "run.json"
NOT_RECORDED = "not recorded"
# (label, key in run.json's versions or a result's env), in the order shown
FIELDS = (
    ("device", "device"),
    ("torch", "torch"),
    ("opacus", "opacus"),
    ("CUDA", "cuda"),
    ("Python", "python"),
    ("toolkit git commit", "git_commit"),
)


def _text(value) -> str | None:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool) and str(value):
        return str(value)
    return None


def _command(run: dict) -> str | None:
    command = run.get("command", run.get("argv"))
    if isinstance(command, list) and command and all(isinstance(a, str) for a in command):
        return shlex.join(command)
    return _text(command)


def _newest_result_time(run_dir: str, results: list[dict]) -> str | None:
    times = []
    for r in results:
        path = os.path.join(run_dir, r.get("config_dir") or "", "result.json")
        if r.get("config_dir") and is_file_at(path, run_dir):
            times.append(stat_at(path, run_dir).st_mtime)
    if not times:
        return None
    when = datetime.datetime.fromtimestamp(max(times), tz=datetime.timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M UTC")


def run_info(run_dir: str, results: list[dict], warn=None) -> list[tuple[str, str]]:
    """(label, text) pairs: command line, date, then ``FIELDS``; "not recorded" where no file
    says. A value that differs between configs lists each one."""
    run = read_json_or_none(os.path.join(run_dir, RUN_FILE), warn=warn, root=run_dir)
    run = run if isinstance(run, dict) else {}
    versions = run.get("versions") if isinstance(run.get("versions"), dict) else {}
    date = _text(run.get("date"))
    if date is None:
        newest = _newest_result_time(run_dir, results)
        date = f"{NOT_RECORDED} (newest result file modified {newest})" if newest else None
    rows = [
        ("command line", _command(run) or NOT_RECORDED),
        ("date", date or NOT_RECORDED),
    ]
    envs = [r["env"] for r in results if isinstance(r.get("env"), dict)]
    for label, key in FIELDS:
        # what measured each config first; the run-level file for what no worker recorded
        values = [_text(env.get(key)) for env in envs]
        values = (
            list(dict.fromkeys(v for v in values if v))
            or [v for v in (_text(versions.get(key)), _text(run.get(key))) if v][:1]
        )
        if not values and key == "cuda" and envs and all(e.get("device") == "cpu" for e in envs):
            values = ["none (a CPU run)"]
        rows.append((label, " / ".join(values) if values else NOT_RECORDED))
    return rows


# A 1-minute load average beyond the run's own processes over this many runnable processes per
# CPU makes step times noisy: the timed steps share the cores with the rest.
BUSY_LOAD_PER_CPU = 0.5


def machine_load() -> dict:
    """{cpus, load}: the CPU count and the 1-minute load average (runnable processes) now; a
    value the OS does not give is None."""
    try:
        load = round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # no load average on this OS
        load = None
    return {"cpus": os.cpu_count(), "load": load}


def busy_note(at_start: dict, at_end: dict, own: int = 1) -> str | None:
    """One line saying the machine was busy while the run measured, or None. Both readings
    count the run's own ``own`` processes (its workers at the end; the CLI, and a run just
    before it, at the start): the note fires when the load beyond them exceeds half the CPUs."""
    cpus = at_start.get("cpus") or at_end.get("cpus")
    start, end = at_start.get("load"), at_end.get("load")
    if not cpus or start is None or end is None:
        return None
    if max(start, end) - own <= BUSY_LOAD_PER_CPU * cpus:
        return None
    return (
        f"note: the machine was busy while this run measured (1-minute load average {start:g} "
        f"at the start, {end:g} at the end, on {cpus} CPUs, about {own} of it this run's own): "
        "step times may be noisy, ratios of NOISY rows most of all"
    )


def _number(value) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def run_busy_note(run_dir: str, warn=None) -> str | None:
    """``busy_note`` of the run's latest measuring, from run.json's ``machine_load`` (the run's,
    or its last resume's); None where none is recorded."""
    run = read_json_or_none(os.path.join(run_dir, RUN_FILE), warn=warn)
    resumed = run.get("resumed") if isinstance(run, dict) else None
    latest = resumed[-1] if isinstance(resumed, list) and resumed else run
    load = latest.get("machine_load") if isinstance(latest, dict) else None
    if not isinstance(load, dict):
        return None
    readings = [load.get(moment) for moment in ("at_start", "at_end")]
    readings = [
        {key: _number(r.get(key)) for key in ("cpus", "load")} if isinstance(r, dict) else {}
        for r in readings
    ]
    return busy_note(*readings, own=int(_number(load.get("own_processes")) or 1))
