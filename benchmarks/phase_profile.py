"""Where a trainer's host work goes, by Python function: ``profiling_script.py`` run with some of
one trainer's methods under cProfile in every worker (and every torchrun rank), each call's
Python functions by call count written to OUT/<method>.<pid>.txt (the last call's; builtins left
out, as ``--host_work``'s counter leaves them out).

    torchrun --standalone --nproc_per_node 2 benchmarks/phase_profile.py --out /tmp/prof \
        -- --mode=profile --model 1b --batch_sizes 16 --distributed ddp --trainers flash ...

The methods are patched on the trainer's class before the CLI forks its workers. What runs on
another thread (autograd's, on CUDA) is not counted.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dp_cost.training import registry  # noqa: E402


def write_counts(profile: cProfile.Profile, path: str, top: int) -> None:
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, ncalls, tt, ct, callers)
    rows = [(v[1], k) for k, v in stats.items() if not k[0].startswith("~")]  # not builtins
    with open(path, "w") as f:
        f.write(f"python calls {sum(n for n, _ in rows)}\n")
        for count, (file, line, name) in sorted(rows, reverse=True)[:top]:
            f.write(f"{count:7d} {file.split('site-packages/')[-1]}:{line}({name})\n")


def profiled(cls: type, method: str, out: str, top: int) -> None:
    inner = getattr(cls, method)

    def wrapper(self, *args, **kwargs):
        profile = cProfile.Profile()
        profile.enable()
        try:
            return inner(self, *args, **kwargs)
        finally:
            profile.disable()
            if profile.getstats():
                write_counts(profile, os.path.join(out, f"{method}.{os.getpid()}.txt"), top)

    setattr(cls, method, wrapper)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the counts")
    parser.add_argument("--trainer", default="flash")
    parser.add_argument("--methods", nargs="+", default=["clip_chunk", "finish_step"])
    parser.add_argument("--top", type=int, default=60, help="functions listed per file")
    parser.add_argument("cli", nargs=argparse.REMAINDER, help="-- then profiling_script.py's")
    args = parser.parse_args(argv)
    cls = registry.TRAINERS.get(args.trainer)
    if cls is None:
        print(f"error: no trainer named {args.trainer!r}", file=sys.stderr)
        return 2
    missing = [m for m in args.methods if not hasattr(cls, m)]
    if missing:
        print(f"error: trainer {args.trainer!r} has no method {missing[0]!r}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    for method in args.methods:
        profiled(cls, method, args.out, args.top)
    cli = args.cli[1:] if args.cli[:1] == ["--"] else args.cli
    sys.argv = [os.path.join(ROOT, "profiling_script.py"), *cli]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
