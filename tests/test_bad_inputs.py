"""Hostile command lines: each is one error line and exit 2, before any worker starts, and
nothing is written outside the temporary output directory."""

import json
import os
import subprocess
import sys

import pytest
import torch
from cli_helpers import ROOT, cli

import profiling_script

SECRET = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"


def bad_command_lines(tmp_path):
    """(arguments, words the error names): at least 40 of them."""
    directory = tmp_path / "a_directory"
    directory.mkdir()
    not_json = tmp_path / "notes.jsonl"
    not_json.write_text("premise: a cat\n")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x81garbage\n")
    array = tmp_path / "array.jsonl"
    array.write_text("[1, 2, 3]\n")
    one_row = tmp_path / "one_row.jsonl"
    one_row.write_text('{"premise": "a", "hypothesis": "b", "label": 0}\n')
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    llama = ["--model", "tiny-llama"]
    return [
        (["--lr", "nan"], "--lr must be a finite number"),
        (["--lr", "inf"], "--lr must be a finite number"),
        (["--lr=-inf"], "--lr must be a finite number"),
        (["--lr", "0"], "--lr > 0"),
        (["--lr", "abc"], "invalid float value"),
        (["--noise_multiplier", "inf"], "--noise_multiplier must be a finite number"),
        (["--noise_multiplier", "nan"], "--noise_multiplier must be a finite number"),
        (["--noise_multiplier", "-1"], "--noise_multiplier must be >= 0"),
        (["--max_grad_norm", "nan"], "--max_grad_norm must be a finite number"),
        (["--max_grad_norm=-inf"], "--max_grad_norm must be a finite number"),
        ([*llama, "--delta", "nan"], "--delta must be a finite number"),
        ([*llama, "--delta", "1"], "--delta must be in (0, 1)"),
        (["--seed", "-1"], "--seed must be in"),
        (["--seed", "99999999999999999999999"], "--seed must be in"),
        (["--num_heads", "0"], "--num_heads must be positive"),
        (["--hidden_dim", "33", "--num_heads", "2"], "not divisible"),
        (["--vocab_size", "-5"], "--vocab_size must be positive"),
        (["--num_layers", "0"], "--num_layers must be positive"),
        (["--max_seq_len", "0"], "--max_seq_len must be positive"),
        (["--batch_size", str(10**15), "--seq_len", "8"], "more than any process can address"),
        (["--max_seq_len", str(10**12), "--seq_len", str(10**12)], "can address"),
        (["--vocab_size", str(10**13)], "more than any process can address"),
        # the position table alone: max_seq_len rows, at the default sequence length
        (["--mode=test", "--max_seq_len", str(10**12)], "more than any process can address"),
        (["--mode=test", "--model", "1b"], "add --device cpu"),  # test mode's CPU is a default
        (["--mode", "hf_swep"], "(did you mean hf_sweep?)"),  # and hf_sweep is not hidden
        (["--trainers", "flsh"], "unknown trainer 'flsh' (did you mean flash?)"),
        (["--steps_", "3"], "(did you mean --steps?)"),
        (["--mode=report"], "--mode=report needs --input_dir"),
        (["--batch_size", "0"], "batch size must be positive"),
        (["--batch_size", "abc"], "invalid int value"),
        (["--seq_len", "0"], "seq_len 0"),
        (["--max_physical_batch_size", "0"], "physical batch size must be positive"),
        (["--steps", "0"], "--steps must be positive"),
        (["--steps", str(10**7)], "at most"),
        (["--warmup_steps", "-1"], "--warmup_steps non-negative"),
        ([*llama, "--dataset_size", "0"], "--dataset_size must be positive"),
        ([*llama, "--use_lora", "--lora_ranks", "0"], "--lora_ranks"),
        ([*llama, "--dataset_path", str(directory)], "is not a file"),
        ([*llama, "--dataset_path", str(not_json)], "is not JSON lines"),
        ([*llama, "--dataset_path", str(binary)], "is not JSON lines"),
        ([*llama, "--dataset_path", str(array)], "is not JSON lines"),
        ([*llama, "--dataset_path", str(one_row), "--batch_size", "4"], "fewer than the batch"),
        (["--use_lora"], "applies only to Hugging Face models"),
        ([*llama, "--lora_rank", "8"], "--lora_ranks applies only to LoRA runs"),
        (["--resume", "--run_name", "nosuchrun"], "no run directory"),
        (["--resume"], "--resume continues a run: name it with --run_name"),
        (["--input_dir", str(directory)], "--input_dir applies only to --mode report, ncu_report"),
        (["--mode=report", "--input_dir", str(directory), "--resume"], "--resume applies only to"),
        ([*llama, "--hidden_dim", "64"], "applies only to the named LM configs"),
        ([*llama, "--dataset_path", str(tmp_path / "missing.jsonl")], "is not a file"),
        (["--run_name", ".."], "--run_name"),
        (["--run_name", "."], "--run_name"),
        (["--run_name", "../../x"], "--run_name"),
        (["--run_name", "/tmp/absolute"], "--run_name"),
        (["--run_name", "a\\b"], "--run_name"),
        (["--run_name", "line\nbreak"], "--run_name"),
        (["--run_name", "x" * 101], "--run_name"),
        (["--output_dir", str(a_file)], "not a directory"),
        (["--output_dir", "/proc/runs"], "system directory"),
        (["--trainers", "nope"], "unknown trainer"),
        (["--fsdp_sync", "logical"], "--fsdp_sync applies to --distributed fsdp"),
        (["--fsdp_sync", "never"], "invalid choice"),
        (["--model", "nope"], "unknown model"),
        (["--mode", "nope"], "invalid choice"),
        (["--token_file", str(tmp_path / "no_token")], "--token_file"),
        ([f"--tokn={SECRET}"], "unrecognized arguments: --tokn"),
        (["--tokn", SECRET], "unrecognized arguments: --tokn"),
        (["--mode", "report", "--input_dir", str(tmp_path / "nope")], "--input_dir"),
    ]


def test_at_least_40_bad_command_lines_in_process(tmp_path, monkeypatch, capsys):
    cases = bad_command_lines(tmp_path)
    assert len(cases) >= 40
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)  # a default ./runs would land here, and be seen
    before_root, before_tmp = sorted(os.listdir(ROOT)), sorted(os.listdir(tmp_path))
    for args, message in cases:
        argv = [*args] if "--output_dir" in args else [*args, "--output_dir", str(out)]
        code = profiling_script.main(argv)
        captured = capsys.readouterr()
        assert code == 2, (args, captured.err[-500:])
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, captured.err)
        assert "Traceback" not in captured.err + captured.out
        assert SECRET not in captured.err + captured.out
        assert not out.exists(), args  # nothing written, not even the output directory
    assert sorted(os.listdir(ROOT)) == before_root
    assert sorted(os.listdir(tmp_path)) == before_tmp


@pytest.mark.parametrize("index", [0, 5, 36, 48, 54])
def test_bad_command_lines_as_subprocesses(tmp_path, index):
    args, message = bad_command_lines(tmp_path)[index]
    argv = [*args] if "--output_dir" in args else [*args, "--output_dir", str(tmp_path / "out")]
    proc = cli(*argv, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and SECRET not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for --device cpu only without CUDA")
def test_a_billion_parameter_model_without_cuda_asks_for_device_cpu(tmp_path, capsys):
    for model in ("meta-llama/Llama-3.1-8B", "1b"):
        code = profiling_script.main(["--mode=hf", "--model", model, "--output_dir", str(tmp_path)])
        assert code == 2 and "add --device cpu" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


# A process in which torch, opacus and transformers cannot be imported: an import of them fails
# (a traceback, exit 1) instead of taking seconds.
NO_TORCH = """
import importlib.abc, importlib.machinery, sys
class Refused(importlib.abc.Loader):
    def create_module(self, spec):
        raise ImportError(f"{spec.name} imported before the command line was checked")
    def exec_module(self, module):
        pass
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "opacus", "transformers"):
            return importlib.machinery.ModuleSpec(name, Refused())
sys.meta_path.insert(0, Refuse())
"""


def test_mistakes_that_need_no_torch_are_found_before_it_is_imported(tmp_path):
    """An unknown trainer or model, a bad number, a shape the model cannot take or no process
    can hold, a missing or broken dataset file, --distributed outside torchrun, a setting
    outside its scope, --resume of no run: found by the plan before torch (and opacus) are
    imported (the seconds those imports take), in a process where importing them fails."""
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"premise": "a", "hypothesis": "b", "label": 0}\n[1, 2]\n')
    llama = ["--mode=hf", "--device", "cpu", "--model", "tiny-llama"]
    capacity = ["--mode=capacity", "--device", "cpu"]
    cases = [
        (["--trainers", "flsh"], "unknown trainer"),
        (["--batch_size", "-1"], "batch size must be positive"),
        (["--steps", "0"], "--steps must be positive"),
        (["--distributed", "ddp"], "runs under torchrun"),
        (["--max_physical_batch_size", "9", "--batch_size", "2"], "physical batch 9"),
        ([*llama, "--dataset_path", str(tmp_path / "missing.jsonl")], "is not a file"),
        ([*llama, "--dataset_path", str(broken)], "line 2"),
        # the model's own numbers: read from its config, not from a build
        (["--seq_len", "0"], "seq_len 0 must be in 1..1024"),
        (["--seq_len", "-3"], "seq_len -3 must be in"),
        (["--seq_len", "2000"], "seq_len 2000 must be in 1..1024"),
        (["--max_seq_len", "10", "--seq_len", "20"], "seq_len 20 must be in 1..10"),
        (["--model", "nope"], "unknown model 'nope'"),
        ([*capacity, "--model", "nope"], "unknown model 'nope'"),
        (["--hidden_dim", "33", "--num_heads", "2"], "not divisible by num_heads"),
        (["--batch_size", str(10**15), "--seq_len", "8"], "can address"),
        (["--hidden_dim", str(10**9)], "can address"),
        (["--num_layers", str(10**9)], "can address"),
        (["--vocab_size", str(10**13)], "can address"),
        (["--max_seq_len", str(10**12)], "can address"),
        (["--mode=test", "--model", "1b"], "add --device cpu"),
        ([*llama, "--seq_len", str(10**9)], "must be in 1..131072"),
        ([*capacity, "--find_max_seq_len", "--max_seq_len", "32"], "takes at most 32"),
        ([*llama, "--lora_rank", "8"], "applies only to LoRA"),  # without --use_lora
        (["--resume", "--run_name", "nosuchrun"], "no run directory"),
    ]
    script = NO_TORCH + (
        "import json\n"
        "import profiling_script\n"
        "for args in json.loads(sys.argv[1]):\n"
        "    print(profiling_script.main(args), flush=True)\n"
    )
    argv = [[*args, "--output_dir", str(tmp_path / "out")] for args, _ in cases]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(argv)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    errors = proc.stderr.strip().splitlines()
    codes = proc.stdout.split()
    for index, (args, message) in enumerate(cases):
        assert index < len(codes), (args, proc.stderr[-2000:])  # it imported torch
        assert codes[index] == "2" and message in errors[index], (args, errors[index])
    assert proc.returncode == 0 and len(errors) == len(cases)  # one line each
    assert not (tmp_path / "out").exists()
