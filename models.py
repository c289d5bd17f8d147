"""The causal LM the profiler trains, as the contract names it: ``models.build_model``,
``models.get_config``, ``models.CONFIGS``. It lives in ``dp_cost.lm.model``; this module
re-exports it for the scripts and notebooks that import ``models``."""

from dp_cost.lm.model import (
    ATTENTION_KINDS,
    CONFIGS,
    MLP,
    Block,
    CausalSelfAttention,
    ModelConfig,
    TransformerLM,
    build_model,
    count_parameters,
    get_config,
)

__all__ = [
    "ATTENTION_KINDS",
    "MLP",
    "CONFIGS",
    "Block",
    "CausalSelfAttention",
    "ModelConfig",
    "TransformerLM",
    "build_model",
    "count_parameters",
    "get_config",
]
