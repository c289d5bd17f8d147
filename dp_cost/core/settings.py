"""The one table of experiment settings.

Each setting of an experiment is declared once, in ``SETTINGS`` (a row: ``core.setting``): its
name (the config field and the ``result.json`` config key), default, default per mode,
command-line flags, help, whether it names the config directory, whether reports compare
trainers only among configs equal in it, and where it takes effect (its scope: given anywhere
else, it is refused).
The command-line parser, the experiment plan, ``ExperimentConfig`` (``measure.config``), the
config directory name, the reports' comparison keys and ``--resume``'s change check all read
this table. What each mode does beside its defaults is ``core.modes``.
"""

from __future__ import annotations

from dp_cost.core import scopes
from dp_cost.core.capacity_settings import CAPACITY_SETTINGS
from dp_cost.core.hf_architectures import HF_CONFIGS
from dp_cost.core.modes import MODES, RUN_MODES
from dp_cost.core.reading import DATASET_MAX_BYTES, DATASET_MAX_LINE_BYTES
from dp_cost.core.schema import (
    CLIPPINGS,
    DISTRIBUTED_MODES,
    FSDP_SYNCS,
    TRAINER_ALIASES,
    TRAINER_ORDER,
)
from dp_cost.core.setting import Setting


class UsageError(Exception):
    """A user mistake: reported as one line with exit code 2."""


def physical_part(config) -> str | None:
    physical = config.physical_batch_size
    return f"_pb{physical}" if physical != config.batch_size // config.world_size else None


# The causal LM's named configs (``models.CONFIGS``), listed here so --help needs no torch.
LM_MODELS = ("tiny", "1b")
MODEL_OVERRIDES = ("vocab_size", "hidden_dim", "num_layers", "num_heads", "max_seq_len")
HF_MODES = dict(hf="meta-llama/Llama-3.2-3B-Instruct", hf_sweep="meta-llama/Llama-3.1-8B-Instruct")

# In the order of the config directory name: <trainer>_bs<B>_seq<T>_pb<P>_r<R>_bf16_<attention>
# _ckpt_graph_<model>; the settings that name no directory part follow.
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "trainer",
        None,
        f"trainers to run: {', '.join(TRAINER_ORDER)} (aliases: "
        f"{', '.join(f'{a}={t}' for a, t in TRAINER_ALIASES.items())}) (default: every "
        "registered one; hf_sweep: dpsgd)",
        flags=("--trainers",),
        axis=True,
        modes={"hf_sweep": ["dpsgd"]},
        dir_part=lambda c: c.trainer,
    ),
    Setting(
        "batch_size",
        None,
        "logical batch size(s)",
        flags=("--batch_sizes", "--batch_size", "--batch-size"),
        type=int,
        axis=True,
        modes=dict(
            test=[2, 4], profile=[4, 8], memory=[1], hf=[32], hf_sweep=[8, 16, 32], capacity=[8]
        ),
        dir_part=lambda c: f"_bs{c.batch_size}",
        compare=True,
    ),
    Setting(
        "seq_len",
        None,
        "sequence length(s)",
        flags=("--seq_lens", "--seq_len", "--seq_length", "--seq_lengths", "--seq-len"),
        type=int,
        axis=True,
        modes=dict(
            test=[256, 512],
            profile=[512, 1024],
            memory=[4096],
            hf=[128],
            hf_sweep=[128, 256, 512],
            capacity=[1024],
        ),
        dir_part=lambda c: f"_seq{c.seq_len}",
        compare=True,
    ),
    Setting(
        "max_physical_batch_size",
        None,
        "physical batch size(s) (default: the logical batch; hf: 1; hf_sweep: 1 2 4)",
        flags=("--max_physical_batch_sizes", "--max_physical_batch_size"),
        type=int,
        axis=True,
        modes={"hf": [1], "hf_sweep": [1, 2, 4]},
        dir_part=physical_part,
        compare=True,
        compared_value=lambda c: c.get("physical_batch_size"),
    ),
    Setting(
        "lora_rank",
        16,
        "LoRA rank(s), with --use_lora",
        flags=("--lora_ranks", "--lora_rank"),
        type=int,
        axis=True,
        modes={"hf_sweep": [8, 16]},
        dir_part=lambda c: f"_r{c.lora_rank}" if c.use_lora else None,
        compare=True,
        compared_value=lambda c: c.get("lora_rank") if c.get("use_lora") else None,
        scope=scopes.LORA,
    ),
    Setting(
        "dtype",
        "float32",
        "bfloat16: autocast for forward/backward with fp32 master weights",
        flags=("--dtype",),
        choices=("float32", "bfloat16"),
        dir_part=lambda c: "_bf16" if c.dtype == "bfloat16" else None,
        compare=True,
    ),
    Setting(
        "attention",
        "explicit",
        "default: explicit softmax (the DPMultiheadAttention LM); sdpa for Hugging Face models",
        flags=("--attention",),
        choices=("explicit", "sdpa"),
        dir_part=lambda c: f"_{c.attention}" if c.attention != c.default_attention else None,
        compare=True,
    ),
    Setting(
        "activation_checkpointing",
        False,
        "recompute each transformer block in the backward (the LM's blocks, Hugging Face's decoder "
        "layers; every trainer; flash with flat clipping makes a second backward)",
        flags=("--activation_checkpointing",),
        switch=True,
        dir_part=lambda c: "_ckpt" if c.activation_checkpointing else None,
        compare=True,
    ),
    Setting(
        "cuda_graph",
        False,
        "replay every step, whatever its Poisson-drawn size, as CUDA graphs of one padded "
        "physical chunk and of the finishing step, captured after the first step with a sample "
        "(standard and flash, CUDA, one process or DDP; under DDP standard is captured after "
        "DDP's 11th iteration: give --warmup_steps 11). The host launches a graph per chunk "
        "instead of each kernel; memory breakdowns and module censuses still measure an eager "
        "step",
        flags=("--cuda_graph",),
        switch=True,
        dir_part=lambda c: "_graph" if c.cuda_graph else None,
        compare=True,
    ),
    Setting(
        "model",
        "tiny",
        f"named model: {', '.join([*LM_MODELS, *HF_CONFIGS])}",
        flags=("--model", "--model_name"),
        modes={"profile": "1b", "memory": "1b", "capacity": "1b", **HF_MODES},
        dir_part=lambda c: "_" + c.model.replace("/", "-") if c.model != c.default_model else None,
        compare=True,
    ),
    Setting(
        "distributed",
        "none",
        "under torchrun: DDP or FSDP2 over the ranks (NCCL on GPUs, gloo on CPU). --batch_sizes "
        "is then the global logical batch, split evenly over the ranks (it must divide by their "
        "number); --max_physical_batch_sizes is per rank; every rank draws the same global batch "
        "from --seed (Hugging Face: one global Poisson draw) and takes its own slice "
        "(default: none)",
        flags=("--distributed",),
        choices=DISTRIBUTED_MODES,
        dir_part=lambda c: c.distributed_mode.dir_part(),
        compare=True,
    ),
    # The number of ranks: torchrun's WORLD_SIZE; the flag plans ranks (capacity) only.
    Setting(
        "world_size",
        1,
        "capacity: the ranks to plan for, in one process without torchrun, under --distributed "
        "(without it, under DDP and FSDP2 both); a measuring run takes its ranks from torchrun",
        flags=("--world_size",),
        type=int,
        compare=True,
    ),
    Setting(
        "fsdp_sync",
        "chunk",
        "--distributed fsdp: reduce-scatter the gradients after every physical chunk (FSDP2's "
        "own way), or hold them unsharded and reduce-scatter once per logical batch (logical: "
        "fewer collectives, the unsharded gradients' memory; ghost only syncs per chunk)",
        flags=("--fsdp_sync",),
        choices=FSDP_SYNCS,
        dir_part=lambda c: "_logicalsync" if c.fsdp_sync == "logical" else None,
        compare=True,
    ),
    Setting(
        "rank_timeout",
        600.0,
        "under torchrun: seconds a rank's worker may show no sign of life before the job ends",
        flags=("--rank_timeout",),
        type=float,
        recorded=False,
    ),
    Setting(
        "optimizer",
        "sgd",
        "plain SGD or Adam",
        flags=("--optimizer",),
        choices=("sgd", "adam"),
        compare=True,
    ),  # fmt: skip
    Setting(
        "lr",
        1e-4,
        "learning rate",
        flags=("--lr", "--learning_rate"),
        type=float,
        modes={"hf": 1e-5, "hf_sweep": 1e-5},
    ),
    Setting(
        "noise_multiplier",
        1.0,
        "sigma",
        flags=("--noise_multiplier", "--sigma"),
        type=float,
        scope=scopes.PRIVATE,
    ),
    Setting(
        "max_grad_norm",
        1.0,
        "clipping norm C",
        flags=("--max_grad_norm",),
        type=float,
        scope=scopes.PRIVATE,
    ),
    Setting(
        "clipping",
        "flat",
        "flat: one bound C on each sample's gradient over all its parameters; per_layer: "
        "Opacus' per-layer rule, each parameter tensor's per-sample gradient clipped to its own "
        "C_l = C / sqrt(P) over the P trainable tensors (sum of C_l^2 = C^2: same noise, same "
        "epsilon, a different clipping rule). dpsgd and flash; ghost has no per-layer mode; "
        "standard does not clip",
        flags=("--clipping",),
        choices=CLIPPINGS,
        dir_part=lambda c: "_perlayer" if c.clipping == "per_layer" else None,
        compare=True,
        scope=scopes.PRIVATE,
    ),
    Setting(
        "steps",
        3,
        "measured steps",
        flags=("--steps", "--num_steps", "--num_iter"),
        type=int,
        # GPU modes: >= 5; capacity's --validate: the peak of two steps after one warm-up
        modes={"profile": 5, "memory": 5, "hf": 5, "hf_sweep": 5, "capacity": 2},
        scope=scopes.MEASURED_STEPS,
    ),
    Setting(
        "warmup_steps",
        1,
        "steps before measuring",
        flags=("--warmup_steps", "--warmup_iter"),
        type=int,
        modes={"profile": 2, "memory": 2},
        scope=scopes.MEASURED_STEPS,
    ),
    Setting("seed", 0, "seed of the data and the model", flags=("--seed",), type=int),
    Setting(
        "device",
        "cpu",
        "auto: CUDA if present; cuda without CUDA is an error",
        flags=("--device",),
        choices=("auto", "cuda", "cpu"),
        modes={mode: "auto" for mode in RUN_MODES if mode != "test"},
    ),
    Setting(
        "flash_route",
        "auto",
        "how flash gets Linear layers' per-sample norms",
        flags=("--flash_route",),
        choices=("auto", "gram", "direct", "product"),
        scope=scopes.FLASH,
    ),
    Setting(
        "noise_sampler",
        "opacus",
        "dpsgd's and ghost's noise: opacus (Opacus' own torch.normal, the cost users pay; its "
        "24- or 32-bit radius can add a large tail term to delta_total) or exact64 (flash's)",
        flags=("--noise_sampler",),
        choices=("opacus", "exact64"),
        dir_part=lambda c: f"_{c.noise_sampler}" if c.noise_sampler != "opacus" else None,
        compare=True,
        scope=scopes.OPACUS,
    ),
    Setting(
        "trace",
        True,
        "numbers only: no torch.profiler trace (memory and hf_sweep never trace)",
        flags=("--no_trace",),
        switch=False,
        modes={name: False for name, mode in MODES.items() if mode.runs and not mode.traces},
        follows_mode=True,
        scope=scopes.TRACING_MODE,
    ),
    Setting(
        "trace_gzip",
        None,
        "gzip the trace files (default: on for GPU runs)",
        flags=("--trace_gzip",),
        switch=None,  # --trace_gzip / --no-trace_gzip
        scope=scopes.TRACED,
    ),
    Setting(
        "breakdown",
        False,
        "attribute the peak of one extra step to its components (CUDA)",
        modes={"memory": True, "hf_sweep": True, "capacity": True},
        follows_mode=True,
    ),
    Setting(
        "save_snapshot",
        False,
        "memory mode: keep the allocator snapshot (python -m torch.cuda._memory_viz) and an HTML "
        "timeline per config",
        flags=("--save_snapshot",),
        switch=True,
        scope=scopes.BREAKDOWN_HISTORY,
    ),
    Setting(
        "host_work",
        False,
        "count one more (DP) step's Python calls, operator dispatches, CUDA launches: host_work",
        flags=("--host_work",),
        switch=True,
        scope=scopes.MEASURED_STEPS,
    ),
    Setting(
        "ncu",
        False,
        "run one step inside cudaProfilerStart/Stop, the range ncu profiles (`--replay-mode "
        "app-range`, or `--profile-from-start off` for per-kernel replay; see "
        "run_profiling_ncu.sh); traces and timing are off",
        flags=("--ncu",),
        switch=True,
    ),
    Setting(
        "detailed_memory",
        False,
        "module census and phase costs (hf_sweep)",
        modes={"hf_sweep": True},
        follows_mode=True,
    ),
    Setting(
        "use_lora",
        False,
        "LoRA (peft) on attention and MLP",
        flags=("--use_lora",),
        switch=True,
        scope=scopes.HF_MODEL,
    ),
    Setting(
        "pretrained",
        False,
        "load the real weights (needs the hub or a local cache; default: random weights)",
        flags=("--pretrained",),
        switch=True,
        scope=scopes.HF_MODEL,
    ),
    Setting(
        "dataset_path",
        None,
        "a local SNLI JSONL, checked whole before any config runs: a regular file of at most "
        f"{DATASET_MAX_BYTES // 2**20} MiB, lines of at most {DATASET_MAX_LINE_BYTES // 2**20} "
        "MiB (default: synthetic)",
        flags=("--dataset_path",),
        scope=scopes.HF_MODEL,
    ),
    Setting(
        "dataset_size",
        10000,
        "N for the sampling rate B/N",
        flags=("--dataset_size",),
        type=int,
        scope=scopes.SYNTHETIC_DATA,
    ),
    Setting(
        "poisson",
        True,
        "fixed-size batches",
        flags=("--no_poisson",),
        switch=False,
        scope=scopes.HF_MODEL,
    ),
    Setting(
        "delta",
        1e-5,
        "delta of the reported epsilon",
        flags=("--delta",),
        type=float,
        scope=scopes.POISSON_EPSILON,
    ),
    *CAPACITY_SETTINGS,
    *(
        Setting(
            name,
            None,
            f"override the causal LM's {name}",
            flags=(f"--{name}",),
            type=int,
            into="model_overrides",
            scope=scopes.NAMED_LM,
        )  # fmt: skip
        for name in MODEL_OVERRIDES
    ),
    Setting("model_overrides", {}, "the --vocab_size ... overrides given"),
    # The mode's default model: the directory name omits the model when it is this one.
    Setting("default_model", "tiny", recorded=False),
)
BY_NAME = {s.name: s for s in SETTINGS}
CONFIG_FIELDS = tuple(s for s in SETTINGS if s.into is None)
