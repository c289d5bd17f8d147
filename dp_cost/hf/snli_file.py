"""A local SNLI JSON-lines file, read and checked without torch: ``snli_pairs`` is the one reader
of such a file. The plan runs it over the whole file before any worker starts (and before torch
is imported), the worker reads the pairs through it (``data.load_snli``)."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator

from dp_cost.core.reading import (
    DATASET_MAX_BYTES,
    DATASET_MAX_LINE_BYTES,
    UnreadableFile,
    open_regular,
    size_words,
)
from dp_cost.hf.configs import SNLI_LABELS


class DatasetError(ValueError):
    """A dataset file that is not SNLI JSON lines; ``str()`` is one line naming the file and,
    for a bad line, its number and what is wrong with it."""


NO_GOLD_LABEL = ("-", -1)  # SNLI's rows where the annotators did not agree: skipped


def _open_dataset(path: str):
    """``path`` opened in binary if it is a regular file under DATASET_MAX_BYTES (a FIFO cannot
    block the open: core.reading.open_regular)."""
    try:
        return open_regular(path, DATASET_MAX_BYTES)
    except UnreadableFile as error:
        if "larger than" in str(error):
            raise DatasetError(f"{path} is {error}") from None
        raise DatasetError(f"{path} is not a file (JSON lines expected): {error}") from None


def _kind(value) -> str:
    """A JSON value's type in words."""
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    kinds = {dict: "an object", list: "a list", str: "a string"}
    return kinds.get(type(value), "a number")


def _shown(value) -> str:
    """A value as a short one-line JSON text (a line may hold a megabyte)."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."


def _field(record: dict, name: str, alias: str):
    """``record[name]`` (SNLI's own files: ``record[alias]``); ValueError when neither is."""
    key = name if name in record else alias
    if key not in record:
        raise ValueError(f"no {name} (or {alias}) field")
    return key, record[key]


def snli_pair(record) -> tuple[str, str, int] | None:
    """(premise, hypothesis, label 0/1/2) of one parsed JSONL line, None for a row without a
    gold label; ValueError naming what is wrong for any other value."""
    if not isinstance(record, dict):
        raise ValueError(f"not a JSON object ({_kind(record)})")
    texts = []
    for name, alias in (("premise", "sentence1"), ("hypothesis", "sentence2")):
        key, text = _field(record, name, alias)
        if not isinstance(text, str):
            raise ValueError(f"{key} is {_kind(text)}, not a string")
        texts.append(text)
    key, label = _field(record, "label", "gold_label")
    if label in NO_GOLD_LABEL and type(label) in (str, int):  # not -1.0, not True
        return None
    label = SNLI_LABELS.get(label, label) if isinstance(label, str) else label
    if type(label) is not int or label not in (0, 1, 2):
        raise ValueError(
            f"{key} is {_shown(record[key])}: expected 0, 1, 2, "
            f'{", ".join(SNLI_LABELS)}, or -1 / "-" for no gold label'
        )
    return texts[0], texts[1], label


def _lines(f, path: str) -> Iterator[tuple[int, bytes]]:
    """(number, bytes) of each line, read in pieces of at most DATASET_MAX_LINE_BYTES + 1: a
    longer line is an error, not a memory blow-up, and so is a file grown past the cap."""
    total = 0
    for line_no in itertools.count(1):
        line = f.readline(DATASET_MAX_LINE_BYTES + 1)
        if not line:
            return
        total += len(line)
        if total > DATASET_MAX_BYTES:
            raise DatasetError(f"{path} is larger than the cap of {size_words(DATASET_MAX_BYTES)}")
        if len(line) > DATASET_MAX_LINE_BYTES and not line.endswith(b"\n"):
            raise DatasetError(
                f"{path} is not JSON lines: line {line_no}: longer than the cap of "
                f"{size_words(DATASET_MAX_LINE_BYTES)}"
            )
        yield line_no, line


def _parsed(line: bytes, line_no: int):
    """One line's JSON value; ValueError naming what is wrong."""
    try:
        text = line.decode("utf-8-sig" if line_no == 1 else "utf-8").rstrip("\r\n")
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8 (byte {error.start + 1} of the line)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg}: column {error.colno})") from None
    except RecursionError:
        raise ValueError("JSON nested too deep to parse") from None


def snli_pairs(path: str | os.PathLike) -> Iterator[tuple[str, str, int]]:
    """The labelled (premise, hypothesis, label) pairs of a local SNLI JSONL, in file order.

    A regular file of at most DATASET_MAX_BYTES, read a line at a time (a line of at most
    DATASET_MAX_LINE_BYTES); blank lines and rows without a gold label are skipped. Every other
    line is a JSON object with ``premise`` and ``hypothesis`` (or SNLI's ``sentence1`` /
    ``sentence2``) strings and a ``label`` (or ``gold_label``): 0/1/2 or entailment/neutral/
    contradiction. Raises DatasetError at the first line that is not, naming the file, the line
    and what is wrong, and for a file without a labelled pair.
    """
    path = os.fspath(path)
    found = 0
    with _open_dataset(path) as f:
        for line_no, line in _lines(f, path):
            if not line.strip():
                continue
            try:
                pair = snli_pair(_parsed(line, line_no))
            except ValueError as error:
                raise DatasetError(f"{path} is not JSON lines: line {line_no}: {error}") from None
            if pair is not None:
                found += 1
                yield pair
    if not found:
        raise DatasetError(f"{path}: no labelled premise/hypothesis pairs")


def count_snli_pairs(path: str | os.PathLike) -> int:
    """How many labelled pairs ``snli_pairs`` reads from ``path`` (the whole file checked)."""
    return sum(1 for _ in snli_pairs(path))
