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

os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
from figure_checks import kept_figures  # noqa: E402, F401 (a fixture of every folder's tests)


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which registers its "dsession"
def pytest_configure(config):
    """The settings above in the processes that run tests, before any test module is imported.
    pytest-xdist's controller runs none: it skips torch's import (about 2 s before it starts the
    test processes)."""
    if config.pluginmanager.has_plugin("dsession"):
        return
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)


# The longest tests (CLI runs of many configs, torchrun jobs, interpreted kernels at large shapes)
# start first, longest first: pytest-xdist hands the tests out in this order (pyproject's addopts;
# the group of those that fork ranks goes out whole, first), so the short ones fill in at the end
# instead of one worker finishing a long run alone. Files or test ids, by the seconds they took on
# 2 cores (5 s and more, as measured on 2026-12-01); whatever is not listed keeps pytest's order
# after them.
LONGEST_FIRST = (
    "tests/test_pinned_run.py::test_test_mode_grid_behaves_as_pinned",
    "tests/capacity/test_capacity.py::test_predicted_state_per_rank_equals_the_real_ranks",
    "tests/parallel/test_distributed_cli.py::test_a_torchrun_job_is_one_run",
    "tests/parallel/test_distributed_updates.py",
    "tests/parallel/test_distributed_cli.py::test_a_silent_rank_ends_the_job",
    "tests/test_hf_sweep.py::test_hf_sweep_cli_writes_every_file",
    "tests/capacity/test_step_time.py::test_recommend_ranks_the_dp_trainers_by_their_fastest",
    "tests/capacity/test_collective_time.py::test_the_calibration_script_writes",
    "tests/report/test_report_sweep.py::test_report_of_a_cuda_like_sweep",
    "tests/parallel/test_distributed_cli.py",
    "tests/capacity/test_capacity.py::test_capacity_mode_writes_its_report",
    "tests/capacity/test_card_tables.py::test_a_recount_counts_each_rows_calibration_step",
    "tests/measure/test_host_work.py::test_every_trainer_step_is_counted",
    "tests/test_run_guarantees.py",
    "tests/test_cli.py",
    "tests/test_signals.py",
    "tests/test_dp_fidelity.py",
    "tests/capacity/test_capacity.py::test_the_predicted_longest_sequence_is_the_last_step",
    "tests/measure/test_tracing.py",
    "tests/measure/test_faults.py",
    "tests/capacity/test_fake_mode.py::test_a_planned_step_is_the_same_under_either_mode",
)


# The tests that fork ranks (tests/forked_ranks.py), by file or test id: all run in the test
# process given the first of them, so one fork server serves them (its imports are about 5 s of
# CPU) and one job of ranks runs at a time.
FORK_RANKS = (
    "tests/capacity/test_capacity.py::test_predicted_state_per_rank_equals_the_real_ranks",
    "tests/capacity/test_collective_time.py::test_the_calibration_script_writes",
    "tests/parallel/test_distributed_cli.py",
    "tests/parallel/test_distributed_updates.py",
)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """--dist load (pyproject's addopts), but for the tests that fork ranks: see FORK_RANKS."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScheduling

    class ForkingTestsInOneProcess(LoadScheduling):
        owner = None  # the test process that runs FORK_RANKS

        def _send_tests(self, node, num):
            if num <= 0:  # nothing asked: not a sign that this process's queue has ended
                return
            chosen = []
            for index in self.pending:
                if len(chosen) == num:
                    break
                if self.collection[index].startswith(FORK_RANKS):
                    self.owner = self.owner or node
                    if self.owner is not node:
                        continue
                chosen.append(index)
            if not chosen:  # the owner's tests alone are left: this process ends its queue
                if not node.shutting_down:
                    node.shutdown()
                return
            for index in chosen:
                self.pending.remove(index)
            self.node2pending[node].extend(chosen)
            node.send_runtest_some(chosen)

        def remove_node(self, node):
            if node is self.owner:  # crashed: the process that replaces it takes the rest
                self.owner = None
            return super().remove_node(node)

    return ForkingTestsInOneProcess(config, log)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        node = item.nodeid
        return next(
            (i for i, p in enumerate(LONGEST_FIRST) if node.startswith(p)), len(LONGEST_FIRST)
        )

    items.sort(key=rank)  # stable: pytest's order within each rank
