"""The plan's checks: a plan that cannot run as asked is a ``UsageError`` (one line, exit 2),
found before any worker starts.

Every check that needs no torch runs first, so a mistake is one line in a fraction of a second;
the last ones (the model's longest sequence and its least bytes) build the model on the meta
device and import torch.
"""

from __future__ import annotations

import math

from dp_cost.capacity.card_rates import CardRatesError, card_rates
from dp_cost.capacity.model_facts import bytes_lower_bound, model_max_seq_len, parameter_count
from dp_cost.core.hf_architectures import HF_CONFIGS
from dp_cost.core.modes import MODES
from dp_cost.core.scopes import PlannedRun
from dp_cost.core.settings import SETTINGS, UsageError
from dp_cost.hf import snli_file
from dp_cost.parallel import ranks
from dp_cost.parallel.mode import distributed_mode, fsdp_sync_refusal

MAX_PLANNED_RANKS = 4096
SEQ_LEN_STEP = 64  # the sequence lengths --find_max_seq_len searches: multiples of this
MAX_GPU_MEMORY_GIB = 2**16  # 64 TiB: far above any card, below torch's size arithmetic
# A result records each step (its times, losses, memory snapshots: about 1 kB a step), and a
# result.json over core.reading.MAX_RESULT_BYTES is not read back: 10,000 steps stay well under.
MAX_STEPS = 10_000
MAX_SEED = 2**63 - 1  # torch.manual_seed takes 64-bit seeds
BILLION = 10**9
ADDRESS_SPACE = 2**47  # bytes of a process's user address space (x86-64, 4-level paging)


def check(values: dict, axes: dict, args) -> int:
    """UsageError for a plan that cannot run as asked; else the dataset's N (a dataset file's
    rows, as read here, or --dataset_size)."""
    model = values["model"]
    check_numbers(values)
    check_distributed(values, axes["batch_size"])
    if args.mode == "hf_sweep" and model not in HF_CONFIGS:
        known = ", ".join(HF_CONFIGS)
        raise UsageError(f"--mode=hf_sweep needs a Hugging Face model ({known}), got {model!r}")
    check_scopes(values, axes, args)
    dataset_size = values["dataset_size"]
    if values["dataset_path"]:
        dataset_size = check_dataset_file(values["dataset_path"], max(axes["batch_size"]))
    check_capacity(values, axes, args)
    check_training_values(values, axes)
    check_batch_shapes(values, axes)
    check_cuda_features(values)
    check_model_fits(values, axes)
    return dataset_size


def check_training_values(values: dict, axes: dict) -> None:
    """LoRA ranks, the dataset's size, the noise, the clipping bound, the learning rate and
    delta in range."""
    if min(axes["lora_rank"]) <= 0 or values["dataset_size"] <= 0:
        raise UsageError("--lora_ranks and --dataset_size must be positive")
    if values["noise_multiplier"] < 0 or values["max_grad_norm"] <= 0 or values["lr"] <= 0:
        raise UsageError("--noise_multiplier must be >= 0, --max_grad_norm and --lr > 0")
    if not 0 < values["delta"] < 1:
        raise UsageError(f"--delta must be in (0, 1), got {values['delta']}")


def check_batch_shapes(values: dict, axes: dict) -> None:
    """Sequence lengths a sentence pair fits in, batch sizes positive and at most the dataset,
    physical batches positive and at most a logical one, then the step counts."""
    batch_sizes, seq_lens = axes["batch_size"], axes["seq_len"]
    if values["model"] in HF_CONFIGS:
        if min(seq_lens) < 3:
            raise UsageError("a sentence pair needs seq_len >= 3 (premise, separator, hypothesis)")
        if not values["dataset_path"] and max(batch_sizes) > values["dataset_size"]:
            raise UsageError(
                f"batch size {max(batch_sizes)} > --dataset_size {values['dataset_size']}: the "
                "sampling rate B/N must be at most 1"
            )
    for b in batch_sizes:
        if b <= 0:
            raise UsageError(f"batch size must be positive, got {b}")
    for pb in axes["max_physical_batch_size"]:
        if pb is not None and pb <= 0:
            raise UsageError(f"physical batch size must be positive, got {pb}")
        if pb is not None and pb > max(batch_sizes):
            raise UsageError(f"physical batch {pb} > every logical batch size {batch_sizes}")
    if values["steps"] <= 0 or values["warmup_steps"] < 0:
        raise UsageError("--steps must be positive and --warmup_steps non-negative")
    if values["steps"] > MAX_STEPS or values["warmup_steps"] > MAX_STEPS:
        raise UsageError(f"--steps and --warmup_steps must be at most {MAX_STEPS}")


def check_cuda_features(values: dict) -> None:
    """--ncu and --cuda_graph need CUDA, exclude each other, and a graph the mode can capture."""
    if values["ncu"] and values["device"] != "cuda":
        raise UsageError("--ncu profiles CUDA kernels: it needs a CUDA device")
    if values["cuda_graph"] and values["device"] != "cuda":
        raise UsageError("--cuda_graph replays CUDA graphs: it needs a CUDA device")
    if values["cuda_graph"] and values["ncu"]:
        raise UsageError("--ncu profiles one eager step in named phases: drop --cuda_graph")
    if values["cuda_graph"] and (reason := distributed_mode(values["distributed"]).graph_refusal):
        raise UsageError(reason)


def check_model_fits(values: dict, axes: dict) -> None:
    """The model's own numbers (the first check that imports torch: models): every sequence
    length within its longest, and its least bytes within a process's address space."""
    model, seq_lens = values["model"], axes["seq_len"]
    max_seq_len = model_max_seq_len(model, values["attention"], values["model_overrides"])
    for t in seq_lens:
        if not 0 < t <= max_seq_len:
            raise UsageError(
                f"seq_len {t} must be in 1..{max_seq_len} (the max_seq_len of model "
                f"{model!r}; raise it with --max_seq_len)"
            )
    # A rank's chunk: the cap, else its share of the global batch
    ranks_count = values["world_size"]
    physical = max(
        pb or b // ranks_count for pb in axes["max_physical_batch_size"] for b in axes["batch_size"]
    )
    needed = bytes_lower_bound(
        model, values["model_overrides"], physical, max(seq_lens), values["dataset_size"]
    )
    if needed > ADDRESS_SPACE:
        raise UsageError(
            f"model {model!r} at batch {physical} x seq_len {max(seq_lens)} needs at least "
            f"{needed / 2**40:.0f} TiB: more than any process can address"
        )


def check_cpu_model_size(model: str, overrides: dict, no_cuda: bool) -> None:
    """A model of a billion parameters or more on a CPU nobody asked for (no CUDA, or a mode
    whose default device is the CPU, such as test) is a mistake, not a measurement."""
    count = parameter_count(model, overrides)
    if count >= BILLION:
        raise UsageError(
            f"{'no CUDA device found and ' if no_cuda else ''}--model {model} has about "
            f"{count / BILLION:.1f}B parameters, on the CPU: add --device cpu to run it "
            "there anyway"
        )


def check_scopes(values: dict, axes: dict, args) -> None:
    """A setting given where it takes no effect (outside its scope in the settings table) is an
    error, not a silent no-op recorded as if used. The first scope broken is named, with every
    flag given outside it."""
    run = PlannedRun(MODES[args.mode], values, axes)
    given = [s for s in SETTINGS if s.flags and getattr(args, s.dest, None) is not None]
    broken = [s for s in given if s.scope is not None and not s.scope.holds(run)]
    if broken:
        scope = broken[0].scope
        flags = [s.flags[0] for s in broken if s.scope is scope]
        verb = "applies" if len(flags) == 1 else "apply"
        raise UsageError(f"{', '.join(flags)} {verb} only to {scope.where}; {scope.instead(run)}")


def check_distributed(values: dict, batch_sizes: list[int]) -> None:
    ranks_count = values["world_size"]
    for b in batch_sizes:
        if b % ranks_count:
            raise UsageError(
                f"batch size {b} does not split evenly over {ranks_count} ranks (--batch_sizes "
                f"is the global batch): give a multiple of {ranks_count}"
            )
    if values["ncu"] and distributed_mode(values["distributed"]).is_distributed:
        raise UsageError("--ncu profiles one process: run it without --distributed")
    if reason := fsdp_sync_refusal(values["distributed"], values["fsdp_sync"]):
        raise UsageError(reason)


def capacity_searches(values: dict) -> tuple[tuple[str, bool], ...]:
    """(flag, given) of --mode=capacity's flags that measure on a GPU."""
    return (
        ("--validate", values["validate"]),
        ("--find_max_batch", values["find_max_batch"]),
        ("--find_max_seq_len", values["find_max_seq_len"]),
    )


MAX_EPOCHS = 10**6
DEFAULT_CARD = next(setting.default for setting in SETTINGS if setting.name == "card")


def check_time_settings(values: dict) -> None:
    """--card names a card with a time calibration (any spelling of its name; the default's
    table missing or broken costs the plan its times, not the run), --epochs is a count of a
    dataset whose size is known, --recommend has a card's memory to fit."""
    card = values["card"]
    if card != DEFAULT_CARD or values["recommend"]:  # --recommend needs the times
        try:
            card_rates(card)
        except CardRatesError as error:
            flag = "--card" if card != DEFAULT_CARD else "--recommend"
            raise UsageError(f"{flag}: {error}") from None
    epochs = values["epochs"]
    if epochs is not None and not 1 <= epochs <= MAX_EPOCHS:
        raise UsageError(f"--epochs must be 1..{MAX_EPOCHS}, got {epochs}")
    if epochs is not None and values["dataset_path"]:
        raise UsageError(
            "--epochs counts epochs of --dataset_size N samples: give N, without --dataset_path"
        )
    if values["recommend"] and not values["gpu_memory"]:
        raise UsageError("--recommend ranks what fits a card: give its memory, --gpu_memory GiB")
    ranks = values["world_size"]
    if values["recommend"] and ranks > 1 and ranks not in card_rates(card).collective_ranks():
        measured = ", ".join(map(str, card_rates(card).collective_ranks())) or "none"
        raise UsageError(
            f"--recommend ranks predicted times, and {card}'s calibration has no collectives of "
            f"{ranks} ranks (measured: {measured}; benchmarks/collective_rates.py measures them)"
        )


def check_capacity(values: dict, axes: dict, args) -> None:
    """--mode=capacity's flags (given in another mode, refused by their scope): budgets are
    finite positive GiB; --validate, --find_max_batch and --find_max_seq_len measure, so they
    need CUDA, and one search a run."""
    if not MODES[args.mode].predicts:  # its flags are refused elsewhere (their scope)
        return
    check_searches(values)
    if distributed_mode(values["distributed"]).is_distributed:
        check_planned_ranks(values)
    for budget in values["gpu_memory"] or []:
        if not (math.isfinite(budget) and 0 < budget <= MAX_GPU_MEMORY_GIB):
            raise UsageError(
                f"--gpu_memory must be a finite positive number of GiB (at most "
                f"{MAX_GPU_MEMORY_GIB}), got {budget}"
            )
    check_time_settings(values)
    if values["validate"] and values["model"] in HF_CONFIGS and values["poisson"]:
        if None in axes["max_physical_batch_size"]:
            raise UsageError(
                "--validate with Poisson sampling needs --max_physical_batch_size: without a cap "
                "the prediction plans the rare largest draw, not the draws a run measures"
            )
    for flag, given in capacity_searches(values):
        if given and values["device"] != "cuda":
            raise UsageError(f"{flag} measures on a GPU: it needs a CUDA device")


def check_searches(values: dict) -> None:
    """One search a run; --find_max_seq_len needs a model that takes one step of tokens."""
    if values["find_max_seq_len"]:
        longest = model_max_seq_len(values["model"], values["attention"], values["model_overrides"])
        if longest < SEQ_LEN_STEP:
            raise UsageError(
                f"--find_max_seq_len searches multiples of {SEQ_LEN_STEP} tokens: model "
                f"{values['model']!r} takes at most {longest}"
            )
    if values["find_max_batch"] and values["find_max_seq_len"]:
        raise UsageError(
            "--find_max_batch and --find_max_seq_len: one search a run (the other is held "
            "at the config's value)"
        )


def check_planned_ranks(values: dict) -> None:
    """--mode=capacity over several ranks: planned in one process (--world_size W), or measured
    with --validate on the ranks of a torchrun job; never searched."""
    for flag, given in capacity_searches(values)[1:]:
        if given:
            raise UsageError(
                f"{flag} searches one process's config by runs: several ranks are "
                "planned (--world_size W), not searched"
            )
    under_torchrun = ranks.from_environment() is not None
    if under_torchrun and not values["validate"]:
        raise UsageError(
            "--mode=capacity under torchrun measures on the job's ranks: add --validate, "
            "or plan without torchrun (--world_size W)"
        )
    if values["validate"] and not under_torchrun:
        raise UsageError(
            "--validate with --distributed measures on the ranks of a torchrun job: "
            "torchrun --nproc_per_node <GPUs> profiling_script.py --mode=capacity "
            "--validate ..."
        )


def check_numbers(values: dict) -> None:
    """Every float finite; the seed and model overrides in range (sizes: in ``check``)."""
    for name in ("lr", "noise_multiplier", "max_grad_norm", "delta", "rank_timeout"):
        if not math.isfinite(values[name]):
            raise UsageError(f"--{name} must be a finite number, got {values[name]}")
    if values["rank_timeout"] <= 0:
        raise UsageError(f"--rank_timeout must be positive seconds, got {values['rank_timeout']}")
    if not 0 <= values["seed"] <= MAX_SEED:
        raise UsageError(f"--seed must be in 0..{MAX_SEED}, got {values['seed']}")
    for name, value in values["model_overrides"].items():
        if value <= 0:
            raise UsageError(f"--{name} must be positive, got {value}")


def check_dataset_file(path: str, largest_batch: int) -> int:
    """Its labelled pairs (the N of the sampling rate B/N); UsageError, one line naming the file,
    the line and what is wrong, unless every line of ``path`` is what ``hf.data.snli_pairs``
    reads (the whole file, streamed, before any worker starts) and it holds at least as many
    pairs as the largest logical batch (B/N <= 1)."""
    try:
        pairs = snli_file.count_snli_pairs(path)
    except snli_file.DatasetError as error:
        raise UsageError(f"--dataset_path {error}") from None
    if pairs < largest_batch:
        raise UsageError(
            f"--dataset_path {path} has {pairs} labelled pairs, fewer than the batch size "
            f"{largest_batch}: the sampling rate B/N must be at most 1"
        )
    return pairs
