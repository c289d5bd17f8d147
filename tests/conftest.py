"""Process-wide test settings, applied before any test module loads.

- Where no GPU exists (CI), Triton kernels can only run interpreted: TRITON_INTERPRET must be set
  before triton is first imported (its own library functions are decorated at that import).
- One intra-op thread in the pytest process: tests compute in it and also fork workers from it
  (measure.processes.run_configs), and a child forked while an OpenMP pool exists can hang in
  its first parallel op (seen here in layer_norm). The CLI itself never computes before forking.
- One intra-op thread in the processes the tests start too (the CLI, torchrun's ranks), through
  OMP_NUM_THREADS: pytest-xdist runs two test processes on CI's 2 cores (pyproject's addopts),
  and a CLI worker's pool of one thread per core, spinning beside the other test process, ran
  2-4 times slower (a pinned run of test_pinned_run.py sets its own count). Results do not
  depend on it: the CLI's losses are bit-identical with 1 and 2 threads.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

from figure_checks import kept_figures  # noqa: E402, F401 (a fixture of every folder's tests)

# The longest tests (CLI runs of many configs, torchrun jobs, interpreted kernels at large shapes)
# start first, longest first: pytest-xdist hands the tests out in this order one at a time
# (pyproject's addopts: --dist load --maxschedchunk 1), so the short ones fill in at the end
# instead of one worker finishing a minute-long run alone. Files or test ids, by the seconds they
# took on 2 cores; whatever is not listed keeps pytest's order after them.
LONGEST_FIRST = (
    "tests/test_pinned_run.py::test_test_mode_grid_behaves_as_pinned",
    "tests/capacity/test_capacity.py::test_predicted_state_per_rank_equals_the_real_ranks",
    "tests/parallel/test_distributed_cli.py::test_a_torchrun_job_is_one_run",
    "tests/parallel/test_distributed_updates.py",
    "tests/test_hf_sweep.py::test_hf_sweep_cli_writes_every_file",
    "tests/measure/test_tracing.py",
    "tests/test_run_guarantees.py",
    "tests/test_cli.py",
    "tests/measure/test_faults.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        node = item.nodeid
        return next(
            (i for i, p in enumerate(LONGEST_FIRST) if node.startswith(p)), len(LONGEST_FIRST)
        )

    items.sort(key=rank)  # stable: pytest's order within each rank
