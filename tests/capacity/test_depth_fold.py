"""benchmarks/depth_fold.py: a config planned at its own depth and at two smaller ones, and the
full depth's numbers drawn by a line through the small ones. Checked against plans made here
(fake_step.predict at each depth) and the phase peaks against a trace counted by hand."""

import dataclasses
import json

import pytest

from dp_cost.capacity import card, fake_step
from dp_cost.measure import worker
from dp_cost.measure.breakdown import MARKER_FUNCTION, peaks_by_phase, replay_to_peak
from dp_cost.measure.config import ExperimentConfig
from tests.cli_helpers import benchmark_main

MIB = 2**20


def test_peaks_by_phase_counts_each_stretch_between_markers():
    def alloc(addr, size):
        return {"action": "alloc", "addr": addr, "size": size}

    def free(addr):
        return {"action": "free_completed", "addr": addr}

    marker = {"action": "alloc", "addr": -1, "size": 0, "frames": [{"name": MARKER_FUNCTION}]}
    trace = [alloc(1, 30), alloc(2, 50), free(1), marker, alloc(3, 10), free(2), alloc(4, 5),
             free(7), {**marker, "addr": -2}]  # fmt: skip
    # 100 held at the start; 180 before the marker; then 150 -> 160 -> 110 -> 115 -> 15 (the
    # block held from the start freed); then 15
    assert peaks_by_phase(trace, {7: 100}) == [180, 160, 15]
    # on CUDA a marker's block is freed at once and its address taken again: counted then
    reused = [alloc(1, 100), {**marker, "addr": 5}, free(5), alloc(5, 50), free(5),
              alloc(6, 60), free(6), alloc(7, 60)]  # fmt: skip
    assert peaks_by_phase(reused, {}) == [100, 160]
    assert max(peaks_by_phase(reused, {})) == replay_to_peak(reused, {})[0]["total"]


def plan(config, blocks: int) -> dict:
    deep = dataclasses.replace(config, model_overrides={**config.model_overrides,
                                                        "num_layers": blocks})  # fmt: skip
    return fake_step.predict(deep, worker.build_trainer)


@pytest.mark.parametrize("trainer", ["standard", "flash"])
def test_a_deep_plan_is_drawn_from_two_shallow_ones(tmp_path, capsys, trainer):
    """The tiny LM six blocks deep against plans made here at 3, 4 and 6 blocks: the script's
    full and shallow numbers are those plans', its drawn numbers lie on the line through the
    shallow ones, and for identical blocks the line meets the deep plan: each phase's peak and
    the step's time within 0.1% (the reserved peak need not: the allocator's segments come in
    steps of 2 and 20 MiB, as large as the tiny model's blocks)."""
    # a second override (a shorter position table) kept at every depth
    config = ExperimentConfig(trainer=trainer, batch_size=2, seq_len=16, capacity=True,
                              model_overrides={"num_layers": 6, "max_seq_len": 256})  # fmt: skip
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"config": config.to_dict()}))
    status, out, _ = benchmark_main("depth_fold.py", path, "--out", tmp_path / "rows.json",
                                    capsys=capsys)  # fmt: skip
    assert status == 0 and f"{trainer} tiny (6 blocks, physical 2)" in out
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    here = {blocks: plan(config, blocks) for blocks in (3, 4, 6)}
    assert row["full"]["peak"] == here[6]["peak"] / MIB
    assert row["full"]["reserved"] == card.reserved_peak(here[6]) / MIB
    for shallow, blocks in zip(row["shallow"], (3, 4), strict=True):
        assert shallow["phase_peaks"] == [p / MIB for p in here[blocks]["phase_peaks"]]
    low, high = (here[b]["phase_peaks"] for b in (3, 4))
    drawn = [(a + 3 * (b - a)) / MIB for a, b in zip(low, high, strict=True)]
    assert row["drawn"]["phase_peaks"] == pytest.approx(drawn)
    assert row["drawn"]["peak"] == pytest.approx(max(drawn))
    assert max(here[6]["phase_peaks"]) == here[6]["peak"]
    assert abs(row["errors"]["phase_peaks_worst"]) < 0.001
    assert abs(row["errors"]["step_ms"]) < 0.001
    assert "peak: 1/1 within ±1%" in out
    status, again, _ = benchmark_main("depth_fold.py", "--rows", tmp_path / "rows.json",
                                      capsys=capsys)  # fmt: skip
    assert status == 0 and again == out  # the kept rows printed again, no plan made


def test_configs_it_cannot_draw_are_named_and_bad_input_refused(tmp_path, capsys):
    shallow = ExperimentConfig(trainer="standard", batch_size=2, seq_len=16)  # two blocks
    (tmp_path / "run" / "a").mkdir(parents=True)
    (tmp_path / "run" / "a" / "result.json").write_text(json.dumps({"config": shallow.to_dict()}))
    (tmp_path / "run" / "b").mkdir()
    (tmp_path / "run" / "b" / "result.json").write_text("{not json")
    unknown = {**shallow.to_dict(), "model": "no-such-model"}
    (tmp_path / "run" / "c").mkdir()
    (tmp_path / "run" / "c" / "result.json").write_text(json.dumps({"config": unknown}))
    status, out, _ = benchmark_main("depth_fold.py", tmp_path / "run", capsys=capsys)
    assert status == 0
    assert "2 blocks: not deeper than --depths" in out and "unreadable" in out
    assert "run/c/result.json: not planned: " in out and "no-such-model" in out
    status, _, err = benchmark_main("depth_fold.py", tmp_path / "nothing", capsys=capsys)
    assert status == 1 and "no result.json" in err
    for broken in ("[not rows", "{}", "[1]", '[{"error": null}]'):
        (tmp_path / "rows.json").write_text(broken)
        status, _, err = benchmark_main("depth_fold.py", "--rows", tmp_path / "rows.json",
                                        capsys=capsys)  # fmt: skip
        assert status == 1 and "not rows this script wrote" in err and "\n" not in err.strip()
    for refused_argv in (("--depths", "4", "3"), ()):
        with pytest.raises(SystemExit) as refused:
            benchmark_main("depth_fold.py", *refused_argv, capsys=capsys)
        assert refused.value.code == 2
