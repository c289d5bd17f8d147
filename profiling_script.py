"""What does differential privacy cost in training? One CLI for every measurement.

    python profiling_script.py --mode=test                  # CPU, tiny model, every trainer
    python profiling_script.py --mode=profile               # GPU, ~1B-parameter model
    python profiling_script.py --mode=report --input_dir runs/<run>

CLI args -> experiment plan (list of ExperimentConfig) -> runner (one forked worker per config)
-> <output_dir>/<run_name>/<config_dir>/result.json -> report (summary table, csv, md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

EXIT_OK, EXIT_CONFIG_ERROR, EXIT_BAD_ARGS, EXIT_INTERRUPTED = 0, 1, 2, 130

# Per-mode defaults (the seeds' values): test is the tiny CPU model, profile the 1b model.
MODE_DEFAULTS = {
    "test": dict(
        model="tiny", batch_sizes=[2, 4], seq_lens=[256, 512], steps=3, warmup_steps=1, device="cpu"
    ),
    "profile": dict(
        model="1b", batch_sizes=[4, 8], seq_lens=[512, 1024], steps=5, warmup_steps=2, device="auto"
    ),
    # Where the peak goes (seed 002: NUM_ITER=3, WARMUP_ITER=2): breakdown on, traces off.
    "memory": dict(
        model="1b", batch_sizes=[1], seq_lens=[4096], steps=3, warmup_steps=2, device="auto"
    ),
    # Hugging Face sequence classifier (seed 004's single-GPU script defaults).
    "hf": dict(
        model="meta-llama/Llama-3.2-3B-Instruct",
        batch_sizes=[32],
        seq_lens=[128],
        physical=[1],
        steps=5,
        warmup_steps=1,
        device="auto",
        lr=1e-5,
    ),
    # Sweep of seq x batch x physical x LoRA rank (seed 003's command; the ranks apply with
    # --use_lora). One trainer by default, the seeds' Opacus per-sample gradients: a sweep
    # multiplies configs; --trainers adds others. Traces off, module census and breakdown on.
    "hf_sweep": dict(
        model="meta-llama/Llama-3.1-8B-Instruct",
        trainers=["dpsgd"],
        batch_sizes=[8, 16, 32],
        seq_lens=[128, 256, 512],
        physical=[1, 2, 4],
        lora_ranks=[8, 16],
        steps=5,
        warmup_steps=1,
        device="auto",
        lr=1e-5,
    ),
}
MODES = ("test", "profile", "memory", "hf", "hf_sweep", "report", "ncu_report")


class UsageError(Exception):
    """A user mistake: reported as one line with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Measure the memory and time DP-SGD costs per clipping method.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--mode", choices=MODES, default="test")
    p.add_argument("--trainers", nargs="+", default=None, help="trainers (default: every one)")
    p.add_argument(
        "--trainer",
        "--experiment",
        "--grad_sample_mode",
        dest="trainer",
        default=None,
        help="a single trainer (alias of --trainers X)",
    )
    p.add_argument("--model", "--model_name", default=None, help="named model config")
    p.add_argument("--batch_sizes", "--batch_size", "--batch-size", nargs="+", type=int)
    p.add_argument(
        "--max_physical_batch_sizes",
        "--max_physical_batch_size",
        nargs="+",
        type=int,
        help="physical batch (default: the logical batch)",
    )
    p.add_argument(
        "--seq_lens", "--seq_len", "--seq_length", "--seq_lengths", "--seq-len", nargs="+", type=int
    )
    p.add_argument("--steps", "--num_steps", "--num_iter", type=int, help="measured steps")
    p.add_argument("--warmup_steps", "--warmup_iter", type=int, help="steps before measuring")
    p.add_argument(
        "--lr", "--learning_rate", type=float, default=None, help="default 1e-4 (hf: 1e-5)"
    )
    p.add_argument("--noise_multiplier", "--sigma", type=float, default=1.0)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--attention",
        choices=("explicit", "sdpa"),
        default=None,
        help="default: explicit (the seeds' model); sdpa for Hugging Face models",
    )
    p.add_argument("--flash_route", choices=("auto", "gram", "direct", "product"), default="auto")
    p.add_argument("--no_trace", action="store_true", help="numbers only: no torch.profiler trace")
    p.add_argument(
        "--trace_gzip",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gzip the trace files (default: on for GPU runs)",
    )
    p.add_argument(
        "--save_snapshot",
        action="store_true",
        help="memory mode: keep the allocator snapshot (python -m torch.cuda._memory_viz) and an "
        "HTML timeline per config",
    )
    p.add_argument(
        "--activation_checkpointing",
        action="store_true",
        help="recompute each transformer block in backward (standard trainer only)",
    )
    p.add_argument(
        "--ncu",
        action="store_true",
        help="run one step inside cudaProfilerStart/Stop, the range ncu profiles "
        "(`--replay-mode app-range`, or `--profile-from-start off` for per-kernel replay; see "
        "run_profiling_ncu.sh); traces and timing are off",
    )
    hf = p.add_argument_group(
        "Hugging Face models (--mode=hf, or --model tiny-llama / a Llama name)"
    )
    hf.add_argument("--use_lora", action="store_true", help="LoRA (peft) on attention and MLP")
    hf.add_argument(
        "--lora_ranks",
        "--lora_rank",
        nargs="+",
        type=int,
        default=None,
        help="LoRA rank(s), with --use_lora (default 16; hf_sweep: 8 16)",
    )
    hf.add_argument(
        "--pretrained",
        action="store_true",
        help="load the real weights (needs the hub or a local cache; default: random weights)",
    )
    hf.add_argument("--token", default=None, help="HF token for --pretrained (prefer HF_TOKEN)")
    hf.add_argument("--dataset_path", default=None, help="a local SNLI JSONL (default: synthetic)")
    hf.add_argument("--dataset_size", type=int, default=10000, help="N for the sampling rate B/N")
    hf.add_argument("--no_poisson", action="store_true", help="fixed-size batches")
    hf.add_argument("--delta", type=float, default=1e-5, help="delta of the reported epsilon")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default=None)
    p.add_argument("--output_dir", "--results_dir", "--output-dir", default="./runs")
    p.add_argument("--run_name", default=None, help="default: <mode>_<timestamp>")
    p.add_argument("--resume", action="store_true", help="skip configs already finished")
    p.add_argument("--input_dir", "--input-dir", default=None, help="run directory (report mode)")
    for name in ("vocab_size", "hidden_dim", "num_layers", "num_heads", "max_seq_len"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the model config")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.trainer is not None and args.trainers is not None:
        parser.error("give either --trainer or --trainers, not both")
    return args


def plan(args: argparse.Namespace, device: str) -> list:
    """The experiment plan: one ExperimentConfig per trainer x batch x physical x seq."""
    import runner
    import trainers

    defaults = MODE_DEFAULTS[getattr(args, "defaults_mode", None) or args.mode]
    names = [args.trainer] if args.trainer else args.trainers
    names = names or defaults.get("trainers") or list(trainers.TRAINERS)
    try:
        names = list(dict.fromkeys(trainers.canonical_trainer_name(n) for n in names))
    except ValueError as error:
        raise UsageError(str(error)) from None
    model = args.model or defaults["model"]
    import hf_models

    if args.attention is None:
        args.attention = "sdpa" if model in hf_models.HF_CONFIGS else "explicit"
    overrides = {
        k: getattr(args, k)
        for k in ("vocab_size", "hidden_dim", "num_layers", "num_heads", "max_seq_len")
        if getattr(args, k) is not None
    }
    max_seq_len = model_max_seq_len(model, args.attention, overrides)
    if args.dataset_path and not os.path.exists(args.dataset_path):
        raise UsageError(f"--dataset_path {args.dataset_path} does not exist")
    if args.mode == "hf_sweep" and model not in hf_models.HF_CONFIGS:
        known = ", ".join(hf_models.HF_CONFIGS)
        raise UsageError(f"--mode=hf_sweep needs a Hugging Face model ({known}), got {model!r}")
    lora_ranks = list(dict.fromkeys(args.lora_ranks or defaults.get("lora_ranks") or [16]))
    if args.lora_ranks and len(lora_ranks) > 1 and not args.use_lora:
        raise UsageError("several --lora_ranks need --use_lora (without it there is no LoRA)")
    if not args.use_lora:  # one rank, recorded in the config and not used
        lora_ranks = [args.lora_ranks[0] if args.lora_ranks else 16]
    if min(lora_ranks) <= 0 or args.dataset_size <= 0:
        raise UsageError("--lora_ranks and --dataset_size must be positive")
    # Repeated values would run one config directory twice: keep each once, in order.
    batch_sizes = list(dict.fromkeys(args.batch_sizes or defaults["batch_sizes"]))
    seq_lens = list(dict.fromkeys(args.seq_lens or defaults["seq_lens"]))
    physical = list(
        dict.fromkeys(args.max_physical_batch_sizes or defaults.get("physical") or [None])
    )
    lr = args.lr if args.lr is not None else defaults.get("lr", 1e-4)
    if args.noise_multiplier < 0 or args.max_grad_norm <= 0 or lr <= 0:
        raise UsageError("--noise_multiplier must be >= 0, --max_grad_norm and --lr > 0")
    if not 0 < args.delta < 1:
        raise UsageError(f"--delta must be in (0, 1), got {args.delta}")
    if model in hf_models.HF_CONFIGS:
        if min(seq_lens) < 3:
            raise UsageError("a sentence pair needs seq_len >= 3 (premise, separator, hypothesis)")
        if not args.dataset_path and max(batch_sizes) > args.dataset_size:
            raise UsageError(
                f"batch size {max(batch_sizes)} > --dataset_size {args.dataset_size}: the "
                "sampling rate B/N must be at most 1"
            )
    steps = args.steps if args.steps is not None else defaults["steps"]
    warmup = args.warmup_steps if args.warmup_steps is not None else defaults["warmup_steps"]
    for b in batch_sizes:
        if b <= 0:
            raise UsageError(f"batch size must be positive, got {b}")
    for t in seq_lens:
        if not 0 < t <= max_seq_len:
            raise UsageError(
                f"seq_len {t} must be in 1..{max_seq_len} (the max_seq_len of model "
                f"{model!r}; raise it with --max_seq_len)"
            )
    for pb in physical:
        if pb is not None and pb <= 0:
            raise UsageError(f"physical batch size must be positive, got {pb}")
        if pb is not None and pb > max(batch_sizes):
            raise UsageError(f"physical batch {pb} > every logical batch size {batch_sizes}")
    if steps <= 0 or warmup < 0:
        raise UsageError("--steps must be positive and --warmup_steps non-negative")
    return [
        runner.ExperimentConfig(
            trainer=name,
            batch_size=b,
            seq_len=t,
            model=model,
            max_physical_batch_size=pb,
            dtype=args.dtype,
            attention=args.attention,
            optimizer=args.optimizer,
            lr=lr,
            noise_multiplier=args.noise_multiplier,
            max_grad_norm=args.max_grad_norm,
            steps=steps,
            warmup_steps=warmup,
            seed=args.seed,
            device=device,
            flash_route=args.flash_route,
            trace=not args.no_trace and args.mode not in ("memory", "hf_sweep") and not args.ncu,
            breakdown=args.mode in ("memory", "hf_sweep") and not args.ncu,
            detailed_memory=args.mode == "hf_sweep",
            ncu=args.ncu,
            use_lora=args.use_lora,
            lora_rank=rank,
            pretrained=args.pretrained,
            dataset_path=args.dataset_path,
            dataset_size=args.dataset_size,
            poisson=not args.no_poisson,
            delta=args.delta,
            save_snapshot=args.save_snapshot,
            activation_checkpointing=args.activation_checkpointing,
            trace_gzip=args.trace_gzip,
            model_overrides=overrides,
            default_model=defaults["model"],
        )
        for b, pb, t, rank, name in itertools.product(
            batch_sizes, physical, seq_lens, lora_ranks, names
        )
    ]


def model_max_seq_len(model: str, attention: str, overrides: dict) -> int:
    """The longest sequence the named model takes (UsageError for an unknown name)."""
    import hf_models
    import models

    if model in hf_models.HF_CONFIGS:
        return hf_models.HF_CONFIGS[model]["max_position_embeddings"]
    try:
        return models.get_config(model, attention=attention, **overrides).max_seq_len
    except (ValueError, TypeError) as error:
        known = ", ".join([*models.CONFIGS, *hf_models.HF_CONFIGS])
        raise UsageError(
            f"{error}"
            if "unknown" not in str(error)
            else f"unknown model {model!r}; known: {known}"
        ) from None


def resolve_device(args: argparse.Namespace) -> str:
    """Pick the device; ``--mode profile`` without CUDA falls back to the test defaults."""
    import runner

    requested = args.device or MODE_DEFAULTS[args.mode]["device"]
    if requested == "cpu":
        return "cpu"
    info = runner.probe_device(requested)
    if info["cuda"]:
        return "cuda"
    if requested == "cuda":
        raise UsageError("--device cuda was given but no CUDA device is available")
    if args.mode == "hf_sweep":  # the sweep stays a sweep; a Llama on CPU would take hours
        if not args.model:
            args.model = "tiny-llama"
        print(f"No CUDA device found: --mode=hf_sweep runs on the CPU with {args.model}.")
    elif args.mode == "memory":
        print(
            "No CUDA device found: the memory breakdown needs one; running the CPU test "
            "defaults (breakdown fields are null)."
        )
        args.defaults_mode = "test"
    else:
        print(f"No CUDA device found: --mode={args.mode} runs the CPU test defaults instead.")
        args.mode = "test"
    return "cpu"


def run_report(args) -> int:
    import report

    if not args.input_dir or not os.path.isdir(args.input_dir):
        raise UsageError(f"--input_dir must be an existing run directory, got {args.input_dir!r}")
    results = report.load_results(args.input_dir)
    if not results:
        raise UsageError(f"no */result.json files under {args.input_dir}")
    print(report.write_summary(args.input_dir, results))
    print(f"Summary written to {args.input_dir}/summary.csv and summary.md")
    return exit_code(results)


def exit_code(results: list[dict]) -> int:
    return EXIT_CONFIG_ERROR if any(r["status"] == "error" for r in results) else EXIT_OK


def refuse_changed_settings(configs: list, run_dir: str) -> None:
    """--resume adds missing configs; a finished one measured with other settings (lr, sigma,
    steps, ...: not all are in the directory name) must not pass as this run's result."""
    import runner

    # A setting added after a result was written reads as its default there.
    defaults = runner.ExperimentConfig(trainer="", batch_size=0, seq_len=0).to_dict()
    for config in configs:
        previous = runner.read_result(os.path.join(run_dir, config.config_dir, "result.json"))
        if not previous:
            continue
        wanted = json.loads(json.dumps(config.to_dict()))
        old = previous["config"]
        changed = sorted(k for k in wanted if old.get(k, defaults.get(k)) != wanted[k])
        if changed:
            raise UsageError(
                f"{config.config_dir} in {run_dir} was measured with other settings "
                f"({', '.join(changed)}): use a new --run_name"
            )


def run_experiments(args) -> int:
    import report
    import runner

    device = resolve_device(args)
    if args.ncu and device != "cuda":
        raise UsageError("--ncu profiles CUDA kernels: it needs a CUDA device")
    configs = plan(args, device)
    run_name = args.run_name or f"{args.mode}_{time.strftime('%Y%m%d_%H%M%S')}"
    run_dir = os.path.join(args.output_dir, run_name)
    if os.path.exists(run_dir) and not args.resume:
        raise UsageError(f"run directory {run_dir} exists: pick another --run_name or add --resume")
    if args.resume:
        refuse_changed_settings(configs, run_dir)
    os.makedirs(run_dir, exist_ok=True)
    print(f"{len(configs)} configs on {device}, results in {run_dir}")
    try:
        results = runner.run_configs(
            configs, run_dir, resume=args.resume, progress=args.mode == "hf_sweep"
        )
    except runner.Interrupted as interrupted:
        finished = report.load_results(run_dir)
        print(f"\nInterrupted during {interrupted}; {len(finished)} finished configs kept.")
        if finished:
            print(report.write_summary(run_dir, finished))
        return EXIT_INTERRUPTED
    print()
    # Summarise every result in the run directory: a --resume run adds to earlier ones.
    print(report.write_summary(run_dir, report.load_results(run_dir)))
    print(f"Summary: {run_dir}/summary.csv, {run_dir}/summary.md")
    return exit_code(results)


def run_ncu_report(args) -> int:
    import ncu

    if not args.input_dir:
        raise UsageError("--mode=ncu_report needs --input_dir DIR (the ncu_reports directory)")
    try:
        print(ncu.write_ncu_summary(args.input_dir))
    except ValueError as error:
        raise UsageError(str(error)) from None
    return EXIT_OK


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.token:  # only the forked workers read it, from the environment; never written
        os.environ["HF_TOKEN"] = args.token
        args.token = None
    if args.mode == "ncu_report":  # needs neither torch's GPU nor opacus
        try:
            return run_ncu_report(args)
        except UsageError as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_BAD_ARGS
    try:
        import opacus  # noqa: F401 - fail early with one line, before any config runs
    except ImportError:
        print("error: opacus is not installed: pip install -r requirements.txt", file=sys.stderr)
        return EXIT_BAD_ARGS
    try:
        if args.mode == "report":
            return run_report(args)
        return run_experiments(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_ARGS


if __name__ == "__main__":
    sys.exit(main())
