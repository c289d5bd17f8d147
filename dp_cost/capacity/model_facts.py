"""What a named model is, read without building it on a device: its shape, its exact parameter
count (on the meta device), the least memory a config of it needs and its longest sequence.
The plan's guards read these before any worker starts; --mode=capacity its longest sequence."""

from __future__ import annotations

from dp_cost.core.settings import UsageError
from dp_cost.hf.configs import HF_CONFIGS


def model_shape(model: str, overrides: dict) -> tuple[int, int, int, int]:
    """(vocab, hidden, layers, MLP width) of a named model with its overrides."""
    # torch and opacus: imported once the checks that need neither have passed
    from dp_cost.lm import model as models

    if model in HF_CONFIGS:
        c = HF_CONFIGS[model]
        shape = (c["vocab_size"], c["hidden_size"], c["num_hidden_layers"])
        return (*shape, c["intermediate_size"])
    c = models.get_config(model, **overrides)
    return c.vocab_size, c.hidden_dim, c.num_layers, c.mlp_dim


def parameter_count(model: str, overrides: dict) -> int:
    """How many parameters the model has, counted exactly on a build on the meta device (no
    memory): our LMs with the learned position table of max_seq_len rows; a Hugging Face
    architecture as --mode=hf builds it (a sequence classifier: grouped-query attention's
    smaller k and v, tied embeddings once, no vocabulary head)."""
    from dp_cost.lm import model as models  # torch: see model_shape

    if model not in HF_CONFIGS:
        return models.count_parameters(models.build_model(model, device="meta", **overrides))
    from dp_cost.hf import models as hf_models  # transformers: a Hugging Face model's alone

    return models.count_parameters(hf_models.build_hf_model(model, device="meta")[0])


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
    from dp_cost.lm import model as models  # torch: see model_shape

    if model in HF_CONFIGS:
        return HF_CONFIGS[model]["max_position_embeddings"]
    try:
        return models.get_config(model, attention=attention, **overrides).max_seq_len
    except (ValueError, TypeError) as error:
        known = ", ".join([*models.CONFIGS, *HF_CONFIGS])
        raise UsageError(
            f"{error}"
            if "unknown" not in str(error)
            else f"unknown model {model!r}; known: {known}"
        ) from None
