"""No write follows a symbolic link planted in a run directory: every file and folder the toolkit
writes there, a link in its place is refused (the CLI: one error line, exit 2) and the link's
target is left as it was. Checked against the target's bytes and ``os.lstat``, not the code's
own account; then the helper in ``core.files`` that every write goes through."""

import json
import os
import shutil
import stat

import pytest
import torch
from cli_helpers import ROOT, in_process, small_run_args

from dp_cost.core import files, rundir
from dp_cost.core.files import UnsafePath
from dp_cost.measure import steps, tracing

PRECIOUS = b"bytes outside the run that no write may touch\n"
CONFIG = "standard_bs2_seq8"
# What a --mode=test run of one config writes in its run directory, folders aside.
RUN_FILES = (".lock", "run.json", f"{CONFIG}/result.json")
REPORT_FILES = (
    "summary.csv",
    "summary.md",
    "summary.txt",
    "trace_analysis.csv",
    "visualizations/memory_curve.png",
    "visualizations/performance_tradeoff.png",
    "report.html",
)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished run (one config) to copy: --resume on the copy measures nothing again."""
    output = tmp_path_factory.mktemp("finished")
    proc = in_process(*small_run_args(output, "standard"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {*RUN_FILES, *REPORT_FILES} <= {
        os.path.relpath(os.path.join(d, f), output / "r")
        for d, _, fs in os.walk(output / "r")
        for f in fs
    }
    return output / "r"


@pytest.fixture
def run(tmp_path, finished_run):
    """A copy of the finished run at ``<tmp>/out/r``, and a folder outside it with a victim."""
    shutil.copytree(finished_run, tmp_path / "out" / "r", symlinks=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim").write_bytes(PRECIOUS)
    return tmp_path / "out" / "r"


def plant(link, target):
    """``link`` made a symbolic link to ``target``, whatever was there before."""
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    elif os.path.lexists(link):
        link.unlink()
    os.symlink(target, link)


def again(run, how):
    """The same run resumed, or its report re-rendered."""
    if how == "resume":
        return in_process(*small_run_args(run.parent, "standard"), "--resume")
    return in_process("--mode=report", "--input_dir", run)


def assert_refused(proc, link, target):
    """Exit 2 with one error line naming the link; the link still there, pointing where it did."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert str(link) in lines[0] and "symbolic link" in lines[0], lines[0]
    assert stat.S_ISLNK(os.lstat(link).st_mode) and os.readlink(link) == str(target)


def assert_untouched(outside):
    assert sorted(os.listdir(outside)) == ["victim"]
    assert (outside / "victim").read_bytes() == PRECIOUS


@pytest.mark.parametrize(
    "name, how",
    [(name, "resume") for name in RUN_FILES + REPORT_FILES]
    + [(name, "report") for name in REPORT_FILES],
)
def test_a_link_in_place_of_a_file_is_refused(run, name, how):
    victim = run.parent.parent / "outside" / "victim"
    plant(run / name, victim)
    assert_refused(again(run, how), run / name, victim)
    assert_untouched(victim.parent)


@pytest.mark.parametrize("how", ["resume", "report"])
def test_a_link_in_place_of_the_visualizations_folder_is_refused(run, how):
    outside = run.parent.parent / "outside"
    plant(run / "visualizations", outside)
    proc = again(run, how)
    assert_refused(proc, run / "visualizations", outside)
    assert_untouched(outside)
    assert (run / "summary.csv").is_file()  # written before the plots: the tables are kept


def test_a_link_in_place_of_a_config_directory_is_refused(run):
    # A link leading outside the run was refused before; one to a folder inside it was entered.
    elsewhere = run / "elsewhere"
    elsewhere.mkdir()
    plant(run / CONFIG, elsewhere)
    assert_refused(again(run, "resume"), run / CONFIG, elsewhere)
    assert os.listdir(elsewhere) == []


def test_a_resumed_run_directory_that_is_a_link_is_refused(run):
    other = run.parent / "other"
    other.mkdir()
    plant(run, other)
    assert_refused(again(run, "resume"), run, other)
    assert os.listdir(other) == []


def test_a_dangling_lock_link_creates_nothing(run):
    missing = run.parent.parent / "outside" / "created"
    plant(run / ".lock", missing)
    assert_refused(again(run, "resume"), run / ".lock", missing)
    assert not os.path.lexists(missing)


def test_a_lock_hard_linked_to_another_file_is_not_truncated(run):
    victim = run.parent.parent / "outside" / "victim"
    (run / ".lock").unlink()
    os.link(victim, run / ".lock")
    proc = again(run, "resume")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "hard links" in proc.stderr
    assert_untouched(victim.parent)


def test_links_planted_at_the_old_predictable_temporary_names_are_not_followed(run):
    """atomic_write's temporaries were <name>.tmp<pid>: a link there took the file's bytes."""
    victim = run.parent.parent / "outside" / "victim"
    names = ["run.json", *REPORT_FILES]
    for name in names:
        os.symlink(victim, run / f"{name}.tmp{os.getpid()}")
    proc = again(run, "resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_untouched(victim.parent)
    assert all(os.readlink(run / f"{name}.tmp{os.getpid()}") == str(victim) for name in names)
    assert json.loads((run / "run.json").read_text())["resumed"]


@pytest.mark.parametrize("kind", ["loop", "dangling"])
def test_an_output_dir_that_is_a_broken_link_is_one_clear_line(tmp_path, kind):
    output = tmp_path / "runs"
    if kind == "loop":
        os.symlink(tmp_path / "back", output)
        os.symlink(output, tmp_path / "back")
    else:
        os.symlink(tmp_path / "missing" / "runs", output)
    proc = in_process(*small_run_args(output, "standard"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    phrase = "symbolic link loop" if kind == "loop" else "symbolic link to a missing path"
    assert lines[0].startswith(f"error: --output_dir {output}") and phrase in lines[0]
    assert not (tmp_path / "missing").exists()


# ---------------------------------------------------------------- what the CLI cannot reach on CPU


def outside_victim(tmp_path):
    (tmp_path / "outside").mkdir()
    victim = tmp_path / "outside" / "victim"
    victim.write_bytes(PRECIOUS)
    return victim


@pytest.mark.parametrize(
    "name", ["memory_snapshot.pickle", "memory_timeline.html", "breakdown_recording.json.gz"]
)
def test_a_memory_snapshot_is_never_written_through_a_link(tmp_path, name):
    victim = outside_victim(tmp_path)
    config = tmp_path / "run" / CONFIG
    config.mkdir(parents=True)
    os.symlink(victim, config / name)
    with pytest.raises(UnsafePath, match="symbolic link"):
        steps.save_snapshot(str(config), {"segments": [], "device_traces": [[]]}, {})
    assert os.path.islink(config / name)
    assert_untouched(victim.parent)
    # ... nor into a config directory that is a link
    (config / name).unlink()
    os.rename(config, tmp_path / "run" / "moved")
    os.symlink(tmp_path / "outside", config)
    with pytest.raises(UnsafePath, match="symbolic link"):
        steps.save_snapshot(str(config), {"segments": [], "device_traces": [[]]}, {})
    assert_untouched(victim.parent)


def test_traces_are_never_written_into_a_linked_config_directory(tmp_path):
    victim = outside_victim(tmp_path)
    (tmp_path / "run").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "run" / CONFIG)
    with pytest.raises(UnsafePath, match="symbolic link"):
        tracing.trace_steps(
            lambda: torch.ones(2).sum(),
            torch.device("cpu"),
            str(tmp_path / "run" / CONFIG),
            use_gzip=False,
        )
    assert_untouched(victim.parent)


def test_a_trace_is_published_whole_and_never_over_a_link(tmp_path):
    victim = outside_victim(tmp_path)
    config = tmp_path / "run" / CONFIG
    config.mkdir(parents=True)
    os.symlink(victim, config / "trace.1.pt.trace.json")
    with files.staging(str(config), root=str(tmp_path / "run"), prefix=".trace-") as stage:
        # The writer reaches the staging folder by a path: still this folder if it is renamed.
        os.rename(config / stage.name, config / "renamed")
        with open(os.path.join(stage.path, "trace.2.pt.trace.json"), "w") as f:
            f.write("[]")
        with open(os.path.join(stage.path, "trace.1.pt.trace.json"), "w") as f:
            f.write("[]")
        os.rename(config / "renamed", config / stage.name)
        assert stage.publish("trace.2.pt.trace.json") == str(config / "trace.2.pt.trace.json")
        with pytest.raises(UnsafePath, match="symbolic link"):
            stage.publish("trace.1.pt.trace.json")
    assert (config / "trace.2.pt.trace.json").read_text() == "[]"
    assert sorted(os.listdir(config)) == ["trace.1.pt.trace.json", "trace.2.pt.trace.json"]
    assert_untouched(victim.parent)


SWEEP_WRITTEN = (
    "memory_profile_results.json",
    "detailed_memory_results.json",
    "memory_profile_summary.csv",
    "visualizations/memory_analysis_overview.png",
)


@pytest.mark.parametrize("name", SWEEP_WRITTEN)
def test_a_sweep_report_never_writes_through_a_link(run, name):
    result_path = run / CONFIG / "result.json"
    result = json.loads(result_path.read_text())
    result["config"]["detailed_memory"] = True  # a Hugging Face sweep's result: its files too
    result_path.write_text(json.dumps(result))
    victim = run.parent.parent / "outside" / "victim"
    plant(run / name, victim)
    assert_refused(again(run, "report"), run / name, victim)
    assert_untouched(victim.parent)


NCU_EXPORT = os.path.join(ROOT, "tests", "fixtures", "ncu_raw_small.csv")


@pytest.mark.parametrize(
    "name",
    ["ncu_summary.csv", "ncu_summary.md", "ncu_comparison.png", "report_ghost_bs8_seq256.csv"],
)
def test_an_ncu_summary_never_writes_through_a_link(tmp_path, monkeypatch, name):
    victim = outside_victim(tmp_path)
    reports = tmp_path / "reports"
    reports.mkdir()
    shutil.copy(NCU_EXPORT, reports / "report_standard_bs8_seq256.csv")
    ncu = tmp_path / "ncu"  # exports the fixture for the .ncu-rep below
    ncu.write_text(f"#!/bin/sh\ncat {NCU_EXPORT}\n")
    ncu.chmod(0o755)
    monkeypatch.setenv("NCU", str(ncu))
    (reports / "report_ghost_bs8_seq256.ncu-rep").write_bytes(b"binary")
    os.utime(victim, (1, 1))  # older than the .ncu-rep: that report's CSV is exported again
    os.symlink(victim, reports / name)
    proc = in_process("--mode=ncu_report", "--input_dir", reports)
    assert_refused(proc, reports / name, victim)
    assert_untouched(victim.parent)


# ---------------------------------------------------------------- the helper every write uses


def write_through_each(path, root=None):
    """Each way the toolkit writes a file, as (name, function of no arguments)."""
    inside = {} if root is None else {"root": root}
    return [
        ("write_text", lambda: files.write_text(path, "text", **inside)),
        ("write_json", lambda: files.write_json(path, {"a": 1}, **inside)),
        ("open_file", lambda: os.close(files.open_file(path, os.O_RDWR | os.O_CREAT, **inside))),
    ]


@pytest.mark.parametrize("way", ["write_text", "write_json", "open_file"])
@pytest.mark.parametrize("target", ["victim", "missing", "folder"])
def test_a_link_at_the_last_component_is_refused_and_left_alone(tmp_path, way, target):
    victim = outside_victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    pointed = {"victim": victim, "missing": victim.parent / "new", "folder": victim.parent}[target]
    link = run / "result.rank1.json"
    os.symlink(pointed, link)
    write = dict(write_through_each(str(link)))[way]
    with pytest.raises(UnsafePath, match="symbolic link"):
        write()
    assert os.listdir(run) == ["result.rank1.json"]  # no temporary left beside it
    assert os.readlink(link) == str(pointed)
    assert_untouched(victim.parent)


def test_folders_below_the_root_are_entered_without_following_links(tmp_path):
    victim = outside_victim(tmp_path)
    output = tmp_path / "output"
    (tmp_path / "real_output" / "run").mkdir(parents=True)
    os.symlink(tmp_path / "real_output", output)  # the root itself: the user's choice, followed
    files.write_text(str(output / "run" / "new" / "summary.csv"), "ok", root=str(output))
    assert (tmp_path / "real_output" / "run" / "new" / "summary.csv").read_text() == "ok"
    os.symlink(victim.parent, output / "run" / "visualizations")
    for _, write in write_through_each(
        str(output / "run" / "visualizations" / "x.png"), root=str(output / "run")
    ):
        with pytest.raises(UnsafePath, match="visualizations is a symbolic link"):
            write()
    with pytest.raises(UnsafePath, match="visualizations is a symbolic link"):
        files.make_folder(str(output / "run" / "visualizations" / "deeper"), str(output / "run"))
    with pytest.raises(UnsafePath, match="not inside"):
        files.write_text(str(tmp_path / "elsewhere.txt"), "x", root=str(output / "run"))
    assert_untouched(victim.parent)


def test_temporary_names_are_unpredictable_and_exclusive(tmp_path, monkeypatch):
    victim = outside_victim(tmp_path)
    path = tmp_path / "summary.csv"
    guessable = f"summary.csv.tmp{os.getpid()}"  # the old temporary's name
    os.symlink(victim, tmp_path / guessable)
    seen = []
    for _ in range(20):
        with files.atomic_write(str(path)) as f:
            f.write("x")
            seen += [n for n in os.listdir(tmp_path) if ".tmp" in n and n != guessable]
    assert_untouched(victim.parent)
    assert len(set(seen)) == len(seen) == 20  # one temporary a write, never the same name
    assert all(files.TEMPORARY_NAME.fullmatch(n) for n in seen)
    # A name already taken (planted by someone who guessed it) is never opened: another is drawn.
    planted = "summary.csv.tmp1"
    os.symlink(victim, tmp_path / planted)
    drawn = iter([planted, planted, "summary.csv.tmp2"])
    monkeypatch.setattr(files, "temporary_name", lambda name: next(drawn))
    files.write_text(str(path), "whole")
    assert path.read_text() == "whole" and os.readlink(tmp_path / planted) == str(victim)
    assert_untouched(victim.parent)


def test_a_half_written_file_is_never_visible(tmp_path):
    path = tmp_path / "result.json"
    path.write_text("old whole")
    # Two writers of one file in one process (the old temporaries were named by the pid alone).
    with files.atomic_write(str(path)) as outer:
        outer.write("first half, ")
        outer.flush()
        with files.atomic_write(str(path)) as inner:
            inner.write("other whole")
        assert path.read_text() == "other whole"
        outer.write("second half")
        outer.flush()
        assert path.read_text() == "other whole"
    assert path.read_text() == "first half, second half"
    # A writer that fails half-way leaves the file as it was and no temporary.
    with pytest.raises(RuntimeError), files.atomic_write(str(path)) as f:
        f.write("half")
        f.flush()
        raise RuntimeError("interrupted")
    assert path.read_text() == "first half, second half" and os.listdir(tmp_path) == [path.name]


def test_check_contained_refuses_a_link_inside_the_run(tmp_path):
    run = tmp_path / "run"
    (run / "elsewhere").mkdir(parents=True)
    os.symlink(run / "elsewhere", run / CONFIG)
    with pytest.raises(UnsafePath, match="symbolic link"):
        rundir.check_contained(str(run), str(run / CONFIG / "result.json"))
    rundir.check_contained(str(run), str(run / "elsewhere" / "result.json"))  # plain: fine


def test_leftovers_are_not_removed_through_a_linked_config_directory(tmp_path):
    """An interrupted config's leftovers (temporaries, a trace's staging folder) are removed
    through the config directory's descriptor: a link in its place is not followed."""
    from dp_cost.measure import children

    outside, run_dir = tmp_path / "outside", tmp_path / "run"
    outside.mkdir()
    run_dir.mkdir()
    (outside / "result.json.tmp12345678901234567890").write_text("theirs")
    (outside / ".trace-abc").mkdir()
    (outside / ".trace-abc" / "kept").write_text("theirs")
    (run_dir / "standard_bs2_seq8").symlink_to(outside)
    children.remove_leftovers(str(run_dir / "standard_bs2_seq8"))
    assert sorted(p.name for p in outside.iterdir()) == [
        ".trace-abc", "result.json.tmp12345678901234567890"
    ]  # fmt: skip
    assert (outside / ".trace-abc" / "kept").read_text() == "theirs"
    assert os.path.islink(run_dir / "standard_bs2_seq8")
    # the same leftovers in a real config directory go, and the emptied directory with them
    real = run_dir / "flash_bs2_seq8"
    real.mkdir()
    (real / "result.json.tmp12345678901234567890").write_text("ours")
    (real / ".trace-abc").mkdir()
    children.remove_leftovers(str(real))
    assert not real.exists()
