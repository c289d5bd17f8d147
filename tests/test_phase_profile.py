"""benchmarks/phase_profile.py: a method's Python calls counted by function (builtins left out),
and its one-line refusals."""

from tests.cli_helpers import benchmark_main, benchmark_script


def twice(x):
    return x + 1


class Stepper:
    def step(self, x):
        return twice(twice(x)) + len([x])  # len: a builtin, not counted


def test_a_profiled_method_writes_its_calls_by_function(tmp_path):
    script = benchmark_script("phase_profile.py")

    class Own(Stepper):
        pass

    script.profiled(Own, "step", str(tmp_path), top=10)
    assert Own().step(1) == 4  # the method still returns what it did
    (counts,) = tmp_path.iterdir()
    assert counts.name.startswith("step.")
    lines = counts.read_text().splitlines()
    assert lines[0] == "python calls 3"  # step itself and twice, twice
    assert lines[1].split()[0] == "2" and lines[1].endswith("(twice)")
    assert not any("len" in line for line in lines)


def test_unknown_trainer_or_method_is_one_line_and_exit_2(tmp_path, capsys):
    status, _, err = benchmark_main(
        "phase_profile.py", "--out", tmp_path, "--trainer", "nope", "--", "--mode=test",
        capsys=capsys,
    )  # fmt: skip
    assert status == 2 and err.strip() == "error: no trainer named 'nope'"
    status, _, err = benchmark_main(
        "phase_profile.py", "--out", tmp_path, "--methods", "nope", "--", "--mode=test",
        capsys=capsys,
    )  # fmt: skip
    assert status == 2 and err.strip() == "error: trainer 'flash' has no method 'nope'"
    assert not list(tmp_path.iterdir())  # nothing written
