"""What does differential privacy cost in training? One CLI for every measurement.

    python profiling_script.py --mode=test                  # CPU, tiny model, every trainer
    python profiling_script.py --mode=profile               # GPU, ~1B-parameter model
    python profiling_script.py --mode=report --input_dir runs/<run>

CLI args -> experiment plan (measure/plan.py) -> the run (measure/run.py): one forked worker
per config (measure/processes.py) -> <output_dir>/<run_name>/<config_dir>/result.json ->
report/.
The parser is built from the settings table (core/settings.py); torch is imported only once a
run is about to start, so ``--help``, bad arguments and the report modes stay fast.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import sys

from dp_cost.core import interrupts, rundir, streams
from dp_cost.core.fmt import count, did_you_mean
from dp_cost.core.interrupts import say
from dp_cost.core.modes import MODES, RUN_MODES
from dp_cost.core.reading import (
    MAX_BYTES,
    MAX_RESULT_BYTES,
    MAX_TOKEN_BYTES,
    UnreadableFile,
    read_text,
    size_words,
)
from dp_cost.core.schema import EXIT_BAD_ARGS, EXIT_CONFIG_ERROR, EXIT_OK, exit_code_of
from dp_cost.core.scopes import HF_ONLY
from dp_cost.core.settings import SETTINGS, UsageError
from dp_cost.ncu import summary as ncu_summary
from dp_cost.report import summary

# What a secret looks like: a Hugging Face token, or a long run of letters mixed with digits.
# ("hf_" and at least 10 more: a real token has 34; the mode name hf_sweep stays readable)
TOKEN_LIKE = re.compile(r"hf_\w{10,}|\b(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[\w-]{24,}\b")


def redacted(text: str) -> str:
    return TOKEN_LIKE.sub("<hidden>", text)


def command_words(words: list[str]) -> list[str]:
    """The command line as run.json records it: the token's value, and any word that is a
    token by its look, hidden (paths are kept: a token has no '/')."""
    shown = ["profiling_script.py"]
    for word in words:
        if shown[-1] == "--token" or TOKEN_LIKE.fullmatch(word):
            word = "<hidden>"
        elif word.startswith("--token="):
            word = "--token=<hidden>"
        shown.append(word)
    return shown


class Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line and never echoes what looks like a secret: an
    unknown flag is named without its value (``--tokn=hf_...`` stays off the screen); a
    mistyped flag or choice gets the closest known one as a suggestion."""

    def error(self, message: str):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            words = message[len(prefix) :].split()
            flags = [w.split("=", 1)[0] for w in words if w.startswith("-")]
            hidden = len(words) - len(flags)
            message = prefix + ", ".join(flags) if flags else "unexpected arguments"
            message += f" (and {hidden} value(s), not shown)" if hidden else ""
            # every option string, argument groups' included (argparse keeps them in one map)
            known_flags = list(self._option_string_actions)
            message += did_you_mean(flags[0], known_flags) if flags else ""
        elif choice := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
            known = re.findall(r"'([^']*)'", choice.group(2))
            message += did_you_mean(choice.group(1), known)
        print(f"error: {redacted(message)} (see --help)", file=sys.stderr)
        sys.exit(EXIT_BAD_ARGS)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
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
            group = hf if setting.scope in HF_ONLY else p
            group.add_argument(*setting.flags, **_argument(setting))
    hf.add_argument(
        "--token",
        default=None,
        help="HF token for --pretrained (visible to other users: prefer HF_TOKEN or --token_file)",
    )
    hf.add_argument(
        "--token_file",
        default=None,
        help="a file holding the HF token (a regular file of at most "
        f"{size_words(MAX_TOKEN_BYTES)})",
    )
    p.add_argument(
        "--output_dir",
        "--results_dir",
        "--output-dir",
        default="./runs",
        help="every mode writes under <output_dir>/<run_name>/ (default: ./runs)",
    )
    p.add_argument("--run_name", default=None, help="one folder name (default: <mode>_<timestamp>)")
    p.add_argument("--resume", action="store_true", help="skip configs already finished")
    p.add_argument(
        "--input_dir",
        "--input-dir",
        default=None,
        help="run directory (report modes); only its regular files are read: a result.json over "
        f"{size_words(MAX_RESULT_BYTES)}, a trace or an ncu CSV export over "
        f"{size_words(MAX_BYTES)} is skipped, named in a warning (report) or the summary "
        "(ncu_report)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also show the libraries' known-harmless messages (profiler, allocator, warnings)",
    )
    return p


def _argument(setting) -> dict:
    """argparse keywords of one setting. Defaults stay None: the plan fills in the mode's."""
    help_text = setting.help
    if "default" not in help_text and setting.switch is None:
        shown = [] if setting.default is None else [f"default: {_shown(setting.default)}"]
        by_value = {}  # modes that share a default are named together: each value shown once
        for mode, value in setting.modes.items():
            by_value.setdefault(_shown(value), []).append(mode)
        shown += [f"{', '.join(modes)}: {value}" for value, modes in by_value.items()]
        help_text += f" ({'; '.join(shown)})" if shown else ""
    options = {"dest": setting.dest, "default": None, "help": help_text}
    if setting.switch is True:
        options.update(action="store_const", const=True)
    elif setting.switch is False:
        options.update(action="store_const", const=False)
    elif setting.name == "trace_gzip":
        options.update(action=argparse.BooleanOptionalAction)
    else:
        options.update(type=setting.type, choices=setting.choices)
        if setting.axis or setting.many:
            options["nargs"] = "+"
    return options


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    # What report.html's header shows as the command line (a token on it hidden).
    args.command_line = command_words(sys.argv[1:] if argv is None else argv)
    if args.trainer is not None and args.trainers is not None:
        parser.error("give either --trainer or --trainers, not both")
    return args


def run_report(args) -> int:
    if not args.input_dir:
        raise UsageError("--mode=report needs --input_dir RUN_DIR, the run directory to report")
    if not os.path.isdir(args.input_dir):
        raise UsageError(f"--input_dir must be an existing run directory, got {args.input_dir!r}")
    rundir.remove_stale_temporaries(args.input_dir)  # a killed run's, unless a run is live
    results = summary.load_results(args.input_dir)
    if not results:
        found = glob.glob(os.path.join(glob.escape(args.input_dir), "*", "*", "result.json"))
        runs = sorted({os.path.dirname(os.path.dirname(path)) for path in found})
        if runs:
            raise UsageError(
                f"{args.input_dir} holds run folders, not results: give one of them as "
                f"--input_dir: {', '.join(runs)}"
            )
        if results.skipped:  # each named in a warning above
            unreadable = count(len(results.skipped), "result file")
            raise UsageError(f"{args.input_dir} has no readable result: {unreadable} skipped")
        raise UsageError(f"no */result.json files under {args.input_dir}")
    print(summary.write_summary(args.input_dir, results))
    if not summary.is_capacity(results):  # a capacity run's report names its own files
        print(f"Summary written to {args.input_dir}/summary.csv and summary.md")
    return exit_code_of(results)


def run_ncu_report(args) -> int:
    if not args.input_dir:
        raise UsageError("--mode=ncu_report needs --input_dir DIR (the ncu_reports directory)")
    try:
        print(ncu_summary.write_ncu_summary(args.input_dir))
    except ValueError as error:
        raise UsageError(str(error)) from None
    return EXIT_OK


def run_experiments(args) -> int:
    # The plan needs no torch for its checks: a mistake is found before torch, opacus and the
    # models are imported (seconds), and only then are they (the workers fork from here).
    from dp_cost.measure import plan

    experiment = plan.make_plan(args, cuda_available)
    from dp_cost.measure import run

    return run.run_plan(args, experiment)


def hf_token(args) -> str | None:
    """The token of --token or --token_file (UsageError when the file cannot be read: not a
    regular file, over MAX_TOKEN_BYTES, not UTF-8, or not one word)."""
    if args.token:
        print(
            "warning: --token is visible to other users of this machine (ps, /proc): "
            "prefer the HF_TOKEN environment variable or --token_file FILE",
            file=sys.stderr,
        )
        return args.token
    if args.token_file:
        try:
            token = read_text(args.token_file, max_bytes=MAX_TOKEN_BYTES).strip()
        except UnreadableFile as error:
            raise UsageError(f"--token_file {args.token_file}: cannot read it ({error})") from None
        # Never shown: it may be the token with a stray word. Printable: the workers read it
        # from the environment, which takes no NUL.
        if len(token.split()) != 1 or not token.isprintable():
            raise UsageError(f"--token_file {args.token_file}: does not hold one token")
        return token
    return None


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as stop:  # --help, or a parser error already printed
        return stop.code if isinstance(stop.code, int) else EXIT_BAD_ARGS
    handlers = interrupts.install()
    try:
        with streams.losable_output():  # a lost stdout or stderr stops nothing
            return run_guarded(args)
    finally:
        # A caller in Python gets its handlers back; the program keeps every signal ignored to
        # its exit (a late Ctrl-C must not end it by the signal once its exit code is set).
        if argv is not None:
            interrupts.restore(handlers)


def run_guarded(args) -> int:
    """``run_mode``, a user mistake, an interrupt or an OSError each turned into its exit code;
    whatever ends it, the run directory closed."""
    try:
        return run_mode(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_ARGS
    except KeyboardInterrupt:  # before any config ran (imports, the plan, the run directory)
        interrupts.ignore()
        measuring = args.mode not in ("report", "ncu_report")  # a report is just run again
        say("\nInterrupted" + (" before any config ran." if measuring else "."), sys.stderr)
        if os.environ.get("RANK", "0") == "0":  # under torchrun: rank 0 speaks for the job
            run_name = args.run_name if measuring else None
            resumable = run_name is not None and rundir.kept_after_close(
                os.path.join(args.output_dir, run_name)
            )
            interrupts.say_continue(args.command_line, run_name, resumable)
        return interrupts.exit_code()
    except OSError as error:  # the disk filled up while writing the summary, ...
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    finally:
        interrupts.ignore()  # nothing may interrupt the run directory's removal
        for run in list(rundir.RunDir.open_now):
            run.close()


# The CLI's own flags (the settings table's have their scopes) and the modes they take effect
# in: given in another mode, one error line rather than a flag silently ignored.
FLAG_MODES = {
    "input_dir": tuple(name for name, mode in MODES.items() if not mode.runs),
    "run_name": RUN_MODES,
    "resume": RUN_MODES,
}


def check_flag_modes(args) -> None:
    for dest, modes in FLAG_MODES.items():
        if getattr(args, dest) not in (None, False) and args.mode not in modes:
            raise UsageError(
                f"--{dest} applies only to --mode {', '.join(modes)}; mode is {args.mode}"
            )


def run_mode(args) -> int:
    check_flag_modes(args)
    token = hf_token(args)
    if token:  # only the forked workers read it, from the environment; never written
        os.environ["HF_TOKEN"] = token
    args.token = args.token_file = None
    if args.mode == "ncu_report":  # needs neither torch nor opacus
        return run_ncu_report(args)
    if args.mode == "report":
        return run_report(args)
    if args.run_name is not None:
        rundir.check_run_name(args.run_name)
    rundir.check_output_dir(args.output_dir)
    # Under torchrun, on rank 0's node (other nodes' ranks take rank 0's run directory).
    if args.resume and os.environ.get("GROUP_RANK", "0") == "0":
        rundir.check_resumable(args.output_dir, args.run_name)
    if importlib.util.find_spec("opacus") is None:  # found, not imported: the plan comes first
        raise UsageError("opacus is not installed: pip install -r requirements.txt")
    return run_experiments(args)


def cuda_available() -> bool:
    """Whether CUDA is usable, asked only when the plan needs to know (torch imported then)."""
    from dp_cost.measure import processes

    return processes.cuda_available()


if __name__ == "__main__":
    sys.exit(main())
