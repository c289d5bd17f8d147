"""Hugging Face Llama sequence classifiers from configs the project ships, LoRA, and the task.

One concept: the HF path of the profiler. Architectures come from ``HF_CONFIGS`` (the public
``config.json`` values of Meta's Llama 3.x checkpoints, copied here so nothing is downloaded) and
are built with random weights directly on the target device; ``pretrained=True`` is the only path
that touches the Hub. The task is SNLI-shaped sentence-pair classification made locally
(``synthetic_snli``) or read from a local JSONL copy (``load_snli``).

Decisions (see ``build_hf_model``):
- HF's ``LlamaRMSNorm`` is a custom module that no Opacus grad sampler and no flash norm rule
  knows, so every one is replaced by ``torch.nn.RMSNorm`` with the same eps, reusing the same
  weight Parameter: the same math (x * rsqrt(mean(x^2) + eps) * w), and Opacus 1.6 (hooks and
  ghost) and ``flash_clip`` support ``nn.RMSNorm``, so full fine-tuning trains the norm weights.
- With LoRA the classifier head ``score`` is trained too (peft ``modules_to_save=["score"]``: a
  trainable copy of the head beside the frozen original), as DP fine-tuning usually does; a
  randomly initialised head that stays frozen would make the task unlearnable.
- Token ids: ``PAD_TOKEN_ID`` = 0 and ``SEP_TOKEN_ID`` = 1 for every config (Llama 3 ships no pad
  id); data tokens are drawn from [2, vocab). ``pad_token_id`` matters to the classifier because
  it pools the logits at the last token that is not the pad id.

Requires ``transformers`` (5.x: the configs use the 4.x names ``rope_theta``/``rope_scaling``,
which 5.x still accepts) and ``peft`` for LoRA; both are imported lazily so ``import hf_models``
is cheap and the non-HF modes do not need them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD_TOKEN_ID = 0
SEP_TOKEN_ID = 1
FIRST_CONTENT_ID = 2  # data tokens are drawn from [FIRST_CONTENT_ID, vocab_size)
NUM_LABELS = 3  # SNLI: 0 entailment, 1 neutral, 2 contradiction
SNLI_LABELS = {"entailment": 0, "neutral": 1, "contradiction": 2}
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_IMPLEMENTATIONS = {"sdpa": "sdpa", "eager": "eager", "explicit": "eager"}

# Llama 3's RoPE frequency scaling ("llama3" rope type), as in the public config.json files.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA_3_2_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": _LLAMA3_ROPE,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}
_LLAMA_3_2_3B = {
    **_LLAMA_3_2_1B,
    "hidden_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "head_dim": 128,
}
_LLAMA_3_1_8B = {
    **_LLAMA_3_2_1B,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "head_dim": 128,
    "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
    "tie_word_embeddings": False,
}
# CPU test model: the Llama-3.2 code path (GQA, llama3 RoPE, tied config) at ~90k parameters.
_TINY_LLAMA = {
    **_LLAMA_3_2_1B,
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}

# Architecture configs (LlamaConfig keyword arguments). Base and -Instruct checkpoints share one.
HF_CONFIGS: dict[str, dict] = {
    "meta-llama/Llama-3.2-1B-Instruct": _LLAMA_3_2_1B,
    "meta-llama/Llama-3.2-1B": _LLAMA_3_2_1B,
    "meta-llama/Llama-3.2-3B-Instruct": _LLAMA_3_2_3B,
    "meta-llama/Llama-3.2-3B": _LLAMA_3_2_3B,
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA_3_1_8B,
    "meta-llama/Llama-3.1-8B": _LLAMA_3_1_8B,
    "tiny-llama": _TINY_LLAMA,
}
DEFAULT_HF_MODEL = "meta-llama/Llama-3.2-3B-Instruct"


def hf_config(name: str, *, num_labels: int = NUM_LABELS, attention: str = "sdpa"):
    """The shipped ``LlamaConfig`` of ``name`` for a ``num_labels``-way classifier, dropout 0."""
    from transformers import LlamaConfig

    if name not in HF_CONFIGS:
        raise ValueError(f"unknown HF model {name!r}; known: {', '.join(HF_CONFIGS)}")
    return LlamaConfig(
        **HF_CONFIGS[name],
        num_labels=num_labels,
        pad_token_id=PAD_TOKEN_ID,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation=_attention(attention),
    )


def _attention(attention: str) -> str:
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {sorted(ATTENTION_IMPLEMENTATIONS)}")
    return ATTENTION_IMPLEMENTATIONS[attention]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _offline() -> bool:
    flags = (os.environ.get(k, "") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(f.strip().upper() in {"1", "ON", "YES", "TRUE"} for f in flags)


def _load_pretrained(name, *, num_labels, token, dtype, device, cache_dir, attention):
    """``from_pretrained`` with one clear RuntimeError line (never the token) when it fails."""
    from transformers import LlamaForSequenceClassification

    if device.type == "meta":
        raise ValueError("pretrained=True needs a real device, not meta")
    token = token or os.environ.get("HF_TOKEN") or None
    try:
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:  # pragma: no cover - older hubs
        HfHubHTTPError = OSError
    try:
        return LlamaForSequenceClassification.from_pretrained(
            name,
            token=token,
            num_labels=num_labels,
            pad_token_id=PAD_TOKEN_ID,
            attention_dropout=0.0,
            use_cache=False,
            attn_implementation=_attention(attention),
            dtype=dtype,
            device_map={"": device},
            cache_dir=cache_dir,
            local_files_only=_offline(),  # offline: never reach for the network
        )
    except (OSError, HfHubHTTPError) as exc:
        lines = str(exc).strip().splitlines()
        reason = lines[0][:300] if lines else type(exc).__name__
        if token:
            reason = reason.replace(token, "***")
        raise RuntimeError(
            f"cannot load pretrained {name!r} (Hub unreachable or offline and not in the local "
            f"cache, or gated without access: set HF_TOKEN): {type(exc).__name__}: {reason}"
        ) from None


def swap_rms_norms(model: nn.Module) -> int:
    """Replace every HF ``LlamaRMSNorm`` by ``torch.nn.RMSNorm`` sharing its weight and eps.

    Same math (HF computes in fp32 and casts back before the weight multiply; in fp32 the two
    agree to rounding). Opacus 1.6 has a grad sampler for ``nn.RMSNorm`` and none for the HF
    class; ``flash_clip`` dispatches on exact types. Returns how many modules were replaced.
    """
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, LlamaRMSNorm)]
    for name, old in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = nn.RMSNorm(
            old.weight.shape, eps=old.variance_epsilon, device="meta", dtype=old.weight.dtype
        )
        new.weight = old.weight  # the same Parameter: no copy, pretrained values kept
        setattr(parent, child, new)
    return len(targets)


def check_no_shared_parameters(model: nn.Module) -> None:
    """Raise if any Parameter is reachable under two names (Opacus ghost rejects tied weights)."""
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            raise ValueError(f"parameter shared by {seen[id(p)]} and {name} (tied weights)")
        seen[id(p)] = name


def apply_lora(
    model: nn.Module, *, rank: int, alpha: float | None = None, dropout: float = 0.0
) -> nn.Module:
    """peft LoRA on q,k,v,o,gate,up,down; the head ``score`` trainable via ``modules_to_save``.

    The model must already be on its device (opacus#820: peft places adapters by the base
    layer's device, and moving a peft model afterwards breaks Opacus' hooks bookkeeping).
    """
    from peft import LoraConfig, TaskType, get_peft_model

    if rank <= 0:
        raise ValueError(f"lora_rank must be positive, got {rank}")
    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        lora_dropout=dropout,
        target_modules=list(LORA_TARGET_MODULES),
        modules_to_save=["score"],
        bias="none",
    )
    return get_peft_model(model, config)


def build_hf_model(
    name: str,
    *,
    device: str | torch.device = "cpu",
    num_labels: int = NUM_LABELS,
    use_lora: bool = False,
    lora_rank: int = 16,
    lora_alpha: float | None = None,
    lora_dropout: float = 0.0,
    pretrained: bool = False,
    token: str | None = None,
    dtype: torch.dtype = torch.float32,
    attention: str = "sdpa",
    cache_dir: str | None = None,
) -> tuple[nn.Module, dict]:
    """A ``LlamaForSequenceClassification`` for ``name``, in train mode, and its ``info``.

    Random weights (default): built from ``HF_CONFIGS[name]`` directly on ``device`` (under a
    ``torch.device`` context: no CPU init + copy; ``device="meta"`` only counts parameters).
    ``pretrained=True``: ``from_pretrained(name, token=token or $HF_TOKEN)`` onto ``device``;
    when the Hub or cache cannot provide it, a one-line RuntimeError (the token never appears).
    ``use_lora``: LoRA rank ``lora_rank`` (alpha default 2*rank) on the attention and MLP
    projections plus a trainable head; otherwise full fine-tuning, every parameter trainable.
    ``info``: trainable_params, frozen_params, config (name), lora_rank (None without LoRA).
    """
    from transformers import LlamaForSequenceClassification

    device = torch.device(device)
    if pretrained:
        model = _load_pretrained(
            name,
            num_labels=num_labels,
            token=token,
            dtype=dtype,
            device=device,
            cache_dir=cache_dir,
            attention=attention,
        )
    else:
        config = hf_config(name, num_labels=num_labels, attention=attention)
        with device, _default_dtype(dtype):
            model = LlamaForSequenceClassification(config)
    model.config.pad_token_id = PAD_TOKEN_ID
    swap_rms_norms(model)
    # A sequence classifier has no LM head, so tie_word_embeddings ties nothing; make sure.
    check_no_shared_parameters(model)
    if use_lora:
        model.requires_grad_(False)
        model = apply_lora(model, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout)
    else:
        model.requires_grad_(True)
    model.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    info = {
        "trainable_params": trainable,
        "frozen_params": total - trainable,
        "config": name,
        "lora_rank": lora_rank if use_lora else None,
    }
    return model, info


def sequence_classification_loss(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Per-sample cross-entropy [n] in fp32: the trainers' ``loss_fn`` for HF classifiers.

    Position ids get a batch dim and are contiguous ([B, T], not HF's broadcast [1, T]), so
    every per-sample machinery sees batch-first tensors.
    """
    batch, seq = input_ids.shape
    position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq).contiguous()
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    return F.cross_entropy(logits.float(), labels, reduction="none")


# ---------------------------------------------------------------- the task


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

    JSONL, one object per line with ``premise`` and ``hypothesis`` (or SNLI's ``sentence1`` /
    ``sentence2``) and ``label`` (or ``gold_label``) as 0/1/2 or entailment/neutral/
    contradiction; rows without a gold label (``-``, -1) are skipped. Tokens by
    ``hash_tokenize``; layout ``premise SEP hypothesis``, truncated to ``seq_len`` and
    right-padded with PAD_TOKEN_ID. Right padding needs no attention mask here: attention is
    causal and the classifier reads the last non-pad position, so pads never influence the
    logits (and receive zero gradient).
    """
    if vocab_size <= FIRST_CONTENT_ID:
        raise ValueError(f"vocab_size must be > {FIRST_CONTENT_ID}, got {vocab_size}")
    rows, labels = [], []
    with open(Path(path), encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            label = record.get("label", record.get("gold_label"))
            label = SNLI_LABELS.get(label, label) if isinstance(label, str) else label
            if label not in (0, 1, 2):
                continue  # no gold label
            premise = record.get("premise", record.get("sentence1"))
            hypothesis = record.get("hypothesis", record.get("sentence2"))
            if premise is None or hypothesis is None:
                raise ValueError(f"{path}:{line_no}: needs premise and hypothesis fields")
            ids = hash_tokenize(premise, vocab_size) + [SEP_TOKEN_ID]
            ids = (ids + hash_tokenize(hypothesis, vocab_size))[:seq_len]
            rows.append(ids + [PAD_TOKEN_ID] * (seq_len - len(ids)))
            labels.append(label)
    if not rows:
        raise ValueError(f"{path}: no labelled premise/hypothesis pairs")
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(labels, dtype=torch.int64)


# ---------------------------------------------------------------- privacy accounting, sampling


def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float = 1e-5,
    accountant: str = "prv",
) -> float:
    """The (epsilon, delta) guarantee of ``steps`` Poisson-subsampled Gaussian steps, by
    Opacus' PRV (default) or RDP accountant. ``inf`` without noise; 0 for no steps."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    accountants = {"prv": PRVAccountant, "rdp": RDPAccountant}
    if accountant not in accountants:
        raise ValueError(f"accountant must be one of {sorted(accountants)}, got {accountant!r}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    acc = accountants[accountant]()
    acc.history = [(noise_multiplier, sample_rate, steps)]
    return float(acc.get_epsilon(delta=delta))


def poisson_batch(
    dataset_size: int, sample_rate: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Indices of one Poisson-sampled batch (int64): each sample independently with
    probability ``sample_rate``, as Opacus' UniformWithReplacementSampler draws them. The batch
    may be empty; its expected size is sample_rate * dataset_size."""
    if not 0 <= sample_rate <= 1:
        raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
    mask = torch.rand(dataset_size, generator=generator) < sample_rate
    return mask.nonzero(as_tuple=False).reshape(-1)
