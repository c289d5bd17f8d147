"""Is a parsed result.json one the report can draw? The keys and types every table and plot
reads, checked once on loading, so a hand-edited or foreign file is skipped with its reason instead
of failing halfway through a report."""

from __future__ import annotations

import math

from dp_cost.core.schema import OPERATIONS, STATUSES


def _is_number(value) -> bool:
    # bool is an int in Python, but a "true" peak is no measurement
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number_or_none(value) -> bool:
    return value is None or _is_number(value)


def _dict_of(value, check) -> bool:
    return isinstance(value, dict) and all(check(v) for v in value.values())


def _list_of(value, check) -> bool:
    return isinstance(value, list) and all(check(v) for v in value)


def _snapshot(value) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("name"), str)
        and _is_number(value.get("timestamp"))
        and _number_or_none(value.get("allocated_mb"))
        and _number_or_none(value.get("phase_peak_mb"))
    )


def _kernel_category(value) -> bool:
    return isinstance(value, dict) and _number_or_none(value.get("time_ms"))


# config key -> check; the settings every table, label and comparison key reads
CONFIG_CHECKS = {
    "trainer": lambda v: isinstance(v, str),
    "model": lambda v: isinstance(v, str),
    "batch_size": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "seq_len": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "dtype": lambda v: isinstance(v, str),
    "attention": lambda v: isinstance(v, str),
}
OPTIONAL_CONFIG_CHECKS = {
    "physical_batch_size": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
    "lora_rank": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
}
# result key -> check of its value when present and not null
RESULT_CHECKS = {
    "config_dir": lambda v: isinstance(v, str),
    "trace_file": lambda v: isinstance(v, str),
    "timeline_file": lambda v: isinstance(v, str),
    "env": lambda v: isinstance(v, dict),
    "avg_time_ms": _is_number,
    "median_time_ms": _is_number,
    "peak_memory_mb": _is_number,
    "peak_reserved_mb": _is_number,
    "step_times_ms": lambda v: _list_of(v, _is_number),
    "breakdown": lambda v: _dict_of(v, _is_number),
    "breakdown_check": lambda v: isinstance(v, dict) and _number_or_none(v.get("torch_peak_mb")),
    "snapshots": lambda v: _list_of(v, _snapshot),
    "kernels": lambda v: _dict_of(v, _kernel_category),
    "flash_routes": lambda v: _list_of(v, lambda route: isinstance(route, dict)),
    "flash_checkpointing": lambda v: isinstance(v, str),
    "clipping": lambda v: isinstance(v, dict) and isinstance(v.get("rule"), str),
    "module_memory": lambda v: (
        isinstance(v, dict) and _dict_of(v.get("groups"), lambda g: _dict_of(g, _is_number))
    ),
    "phase_costs": lambda v: (
        isinstance(v, dict) and all(_dict_of(v.get(op), _number_or_none) for op, _ in OPERATIONS)
    ),
    "privacy": lambda v: isinstance(v, dict),
    "prediction": lambda v: _prediction(v),
    "find_max_batch": lambda v: (
        isinstance(v, dict)
        and _int_or_none(v.get("largest_physical_batch"))
        and _int_or_none(v.get("predicted_largest"))
        and _list_of(v.get("probes"), lambda p: isinstance(p, dict))
    ),
    "find_max_seq_len": lambda v: (
        isinstance(v, dict)
        and _int_or_none(v.get("longest_seq_len"))
        and _int_or_none(v.get("predicted_longest"))
        and _list_of(v.get("probes"), lambda p: isinstance(p, dict))
    ),
}


def _int_or_none(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _budget(value) -> bool:
    return (
        isinstance(value, dict)
        and _is_number(value.get("gpu_memory_gib"))
        and _int_or_none(value.get("physical_batch_size"))
        and _number_or_none(value.get("allocator_room_mb"))
    )


def _prediction(value) -> bool:
    """--mode=capacity's prediction: what its table and plot read."""
    return (
        isinstance(value, dict)
        and _is_number(value.get("peak_memory_mb"))
        and _int_or_none(value.get("physical_batch_size"))
        and _list_of(value.get("largest_physical_batch"), _budget)
        and (value.get("card") is None or _budget(value["card"]))
        and _list_of(
            value.get("predictions"),
            lambda p: (
                isinstance(p, dict)
                and _int_or_none(p.get("physical_batch_size"))
                and _is_number(p.get("peak_memory_mb"))
            ),
        )
        and isinstance(value.get("overheads"), dict)
    )


def result_problem(result, folder: str | None = None) -> str | None:
    """What makes ``result`` unusable for a report (one short phrase), or None if it is fine.
    ``folder``: the name of the config directory it was read from, which it must be the
    result of."""
    if not isinstance(result, dict):
        return f"not a JSON object but {type(result).__name__}"
    if result.get("status") not in STATUSES:
        return f"status {str(result.get('status'))[:40]!r} is none of {', '.join(STATUSES)}"
    config = result.get("config")
    if not isinstance(config, dict):
        return "no config object"
    for key, check in CONFIG_CHECKS.items():
        if key not in config:
            return f"config has no {key!r}"
        if not check(config[key]):
            return f"config {key!r} has the wrong type"
    for key, check in OPTIONAL_CONFIG_CHECKS.items():
        if key in config and not check(config[key]):
            return f"config {key!r} has the wrong type"
    for key, check in RESULT_CHECKS.items():
        if result.get(key) is not None and not check(result[key]):
            return f"{key!r} has the wrong type"
    return None if folder is None else placement_problem(result, folder)


def placement_problem(result: dict, folder: str) -> str | None:
    """Why a result is not the one of the config directory ``folder`` (a result.json copied
    from another config's directory would be a second row of that config), or None."""
    config = result["config"]
    own = f"{config['trainer']}_bs{config['batch_size']}_seq{config['seq_len']}"
    named = result.get("config_dir")
    if (named is None or named == folder) and (folder == own or folder.startswith(own + "_")):
        return None
    return f"it is the result of {str(named or own)[:80]!r}, not of its folder: copied there?"
