"""FSDP2 over a trainer's model: which modules are its units, and gradients summed (not
averaged) over the ranks."""

from __future__ import annotations

from opacus.utils.fsdp_utils import FSDP2Wrapper
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (the members of the outermost nn.ModuleLists): FSDP's units."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        for block in module:
            blocks.append(block)
            inside.update(id(m) for m in block.modules())
    return blocks


def shard(model: nn.Module, units: str) -> nn.Module:
    """FSDP2 over ``model`` in place, in FSDP_UNITS[units]."""
    return FSDP_UNITS[units](model)


# Blocks whose all-gathers a block's backward starts. FSDP2's default, the next one alone, is
# kept: two (benchmarks/fsdp_buckets.py --backward_prefetch) sped both standard's and flash's
# Llama-3.1-8B steps on 4 H200s by about 2% at 0.7-0.8 GB more peak a rank, and the 1b model's
# not at all, leaving flash / standard where it was.
BACKWARD_PREFETCH_BLOCKS = 1

# Units of a chunk's forward that a trainer whose link idles between a chunk's backward and the
# next chunk's forward (flash reducing every chunk: its clipped sums are made after the
# backward) all-gathers there (forward_units, prefetch_forward); 0: none, each unit's own
# pre-forward gathers it. Two, the root (the embedding and the head: the largest gather) and the
# first block, as measured on Llama-3.1-8B under FSDP2 x 2 (the benchmark index; more went ahead
# of the clipped sums' reduce-scatters on NCCL's stream and were slower; with fsdp_sync
# "logical" any were slower); benchmarks/fsdp_buckets.py --forward_prefetch.
FORWARD_PREFETCH_UNITS = 2


def shard_blocks(model: nn.Module) -> nn.Module:
    """Each transformer block one FSDP2 unit (all-gathered for its forward and backward, then
    resharded), the rest in the root unit; gradients summed over ranks (FSDP2 averages by
    default; the trainers' 1/B is already the global batch's). In the backward each block
    all-gathers the BACKWARD_PREFETCH_BLOCKS blocks before it (1: FSDP2's own choice)."""
    blocks = transformer_blocks(model)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    if BACKWARD_PREFETCH_BLOCKS > 1:
        for i, block in enumerate(blocks):
            earlier = blocks[max(0, i - BACKWARD_PREFETCH_BLOCKS) : i]
            if earlier:
                block.set_modules_to_backward_prefetch(list(reversed(earlier)))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM (NCCL would otherwise use PreMulSum by 1.0, which gloo lacks).
            module.set_force_sum_reduction_for_comms(True)
    return model


def forward_units(model: nn.Module) -> list[FSDPModule]:
    """``model``'s FSDP2 units in the order its forward gathers them: the root, then the blocks
    (module order; the forwards of the models here run their blocks in it)."""
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def prefetch_forward(units: list[FSDPModule]) -> None:
    """Each unit's parameters all-gathered now, asynchronously (FSDPModule.unshard): its own
    pre-forward waits for its gather instead of starting one."""
    for unit in units:
        unit.unshard(async_op=True)


FSDP_UNITS = {
    "blocks": shard_blocks,
    # Opacus' FSDP2 path (ghost clipping): every layer it has a norm sampler for is its own
    # unit (its hooks need that layer's parameters whole); gradients averaged over ranks, as
    # Opacus' FSDP optimizer expects.
    "opacus_layers": FSDP2Wrapper,
}
