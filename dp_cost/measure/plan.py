"""Command-line arguments -> the experiment plan: one ``ExperimentConfig`` per combination.

Every value comes from the settings table (``core.settings.SETTINGS``): the command line where
given, else the mode's default. What a mode does without CUDA is its ``Mode`` row. The plan is
checked here, before any worker starts: a bad value is a ``UsageError`` (one line, exit 2).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from dataclasses import dataclass

from dp_cost.core.hf_architectures import HF_CONFIGS
from dp_cost.core.modes import MODES
from dp_cost.core.schema import TRAINER_ORDER, canonical_trainer_name
from dp_cost.core.settings import (
    BY_NAME,
    CONFIG_FIELDS,
    HF_SETTINGS,
    MODEL_OVERRIDES,
    SETTINGS,
    UsageError,
    default_attention,
)
from dp_cost.hf import snli_file
from dp_cost.measure.config import ExperimentConfig
from dp_cost.measure.model_facts import bytes_lower_bound, model_max_seq_len, parameter_count
from dp_cost.parallel import ranks
from dp_cost.parallel.mode import distributed_mode, fsdp_sync_refusal


@dataclass
class Plan:
    mode: str  # the mode that runs: a GPU mode without CUDA may run as another
    device: str  # "cuda" or "cpu"
    configs: list  # list[ExperimentConfig]
    note: str | None = None  # printed first: what changed without CUDA; what a graph will replay


def resolve_device(args: argparse.Namespace, cuda_available) -> tuple[str, str, str, str | None]:
    """(device, mode that runs, mode whose defaults apply, note). ``cuda_available()`` is asked
    only when the device is not forced to CPU."""
    mode = MODES[args.mode]
    requested = args.device or BY_NAME["device"].default_for(mode.name)
    if requested == "cpu":
        return "cpu", mode.name, mode.name, None
    if cuda_available():
        return "cuda", mode.name, mode.name, None
    if requested == "cuda":
        raise UsageError("--device cuda was given but no CUDA device is available")
    running = mode.cpu_defaults if mode.cpu_becomes else mode.name
    defaults = mode.cpu_defaults or mode.name
    model = args.model or mode.cpu_model
    return "cpu", running, defaults, mode.cpu_message.format(model=model)


def make_plan(args: argparse.Namespace, cuda_available) -> Plan:
    device, running, defaults, note = resolve_device(args, cuda_available)
    mode = MODES[args.mode]

    def value(setting):
        given = getattr(args, setting.dest, None) if setting.flags else None
        if given is not None:
            return given
        if setting.name == "model" and note and mode.cpu_model:  # no CUDA: the CPU model
            return mode.cpu_model
        return setting.default_for(running if setting.follows_mode else defaults)

    values = {s.name: value(s) for s in CONFIG_FIELDS}
    values["model_overrides"] = {
        name: getattr(args, name) for name in MODEL_OVERRIDES if getattr(args, name) is not None
    }
    values["default_model"] = BY_NAME["model"].default_for(defaults)
    values["device"] = device
    if args.attention is None:
        values["attention"] = default_attention(values["model"])
    if values["ncu"]:  # one replayed step: no trace, no breakdown
        values["trace"] = values["breakdown"] = False
    values["world_size"] = world_size(values["distributed"], args.world_size, mode)
    names = [args.trainer] if args.trainer else values["trainer"]
    try:
        known = trainer_names()
        names = [canonical_trainer_name(n, known) for n in names or known]
    except ValueError as error:
        raise UsageError(str(error)) from None
    values["trainer"] = names
    axes = {name: _unique(values.pop(name)) for name in ("batch_size", "seq_len", "trainer")}
    axes["max_physical_batch_size"] = _unique(values.pop("max_physical_batch_size") or [None])
    axes["lora_rank"] = _lora_ranks(args, values.pop("lora_rank"))
    dataset_size = check(values, axes, args)
    if device == "cpu" and args.device != "cpu" and args.model and not mode.predicts:
        # The CPU was not asked for (no CUDA, or a mode whose default device is the CPU, such
        # as test): a huge model there is a mistake, not a measurement
        count = parameter_count(args.model, values["model_overrides"])
        if count >= BILLION:
            raise UsageError(
                f"{'no CUDA device found and ' if note else ''}--model {args.model} has about "
                f"{count / BILLION:.1f}B parameters, on the CPU: add --device cpu to run it "
                "there anyway"
            )
    notes = [note, poisson_graph_note(values, axes, dataset_size), ddp_graph_note(values, axes)]
    note = "\n".join(filter(None, notes)) or None
    order = ("batch_size", "max_physical_batch_size", "seq_len", "lora_rank", "trainer")
    configs = [
        ExperimentConfig(**values, **dict(zip(order, combination)))
        for combination in itertools.product(*(axes[name] for name in order))
    ]
    return Plan(running, device, configs, note)


def trainer_names() -> list[str]:
    """The registered trainers' names (``trainers.TRAINERS``), read without importing torch
    where nothing imported the registry yet: it then holds the built-in trainers alone
    (``TRAINER_ORDER``; a test keeps the two equal), since registering one imports it."""
    registry = sys.modules.get("trainers")
    return list(registry.TRAINERS) if registry is not None else list(TRAINER_ORDER)


def ddp_graph_note(values: dict, axes: dict) -> str | None:
    """standard under DDP is captured only after DDP's 11th iteration: say so before the run
    when the warm-up steps stop short of it (the timed steps would start eagerly)."""
    graphed = values["cuda_graph"] and distributed_mode(values["distributed"]).replicates
    if not graphed or "standard" not in axes["trainer"]:
        return None
    from dp_cost.parallel import ddp  # torch: imported once the checks that need none have passed

    if values["warmup_steps"] >= ddp.EAGER_ITERATIONS:
        return None
    return (
        f"note: --cuda_graph under DDP captures standard after DDP's {ddp.EAGER_ITERATIONS}th "
        f"iteration: with --warmup_steps {values['warmup_steps']} its first timed steps run "
        f"eagerly (give --warmup_steps {ddp.EAGER_ITERATIONS})"
    )


def poisson_graph_note(values: dict, axes: dict, dataset_size: int) -> str | None:
    """With --cuda_graph and Poisson batches (Hugging Face models) the graph replays chunks of
    P samples, P the expected batch (a rank's share of it) unless a smaller cap is given: say,
    before the run, how often a draw takes a second chunk then, and what a cap does."""
    if not (values["cuda_graph"] and values["poisson"] and values["model"] in HF_CONFIGS):
        return None
    import trainers  # torch: imported once the checks that need none have passed

    if not any(trainers.TRAINERS[name].capturable for name in axes["trainer"]):
        return None  # every config is skipped, with its reason
    ranks = values["world_size"]
    uncapped = [
        batch
        for batch in axes["batch_size"]
        for cap in axes["max_physical_batch_size"]
        if cap is None or cap >= math.ceil(batch / ranks)
    ]
    if not uncapped:
        return None
    # A draw of n takes a second chunk on some rank when its largest share, ceil(n / W), is
    # above P = ceil(B / W): n > W * P. N: the labelled pairs of a dataset file, or
    # --dataset_size.
    shares = ", ".join(
        f"{100 * draw_above_probability(ranks * math.ceil(b / ranks), b, dataset_size):.2g}% "
        f"of steps at batch {b}"
        for b in _unique(uncapped)
    )
    return (
        "note: --cuda_graph replays padded chunks of the expected batch (a rank's share of it) "
        f"when --max_physical_batch_size does not cap it lower; larger Poisson draws replay two "
        f"chunks, the second mostly padding (about {shares}). A smaller "
        "--max_physical_batch_size pads less; every draw replays the graphs either way."
    )


def draw_probability(count: int, batch_size: int, dataset_size: int) -> float:
    """P(a Poisson-sampled batch has exactly ``count`` samples) at rate B/N: binomial over N
    samples, or its Poisson limit where N >> B (lgamma's differences lose digits there)."""
    k, b, n = count, batch_size, dataset_size
    if k > n:
        return 0.0
    if n > 10**6 * b:
        return math.exp(k * math.log(b) - b - math.lgamma(k + 1))
    if b == n:
        return float(k == n)
    log_choose = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    return math.exp(log_choose + k * math.log(b / n) + (n - k) * math.log1p(-b / n))


def draw_above_probability(limit: int, batch_size: int, dataset_size: int) -> float:
    """P(a Poisson-sampled batch has more than ``limit`` samples)."""
    below = math.fsum(draw_probability(k, batch_size, dataset_size) for k in range(limit + 1))
    return max(0.0, 1.0 - below)


def _unique(values) -> list:
    """Each value once, in order: a repeated value would run one config directory twice."""
    return list(dict.fromkeys(values if isinstance(values, list) else [values]))


def _lora_ranks(args, ranks) -> list[int]:
    ranks = _unique(ranks)
    if args.lora_ranks and len(ranks) > 1 and not args.use_lora:
        raise UsageError("several --lora_ranks need --use_lora (without it there is no LoRA)")
    if not args.use_lora:  # one rank, recorded in the config and not used
        ranks = [args.lora_ranks[0] if args.lora_ranks else BY_NAME["lora_rank"].default]
    return ranks


def check_applies(model: str, args) -> None:
    """A setting the model would ignore is an error, not a silent no-op recorded as if used."""
    given = [s for s in SETTINGS if s.flags and getattr(args, s.dest, None) is not None]
    if model not in HF_CONFIGS:
        ignored = [s.flags[0] for s in given if s.name in HF_SETTINGS]
        what = "Hugging Face models (--model tiny-llama or a Llama name)"
    else:
        ignored = [s.flags[0] for s in given if s.into == "model_overrides"]
        what = "the named LM configs (tiny, 1b); a Hugging Face model keeps its shipped config"
    if ignored:
        raise UsageError(f"{', '.join(ignored)} applies only to {what}; model is {model!r}")


def world_size(distributed: str, planned: int | None, mode) -> int:
    """The ranks of a distributed run: torchrun's WORLD_SIZE, or ``planned`` (--world_size, for
    --mode=capacity without torchrun); UsageError where --distributed, --world_size and the way
    the CLI was started disagree."""
    try:
        info = ranks.from_environment()
    except ValueError as error:
        raise UsageError(str(error)) from None
    over_ranks = distributed_mode(distributed).is_distributed
    if planned is not None:
        if not mode.predicts:
            raise UsageError(
                "--world_size plans ranks without torchrun: it needs --mode=capacity (a "
                "measuring run takes its ranks from torchrun)"
            )
        if not 1 <= planned <= MAX_PLANNED_RANKS:
            raise UsageError(f"--world_size must be in 1..{MAX_PLANNED_RANKS}, got {planned}")
        if info is not None:
            raise UsageError(
                "--world_size plans ranks in one process: run --mode=capacity without "
                "torchrun (under torchrun, --validate measures on the job's own ranks)"
            )
        if planned > 1 and not over_ranks:
            raise UsageError(
                f"--world_size {planned} plans ranks of --distributed ddp or fsdp: add one"
            )
        if planned == 1 and over_ranks:
            raise UsageError(
                f"--distributed {distributed} plans 2 or more ranks: give --world_size 2 or more "
                "(one rank is --distributed none)"
            )
    if not over_ranks:
        if info is not None and info.world_size > 1:
            raise UsageError(
                f"started by torchrun with {info.world_size} ranks: add --distributed ddp or "
                "--distributed fsdp (else every rank would run every config alone)"
            )
        return 1
    if info is None:
        if mode.predicts:
            if planned is None:
                raise UsageError(
                    f"--mode=capacity --distributed {distributed} plans ranks in one process: "
                    "give their number, --world_size W"
                )
            return planned
        raise UsageError(
            f"--distributed {distributed} runs under torchrun, one process per GPU: "
            f"torchrun --nproc_per_node <GPUs> profiling_script.py ... --distributed {distributed}"
        )
    return info.world_size


MAX_PLANNED_RANKS = 4096


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


def check(values: dict, axes: dict, args) -> int:
    """UsageError for a plan that cannot run as asked; else the dataset's N (a dataset file's
    rows, as read here, or --dataset_size)."""
    model = values["model"]
    check_numbers(values)
    check_distributed(values, axes["batch_size"])
    dataset_size = values["dataset_size"]
    if values["dataset_path"]:
        dataset_size = check_dataset_file(values["dataset_path"], max(axes["batch_size"]))
    if args.mode == "hf_sweep" and model not in HF_CONFIGS:
        known = ", ".join(HF_CONFIGS)
        raise UsageError(f"--mode=hf_sweep needs a Hugging Face model ({known}), got {model!r}")
    check_applies(model, args)
    check_capacity(values, axes, args)
    if values["save_snapshot"] and not values["breakdown"]:
        raise UsageError("--save_snapshot keeps the breakdown's allocator history: it needs "
                         "--mode=memory or --mode=hf_sweep")  # fmt: skip
    if min(axes["lora_rank"]) <= 0 or values["dataset_size"] <= 0:
        raise UsageError("--lora_ranks and --dataset_size must be positive")
    if values["noise_multiplier"] < 0 or values["max_grad_norm"] <= 0 or values["lr"] <= 0:
        raise UsageError("--noise_multiplier must be >= 0, --max_grad_norm and --lr > 0")
    if not 0 < values["delta"] < 1:
        raise UsageError(f"--delta must be in (0, 1), got {values['delta']}")
    batch_sizes, seq_lens = axes["batch_size"], axes["seq_len"]
    if model in HF_CONFIGS:
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
    if values["ncu"] and values["device"] != "cuda":
        raise UsageError("--ncu profiles CUDA kernels: it needs a CUDA device")
    if values["cuda_graph"] and values["device"] != "cuda":
        raise UsageError("--cuda_graph replays CUDA graphs: it needs a CUDA device")
    if values["cuda_graph"] and values["ncu"]:
        raise UsageError("--ncu profiles one eager step in named phases: drop --cuda_graph")
    if values["cuda_graph"] and (reason := distributed_mode(values["distributed"]).graph_refusal):
        raise UsageError(reason)
    # From here on the model's own numbers: the first check that imports torch (models)
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
        pb or b // ranks_count for pb in axes["max_physical_batch_size"] for b in batch_sizes
    )
    needed = bytes_lower_bound(
        model, values["model_overrides"], physical, max(seq_lens), values["dataset_size"]
    )
    if needed > ADDRESS_SPACE:
        raise UsageError(
            f"model {model!r} at batch {physical} x seq_len {max(seq_lens)} needs at least "
            f"{needed / 2**40:.0f} TiB: more than any process can address"
        )
    return dataset_size


SEQ_LEN_STEP = 64  # the sequence lengths --find_max_seq_len searches: multiples of this
MAX_GPU_MEMORY_GIB = 2**16  # 64 TiB: far above any card, below torch's size arithmetic


def check_capacity(values: dict, axes: dict, args) -> None:
    """--gpu_memory, --validate, --find_max_batch and --find_max_seq_len belong to
    --mode=capacity; budgets are finite positive GiB; the last three measure, so they need
    CUDA."""
    budgets = values["gpu_memory"] or []
    measuring = (
        ("--validate", values["validate"]),
        ("--find_max_batch", values["find_max_batch"]),
        ("--find_max_seq_len", values["find_max_seq_len"]),
    )
    if not MODES[args.mode].predicts:
        for flag, given in (("--gpu_memory", budgets), *measuring):
            if given:
                raise UsageError(f"{flag} plans memory: it needs --mode=capacity")
        return
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
    if distributed_mode(values["distributed"]).is_distributed:
        for flag, given in measuring[1:]:
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
    for budget in budgets:
        if not (math.isfinite(budget) and 0 < budget <= MAX_GPU_MEMORY_GIB):
            raise UsageError(
                f"--gpu_memory must be a finite positive number of GiB (at most "
                f"{MAX_GPU_MEMORY_GIB}), got {budget}"
            )
    values["gpu_memory"] = _unique(budgets) or None  # a card named twice is searched once
    if values["save_snapshot"] and not values["validate"]:
        raise UsageError(
            "--save_snapshot keeps a measured step's allocator history: with --mode=capacity "
            "it needs --validate"
        )
    if values["validate"] and values["model"] in HF_CONFIGS and values["poisson"]:
        if None in axes["max_physical_batch_size"]:
            raise UsageError(
                "--validate with Poisson sampling needs --max_physical_batch_size: without a cap "
                "the prediction plans the rare largest draw, not the draws a run measures"
            )
    for flag, given in measuring:
        if given and values["device"] != "cuda":
            raise UsageError(f"{flag} measures on a GPU: it needs a CUDA device")


# A result records each step (its times, losses, memory snapshots: about 1 kB a step), and a
# result.json over core.reading.MAX_RESULT_BYTES is not read back: 10,000 steps stay well under.
MAX_STEPS = 10_000
MAX_SEED = 2**63 - 1  # torch.manual_seed takes 64-bit seeds
BILLION = 10**9
ADDRESS_SPACE = 2**47  # bytes of a process's user address space (x86-64, 4-level paging)


def check_numbers(values: dict) -> None:
    """Every float finite; the seed and model overrides in range (sizes: in ``check``)."""
    for name in ("lr", "noise_multiplier", "max_grad_norm", "delta"):
        if not math.isfinite(values[name]):
            raise UsageError(f"--{name} must be a finite number, got {values[name]}")
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
