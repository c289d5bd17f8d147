"""The tape's phases around a checkpointed block (torch.utils.checkpoint, non-reentrant): its
first forward, which records each layer's edge and an empty holder and keeps no input, and its
recomputation at the start of its backward, which fills the holders (dp_cost.flash.capture).
Each checkpoint call gets its own pair of contexts and its own holders: a module called in two
blocks is recomputed in the backward's order, not the forward's."""

from __future__ import annotations

import contextlib
import functools

import torch

# Tape.phase: a plain forward; a checkpointed block's first forward (edges, no input); its
# recomputation in the backward (inputs only)
PLAIN, FIRST_OF_CHECKPOINTED, RECOMPUTING = range(3)


class BlockPhase:
    """A context in which ``tape`` is in ``phase`` for one checkpointed block (``waiting``: its
    holders by id(layer)); the phase and block before restored on exit."""

    __slots__ = ("tape", "phase", "waiting", "before")

    def __init__(self, tape, phase: int, waiting: dict):
        self.tape, self.phase, self.waiting, self.before = tape, phase, waiting, (PLAIN, {})

    def __enter__(self):
        tape = self.tape
        if self.phase == RECOMPUTING:
            tape.casts = {}  # the casts of the blocks recomputed before: held by records alone
            if tape.group_done is not None:  # the backward of every block after this one ended
                tape.group_done()  # before the phase changes: if it fails, none has
        self.before = tape.phase, tape.waiting
        tape.phase, tape.waiting = self.phase, self.waiting
        if self.phase == FIRST_OF_CHECKPOINTED:
            tape.blocks.append(self.waiting)

    def __exit__(self, *exc_info):
        tape = self.tape
        tape.phase, tape.waiting = self.before
        if self.phase == FIRST_OF_CHECKPOINTED and tape.records and tape.group_done:
            tape.hook_blocks = True


class CountedLeaf(torch.autograd.Function):
    """A managed layer's output in a checkpointed block where nothing before it needs a
    gradient (a leaf: its op saved nothing), unchanged, with an empty tensor saved. torch's
    recomputation runs when a saved tensor of the block is first unpacked and stops after the
    last one the first forward saved (early stop, which spares the block's last GEMM): a save
    after the layer's holder is filled, unpacked in the backward, makes the recomputation run
    and reach the layer in a block where nothing else is saved after it, or nothing at all."""

    @staticmethod
    def forward(ctx, leaf):
        ctx.save_for_backward(leaf.new_empty(0))
        return leaf.view_as(leaf)

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018 (unpacked: the block's recomputation has run)
        return grad


def block_contexts(tape) -> tuple[BlockPhase, BlockPhase]:
    """torch.utils.checkpoint's ``context_fn`` for one checkpoint call: the contexts of the
    block's first forward and of its recomputation, sharing the block's holders."""
    waiting: dict[int, list[list]] = {}
    return BlockPhase(tape, FIRST_OF_CHECKPOINTED, waiting), BlockPhase(tape, RECOMPUTING, waiting)


def each_block(engine, clip, copy_gradients: bool):
    """The tape's group_done for FlashClipping.clip_each_block: ``clip(engine)`` of the blocks
    whose backward has ended, as the next block's recomputation starts."""
    return functools.partial(_drain, engine, clip, copy_gradients)


def _drain(engine, clip, copy_gradients: bool) -> None:
    """The records whose G arrived and whose A is there, clipped (engine.clip_group). Each G is
    copied where ``copy_gradients``: autograd may still pass the tensor on, and a clipped GEMM
    folds c into its G in place. Run inside torch's recomputation: without its autocast and
    grad mode, as after the backward."""
    with torch.no_grad(), _without_autocast():
        ready = engine.take_arrived()
        records, grads = [record for record, _ in ready], [G for _, G in ready]
        del ready
        if copy_gradients:
            for i, G in enumerate(grads):  # one copy at a time, each original let go
                grads[i] = G.clone()
            G = None
        batch = [records, grads]
        del records, grads
        engine.clip_group(batch, clip)


def _without_autocast() -> contextlib.ExitStack:
    """Autocast off on every device type where it is on."""
    stack = contextlib.ExitStack()
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack
