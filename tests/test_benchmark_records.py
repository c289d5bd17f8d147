"""The benchmark records stay reproducible from a clone (CPU only, no GPU, a few seconds).

``benchmarks/README.md`` is the index of what holds today: every data row of its tables (a
record) names the exact command that produced it, with a script git tracks, its commit (or "not
recorded") and a link to its history file. ``benchmarks/history/<date>.md`` is the dated log.
Numbers that came out of scripts git does not track may appear only in sections (text between
two headings) that carry a marker line starting with ``*History:``; the index's "History only"
section carries one too.

(a) every script a current record names is tracked (``git ls-files``), and every mention of an
    untracked script (``.devscripts``, "throwaway", "not in the repository") sits in a marked
    section;
(b) every script the index names answers ``--help`` with exit 0 (the shell suites without a
    ``--help`` of their own are listed in SHELL_WITHOUT_HELP and only syntax-checked), and every
    flag of every current command exists in its script's ``--help`` (a shell suite passes extra
    arguments on to profiling_script.py, so its flags may also be that script's or its own);
(c) no path cited under benchmarks/ is missing from the repository outside a marked section.

The checks are plain functions of the text, so the tests at the end feed them bad records.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
INDEX = BENCH / "README.md"
HISTORY = BENCH / "history"
HISTORY_ONLY = "History only (not reproducible)"

# Shell suites that take no --help: each checks for a CUDA GPU before it reads its arguments
# (and would otherwise pass --help on to profiling_script.py), so on a CPU machine --help exits
# 1. They get `bash -n` instead; a suite that gains a --help handler must leave this list.
SHELL_WITHOUT_HELP = {
    "run_profiling.sh": "CUDA check first; extra arguments go to profiling_script.py",
    "run_all_experiments.sh": "CUDA check first; extra arguments go to profiling_script.py",
    "run_single_gpu_analysis.sh": "CUDA check first; other arguments go to profiling_script.py",
}

MARKER = re.compile(r"^\*History:")
HEADING = re.compile(r"^#{1,6} ")
UNTRACKED_HINT = re.compile(r"\.devscripts|throwaway|not in the repository", re.IGNORECASE)
SCRIPT = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-][\w.-]*\.(?:py|sh))(?![\w/-])")
# This repository's folders, the top-level packages the code had before dp_cost/, and .devscripts.
PACKAGES = ("dp_cost", "core", "measure", "report", "flash", "ncu", "hf", "parallel", "stepping")
FOLDER = re.compile(
    r"(?<![\w./-])((?:\.devscripts|tests|benchmarks|samplers|" + "|".join(PACKAGES) + r")/[\w./-]*)"
)
MODULE = re.compile(r"\bpython3? -m ([\w.]+)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b|\bnot recorded\b")
HISTORY_LINK = re.compile(r"\[(\d{4}-\d{2}-\d{2})\]\(history/(\d{4}-\d{2}-\d{2})\.md\)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDER = re.compile(r"\.\.\.|…|[\[\]{}<>|]")
SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


# --- the text --------------------------------------------------------------------------------


@dataclass
class Section:
    """The lines from one heading to the next (outside code fences); marked: a *History: line."""

    heading: str
    lines: list[tuple[int, str]] = field(default_factory=list)
    marked: bool = False


def sections(text: str) -> list[Section]:
    out = [Section("")]
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and HEADING.match(line):
            out.append(Section(line.lstrip("#").strip()))
        elif not fenced and MARKER.match(line):
            out[-1].marked = True
        out[-1].lines.append((number, line))
    return out


def cited_paths(line: str) -> list[str]:
    """Script files, repository folders (in code spans) and ``python -m`` modules of this
    repository that a line cites (modules as paths: ``dp_cost.ncu`` -> ``dp_cost/ncu``)."""
    paths = [m.group(1).removeprefix("./") for m in SCRIPT.finditer(line)]
    for span in CODE_SPAN.findall(line):  # folders in code only: prose says "flash/std"
        paths += [m.group(1).rstrip("./") for m in FOLDER.finditer(span)]
    paths += [
        m.group(1).replace(".", "/")
        for m in MODULE.finditer(line)
        if m.group(1).split(".")[0] in PACKAGES
    ]
    return list(dict.fromkeys(p for p in paths if p))


def path_exists(path: str, files: set[str]) -> bool:
    """A file, a module (``.py`` left out) or a folder holding one of ``files``."""
    prefix = path + "/"
    return path in files or path + ".py" in files or any(f.startswith(prefix) for f in files)


def unmarked_problems(text: str, exists: Callable[[str], bool]) -> list[str]:
    """(a) and (c): lines outside a marked section that cite an untracked script or a path the
    repository lacks."""
    problems = []
    for section in sections(text):
        if section.marked:
            continue
        for number, line in section.lines:
            if UNTRACKED_HINT.search(line):
                problems.append(
                    f"line {number}: cites an untracked script in a section with no *History: "
                    f"marker: {line.strip()[:100]}"
                )
            for path in cited_paths(line):
                if not exists(path):
                    problems.append(
                        f"line {number}: {path} is not in the repository, and the section "
                        "carries no *History: marker"
                    )
    return problems


def link_problems(text: str, where: Path) -> list[str]:
    """Relative Markdown links that lead nowhere."""
    return [
        f"link to {target} from {where.name}: no such file"
        for target in LINK.findall(text)
        if "://" not in target and not (where.parent / target).exists()
    ]


# --- the index's records ---------------------------------------------------------------------


@dataclass
class Record:
    line: int
    row: str
    commands: list[str]


def command_words(command: str) -> list[str]:
    """The command's words after environment assignments and ``time``."""
    try:
        words = shlex.split(command)
    except ValueError:
        return []
    while words and (ENV_ASSIGNMENT.match(words[0]) or words[0] == "time"):
        words.pop(0)
    return words


def is_command(span: str) -> bool:
    words = command_words(span)
    return bool(words) and (
        words[0] in ("python", "python3", "torchrun", "bash") or words[0].startswith("./")
    )


def parse_command(command: str) -> tuple[str | None, list[str]]:
    """(script, its arguments); no script for ``python -m`` or a launcher without one."""
    words = command_words(command)
    if not words:
        return None, []
    head, rest = words[0], words[1:]
    if head in ("python", "python3"):
        if not rest or rest[0].startswith("-"):
            return None, []
        return rest[0], rest[1:]
    if head == "torchrun":
        for i, word in enumerate(rest):
            if word.endswith(".py"):
                return word, rest[i + 1 :]
        return None, []
    if head == "bash":
        return (rest[0], rest[1:]) if rest else (None, [])
    if head.startswith("./"):
        return head[2:], rest
    return None, []


def current_sections(text: str) -> list[Section]:
    """The index's sections before "History only"."""
    out = []
    for section in sections(text):
        if section.heading == HISTORY_ONLY:
            break
        out.append(section)
    return out


def index_records(text: str) -> list[Record]:
    """The data rows of every table above "History only": each is one current record."""
    records = []
    for section in current_sections(text):
        table: list[tuple[int, str]] = []
        for number, line in [*section.lines, (0, "")]:
            if line.startswith("|"):
                table.append((number, line))
                continue
            if len(table) > 2 and SEPARATOR.match(table[1][1]):
                for row_number, row in table[2:]:
                    spans = [s for s in CODE_SPAN.findall(row) if is_command(s)]
                    records.append(Record(row_number, row, spans))
            table = []
    return records


def index_scripts(text: str) -> list[str]:
    """Every script a command in the index's current sections names."""
    scripts = set()
    for section in current_sections(text):
        for _, line in section.lines:
            for span in CODE_SPAN.findall(line):
                if is_command(span):
                    script, _ = parse_command(span)
                    if script:
                        scripts.add(script)
    return sorted(scripts)


def flag_known(flag: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


# Python scripts that pass the configs' flags on to profiling_script.py, as the shell suites do.
PASSES_CLI_FLAGS = {
    "benchmarks/checkpointing.py",
    "benchmarks/fsdp_buckets.py",
    "benchmarks/paired_steps.py",
}


def command_problems(command: str, tracked: set[str], helps: dict[str, str]) -> list[str]:
    """(a) and (b): the command runs a tracked script with flags that script (or, for a shell
    suite, profiling_script.py) knows, and holds no placeholder."""
    problems = []
    if PLACEHOLDER.search(command):
        problems.append(f"placeholder in `{command}`: write the exact command")
    script, args = parse_command(command)
    if script is None:
        return [*problems, f"`{command}` names no script"]
    if script not in tracked:
        return [*problems, f"`{command}`: {script} is not tracked by git"]
    known = helps.get(script, "")
    if script.endswith(".sh") or script in PASSES_CLI_FLAGS:
        known += (REPO / script).read_text() + helps.get("profiling_script.py", "")
    choices = re.search(r"positional arguments:\s*\n\s*\{([\w,-]+)\}", known)
    positional = [a for a in args if not a.startswith("-")]
    if choices and positional and positional[0] not in choices.group(1).split(","):
        problems.append(f"`{command}`: {positional[0]} is none of {{{choices.group(1)}}}")
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag != "--" and not flag_known(flag, known):
            problems.append(f"`{command}`: {script} has no {flag}")
    return problems


def record_problems(record: Record, tracked: set[str], helps: dict[str, str]) -> list[str]:
    where = f"benchmarks/README.md line {record.line}"
    problems = []
    if not record.commands:
        problems.append("names no command of a tracked script")
    for command in record.commands:
        problems += command_problems(command, tracked, helps)
    links = HISTORY_LINK.findall(record.row)
    if not links:
        problems.append("links no history file: [YYYY-MM-DD](history/YYYY-MM-DD.md)")
    for shown, target in links:
        if shown != target:
            problems.append(f"the date {shown} links to history/{target}.md")
        if not (HISTORY / f"{target}.md").exists():
            problems.append(f"history/{target}.md does not exist")
    cells = record.row.split("|")
    if not any(COMMIT.fullmatch(c.strip().split(" ")[0]) or "not recorded" in c for c in cells):
        problems.append('names no commit (a hash, or "not recorded")')
    return [f"{where}: {p}" for p in problems]


# --- the repository --------------------------------------------------------------------------


def _git_files(*args: str) -> set[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", *args], cwd=REPO, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the records are checked against git ls-files")
    return {f for f in out.decode().split("\0") if f}


@cache
def tracked_files() -> frozenset[str]:
    return frozenset(_git_files())


@cache
def repository_files() -> frozenset[str]:
    """Tracked files and the new ones git does not ignore (a clone has them once committed)."""
    return frozenset(tracked_files() | _git_files("--others", "--exclude-standard"))


def markdown_files() -> list[Path]:
    return sorted(BENCH.rglob("*.md"))


def has_help_handler(source: str) -> bool:
    return re.search(r"(^|[\s|(])--help\s*\)", source, re.MULTILINE) is not None


def run_help(script: str) -> subprocess.CompletedProcess:
    if script in SHELL_WITHOUT_HELP:
        cmd = ["bash", "-n", script]
    elif script.endswith(".sh"):
        cmd = ["bash", script, "--help"]
    else:
        cmd = [sys.executable, script, "--help"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def helps() -> dict[str, subprocess.CompletedProcess]:
    """Every indexed script's --help, run at once (bench_flash.py imports torch: seconds)."""
    scripts = sorted(set(index_scripts(INDEX.read_text())) | {"profiling_script.py"})
    with ThreadPoolExecutor(len(scripts)) as pool:
        return dict(zip(scripts, pool.map(run_help, scripts), strict=True))


def help_texts(helps: dict[str, subprocess.CompletedProcess]) -> dict[str, str]:
    return {script: done.stdout for script, done in helps.items()}


# --- the records as they are -----------------------------------------------------------------


def test_index_and_dated_history_files():
    assert INDEX.exists()
    dated = sorted(HISTORY.glob("*.md"))
    assert dated, "benchmarks/history/ holds no dated file"
    for path in dated:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}\.md", path.name), path.name
        day = path.stem
        session_headings = [line for line in path.read_text().splitlines() if line[:3] == "## "]
        assert session_headings, f"{path.name} holds no session"
        for heading in session_headings:
            assert heading.startswith(f"## {day}"), f"{path.name}: {heading[:60]}"


def test_every_current_record_names_a_tracked_script_that_answers_help_and_its_command(helps):
    """Every record's script is tracked and its command parses by the script's --help; every
    indexed script answers --help. One test, not one per script: pytest-xdist could give those
    to both workers, and each would run every script's --help again (tens of seconds)."""
    text = INDEX.read_text()
    records = index_records(text)
    assert len(records) >= 10, "the index's tables were not found"
    texts = help_texts(helps)
    problems = [p for r in records for p in record_problems(r, set(tracked_files()), texts)]
    for script in index_scripts(INDEX.read_text()):
        done = helps[script]
        source = (REPO / script).read_text()
        if done.returncode != 0:
            problems.append(f"{script}: exit {done.returncode}\n{done.stderr[-2000:]}")
        elif script in SHELL_WITHOUT_HELP:
            if has_help_handler(source):
                problems.append(f"{script} takes --help now: drop it from the list")
        elif not done.stdout.strip():
            problems.append(f"{script} --help printed nothing")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(BENCH)))
def test_untracked_scripts_and_missing_paths_only_under_the_history_marker(path):
    text = path.read_text()
    files = set(repository_files())
    problems = unmarked_problems(text, lambda p: path_exists(p, files))
    problems += link_problems(text, path)
    if "BENCHMARKS.md" in text:
        problems.append("cites BENCHMARKS.md, which was split into benchmarks/")
    assert not problems, f"{path.relative_to(REPO)}:\n" + "\n".join(problems)


# --- the checks fail on bad records ----------------------------------------------------------

FILES = {"profiling_script.py", "bench_flash.py", "run_profiling_ncu.sh", "dp_cost/core/files.py"}
FILES |= {"dp_cost/ncu/__init__.py", "dp_cost/ncu/__main__.py", "tests/test_trainers.py"}
HELPS = {
    "profiling_script.py": "usage: [--mode {test,profile}] [--steps STEPS] [--no_trace]",
    "bench_flash.py": "usage: {kernels,steps}\n\npositional arguments:\n  {kernels,steps}\n"
    "  --dtypes  --cuda_graph",
}


def _problems(text: str) -> list[str]:
    return unmarked_problems(text, lambda p: path_exists(p, FILES))


def test_an_unmarked_untracked_script_is_caught_and_the_marker_clears_it():
    text = "## 2026-11-26 (a session)\n\nA probe (`.devscripts/s9/ab.py`) gave 1.08.\n"
    assert len(_problems(text)) == 2  # the hint, and the path the repository lacks
    marked = text.replace("\n\nA probe", "\n\n*History: not reproducible from a clone.*\n\nA")
    assert _problems(marked) == []
    # The marker covers its own section only, not the next one.
    assert _problems(marked + "\n### Next\n\nA throwaway script gave 3 ms.\n")
    # A marker-like line inside a code fence does not count, nor does a heading there.
    fenced = text + "```\n*History: no\n# not a heading\n```\n"
    assert len(_problems(fenced)) == 2


def test_missing_and_renamed_paths_are_caught():
    present = (
        "`dp_cost/core/files.py`, `python -m dp_cost.ncu`, `tests/test_trainers.py`, `dp_cost/ncu`"
    )
    assert _problems(present) == []
    for old in ("`core/files.py`", "`python -m ncu metrics x`", "`flash_kernels.py`", "`measure/`"):
        assert _problems(f"see {old} here"), old
    assert _problems("see `python -m dp_cost.ncu metrics x` here") == []


def test_bad_records_are_caught():
    good = (
        "| card | ms | date | commit | command |\n|---|---|---|---|---|\n"
        "| H100 | 1.0 | [2026-11-26](history/2026-11-26.md) | a724ce1 | "
        "`python bench_flash.py steps --dtypes float32 --cuda_graph` |\n"
    )
    if not (HISTORY / "2026-11-26.md").exists():
        pytest.skip("the history file the sample row links is missing")

    def problems(index: str) -> list[str]:
        return [p for r in index_records(index) for p in record_problems(r, FILES, HELPS)]

    assert len(index_records(good)) == 1
    assert problems(good) == []
    bad_rows = {
        "untracked script": good.replace("bench_flash.py", ".devscripts/s9/step_ab.py"),
        "unknown flag": good.replace("--cuda_graph", "--cuda_graphs"),
        "unknown subcommand": good.replace("steps", "step"),
        "placeholder": good.replace("--cuda_graph", "[--cuda_graph]"),
        "no command": good.replace("`python bench_flash.py", "python bench_flash.py`"),
        "no commit": good.replace("a724ce1", "later"),
        "no history link": good.replace("(history/2026-11-26.md)", ""),
        "wrong history date": good.replace("[2026-11-26]", "[2026-11-25]"),
        "missing history file": good.replace("history/2026-11-26", "history/2031-01-01"),
    }
    for what, index in bad_rows.items():
        assert problems(index), what
    # Below "History only" a row is no current record.
    assert index_records(f"## {HISTORY_ONLY}\n\n" + bad_rows["untracked script"]) == []
    # A shell suite may pass profiling_script.py's flags on.
    assert command_problems("BATCH_SIZES=8 ./run_profiling_ncu.sh --no_trace", FILES, HELPS) == []
    assert command_problems("./run_profiling_ncu.sh --no_such_flag", FILES, HELPS)


def test_an_indexed_script_without_help_is_caught(tmp_path):
    script = tmp_path / "suite.sh"
    script.write_text('#!/usr/bin/env bash\necho "no GPU" >&2\nexit 1\n')
    assert not has_help_handler(script.read_text())
    assert subprocess.run(["bash", str(script), "--help"], capture_output=True).returncode != 0
    assert has_help_handler('case "$1" in\n    -h | --help) usage; exit 0 ;;\nesac\n')
