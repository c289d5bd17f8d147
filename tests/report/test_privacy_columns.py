"""The summaries' privacy columns: epsilon, delta_total and dp_steps of each DP config, and one
line saying why where epsilon is null."""

from dp_cost.report.results import NO_SAMPLING, OLDER_RECORD, privacy_notes, privacy_summary
from dp_cost.report.tables import format_table, summary_rows


def result(trainer, privacy=None, env=None, model="tiny-llama", clipping=True):
    return {
        "status": "ok",
        "config": {
            "trainer": trainer,
            "batch_size": 8,
            "seq_len": 16,
            "model": model,
            "dtype": "float32",
            "attention": "sdpa",
        },  # fmt: skip
        "privacy": privacy,
        "env": env or {},
        "clipping": {"rule": "flat"} if clipping else None,
        "median_time_ms": 10.0,
    }


RECORD = {"epsilon": 1.9185, "delta": 1e-5, "delta_total": 1.0365e-5, "steps": 4}


def test_each_dp_config_shows_its_epsilon_or_why_not():
    assert privacy_summary(result("flash", RECORD)) == {
        "epsilon": 1.9185, "delta_total": 1.0365e-5, "dp_steps": 4, "why": None,
    }  # fmt: skip
    # no noise: epsilon is infinite, written null, with the worker's note
    infinite = privacy_summary(result("flash", {**RECORD, "epsilon": None},
                                      {"non_finite_note": "privacy.epsilon was inf"}))  # fmt: skip
    assert infinite["epsilon"] is None and "inf" in infinite["why"]
    # a result written before delta_total: its epsilon (an older reuse rule) is not shown
    older = privacy_summary(result("flash", {"epsilon": 4.98, "delta": 1e-5, "steps": 5}))
    assert older["epsilon"] is None and older["why"] == OLDER_RECORD
    # the causal LM: no sampling, so no epsilon; standard: nothing to say
    assert privacy_summary(result("dpsgd", model="tiny"))["why"] == NO_SAMPLING
    assert privacy_summary(result("standard", clipping=False))["why"] is None


def test_the_tables_carry_the_columns_and_the_notes_the_reasons():
    results = [result("standard", clipping=False), result("flash", RECORD),
               result("dpsgd", model="tiny")]  # fmt: skip
    table = format_table(summary_rows(results))
    assert "epsilon" in table and "1.0365e-05" in table and "1.92" in table
    notes = privacy_notes(results)
    assert "every DP step" in notes and f"dpsgd bs8 seq16: {NO_SAMPLING}" in notes


def test_a_tail_term_over_delta_is_said_once_per_sampler():
    """Where a sampler's tail term exceeds delta, the notes (summary.md, report.html) say so on
    one line per sampler naming the configs; a term below delta says nothing."""
    over = {**RECORD, "delta_total": 0.041, "tail_delta": 0.04099, "noise_sampler": "torch_cuda"}
    under = {**RECORD, "tail_delta": 3.65e-7, "noise_sampler": "exact64"}
    results = [result("dpsgd", over), result("ghost", over), result("flash", under)]
    lines = [line for line in privacy_notes(results).splitlines() if "tail term exceeds" in line]
    assert len(lines) == 1
    assert "dpsgd bs8 seq16 (0.041)" in lines[0] and "ghost bs8 seq16" in lines[0]
    assert "torch_cuda" in lines[0] and "--noise_sampler exact64" in lines[0]
    assert "flash bs8" not in lines[0]
    assert "tail term exceeds" not in privacy_notes([result("flash", under)])
