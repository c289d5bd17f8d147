"""What a run shows as it goes: a line per config (``describe``: its outcome, its time and
peak, or the capacity prediction and searches), and the progress bar over the configs
(hf_sweep: done and left, elapsed time and an estimate of the rest)."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

from dp_cost.capacity.probing import SEARCHES


class ProgressBar(tqdm):
    """Configs done and left, elapsed time and an estimate of the rest, on stderr: tqdm's bar
    redrawn in place on a terminal; one plain line per config elsewhere (a pipe, a log file)."""

    FORMAT = (
        "[{bar:24}] {n}/{total} configs done, {left} left, elapsed {elapsed}, "
        "estimate {remaining} left"
    )

    def __init__(self, total: int, done_already: int = 0, stream=None):
        stream = stream or sys.stderr
        self.lines = None if stream.isatty() else stream
        super().__init__(
            total=total,
            initial=done_already,
            file=stream if self.lines is None else open(os.devnull, "w"),  # noqa: SIM115
            ascii="-#",
            bar_format=self.FORMAT,
            mininterval=0,
        )
        self.print_line()

    @property
    def format_dict(self):
        return {**super().format_dict, "left": self.total - self.n}

    def update(self, n: int = 1):
        super().update(n)
        self.print_line()

    def print_line(self):
        if self.lines is not None:
            self.lines.write(str(self) + "\n")
            self.lines.flush()

    def write(self, message: str):  # type: ignore[override]
        """``message`` on stdout, above the bar."""
        tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()

    def close(self):
        file = self.fp
        super().close()
        if self.lines is not None:
            file.close()


def describe(result: dict) -> str:
    """A config's outcome in one line of the run's log."""
    prediction = result.get("prediction")
    if prediction:  # --mode=capacity: the prediction, and with --validate the measured peak
        told = f"predicted peak {prediction['peak_memory_mb']:.1f} MB" + "".join(
            f", fits {p['gpu_memory_gib']:g} GiB up to physical batch {p['physical_batch_size']}"
            + (" (the search's cap: more may fit)" if p.get("search_capped") else "")
            for p in prediction["largest_physical_batch"]
        )
        if prediction.get("peak_note"):
            told += " (a lower bound: see capacity.md)"
        step_time = prediction.get("time") or {}
        if step_time.get("step_ms") is not None:
            told += f", {step_time['step_ms']:.1f} ms a step on {step_time['card']}"
        for key, search in SEARCHES.items():
            found = result.get(key)
            if found:
                largest = found.get(search.found)
                above = [p for p in found["probes"] if largest and p[search.probed] > largest]
                told += (
                    f"; found by {len(found['probes'])} runs: "
                    + (f"{search.words} {largest} runs" if largest else f"no {search.words} runs")
                    + (" (the next one does not)" if above else "")
                    + (f", {found['error']}" if found.get("error") else "")
                )
        if result["status"] != "ok":
            return f"{told}; measured: {result['status']}: {result.get('error')}"
        measured = result.get("peak_memory_mb")
        return told + ("" if measured is None else f"; measured {measured:.1f} MB")
    if result["status"] != "ok":
        return f"{result['status']}: {result.get('error')}"
    if result["median_time_ms"] is None:  # an --ncu step: its time under replay is no measurement
        return "ok (" + result["env"].get("ncu_note", "not timed") + ")"
    median, peak = result["median_time_ms"], result["peak_memory_mb"]
    return f"ok, median {median:.1f} ms, peak " + ("n/a" if peak is None else f"{peak:.1f} MB")
