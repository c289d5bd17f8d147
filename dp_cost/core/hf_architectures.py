"""The Hugging Face architectures this project ships, as plain data (no torch, no download).

``HF_CONFIGS`` holds the public ``config.json`` values of Meta's Llama 3.x checkpoints (base and
-Instruct share one), copied here so nothing is fetched: ``hf.models`` builds them with random
weights. ``tiny-llama`` is the CPU test model on the same code path. In the bottom layer: the
settings table and the reports name these models without importing ``hf/``.
"""

from __future__ import annotations

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
# Planned with --mode=capacity (built on the meta device there); measuring it needs a sharded
# build over several cards.
_LLAMA_3_1_70B = {
    **_LLAMA_3_1_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
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
    "meta-llama/Llama-3.1-70B-Instruct": _LLAMA_3_1_70B,
    "meta-llama/Llama-3.1-70B": _LLAMA_3_1_70B,
    "tiny-llama": _TINY_LLAMA,
}


def default_attention(model: str) -> str:
    """Hugging Face models default to SDPA, the DPMultiheadAttention LM to explicit softmax."""
    return "sdpa" if model in HF_CONFIGS else "explicit"
