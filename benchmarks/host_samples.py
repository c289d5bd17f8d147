"""Where a step's host time goes, by Python function, sampled: py-spy records one trainer's
process (benchmarks/host_work.py's child, the trainer built as the CLI's worker builds it) and
this sums the samples of its steps per function, inclusive and own, in ms per step.

Sampling, unlike cProfile, adds no cost per call, so many small calls are not overweighted.
py-spy sees Python stacks only: C++ work of a thread with no Python frame (autograd's backward
ops, torch's launches from C++) is not sampled, and a frame's own time includes the C calls it
makes (a launch, or a wait for the GPU: ``eager_step``'s own time is mostly its sync on the
loss). The backward hooks flash runs on autograd's thread are sampled.

    pip install py-spy
    python benchmarks/host_samples.py --shapes 8x512 --trainers standard flash --steps 100

Needs py-spy on PATH (or --py_spy); on CUDA the host_work.py child runs the usual way.
"""

from __future__ import annotations  # noqa: I001

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8x512"], help="BxT")
    parser.add_argument("--trainers", nargs="+", default=["standard", "flash"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup_steps", type=int, default=5)
    parser.add_argument("--rate", type=int, default=200, help="samples per second")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--py_spy", default=shutil.which("py-spy"))
    parser.add_argument("--device", default="cuda")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and argument mistakes answer before torch is imported


from host_work import parse_shapes  # this script's sibling: the same BxT as its child takes  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STEP_FRAME = "measure.<locals>.step ("  # host_work.py's timed or warm-up step
HOOK_FRAMES = ("save_grad (",)  # flash's backward hooks, on autograd's thread
SKIPPED = ("_do_compile", "autotun", "launches_per_step", "python_profile")  # not a step's own


def function_of(frame: str) -> str:
    """'name (path:line)' -> 'name (file)'."""
    name, _, location = frame.partition(" (")
    return f"{name} ({os.path.basename(location.rsplit(':', 1)[0])})" if location else name


def summarize(raw_lines, steps: int, rate: int) -> tuple[dict, dict, int]:
    """(inclusive, own) ms per step by function over the steps' stacks, and their samples."""
    inclusive, own, samples = collections.Counter(), collections.Counter(), 0
    for line in raw_lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        if STEP_FRAME not in stack and not any(hook in stack for hook in HOOK_FRAMES):
            continue
        if any(skip in stack for skip in SKIPPED):
            continue
        count = int(count)
        samples += count
        frames = [function_of(f) for f in stack.split(";")]
        for name in set(frames):
            inclusive[name] += count
        own[frames[-1]] += count
    per_step = 1000 / rate / steps
    return (
        {name: n * per_step for name, n in inclusive.most_common()},
        {name: n * per_step for name, n in own.most_common()},
        samples,
    )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not args.py_spy:
        print(
            "host_samples.py: py-spy not found (pip install py-spy, or --py_spy)", file=sys.stderr
        )
        return 2
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError:
        print(
            f"host_samples.py: --shapes takes BxT, e.g. 8x512; got {args.shapes}", file=sys.stderr
        )
        return 2
    for batch, seq in shapes:
        shape = f"{batch}x{seq}"
        for trainer in args.trainers:
            with tempfile.TemporaryDirectory() as folder:
                raw = os.path.join(folder, "raw.txt")
                child = [sys.executable, os.path.join(HERE, "host_work.py"), "--device",
                         args.device, "--shapes", shape, "--steps", str(args.steps),
                         "--warmup_steps", str(args.warmup_steps), "--one",
                         f"{trainer},{batch},{seq}"]  # fmt: skip
                record = [args.py_spy, "record", "--nonblocking", "-r", str(args.rate), "-f",
                          "raw", "-o", raw, "--", *child]  # fmt: skip
                done = subprocess.run(record, capture_output=True, text=True)
                if done.returncode or not os.path.exists(raw):
                    print(done.stderr[-2000:], file=sys.stderr)
                    return 1
                with open(raw) as f:
                    inclusive, own, samples = summarize(
                        f, args.steps + args.warmup_steps, args.rate
                    )
            print(f"== ({batch}, {seq}) {trainer}: {samples} samples at {args.rate}/s over "
                  f"{args.steps + args.warmup_steps} steps; ms per step")  # fmt: skip
            for title, table in (("inclusive", inclusive), ("own", own)):
                print(f"-- {title}")
                for name, ms in list(table.items())[: args.top]:
                    print(f"{ms:8.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
