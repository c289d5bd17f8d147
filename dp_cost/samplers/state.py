"""Where Opacus keeps the state it adds to a model, for the memory breakdown and the census:
the attributes it sets, and the functions (by package and name) that allocate it (Opacus'
registries hold one function per layer type, so names are stable where file paths are not)."""

from dp_cost.core.schema import AllocationSite
from dp_cost.samplers import embedding

# (role, "parameter" or "module", attribute) of what Opacus attaches.
OPACUS_ATTRIBUTES = (
    ("per_sample_gradients", "parameter", "grad_sample"),  # hooks mode
    ("norm_samples", "parameter", "_norm_sample"),  # ghost mode
    ("activation_hooks", "module", "activations"),  # saved layer inputs
    ("norm_samples", "module", "norm_sample"),  # ghost mode under FSDP2
    ("gradients", "parameter", "summed_grad"),  # clipped sums over physical chunks
)

OPACUS_SITES = (
    # Ghost clipping's B x T x T ggT/aaT and Opacus' rescaled copies of each layer's output
    # gradient (B x T x p, made for the norm or per-sample computation).
    AllocationSite("temp_matrices", "norm_sample", package="opacus.grad_sample"),
    AllocationSite("temp_matrices", "^rearrange_grad_samples", package="opacus.grad_sample"),
    AllocationSite("norm_samples", "^(get_clipping_coef|get_norm_)"),
    # Per-sample gradients and their clipped copies in the optimizer.
    AllocationSite(
        "per_sample_gradients",
        r"^(compute_\w+_grad_sample|create_or_accumulate_grad_sample)",
        package="opacus.grad_sample",
    ),
    AllocationSite("per_sample_gradients", "^clip", package="opacus.optimizers"),
    AllocationSite("gradients", "", package="opacus.optimizers"),  # summed, noised
    # The masked copy of the output gradient made by our embedding samplers (the per-sample
    # gradients themselves come from the stock samplers they call, matched above).
    AllocationSite.of("temp_matrices", embedding.without_padding),
)
