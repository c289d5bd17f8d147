"""Run by torchrun (2 ranks, gloo, CPU) from test_distributed_cli.py: the CLI, its workers
replaced by stand-ins as soon as they start: rank 1's stops itself (SIGSTOP, as ``kill -STOP``
would), rank 0's waits for it (as it would in a collective). The job must end after
--rank_timeout, saying which rank fell silent."""

import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import profiling_script  # noqa: E402
from dp_cost.measure import worker  # noqa: E402


def stopped_or_waiting(config, out_dir, rank_setup=None):
    if rank_setup[0].rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)


worker.run_experiment = stopped_or_waiting
sys.exit(profiling_script.main(sys.argv[1:]))
