"""The task: SNLI-shaped sentence-pair classification, made locally or read from a local JSONL.

Nothing is downloaded: ``synthetic_snli`` draws pairs from a seed; ``load_snli`` reads a local
copy (through ``snli_file.snli_pairs``, which checks it) and tokenizes it with a hashing
tokenizer (no vocabulary file).
"""

from __future__ import annotations

import hashlib
import os
import re

import torch

from dp_cost.hf.configs import (
    FIRST_CONTENT_ID,
    NUM_LABELS,
    PAD_TOKEN_ID,
    SEP_TOKEN_ID,
)
from dp_cost.hf.snli_file import snli_pairs


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
