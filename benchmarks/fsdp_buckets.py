"""profiling_script.py with its collectives set otherwise than the defaults: the size of a
bucket of flash's small gradients (a gradient of a quarter of it or more goes alone; FSDP2's
reduce-scatters and DDP's all-reduces alike, whose defaults differ), how many bytes of flash's
collectives may be in flight behind the newest before the compute stream waits for the oldest
(FSDP2's reduce-scatters; DDP's all-reduces are never waited for before the last), how many
groups a step's last collectives land in (each group's noise and optimizer step beside the later
groups' collectives; 1: every one waited for first), how many blocks FSDP2 all-gathers ahead in
the backward (every trainer's; dp_cost.parallel.fsdp), and how many FSDP2 units of the next
chunk's forward flash all-gathers after a chunk's backward (reducing every chunk). For measuring
what they cost; a setting not given keeps its default (dp_cost.flash.sinks',
dp_cost.parallel.fsdp's).

usage: torchrun --nproc_per_node W benchmarks/fsdp_buckets.py [--bucket_mb MB]
           [--in_flight_mb MB|none] [--backward_prefetch N] [--landing_groups N]
           [--forward_prefetch N]
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
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--bucket_mb", type=float, help="bucket size, MiB")
    parser.add_argument("--in_flight_mb", help="MiB in flight behind the newest, or none")
    parser.add_argument("--backward_prefetch", type=int, help="blocks all-gathered ahead")
    parser.add_argument(
        "--forward_prefetch", type=int, help="units of the next chunk's forward gathered ahead"
    )
    parser.add_argument(
        "--landing_groups", type=int, help="groups a step's last collectives land in (1: all first)"
    )
    # profiling_script.py's arguments after "--" (torchrun drops a "--" that follows the script
    # at once: then every argument this parser does not know is theirs)
    split = argv.index("--") if "--" in argv else len(argv)
    args, unknown = parser.parse_known_args(argv[:split])
    rest = unknown + argv[split + 1 :]
    if args.backward_prefetch is not None and args.backward_prefetch < 1:
        parser.error("--backward_prefetch must be at least 1")
    if args.forward_prefetch is not None and args.forward_prefetch < 0:
        parser.error("--forward_prefetch must be at least 0")
    if args.landing_groups is not None and args.landing_groups < 1:
        parser.error("--landing_groups must be at least 1")
    from dp_cost.flash import sinks as buckets
    from dp_cost.parallel import fsdp

    if args.bucket_mb is not None:
        buckets.BUCKET_BYTES = buckets.ALL_REDUCE_BUCKET_BYTES = int(args.bucket_mb * 2**20)
    if args.in_flight_mb is not None:
        unbounded = args.in_flight_mb.lower() == UNBOUNDED  # the word, not --distributed's "none"
        in_flight = None if unbounded else int(float(args.in_flight_mb) * 2**20)
        buckets.ShardedGradients.IN_FLIGHT_BYTES = in_flight
    if args.backward_prefetch is not None:
        fsdp.BACKWARD_PREFETCH_BLOCKS = args.backward_prefetch
    if args.forward_prefetch is not None:
        fsdp.FORWARD_PREFETCH_UNITS = args.forward_prefetch
    if args.landing_groups is not None:
        buckets.LANDING_GROUPS = args.landing_groups
    os.chdir(ROOT)
    import profiling_script

    return profiling_script.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
