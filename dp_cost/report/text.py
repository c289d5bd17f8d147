"""summary.txt: the plain-text summary of a run, in the older memory scripts' layout."""

from __future__ import annotations

from dp_cost.core.schema import BREAKDOWN_LABELS, trainer_title
from dp_cost.report.results import ordered, privacy_summary


def _privacy_lines(results: list[dict]) -> list[str]:
    """Each DP config's (epsilon, delta_total) and the steps it covers, or why it has none."""
    lines = []
    for r in ordered(results):
        privacy, c = privacy_summary(r), r["config"]
        name = f"{trainer_title(c['trainer'])} bs{c['batch_size']} T{c['seq_len']}"
        if privacy["epsilon"] is not None:
            lines.append(
                f"{name:<48}epsilon {privacy['epsilon']:.2f} at delta_total "
                f"{privacy['delta_total']:.4e} over {privacy['dp_steps']} DP steps"
            )
        elif privacy["why"]:
            lines.append(f"{name:<48}epsilon null: {privacy['why']}")
    return (
        ["", "PRIVACY (every DP step the model took: warm-up, timed, measurement)", *lines]
        if lines
        else []
    )


def _fixed(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def summary_text(results: list[dict]) -> str:
    """summary.txt: the older scripts' layout — trainer, peak, median time — plus the component
    table of every config with a breakdown. (The older scripts' "Memory/Time" column, MB divided
    by ms, measured nothing and is gone.)"""
    rule = "=" * 100
    lines = [
        rule,
        "SUMMARY",
        rule,
        "",
        f"{'Method':<48}{'Peak Memory (MB)':>18}{'Median Time (ms)':>18}",
        "-" * 100,
    ]
    for r in ordered(results):
        c = r["config"]
        name = f"{trainer_title(c['trainer'])} bs{c['batch_size']} T{c['seq_len']}"
        if r["status"] != "ok":
            lines.append(f"{name:<48}{r['status'] + ': ' + str(r.get('error'))[:50]:>48}")
            continue
        peak, median = r.get("peak_memory_mb"), r.get("median_time_ms")
        # null under --ncu (a replayed step is no measurement): shown as n/a, never as 0
        lines.append(f"{name:<48}{_fixed(peak):>18}{_fixed(median):>18}")
    lines += _privacy_lines(results)
    lines += [
        rule,
        "",
        "COMPONENT-LEVEL BREAKDOWN (at the measured peak of one recorded step):",
        "",
    ]
    any_breakdown = False
    for r in ordered(results):
        if not r.get("breakdown"):
            continue
        any_breakdown = True
        c = r["config"]
        lines.append(
            f"{trainer_title(c['trainer'])} bs{c['batch_size']} "
            f"T{c['seq_len']} {c['dtype']} {c['attention']}:"
        )
        lines.append("-" * 80)
        for key, value in sorted(r["breakdown"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {BREAKDOWN_LABELS.get(key, key):<50}{value:>14.2f} MB")
        check = r.get("breakdown_check") or {}
        if check:
            lines.append(
                f"  {'(sum; torch max_memory_allocated of that step)':<50}"
                f"{sum(r['breakdown'].values()):>14.2f} MB; {check['torch_peak_mb']:.2f} MB"
                f", peak after {check.get('peak_after_phase')}"
            )
        lines.append("")
    if not any_breakdown:
        lines.append("  (no breakdown: it needs --mode=memory on a CUDA device)")
    return "\n".join(lines) + "\n"
