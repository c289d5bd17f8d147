"""--noise_sampler for Opacus' trainers: Opacus' own draw (torch.normal, the default: the cost
users pay) or the 64-bit Box-Muller transform flash draws with (noise.laws' "exact64").

Opacus has no hook for its noise: every optimizer we use draws it by calling the module-level
``_generate_noise(std, reference, generator, secure_mode)`` with its own ``self.generator``.
So the choice rides on that generator: an optimizer drawing exact64 holds an Exact64Generator,
and the function installed in Opacus' modules (once, per process) draws exact64 for it and
calls Opacus' own function for any other generator, so every other optimizer, ours or not,
draws exactly as before."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from opacus.optimizers import optimizer as opacus_optimizer

from dp_cost.flash import add_gaussian_noise

NOISE_SAMPLERS = ("opacus", "exact64")
OPACUS_GENERATE_NOISE = opacus_optimizer._generate_noise


@dataclass(frozen=True)
class Exact64Generator:
    """An optimizer's ``generator`` when it draws exact64: the torch generator the draw takes
    its words from (None: the device's default, as Opacus' draw)."""

    words: torch.Generator | None = None


def generate_noise(std, reference, generator=None, secure_mode=False):
    """Opacus' _generate_noise, or the exact64 draw for an Exact64Generator: noise of the
    reference's (unsharded) shape, dtype and device, as Opacus' torch.normal returns it."""
    if not isinstance(generator, Exact64Generator):
        return OPACUS_GENERATE_NOISE(std, reference, generator, secure_mode)
    if secure_mode:
        raise ValueError("--noise_sampler exact64 does not implement Opacus' secure_mode")
    noise = torch.zeros(reference.shape, device=reference.device, dtype=reference.dtype)
    if std != 0:
        add_gaussian_noise([noise], std, generator.words)
    return noise


def draw_with(optimizer, noise_sampler: str) -> str:
    """Make ``optimizer`` (an Opacus DP optimizer) draw its noise with ``noise_sampler``; the
    name of the law it draws from (noise.laws.NOISE_LAWS)."""
    if noise_sampler not in NOISE_SAMPLERS:
        raise ValueError(f"noise_sampler must be one of {NOISE_SAMPLERS}, got {noise_sampler!r}")
    if noise_sampler == "opacus":
        device = optimizer.params[0].device.type if optimizer.params else "cpu"
        return f"torch_{device}"
    # every Opacus module that calls the function by a name of its own (the optimizers' and
    # the privacy engine's: imported by now, as the optimizer is)
    for name, module in list(sys.modules.items()):
        if name.startswith("opacus") and hasattr(module, "_generate_noise"):
            module._generate_noise = generate_noise
    optimizer.generator = Exact64Generator(optimizer.generator)
    return "exact64"
