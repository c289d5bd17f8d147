"""Flash's norm rules and routes against per-sample brute force with autograd: each Linear route
(gram, direct, product, auto), fp32/bf16 and the fused-kernel wiring, the routes' memory bounds,
and the clip factors' rounding."""

import copy
import os

import pytest
import torch
from flash_reference import (
    assert_close,
    brute_force,
    brute_force_at_median,
    flash_step,
    flat_grads,
    make_batch,
    make_model,
    sample_losses,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dp_cost.flash.engine import FlashClipping


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


def test_fp32_matches_brute_force():
    model = make_model(torch.float32)
    ids, targets = make_batch(3, 257, seed=1)
    ref_norms, max_norm, _, ref_sum = brute_force_at_median(model, ids, targets)
    flash = FlashClipping(model, tile_size=16)
    norms, _ = flash_step(flash, model, ids, targets, max_norm)
    assert norms.dtype == torch.float32
    assert_close(norms, ref_norms, 1e-5)
    assert_close(flat_grads(model), ref_sum, 1e-5)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CUDA runs this wiring compiled"
)
def test_fused_kernel_wiring_interpreted_on_cpu(monkeypatch):
    """The CUDA path through flash (LayerNorm/RMSNorm per-sample gradients and the clipped
    sums of kept per-sample gradients on flash.kernels, in two chunks, so .grad is written once
    and then accumulated into), run on CPU tensors by the Triton interpreter: against brute
    force in fp32. Every kept per-sample gradient counts as large, so all take the kernel."""
    from dp_cost.flash import engine as flash_clip
    from dp_cost.flash import fused

    kernels = pytest.importorskip("dp_cost.flash.kernels", reason="needs triton")
    monkeypatch.setattr(flash_clip, "SMALL_PER_SAMPLE_NUMEL", 0)
    calls = []
    # the checks ask for CUDA; the interpreter runs the same kernels on CPU tensors
    monkeypatch.setattr(fused, "KERNELS_ON_CPU", True)
    check = kernels.norm_layer_grads_supported
    monkeypatch.setattr(  # the one-layer kernel (the grouped one asks for CUDA still)
        kernels,
        "norm_layer_grads_supported",
        lambda *a: calls.append(a) or check(*a) or True,
    )
    monkeypatch.setattr(
        kernels,
        "weighted_sums_supported_each",
        lambda pairs: calls.append(pairs) or [True] * len(pairs),
    )
    model = make_model(torch.float32)
    ids, targets = make_batch(4, 17, seed=9)
    ref_norms, max_norm, clip, ref_sum = brute_force_at_median(model, ids, targets)
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
    ids, targets = make_batch(3, 33, seed=5)
    ref_norms, max_norm, _, ref_sum = brute_force_at_median(model, ids, targets)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast, tolerance", [(True, 2e-2), (False, 1e-5)])
def test_cuda_step_matches_brute_force(monkeypatch, autocast, tolerance):
    """On CUDA flash runs its fused kernels (LayerNorm/RMSNorm per-sample gradients after the
    backward, the clipped sums of kept per-sample gradients): bf16 autocast, and fp32 exact to
    1e-5."""
    from dp_cost.flash import engine as flash_clip
    from dp_cost.flash import kernels as flash_kernels

    # TinyLM's per-sample weight gradients (<= 96 elements) count as large here, so they take
    # the weighted-sum kernel as the 1b model's do; biases and norm layers stay small.
    monkeypatch.setattr(flash_clip, "SMALL_PER_SAMPLE_NUMEL", 64)
    calls = []
    for name in ("norm_layer_per_sample_grads_many", "weighted_sums_", "squared_row_norms_many"):
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
    # the norm layers after the backward, one launch per kind (LayerNorm, RMSNorm); the
    # product-route Linears' norms and sums in one launch each, and the small parameters'
    # concatenation (biases, norm layers) in one more sum
    assert sorted(calls) == sorted(
        ["norm_layer_per_sample_grads_many"] * 2
        + ["squared_row_norms_many"]
        + ["weighted_sums_"] * 2
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast, tolerance", [(True, 2e-2), (False, 1e-5)])
def test_cuda_gram_step_forms_the_biases_in_one_launch(monkeypatch, autocast, tolerance):
    """Gram route on CUDA: the Linear biases' per-sample gradients come right after the backward
    from the kept G, both layers' in one token-sums launch, with no host sync; the step matches
    brute force (bf16 autocast, and fp32 to 1e-5)."""
    from dp_cost.flash import kernels as flash_kernels

    launches = []
    token_sums = flash_kernels.token_sums_many
    monkeypatch.setattr(
        flash_kernels,
        "token_sums_many",
        lambda sources: launches.append([s.shape for s in sources]) or token_sums(sources),
    )
    model = make_model(torch.float32)
    ids, targets = make_batch(3, 130, seed=8)
    ref_norms, _, ref_sum = brute_force(copy.deepcopy(model), ids, targets, max_norm=1.0)
    model, ids, targets = model.cuda(), ids.cuda(), targets.cuda()
    flash = FlashClipping(model, route="gram", tile_size=64)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = sample_losses(model(ids).float(), targets).sum()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flash.backward(loss)
        norms = flash.per_sample_squared_norms().sqrt()
        flash.accumulate_clipped_grads((1.0 / (norms + 1e-6)).clamp(max=1.0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert launches == [[(3, 130, 12), (3, 130, 11)]]  # up's and head's G; down has no bias
    assert_close(norms.cpu(), ref_norms, tolerance)
    assert_close(flat_grads(model).cpu(), ref_sum, tolerance)


def test_clip_factors_are_never_rounded_up():
    """In bf16 a clip factor rounded up would scale a sample's gradient past C (the sensitivity
    the noise is calibrated to): the low-precision factor must be <= the exact one, 1 ulp off."""
    from dp_cost.flash.clip import round_down

    c = torch.rand(10_000, generator=torch.Generator().manual_seed(0)).clamp(min=1e-3)
    c[:3] = torch.tensor([1.0, 0.5, 0.3])
    low = round_down(c, torch.bfloat16)
    assert low.dtype == torch.bfloat16
    assert (low.float() <= c).all()
    assert low[0] == 1 and low[1] == 0.5  # exactly representable: kept as they are
    ulp = c * 2.0**-7
    assert ((c - low.float()) <= ulp).all()
    assert torch.equal(round_down(c, torch.float32), c)


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
