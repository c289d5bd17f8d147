"""FlashClipping's book-keeping: its tape, chunks, reused modules, what it keeps and frees, and
when it refuses; numbers checked against per-sample brute force with autograd."""

import copy
import os
import weakref

import pytest
import torch
import torch.nn.functional as F
from flash_reference import (
    RecordingSink,
    assert_close,
    brute_force,
    brute_force_at_median,
    flash_step,
    flat_grads,
    make_batch,
    make_model,
    per_sample_grads_of,
    sample_losses,
)
from torch import nn

from dp_cost.flash import clip
from dp_cost.flash.clip import clip_per_sample, squared_row_norms_many
from dp_cost.flash.engine import FlashClipping, UnsupportedLayerError


@pytest.mark.parametrize("B", [1, 3])
def test_large_kept_per_sample_grads_match_brute_force(monkeypatch, B):
    """Kept per-sample gradients above SMALL_PER_SAMPLE_NUMEL (the 1b model's product-route
    weights) are clip-summed one by one, not batched: with the threshold at 0 every kept one
    (weights, biases, norm layers) takes that path."""
    from dp_cost.flash import engine as flash_clip

    monkeypatch.setattr(flash_clip, "SMALL_PER_SAMPLE_NUMEL", 0)
    model = make_model()
    reference = copy.deepcopy(model)
    ids, targets = make_batch(B, 5, seed=B)
    ref_norms = brute_force(reference, ids, targets)[0]
    max_norm = ref_norms.min() * 0.9  # every sample clipped
    _, _, ref_sum = brute_force(reference, ids, targets, max_norm)
    flash = FlashClipping(model, route="product")
    norms, _ = flash_step(flash, model, ids, targets, max_norm)
    assert_close(norms, ref_norms, 1e-9)
    assert_close(flat_grads(model), ref_sum, 1e-9)


@pytest.mark.parametrize("B", [1, 3])
def test_squared_row_norms_many_sums_every_tensor_per_sample_per_dtype(B):
    """The large kept per-sample gradients' norms: one launch per dtype over tensors of unequal
    shapes (on the CPU a multi-tensor norm; CUDA: flash.kernels.squared_row_norms_many), a term
    per dtype (each in its accumulation dtype), equal to brute force."""
    gen = torch.Generator().manual_seed(B)
    shapes = [(B, 7, 5), (B, 3), (B, 70000), (B, 2, 2, 2)]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads += [
        torch.randn(s, generator=gen).to(dtype)
        for s in shapes
        for dtype in (torch.float32, torch.bfloat16)
    ]
    terms = squared_row_norms_many(grads)
    assert [t.dtype for t in terms] == [torch.float64, torch.float32, torch.float32]
    expected = sum(g.double().flatten(1).square().sum(1) for g in grads)
    assert_close(sum(t.double() for t in terms), expected, 1e-6)


@pytest.mark.parametrize("kernel", [False, True])
def test_squared_row_norms_each_gives_each_tensor_its_own_norms(monkeypatch, kernel):
    """Per-layer clipping's norms of kept per-sample gradients: one [B] per tensor, in order,
    by the CPU's reductions or (kernel: the CUDA path, interpreted, its check widened to CPU
    tensors) one launch per dtype whose partials are summed per tensor; mixed dtypes and
    shapes, samples scaled apart so a row or tensor mixed up with another shows."""
    if kernel:
        kernels = pytest.importorskip("dp_cost.flash.kernels", reason="needs triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the kernel is interpreted on the CPU only")
        monkeypatch.setattr(clip, "triton_kernels", lambda: kernels)
        monkeypatch.setattr(
            kernels, "weighted_sums_supported_each", lambda pairs: [True] * len(pairs)
        )
    gen = torch.Generator().manual_seed(9)
    scale = torch.tensor([1.0, 30.0, 0.01])
    shapes = [(3, 7, 5), (3, 1), (3, 1500), (3, 2, 2, 2)]
    grads = [
        (torch.randn(s, generator=gen) * scale.view(3, *[1] * (len(s) - 1))).to(dtype)
        for s in shapes
        for dtype in (torch.float32, torch.float16)
    ]
    for asked in (grads, grads[::2]):  # two dtypes; one (the kernel's rows as they come)
        terms = clip.squared_row_norms_each(asked)
        assert terms.shape == (len(asked), 3)
        for term, grad in zip(terms, asked, strict=True):
            assert_close(term.double(), grad.double().flatten(1).square().sum(1), 1e-6)


@pytest.mark.parametrize("route", ["gram", "product"])
@pytest.mark.parametrize("B", [1, 3])
def test_biases_formed_after_the_backward_in_one_launch_match_brute_force(monkeypatch, B, route):
    """Gram-route Linear biases get their per-sample gradients right after the backward from the
    kept G, every layer's in one token-sums launch (a CUDA path: here the kernel interpreted and
    its support check widened to CPU tensors), fp32 norms and clipped sums against brute force.
    The up layer's weight is frozen: nothing needs its A and G after its bias is formed (in the
    same launch as head's), so they are dropped then; head's weight still needs them. On the
    product route head's bias goes in that launch too, beside its weight's per-sample GEMM."""
    kernels = pytest.importorskip("dp_cost.flash.kernels", reason="needs triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU kernels are interpreted only where there is no GPU")
    launches, token_sums = [], kernels.token_sums_many
    monkeypatch.setattr(
        kernels,
        "token_sums_supported_many",
        lambda sources: [G.dim() == 3 and G.dtype == torch.float32 for G in sources],
    )
    monkeypatch.setattr(
        kernels,
        "token_sums_many",
        lambda sources: launches.append(len(sources)) or token_sums(sources),
    )
    model = make_model(dtype=torch.float32)
    model.up.weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    ids, targets = make_batch(B, 9, seed=B + 7)
    trained = [p for p in reference.parameters() if p.requires_grad]
    per_sample = torch.stack(
        [
            torch.cat([g.flatten() for g in torch.autograd.grad(loss, trained)])
            for loss in (
                sample_losses(reference(ids[b : b + 1]), targets[b : b + 1]).sum() for b in range(B)
            )
        ]
    )
    ref_norms = per_sample.norm(dim=1)
    max_norm = ref_norms.median()
    ref_sum = ((max_norm / (ref_norms + 1e-6)).clamp(max=1.0)[:, None] * per_sample).sum(0)
    flash = FlashClipping(model, route=route, tile_size=4)
    flash.backward(sample_losses(model(ids), targets).sum())
    assert launches == [2]  # up's and head's biases in one launch; down has none
    kept = {(module, role) for module, role, _ in flash.kept_tensors()}
    assert (model.up, "activation_hooks") not in kept
    # its weight still needs A and G on the Gram route; the product route formed it already
    assert ((model.head, "activation_hooks") in kept) == (route == "gram")
    norms = flash.per_sample_squared_norms().sqrt()
    flash.accumulate_clipped_grads((max_norm / (norms + 1e-6)).clamp(max=1.0))
    flash.release()
    assert_close(norms, ref_norms, 1e-5)
    names = [n for n, p in reference.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    assert_close(torch.cat([params[n].grad.flatten() for n in names]), ref_sum, 1e-5)


def test_accumulate_many_gives_each_parameter_its_sum():
    """Small parameters' clipped sums from one flat buffer: a first chunk's .grad holds exactly
    its slice, in its own storage (the memory census counts storages whole, by owner) and in
    the parameter's dtype, a second chunk's adds to it, and an optimizer step reads them."""
    from dp_cost.flash.clip import accumulate_many

    torch.manual_seed(0)
    params = [
        nn.Parameter(torch.randn(3, 4)),
        nn.Parameter(torch.randn(5)),
        nn.Parameter(torch.randn(2)),
    ]
    first, second = torch.randn(19, dtype=torch.float64), torch.randn(19, dtype=torch.float64)
    for p in params:
        p.data = p.data.double()
    sums = first.clone()
    accumulate_many(params, sums)
    storages = {p.grad.untyped_storage().data_ptr() for p in params}
    assert len(storages) == 3 and sums.untyped_storage().data_ptr() not in storages
    accumulate_many(params, second.clone())
    total = first + second
    assert torch.equal(torch.cat([p.grad.flatten() for p in params]), total)
    before = [p.detach().clone() for p in params]
    torch.optim.SGD(params, lr=0.5).step()
    for p, old, start, n in zip(params, before, (0, 12, 17), (12, 5, 2)):
        assert torch.equal(p.detach().flatten(), old.flatten() - 0.5 * total[start : start + n])
    half = [nn.Parameter(torch.zeros(4).half()), nn.Parameter(torch.zeros(2).half())]
    sums = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    accumulate_many(half, sums)
    assert [p.grad.dtype for p in half] == [torch.float16] * 2
    assert torch.equal(torch.cat([p.grad for p in half]), sums.half())


def test_two_chunks_equal_full_batch():
    model = make_model()
    ids, targets = make_batch(4, 7, seed=3)
    ref_norms, max_norm, clip, ref_sum = brute_force_at_median(model, ids, targets)
    assert (clip < 1).any() and (clip == 1).any()
    flash = FlashClipping(model, tile_size=4)
    for half in (slice(0, 2), slice(2, 4)):
        flash_step(flash, model, ids[half], targets[half], max_norm)
    assert_close(flat_grads(model), ref_sum, 1e-9)


def run_reused(m, x):
    """A model that calls its "lin" layer twice."""
    return m["out"](torch.tanh(m["lin"](torch.tanh(m["lin"](x))))).sum((1, 2))


def reused_model():
    """(model, its copy, input) for run_reused."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"lin": nn.Linear(6, 6), "out": nn.Linear(6, 1)}).double()
    return model, copy.deepcopy(model), torch.randn(3, 4, 6, dtype=torch.float64)


def test_module_called_twice():
    model, reference, x = reused_model()
    ref = per_sample_grads_of(run_reused, reference, x)
    for route in ("auto", "gram", "product"):
        flash = FlashClipping(model, route=route, tile_size=2)
        flash.backward(run_reused(model, x).sum())
        assert_close(flash.per_sample_squared_norms(), ref.square().sum(1), 1e-9)
        flash.remove()


def test_module_called_twice_per_layer():
    """Per-layer clipping of a module called twice: each parameter's per-sample norm is of its
    gradient summed over both calls, and its clipped sum takes its own row of [P, B] factors,
    against brute force on every route."""
    model, reference, x = reused_model()
    sizes = [p.numel() for p in reference.parameters()]
    per_parameter = per_sample_grads_of(run_reused, reference, x).split(sizes, dim=1)
    factors = torch.rand(len(sizes), 3, dtype=torch.float64)
    for route in ("auto", "gram", "product"):
        flash = FlashClipping(model, route=route, tile_size=2)
        flash.backward(run_reused(model, x).sum())
        expected = torch.stack([grads.square().sum(1) for grads in per_parameter])
        assert_close(flash.per_parameter_squared_norms(), expected, 1e-9)
        flash.accumulate_clipped_grads(factors)
        for param, row, grads in zip(model.parameters(), factors, per_parameter, strict=True):
            assert_close(param.grad.flatten(), row @ grads, 1e-9)
            param.grad = None
        flash.remove()


def test_module_called_on_short_and_long_inputs():
    """One call keeps per-sample grads (T=4 >= dp/(d+p)=3), the other keeps A and G (T=2):
    the second is folded into the first, and norms and clipped sums stay exact."""
    torch.manual_seed(1)
    model = nn.ModuleDict({"lin": nn.Linear(6, 6)}).double()
    reference = copy.deepcopy(model)

    def run(m, x):
        return m["lin"](x).square().sum((1, 2)) + m["lin"](x[:, :2]).sin().sum((1, 2))

    x = torch.randn(3, 4, 6, dtype=torch.float64)
    params = list(reference.parameters())
    ref = torch.stack(
        [
            torch.cat(
                [g.flatten() for g in torch.autograd.grad(run(reference, x[b : b + 1]), params)]
            )
            for b in range(3)
        ]
    )
    flash = FlashClipping(model, tile_size=2)
    flash.backward(run(model, x).sum())
    # the T=2 call's A and G (Gram by itself) were folded into the kept per-sample grads
    assert [r["route"] for r in flash.routes()] == ["product", "product"]
    norms = flash.per_sample_squared_norms().sqrt()
    assert_close(norms, ref.norm(dim=1), 1e-9)
    clip = torch.tensor([0.5, 1.0, 0.25], dtype=torch.float64)
    flash.accumulate_clipped_grads(clip)
    assert_close(flat_grads(model), (clip[:, None] * ref).sum(0), 1e-9)


def recorded_inputs(flash: FlashClipping) -> dict:
    """The input A each managed layer's taped forward recorded (before the backward), by name."""
    hooked = [record for record in flash.tape.hooked if record is not None]
    return {record[0].name: record[1] for record in flash.tape.records + hooked}


def test_autocast_keeps_one_low_precision_input_per_tensor():
    """Under autocast a Linear multiplies its input cast to bf16: flash keeps that cast (half the
    bytes of an fp32 LayerNorm output), once for layers that read the same tensor (q, k, v)."""

    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(8)
            self.q, self.k, self.v = (nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            h = self.ln(x)  # fp32 under autocast
            return self.q(h) * self.k(h) + self.v(h)

    torch.manual_seed(0)
    model = QKV()
    flash = FlashClipping(model, route="gram")
    x = torch.randn(2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    saved = {name: A for name, A in recorded_inputs(flash).items() if name in "qkv"}
    assert all(A.dtype == torch.bfloat16 for A in saved.values())
    assert len({A.untyped_storage().data_ptr() for A in saved.values()}) == 1  # one cast
    expected = F.layer_norm(x, (8,), model.ln.weight, model.ln.bias).to(torch.bfloat16)
    assert torch.equal(saved["q"], expected)
    flash.backward(out.float().sum())
    q = next(layer for layer in flash.layers if layer.name == "q")
    # gram route: the weight waits for A and G; the [B, p] bias gradient was formed after it
    assert q.calls[0].pending == {"weight"} and q.per_sample["bias"].shape == (2, 8)


def test_unsupported_layer_raises():
    model = nn.ModuleDict({"conv": nn.Conv1d(3, 4, 2), "lin": nn.Linear(4, 2)})
    with pytest.raises(UnsupportedLayerError, match=r"'conv'.*Conv1d"):
        FlashClipping(model)
    model.conv.requires_grad_(False)  # frozen layers need no rule
    FlashClipping(model)


def test_tied_weights_raise():
    model = nn.ModuleDict({"emb": nn.Embedding(5, 4), "head": nn.Linear(4, 5, bias=False)})
    model.head.weight = model.emb.weight
    with pytest.raises(ValueError, match=r"emb\.weight.*head\.weight"):
        FlashClipping(model)


def test_remove_restores_training():
    model = make_model()
    frozen = model.pos.weight
    frozen.requires_grad_(False)
    flash = FlashClipping(model)
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p is not frozen for p in flash.params)
    flash.remove()
    assert [p.requires_grad for p in model.parameters()] == [
        p is not frozen for p in model.parameters()
    ]
    ids, targets = make_batch(2, 5)
    sample_losses(model(ids), targets).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p is not frozen)


def test_saved_tensors_freed_layer_by_layer_while_the_graph_lives():
    """accumulate_clipped_grads must free each layer's A and G even though the caller's loss
    (and with it the autograd graph and the norm layers' hooks) is still alive: holding them until
    the step ends would put every A and G on top of the full weight gradients at the peak."""

    model = make_model()
    flash = FlashClipping(model, tile_size=16)
    ids, targets = make_batch(3, 9)
    loss = sample_losses(model(ids), targets).sum()
    flash.backward(loss)
    saved = [
        weakref.ref(t) for layer in flash.layers for call in layer.calls for t in call.tensors()
    ]
    saved += [weakref.ref(g) for layer in flash.layers for g in layer.per_sample.values()]
    # Embeddings keep A and G; Linears (T=9 >= dp/(d+p)) and norms keep per-sample grads.
    assert len(saved) >= len(flash.layers) + 2
    norms = flash.per_sample_squared_norms().sqrt()
    flash.accumulate_clipped_grads((1.0 / (norms + 1e-6)).clamp(max=1.0))
    assert loss.grad_fn is not None  # the graph is still referenced here
    alive = [ref for ref in saved if ref() is not None]
    # Token ids of the embeddings are the model's own input (the test holds them); nothing else.
    # (The kept per-sample grads of the Linears and norm layers are freed as well.)
    assert all(ref().dtype == torch.long for ref in alive)


def test_product_route_drops_inputs_once_formed():
    """Layers that keep per-sample grads let go of A and G as soon as they are formed, right
    after the backward (one launch per kind, not one per layer in the backward)."""

    model = make_model()
    flash = FlashClipping(model, route="product")
    ids, targets = make_batch(2, 6)
    loss = sample_losses(model(ids), targets).sum()
    inputs = {name: weakref.ref(A) for name, A in recorded_inputs(flash).items()}
    flash.backward(loss)
    kept = {layer.name for layer in flash.layers if layer.per_sample}
    assert kept == {"ln", "up", "down", "rms", "head"}  # every Linear and norm; not embeddings
    assert all(inputs[name]() is None for name in kept)
    up = next(layer for layer in flash.layers if layer.name == "up")
    assert up.per_sample["weight"].shape == (2, 12, 8) and up.calls == []


def test_different_batch_sizes_in_one_forward_raise():
    """Per-sample grads of a module called on x and on x[:1] cannot be summed (no broadcast)."""
    model = nn.ModuleDict({"lin": nn.Linear(4, 4)}).double()
    flash = FlashClipping(model, route="product")
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    loss = model["lin"](x).sum() + model["lin"](x[:1]).sum()
    with pytest.raises(ValueError, match="different batch sizes"):
        flash.backward(loss)


def test_input_modified_in_place_between_layers():
    """Two Linears read h and h changes in place between them (legal here: flash freezes the
    weights, so autograd saves no input). In fp32 flash's A is h itself: it must refuse, as
    autograd does for a saved tensor. Under autocast A is a cast copy: the second layer must get
    a fresh cast of the changed h (not the first layer's), and the norms stay exact."""

    class TwoReaders(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 4), nn.Linear(6, 4)

        def forward(self, x):
            h = x * 1.0
            y = self.a(h)
            h.add_(3.0)
            return y + self.b(h)

    torch.manual_seed(0)
    model = TwoReaders()
    x = torch.randn(3, 5, 6)
    flash = FlashClipping(model, route="gram")
    with pytest.raises(RuntimeError, match="modified in place"):
        flash.backward(model(x).square().sum())
    flash.release()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    flash.backward(out.float().square().sum())
    norms = flash.per_sample_squared_norms()
    flash.remove()
    reference = []
    for b in range(3):  # brute force in the same precision: the layers' own bf16 products
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x[b : b + 1])
        out.float().square().sum().backward()
        reference.append(sum(p.grad.double().square().sum() for p in model.parameters()))
    assert_close(norms.double(), torch.stack(reference), 2e-2)


@pytest.mark.parametrize("in_place", ["relu_", "add_"])
def test_layer_output_modified_in_place(in_place):
    """A Linear on [B, T, d] returns a view of its 2-D product, and an op in place on that view
    (ReLU(inplace=True), a residual y += x) takes the view's autograd node out of the graph: the
    layer's gradient must still arrive (it was silently dropped, the layer counted as unused)."""

    def run(m, x):
        h = torch.tanh(m[0](x))
        y = m[1](h)
        y.relu_() if in_place == "relu_" else y.add_(h)
        return m[2](y).square().sum((1, 2))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 2)).double()
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    per_sample = per_sample_grads_of(run, model, x)
    for route in ("gram", "product"):
        flash = FlashClipping(model, route=route)
        flash.backward(run(model, x).sum())
        assert_close(flash.per_sample_squared_norms(), per_sample.square().sum(1), 1e-9)
        flash.accumulate_clipped_grads(torch.ones(3, dtype=torch.float64))
        assert_close(flat_grads(model), per_sample.sum(0), 1e-9)
        flash.remove()
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("route", ["gram", "product"])
def test_kept_tensors_are_the_saved_inputs_output_grads_and_per_sample_grads(route):
    """kept_tensors() yields what the engine holds for each hooked module: after backward, each
    Linear's input A [B, T, d] and output gradient G [B, T, p] (gram: the weight waits for them)
    or its per-sample weight gradients (product), and the per-sample gradients of biases and the
    LayerNorm; checked against a forward hook and autograd on an untouched copy. After
    release() it yields nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 3)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    per_sample = {}  # (module index, parameter name) -> brute-force per-sample gradients [B, ...]
    for b in range(2):
        reference.zero_grad()
        reference(x[b : b + 1]).square().sum().backward()
        for name, param in reference.named_parameters():
            per_sample.setdefault(tuple(name.split(".")), []).append(param.grad.clone())
    inputs, outputs = {}, {}

    def record(module, args, output):
        inputs[module] = args[0].detach()
        output.retain_grad()
        outputs[module] = output

    for module in reference:
        module.register_forward_hook(record)
    reference.zero_grad()
    reference(x).square().sum().backward()
    ref_of = dict(zip(model, reference, strict=True))

    flash = FlashClipping(model, route=route)
    out = model(x)
    # Between forward and backward: the saved inputs only, one per hooked module
    held = [(module, role) for module, role, _ in flash.kept_tensors()]
    assert held == [(m, "activation_hooks") for m in (model[0], model[2], model[3])]
    flash.backward(out.square().sum())
    kept = {}
    for module, role, tensor in flash.kept_tensors():
        kept.setdefault((module, role), []).append(tensor)
    linears = (model[0], model[3])
    if route == "gram":
        assert set(kept) == {(m, "activation_hooks") for m in linears} | {
            (m, "per_sample_gradients") for m in (*linears, model[2])
        }
        for module in linears:
            A, G = kept[module, "activation_hooks"]
            torch.testing.assert_close(A, inputs[ref_of[module]], rtol=0, atol=0)
            torch.testing.assert_close(G, outputs[ref_of[module]].grad)
            assert A.shape == (2, 5, module.in_features) and G.shape == (2, 5, module.out_features)
    else:  # every Linear and the LayerNorm formed per-sample grads and dropped A and G
        assert set(kept) == {(m, "per_sample_gradients") for m in (*linears, model[2])}
    for module in (*linears, model[2]):
        grads = kept[module, "per_sample_gradients"]
        names = {"bias"} if route == "gram" and module in linears else {"weight", "bias"}
        assert len(grads) == len(names)
        index = str(list(model).index(module))
        for name in names:  # each sample's own gradient, as autograd gives it for that sample
            expected = torch.stack(per_sample[index, name])
            matches = [
                g for g in grads if g.shape == expected.shape and torch.allclose(g, expected)
            ]
            assert len(matches) == 1, f"{name} of {module}"
    flash.release()
    assert list(flash.kept_tensors()) == []


def test_allocation_sites_name_the_functions_that_allocate():
    """The memory attribution reads each entry's function name: every role lists the functions
    (and each rule's overrides) that make its allocations, under the names they have."""
    from dp_cost.flash.rules.linear import LinearRule
    from dp_cost.flash.sites import ALLOCATION_SITES

    names = {role: {fn.__code__.co_name for fn in fns} for role, fns in ALLOCATION_SITES.items()}
    assert list(names) == ["temp_matrices", "norm_samples", "per_sample_gradients", "gradients"]
    assert names["temp_matrices"] == {"gram_squared_norms", "direct_squared_norms"}
    assert names["norm_samples"] == {
        "per_sample_squared_norms",
        "squared_norms",
        "squared_norms_many",
    }
    assert names["per_sample_gradients"] == {
        "per_sample_grads",
        "per_sample_grads_many",
        "add_per_sample",
    }
    assert names["gradients"] == {"clipped_grads", "accumulate_clipped_grads"}
    overrides = (
        LinearRule.squared_norms,
        LinearRule.per_sample_grads,
        LinearRule.per_sample_grads_many,
        LinearRule.clipped_grads,
    )
    assert all(any(fn in fns for fns in ALLOCATION_SITES.values()) for fn in overrides)


def test_input_read_by_layers_with_other_calls_between_is_cast_once():
    """LoRA's q, k and v adapters read one input, but each lora_B runs before the next lora_A:
    flash still keeps one bf16 cast of it, not one per adapter."""

    class LoRAQKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(8)
            self.qa, self.ka, self.va = (nn.Linear(8, 2, bias=False) for _ in range(3))
            self.qb, self.kb, self.vb = (nn.Linear(2, 8, bias=False) for _ in range(3))

        def forward(self, x):
            h = self.ln(x)
            return self.qb(self.qa(h)) * self.kb(self.ka(h)) + self.vb(self.va(h))

    torch.manual_seed(0)
    model = LoRAQKV()
    flash = FlashClipping(model, route="product")
    x = torch.randn(2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    saved = {name: A for name, A in recorded_inputs(flash).items() if name[1:] == "a"}
    assert len({A.untyped_storage().data_ptr() for A in saved.values()}) == 1  # one cast
    h = model.ln(x).to(torch.bfloat16)
    assert all(A.dtype == torch.bfloat16 and torch.equal(A, h) for A in saved.values())
    flash.backward(out.float().sum())
    assert flash.tape.casts == {}  # the casts are held by the layers' calls alone


def test_under_autocast_flash_casts_no_input_the_layers_do_not():
    """Under bf16 autocast a Linear casts its fp32 input itself; flash keeps that very cast
    (handed to the first layer reading the input) instead of making its own: as many casts of
    activations as the model without flash, and the gradient reaching the input bit for bit
    the same."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):  # counts casts of activations (weights are [8, 8] here)
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].shape == (2, 5, 8):
                self.count += 1
            return func(*args, **(kwargs or {}))

    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)
            self.q, self.k, self.v = (nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            # fp32 (CPU autocast keeps LayerNorm in its input's dtype), and not flash's leaf
            # (autocast caches its casts of leaves)
            h = self.ln(self.embed(x).float())
            h.register_hook(lambda grad: grads.append(grad))
            return (self.q(h) * self.k(h)).float().tanh() + self.v(h)

    counts, grads = [], []
    for with_flash in (False, True):
        torch.manual_seed(0)
        model = QKV()
        flash = FlashClipping(model) if with_flash else None
        casts = Casts()
        with casts, torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(2, 5, 8))
        counts.append(casts.count)
        loss = out.float().square().sum()
        if with_flash:
            assert recorded_inputs(flash)["q"].dtype == torch.bfloat16  # q's A: the cast
            flash.backward(loss)
        else:
            loss.backward()
    # x for embed, its output to fp32, h for q, k and v, the product to fp32, with flash or not
    assert counts[1] == counts[0] == 6
    assert torch.equal(grads[1], grads[0])


@pytest.mark.parametrize("route", ["product", "gram"])
@pytest.mark.parametrize("small", [2**18, 64])
def test_sink_gets_each_parameter_sum_once_as_grad_would(monkeypatch, small, route):
    """accumulate_clipped_grads(sink=...) hands over what the .grad path writes, one parameter
    at a time and in flash.params' reverse order whatever the route (the ranks' collectives
    pair up by that order), with kept per-sample gradients in the concatenation (all of them at
    the default threshold) or one by one (threshold 64: the weights)."""
    from dp_cost.flash import engine as flash_clip

    monkeypatch.setattr(flash_clip, "SMALL_PER_SAMPLE_NUMEL", small)
    ids, targets = make_batch(3, 5, seed=2)
    results = []
    for use_sink in (False, True):
        model = make_model()
        flash = FlashClipping(model, route=route)
        flash.backward(sample_losses(model(ids), targets).sum())
        c = (1.0 / (flash.per_sample_squared_norms().sqrt() + 1e-6)).clamp(max=1.0)
        sink = RecordingSink() if use_sink else None
        flash.accumulate_clipped_grads(c, sink=sink)
        if use_sink:
            got = sink.got
            assert all(len(v) == 1 for v in got.values()) and len(got) == len(flash.params)
            assert sink.finished == [flash.params]  # finish once, after every parameter
            assert [id(p) for p in sink.order] == [id(p) for p in reversed(flash.params)]
            assert all(p.grad is None for p in model.parameters())
            results.append(torch.cat([got[id(p)][0].flatten() for p in model.parameters()]))
        else:
            results.append(flat_grads(model))
        flash.release()
    assert_close(results[1], results[0], 1e-12)


@pytest.mark.parametrize("route", ["product", "gram"])
def test_sink_path_holds_no_sum_it_handed_over(monkeypatch, route):
    """Each clipped sum handed to the sink is the sink's alone: by the next hand-over flash
    holds no reference to it (no local of a suspended generator or loop keeps an unsharded sum
    alive through the next layer's clipped GEMM). No concatenation of small per-sample
    gradients here (threshold 0): their sums would be views of one buffer."""
    from dp_cost.flash import engine as flash_clip

    monkeypatch.setattr(flash_clip, "SMALL_PER_SAMPLE_NUMEL", 0)
    ids, targets = make_batch(3, 5, seed=4)
    model = make_model()
    flash = FlashClipping(model, route=route)
    handed, alive_at_next = [], []

    class WeakSink:
        def __call__(self, param, grad):
            alive_at_next.append([ref() is not None for ref in handed])
            handed.append(weakref.ref(grad if grad._base is None else grad._base))

        def finish(self, params):
            pass

    for _ in range(2):  # the second chunk as the first
        handed.clear(), alive_at_next.clear()
        flash.backward(sample_losses(model(ids), targets).sum())
        c = (1.0 / (flash.per_sample_squared_norms().sqrt() + 1e-6)).clamp(max=1.0)
        flash.accumulate_clipped_grads(c, sink=WeakSink())
        flash.release()
        assert len(handed) == len(flash.params)
        assert not any(any(alive) for alive in alive_at_next), alive_at_next


def test_input_replaced_by_a_later_pre_hook_is_the_one_kept():
    """A forward pre-hook registered on a managed module that replaces the input: flash keeps what
    the layer was given (per-sample gradients against brute force)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    flash = FlashClipping(model, route="gram")
    for m in (model[0], reference[0]):
        m.register_forward_pre_hook(lambda m, args: (2 * args[0] + 1,))
    flash.backward(model(x).square().sum())
    norms = flash.per_sample_squared_norms().sqrt()
    expected = per_sample_grads_of(lambda m, xb: m(xb).square().sum(), reference, x).norm(dim=1)
    assert_close(norms, expected, 1e-12)


def test_remove_twice_keeps_what_was_set_later():
    """remove() takes off flash's forwards only: a forward another library set on a managed
    module after flash stays (flash's, which it calls, records nothing any more), and a second
    remove() is a no-op."""
    model = nn.Sequential(nn.Linear(4, 3))
    flash = FlashClipping(model)
    calls = []
    inner = model[0].forward
    model[0].forward = lambda x: calls.append(1) or inner(x)
    flash.remove()
    flash.remove()
    model(torch.randn(2, 4))
    assert calls == [1] and all(p.requires_grad for p in model.parameters())
    assert not flash.tape.records
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks


def test_sink_gets_zeros_in_place_for_a_layer_the_chunk_did_not_reach():
    """A layer no call reached (a data-dependent branch, an unused head) is still handed over,
    as zeros at its place in flash.params' (reverse) order: a rank that reached it and one
    that did not issue the same collectives."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.skipped = nn.Linear(4, 6), nn.Linear(6, 6)
            self.norm, self.head = nn.LayerNorm(6), nn.Linear(6, 1)

        def forward(self, x, take_branch):
            h = self.first(x)
            return self.head(self.norm(self.skipped(h) if take_branch else h))

    torch.manual_seed(0)
    model = Branchy()
    flash = FlashClipping(model)
    flash.backward(model(torch.randn(3, 5, 4), take_branch=False).sum())
    c = (1.0 / (flash.per_sample_squared_norms().sqrt() + 1e-6)).clamp(max=1.0)
    sink = RecordingSink()
    flash.accumulate_clipped_grads(c, sink=sink)
    assert [id(p) for p in sink.order] == [id(p) for p in reversed(list(model.parameters()))]
    for name, param in model.named_parameters():
        handed = sink.got[id(param)][0]
        assert handed.shape == param.shape
        assert (handed == 0).all() == name.startswith("skipped"), name


def test_autograd_gradients_then_the_book_keeping_again():
    """Inside autograd_gradients() autograd forms .grad (of one sample: its per-sample
    gradient) and the tape keeps nothing; clip_per_sample of two such gradients, stacked as
    the DDP gather stacks them, is the brute-force clipped sum; afterwards the engine's own
    step is exact again (its parameters frozen for autograd once more)."""
    model = make_model()
    reference = copy.deepcopy(model)
    ids, targets = make_batch(2, 5, seed=3)
    norms = brute_force(reference, ids, targets)[0]
    max_norm = (norms.min() + norms.max()) / 2  # one sample clipped, the other not
    _, _, ref_sum = brute_force(reference, ids, targets, max_norm)
    flash = FlashClipping(model)
    params = list(model.parameters())
    per_sample = []
    for b in range(2):
        with flash.autograd_gradients():
            sample_losses(model(ids[b : b + 1]), targets[b : b + 1]).sum().backward()
            assert not list(flash.kept_tensors())
        per_sample.append([p.grad for p in params])
        for p in params:
            p.grad = None
    assert not any(p.requires_grad for p in params)
    grads = [torch.stack(pair) for pair in zip(*per_sample, strict=True)]
    clip_per_sample(params, grads, lambda n: (max_norm / (n + 1e-6)).clamp(max=1.0), 1)
    assert_close(flat_grads(model), ref_sum, 1e-10)
    for p in params:
        p.grad = None
    flash_step(flash, model, ids, targets, max_norm)
    assert_close(flat_grads(model), ref_sum, 1e-10)


@pytest.mark.parametrize("budget, in_backward", [(0, True), (2**40, False)])
def test_norm_layers_formed_in_the_backward_within_a_byte_budget(monkeypatch, budget, in_backward):
    """Norm layers' G comes by a hook on their output's node, and their per-sample gradients
    are formed there, several layers' at once (one launch per kind on CUDA), as soon as the A
    and G held for them pass DEFERRED_BYTES (0: at each norm layer, mid-backward), else all
    together right after the backward. Exact against brute force either way."""
    from dp_cost.flash import capture
    from dp_cost.flash.rules.norm import NormLayerRule

    monkeypatch.setattr(capture, "DEFERRED_BYTES", budget)
    monkeypatch.setattr(capture, "DEFERRED_PARTS", 2**40)  # the budget: DEFERRED_BYTES alone
    formed = []
    many = NormLayerRule.per_sample_grads_many

    def spy(self, calls):
        formed.append((len(calls), not flash._after_backward))  # LayerNorm, RMSNorm: a rule each
        return many(self, calls)

    monkeypatch.setattr(NormLayerRule, "per_sample_grads_many", spy)
    model = make_model()
    ids, targets = make_batch(3, 6, seed=2)
    ref_norms, max_norm, _, ref_sum = brute_force_at_median(model, ids, targets)
    flash = FlashClipping(model)
    norms, routes = flash_step(flash, model, ids, targets, max_norm)
    assert formed == [(1, in_backward)] * 2
    assert_close(norms, ref_norms, 1e-9)
    assert_close(flat_grads(model), ref_sum, 1e-9)
    assert {r["route"] for r in routes if r["layer"] in ("ln", "rms")} == {"norm"}


def test_norm_layers_formed_in_about_deferred_parts_launches_however_deep(monkeypatch):
    """The budget for held norm-layer A and G is at least 1 / DEFERRED_PARTS of them all: 16
    LayerNorms of one size between Linears are formed in DEFERRED_PARTS launches, and one for
    the rest (not one per layer); the norms and clipped sums stay exact."""
    from dp_cost.flash import capture
    from dp_cost.flash.rules.norm import NormLayerRule

    monkeypatch.setattr(capture, "DEFERRED_BYTES", 0)
    sizes = []
    many = NormLayerRule.per_sample_grads_many
    monkeypatch.setattr(
        NormLayerRule,
        "per_sample_grads_many",
        lambda rule, calls: sizes.append(len(calls)) or many(rule, calls),
    )
    torch.manual_seed(0)
    layers = []
    for _ in range(16):
        layers += [nn.Linear(6, 6), nn.LayerNorm(6)]
    model = nn.Sequential(*layers, nn.Linear(6, 2)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    per_sample = per_sample_grads_of(lambda m, xb: m(xb).square().sum((1, 2)), reference, x)
    flash = FlashClipping(model)
    flash.backward(model(x).square().sum())
    assert sizes == [5, 5, 5, 1]  # each: past a quarter (4 layers) by the 5th; the last after
    assert_close(flash.per_sample_squared_norms(), per_sample.square().sum(1), 1e-9)
    flash.accumulate_clipped_grads(torch.ones(3, dtype=torch.float64))
    assert_close(flat_grads(model), per_sample.sum(0), 1e-9)


def test_a_second_backward_of_one_forward_raises():
    """One backward per forward: a second one would add every call's gradients again."""
    model = make_model()
    ids, targets = make_batch(3, 6, seed=2)
    flash = FlashClipping(model, route="gram")
    loss = sample_losses(model(ids), targets).sum()
    flash.backward(loss)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        flash.backward(loss)
    with pytest.raises(RuntimeError, match="release"):  # nor a forward before release()
        model(ids)
    flash.release()
    flash_step(flash, model, ids, targets, 1.0)  # and after it, the next step runs


class ManyNorms(nn.Module):
    """LayerNorms of one shape, one of them called twice and one without a bias, between
    Linears: several norm-layer calls per grouped launch."""

    def __init__(self, d=16):
        super().__init__()
        self.inp, self.out = nn.Linear(d, d), nn.Linear(d, 3)
        self.a, self.b = nn.LayerNorm(d), nn.LayerNorm(d, eps=1e-5)
        self.c = nn.LayerNorm(d, bias=False)
        with torch.no_grad():
            for norm in (self.a, self.b, self.c):
                norm.weight.add_(0.3 * torch.randn_like(norm.weight))

    def forward(self, x):
        h = self.a(self.inp(x))
        h = self.b(h) + self.b(2 * h + 1)
        return self.out(self.c(h))


def test_grouped_norm_layer_launches_match_brute_force(monkeypatch):
    """The engine's grouped path (flash.kernels.norm_layer_per_sample_grads_many, interpreted
    on the CPU, its CUDA check lifted): the four LayerNorm calls of one shape and eps formed in
    one launch right after the backward, each result handed to its own call (the reused layer's
    two summed, the bias-free one's weight alone); norms and clipped sums equal brute force."""
    kernels = pytest.importorskip("dp_cost.flash.kernels", reason="needs triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU check of the grouped path; CUDA: test_flash_kernels_gpu.py")
    monkeypatch.setattr(
        kernels,
        "norm_layer_grads_many_supported_each",
        lambda pairs: [x.dim() == 3 and x.shape == g.shape for x, g in pairs],
    )
    sizes, grouped = [], kernels.norm_layer_per_sample_grads_many

    def spy(pairs, eps, rms):
        sizes.append(len(pairs))
        return grouped(pairs, eps, rms)

    monkeypatch.setattr(kernels, "norm_layer_per_sample_grads_many", spy)
    torch.manual_seed(3)
    model = ManyNorms()
    x = torch.randn(3, 5, 16)

    def loss_of(m, inputs):
        return m(inputs).square().mean((1, 2))

    per_sample = per_sample_grads_of(loss_of, copy.deepcopy(model), x).double()
    ref_norms = per_sample.norm(dim=1)
    clip = (ref_norms.median() / (ref_norms + 1e-6)).clamp(max=1.0)
    flash = FlashClipping(model)
    flash.backward(loss_of(model, x).sum())
    norms = flash.per_sample_squared_norms().sqrt()
    flash.accumulate_clipped_grads((ref_norms.median() / (norms + 1e-6)).clamp(max=1.0).float())
    flash.release()
    assert sizes == [4]
    assert_close(norms.double(), ref_norms, 1e-5)
    assert_close(flat_grads(model).double(), (clip[:, None] * per_sample).sum(0), 1e-5)


def test_embedding_route_by_size_and_work():
    """The Gram route where its [B, T, T] product is small and its exact fp32 multiply-adds few:
    (8, 512) at d = 2048 takes it; (8, 1024) there (4x the multiply-adds) and (2, 4096) (a
    product of 2^25 elements) sort; a narrow embedding takes it up to the product's bound."""
    from dp_cost.flash.rules.embedding import takes_gram_route

    def route(B, T, d):
        return takes_gram_route(torch.empty(B, T, d, device="meta"))

    assert route(8, 512, 2048) and route(1, 1, 2048)
    assert not route(8, 1024, 2048) and not route(2, 4096, 2048)
    assert route(8, 1024, 64) and route(16, 1024, 64) and not route(32, 1024, 64)


@pytest.mark.parametrize("route_elements", [0, 2**40], ids=["sort", "gram"])
@pytest.mark.parametrize("B,T", [(1, 1), (2, 1), (3, 12), (5, 40)])
def test_embedding_norms_by_either_route_match_brute_force(monkeypatch, route_elements, B, T):
    """An embedding's per-sample norms by the Gram route (within its bounds) and by the sort
    route (beyond them) both equal brute force: a vocabulary of 4 ids, so a sample repeats
    ids many times (its gradient rows are sums of several tokens' g), one id the padding row
    (no gradient). Empty batches never reach the engine (the trainers' step skips them)."""
    from dp_cost.flash.rules import embedding

    monkeypatch.setattr(embedding, "GRAM_ROUTE_ELEMENTS", route_elements)
    monkeypatch.setattr(embedding, "GRAM_ROUTE_MULTIPLY_ADDS", route_elements)
    gen = torch.Generator().manual_seed(B * 100 + T)
    model = nn.ModuleDict(
        {"emb": nn.Embedding(4, 6, padding_idx=2), "head": nn.Linear(6, 3, bias=False)}
    ).double()
    ids = torch.randint(0, 4, (B, T), generator=gen)
    targets = torch.randint(0, 3, (B, T), generator=gen)

    def losses(m, x, y):
        logits = m["head"](m["emb"](x))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")

    reference = []
    for b in range(B):  # brute force: one sample's own backward at a time
        m = copy.deepcopy(model)
        losses(m, ids[b : b + 1], targets[b : b + 1]).sum().backward()
        reference.append(sum(p.grad.square().sum() for p in m.parameters()))
    flash = FlashClipping(model)
    flash.backward(losses(model, ids, targets).sum())
    norms = flash.per_sample_squared_norms()
    assert_close(norms, torch.stack(reference), 1e-10)
    assert (ids == 2).any() or B * T < 10  # the padding row is exercised where it can be


def test_a_norm_layer_whose_output_gets_no_gradient_adds_nothing():
    """A norm layer's G comes by a hook on its output's node; an output no loss reads (an
    auxiliary head) never gets one: it adds nothing, as the other layers' unused outputs, and
    the rest stays exact. A norm layer first in the forward has its edge asked of the autograd
    call itself: exact too."""

    class AuxHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.aux, self.norm = nn.Linear(4, 4), nn.LayerNorm(4), nn.LayerNorm(4)

        def forward(self, x):
            h = self.lin(self.norm(x))
            self.aux(h)  # computed, never used
            return h.square().sum((1, 2))

    torch.manual_seed(0)
    model = AuxHead()
    with torch.no_grad():
        model.norm.weight.add_(torch.randn(4))
    x = torch.randn(3, 5, 4)
    params = list(model.parameters())
    per_sample = torch.stack(  # aux's columns: zeros
        [
            torch.cat([g.flatten() for g in grads])
            for grads in (
                torch.autograd.grad(model(x[b : b + 1]).sum(), params, materialize_grads=True)
                for b in range(3)
            )
        ]
    )
    flash = FlashClipping(model)
    flash.backward(model(x).sum())
    assert_close(flash.per_sample_squared_norms(), per_sample.square().sum(1), 1e-5)
    flash.accumulate_clipped_grads(torch.ones(3))
    assert model.aux.weight.grad is None  # no call of it got a gradient: no clipped sum
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    assert_close(torch.cat([g.flatten() for g in grads]), per_sample.sum(0), 1e-5)


def test_a_model_copied_while_wrapped_records_nothing():
    """deepcopy of a wrapped model: its forwards compute as the original's and record into an
    idle tape of its own (none of the original engine's records)."""
    model = make_model()
    flash = FlashClipping(model)
    twin = copy.deepcopy(model)
    ids, targets = make_batch(2, 5)
    torch.testing.assert_close(twin(ids), model(ids))
    assert twin.up.forward.args[1].idle and not twin.up.forward.args[1].records
    assert len(flash.tape.records) > 0  # the original's forward recorded, the copy's did not
    flash.release()


def test_a_module_whose_forward_another_library_replaced_is_refused():
    """A forward another library set on a module before flash (accelerate's hooks do) may hand
    the layer another input than it was given, which flash could not see: refused, the model
    left as it was."""
    model = nn.Sequential(nn.Linear(4, 3))
    own = model[0].forward
    model[0].forward = lambda x: own(2 * x)
    library = model[0].forward
    with pytest.raises(ValueError, match="'0' already has a forward of its own"):
        FlashClipping(model)
    assert model[0].forward is library and all(p.requires_grad for p in model.parameters())


def test_a_plain_backward_after_remove_runs():
    """remove() with the graph of a taped forward still alive: the norm layers' hooks on that
    graph do nothing, and autograd's own backward runs."""
    model = make_model()
    flash = FlashClipping(model)
    ids, targets = make_batch(2, 5)
    loss = sample_losses(model(ids), targets).sum()
    flash.remove()
    loss.backward()  # the parameters are trainable again; the graph was built frozen
