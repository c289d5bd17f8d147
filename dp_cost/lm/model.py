"""The causal decoder LM the profiler trains, built from its named configs (``lm.configs``).

gpt-fast style: a dataclass config, a dict of named configs, small modules whose forward
reads like the math. Attention is built on Opacus' ``DPMultiheadAttention`` so every trainable
layer is an ``nn.Linear`` / ``nn.Embedding`` / ``nn.LayerNorm`` that Opacus can clip.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from opacus.layers import DPMultiheadAttention
from torch.utils.checkpoint import checkpoint

from dp_cost.core import recompute
from dp_cost.core.kernel_names import ATTENTION_RANGE

# Re-exported: the configs are plain data (lm/configs.py), read by the plan without torch.
from dp_cost.lm.configs import ATTENTION_KINDS as ATTENTION_KINDS
from dp_cost.lm.configs import CONFIGS as CONFIGS
from dp_cost.lm.configs import ModelConfig as ModelConfig
from dp_cost.lm.configs import get_config as get_config


class CausalSelfAttention(DPMultiheadAttention):
    """Batch-first causal self-attention on Opacus' DPMultiheadAttention layers.

    Opacus 1.6's own ``batch_first=True`` path reshapes the output in the wrong order and
    scrambles heads and positions (opacus#774), and it rejects causal masks. We keep its
    ``nn.Linear`` projections (the only trainable layers, so hooks and ghost clipping see
    ``[B, T, E]`` with batch first) and write the attention itself.
    """

    def __init__(self, embed_dim: int, num_heads: int, attention: str = "explicit", **kwargs):
        super().__init__(embed_dim, num_heads, batch_first=True, **kwargs)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, embed = x.shape
        heads, head_dim = self.num_heads, self.head_dim

        def split_heads(t: torch.Tensor) -> torch.Tensor:  # [B,T,E] -> [B,H,T,Dh]
            return t.view(batch, seq, heads, head_dim).transpose(1, 2)

        q, k, v = (
            split_heads(self.qlinear(x)),
            split_heads(self.klinear(x)),
            split_heads(self.vlinear(x)),
        )
        # The profiler range tells the trace's kernel table which GEMMs are attention (q·kᵀ,
        # probs·v and their backward) and which are projections.
        with torch.profiler.record_function(ATTENTION_RANGE):
            if self.attention == "sdpa":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-2, -1)) * head_dim**-0.5
                causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
                probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
                out = self.dropout(probs) @ v
        out = out.transpose(1, 2).reshape(batch, seq, embed)
        return self.out_proj(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_dim, config.mlp_dim)
        self.fc2 = nn.Linear(config.mlp_dim, config.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_dim)
        self.attn = CausalSelfAttention(
            config.hidden_dim, config.num_heads, config.attention, dropout=config.dropout
        )
        self.ln2 = nn.LayerNorm(config.hidden_dim)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    """Causal decoder LM: (B, T) int64 token ids -> (B, T, V) logits; untied embeddings."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden_dim)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.hidden_dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_dim)
        self.lm_head = nn.Linear(config.hidden_dim, config.vocab_size, bias=False)
        if config.activation_checkpointing:
            recompute.attach(self)  # what a trainer does in a block's forward and recomputation

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, seq = tokens.shape
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} > max_seq_len {self.config.max_seq_len}")
        # Position ids with a batch dim, contiguous: Opacus' embedding grad sampler needs
        # [B, T] ids (a broadcast [1, T] gives per-sample grads of the wrong shape).
        positions = torch.arange(seq, device=tokens.device).expand(batch, seq).contiguous()
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            if self.config.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False, context_fn=self.recompute_contexts)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(
    name_or_config: str | ModelConfig = "tiny",
    device: str | torch.device = "cpu",
    **overrides,
) -> TransformerLM:
    """Build the LM directly on ``device`` (no CPU init + copy: 1B params would double host RAM)."""
    config = get_config(name_or_config, **overrides)
    with torch.device(device):
        model = TransformerLM(config)
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
