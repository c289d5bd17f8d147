"""profiling_script.py with flash's collective buckets set otherwise than the defaults: the
size of a bucket of small gradients (a gradient of a quarter of it or more goes alone; FSDP2's
reduce-scatters and DDP's all-reduces alike, whose defaults differ) and how
many bytes of collectives may be in flight behind the newest before the compute stream waits
for the oldest (FSDP2's reduce-scatters; DDP's all-reduces are never waited for before the
last). For measuring what they cost; the CLI's defaults are dp_cost.flash.sinks'.

usage: torchrun --nproc_per_node W benchmarks/fsdp_buckets.py --bucket_mb MB --in_flight_mb MB|none
           -- PROFILING_SCRIPT_ARGUMENTS
"""

from __future__ import annotations

import argparse
import os
import sys

UNBOUNDED = "none"  # --in_flight_mb's word for no bound
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--bucket_mb", type=float, required=True, help="bucket size, MiB")
    parser.add_argument(
        "--in_flight_mb", required=True, help="MiB in flight behind the newest, or none (no bound)"
    )
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="-- then profiling_script.py's")
    args = parser.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    from dp_cost.flash import sinks as buckets

    buckets.BUCKET_BYTES = buckets.ALL_REDUCE_BUCKET_BYTES = int(args.bucket_mb * 2**20)
    unbounded = args.in_flight_mb.lower() == UNBOUNDED  # the word, not --distributed's "none"
    in_flight = None if unbounded else int(float(args.in_flight_mb) * 2**20)
    buckets.ShardedGradients.IN_FLIGHT_BYTES = in_flight
    os.chdir(ROOT)
    import profiling_script

    return profiling_script.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
