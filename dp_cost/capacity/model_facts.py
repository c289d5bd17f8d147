"""What a named model is, read without building it: its shape, its exact parameter count, the
least memory a config of it needs and its longest sequence. Torch-free (plain data:
``lm.configs``, ``hf.configs``): the plan's guards read these before torch is imported, so a
bad shape is one line in a fraction of a second; --mode=capacity reads its longest sequence."""

from __future__ import annotations

from dp_cost.core.settings import UsageError
from dp_cost.hf.configs import HF_CONFIGS, classifier_parameter_count
from dp_cost.lm import configs as lm_configs


def lm_config(model: str, **overrides) -> lm_configs.ModelConfig:
    """The named LM's config with its overrides (UsageError, one line, for an unknown name or
    a shape the LM cannot take)."""
    try:
        return lm_configs.get_config(model, **overrides)
    except (ValueError, TypeError) as error:
        known = ", ".join([*lm_configs.CONFIGS, *HF_CONFIGS])
        unknown = "unknown" in str(error)
        message = f"unknown model {model!r}; known: {known}" if unknown else str(error)
        raise UsageError(message) from None


def model_shape(model: str, overrides: dict) -> tuple[int, int, int, int]:
    """(vocab, hidden, layers, MLP width) of a named model with its overrides."""
    if model in HF_CONFIGS:
        c = HF_CONFIGS[model]
        shape = (c["vocab_size"], c["hidden_size"], c["num_hidden_layers"])
        return (*shape, c["intermediate_size"])
    c = lm_config(model, **overrides)
    return c.vocab_size, c.hidden_dim, c.num_layers, c.mlp_dim


def parameter_count(model: str, overrides: dict) -> int:
    """How many parameters the model has, exactly: our LMs with the learned position table of
    max_seq_len rows; a Hugging Face architecture as --mode=hf builds it (a sequence
    classifier: grouped-query attention's smaller k and v, tied embeddings once, no vocabulary
    head)."""
    if model in HF_CONFIGS:
        return classifier_parameter_count(model)
    return lm_configs.parameter_count(lm_config(model, **overrides))


def bytes_lower_bound(model, overrides, physical_batch, seq_len, dataset_size) -> int:
    """Bytes a config needs at the least: fp32 parameters, one hidden state per layer, the LM's
    logits, the HF task's synthetic dataset. Python integers: no overflow, however large."""
    vocab, hidden, layers, _ = model_shape(model, overrides)
    tokens = physical_batch * seq_len
    hf = model in HF_CONFIGS  # a sequence classifier: no vocabulary-wide logits
    activations = tokens * (hidden * layers + (0 if hf else vocab))
    dataset = 8 * dataset_size * seq_len if hf else 0
    return 4 * (parameter_count(model, overrides) + activations) + dataset


def model_max_seq_len(model: str, attention: str, overrides: dict) -> int:
    """The longest sequence the named model takes (UsageError for an unknown name)."""
    if model in HF_CONFIGS:
        return HF_CONFIGS[model]["max_position_embeddings"]
    return lm_config(model, attention=attention, **overrides).max_seq_len
