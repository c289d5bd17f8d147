"""Result files are strict JSON: no bare NaN or Infinity, whatever was measured."""

import json
import math

from dp_cost.core import files


def test_non_finite_floats_are_written_as_null_and_located(tmp_path):
    data = {"losses": [1.0, math.nan], "peak": math.inf, "nested": {"x": (-math.inf, 2)}, "n": 3}
    assert files.non_finite_paths(data) == ["losses[1]", "peak", "nested.x[0]"]
    path = str(tmp_path / "result.json")
    files.write_json(path, data)
    text = open(path).read()
    assert "NaN" not in text and "Infinity" not in text
    strict = json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert strict == {"losses": [1.0, None], "peak": None, "nested": {"x": [None, 2]}, "n": 3}
    assert files.non_finite_paths(strict) == []
