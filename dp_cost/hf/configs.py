"""What the Hugging Face task takes as plain data (no torch): token ids, labels, LoRA's target
modules, attention implementations. The architectures themselves are
``core.hf_architectures.HF_CONFIGS``. Token ids: ``PAD_TOKEN_ID`` 0 and ``SEP_TOKEN_ID`` 1 for
every config (Llama 3 ships no pad id); data tokens are drawn from [2, vocab).
"""

from __future__ import annotations

# Re-exported: measure/'s capacity modules read the architectures from here.
from dp_cost.core.hf_architectures import HF_CONFIGS as HF_CONFIGS

PAD_TOKEN_ID = 0
SEP_TOKEN_ID = 1
FIRST_CONTENT_ID = 2  # data tokens are drawn from [FIRST_CONTENT_ID, vocab_size)
NUM_LABELS = 3  # SNLI: 0 entailment, 1 neutral, 2 contradiction
SNLI_LABELS = {"entailment": 0, "neutral": 1, "contradiction": 2}
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_IMPLEMENTATIONS = {"sdpa": "sdpa", "eager": "eager", "explicit": "eager"}

DEFAULT_HF_MODEL = "meta-llama/Llama-3.2-3B-Instruct"


def classifier_parameter_count(name: str, num_labels: int = NUM_LABELS) -> int:
    """The parameters of ``name``'s sequence classifier as ``hf.models`` builds it, counted from
    its architecture without building it (a test keeps this equal to a build's count): the
    token embeddings, per layer the attention's q and o projections and grouped-query
    attention's smaller k and v (no biases), the gated MLP's three projections and two RMSNorms,
    the final RMSNorm and the ``num_labels`` score head; no vocabulary head."""
    c = HF_CONFIGS[name]
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * c["num_key_value_heads"] * head_dim
    layer = attention + 3 * hidden * c["intermediate_size"] + 2 * hidden
    body = c["vocab_size"] * hidden + c["num_hidden_layers"] * layer + hidden
    return body + hidden * num_labels
