"""What does differential privacy cost in training? One CLI for every measurement.

    python profiling_script.py --mode=test                  # CPU, tiny model, every trainer
    python profiling_script.py --mode=profile               # GPU, ~1B-parameter model
    python profiling_script.py --mode=report --input_dir runs/<run>

CLI args -> experiment plan (measure/plan.py) -> one forked worker per config
(measure/processes.py) -> <output_dir>/<run_name>/<config_dir>/result.json -> report/.
The parser is built from the settings table (core/settings.py); torch is imported only once a
run is about to start, so ``--help``, bad arguments and the report modes stay fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from core import files
from core.schema import (
    EXIT_BAD_ARGS,
    EXIT_CONFIG_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    STATUSES,
)
from core.settings import HF_SETTINGS, MODES, SETTINGS, UsageError, changed_settings
from ncu import summary as ncu_summary
from report import summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Measure the memory and time DP-SGD costs per clipping method.",
    )
    p.add_argument(
        "--mode",
        choices=list(MODES),
        default="test",
        help="; ".join(f"{m.name}: {m.help}" for m in MODES.values()) + " (default: test)",
    )
    p.add_argument(
        "--trainer",
        "--experiment",
        "--grad_sample_mode",
        dest="trainer",
        default=None,
        help="a single trainer (alias of --trainers X)",
    )
    hf = p.add_argument_group(
        "Hugging Face models (--mode=hf, or --model tiny-llama / a Llama name)"
    )
    for setting in SETTINGS:
        if setting.flags:
            group = hf if setting.name in HF_SETTINGS else p
            group.add_argument(*setting.flags, **_argument(setting))
    hf.add_argument("--token", default=None, help="HF token for --pretrained (prefer HF_TOKEN)")
    p.add_argument(
        "--output_dir",
        "--results_dir",
        "--output-dir",
        default="./runs",
        help="every mode writes under <output_dir>/<run_name>/ (default: ./runs)",
    )
    p.add_argument("--run_name", default=None, help="default: <mode>_<timestamp>")
    p.add_argument("--resume", action="store_true", help="skip configs already finished")
    p.add_argument("--input_dir", "--input-dir", default=None, help="run directory (report mode)")
    return p


def _argument(setting) -> dict:
    """argparse keywords of one setting. Defaults stay None: the plan fills in the mode's."""
    help_text = setting.help
    if "default" not in help_text and setting.switch is None:
        shown = [] if setting.default is None else [f"default: {_shown(setting.default)}"]
        shown += [f"{mode}: {_shown(value)}" for mode, value in setting.modes.items()]
        help_text += f" ({'; '.join(shown)})"
    options = {"dest": setting.dest, "default": None, "help": help_text}
    if setting.switch is True:
        options.update(action="store_const", const=True)
    elif setting.switch is False:
        options.update(action="store_const", const=False)
    elif setting.name == "trace_gzip":
        options.update(action=argparse.BooleanOptionalAction)
    else:
        options.update(type=setting.type, choices=setting.choices)
        if setting.axis:
            options["nargs"] = "+"
    return options


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.trainer is not None and args.trainers is not None:
        parser.error("give either --trainer or --trainers, not both")
    return args


def exit_code(results: list[dict]) -> int:
    return EXIT_CONFIG_ERROR if any(r["status"] == "error" for r in results) else EXIT_OK


def run_report(args) -> int:
    if not args.input_dir or not os.path.isdir(args.input_dir):
        raise UsageError(f"--input_dir must be an existing run directory, got {args.input_dir!r}")
    results = summary.load_results(args.input_dir)
    if not results:
        raise UsageError(f"no */result.json files under {args.input_dir}")
    print(summary.write_summary(args.input_dir, results))
    print(f"Summary written to {args.input_dir}/summary.csv and summary.md")
    return exit_code(results)


def run_ncu_report(args) -> int:
    if not args.input_dir:
        raise UsageError("--mode=ncu_report needs --input_dir DIR (the ncu_reports directory)")
    try:
        print(ncu_summary.write_ncu_summary(args.input_dir))
    except ValueError as error:
        raise UsageError(str(error)) from None
    return EXIT_OK


def refuse_changed_settings(configs: list, run_dir: str) -> None:
    """--resume adds missing configs; a finished one measured with other settings (lr, sigma,
    steps, ...: not all are in the directory name) must not pass as this run's result."""
    for config in configs:
        previous = files.read_json(os.path.join(run_dir, config.config_dir, "result.json"))
        if not isinstance(previous, dict) or previous.get("status") not in STATUSES:
            continue
        changed = changed_settings(previous.get("config", {}), config.to_dict())
        if changed:
            raise UsageError(
                f"{config.config_dir} in {run_dir} was measured with other settings "
                f"({', '.join(changed)}): use a new --run_name"
            )


def run_experiments(args) -> int:
    # Delayed: these import torch, opacus and the models.
    from measure import plan, processes

    experiment = plan.make_plan(args, processes.cuda_available)
    if experiment.note:
        print(experiment.note)
    configs = experiment.configs
    run_name = args.run_name or f"{experiment.mode}_{time.strftime('%Y%m%d_%H%M%S')}"
    run_dir = os.path.join(args.output_dir, run_name)
    if os.path.exists(run_dir) and not args.resume:
        raise UsageError(f"run directory {run_dir} exists: pick another --run_name or add --resume")
    if args.resume:
        refuse_changed_settings(configs, run_dir)
    os.makedirs(run_dir, exist_ok=True)
    print(f"{len(configs)} configs on {experiment.device}, results in {run_dir}")
    try:
        results = processes.run_configs(
            configs, run_dir, resume=args.resume, progress=experiment.mode == "hf_sweep"
        )
    except processes.Interrupted as interrupted:
        finished = summary.load_results(run_dir)
        print(f"\nInterrupted during {interrupted}; {len(finished)} finished configs kept.")
        if finished:
            print(summary.write_summary(run_dir, finished))
        return EXIT_INTERRUPTED
    print()
    # Summarise every result in the run directory: a --resume run adds to earlier ones.
    print(summary.write_summary(run_dir, summary.load_results(run_dir)))
    print(f"Summary: {run_dir}/summary.csv, {run_dir}/summary.md")
    return exit_code(results)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.token:  # only the forked workers read it, from the environment; never written
        os.environ["HF_TOKEN"] = args.token
        args.token = None
    try:
        if args.mode == "ncu_report":  # needs neither torch nor opacus
            return run_ncu_report(args)
        if args.mode == "report":
            return run_report(args)
        try:
            import opacus  # noqa: F401 - fail early with one line, before any config runs
        except ImportError:
            raise UsageError("opacus is not installed: pip install -r requirements.txt") from None
        return run_experiments(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_ARGS


if __name__ == "__main__":
    sys.exit(main())
