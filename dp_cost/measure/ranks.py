"""The CLI processes of one torchrun job are one run: rank 0 names the run directory, holds its
lock, decides which configs run, and writes each config's aggregate ``result.json``; every rank
runs its own worker per config (``result.rank<k>.json``).

The CLI processes never touch torch.distributed's process groups (their workers fork from
them); they talk through the job's key-value store (torch's TCPStore at MASTER_ADDR:MASTER_PORT,
torchrun's own), and each config's workers form their own process group under a fresh prefix
of that store.

A rank's worker shows it is alive by a count it raises in the store (``start_heartbeat``: a
thread, so a worker busy in a long step still does); every rank's CLI watches every rank's
count while a config runs (``RankGroup.silent_rank``). A count that stays still for
--rank_timeout seconds is a rank stopped, hung or cut off: the job cannot go on, and ends
(``SilentRank``) instead of waiting on it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import threading
import time

import torch.distributed as dist

from dp_cost.parallel.ranks import RankInfo
from dp_cost.training.clipping import merged_record

STORE_TIMEOUT = datetime.timedelta(hours=2)  # the longest a rank waits for the others' answer
LAST_WORD_S = 60.0  # how long rank 0 keeps the store up for the others' last read
BEAT_S = 1.0  # how often a worker raises its count (a quarter of --rank_timeout when shorter)


class SilentRank(Exception):
    """A rank's worker showed no sign of life for --rank_timeout seconds: the job ends.
    ``result``: this rank's result of the config (an error naming the silent rank)."""

    def __init__(self, rank: int, timeout_s: float, result: dict | None = None):
        super().__init__(
            f"rank {rank}'s worker showed no sign of life for {timeout_s:g} s (stopped, hung or "
            "cut off; --rank_timeout)"
        )
        self.rank, self.timeout_s, self.result = rank, timeout_s, result


class RankGroup:
    def __init__(self, info: RankInfo):
        self.info = info
        hosts = info.is_first and not info.agent_hosts_store
        self.store = dist.TCPStore(
            info.master_addr,
            info.master_port,
            info.world_size if hosts else None,
            is_master=hosts,
            timeout=STORE_TIMEOUT,
            wait_for_workers=False,
        )
        # A restarted torchrun job (--max_restarts) reuses the store: keys per attempt.
        self.prefix = f"dp_cost/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.beats: dict[tuple[int, int], tuple[int, float]] = {}  # (config, rank): count, seen

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def is_first(self) -> bool:
        return self.info.is_first

    def broadcast(self, key: str, value=None):
        """Rank 0's ``value`` on every rank (the others wait for it)."""
        if self.is_first:
            self.store.set(self.prefix + key, json.dumps(value))
            return value
        return json.loads(self.store.get(self.prefix + key))

    def gather(self, key: str, value) -> list | None:
        """Every rank's ``value``, in rank order, on rank 0 (None elsewhere)."""
        self.post(f"{key}/{self.rank}", value)
        if not self.is_first:
            return None
        return [json.loads(self.store.get(f"{self.prefix}{key}/{r}")) for r in self.ranks()]

    def last_broadcast(self, key: str, value=None):
        """``broadcast`` as the job's last word: where rank 0 hosts the store (no launcher's
        agent holds it), rank 0 leaves only once every other rank has read it (or LAST_WORD_S
        has passed), since the store ends with rank 0's process."""
        value = self.broadcast(key, value)
        read_key = f"{self.prefix}{key}/read"
        if not self.is_first:
            self.store.add(read_key, 1)
        elif not self.info.agent_hosts_store:
            deadline = time.monotonic() + LAST_WORD_S
            while self.store.add(read_key, 0) < self.info.world_size - 1:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        return value

    def post(self, key: str, value) -> None:
        self.store.set(self.prefix + key, json.dumps(value))

    def peek(self, key: str):
        """The value posted under ``key``, or None when none is yet (never waits)."""
        if not self.store.check([self.prefix + key]):
            return None
        return json.loads(self.store.get(self.prefix + key))

    def ranks(self) -> range:
        return range(self.info.world_size)

    def worker_prefix(self, index: int) -> str:
        """Where config ``index``'s workers meet: a fresh process group per config."""
        return f"{self.prefix}config{index}/"

    def silent_rank(self, index: int, timeout_s: float) -> int | None:
        """A rank whose worker of config ``index`` has not raised its count for ``timeout_s``
        seconds of this process's clock (the clocks of other nodes are never compared), or
        None."""
        now = time.monotonic()
        for rank in self.ranks():
            count = self.store.add(f"{self.worker_prefix(index)}{BEAT_KEY}/{rank}", 0)
            seen = self.beats.get((index, rank))
            if seen is None or seen[0] != count:
                self.beats[index, rank] = (count, now)
            elif now - seen[1] > timeout_s:
                return rank
        return None

    def why_stop(self, index: int, timeout_s: float) -> SilentRank | dict | None:
        """Why this rank's worker of config ``index`` must stop: a rank fell silent, or another
        rank's worker ended badly (what it reported); None while neither."""
        silent = self.silent_rank(index, timeout_s)
        return (
            SilentRank(silent, timeout_s)
            if silent is not None
            else self.ended_badly_elsewhere(index)
        )

    def ended_badly_elsewhere(self, index: int) -> dict | None:
        """The status another rank's worker of config ``index`` ended with, if not ok: this
        rank's worker is then waiting in a collective that will never complete."""
        for rank in self.ranks():
            if rank != self.rank:
                ended = self.peek(f"ended/{index}/{rank}")
                if ended is not None and ended["status"] != "ok":
                    return {**ended, "rank": rank}
        return None


BEAT_KEY = "alive"


def start_heartbeat(info: RankInfo, prefix: str, timeout_s: float) -> None:
    """In a rank's worker of a config (its store prefix): a thread that raises the worker's
    count in the job's store for as long as the process runs. It stops with the process:
    stopped (SIGSTOP), frozen, or gone with its node."""
    every_s = min(BEAT_S, timeout_s / 4)

    def beat():
        try:
            store = dist.TCPStore(info.master_addr, info.master_port, is_master=False)
            while True:
                store.add(f"{prefix}{BEAT_KEY}/{info.rank}", 1)
                time.sleep(every_s)
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
            return

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def stopped_result(skeleton: dict, ended: dict | SilentRank) -> dict:
    """This rank's result when another rank's worker failed first: the same status; when a
    rank fell silent, an error naming it."""
    if isinstance(ended, SilentRank):
        skeleton["status"], skeleton["error"] = "error", f"{ended}: the job was ended"
        return skeleton
    skeleton["status"] = ended["status"]
    skeleton["error"] = (
        f"stopped: rank {ended['rank']} ended in {ended['status']}: {ended['error']}"
    )
    return skeleton


# How a collective fails when another rank's worker died or stopped answering (gloo, NCCL, the
# process group's timeout): the consequence on this rank, not the cause.
PEER_FAILURE = re.compile(
    r"stopped: rank|Connection (closed|reset) by peer|Broken pipe|DistBackendError|"
    r"NCCL communicator was aborted|remote process exited|[Ww]atchdog caught collective|"
    r"timed out|Timeout"
)


def aggregate(per_rank: list[dict]) -> dict:
    """A config's ``result.json`` from its ranks' results: rank 0's (the losses are of the
    global batch on every rank), with the slowest rank's step times, the largest peak, and each
    rank's own numbers under ``ranks``. A failure takes the status and error of the rank where
    it happened (a rank out of memory: oom), not those of the ranks whose collectives then
    failed or that were stopped because of it."""
    failed = [(rank, r) for rank, r in enumerate(per_rank) if r["status"] not in ("ok", "skipped")]
    causes = [(rank, r) for rank, r in failed if not PEER_FAILURE.search(str(r.get("error")))]
    result = dict(per_rank[0])
    if failed:
        rank, cause = (causes or failed)[0]
        result["status"] = cause["status"] if causes else "error"
        result["error"] = f"rank {rank}: {cause.get('error')}"
    steps = [r.get("step_times_ms") or [] for r in per_rank]
    if all(steps) and len({len(s) for s in steps}) == 1:
        slowest = [max(times) for times in zip(*steps, strict=True)]
        result.update(
            step_times_ms=slowest,
            avg_time_ms=statistics.fmean(slowest),
            median_time_ms=statistics.median(slowest),
        )
    for key in ("peak_memory_mb", "peak_reserved_mb", "communication_time_ms"):
        values = [r.get(key) for r in per_rank if r.get(key) is not None]
        result[key] = max(values) if values else result.get(key)
    clipping = [r["clipping"] for r in per_rank if r.get("clipping")]
    if clipping and len(clipping) == len(per_rank):  # each rank counted its own samples
        result["clipping"] = merged_record(clipping)
    result["ranks"] = [
        {
            "rank": rank,
            "status": r["status"],
            "device": (r.get("env") or {}).get("device"),
            "median_time_ms": r.get("median_time_ms"),
            "peak_memory_mb": r.get("peak_memory_mb"),
            "communication_time_ms": r.get("communication_time_ms"),
            "breakdown": r.get("breakdown"),
        }
        for rank, r in enumerate(per_rank)
    ]
    return result
