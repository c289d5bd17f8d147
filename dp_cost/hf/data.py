"""The task: SNLI-shaped sentence-pair classification, made locally or read from a local JSONL.

Nothing is downloaded: ``synthetic_snli`` draws pairs from a seed; ``load_snli`` reads a local
copy and tokenizes it with a hashing tokenizer (no vocabulary file). ``snli_pairs`` is the one
reader of such a file: the plan runs it over the whole file before any worker starts, the
worker reads the pairs through it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterator

import torch

from dp_cost.core.reading import UnreadableFile, open_regular, size_words
from dp_cost.hf.configs import (
    DATASET_MAX_BYTES,
    DATASET_MAX_LINE_BYTES,
    FIRST_CONTENT_ID,
    NUM_LABELS,
    PAD_TOKEN_ID,
    SEP_TOKEN_ID,
    SNLI_LABELS,
)


def synthetic_snli(
    num_samples: int, seq_len: int, vocab_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """SNLI-shaped pairs made locally: ``input_ids`` [N, T] int64 and ``labels`` [N] in {0,1,2}.

    Layout of each row, exactly ``seq_len`` tokens, no padding (so no attention mask is needed
    and the classifier pools at the last position)::

        premise (P tokens) | SEP_TOKEN_ID | hypothesis (T - P - 1 tokens)

    with P uniform in [1, T-2] and tokens uniform in [FIRST_CONTENT_ID, vocab_size). Labels are
    uniform and independent of the tokens: the task measures cost, not accuracy. Deterministic
    in ``seed`` (its own generator; the global RNG is untouched).
    """
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 (premise, separator, hypothesis), got {seq_len}")
    if vocab_size <= FIRST_CONTENT_ID:
        raise ValueError(f"vocab_size must be > {FIRST_CONTENT_ID}, got {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(FIRST_CONTENT_ID, vocab_size, (num_samples, seq_len), generator=g)
    premise_len = torch.randint(1, seq_len - 1, (num_samples,), generator=g)
    input_ids[torch.arange(num_samples), premise_len] = SEP_TOKEN_ID
    labels = torch.randint(0, NUM_LABELS, (num_samples,), generator=g)
    return input_ids, labels


_WORD = re.compile(r"\w+|[^\w\s]")


def hash_tokenize(text: str, vocab_size: int) -> list[int]:
    """Deterministic hashing tokenizer: lower-cased words and punctuation, each mapped by
    blake2b to a bucket in [FIRST_CONTENT_ID, vocab_size). No vocabulary file, no download;
    collisions are fine for a cost measurement."""
    buckets = vocab_size - FIRST_CONTENT_ID
    return [
        FIRST_CONTENT_ID
        + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") % buckets
        for w in _WORD.findall(text.lower())
    ]


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


def load_snli(
    path: str | os.PathLike, seq_len: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A local SNLI copy as (input_ids [N, T], labels [N]); never downloads.

    The pairs of ``snli_pairs`` (which says what the file holds; DatasetError for a bad line).
    Tokens by ``hash_tokenize``; layout ``premise SEP hypothesis``, truncated to ``seq_len`` and
    right-padded with PAD_TOKEN_ID. Right padding needs no attention mask here: attention is
    causal and the classifier reads the last non-pad position, so pads never influence the
    logits (and receive zero gradient).
    """
    if vocab_size <= FIRST_CONTENT_ID:
        raise ValueError(f"vocab_size must be > {FIRST_CONTENT_ID}, got {vocab_size}")
    rows, labels = [], []
    for premise, hypothesis, label in snli_pairs(path):
        ids = hash_tokenize(premise, vocab_size) + [SEP_TOKEN_ID]
        ids = (ids + hash_tokenize(hypothesis, vocab_size))[:seq_len]
        rows.append(ids + [PAD_TOKEN_ID] * (seq_len - len(ids)))
        labels.append(label)
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(labels, dtype=torch.int64)
