"""The causal LM's named configs as plain data (no torch): what ``lm.model`` builds, and what
the plan's checks read before torch is imported (a bad shape is one line in a fraction of a
second): the config of a name with its overrides, and its exact parameter count."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ATTENTION_KINDS = ("explicit", "sdpa")


@dataclass
class ModelConfig:
    vocab_size: int = 32000
    hidden_dim: int = 2048
    num_layers: int = 20
    num_heads: int = 16
    mlp_dim: int = 8192
    max_seq_len: int = 16384
    attention: str = (
        "explicit"  # "explicit" softmax (as the older profiling scripts' model) or "sdpa"
    )
    activation_checkpointing: bool = False  # recompute each block in the backward
    dropout: float = 0.0

    def __post_init__(self):
        for field in ("vocab_size", "hidden_dim", "num_layers", "num_heads", "max_seq_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.hidden_dim % self.num_heads:
            raise ValueError(
                f"hidden_dim {self.hidden_dim} is not divisible by num_heads {self.num_heads}"
            )
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")


CONFIGS: dict[str, ModelConfig] = {
    # ~1M parameters: the CPU test model.
    "tiny": ModelConfig(
        vocab_size=2000, hidden_dim=128, num_layers=2, num_heads=4, mlp_dim=512, max_seq_len=1024
    ),
    # ~1.14B parameters without the position table (32000·2048·2 + 20·50.3M), +33.5M for
    # 16384 positions, so T=16384 memory runs need no override.
    "1b": ModelConfig(),
}


def get_config(name_or_config: str | ModelConfig, **overrides) -> ModelConfig:
    """A named config (or a config object) with non-None overrides applied."""
    if isinstance(name_or_config, ModelConfig):
        base = name_or_config
    elif name_or_config in CONFIGS:
        base = CONFIGS[name_or_config]
    else:
        raise ValueError(f"unknown model {name_or_config!r}; known: {', '.join(CONFIGS)}")
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def parameter_count(config: ModelConfig) -> int:
    """The parameters ``lm.model.TransformerLM`` has for ``config``, counted from its layers
    (a test keeps this equal to a build's count): token and position embeddings, per block two
    LayerNorms, attention's q, k, v and output projections (with biases) and the MLP's two
    Linear layers (with biases), the final LayerNorm and the untied LM head (no bias)."""
    e, m, v = config.hidden_dim, config.mlp_dim, config.vocab_size
    block = 2 * (2 * e) + 4 * (e * e + e) + (e * m + m) + (m * e + e)
    return v * e + config.max_seq_len * e + config.num_layers * block + 2 * e + e * v
