"""Hugging Face Llama sequence classifiers from the configs the project ships, and LoRA.

Architectures come from ``core.hf_architectures.HF_CONFIGS`` and are built with random weights
directly on the target device; ``pretrained=True`` is the only path that touches the Hub.

Decisions (see ``build_hf_model``):
- HF's ``LlamaRMSNorm`` is a custom module that no Opacus grad sampler and no flash norm rule
  knows, so every one is replaced by ``torch.nn.RMSNorm`` with the same eps, reusing the same
  weight Parameter: the same math (x * rsqrt(mean(x^2) + eps) * w), and Opacus 1.6 (hooks and
  ghost) and flash's norm rules support ``nn.RMSNorm``, so full fine-tuning trains the norm weights.
- With LoRA the classifier head ``score`` is trained too (peft ``modules_to_save=["score"]``: a
  trainable copy of the head beside the frozen original), as DP fine-tuning usually does; a
  randomly initialised head that stays frozen would make the task unlearnable.
- ``pad_token_id`` (``hf.configs.PAD_TOKEN_ID``) matters to the classifier because it pools the
  logits at the last token that is not the pad id.

Requires ``transformers`` (5.x: the configs use the 4.x names ``rope_theta``/``rope_scaling``,
which 5.x still accepts) and ``peft`` for LoRA; both are imported lazily so importing this module
is cheap and the non-HF modes do not need them.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from dp_cost.core import recompute
from dp_cost.core.hf_architectures import HF_CONFIGS
from dp_cost.hf.configs import (
    ATTENTION_IMPLEMENTATIONS,
    LORA_TARGET_MODULES,
    NUM_LABELS,
    PAD_TOKEN_ID,
)


def import_libraries(use_lora: bool) -> None:
    """Import what building a Hugging Face model imports (transformers' Llama, and peft for
    LoRA), once in a process that forks workers: each worker inherits them instead of paying
    their import (seconds of CPU) per config."""
    from transformers.models.llama import modeling_llama  # noqa: F401

    if use_lora:
        import peft  # noqa: F401


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


# The parts of a parameter's name that peft's wrappers add: a weight keeps its initial value with
# or without LoRA, and the head's trainable copy starts equal to the original head.
PEFT_NAME_PARTS = re.compile(
    r"base_model\.model\.|\.base_layer|\.original_module|\.modules_to_save\.\w+"
)


def parameter_seed(seed: int, name: str) -> int:
    """The seed of one parameter's initial value: from the run's seed and its name alone."""
    return (seed * 1_000_003 + zlib.crc32(PEFT_NAME_PARTS.sub("", name).encode())) % 2**63


def initial_value(module: nn.Module, name: str, whole: torch.Tensor, std: float, generator):
    """Fill ``whole`` with the initial value of ``module``'s parameter ``name`` (its qualified
    name), by the rules of HF's Llama (Linear and Embedding weights N(0, initializer_range), the
    padding row 0; biases 0; norms 1) and peft's LoRA (A: Kaiming uniform, a = sqrt(5); B: 0)."""
    if name.endswith(".bias") or ".lora_B." in name:
        return whole.zero_()
    if ".lora_A." in name:
        return nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
    if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
        return whole.fill_(1.0)
    if isinstance(module, (nn.Linear, nn.Embedding)):
        whole.normal_(0.0, std, generator=generator)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            whole[module.padding_idx] = 0
        return whole
    raise ValueError(f"no initialization rule for {name} (a {type(module).__name__})")


def initialize_weights(model: nn.Module, seed: int) -> None:
    """Every parameter's random initial value from a generator of its own, seeded by
    parameter_seed: the values depend on neither the order nor the place of initialization, so
    a rank that materialized only its FSDP2 shards (materialize_shards) holds the slices of the
    weights a whole build holds. An FSDP2 parameter (a DTensor) gets its local shard of the
    whole value, made on its device one parameter at a time."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    std = model.config.initializer_range
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for attribute, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{attribute}" if module_name else attribute
                sharded = isinstance(param, DTensor)
                local = param.to_local() if sharded else param
                generator = torch.Generator(local.device).manual_seed(parameter_seed(seed, name))
                if not sharded:  # filled in place
                    initial_value(module, name, param, std, generator)
                    continue
                whole = torch.empty(param.shape, dtype=param.dtype, device=local.device)
                initial_value(module, name, whole, std, generator)
                # this rank's slice, as FSDP2 splits it
                placed = distribute_tensor(
                    whole, param.device_mesh, param.placements, src_data_rank=None
                )
                local.copy_(placed.to_local())
                del whole, placed  # one whole parameter at a time


def materialize_shards(model: nn.Module, device: torch.device, seed: int) -> None:
    """A model built with its parameters on the meta device (build_hf_model(empty_weights=True))
    and then sharded by FSDP2: each rank allocates only its shards (to_empty) and initializes
    them (initialize_weights). The buffers (rotary tables) were built real and are kept."""
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    initialize_weights(model, seed)


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
    seed: int = 0,
    empty_weights: bool = False,
    activation_checkpointing: bool = False,
) -> tuple[nn.Module, dict]:
    """A ``LlamaForSequenceClassification`` for ``name``, in train mode, and its ``info``.

    Random weights (default): built from ``HF_CONFIGS[name]`` directly on ``device`` (under a
    ``torch.device`` context: no CPU init + copy; ``device="meta"`` only counts parameters),
    each parameter initialized from ``seed`` and its name (initialize_weights).
    ``empty_weights``: the parameters on the meta device (the buffers on ``device``), left for
    materialize_shards once FSDP2 has sharded them: a model too large for one card.
    ``pretrained=True``: ``from_pretrained(name, token=token or $HF_TOKEN)`` onto ``device``;
    when the Hub or cache cannot provide it, a one-line RuntimeError (the token never appears).
    ``use_lora``: LoRA rank ``lora_rank`` (alpha default 2*rank) on the attention and MLP
    projections plus a trainable head; otherwise full fine-tuning, every parameter trainable.
    ``activation_checkpointing``: each decoder layer recomputed in the backward (checkpointed).
    ``info``: trainable_params, frozen_params, config (name), lora_rank, empty_weights."""
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
        model = _build_random(name, num_labels, attention, device, dtype, empty_weights)
    model.config.pad_token_id = PAD_TOKEN_ID
    swap_rms_norms(model)
    # A sequence classifier has no LM head, so tie_word_embeddings ties nothing; make sure.
    check_no_shared_parameters(model)
    if activation_checkpointing:
        checkpointed(model)
    if use_lora:
        model.requires_grad_(False)
        model = apply_lora(model, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout)
    else:
        model.requires_grad_(True)
    if not pretrained and not empty_weights and device.type != "meta":
        initialize_weights(model, seed)
    model.train()
    return model, model_info(model, name, lora_rank if use_lora else None, empty_weights)


def checkpointed(model: nn.Module) -> None:
    """Each decoder layer recomputed in the backward: transformers' non-reentrant checkpointing,
    with the contexts a trainer sets (dp_cost.core.recompute)."""
    contexts = recompute.attach(model)
    # a later transformers 5 release renamed gradient_checkpointing_enable (kept, deprecated);
    # earlier ones (5.17) lack the new name
    enable = getattr(model, "activation_checkpointing_enable", None)
    enable = enable or model.gradient_checkpointing_enable
    enable({"use_reentrant": False, "context_fn": contexts})


def _build_random(name, num_labels, attention, device, dtype, empty_weights) -> nn.Module:
    """The architecture of ``name`` built directly on ``device`` in ``dtype`` (its parameters on
    the meta device with ``empty_weights``), not yet initialized."""
    from accelerate import init_empty_weights
    from transformers import LlamaForSequenceClassification

    config = hf_config(name, num_labels=num_labels, attention=attention)
    empty = init_empty_weights(include_buffers=False) if empty_weights else contextlib.nullcontext()
    with device, _default_dtype(dtype), empty:
        return LlamaForSequenceClassification(config)


def model_info(model: nn.Module, name: str, lora_rank: int | None, empty_weights: bool) -> dict:
    """build_hf_model's ``info``: parameter counts, the config's name, the LoRA rank."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {
        "trainable_params": trainable,
        "frozen_params": total - trainable,
        "config": name,
        "lora_rank": lora_rank,
        # the parameters left on the meta device for each rank to materialize its FSDP2 shards
        "empty_weights": empty_weights,
    }


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
