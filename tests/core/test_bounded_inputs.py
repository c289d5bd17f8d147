"""Every file the CLI reads (--token_file, --dataset_path, the files of --input_dir in
--mode=report and --mode=ncu_report, a run directory's files on --resume) is taken only as a
regular file under the cap its flag's --help states, read in bounded pieces: a FIFO, a device, a
directory, a file over the cap or a line over the cap is one error line (exit 2) or, inside a
run directory, that file skipped with one warning line; never a hang or a memory blow-up."""

import contextlib
import gzip
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc

import pytest
from cli_helpers import ROOT, SMALL_MODEL

import profiling_script
from dp_cost.core import reading
from dp_cost.core.reading import DATASET_MAX_BYTES, DATASET_MAX_LINE_BYTES
from dp_cost.core.schema import FINISHED
from dp_cost.measure import plan, plan_checks, processes, run
from dp_cost.report import summary as report

NCU_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "ncu_raw_small.csv")
KINDS = ("fifo", "device", "directory", "over_cap", "long_line")
NOT_REGULAR = ("fifo", "device", "directory")


class Hung(Exception):
    """A reader still blocked (on a FIFO's open) when the test's deadline passed."""


@contextlib.contextmanager
def deadline(seconds=5.0):
    """Fail instead of hanging: SIGALRM interrupts a blocked open() in this (main) thread."""

    def on_alarm(signum, frame):
        raise Hung(f"still reading after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def make_hostile(path, kind: str, cap: int, line_cap: int | None = None):
    """``path`` made a file no reader may take whole: a FIFO, /dev/zero, a directory, a sparse
    file one byte over ``cap`` (no disk used), or one line over ``line_cap`` (over ``cap`` when
    the file has no line cap of its own), without a newline."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.symlink("/dev/zero", path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "over_cap":
        with open(path, "wb") as f:
            f.truncate(cap + 1)
    elif kind == "long_line":
        with open(path, "wb") as f:
            f.write(b"x" * ((line_cap or cap) + 1))
    return path


def main_error(argv, capsys) -> str:
    """The one line ``main(argv)`` prints for a usage error (exit 2), within a deadline."""
    with deadline():
        code = profiling_script.main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def cap_words(cap: int) -> str:
    return f"larger than the cap of {reading.size_words(cap)}"


# ---------------------------------------------------------------- --token_file
@pytest.mark.parametrize("kind", KINDS)
def test_token_file_takes_only_a_small_regular_file(tmp_path, capsys, kind):
    path = make_hostile(tmp_path / "token", kind, reading.MAX_TOKEN_BYTES)
    line = main_error(["--mode=report", "--token_file", path, "--input_dir", tmp_path], capsys)
    reason = "not a regular file" if kind in NOT_REGULAR else cap_words(reading.MAX_TOKEN_BYTES)
    assert line.startswith(f"error: --token_file {path}: cannot read it ({reason}"), line
    assert f"at most {reading.size_words(reading.MAX_TOKEN_BYTES)}" in help_of("--token_file")


def test_token_file_holds_one_token_never_shown(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "unchanged")
    secret = "hf_SecretSecretSecret0123456789"
    for content in ("", "\n\n", f"{secret} {secret}\n", f"{secret}\nline\n", f"{secret}\0"):
        (tmp_path / "token").write_text(content)
        line = main_error(["--mode=report", "--token_file", tmp_path / "token"], capsys)
        assert "does not hold one token" in line and secret not in line
    (tmp_path / "token").write_text(f"  {secret}\n")
    args = profiling_script.parse_args(["--token_file", str(tmp_path / "token")])
    assert profiling_script.hf_token(args) == secret


def help_of(flag: str) -> str:
    """The --help text of one flag, on one line."""
    parser = profiling_script.build_parser()
    action = next(a for a in parser._actions if flag in a.option_strings)
    return " ".join(action.help.split())


# ---------------------------------------------------------------- --dataset_path
@pytest.mark.parametrize("kind", KINDS)
def test_dataset_path_takes_only_a_regular_file_of_bounded_lines(tmp_path, capsys, kind):
    path = make_hostile(tmp_path / "snli.jsonl", kind, DATASET_MAX_BYTES, DATASET_MAX_LINE_BYTES)
    out = tmp_path / "out"
    argv = ["--model", "tiny-llama", "--dataset_path", path, "--output_dir", out]
    line = main_error(argv, capsys)
    assert line.startswith(f"error: --dataset_path {path} ")
    reason = {
        "over_cap": f"is larger than the cap of {reading.size_words(DATASET_MAX_BYTES)}",
        "long_line": f"line 1: longer than the cap of {DATASET_MAX_LINE_BYTES // 2**20} MiB",
    }.get(kind, "is not a file (JSON lines expected): not a regular file")
    assert reason in line and not out.exists()
    text = help_of("--dataset_path")
    assert f"at most {DATASET_MAX_BYTES // 2**20} MiB" in text
    assert f"lines of at most {DATASET_MAX_LINE_BYTES // 2**20} MiB" in text


# ---------------------------------------------------------------- --input_dir, --mode=report
def a_result(trainer: str, peak: float = 100.0) -> dict:
    """A result.json a report draws (made-up numbers, not a measurement)."""
    config = {"trainer": trainer, "model": "tiny", "batch_size": 2, "seq_len": 8,
              "physical_batch_size": 2, "dtype": "float32", "attention": "explicit"}  # fmt: skip
    return {
        "experiment": trainer,
        "config_dir": f"{trainer}_bs2_seq8",
        "status": "ok",
        "error": None,
        "config": config,
        "median_time_ms": 10.0,
        "avg_time_ms": 10.0,
        "step_times_ms": [10.0, 10.0],
        "peak_memory_mb": peak,
        "snapshots": [],
    }


def write_results(run_dir, *results):
    for result in results:
        (run_dir / result["config_dir"]).mkdir(parents=True, exist_ok=True)
        (run_dir / result["config_dir"] / "result.json").write_text(json.dumps(result))


def reported_trainers(run_dir) -> list[str]:
    lines = (run_dir / "summary.csv").read_text().splitlines()
    return [line.split(",")[0] for line in lines[1:]]


def skip_warnings(err: str) -> dict[str, str]:
    """Config directory -> the reason of its one "skipped" warning line (a second one fails)."""
    found = {}
    for line in err.splitlines():
        if line.startswith("warning: skipped ") and line.count("/result.json: ") == 1:
            path, reason = line.removeprefix("warning: skipped ").split(": ", 1)
            name = os.path.basename(os.path.dirname(path))
            assert name not in found, f"two warnings for {name}"
            found[name] = reason
    return found


def test_report_skips_each_unreadable_result_with_one_warning(tmp_path, capsys):
    run_dir = tmp_path / "run[1]"  # a glob pattern's characters: a name, not a pattern
    write_results(run_dir, a_result("standard"), a_result("dpsgd", 300.0))
    for kind in KINDS:
        (run_dir / f"{kind}_bs2_seq8").mkdir()
        make_hostile(run_dir / f"{kind}_bs2_seq8" / "result.json", kind, reading.MAX_RESULT_BYTES)
    with deadline(20):
        code = profiling_script.main(["--mode=report", "--input_dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err
    reasons = skip_warnings(err)
    assert sorted(reasons) == sorted(f"{kind}_bs2_seq8" for kind in KINDS)
    for kind in NOT_REGULAR:
        assert reasons[f"{kind}_bs2_seq8"] == "not a regular file"
    for kind in ("over_cap", "long_line"):
        assert reasons[f"{kind}_bs2_seq8"].startswith(cap_words(reading.MAX_RESULT_BYTES))
    assert reported_trainers(run_dir) == ["standard", "dpsgd"]
    assert f"result.json over {reading.size_words(reading.MAX_RESULT_BYTES)}" in help_of(
        "--input_dir"
    )


def test_a_result_over_its_cap_is_refused_by_its_size_before_a_byte_is_read(tmp_path):
    """The cap of a result, not a trace's: 16 MiB + 1 byte of zeros (a sparse file) is refused
    holding less than a MiB (a read would hold the 16 MiB at least)."""
    (tmp_path / "standard_bs2_seq8").mkdir()
    path = tmp_path / "standard_bs2_seq8" / "result.json"
    make_hostile(path, "over_cap", reading.MAX_RESULT_BYTES)
    warnings = io.StringIO()
    tracemalloc.start()
    try:
        with pytest.raises(reading.UnreadableFile, match=cap_words(reading.MAX_RESULT_BYTES)):
            reading.read_result(path)
        assert report.load_results(str(tmp_path), warn=warnings) == []
        assert reading.read_json_or_none(path, warn=warnings) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20
    assert warnings.getvalue().count(f"warning: skipped {path}: ") == 2
    with pytest.raises(reading.UnreadableFile, match="not JSON"):  # a trace's cap: read
        reading.read_json(path)


def test_an_unreadable_result_warns_once_however_many_checks_read_it(tmp_path):
    """--resume reads an earlier result twice (the settings check, then what to keep): one
    warning line, until the file changes."""
    path = tmp_path / "result.json"
    path.write_text('{"status": ')
    warnings = io.StringIO()
    assert reading.read_json_or_none(path, warn=warnings) is None
    assert reading.read_json_or_none(path, warn=warnings) is None
    assert warnings.getvalue().count("\n") == 1
    path.write_text("[1, 2")
    assert reading.read_json_or_none(path, warn=warnings) is None
    assert warnings.getvalue().count("\n") == 2


# What the report of a run with one 200 MB result prints last: its exit code, wall time and peak
# resident memory, measured in its own process (this one's peak is the test suite's).
REPORT_AND_MEASURE = """
import json, resource, sys, time
# Before the fix this report parsed the 200 MB and took 4.6 GB: a MemoryError here instead of the
# test machine running out.
resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
import profiling_script
start = time.monotonic()
code = profiling_script.main(["--mode=report", "--input_dir", sys.argv[1]])
# This process's own peak (VmHWM): ru_maxrss would carry over the peak of the process that
# started it (Linux keeps it across fork and exec), here a test process of a GB or more.
status = open("/proc/self/status").read()
peak_kib = int(status.split("VmHWM:")[1].split()[0])
print(json.dumps({"code": code, "seconds": time.monotonic() - start, "peak_kib": peak_kib}))
"""


def test_a_200_mb_result_is_skipped_quickly_and_the_others_reported(tmp_path):
    write_results(tmp_path, a_result("standard"), a_result("dpsgd", 300.0))
    (tmp_path / "ghost_bs2_seq8").mkdir()
    huge = tmp_path / "ghost_bs2_seq8" / "result.json"
    floats = b"1.2345678901234567, " * 50_000  # 1 MB
    with open(huge, "wb") as f:
        f.write(b'{"status": "ok", "step_times_ms": [')
        for _ in range(200):
            f.write(floats)
        f.write(b"1.0]}")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", REPORT_AND_MEASURE, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads(proc.stdout.splitlines()[-1])
    assert measured["code"] == 0 and elapsed < 10 and measured["peak_kib"] < 2**20, measured
    assert proc.stderr.splitlines() == [
        f"warning: skipped {huge}: {cap_words(reading.MAX_RESULT_BYTES)}: 200000040 bytes"
    ]
    assert reported_trainers(tmp_path) == ["standard", "dpsgd"]
    assert f"{huge}: {cap_words(reading.MAX_RESULT_BYTES)}" in (tmp_path / "summary.md").read_text()


# ---------------------------------------------------------------- --input_dir, --mode=ncu_report
def test_ncu_report_names_each_unreadable_export_and_summarises_the_others(tmp_path, capsys):
    """A CSV export has no line cap of its own: a long line is a file over the cap."""
    shutil.copy(NCU_FIXTURE, tmp_path / "report_standard_bs8_seq256.csv")
    names = {"fifo": "dpsgd_bs8", "device": "ghost_bs8", "directory": "flash_bs8",
             "over_cap": "dpsgd_bs4"}  # fmt: skip
    for kind, name in names.items():
        make_hostile(tmp_path / f"report_{name}_seq256.csv", kind, reading.MAX_BYTES)
    with deadline(20):
        code = profiling_script.main(["--mode=ncu_report", "--input_dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0 and "Traceback" not in captured.out + captured.err
    not_measured = captured.out.split("Not measured", 1)[1].splitlines()
    for kind, name in names.items():
        reason = "not a regular file" if kind in NOT_REGULAR else cap_words(reading.MAX_BYTES)
        assert sum(f"- report_{name}_seq256: UnreadableFile: {reason}" in x for x in not_measured)
    assert not [line for line in not_measured if "report_standard" in line]
    assert f"ncu CSV export over {reading.size_words(reading.MAX_BYTES)}" in help_of("--input_dir")


# ---------------------------------------------------------------- --resume
def test_resume_over_unreadable_files_warns_once_each_and_measures_again(tmp_path, capsys):
    run_dir = tmp_path / "r"
    (run_dir / "standard_bs2_seq8").mkdir(parents=True)
    result = run_dir / "standard_bs2_seq8" / "result.json"
    result.write_text(json.dumps(a_result("standard"))[:50])  # cut short: not JSON
    make_hostile(run_dir / "run.json", "over_cap", reading.MAX_RESULT_BYTES)
    argv = ["--mode=test", "--trainers", "standard", "--batch_sizes", "2", "--seq_lens", "8",
            "--steps", "1", "--output_dir", tmp_path, "--run_name", "r", "--resume",
            *SMALL_MODEL]  # fmt: skip
    with deadline(60):
        code = profiling_script.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning: skipped")]
    assert len(warnings) == 2, err  # not once per check that reads the file
    assert warnings[0].startswith(f"warning: skipped {result}: not JSON (")
    assert warnings[1].startswith(
        f"warning: skipped {run_dir / 'run.json'}: {cap_words(reading.MAX_RESULT_BYTES)}"
    )
    assert json.loads(result.read_text())["status"] == "ok"
    assert "command" in json.loads((run_dir / "run.json").read_text())
    # the unfinished earlier attempt is not left beside the new result
    assert not list(result.parent.glob("*.previous"))


# ---------------------------------------------------------------- fuzzed files, every reader
def corruptions(good: bytes, rng: random.Random) -> list[bytes]:
    """Ways a file gets broken: cut short, bytes flipped, bytes inserted, a bare NaN, nesting,
    binary noise, a gzip of garbage or of too much, another JSON shape."""
    out = []
    for _ in range(6):
        cut = rng.randrange(len(good))
        out.append(good[:cut])
        flipped = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(len(good))] = rng.randrange(256)
        out.append(bytes(flipped))
        at = rng.randrange(len(good))
        out.append(good[:at] + bytes(rng.randrange(256) for _ in range(8)) + good[at:])
    out += [
        good.replace(b"10.0", b"NaN", 1),
        good.replace(b"10.0", b"-Infinity", 1),
        b"[" * 10_000 + b"]" * 10_000,
        bytes(rng.randrange(256) for _ in range(300)),
        b"\x1f\x8b\x08\x00" + bytes(rng.randrange(256) for _ in range(50)),
        gzip.compress(b" " * (reading.MAX_RESULT_BYTES + 1)),
        b"[1, 2, 3]",
        b'"ok"',
        b"null",
        b"",
    ]
    return out


def test_fuzzed_files_through_every_reader(tmp_path, capsys, monkeypatch):
    """Seeded corruptions of a result, run.json, a dataset line and a token file, and the
    hostile kinds: the report skips each bad result with one warning and reports the good one;
    --resume's readers take none of them and warn once per file; the dataset check names the
    line it corrupted (or accepts it); a token file is one token or one error line."""
    rng = random.Random(20240611)
    good = json.dumps(a_result("standard")).encode()
    run_dir = tmp_path / "run"
    write_results(run_dir, a_result("standard"))
    bad = corruptions(good, rng)
    for i, content in enumerate(bad):
        (run_dir / f"fuzz{i}_bs2_seq8").mkdir()
        (run_dir / f"fuzz{i}_bs2_seq8" / "result.json").write_bytes(content)
    for kind in KINDS:
        (run_dir / f"{kind}_bs2_seq8").mkdir()
        make_hostile(run_dir / f"{kind}_bs2_seq8" / "result.json", kind, reading.MAX_RESULT_BYTES)
    (run_dir / "run.json").write_bytes(bad[0])

    with deadline(30):
        code = profiling_script.main(["--mode=report", "--input_dir", str(run_dir)])
    captured = capsys.readouterr()
    assert code == 0 and "Traceback" not in captured.err + captured.out
    assert captured.err.count(f"warning: skipped {run_dir / 'run.json'}: not JSON") == 1
    skipped = skip_warnings(captured.err)
    loaded = report.load_results(str(run_dir), warn=io.StringIO())
    assert len(loaded) + len(skipped) == len(bad) + len(KINDS) + 1
    assert "standard_bs2_seq8" not in skipped and len(skipped) == len(loaded.skipped)
    assert {"fifo_bs2_seq8", "over_cap_bs2_seq8", f"fuzz{len(bad) - 1}_bs2_seq8"} <= set(skipped)

    # --resume: the two checks that read an earlier result take none of them, one warning per
    # file between them (a file that is still a result of other settings: one error line)
    args = ["--mode=test", "--trainers", "standard", "--batch_sizes", "2", "--seq_lens", "8",
            *SMALL_MODEL]  # fmt: skip
    config = plan.make_plan(profiling_script.parse_args(args), lambda: False).configs[0]
    broken = sorted(n for n in os.listdir(run_dir) if n.endswith("_bs2_seq8"))
    for i, name in enumerate(n for n in broken if n != "standard_bs2_seq8"):
        resumed = tmp_path / f"resume{i}" / config.config_dir
        resumed.mkdir(parents=True)
        os.replace(run_dir / name / "result.json", resumed / "result.json")
        with deadline():
            try:
                run.refuse_changed_settings([config], str(resumed.parent))
            except profiling_script.UsageError as error:
                assert "measured with other settings" in str(error)
            path = str(resumed / "result.json")
            kept = processes.finished_result(path, str(resumed.parent), resume=True)
        assert kept is None or kept["status"] in FINISHED
        err = capsys.readouterr().err
        assert err.count("\n") <= 1 and "Traceback" not in err, (name, err)

    # --dataset_path: one line of 10 corrupted: the error names that line, or the file passes
    line = json.dumps({"premise": "a b", "hypothesis": "c", "label": "neutral"}).encode()
    dataset = tmp_path / "snli.jsonl"
    for content in corruptions(line, rng):
        if b"\n" in content:
            continue  # one line stays one line
        number = rng.randint(1, 10)
        lines = [line] * 10
        lines[number - 1] = content
        dataset.write_bytes(b"\n".join(lines) + b"\n")
        try:
            assert plan_checks.check_dataset_file(str(dataset), 1) in (9, 10)
        except plan.UsageError as error:
            message = str(error)
            assert "\n" not in message and message.startswith(f"--dataset_path {dataset} ")
            assert f"line {number}: " in message, message

    # --token_file: one token set for the workers, or one error line without the file's content
    monkeypatch.setenv("HF_TOKEN", "unchanged")
    token = tmp_path / "token"
    secret = b"hf_abcdefghijklmnopqrstuvwxyz0123456789"
    for content in corruptions(secret + b"\n", rng):
        token.write_bytes(content)
        argv = ["--mode=ncu_report", "--token_file", token, "--input_dir", tmp_path / "no"]
        with deadline():
            assert profiling_script.main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and secret.decode() not in err
        assert err.startswith((f"error: --token_file {token}: ", "error: --input_dir"))
