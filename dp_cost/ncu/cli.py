"""``python -m dp_cost.ncu command ...`` and ``python -m dp_cost.ncu metrics ...``: the helpers
run_profiling_ncu.sh calls (one source of truth for ncu command lines and metric names)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from dp_cost.ncu.command import REPLAY_MODES, ncu_command, profile_args, report_name
from dp_cost.ncu.metrics import METRICS, translate_metrics


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="ncu helpers for run_profiling_ncu.sh")
    sub = parser.add_subparsers(dest="what", required=True)
    cmd = sub.add_parser("command", help="print the ncu command line of one config")
    cmd.add_argument("--trainer", required=True)
    cmd.add_argument("--batch_size", type=int, required=True)
    cmd.add_argument("--seq_len", type=int, required=True)
    cmd.add_argument("--report_dir", default="ncu_reports")
    cmd.add_argument("--metrics", default=",".join(METRICS))
    cmd.add_argument("--clock_control", "--clock-control", default="none")
    cmd.add_argument("--nvtx", action="store_true")
    cmd.add_argument(
        "--replay_mode", "--replay-mode", default="kernel", help=" | ".join(REPLAY_MODES)
    )
    cmd.add_argument("--ncu", default="ncu")
    cmd.add_argument("--python", default=None)
    cmd.add_argument("extra", nargs="*", help="after --: more profiling_script.py arguments")
    met = sub.add_parser("metrics", help="check/translate a comma-separated metric list")
    met.add_argument("names")
    args = parser.parse_args(argv)
    try:
        if args.what == "metrics":
            print(",".join(translate_metrics(args.names)))
            return 0
        name = report_name(args.trainer, args.batch_size, args.seq_len)
        argv_out = ncu_command(
            os.path.join(args.report_dir, name),
            profile_args(args.trainer, args.batch_size, args.seq_len, args.extra),
            metrics=args.metrics,
            clock_control=args.clock_control,
            nvtx=args.nvtx,
            replay_mode=args.replay_mode,
            ncu=args.ncu,
            python=args.python,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(shlex.join(argv_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
