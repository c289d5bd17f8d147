"""How the ranks' results become one: the aggregate result.json, and a rank whose worker is
stopped because another rank's worker failed (recorded with that rank's status)."""

import multiprocessing
import time

from cli_helpers import free_port

from dp_cost.measure import processes, ranks
from dp_cost.measure.config import ExperimentConfig
from dp_cost.parallel.ranks import RankInfo, share


def rank_result(status="ok", steps=(10.0, 20.0), peak=5.0, error=None):
    return {
        "status": status,
        "error": error,
        "config": {"trainer": "flash"},
        "env": {"device": "cpu"},
        "losses": [1.0, 0.9],
        "step_times_ms": list(steps),
        "median_time_ms": sorted(steps)[len(steps) // 2],
        "peak_memory_mb": peak,
        "peak_reserved_mb": None,
        "communication_time_ms": None,
        "breakdown": None,
    }


def test_the_aggregate_takes_the_slowest_rank_per_step_and_the_largest_peak():
    result = ranks.aggregate(
        [rank_result(steps=(10, 20), peak=5), rank_result(steps=(12, 18), peak=7)]
    )
    assert result["status"] == "ok" and result["error"] is None
    assert result["step_times_ms"] == [12, 20]
    assert result["median_time_ms"] == 16 and result["avg_time_ms"] == 16
    assert result["peak_memory_mb"] == 7
    assert result["losses"] == [1.0, 0.9]  # the global batch's, from rank 0
    assert [(r["rank"], r["peak_memory_mb"]) for r in result["ranks"]] == [(0, 5), (1, 7)]


def test_the_aggregate_names_the_rank_that_failed_not_the_one_stopped():
    stopped = rank_result("oom", error="stopped: rank 1 ended in oom: CUDA out of memory")
    failed = rank_result("oom", error="OutOfMemoryError: CUDA out of memory")
    result = ranks.aggregate([stopped, failed])
    assert result["status"] == "oom"
    assert result["error"] == "rank 1: OutOfMemoryError: CUDA out of memory"
    assert ranks.aggregate([rank_result(), rank_result("error", error="boom")])["status"] == "error"


def test_a_rank_out_of_memory_is_the_cause_not_the_peer_whose_collective_then_failed():
    # Rank 1's worker was killed (the OOM killer); rank 0's all-reduce then lost its peer.
    peer = rank_result("error", error="RuntimeError: [gloo/pair.cc:553] Connection closed by peer")
    killed = rank_result(
        "oom", error="worker killed by SIGKILL: most likely the kernel's OOM killer"
    )
    result = ranks.aggregate([peer, killed])
    assert result["status"] == "oom"
    assert result["error"].startswith("rank 1: worker killed by SIGKILL")
    only_peers = ranks.aggregate([peer, rank_result("error", error="DistBackendError: NCCL")])
    assert only_peers["status"] == "error" and only_peers["error"].startswith("rank 0:")


def test_a_batch_is_shared_like_tensor_split():
    assert [len(share(7, r, 2)) for r in range(2)] == [4, 3]
    assert [list(share(5, r, 3)) for r in range(3)] == [[0, 1], [2, 3], [4]]
    assert [len(share(1, r, 2)) for r in range(2)] == [1, 0]


class OtherRankFailed(ranks.RankGroup):
    """A rank group where rank 1's worker has ended out of memory after ``after_s`` (every
    rank alive)."""

    info = RankInfo(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=9)
    rank = 0

    def __init__(self, after_s):
        self.deadline = time.monotonic() + after_s
        self.posted = {}

    def worker_prefix(self, index):
        return f"config{index}/"

    def silent_rank(self, index, timeout_s):
        return None

    def ended_badly_elsewhere(self, index):
        if time.monotonic() < self.deadline:
            return None
        return {"status": "oom", "error": "CUDA out of memory", "rank": 1}

    def post(self, key, value):
        self.posted[key] = value


def test_a_worker_waiting_on_a_failed_rank_is_stopped_and_takes_its_status(tmp_path, monkeypatch):
    # This rank's worker cannot even reach the store (nothing listens on port 9): it waits, as
    # it would in a collective whose other rank died. It must be stopped, not waited for.
    monkeypatch.setattr(processes, "STOP_GRACE_S", 0.5)
    config = ExperimentConfig(trainer="flash", batch_size=2, seq_len=8, distributed="ddp",
                              world_size=2, steps=1)  # fmt: skip
    group = OtherRankFailed(after_s=1.0)
    start = time.monotonic()
    result = processes.run_in_child(
        multiprocessing.get_context("fork"), config, str(tmp_path),
        str(tmp_path / "result.rank0.json"), group=group, index=3,
    )  # fmt: skip
    assert time.monotonic() - start < 60
    assert result["status"] == "oom"
    assert result["error"] == "stopped: rank 1 ended in oom: CUDA out of memory"
    assert group.posted["ended/3/0"]["status"] == "oom"
    assert not multiprocessing.active_children()


def test_a_rank_whose_worker_count_stands_still_is_found_silent(monkeypatch):
    """A rank group on a store of its own, on a clock of the test's: rank 0's worker beats,
    rank 1's beat once and stopped: rank 1 is silent once the timeout has passed since."""
    import types

    port = free_port()
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    now = [100.0]
    monkeypatch.setattr(ranks, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    group = ranks.RankGroup(RankInfo(0, 2, 0, "127.0.0.1", port))
    beat = lambda rank: group.store.add(f"{group.worker_prefix(3)}alive/{rank}", 1)  # noqa: E731
    beat(1)
    for _ in range(5):  # 10 s, rank 0 beating
        assert group.silent_rank(3, timeout_s=10) is None
        now[0] += 2
        beat(0)
    now[0] += 0.5
    assert group.silent_rank(3, timeout_s=10) == 1
    stop = group.why_stop(3, timeout_s=10)
    assert isinstance(stop, ranks.SilentRank) and stop.rank == 1
    assert str(stop).startswith("rank 1's worker showed no sign of life for 10 s")


def test_rank_0_hosting_the_store_leaves_only_once_the_others_read_its_last_word(monkeypatch):
    """Without a launcher's agent to hold the job's store, rank 0's process holds it: its last
    broadcast (the job's exit code) returns only once every other rank has read it, or the
    others' read would find the store gone with rank 0 ("Failed to recv")."""
    import threading

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    port = free_port()
    first = ranks.RankGroup(RankInfo(0, 3, 0, "127.0.0.1", port))
    others = [ranks.RankGroup(RankInfo(r, 3, r, "127.0.0.1", port)) for r in (1, 2)]
    said = []
    leaving = threading.Thread(target=lambda: said.append(first.last_broadcast("exit_code", 3)))
    leaving.start()
    assert others[0].last_broadcast("exit_code") == 3
    leaving.join(0.5)
    assert leaving.is_alive() and not said  # rank 2 has not read it yet
    assert others[1].last_broadcast("exit_code") == 3
    leaving.join(10)
    assert said == [3]
