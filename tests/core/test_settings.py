"""The settings table: config directory names as README spells them, comparison keys,
and the command line and the plan both reading the one table."""

import argparse

import pytest

import profiling_script
from dp_cost.core import settings
from dp_cost.measure.config import ExperimentConfig, changed_settings
from dp_cost.report.results import comparison_key


@pytest.mark.parametrize(
    "fields, name",
    [
        ({}, "dpsgd_bs8_seq256"),
        ({"max_physical_batch_size": 8}, "dpsgd_bs8_seq256"),  # physical = logical: no part
        ({"max_physical_batch_size": 2}, "dpsgd_bs8_seq256_pb2"),
        ({"lora_rank": 4}, "dpsgd_bs8_seq256"),  # a rank without LoRA names nothing
        ({"use_lora": True, "lora_rank": 4}, "dpsgd_bs8_seq256_r4"),
        ({"dtype": "bfloat16", "attention": "sdpa"}, "dpsgd_bs8_seq256_bf16_sdpa"),
        ({"activation_checkpointing": True}, "dpsgd_bs8_seq256_ckpt"),
        ({"activation_checkpointing": True, "cuda_graph": True, "model": "1b"},
         "dpsgd_bs8_seq256_ckpt_graph_1b"),
        ({"model": "1b"}, "dpsgd_bs8_seq256_1b"),
        ({"model": "1b", "default_model": "1b"}, "dpsgd_bs8_seq256"),
        # HF models default to SDPA: explicit attention is the part that differs.
        (
            {"model": "meta-llama/Llama-3.2-1B", "attention": "explicit"},
            "dpsgd_bs8_seq256_explicit_meta-llama-Llama-3.2-1B",
        ),
        (
            {"max_physical_batch_size": 2, "use_lora": True, "lora_rank": 8,
             "dtype": "bfloat16", "attention": "sdpa", "model": "1b"},
            "dpsgd_bs8_seq256_pb2_r8_bf16_sdpa_1b",
        ),
    ],
)  # fmt: skip
def test_config_dir_names_parts_in_documented_order(fields, name):
    assert ExperimentConfig("dpsgd", 8, 256, **fields).config_dir == name


def test_result_config_records_every_setting_but_plan_internals():
    data = ExperimentConfig("flash", 4, 64, max_physical_batch_size=2).to_dict()
    assert "default_model" not in data
    assert data["physical_batch_size"] == 2
    flags = {s.name for s in settings.SETTINGS if s.flags and s.into is None}
    assert flags - set(data) == {"rank_timeout"}  # how a run is watched, not what it measures


def test_comparison_key_ignores_the_trainer_and_lora_rank_without_lora():
    base = ExperimentConfig("standard", 4, 64).to_dict()
    other = ExperimentConfig("ghost", 4, 64, lora_rank=32).to_dict()
    assert comparison_key(base) == comparison_key(other)
    for change in ({"dtype": "bfloat16"}, {"max_physical_batch_size": 2}, {"optimizer": "adam"}):
        changed = ExperimentConfig("ghost", 4, 64, **change).to_dict()
        assert comparison_key(changed) != comparison_key(base), change
    # An older result without the newer keys reads as their defaults.
    old_keys = ("model", "batch_size", "seq_len", "physical_batch_size", "dtype", "attention")
    old = {k: base[k] for k in old_keys}
    assert comparison_key(old) == comparison_key(base)


def test_changed_settings_names_what_differs():
    old = ExperimentConfig("ghost", 4, 64).to_dict()
    new = ExperimentConfig("ghost", 4, 64, lr=0.5, steps=9).to_dict()
    assert changed_settings(old, new) == ["lr", "steps"]
    del old["delta"]  # written before the setting existed: its default
    assert changed_settings(old, ExperimentConfig("ghost", 4, 64).to_dict()) == []


def test_every_flag_of_the_table_is_on_the_command_line_with_its_aliases():
    parser = profiling_script.build_parser()
    spelled = {s for action in parser._actions for s in action.option_strings}
    for setting in settings.SETTINGS:
        assert set(setting.flags) <= spelled, setting.name
    for alias in ("--batch_size", "--seq_length", "--num_iter", "--sigma", "--model_name",
                  "--max_physical_batch_size", "--lora_rank", "--learning_rate"):  # fmt: skip
        assert alias in spelled


def test_mode_defaults_reach_the_plan_and_flags_override_them():
    from dp_cost.measure import plan

    def planned(*argv):
        args = profiling_script.parse_args(list(argv))
        return plan.make_plan(args, cuda_available=lambda: True)

    profile = planned("--mode=profile", "--trainers", "standard")
    assert profile.device == "cuda"
    assert [(c.batch_size, c.seq_len) for c in profile.configs] == [
        (4, 512), (4, 1024), (8, 512), (8, 1024)
    ]  # fmt: skip
    first = profile.configs[0]
    assert (first.model, first.steps, first.warmup_steps, first.trace, first.breakdown) == (
        "1b", 5, 2, True, False
    )  # fmt: skip
    memory = planned("--mode=memory", "--trainers", "ghost").configs[0]
    assert (memory.batch_size, memory.seq_len, memory.trace, memory.breakdown) == (
        1, 4096, False, True
    )  # fmt: skip
    assert memory.steps == 5  # every GPU mode measures at least 5 steps; test keeps 3
    assert planned("--mode=test").configs[0].steps == 3
    sweep = planned("--mode=hf_sweep")
    assert {c.trainer for c in sweep.configs} == {"dpsgd"} and sweep.configs[0].lr == 1e-5
    assert len(sweep.configs) == 3 * 3 * 3  # batch x seq x physical; one rank without LoRA
    assert sweep.configs[0].lora_rank == 16 and sweep.configs[0].detailed_memory
    given = planned("--mode=profile", "--trainer", "vanilla", "--steps", "7", "--no_trace")
    assert {(c.trainer, c.steps, c.trace) for c in given.configs} == {("standard", 7, False)}


def test_without_cuda_a_gpu_mode_runs_what_its_mode_row_says(capsys):
    from dp_cost.measure import plan

    def planned(*argv):
        return plan.make_plan(profiling_script.parse_args(list(argv)), cuda_available=lambda: False)

    profile = planned("--mode=profile")
    assert profile.mode == "test" and profile.device == "cpu"
    assert "test defaults" in profile.device_note and profile.note is None
    assert profile.configs[0].model == "tiny"
    memory = planned("--mode=memory")
    assert memory.mode == "memory" and memory.configs[0].breakdown  # null on CPU, still asked
    assert memory.configs[0].seq_len == 256
    # A GPU-sized shape given is not run on the CPU: the CPU defaults' shape runs, said first.
    capsys.readouterr()
    given = planned("--mode=memory", "--seq_len", "16384", "--batch_size", "1", "--model", "1b",
                    "--hidden_dim", "64", "--trainers", "flash")  # fmt: skip
    shapes = {(c.model, c.batch_size, c.seq_len) for c in given.configs}
    assert shapes == {("tiny", b, t) for b in (2, 4) for t in (256, 512)}
    assert all(c.model_overrides == {} for c in given.configs)
    assert capsys.readouterr().out == given.device_note + "\n"
    assert given.device_note.splitlines()[1] == (
        "Not used: --batch_sizes 1 --seq_lens 16384 --model 1b --hidden_dim 64 (--device cpu "
        "runs them on the CPU)."
    )
    forced = planned("--mode=memory", "--seq_len", "64", "--batch_size", "1", "--device", "cpu")
    assert [(c.batch_size, c.seq_len) for c in forced.configs[:1]] == [(1, 64)]
    assert forced.device_note is None
    sweep = planned("--mode=hf_sweep")
    assert sweep.configs[0].model == "tiny-llama" and "tiny-llama" in sweep.device_note
    hf = planned("--mode=hf")  # keeps its own defaults on the CPU, with the CPU's model
    assert hf.mode == "hf" and "tiny-llama" in hf.device_note
    assert "test defaults" not in hf.device_note
    first = hf.configs[0]
    assert (first.model, first.lr, first.steps, first.batch_size) == ("tiny-llama", 1e-5, 5, 32)
    with pytest.raises(settings.UsageError, match="add --device cpu"):
        planned("--mode=hf", "--model", "meta-llama/Llama-3.2-3B")  # billions of parameters
    forced = planned("--mode=hf", "--model", "meta-llama/Llama-3.2-3B", "--device", "cpu")
    assert forced.configs[0].model == "meta-llama/Llama-3.2-3B" and forced.device_note is None

    forced = planned("--mode=hf_sweep", "--device", "cpu")
    assert forced.device_note is None
    assert forced.configs[0].model == "meta-llama/Llama-3.1-8B-Instruct"
    with pytest.raises(settings.UsageError):
        planned("--device", "cuda")


def test_switches_set_their_value_and_stay_unset_otherwise():
    args = profiling_script.parse_args(["--no_poisson", "--use_lora"])
    assert isinstance(args, argparse.Namespace)
    assert args.no_poisson is False and args.use_lora is True and args.no_trace is None


LLAMA = ["--mode=hf", "--model", "tiny-llama"]
# Each setting with a scope, given outside it (the first flag named in the error).
OUTSIDE_SCOPE = {
    "lora_rank": [*LLAMA, "--lora_rank", "8"],  # without --use_lora: full fine-tuning
    "use_lora": ["--use_lora"],  # the LM has no LoRA
    "pretrained": ["--pretrained"],
    "dataset_path": ["--dataset_path", "snli.jsonl"],  # refused before the file is read
    "dataset_size": [*LLAMA, "--dataset_path", "snli.jsonl", "--dataset_size", "50"],
    "poisson": ["--no_poisson"],
    "delta": [*LLAMA, "--no_poisson", "--delta", "0.1"],  # no epsilon to be the delta of
    **{name: [*LLAMA, f"--{name}", "64"] for name in settings.MODEL_OVERRIDES},
    "gpu_memory": ["--gpu_memory", "80"],
    "find_max_batch": ["--find_max_batch"],
    "find_max_seq_len": ["--find_max_seq_len"],
    "validate": ["--validate"],
    "card": ["--card", "NVIDIA H200"],
    "epochs": ["--epochs", "1"],
    "recommend": ["--recommend"],
    "noise_multiplier": ["--trainers", "standard", "--sigma", "2"],
    "max_grad_norm": ["--trainers", "standard", "--max_grad_norm", "2"],
    "clipping": ["--trainers", "standard", "--clipping", "per_layer"],
    "steps": ["--mode=capacity", "--steps", "4"],  # a prediction takes no step
    "warmup_steps": ["--mode=capacity", "--warmup_steps", "4"],
    "host_work": ["--mode=capacity", "--host_work"],
    "flash_route": ["--trainers", "dpsgd", "--flash_route", "gram"],
    "noise_sampler": ["--trainers", "standard", "flash", "--noise_sampler", "exact64"],
    "trace": ["--mode=memory", "--no_trace"],  # memory never traces
    "trace_gzip": ["--no_trace", "--trace_gzip"],
    "save_snapshot": ["--save_snapshot"],  # no breakdown in test mode
}


def test_every_setting_given_outside_its_scope_is_one_error_naming_it():
    """One check (plan_checks.check_scopes) for every setting whose row has a scope."""
    from dp_cost.measure import plan

    scoped = {s.name for s in settings.SETTINGS if s.scope is not None}
    assert scoped == set(OUTSIDE_SCOPE)
    for name, argv in OUTSIDE_SCOPE.items():
        args = profiling_script.parse_args(["--device", "cpu", *argv])
        with pytest.raises(settings.UsageError) as refused:
            plan.make_plan(args, cuda_available=lambda: False)
        flag = settings.BY_NAME[name].flags[0]
        assert str(refused.value).startswith(f"{flag} applies only to "), (name, refused.value)
        assert "\n" not in str(refused.value)


def test_a_scope_refusal_names_what_the_run_is_instead():
    from dp_cost.measure import plan

    def refusal(*argv) -> str:
        args = profiling_script.parse_args(["--device", "cpu", *argv])
        with pytest.raises(settings.UsageError) as refused:
            plan.make_plan(args, cuda_available=lambda: False)
        return str(refused.value)

    assert refusal("--use_lora", "--no_poisson") == (
        "--use_lora, --no_poisson apply only to Hugging Face models (--model tiny-llama or a "
        "Llama name); model is 'tiny'"
    )  # the first scope broken, with every flag given outside it
    assert refusal(*LLAMA, "--lora_rank", "8").endswith(
        "applies only to LoRA runs of a Hugging Face model (--use_lora); without --use_lora every "
        "weight is trained"
    )
    assert refusal("--mode=memory", "--no_trace").endswith("(test, profile, hf); mode is memory")
    assert refusal("--trainers", "standard", "ghost", "--flash_route", "gram").endswith(
        "runs of the flash trainer; trainers: standard, ghost"
    )


def test_experiment_config_is_the_settings_table_written_out():
    """ExperimentConfig is written out so its fields can be read and grepped; it must stay the
    settings table's: the same names in the same order, the same defaults."""
    import dataclasses

    from dp_cost.core.settings import CONFIG_FIELDS
    from dp_cost.measure.config import AXES_REQUIRED

    fields = dataclasses.fields(ExperimentConfig)
    table = [s.name for s in CONFIG_FIELDS if s.name in AXES_REQUIRED]
    table += [s.name for s in CONFIG_FIELDS if s.name not in AXES_REQUIRED]
    assert [f.name for f in fields] == table
    by_name = {s.name: s for s in CONFIG_FIELDS}
    for f in fields:
        if f.name in AXES_REQUIRED:
            assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert default == by_name[f.name].default, f.name
        assert type(default) is type(by_name[f.name].default), f.name


def test_the_distributed_mode_object_names_the_directory_and_refusals():
    from dp_cost.measure.config import ExperimentConfig
    from dp_cost.parallel.mode import distributed_mode

    single = ExperimentConfig(trainer="flash", batch_size=4, seq_len=8)
    ddp = ExperimentConfig(
        trainer="flash", batch_size=4, seq_len=8, distributed="ddp", world_size=2
    )
    assert single.config_dir == "flash_bs4_seq8"
    assert ddp.config_dir == "flash_bs4_seq8_ddp2x" and ddp.distributed_mode.replicates
    assert not single.distributed_mode.is_distributed
    assert (
        distributed_mode("fsdp", 4).graph_refusal
        and distributed_mode("ddp", 2).graph_refusal is None
    )
    assert distributed_mode("none", 8).world_size == 1
    assert [list(distributed_mode("fsdp", 3).batch_share(7, r)) for r in range(3)] == [
        [0, 1, 2], [3, 4], [5, 6]]  # fmt: skip
    with pytest.raises(ValueError, match="--distributed must be one of"):
        distributed_mode("zero3")


def test_the_distributed_choices_are_the_mode_objects_names():
    """--distributed's choices (core, read by the parser without parallel/) name the mode
    objects of parallel/mode.py, in their order."""
    from dp_cost.core.schema import DISTRIBUTED_MODES
    from dp_cost.parallel import mode

    assert tuple(mode.MODES) == DISTRIBUTED_MODES
    assert settings.BY_NAME["distributed"].choices == DISTRIBUTED_MODES


def test_a_recorded_config_reads_back_as_the_config_that_wrote_it():
    """``from_dict`` inverts ``to_dict`` through a result file's JSON; what is not a field (the
    derived physical batch, a setting since removed) is left out."""
    import json

    config = ExperimentConfig(
        trainer="flash", batch_size=8, seq_len=64, max_physical_batch_size=2, capacity=True,
        model_overrides={"num_layers": 1}, gpu_memory=[79.0],
    )  # fmt: skip
    recorded = json.loads(json.dumps(config.to_dict()))
    assert "physical_batch_size" in recorded
    assert ExperimentConfig.from_dict(recorded) == config
    assert ExperimentConfig.from_dict({**recorded, "a_removed_setting": 1}) == config
