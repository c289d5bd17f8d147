"""Activation checkpointing (--activation_checkpointing) with the DP trainers: each checkpointed
block's forward runs twice (first without keeping its layers' inputs, then recomputed in the
backward), and Opacus' hooks and flash's tape must capture each layer's input once. The update
against brute force on a twin of the model built without checkpointing (fp32, 1e-5): the tiny
LM, physical chunks, flat and per-layer clipping (tests/hf/test_hf_checkpointing.py: tiny Llama
full and LoRA with left padding)."""

import collections
import dataclasses

import pytest
import torch
from test_per_layer_clipping import bound_between_norms, per_layer_reference
from test_trainers import SMALL, make_batch, reference_update, relative_error
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import models
import trainers
from dp_cost.core import recompute
from dp_cost.flash import FlashClipping
from dp_cost.flash.checkpointed import PLAIN, RECOMPUTING

DP_TRAINERS = ["dpsgd", "ghost", "flash"]


def twins(seed=0, **overrides):
    """(checkpointed model, the same weights built without checkpointing)."""
    torch.manual_seed(seed)
    checkpointed = models.build_model(
        dataclasses.replace(SMALL, activation_checkpointing=True, **overrides)
    )
    plain = models.build_model(dataclasses.replace(SMALL, **overrides))
    plain.load_state_dict(checkpointed.state_dict())
    return checkpointed, plain


def waiting(engine) -> list:
    """The holders of flash's tape that no recomputation has filled yet."""
    return [h for block in engine.tape.blocks for holders in block.values() for h in holders]


def nothing_left_captured(model, trainer=None) -> bool:
    """No layer keeps a captured input after the step: a layer captured twice (the first
    forward and the recomputation) would keep one, every step (Opacus' hooks, flash's tape)."""
    engine = getattr(getattr(trainer, "trainer", None), "engine", None)
    if engine is not None:
        tape = engine.tape
        if tape.records or waiting(engine) or any(layer.calls for layer in engine.layers):
            return False
    return not any(getattr(m, "activations", None) for m in model.modules())


def assert_the_next_step_exact(trainer, model, inputs, targets, want):
    """After a failed or interrupted step: the next step's SGD update (lr 0.5) is ``want`` and
    nothing stays captured."""
    for p in model.parameters():
        p.grad = None
    trainer.step(inputs, targets)
    got = -0.5 * torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    assert relative_error(got, want) < 1e-5
    assert nothing_left_captured(model, trainer)


@pytest.mark.parametrize("physical", [None, 2])
@pytest.mark.parametrize("name", DP_TRAINERS)
def test_dp_trainers_under_checkpointing_match_brute_force(name, physical):
    model, plain = twins(max_seq_len=64)
    assert recompute.recompute_contexts(model) is not None
    assert recompute.recompute_contexts(plain) is None
    inputs, targets = make_batch(5, 40)  # longer sequences than the blocks' width
    _, norms = reference_update(plain, inputs, targets, 1.0, 0.5)
    max_grad_norm = norms.median().item()
    want, _ = reference_update(plain, inputs, targets, max_grad_norm, 0.5)
    trainer = trainers.make_trainer(
        name, model, lr=0.5, batch_size=5, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
        max_physical_batch_size=physical,
    )  # fmt: skip
    trainer.step(inputs, targets)
    got = -0.5 * torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    assert relative_error(got, want) < 1e-5
    assert nothing_left_captured(model, trainer)


@pytest.mark.parametrize("name", ["dpsgd", "flash"])
def test_per_layer_clipping_under_checkpointing_matches_brute_force(name):
    model, plain = twins(max_seq_len=64)
    inputs, targets = make_batch(5, 9)
    max_grad_norm = bound_between_norms(plain, inputs, targets)
    want, _, clipped = per_layer_reference(plain, inputs, targets, max_grad_norm, 0.5)
    trainer = trainers.make_trainer(
        name, model, lr=0.5, batch_size=5, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
        max_physical_batch_size=2, clipping="per_layer",
    )  # fmt: skip
    trainer.step(inputs, targets)
    got = -0.5 * torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    assert relative_error(got, want) < 1e-5
    record = trainer.trainer.privacy.clipping_record()
    assert [p["clipped_samples"] for p in record["parameters"]] == clipped.tolist()
    assert nothing_left_captured(model, trainer)


def test_checkpointing_captures_each_layer_once_per_recomputed_forward():
    """The first forward of a checkpointed block captures nothing; its recomputation captures
    each layer's input once (counted by Opacus' own counter of captures not yet used)."""
    model, _ = twins()
    trainer = trainers.make_trainer(
        "dpsgd", model, lr=0.5, batch_size=4, max_grad_norm=1.0, noise_multiplier=0.0
    )
    wrapped = trainer.trainer.wrapped
    inputs, targets = make_batch(4, 8)
    captured_in_forward = []
    for name, module in model.named_modules():
        if name.startswith("blocks.") and list(module.parameters(recurse=False)):
            module.register_forward_hook(
                lambda m, i, o, name=name: captured_in_forward.append(
                    (name, len(getattr(m, "activations", [])), wrapped.hooks_enabled)
                )
            )
    trainer.step(inputs, targets)
    first = [c for c in captured_in_forward if not c[2]]  # the first forward: capture off
    again = [c for c in captured_in_forward if c[2]]  # the recomputation: capture on
    assert first and len(first) == len(again)
    assert all(count == 0 for _, count, _ in first)
    assert all(count == 1 for _, count, _ in again)  # Opacus' hook ran first: one, not two
    assert nothing_left_captured(model)


def flash_on(model):
    """A FlashClipping engine on ``model``, given the model's checkpoint contexts (as flash's
    trainer does)."""
    return FlashClipping(model, checkpointed=recompute.recompute_contexts(model))


def test_flash_keeps_each_input_once_from_the_recomputation():
    """The first forward of a checkpointed block keeps no input of its layers (only the layers
    outside the blocks keep theirs); the recomputation gives each layer's call its input once:
    one call and one route per layer call, and the per-sample norms of the model built
    without checkpointing. Long sequences (the Gram route) and a padded batch of one."""
    model, plain = twins(max_seq_len=256)
    checkpointed, reference = flash_on(model), flash_on(plain)
    block_modules = {id(m) for m in model.blocks.modules()}
    for inputs, targets in (make_batch(3, 200), make_batch(1, 7)):
        losses = []
        for net in (model, plain):
            logits = net(inputs)
            losses.append(
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), targets.flatten(), reduction="sum"
                )
            )
        kept = list(checkpointed.kept_tensors())
        assert kept and not any(id(module) in block_modules for module, _, _ in kept)
        assert len(waiting(checkpointed)) == sum(
            1 for layer in checkpointed.layers if id(layer.module) in block_modules
        )
        for engine, loss in zip((checkpointed, reference), losses, strict=True):
            engine.backward(loss)
        assert not waiting(checkpointed)  # every holder taken, once
        assert checkpointed.routes() == reference.routes()
        got, want = (e.per_sample_squared_norms() for e in (checkpointed, reference))
        assert torch.allclose(got, want, rtol=1e-5)
        for engine in (checkpointed, reference):
            engine.release()


def test_per_layer_flash_clips_each_block_as_its_backward_ends():
    """Per-layer clipping of a checkpointed model: each block's clipped sums are made when the
    next block's recomputation starts, so what flash holds then is one block's calls (and the
    layers after the blocks, with the first group), never two blocks' and never the whole
    model's; the update is
    brute force's (test above). A module called in two checkpointed blocks is refused (clipped
    in parts, its gradient's norm would be wrong)."""
    model, plain = twins(max_seq_len=64)
    inputs, targets = make_batch(4, 30)
    max_grad_norm = bound_between_norms(plain, inputs, targets)
    trainer = trainers.make_trainer(
        "flash", model, lr=0.5, batch_size=4, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
        clipping="per_layer",
    )  # fmt: skip
    engine = trainer.trainer.engine
    block_of = {
        id(module): index for index, block in enumerate(model.blocks) for module in block.modules()
    }
    groups = []
    real = trainer.trainer.clip_block

    def clip_block(engine, finish=False):
        held = {layer.name for layer in engine.layers if layer.calls or layer.per_sample}
        blocks = {block_of.get(id(ly.module)) for ly in engine.layers if ly.name in held}
        groups.append((finish, held, blocks))
        real(engine, finish)

    trainer.trainer.clip_block = clip_block
    engine.clip_each_block(clip_block)
    trainer.step(inputs, targets)
    in_backward = [blocks for finish, _, blocks in groups if not finish]
    assert len(in_backward) >= len(model.blocks) - 1
    assert all(len(blocks - {None}) <= 1 for blocks in in_backward)
    seen = [block for blocks in in_backward for block in blocks - {None}]
    assert sorted(seen) == list(range(1, len(model.blocks)))  # each once, the first's later
    last = groups[-1]
    assert last[0] and last[2] - {None} == {0}  # the first block's, and the embeddings'
    assert "lm_head" in groups[0][1] and "lm_head" not in last[1]  # the head's, first
    assert nothing_left_captured(model, trainer)

    shared, _ = twins(max_seq_len=64)
    shared.blocks[1].mlp = shared.blocks[0].mlp  # one module in two checkpointed blocks
    trainer = trainers.make_trainer(
        "flash", shared, lr=0.5, batch_size=4, max_grad_norm=1.0, clipping="per_layer"
    )
    with pytest.raises(ValueError, match="called in two checkpointed blocks"):
        trainer.step(inputs, targets)


def test_two_backwards_give_the_norms_twice_and_hold_no_input_between_them():
    """Flat clipping of a checkpointed model: the first backward's per-sample norms, summed
    over the blocks' groups, are those of the model built without checkpointing; between the
    two backwards no recomputed input is held (only what rearm() needs: holders, emptied);
    the second backward, its blocks recomputed again, gives the same norms."""
    model, plain = twins(max_seq_len=64)
    engine, reference = flash_on(model), flash_on(plain)
    inputs, targets = make_batch(3, 40)
    groups = []
    engine.clip_each_block(lambda e: groups.append(e.per_sample_squared_norms()))

    def loss_of(net):
        logits = net(inputs)
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), reduction="sum"
        )

    loss = loss_of(model)
    reference.backward(loss_of(plain))
    want = reference.per_sample_squared_norms()
    engine.backward(loss, retain_graph=True)
    assert len(groups) >= len(model.blocks) - 1  # each block's as its backward ended
    first = sum(groups) + engine.per_sample_squared_norms()
    assert torch.allclose(first, want, rtol=1e-5)
    _, hooked, entries, _ = engine._replay
    holders = [r[1] for r in entries + engine._replay[0] if r is not None and type(r[1]) is list]
    assert holders and not any(holders)  # no recomputed input held until the second backward
    assert not engine.tape.casts
    engine.rearm()
    groups.clear()
    engine.backward(loss)
    assert torch.allclose(sum(groups) + engine.per_sample_squared_norms(), want, rtol=1e-5)


def test_an_interrupted_checkpointed_chunk_leaves_nothing_kept():
    """A forward whose backward never comes (an interrupted chunk), then release(): nothing is
    kept, and the next step matches brute force; a recomputation with no forward waiting (a
    second backward through one graph) is refused."""
    model, plain = twins(max_seq_len=64)
    engine = flash_on(model)
    inputs, targets = make_batch(4, 9)
    model(inputs).sum()  # the forward of a chunk whose backward never comes
    assert waiting(engine)
    engine.release()
    assert not engine.tape.blocks and not engine.tape.records
    assert not list(engine.kept_tensors())
    engine.remove()
    _, norms = reference_update(plain, inputs, targets, 1.0, 0.5)
    max_grad_norm = norms.median().item()
    want, _ = reference_update(plain, inputs, targets, max_grad_norm, 0.5)
    trainer = trainers.make_trainer(
        "flash", model, lr=0.5, batch_size=4, max_grad_norm=max_grad_norm, noise_multiplier=0.0
    )
    with pytest.raises(KeyboardInterrupt):  # interrupted in the backward, inside a recomputation
        real = model.blocks[0].forward

        def interrupted(*args, **kwargs):
            if trainer.trainer.engine.tape.phase == RECOMPUTING:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        model.blocks[0].forward = interrupted
        try:
            trainer.step(inputs, targets)
        finally:
            del model.blocks[0].forward
    assert trainer.trainer.engine.tape.phase == PLAIN  # the contexts restored it
    assert_the_next_step_exact(trainer, model, inputs, targets, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_flash_under_checkpointing_on_cuda_in_bf16_and_graphed(clipping):
    """On CUDA: the checkpointed model's flash update in bf16 autocast is the one flash makes
    without checkpointing (long sequences: the Gram route and the fused kernels; the first
    forward casts inside each op, the recomputation once per shared input), and the step a CUDA
    graph replays, checkpointed, is the brute-force update (fp32)."""
    cuda = torch.device("cuda")
    model, plain = (m.to(cuda) for m in twins(max_seq_len=512, attention="sdpa"))
    inputs, targets = (t.to(cuda) for t in make_batch(4, 400))
    updates = []
    for net in (model, plain):
        trainer = trainers.make_trainer(
            "flash", net, lr=0.5, batch_size=4, max_grad_norm=1e-3, noise_multiplier=0.0,
            dtype=torch.bfloat16, clipping=clipping, max_physical_batch_size=2,
        )  # fmt: skip
        trainer.step(inputs, targets)
        updates.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]).double())
        trainer.trainer.engine.remove()
        for p in net.parameters():
            p.grad = None
    assert relative_error(updates[0], updates[1]) < 1e-2
    _, norms = reference_update(plain, inputs[:, :64], targets[:, :64], 1.0, 0.5)
    max_grad_norm = norms.median().item()
    trainer = trainers.make_trainer(
        "flash", model, lr=0.5, batch_size=4, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
        cuda_graph=True, clipping="flat", max_physical_batch_size=2,
    )  # fmt: skip
    batches = [make_batch(4, 64, seed=s) for s in range(3)]
    for step, (inputs, targets) in enumerate(batches):
        inputs, targets = inputs.to(cuda), targets.to(cuda)
        plain.load_state_dict(model.state_dict())
        want, _ = reference_update(plain, inputs, targets, max_grad_norm, 0.5)
        trainer.step(inputs, targets)  # eager, then captured and replayed
        got = -0.5 * torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        assert relative_error(got, want) < 1e-4, step
    assert trainer.graphs.graphs is not None and trainer.graphs.error is None


def test_frozen_embeddings_under_checkpointing():
    """The first block's first layers read an input that needs no gradient (the embeddings
    frozen): their output is a leaf in the first forward, and so in the recomputation (which
    must save what the first forward saved); the norms are those of the model built without
    checkpointing."""
    model, plain = twins(max_seq_len=64)
    for net in (model, plain):
        net.tok_emb.requires_grad_(False)
        net.pos_emb.requires_grad_(False)
    checkpointed, reference = flash_on(model), flash_on(plain)
    inputs, targets = make_batch(3, 20)
    for engine, net in ((checkpointed, model), (reference, plain)):
        logits = net(inputs)
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), reduction="sum"
        )
        engine.backward(loss)
    got, want = (e.per_sample_squared_norms() for e in (checkpointed, reference))
    assert torch.allclose(got, want, rtol=1e-5)


class LeafBlockNet(torch.nn.Module):
    """A fixed table of token vectors (a buffer: nothing before the block needs a gradient),
    then a block whose one managed layer reads them (its output a leaf, its op saving nothing)
    and adds its input (saving nothing): flash's is the block's only saved tensor.
    Checkpointed or not."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.register_buffer("table", torch.randn(11, 6))
        self.inner = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11)
        self.checkpointed = checkpointed
        if checkpointed:
            recompute.attach(self)

    def block(self, x):
        return self.inner(x) + x

    def forward(self, ids):
        x = self.table[ids]
        if self.checkpointed:
            contexts = recompute.recompute_contexts(self)
            x = checkpoint(self.block, x, use_reentrant=False, context_fn=contexts)
        else:
            x = self.block(x)
        return self.head(x)


def test_a_block_that_saves_nothing_but_its_leaf_layer_is_recomputed_and_clipped():
    """torch recomputes a block when the backward first unpacks one of its saved tensors and
    stops after the last one its first forward saved. A block whose only managed layer reads
    an input that needs no gradient saves nothing of its own: flash's counted leaf makes the
    recomputation run and reach it, and the norms are those of the model built without
    checkpointing."""
    torch.manual_seed(4)
    model, plain = LeafBlockNet(True), LeafBlockNet(False)
    plain.load_state_dict(model.state_dict())
    checkpointed, reference = flash_on(model), flash_on(plain)
    ids, targets = torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (3, 5))
    for engine, net in ((checkpointed, model), (reference, plain)):
        loss = torch.nn.functional.cross_entropy(
            net(ids).flatten(0, 1), targets.flatten(), reduction="sum"
        )
        engine.backward(loss)
    assert not waiting(checkpointed)
    got, want = (e.per_sample_squared_norms() for e in (checkpointed, reference))
    assert torch.allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_flash_steps_on_a_block_that_saves_nothing_but_its_leaf_layer_match_brute_force(
    clipping,
):
    """The block of the test above through flash's trainer, in chunks of 2: flat clipping's
    two backwards (the block recomputed in each) and per-layer clipping's block-by-block
    sums, against brute force on the model built without checkpointing."""
    torch.manual_seed(6)
    model, plain = LeafBlockNet(True), LeafBlockNet(False)
    plain.load_state_dict(model.state_dict())
    ids, targets = torch.randint(0, 11, (5, 4)), torch.randint(0, 11, (5, 4))
    reference = reference_update if clipping == "flat" else per_layer_reference
    want = reference(plain, ids, targets, 0.05, 0.5)[0]
    trainer = trainers.make_trainer(
        "flash", model, lr=0.5, batch_size=5, max_grad_norm=0.05, noise_multiplier=0.0,
        max_physical_batch_size=2, clipping=clipping,
    )  # fmt: skip
    trainer.step(ids, targets)
    got = -0.5 * torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    assert relative_error(got, want) < 1e-5
    assert nothing_left_captured(model, trainer)


class Counted(TorchDispatchMode):
    """The aten ops run below autograd, counted by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("clipping, backwards", [("flat", 2), ("per_layer", 1)])
def test_flash_recomputation_stops_after_the_last_saved_tensor(clipping, backwards):
    """torch's early stop: the recomputation of a block ends once the last tensor its first
    forward saved is saved again, so each block's last Linear (fc2: its output only feeds the
    residual sum) is not run again. A flash step under checkpointing runs one addmm a block per
    Linear but fc2 per backward (flat clipping: two) more than the same step without."""
    counts = []
    for checkpointed in (True, False):
        torch.manual_seed(0)
        model = models.build_model(
            dataclasses.replace(SMALL, activation_checkpointing=checkpointed)
        )
        trainer = trainers.make_trainer(
            "flash", model, lr=0.5, batch_size=3, max_grad_norm=1.0, noise_multiplier=0.0,
            clipping=clipping,
        )  # fmt: skip
        with Counted() as counted:
            trainer.step(*make_batch(3, 8))
        counts.append(counted.counts["aten.addmm.default"])
    linears = [m for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)]
    assert counts[0] - counts[1] == backwards * len(model.blocks) * (len(linears) - 1)


def test_a_failed_second_backward_leaves_the_next_step_exact():
    """Flat clipping's second backward fails (say, out of memory): the next step starts from
    nothing (no factors of the failed step) and matches brute force."""
    model, plain = twins(max_seq_len=64)
    inputs, targets = make_batch(4, 9)
    _, norms = reference_update(plain, inputs, targets, 1.0, 0.5)
    max_grad_norm = norms.median().item()
    want, _ = reference_update(plain, inputs, targets, max_grad_norm, 0.5)
    trainer = trainers.make_trainer(
        "flash", model, lr=0.5, batch_size=4, max_grad_norm=max_grad_norm, noise_multiplier=0.0
    )
    engine = trainer.trainer.engine
    backwards = []

    def failing_second(loss, retain_graph=False):
        backwards.append(retain_graph)
        if len(backwards) == 2:  # the second backward, its clip factors already set
            raise RuntimeError("CUDA out of memory (a stand-in)")
        type(engine).backward(engine, loss, retain_graph)

    engine.backward = failing_second
    with pytest.raises(RuntimeError, match="stand-in"):
        trainer.step(inputs, targets)
    del engine.backward
    assert backwards == [True, False]
    assert trainer.trainer.chunk_factors is None and trainer.trainer.chunk_sink is None
    for p in model.parameters():
        p.grad = None
    plain.load_state_dict(model.state_dict())  # the failed step moved nothing
    trainer.step(inputs, targets)
    got = -0.5 * torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    assert relative_error(got, want) < 1e-5
    assert nothing_left_captured(model, trainer)


def test_removing_the_engine_takes_its_contexts_off_the_model():
    model, _ = twins()
    engine = flash_on(model)
    contexts = recompute.recompute_contexts(model)
    assert contexts.make == engine.checkpoint_contexts
    engine.remove()
    first, again = contexts()
    assert type(first).__name__ == type(again).__name__ == "nullcontext"


def test_a_failure_while_a_block_is_clipped_leaves_the_tape_plain():
    """The block-by-block work runs as a recomputation starts; when it fails (say, out of
    memory in a clipped sum), torch exits no context: the tape is left in no checkpointed
    phase, and the next step runs and matches brute force."""
    model, plain = twins(max_seq_len=64, num_layers=3)
    inputs, targets = make_batch(4, 9)
    max_grad_norm = bound_between_norms(plain, inputs, targets)
    want, _, _ = per_layer_reference(plain, inputs, targets, max_grad_norm, 0.5)
    trainer = trainers.make_trainer(
        "flash", model, lr=0.5, batch_size=4, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
        clipping="per_layer",
    )  # fmt: skip
    engine, real = trainer.trainer.engine, trainer.trainer.clip_block
    calls = []

    def failing_once(engine, finish=False):
        calls.append(finish)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (a stand-in)")
        real(engine, finish)

    engine.clip_each_block(failing_once)
    with pytest.raises(RuntimeError, match="stand-in"):
        trainer.step(inputs, targets)
    engine.clip_each_block(real)
    assert engine.tape.phase == PLAIN
    assert_the_next_step_exact(trainer, model, inputs, targets, want)
