"""benchmarks/paired_steps.py: configs' workers step in turn on the same draws, and the ratios are
of the steps each timed (a stand-in step of a known length and known collections; the draws
against the Poisson sampler's own)."""

import gc
import json
import os

import torch
from cli_helpers import benchmark_main, benchmark_script

from dp_cost.hf import privacy
from dp_cost.measure import worker as cli_worker

TINY_LORA = [
    "--mode=hf", "--model_name", "tiny-llama", "--use_lora", "--lora_rank", "4", "--batch_size",
    "6", "--seq_length", "8", "--max_physical_batch_size", "2", "--dataset_size", "30",
    "--warmup_steps", "1",
]  # fmt: skip
STEP_LENGTH = {"standard": 0.010, "flash": 0.025}  # seconds of the stand-in clock a step takes


class StandInRunner:
    """A trainer whose step advances the (forked) worker's clock by its trainer's length and
    appends its trainer's name to a log, in the order steps are run."""

    def __init__(self, trainer: str, log_path, module):
        self.trainer, self.log_path, self.module = trainer, log_path, module

    def step(self, inputs, targets):
        if self.trainer == "flash":
            gc.collect(1)  # one collection of generation 1 in each of its steps
        self.module.now[0] += STEP_LENGTH[self.trainer]
        with open(self.log_path, "a") as log:
            cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
            log.write(f"{self.trainer} {len(inputs)} {cpus}\n")


def test_workers_take_turns_on_the_same_draws_and_the_ratios_are_of_their_steps(
    tmp_path, monkeypatch, capsys
):
    paired = benchmark_script("paired_steps.py")
    log_path = tmp_path / "steps.log"
    paired.now = [0.0]
    monkeypatch.setattr(paired, "clock", lambda: paired.now[0])
    monkeypatch.setattr(
        cli_worker,
        "build_trainer",
        lambda config, *rest: StandInRunner(config.trainer, log_path, paired),
    )
    out = tmp_path / "paired.json"
    status = paired.main(
        [
            "--draws",
            "5",
            "--cpus",
            "0",
            "--out",
            str(out),
            "--",
            *TINY_LORA,
            "--trainers",
            "standard",
            "flash",
        ]  # fmt: skip
    )
    stdout = capsys.readouterr().out
    assert status == 0
    result = json.loads(out.read_text())
    # The Poisson draws the CLI's workload makes from the config's seed (0): one warm-up, then 5.
    generator = torch.Generator().manual_seed(0)
    draws = [len(privacy.poisson_batch(30, 6 / 30, generator)) for _ in range(6)]
    assert result["draw_sizes"] == draws[1:]
    # Each worker stepped once for its warm-up alone, then the two in turn, the order swapped
    # every draw: standard flash, flash standard, ...
    lines = [line.split() for line in log_path.read_text().splitlines()]
    assert {cpus for _, _, cpus in lines} == {"0"}  # every step of both workers on CPU 0 alone
    steps = [(name, int(size)) for name, size, _ in lines]
    warm_ups, timed = steps[:2], steps[2:]
    assert warm_ups == [("standard", draws[0]), ("flash", draws[0])]
    expected = []
    for index, size in enumerate(draws[1:]):
        pair = ["standard", "flash"] if index % 2 == 0 else ["flash", "standard"]
        expected += [(name, size) for name in pair]
    assert timed == expected
    standard, flash = result["configs"]
    assert all(abs(ms - 10.0) < 1e-9 for ms in standard["step_ms"])
    assert abs(flash["median_ms"] - 25.0) < 1e-9
    assert abs(flash["sum_ratio"] - 2.5) < 1e-9 and abs(flash["draw_ratio_median"] - 2.5) < 1e-9
    assert "summed steps 2.500" in stdout
    assert flash["gc_collections"][1:] == [5, 0] and len(flash["gc_ms"]) == 5


def test_one_config_or_a_failing_worker_is_one_error_line(tmp_path, monkeypatch, capsys):
    status, _, stderr = benchmark_main(
        "paired_steps.py", "--draws", 2, "--", *TINY_LORA, "--trainers", "flash", capsys=capsys
    )
    assert status == 1 and stderr.count("\n") == 1 and "need 2 or more" in stderr

    def broken(config, *rest):
        raise ValueError("no trainer here\nsecond line")

    monkeypatch.setattr(cli_worker, "build_trainer", broken)
    status, _, stderr = benchmark_main(
        "paired_steps.py", "--draws", 2, "--", *TINY_LORA, "--trainers", "standard", "flash",
        capsys=capsys,
    )  # fmt: skip
    assert status == 1 and stderr == "paired_steps.py: ValueError: no trainer here\n"
    status, _, stderr = benchmark_main("paired_steps.py", "--draws", 0, capsys=capsys)
    assert status == 2 and "--draws must be at least 1" in stderr
    status, _, stderr = benchmark_main(
        "paired_steps.py", "--out", tmp_path / "none" / "p.json", capsys=capsys
    )
    assert status == 2 and stderr.endswith("its folder does not exist\n")
    status, _, stderr = benchmark_main("paired_steps.py", "--cpus", 100000, capsys=capsys)
    assert status == 2 and stderr.startswith("paired_steps.py: --cpus 100000: this process may")
