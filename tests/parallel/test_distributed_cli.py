"""The CLI under torchrun (2 ranks, gloo, CPU), judged by the files it writes: one run, per-rank
results beside each aggregate, the losses of the global batch equal to a single-process run's,
and the mistakes a user makes with --distributed as one line and exit 2."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
from cli_helpers import ROOT, SMALL_MODEL, TORCHRUN_ENV, in_process, results_in
from forked_ranks import forked_ranks

import profiling_script

# standard alone takes no noise flag (refused outside the DP trainers' scope)
PLAIN_ARGS = ["--mode=test", "--batch_sizes", "4", "--seq_lens", "8", "--steps", "2",
              "--no_trace", "--run_name", "r", *SMALL_MODEL]  # fmt: skip
ARGS = [*PLAIN_ARGS, "--noise_multiplier", "0"]
TRAINERS = ["standard", "dpsgd", "ghost", "flash"]


def torchrun_cli(*args, launcher="forked"):
    """The CLI on 2 ranks: started by torchrun itself (``launcher="torchrun"``), or forked from
    this process as torchrun would start them (tests/forked_ranks.py: no launcher or interpreters
    to start, about 7 s of CPU less a job)."""
    if launcher == "forked":
        return forked_ranks("profiling_script.py", *args, ranks=2)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--standalone", "profiling_script.py", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def test_a_torchrun_job_is_one_run_with_the_single_process_losses(tmp_path):
    """One single-process run, then the same run under torchrun with DDP (torchrun itself) and
    with FSDP2 (ranks forked as torchrun starts them)."""
    single = in_process(*ARGS, "--trainers", *TRAINERS, "--output_dir", str(tmp_path / "single"))
    assert single.returncode == 0, single.stderr[-3000:]
    expected = results_in(tmp_path / "single" / "r")
    for distributed, launcher in (("ddp", "torchrun"), ("fsdp", "forked")):
        check_torchrun_run(tmp_path / distributed, distributed, expected, launcher)


def check_torchrun_run(out, distributed, expected, launcher):
    done = torchrun_cli(
        *ARGS,
        "--trainers",
        *TRAINERS,
        "--distributed",
        distributed,
        "--output_dir",
        str(out),
        launcher=launcher,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert os.listdir(out) == ["r"]  # rank 0 named the run for both ranks
    results = results_in(out / "r")
    assert sorted(results) == sorted(f"{name}_{distributed}2x" for name in expected)
    for name, reference in expected.items():
        run_dir = out / "r" / f"{name}_{distributed}2x"
        result = results[f"{name}_{distributed}2x"]
        if name.startswith("dpsgd") and distributed == "fsdp":
            assert result["status"] == "skipped" and "FSDP2" in result["error"]
            continue
        assert result["status"] == "ok", (distributed, result["error"])
        assert sorted(os.listdir(run_dir)) == ["result.json", "result.rank0.json",
                                               "result.rank1.json"]  # fmt: skip
        assert [r["rank"] for r in result["ranks"]] == [0, 1]
        assert result["config"]["world_size"] == 2
        assert result["config"]["physical_batch_size"] == 2  # the rank's share of 4
        # Noise 0, same seed, the global batch split over the ranks: the same losses.
        for got, want in zip(result["losses"], reference["losses"], strict=True):
            assert got == pytest.approx(want, rel=1e-5), (distributed, name)
        assert result["communication_time_ms"] is None  # no CUDA trace: null, with the reason
        assert "communication" in result["env"]["communication_note"]
    report = in_process("--mode=report", "--input_dir", str(out / "r"))
    assert report.returncode == 0 and "flash" in report.stdout


def test_fsdp2_sync_held_to_the_last_chunk_from_the_cli(tmp_path):
    """--fsdp_sync logical with two chunks per rank: standard and flash step as one process
    does (the same losses), in directories of their own; ghost is recorded skipped, saying
    why."""
    single = in_process(
        *ARGS, "--trainers", "standard", "flash", "--output_dir", str(tmp_path / "one")
    )
    assert single.returncode == 0, single.stderr[-3000:]
    expected = {r["config"]["trainer"]: r for r in results_in(tmp_path / "one" / "r").values()}
    done = torchrun_cli(
        *ARGS, "--trainers", "standard", "ghost", "flash", "--distributed", "fsdp",
        "--fsdp_sync", "logical", "--max_physical_batch_sizes", "1",
        "--output_dir", str(tmp_path / "held"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = results_in(tmp_path / "held" / "r")
    assert all(name.endswith("_fsdp2x_logicalsync") for name in results), sorted(results)
    by_trainer = {r["config"]["trainer"]: r for r in results.values()}
    assert by_trainer["ghost"]["status"] == "skipped"
    assert "Opacus' FSDP2 optimizer" in by_trainer["ghost"]["error"]
    for name in ("standard", "flash"):
        result = by_trainer[name]
        assert result["status"] == "ok", result["error"]
        assert result["config"]["fsdp_sync"] == "logical"
        assert result["config"]["physical_batch_size"] == 1  # two chunks per rank
        for got, want in zip(result["losses"], expected[name]["losses"], strict=True):
            assert got == pytest.approx(want, rel=1e-5), name


def test_a_silent_rank_ends_the_job_with_its_config_an_error_naming_it(tmp_path):
    """Rank 1's worker stopped (SIGSTOP), rank 0's waiting for it: after --rank_timeout the job
    ends, its config recorded as an error naming rank 1, one line and the command that
    continues, exit 1, and no process of the job left behind."""
    args = [*PLAIN_ARGS, "--trainers", "standard", "--distributed", "ddp", "--rank_timeout", "2"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--standalone", "tests/parallel/silent_rank.py", *args, "--output_dir",
               str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert time.monotonic() - start < 120
    assert done.returncode == 1, done.stderr[-3000:]
    silent = "rank 1's worker showed no sign of life for 2 s (stopped, hung or cut off"
    assert f"error: {silent}" in done.stderr and "the job is ended" in done.stderr
    assert "Continue this run with: " in done.stderr and "--resume --run_name r" in done.stderr
    result = results_in(tmp_path / "r")["standard_bs4_seq8_ddp2x"]
    assert result["status"] == "error" and silent in result["error"]
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and job_process(pid, tmp_path)]
    assert not left


def job_process(pid: str, tmp_path) -> bool:
    """Whether process ``pid`` is one of the job's (its command line names the run's folder)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return str(tmp_path).encode() in f.read()
    except OSError:
        return False


def test_distributed_without_torchrun_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    code = profiling_script.main([*ARGS, "--distributed", "ddp", "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "torchrun --nproc_per_node" in err
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--distributed", "ddp", "--batch_sizes", "3"], "does not split evenly over 2 ranks"),
        ([], "add --distributed ddp or --distributed fsdp"),
    ],
)
def test_distributed_mistakes_under_torchrun(tmp_path, capsys, monkeypatch, extra, message):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    code = profiling_script.main([*ARGS, *extra, "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not os.listdir(tmp_path)


def test_per_layer_clipping_under_ddp_from_the_cli(tmp_path):
    """--clipping per_layer under DDP: dpsgd and flash step as one process does (the same
    losses), their records count the same clipped samples over the global batches (merged over
    the ranks), in directories of their own; ghost is recorded skipped, saying why."""
    per_layer = [*ARGS, "--clipping", "per_layer", "--max_grad_norm", "0.05"]
    single = in_process(
        *per_layer, "--trainers", "dpsgd", "flash", "--output_dir", str(tmp_path / "one")
    )
    assert single.returncode == 0, single.stderr[-3000:]
    expected = {r["config"]["trainer"]: r for r in results_in(tmp_path / "one" / "r").values()}
    done = torchrun_cli(
        *per_layer, "--trainers", "standard", "dpsgd", "ghost", "flash", "--distributed", "ddp",
        "--output_dir", str(tmp_path / "ddp"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = results_in(tmp_path / "ddp" / "r")
    assert all(name.endswith("_perlayer") for name in results), sorted(results)
    by_trainer = {r["config"]["trainer"]: r for r in results.values()}
    assert by_trainer["ghost"]["status"] == "skipped"
    assert "no per-layer mode" in by_trainer["ghost"]["error"]
    assert by_trainer["standard"]["clipping"] is None  # standard does not clip
    for name in ("dpsgd", "flash"):
        result, want = by_trainer[name], expected[name]
        assert result["status"] == "ok", result["error"]
        for got, loss in zip(result["losses"], want["losses"], strict=True):
            assert got == pytest.approx(loss, rel=1e-5), name
        record = result["clipping"]
        assert record["rule"] == "per_layer" and record["samples"] == want["clipping"]["samples"]
        assert record["samples"] > 0
        counts = [p["clipped_samples"] for p in record["parameters"]]
        assert counts == [p["clipped_samples"] for p in want["clipping"]["parameters"]], name
        assert 0 < sum(counts) < record["samples"] * len(counts)  # some clipped, not all


def printed_cell(printed: str, trainer: str, column: str) -> str:
    """The cell of ``column`` in ``trainer``'s row of the printed summary table."""
    lines = printed.splitlines()
    header = next(line for line in lines if line.startswith("trainer "))
    row = next(line for line in lines if line.startswith(trainer + " "))
    return re.split(r"\s{2,}", row)[re.split(r"\s{2,}", header).index(column)]


def test_ddp_measurement_steps_reuse_one_draw_and_the_printed_epsilon_covers_it(
    tmp_path, monkeypatch
):
    """DDP on 2 ranks, a Hugging Face run whose last timed global batch holds 1 sample (rank 1's
    share empty): the measurement steps on both ranks reuse that draw, each rank's result records
    the same draws (those of the seed's Poisson sampler, drawn here again), and epsilon recomputed
    from them by Opacus' accountant is the one in the result and the printed table."""
    import math

    import torch
    from opacus.accountants import PRVAccountant

    from dp_cost.hf.privacy import poisson_batch

    def draws_of(seed, count=4):  # warm-up and 3 timed steps: the workload's own sampler
        generator = torch.Generator().manual_seed(seed)
        return [len(poisson_batch(10, 0.2, generator)) for _ in range(count)]

    seed = next(s for s in range(1000) if draws_of(s)[-1] == 1)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # sigma 4: Opacus' PRV accountant takes about 0.4 s for this history, against 2 s at sigma 1
    # (each rank's worker of each config computes it, and the test again)
    done = torchrun_cli(
        "--mode=hf", "--model_name", "tiny-llama", "--seq_length", "8", "--batch_size", "2",
        "--dataset_size", "10", "--seed", str(seed), "--steps", "3", "--warmup_steps", "1",
        "--noise_multiplier", "4",
        "--trainers", "dpsgd", "flash", "--distributed", "ddp", "--no_trace",
        "--output_dir", str(tmp_path), "--run_name", "r",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = done.stdout
    for config_dir, result in results_in(tmp_path / "r").items():
        assert result["status"] == "ok", result["error"]
        records = [result["privacy"]]
        for rank in (0, 1):
            path = tmp_path / "r" / config_dir / f"result.rank{rank}.json"
            rank_result = json.loads(path.read_text())
            records.append(rank_result["privacy"])
            assert rank_result["measurement_batch_size"] == 1
        for record in records:
            assert record["draw_sizes"] == draws_of(seed)
            assert record["steps_per_draw"][:3] == [1, 1, 1] and record["steps_per_draw"][3] > 1
        record = records[0]
        sigma = record["noise_multiplier"] / (1 + record["sensitivity_margin"])
        accountant = PRVAccountant()
        accountant.history = [
            (sigma / math.sqrt(uses), 0.2, 1) for uses in record["steps_per_draw"]
        ]
        epsilon = accountant.get_epsilon(delta=1e-5)
        assert record["epsilon"] == pytest.approx(epsilon, rel=1e-6)
        assert printed_cell(printed, result["config"]["trainer"], "epsilon") == f"{epsilon:.2f}"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp2_ranks_materialize_only_their_shards_with_the_whole_builds_losses(
    tmp_path, monkeypatch, lora
):
    """A Hugging Face model under FSDP2 is built with its parameters on the meta device and
    each rank allocates and initializes only its shards after sharding (no rank holds the whole
    model): the losses equal one process's, which builds the model whole (noise 0, fixed-size
    batches), for standard, ghost and flash, full fine-tuning and LoRA: the losses of the
    initial weights and of the weights after one update (no warm-up step), in one chunk of 2
    samples a rank (hf mode's default of 1 would double the chunks, each costly under FSDP2)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["--mode=hf", "--model_name", "tiny-llama", "--seq_length", "8", "--batch_size", "4",
            "--max_physical_batch_sizes", "2", "--dataset_size", "20", "--steps", "2",
            "--warmup_steps", "0", "--noise_multiplier", "0", "--no_poisson",
            "--trainers", "standard", "ghost", "flash", "--no_trace", "--run_name", "r",
            *(["--use_lora", "--lora_rank", "4"] if lora else [])]  # fmt: skip
    single = in_process(*args, "--output_dir", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr[-3000:]
    expected = {r["config"]["trainer"]: r for r in results_in(tmp_path / "one" / "r").values()}
    done = torchrun_cli(*args, "--distributed", "fsdp", "--output_dir", str(tmp_path / "fsdp"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for result in results_in(tmp_path / "fsdp" / "r").values():
        name = result["config"]["trainer"]
        assert result["status"] == "ok", result["error"]
        assert result["env"]["model_info"]["empty_weights"]
        assert not expected[name]["env"]["model_info"]["empty_weights"]
        for got, want in zip(result["losses"], expected[name]["losses"], strict=True):
            assert got == pytest.approx(want, rel=1e-5), name


def test_opacus_trainers_under_activation_checkpointing_on_ranks_step_as_one_process(tmp_path):
    """--activation_checkpointing under DDP (dpsgd, ghost) and FSDP2 (standard, ghost), chunks
    of one sample a rank: the losses of one process without checkpointing (noise 0): each
    rank's hooks capture each recomputed layer once."""
    args = [*ARGS, "--max_physical_batch_sizes", "1"]
    single = in_process(
        *args, "--trainers", "standard", "dpsgd", "ghost", "--output_dir", tmp_path / "one"
    )
    assert single.returncode == 0, single.stderr[-3000:]
    expected = {
        r["config"]["trainer"]: r["losses"] for r in results_in(tmp_path / "one" / "r").values()
    }
    for distributed, names in (("ddp", ["dpsgd", "ghost"]), ("fsdp", ["standard", "ghost"])):
        out = tmp_path / distributed
        done = torchrun_cli(
            *args, "--activation_checkpointing", "--trainers", *names, "--distributed",
            distributed, "--output_dir", out,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        results = results_in(out / "r")
        assert sorted(r["config"]["trainer"] for r in results.values()) == sorted(names)
        for name, result in results.items():
            assert "_ckpt" in name and result["status"] == "ok", (name, result["error"])
            want = expected[result["config"]["trainer"]]
            assert result["losses"] == pytest.approx(want, rel=1e-5), name


def test_ghost_under_fsdp2_on_4_ranks_where_the_head_has_fewer_rows_than_ranks(
    tmp_path, monkeypatch
):
    """tiny-llama's classifier head has 3 rows: on 4 ranks one rank's shard of it is empty.
    Ghost under FSDP2 runs there, with the losses of one process (noise 0, LoRA and the head
    trainable)."""
    args = ["--mode=hf", "--model_name", "tiny-llama", "--use_lora", "--lora_rank", "4",
            "--seq_length", "8", "--batch_size", "4", "--dataset_size", "8", "--steps", "1",
            "--warmup_steps", "0",
            "--noise_multiplier", "0", "--no_poisson", "--trainers", "ghost", "--no_trace",
            "--run_name", "r"]  # fmt: skip
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    single = in_process(*args, "--output_dir", tmp_path / "one")
    assert single.returncode == 0, single.stderr[-3000:]
    (expected,) = results_in(tmp_path / "one" / "r").values()
    done = forked_ranks(
        "profiling_script.py", *args, "--distributed", "fsdp", "--output_dir", tmp_path / "fsdp",
        ranks=4,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = results_in(tmp_path / "fsdp" / "r").values()
    assert result["status"] == "ok" and result["config"]["world_size"] == 4, result["error"]
    assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
