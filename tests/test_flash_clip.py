"""Tests for flash_clip: numbers are checked against per-sample brute force with autograd."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flash_clip import FlashClipping, UnsupportedLayerError

VOCAB, PAD = 11, 0


class TinyLM(nn.Module):
    """Token + positional embeddings, LayerNorm, GELU MLP, RMSNorm, per-token logits."""

    def __init__(self, d=8, hidden=12, max_len=300):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d)
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d, bias=False)
        self.rms = nn.RMSNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids):
        B, T = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(T, device=ids.device).expand(B, T))
        x = x + self.down(F.gelu(self.up(self.ln(x))))
        return self.head(self.rms(x))


def make_batch(B, T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, T), generator=gen)
    if T >= 3:
        ids[:, 1] = ids[:, 0]  # repeated token id within a sample
        ids[:, 2] = PAD
    targets = torch.randint(0, VOCAB, (B, T), generator=gen)
    return ids, targets


def sample_losses(logits, targets):
    """Mean cross-entropy over each sample's tokens, shape [B]."""
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return losses.view(targets.shape).mean(1)


def make_model(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = TinyLM().to(dtype)
    with torch.no_grad():  # non-trivial norm affine params
        for m in (model.ln, model.rms):
            m.weight.add_(0.3 * torch.randn_like(m.weight))
        model.ln.bias.add_(0.3 * torch.randn_like(model.ln.bias))
    return model


def brute_force(model, ids, targets, max_norm=None):
    """Per-sample gradients one sample at a time on an untouched copy of the model."""
    params = list(model.parameters())
    rows = []
    for b in range(len(ids)):
        loss = sample_losses(model(ids[b : b + 1]), targets[b : b + 1]).sum()
        grads = torch.autograd.grad(loss, params)
        rows.append(torch.cat([g.flatten() for g in grads]))
    per_sample = torch.stack(rows)
    norms = per_sample.norm(dim=1)
    if max_norm is None:
        return norms, None, None
    clip = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return norms, clip, (clip[:, None] * per_sample).sum(0)


def flash_step(flash, model, ids, targets, max_norm):
    """One chunk: forward, one backward, norms, clip factors, accumulate, release."""
    flash.backward(sample_losses(model(ids), targets).sum())
    norms = flash.per_sample_squared_norms().sqrt()
    flash.accumulate_clipped_grads((max_norm / (norms + 1e-6)).clamp(max=1.0))
    routes = flash.routes()
    flash.release()
    return norms, routes


def flat_grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def assert_close(actual, expected, rtol):
    err = (actual - expected).abs().max() / expected.abs().max()
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


@pytest.mark.parametrize("route", ["gram", "direct", "product", "auto"])
@pytest.mark.parametrize("T", [1, 5, 257])
@pytest.mark.parametrize("B", [1, 3])
def test_matches_brute_force(route, T, B):
    model = make_model()
    reference = copy.deepcopy(model)
    ids, targets = make_batch(B, T, seed=T + B)
    ref_norms = brute_force(reference, ids, targets)[0]
    # B=3: clip only the two larger samples; B=1: clip the only sample.
    max_norm = ref_norms.sort().values[:2].mean() if B > 1 else ref_norms[0] / 2
    _, clip, ref_sum = brute_force(reference, ids, targets, max_norm)
    assert (clip < 1).any() and ((clip == 1).any() or B == 1)

    flash = FlashClipping(model, route=route, tile_size=16)
    norms, routes = flash_step(flash, model, ids, targets, max_norm)
    assert_close(norms, ref_norms, 1e-9)
    assert_close(flat_grads(model), ref_sum, 1e-9)
    linear_routes = {r["layer"]: r["route"] for r in routes if "d" in r}
    assert set(linear_routes) == {"up", "down", "head"}
    if route != "auto":
        assert set(linear_routes.values()) == {route}


@pytest.mark.parametrize("B", [1, 3])
def test_large_kept_per_sample_grads_match_brute_force(monkeypatch, B):
    """Kept per-sample gradients above SMALL_PER_SAMPLE_NUMEL (the 1b model's product-route
    weights) are clip-summed one by one, not batched: with the threshold at 0 every kept one
    (weights, biases, norm layers) takes that path."""
    import flash_clip

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


def test_fp32_matches_brute_force():
    model = make_model(torch.float32)
    reference = copy.deepcopy(model)
    ids, targets = make_batch(3, 257, seed=1)
    ref_norms = brute_force(reference, ids, targets)[0]
    max_norm = ref_norms.median()
    _, _, ref_sum = brute_force(reference, ids, targets, max_norm)
    flash = FlashClipping(model, tile_size=16)
    norms, _ = flash_step(flash, model, ids, targets, max_norm)
    assert norms.dtype == torch.float32
    assert_close(norms, ref_norms, 1e-5)
    assert_close(flat_grads(model), ref_sum, 1e-5)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CUDA runs this wiring compiled"
)
def test_fused_kernel_wiring_interpreted_on_cpu(monkeypatch):
    """The CUDA path through flash_clip (LayerNorm/RMSNorm per-sample gradients and the clipped
    sums of kept per-sample gradients on flash_kernels, in two chunks, so .grad is written once
    and then accumulated into), run on CPU tensors by the Triton interpreter: against brute
    force in fp32. Every kept per-sample gradient counts as large, so all take the kernel."""
    import flash_clip

    kernels = pytest.importorskip("flash_kernels", reason="needs triton")
    monkeypatch.setattr(flash_clip, "SMALL_PER_SAMPLE_NUMEL", 0)
    calls = []
    for name in ("norm_layer_grads_supported", "weighted_sums_supported"):
        check = getattr(kernels, name)
        # the checks ask for CUDA; the interpreter runs the same kernels on CPU tensors
        monkeypatch.setattr(
            kernels, name, lambda *a, _check=check: calls.append(a) or _check(*a) or True
        )
    model = make_model(torch.float32)
    reference = copy.deepcopy(model)
    ids, targets = make_batch(4, 17, seed=9)
    ref_norms = brute_force(reference, ids, targets)[0]
    max_norm = ref_norms.median()
    _, clip, ref_sum = brute_force(reference, ids, targets, max_norm)
    assert (clip < 1).any() and (clip == 1).any()
    flash = FlashClipping(model, route="product")
    norms = torch.cat(
        [flash_step(flash, model, ids[i : i + 2], targets[i : i + 2], max_norm)[0] for i in (0, 2)]
    )
    assert calls  # the fused path was asked for
    assert_close(norms, ref_norms, 1e-5)
    assert_close(flat_grads(model), ref_sum, 1e-5)


def test_auto_route_choice():
    model = make_model()
    flash = FlashClipping(model, tile_size=16)
    # up: d=8, p=12. Per-sample grads are kept iff dp <= T(d+p), i.e. T >= 4.8; below that,
    # gram iff T(d+p)(1 + 1/n_tiles) < 2dp (T=3, one tile: 120 < 192).
    for T, expected in [(3, "gram"), (5, "product"), (257, "product")]:
        ids, targets = make_batch(2, T)
        _, routes = flash_step(flash, model, ids, targets, 1.0)
        up = next(r for r in routes if r["layer"] == "up")
        assert up == {"layer": "up", "T": T, "d": 8, "p": 12, "route": expected}


def test_two_chunks_equal_full_batch():
    model = make_model()
    reference = copy.deepcopy(model)
    ids, targets = make_batch(4, 7, seed=3)
    ref_norms = brute_force(reference, ids, targets)[0]
    max_norm = ref_norms.median()
    _, clip, ref_sum = brute_force(reference, ids, targets, max_norm)
    assert (clip < 1).any() and (clip == 1).any()
    flash = FlashClipping(model, tile_size=4)
    for half in (slice(0, 2), slice(2, 4)):
        flash_step(flash, model, ids[half], targets[half], max_norm)
    assert_close(flat_grads(model), ref_sum, 1e-9)


def test_module_called_twice():
    torch.manual_seed(0)
    model = nn.ModuleDict({"lin": nn.Linear(6, 6), "out": nn.Linear(6, 1)}).double()
    reference = copy.deepcopy(model)

    def run(m, x):
        return m["out"](torch.tanh(m["lin"](torch.tanh(m["lin"](x))))).sum((1, 2))

    x = torch.randn(3, 4, 6, dtype=torch.float64)
    ref = [
        torch.cat(
            [
                g.flatten()
                for g in torch.autograd.grad(
                    run(reference, x[b : b + 1]).sum(), list(reference.parameters())
                )
            ]
        )
        for b in range(3)
    ]
    for route in ("auto", "gram", "product"):
        flash = FlashClipping(model, route=route, tile_size=2)
        flash.backward(run(model, x).sum())
        assert_close(flash.per_sample_squared_norms(), torch.stack(ref).square().sum(1), 1e-9)
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


class LargestAlloc(TorchDispatchMode):
    """Records the largest freshly allocated op output (views and in-place results excluded)."""

    def __init__(self):
        super().__init__()
        self.largest, self.shapes = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = tree_leaves((args, kwargs))
        seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.numel())
                self.shapes.add(tuple(t.shape))
        return out


def test_alloc_recorder_sees_a_gram_matrix():
    A = torch.randn(2, 64, 32)
    with LargestAlloc() as rec:
        A.view(2, 2048)  # a view is not an allocation
    assert rec.largest == 0
    with LargestAlloc() as rec:
        A @ A.mT
    assert rec.largest == 2 * 64 * 64


@pytest.mark.parametrize("route", ["gram", "direct"])
def test_no_large_intermediates(route):
    B, T, d, p = 2, 64, 32, 32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, p), nn.GELU(), nn.Linear(p, p))
    flash = FlashClipping(model, route=route, tile_size=16, block_numel=512)
    with LargestAlloc() as in_backward:
        flash.backward(model(torch.randn(B, T, d)).square().sum())
    with LargestAlloc() as in_norms:
        norms = flash.per_sample_squared_norms()
    assert norms.shape == (B,) and (norms > 0).all()
    bound = B * T * T if route == "gram" else B * d * p
    assert in_norms.largest < bound
    if route == "gram":
        assert in_backward.largest < bound
    assert (p, d) not in in_backward.shapes  # autograd formed no weight gradient


@pytest.mark.parametrize("route", ["gram", "direct", "product"])
def test_bf16_autocast_close_to_fp32(route):
    model = make_model(torch.float32)
    reference = copy.deepcopy(model)
    ids, targets = make_batch(3, 33, seed=5)
    ref_norms = brute_force(reference, ids, targets)[0]
    max_norm = ref_norms.median()
    _, _, ref_sum = brute_force(reference, ids, targets, max_norm)
    flash = FlashClipping(model, route=route, tile_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = sample_losses(model(ids).float(), targets).sum()
    flash.backward(loss)
    assert {r["route"] for r in flash.routes() if "d" in r} == {route}
    norms = flash.per_sample_squared_norms().sqrt()
    assert norms.dtype == torch.float32
    assert_close(norms, ref_norms, 2e-2)
    flash.accumulate_clipped_grads((max_norm / (norms + 1e-6)).clamp(max=1.0))
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert_close(flat_grads(model), ref_sum, 2e-2)


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
    saved = {layer.name: layer.calls[0][0] for layer in flash.layers if layer.name in "qkv"}
    assert all(A.dtype == torch.bfloat16 for A in saved.values())
    assert len({A.untyped_storage().data_ptr() for A in saved.values()}) == 1  # one cast
    expected = F.layer_norm(x, (8,), model.ln.weight, model.ln.bias).to(torch.bfloat16)
    assert torch.equal(saved["q"], expected)
    flash.backward(out.float().sum())
    q = next(layer for layer in flash.layers if layer.name == "q")
    # gram route: the weight waits for A and G; the [B, p] bias gradient was formed at once
    assert q.calls[0][2] == {"weight"} and q.per_sample["bias"].shape == (2, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast, tolerance", [(True, 2e-2), (False, 1e-5)])
def test_cuda_step_matches_brute_force(monkeypatch, autocast, tolerance):
    """On CUDA flash runs its fused kernels (LayerNorm/RMSNorm per-sample gradients, the
    clipped sums of kept per-sample gradients): bf16 autocast, and fp32 exact to 1e-5."""
    import flash_clip
    import flash_kernels

    # TinyLM's per-sample weight gradients (<= 96 elements) count as large here, so they take
    # the weighted-sum kernel as the 1b model's do; biases and norm layers stay small.
    monkeypatch.setattr(flash_clip, "SMALL_PER_SAMPLE_NUMEL", 64)
    calls = []
    for name in ("norm_layer_per_sample_grads", "weighted_sums_"):
        kernel = getattr(flash_kernels, name)
        spy = lambda *a, _kernel=kernel, _name=name, **k: calls.append(_name) or _kernel(*a, **k)
        monkeypatch.setattr(flash_kernels, name, spy)
    model = make_model(torch.float32)
    ids, targets = make_batch(3, 257, seed=6)
    ref_norms, _, ref_sum = brute_force(copy.deepcopy(model), ids, targets, max_norm=1.0)
    model, ids, targets = model.cuda(), ids.cuda(), targets.cuda()
    flash = FlashClipping(model, tile_size=64)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = sample_losses(model(ids).float(), targets).sum()
    flash.backward(loss)
    # No host sync between backward and the optimizer (torch.unique or boolean-mask indexing
    # would wait for the GPU mid-step): CUDA raises on any synchronising op here.
    torch.cuda.set_sync_debug_mode("error")
    try:
        norms = flash.per_sample_squared_norms().sqrt()
        flash.accumulate_clipped_grads((1.0 / (norms + 1e-6)).clamp(max=1.0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(norms.cpu(), ref_norms, tolerance)
    assert_close(flat_grads(model).cpu(), ref_sum, tolerance)
    # two norm layers, each once; the product-route Linears' sums in one launch
    assert sorted(calls) == ["norm_layer_per_sample_grads"] * 2 + ["weighted_sums_"]


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
    (and with it the autograd graph and the hooks' closures) is still alive: holding them until
    the step ends would put every A and G on top of the full weight gradients at the peak."""
    import weakref

    model = make_model()
    flash = FlashClipping(model, tile_size=16)
    ids, targets = make_batch(3, 9)
    loss = sample_losses(model(ids), targets).sum()
    flash.backward(loss)
    saved = [weakref.ref(t) for layer in flash.layers for call in layer.calls for t in call]
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


def test_product_route_drops_inputs_during_backward():
    """Layers that keep per-sample grads let go of A and G inside backward itself."""
    import weakref

    model = make_model()
    flash = FlashClipping(model, route="product")
    ids, targets = make_batch(2, 6)
    loss = sample_losses(model(ids), targets).sum()
    inputs = {layer.name: weakref.ref(layer.calls[0][0]) for layer in flash.layers}
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


def test_clip_factors_are_never_rounded_up():
    """In bf16 a clip factor rounded up would scale a sample's gradient past C (the sensitivity
    the noise is calibrated to): the low-precision factor must be <= the exact one, 1 ulp off."""
    from flash_clip import _round_down

    c = torch.rand(10_000, generator=torch.Generator().manual_seed(0)).clamp(min=1e-3)
    c[:3] = torch.tensor([1.0, 0.5, 0.3])
    low = _round_down(c, torch.bfloat16)
    assert low.dtype == torch.bfloat16
    assert (low.float() <= c).all()
    assert low[0] == 1 and low[1] == 0.5  # exactly representable: kept as they are
    ulp = c * 2.0**-7
    assert ((c - low.float()) <= ulp).all()
    assert torch.equal(_round_down(c, torch.float32), c)


def test_bf16_clipped_contribution_never_exceeds_the_clip_norm():
    """The clipped GEMM reads c * g rounded to nearest in bf16, up to 2^-8 above c * g: with g
    and c at a rounding tie (g = 1.15625, c = 0.875) and nothing to cancel it, the sample's
    clipped gradient would exceed C by 0.4% unless c is shrunk by that rounding first."""
    lin = nn.Linear(64, 64, bias=False)
    flash = FlashClipping(lin, route="gram")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(torch.ones(1, 1, 64))
    flash.backward((out.float() * 1.15625).sum())  # G = 1.15625 everywhere (exact in bf16)
    norm = flash.per_sample_squared_norms().sqrt()
    C = 0.875 * (norm.item() + 1e-6)  # clip factor exactly 0.875
    flash.accumulate_clipped_grads((C / (norm + 1e-6)).clamp(max=1.0))
    clipped = lin.weight.grad.double().norm().item()
    assert clipped <= C
    assert clipped >= C * (1 - 2**-6)  # shrunk by about one bf16 ulp, not more


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
