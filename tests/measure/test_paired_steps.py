"""benchmarks/paired_steps.py: configs' workers step in turn on the same draws, and the ratios are
of the steps each timed (a stand-in step whose length follows its draw, against numpy's
percentiles; known collections; the draws against the Poisson sampler's own); every failure is
one line, and an interrupt leaves no worker."""

import gc
import json
import multiprocessing.context
import os
import signal
import subprocess
import sys

import numpy
import torch
from cli_helpers import ROOT, SMALL_MODEL, benchmark_script, child_pids, wait_for

from dp_cost.hf import privacy
from dp_cost.measure import worker as cli_worker

TINY_LORA = [
    "--mode=hf", "--model_name", "tiny-llama", "--use_lora", "--lora_rank", "4", "--batch_size",
    "6", "--seq_length", "8", "--max_physical_batch_size", "2", "--dataset_size", "30",
    "--warmup_steps", "1",
]  # fmt: skip


def step_seconds(trainer: str, size: int) -> float:
    """The stand-in clock's seconds for a step of ``size`` samples: the ratio moves by draw."""
    return 0.001 * size if trainer == "standard" else 0.002 * size + 0.005


class StandInRunner:
    """A trainer whose step advances the (forked) worker's clock by its length and appends its
    trainer's name, its draw's size and its CPUs to a log, in the order steps are run."""

    def __init__(self, trainer: str, log_path, module):
        self.trainer, self.log_path, self.module = trainer, log_path, module

    def step(self, inputs, targets):
        if self.trainer == "flash":
            gc.collect(1)  # one collection of generation 1 in each of its steps
        self.module.now[0] += step_seconds(self.trainer, len(inputs))
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
    cpu = min(os.sched_getaffinity(0))
    status = paired.main(
        [
            "--draws",
            "7",
            "--cpus",
            str(cpu),
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
    # The Poisson draws the CLI's workload makes from the config's seed (0): one warm-up, then 7.
    generator = torch.Generator().manual_seed(0)
    draws = [len(privacy.poisson_batch(30, 6 / 30, generator)) for _ in range(8)]
    timed_draws = draws[1:]
    assert result["draw_sizes"] == timed_draws and 0 not in timed_draws
    # Each worker stepped once for its warm-up alone, then the two in turn, the order swapped
    # every draw: standard flash, flash standard, ...; every step on the one CPU asked for.
    lines = [line.split() for line in log_path.read_text().splitlines()]
    assert {cpus for _, _, cpus in lines} == {str(cpu)}
    steps = [(name, int(size)) for name, size, _ in lines]
    assert steps[:2] == [("standard", draws[0]), ("flash", draws[0])]
    expected = []
    for index, size in enumerate(timed_draws):
        pair = ["standard", "flash"] if index % 2 == 0 else ["flash", "standard"]
        expected += [(name, size) for name in pair]
    assert steps[2:] == expected
    # The ratios from the stand-in's lengths, draw by draw; quartiles by numpy's percentiles.
    standard_ms = [1e3 * step_seconds("standard", n) for n in timed_draws]
    flash_ms = [1e3 * step_seconds("flash", n) for n in timed_draws]
    ratios = [f / s for f, s in zip(flash_ms, standard_ms)]
    standard, flash = result["configs"]
    assert numpy.allclose(standard["step_ms"], standard_ms)
    assert numpy.allclose(flash["step_ms"], flash_ms)
    assert numpy.isclose(flash["sum_ratio"], sum(flash_ms) / sum(standard_ms))
    assert numpy.isclose(flash["draw_ratio_median"], numpy.median(ratios))
    assert numpy.allclose(flash["draw_ratio_quartiles"], numpy.percentile(ratios, [25, 75]))
    assert f"summed steps {sum(flash_ms) / sum(standard_ms):.3f}" in stdout
    assert flash["gc_collections"][1:] == [7, 0] and len(flash["gc_ms"]) == 7


def test_each_failure_is_one_error_line(tmp_path, monkeypatch, capfd):
    def run(*argv):  # the script's and its workers' fd 2 alike (capfd)
        status = benchmark_script("paired_steps.py").main([str(a) for a in argv])
        return status, capfd.readouterr().err

    status, stderr = run("--draws", 2, "--", *TINY_LORA, "--trainers", "flash")
    assert status == 1 and stderr.count("\n") == 1 and "need 2 or more" in stderr
    status, stderr = run("--draws", 2, "--", "--mode=capacity", "--trainers", "standard", "flash")
    assert status == 1 and stderr == (
        "paired_steps.py: --mode=capacity: paired steps time training steps (not a plan)\n"
    )

    def broken(config, *rest):
        raise ValueError("no trainer here\nsecond line")

    monkeypatch.setattr(cli_worker, "build_trainer", broken)
    status, stderr = run("--draws", 2, "--", *TINY_LORA, "--trainers", "standard", "flash")
    assert status == 1 and stderr == (
        "paired_steps.py: standard_bs6_seq8_pb2_r4_tiny-llama: ValueError: no trainer here\n"
    )

    def dying(config, *rest):
        os._exit(3)

    monkeypatch.setattr(cli_worker, "build_trainer", dying)
    status, stderr = run("--draws", 2, "--", *TINY_LORA, "--trainers", "standard", "flash")
    assert status == 1 and stderr == (
        "paired_steps.py: standard_bs6_seq8_pb2_r4_tiny-llama: its worker exited with code 3\n"
    )
    for argv, message in (
        (["--draws", 0, "--", "--mode=test"], "--draws must be at least 1"),
        (["--draws", 2], "give the configs' arguments after --"),
        (["--out", tmp_path / "none" / "p.json", "--", "--mode=test"], "folder does not exist"),
        (["--out", tmp_path, "--", "--mode=test"], "is a folder: give a file"),
        (["--cpus", 100000, "--", "--mode=test"], "--cpus 100000: this process may run only"),
    ):
        status, stderr = run(*argv)
        assert status == 2 and stderr.count("\n") == 1 and message in stderr, stderr


def test_a_ctrl_c_during_a_fork_is_raised_after_it_and_kills_that_worker(
    tmp_path, monkeypatch, capfd
):
    """A Ctrl-C that lands inside the second worker's fork, in both processes' after-fork
    callbacks (where Python would print it as ignored and go on): raised here once the fork is
    done, so the run ends with one line and exit 130, both workers gone, the one just forked
    too, and nothing printed by the child; a second Ctrl-C during the clean-up's first kill
    leaves no worker behind either."""
    paired = benchmark_script("paired_steps.py")
    paired.now = [0.0]  # the stand-in's clock (its warm-up step advances it)
    monkeypatch.setattr(
        cli_worker,
        "build_trainer",
        lambda config, *rest: StandInRunner(config.trainer, tmp_path / "steps.log", paired),
    )
    armed, workers = [], []

    def interrupt_inside_the_fork():  # in the parent and in the child
        if armed:
            armed.clear()
            os.kill(os.getpid(), signal.SIGINT)

    # a process cannot drop its fork callbacks: disarmed, this one does nothing in later tests
    os.register_at_fork(
        after_in_parent=interrupt_inside_the_fork, after_in_child=interrupt_inside_the_fork
    )
    real_popen = multiprocessing.context.ForkProcess._Popen

    def popen_arming_the_second_fork(process):
        if process._target is paired.worker:  # not the CUDA probe's fork before them
            workers.append(process)
            if len(workers) == 2:
                armed.append(True)
        return real_popen(process)

    monkeypatch.setattr(
        multiprocessing.context.ForkProcess, "_Popen", staticmethod(popen_arming_the_second_fork)
    )
    real_kill, second_ctrl_c = multiprocessing.context.ForkProcess.kill, [True]

    def kill_after_a_second_ctrl_c(process):
        if second_ctrl_c:
            second_ctrl_c.clear()
            os.kill(os.getpid(), signal.SIGINT)
        real_kill(process)

    monkeypatch.setattr(multiprocessing.context.ForkProcess, "kill", kill_after_a_second_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's, as in a CLI
    try:
        status = paired.main(["--draws", "3", "--", *TINY_LORA, "--trainers", "standard", "flash"])
    finally:
        armed.clear()
        signal.signal(signal.SIGINT, previous)
    assert status == 130
    assert capfd.readouterr().err == "paired_steps.py: interrupted\n"
    assert len(workers) == 2 and not armed  # the second fork was the one interrupted
    assert not second_ctrl_c  # and the clean-up met a second Ctrl-C
    for process in workers:  # both killed and reaped
        assert process.exitcode == -signal.SIGKILL
        assert not os.path.exists(f"/proc/{process.pid}")


def test_an_interrupt_stops_every_worker_with_one_line():
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) mid-run: exit 130,
    one line, no traceback, and no worker left; started with SIGINT ignored, as a shell
    script's background job is, so the test does not depend on what pytest's process has."""
    script = os.path.join(ROOT, "benchmarks", "paired_steps.py")
    command = [
        sys.executable, script, "--draws", "100000", "--", "--mode=test", *SMALL_MODEL,
        "--batch_sizes", "2", "--seq_lens", "8", "--trainers", "standard", "flash",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        wait_for(lambda: len(child_pids(proc.pid)) >= 2, timeout=120)  # both workers started
        workers = child_pids(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert stderr.splitlines()[-1] == "paired_steps.py: interrupted"
    assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}")]
