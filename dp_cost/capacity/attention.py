"""A planned step's attention as CUDA runs it, not as the CPU would.

The fake step runs on CPU fake tensors, where ``F.scaled_dot_product_attention`` would take the
CPU's kernel. On a card torch picks one of four kernels, and they keep different tensors for
the backward: cuDNN's, flash's and the memory-efficient kernel keep the output and a row of
log-sum-exps (a boolean mask becomes an additive one, kept too), while the math fallback keeps
the whole [B, H, T, T] softmax, and for grouped-query attention the repeated keys and values.
On an H200 with torch 2.11 an fp32 Llama step with grouped-query heads takes the math fallback
(the memory-efficient kernel has no grouped heads there): 5 GB more than the CPU kernel keeps
for Llama-3.2-3B at (2, 1024).

``CudaAttention`` turns each call into the call of the kernel
``cuda_backend`` chooses by torch's rules, whose fake (meta) kernels then make what it keeps.
The rules are those of torch 2.11 with cuDNN 9.19 on sm90 (H100, H200), measured for every case
of ``benchmarks/attention_backends.py``'s grid; tests/capacity/test_attention.py checks the
choice and the kept bytes against that table. By hand: torch decides this in C++
(``sdp_utils.cpp``) only for CUDA tensors, and a CPU build has no CUDA choice to ask.

``real_masks`` makes a Hugging Face model build the mask an eager run builds (none, here).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

aten = torch.ops.aten

LOW_PRECISION = (torch.float16, torch.bfloat16)


def _cudnn_can(query, key, value, attn_mask, dropout_p) -> bool:
    # torch 2.11's checks on sm90: head sizes up to 256 in steps of 8, for the backward too,
    # and any dropout (newer torch versions narrow both)
    d_qk, d_v = query.shape[-1], value.shape[-1]
    return (
        query.dtype in LOW_PRECISION
        and d_qk <= 256
        and d_v <= 256
        and d_qk % 8 == 0
        and d_v % 8 == 0
        and key.shape[-2] != 1
        and max(query.shape[0], query.shape[1]) <= 65535
    )


def _within_rules(query, key, value, attn_mask, enable_gqa) -> bool:
    """Calls of the shapes the rules were checked on: 4-D operands, a 4-D mask that needs no
    gradient, and key heads other than the query's only with ``enable_gqa``. Any other call is
    planned as the math fallback, the kernel that keeps the most."""
    masked = attn_mask is not None
    return (
        query.dim() == key.dim() == value.dim() == 4
        and not (masked and (attn_mask.dim() != 4 or attn_mask.requires_grad))
        and (enable_gqa or key.shape[-3] == query.shape[-3])
    )


def _flash_can(query, key, value, attn_mask, is_causal) -> bool:
    return (
        query.dtype in LOW_PRECISION
        and attn_mask is None
        and query.shape[-1] == key.shape[-1] == value.shape[-1] <= 256
        and not (is_causal and query.shape[-2] != key.shape[-2])
    )


def _efficient_can(query, key, value, grouped) -> bool:
    # operands aligned for its tensor-core GEMMs: 16 bytes on sm80 and later
    alignment = 8 if query.dtype in LOW_PRECISION else 4
    d_qk, d_v = query.shape[-1], value.shape[-1]
    return not grouped and d_qk == key.shape[-1] and d_qk % alignment == 0 and d_v % alignment == 0


def cuda_backend(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False
) -> str:
    """The kernel (an ``SDPBackend`` name) torch runs this call with on the card: the first of
    cuDNN, flash, memory-efficient and math whose rules the call meets."""
    if not _within_rules(query, key, value, attn_mask, enable_gqa):
        return "MATH"
    grouped = enable_gqa and key.shape[-3] != query.shape[-3]
    if _cudnn_can(query, key, value, attn_mask, dropout_p):
        return "CUDNN_ATTENTION"
    if _flash_can(query, key, value, attn_mask, is_causal):
        return "FLASH_ATTENTION"
    if _efficient_can(query, key, value, grouped):
        return "EFFICIENT_ATTENTION"
    return "MATH"


def _additive(attn_mask, dtype):
    """A boolean mask as the fused kernels take it: 0 where attended, -inf elsewhere."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    blocked = torch.full((), float("-inf"), dtype=dtype, device=attn_mask.device)
    return torch.zeros((), dtype=dtype, device=attn_mask.device).where(attn_mask, blocked)


def run_backend(backend, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The output of ``backend``'s op on these operands (on fake tensors: its meta kernel)."""
    if backend == "CUDNN_ATTENTION":
        bias = _additive(attn_mask, query.dtype)
        return aten._scaled_dot_product_cudnn_attention(
            query, key, value, bias, True, dropout_p, is_causal, False, scale=scale
        )[0]
    if backend == "FLASH_ATTENTION":
        return aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    if backend == "EFFICIENT_ATTENTION":
        bias = _additive(attn_mask, query.dtype)
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, dropout_p, is_causal, scale=scale
        )[0]
    return aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )[0]


def _sdpa_arguments(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class CudaAttention:
    """While entered, each ``F.scaled_dot_product_attention`` call runs as the kernel CUDA would
    choose; the choices are counted in ``backends`` (name -> calls). The function itself is
    replaced, not intercepted by a TorchFunctionMode: a checkpointed block's recomputation runs
    inside the backward, where no such mode is active."""

    def __init__(self):
        self.backends: dict[str, int] = {}
        self._replaced = None

    def __enter__(self):
        self._replaced = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self.attention
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._replaced

    def attention(self, *args, **kwargs):
        query, key, value, mask, dropout_p, is_causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
        device = query.device.type
        if torch.is_autocast_enabled(device):  # CUDA's autocast runs attention in low precision
            low = torch.get_autocast_dtype(device)
            query, key, value = (t.to(low) for t in (query, key, value))
            mask = mask if mask is None or mask.dtype == torch.bool else mask.to(low)
        backend = cuda_backend(query, key, value, mask, dropout_p, is_causal, gqa)
        self.backends[backend] = self.backends.get(backend, 0) + 1
        with torch.autocast(device, enabled=False):
            return run_backend(backend, query, key, value, mask, dropout_p, is_causal, scale, gqa)


@contextlib.contextmanager
def real_masks(hugging_face: bool, graphed: bool):
    """The attention mask a Hugging Face model builds in an eager run on the toolkit's inputs.

    Those inputs are never packed or padded (no attention mask; position ids 0..T-1 in every
    row: ``hf.models.sequence_classification_loss``), which transformers finds by reading the
    position ids, then skips the mask and asks for causal attention (inputs with a padding mask
    would need it planned). A fake tensor has no values to read, so it takes the step for a
    traced one and builds a mask, as a CUDA graph's capture does (``graphed``: left as it is)."""
    if not hugging_face or graphed:
        yield
        return
    from transformers import masking_utils

    packed = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = packed
