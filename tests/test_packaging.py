"""pip install -e . gives a `dp-cost` command equal to `python profiling_script.py`, with the
machinery in the one package dp_cost (no top-level core/, report/, measure/ to clash with
other installed packages)."""

import os
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_the_command_is_the_cli():
    toml = project()
    assert toml["project"]["scripts"] == {"dp-cost": "profiling_script:main"}
    code = "import sys, profiling_script; sys.exit(profiling_script.main(['--help']))"
    by_entry = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True
    )
    by_file = subprocess.run(
        [sys.executable, "profiling_script.py", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert by_entry.returncode == by_file.returncode == 0
    # The same options and help (the usage line's program name is whatever started it).
    options = lambda text: text[text.index("\n\n") :]  # noqa: E731
    assert options(by_entry.stdout) == options(by_file.stdout)


def test_what_installs_is_the_package_and_the_contracts_modules():
    toml = project()["tool"]["setuptools"]
    assert toml["packages"]["find"]["include"] == ["dp_cost*"]
    modules = toml["py-modules"]
    assert all(os.path.isfile(os.path.join(ROOT, f"{m}.py")) for m in modules)
    # Every other top-level folder with Python code is not a package that would be installed.
    for entry in os.listdir(ROOT):
        if entry in ("dp_cost", "tests", "benchmarks") or entry.startswith("."):
            continue
        assert not os.path.isfile(os.path.join(ROOT, entry, "__init__.py")), entry
