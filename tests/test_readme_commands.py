"""Every command line of README.md's and the docs pages' bash blocks, checked without a step:
each parses and plans as on a GPU machine (CUDA stubbed) and as on a CPU-only one, where a GPU
mode says so first and runs the CPU test defaults, or refuses in one line naming what it needs
(CUDA, or --device cpu for a billion-parameter model). torchrun's lines plan in the environment
torchrun gives rank 0. README's --mode=test line and its report line are run by
test_pinned_run.py (its grid run); what the others would run on the CPU is either that grid's
shape (profile, memory) or too heavy for a test (8B plans, sweeps, torchrun jobs)."""

import os
import re
import shlex

import pytest
from cli_helpers import ROOT, TORCHRUN_ENV

import profiling_script
from dp_cost.core.modes import MODES
from dp_cost.core.settings import BY_NAME, UsageError
from dp_cost.measure import plan

COMMAND = re.compile(r"^(?:torchrun\s.*?\s|python3?\s+)profiling_script\.py\s+(.*)$")
PAGES = ["README.md", *sorted(f"docs/{p}" for p in os.listdir(os.path.join(ROOT, "docs")))]


def page_commands(page: str) -> list[str]:
    """The profiling_script.py command lines of a page's bash blocks, continuations joined,
    comments dropped."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    lines = [
        " ".join(line.split("  #")[0].split())
        for block in blocks
        for line in block.replace("\\\n", " ").splitlines()
    ]
    return [line for line in lines if COMMAND.match(line)]


def readme_commands() -> list[str]:
    """Every page's command lines but those with a placeholder (runs/<run>, ...)."""
    commands = [c for page in PAGES if page.endswith(".md") for c in page_commands(page)]
    return list(dict.fromkeys(c for c in commands if "<" not in c and "..." not in c))


COMMANDS = readme_commands()
MODE_FLAG = re.compile(r"--mode=(\w+)")
IDS = [f"{n}-{MODE_FLAG.search(c).group(1)}" for n, c in enumerate(COMMANDS)]


def planned(command: str, monkeypatch, cuda: bool):
    """``make_plan`` of the command line's arguments (None for a report mode)."""
    argv = shlex.split(COMMAND.match(command).group(1))
    for name, value in (TORCHRUN_ENV if command.startswith("torchrun") else {}).items():
        monkeypatch.setenv(name, value)
    try:
        args = profiling_script.parse_args(argv)
    except SystemExit:
        pytest.fail(f"the command does not parse: {command}")
    if not MODES[args.mode].runs:  # report modes read existing files
        return None
    return plan.make_plan(args, cuda_available=lambda: cuda)


def test_the_pages_hold_the_commands_of_every_kind():
    assert len(COMMANDS) >= 20 and any(c.startswith("torchrun") for c in COMMANDS)
    assert "python profiling_script.py --mode=test" in page_commands("README.md")


@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_a_command_plans_on_a_gpu_machine(command, monkeypatch):
    """A renamed flag or a changed default fails here, not for a user."""
    experiment = planned(command, monkeypatch, cuda=True)
    assert experiment is None or experiment.configs


@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_a_command_on_a_cpu_says_so_first_then_runs_the_cpu_defaults_or_names_the_gpu(
    command, monkeypatch, capsys
):
    try:
        experiment = planned(command, monkeypatch, cuda=False)
    except UsageError as error:  # one line naming what it needs, after the no-CUDA line
        assert re.search(r"CUDA|GPU|--device cpu", str(error)), f"{command}: {error}"
        experiment = None
    else:
        if experiment is None:
            return
    printed = capsys.readouterr().out
    mode = MODES[MODE_FLAG.search(command).group(1)]
    if mode.predicts or BY_NAME["device"].default_for(mode.name) == "cpu":  # nothing to say
        assert printed == ""
        return
    assert printed.startswith("No CUDA device found"), f"{command}: {printed!r}"
    if experiment is None or mode.cpu_defaults is None:
        return
    # A GPU mode's shape is the CPU defaults': the grid the --mode=test run measures.
    cpu = mode.cpu_defaults
    shapes = {(c.model, c.batch_size, c.seq_len, c.physical_batch_size) for c in experiment.configs}
    want = {
        (BY_NAME["model"].default_for(cpu), b, t, b // experiment.configs[0].world_size)
        for b in BY_NAME["batch_size"].default_for(cpu)
        for t in BY_NAME["seq_len"].default_for(cpu)
    }
    assert shapes == want, command
    assert all(c.device == "cpu" for c in experiment.configs)
