"""core/reading.py: only regular files, a size cap, UTF-8, bounded nesting, no bare NaN; every
refusal is an UnreadableFile with a reason, never a hang or a RecursionError."""

import gzip
import json
import os
import threading

import pytest

from dp_cost.core import reading


def test_reads_plain_and_gzipped_json(tmp_path):
    data = {"a": [1, 2.5, {"b": None}]}
    (tmp_path / "r.json").write_text(json.dumps(data))
    (tmp_path / "r.json.gz").write_bytes(gzip.compress(json.dumps(data).encode()))
    assert reading.read_json(tmp_path / "r.json") == data
    assert reading.read_json(tmp_path / "r.json.gz") == data


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"a": NaN}', "not JSON"),
        (b'{"a": -Infinity}', "not JSON"),
        (b'{"a": 1', "not JSON"),
        (b"[" * 100 + b"]" * 100, "nested deeper than 64"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
        (b"\x1f\x8b\x08\x00broken", "broken gzip"),
    ],
)
def test_bad_content_is_refused_with_a_reason(tmp_path, content, reason):
    path = tmp_path / "result.json"
    path.write_bytes(content)
    with pytest.raises(reading.UnreadableFile, match=reason):
        reading.read_json(path)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "result.json"
    os.mkfifo(fifo)
    outcome = []

    def read():
        try:
            reading.read_json(fifo)
        except reading.UnreadableFile as error:
            outcome.append(str(error))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert outcome == ["not a regular file"]


def test_directories_devices_and_missing_files_are_refused(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "zero").symlink_to("/dev/zero")
    for path, reason in (
        (tmp_path / "dir", "not a regular file|directory"),
        (tmp_path / "zero", "not a regular file"),
        (tmp_path / "missing", "No such file"),
    ):
        with pytest.raises(reading.UnreadableFile, match=reason):
            reading.read_json(path)


def test_size_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "MAX_BYTES", 100)
    (tmp_path / "big.json").write_text(json.dumps(["x" * 200]))
    with pytest.raises(reading.UnreadableFile, match="larger than"):
        reading.read_json(tmp_path / "big.json")
    # a small gzip that inflates past the cap is refused too
    (tmp_path / "bomb.json.gz").write_bytes(gzip.compress(b" " * 10_000 + b"[]"))
    with pytest.raises(reading.UnreadableFile, match="uncompressed"):
        reading.read_json(tmp_path / "bomb.json.gz")


def test_nesting_depth():
    assert reading.nesting_depth(3) == 0
    assert reading.nesting_depth([]) == 1
    assert reading.nesting_depth({"a": [1, {"b": [[]]}], "c": 2}) == 5


def test_read_json_or_none_warns_once_per_unreadable_file(tmp_path, capsys):
    assert reading.read_json_or_none(tmp_path / "missing.json") is None
    assert capsys.readouterr().err == ""
    os.mkfifo(tmp_path / "result.json")
    assert reading.read_json_or_none(tmp_path / "result.json") is None
    assert (
        capsys.readouterr().err == f"warning: skipped {tmp_path}/result.json: not a regular file\n"
    )
    (tmp_path / "ok.json").write_text('{"status": "ok"}')
    assert reading.read_json_or_none(tmp_path / "ok.json") == {"status": "ok"}
