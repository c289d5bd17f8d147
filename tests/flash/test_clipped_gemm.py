"""flash.kernels.clipped_weight_grad, a Linear's clipped weight gradient sum_b c_b G_b^T A_b in
fp32, against fp64 brute force: on CPU interpreted (TRITON_INTERPRET=1, explicit tiles, fp32
and fp16: the interpreter has no bf16), and compiled and autotuned on a GPU in bf16 (skipped without
CUDA), where flash's whole bf16 step is checked against fp64 too."""

import os

import pytest
import torch
from flash_reference import RecordingSink
from torch import nn

from dp_cost.flash import fused
from dp_cost.flash.engine import FlashClipping

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest.py without a GPU
interpreted = pytest.mark.skipif(not INTERPRETED, reason="the GPU runs the compiled kernel")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
kernels = pytest.importorskip("dp_cost.flash.kernels", reason="needs triton")
clipped_gemm_module = pytest.importorskip(
    "dp_cost.flash.kernels.clipped_gemm", reason="needs triton"
)


def clipped_sum(A, G, c):
    """Brute force in fp64: each sample's gradient G_b^T A_b, weighted by c_b, summed."""
    per_sample = torch.einsum("btp,btd->bpd", G.double(), A.double())
    return torch.einsum("b,bpd->pd", c.double(), per_sample)


def per_sample_norms(A, G):
    return torch.einsum("btp,btd->bpd", G.double(), A.double()).flatten(1).norm(dim=1)


def relative_error(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


def fp32_at_most(x):
    """x (fp64) in fp32, rounded toward zero: a clip factor that cannot exceed C / ||g||."""
    low = x.float()
    return torch.where(low.double() > x, torch.nextafter(low, torch.zeros_like(low)), low)


def small_tiles(rescale, flatten=False):
    """One of the kernel's variants with tiles small enough for the interpreter's shapes."""
    meta = {"RESCALE": rescale, "FLATTEN": flatten, "BLOCK_P": 16, "BLOCK_D": 32}
    return meta | {"BLOCK_T": 16, "GROUP_P": 2}


def operands(B, T, d, p, dtype, seed, padding=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(B, T, d, generator=gen).to(device, dtype)
    G = torch.randn(B, T, p, generator=gen).to(device, dtype)
    if padding:  # padding tokens: zero rows of A and G at the end of each sample
        A[:, T - padding :] = 0
        G[:, T - padding :] = 0
    return A, G


@interpreted
def test_kernel_is_interpreted_on_cpu():
    assert type(clipped_gemm_module._clipped_gemm_kernel).__name__ == "InterpretedFunction"


@interpreted
@pytest.mark.parametrize(
    "rescale, flatten", [(True, False), (True, True), (False, False), (False, True)]
)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize(
    "B, T, d, p, padding",
    [
        (3, 37, 20, 33, 0),  # T past a token block, d and p odd and past their tiles
        (4, 5, 48, 40, 2),  # T under one block, padding tokens
        (1, 100, 16, 48, 9),  # one sample: splits cut its tokens
        (2, 64, 32, 32, 0),  # exact multiples of every block
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_fp64_brute_force(dtype, B, T, d, p, padding, splits, rescale, flatten):
    A, G = operands(B, T, d, p, dtype, seed=T + B, padding=padding)
    c = torch.rand(B, generator=torch.Generator().manual_seed(1)) * 0.9 + 0.05
    if B > 2:
        c[1], c[2] = 0.0, 1.0  # a sample that must not count, one not clipped
    out = kernels.clipped_weight_grad(A, G, c, splits=splits, config=small_tiles(rescale, flatten))
    assert out.dtype == torch.float32 and out.shape == (p, d)
    assert relative_error(out, clipped_sum(A, G, c)) < 1e-5


@interpreted
@pytest.mark.parametrize("splits", [1, 4])
def test_accumulates_into_existing_grad(splits):
    A, G = operands(3, 50, 24, 40, torch.float16, seed=3)
    c = torch.tensor([0.3, 1.0, 0.01])
    grad = torch.randn(40, 24)
    expected = grad.double() + clipped_sum(A, G, c)
    out = kernels.clipped_weight_grad(
        A, G, c, out=grad, splits=splits, config=small_tiles(True, True)
    )
    assert out is grad
    assert relative_error(grad, expected) < 1e-5


@interpreted
def test_strided_operands():
    """A and G as views (a transposed A, a slice of a wider G) are read by their strides."""
    A = torch.randn(2, 24, 30).mT  # [2, 30, 24]
    G = torch.randn(2, 30, 50)[:, :, 5:45]
    c = torch.tensor([0.5, 0.25])
    out = kernels.clipped_weight_grad(A, G, c, config=small_tiles(False))
    assert relative_error(out, clipped_sum(A, G, c)) < 1e-5


@interpreted
@pytest.mark.parametrize("rescale, flatten", [(True, False), (False, True)])
def test_each_sample_stays_within_the_clip_norm(rescale, flatten):
    """Each sample's clipped contribution, alone (the others' c set to 0), has norm <= C with
    no shrinking of c: c * G is never rounded to 16 bits. Sample 0 is the rounding tie that
    lifts a bf16 c * g above c * g (g = 1.15625 / 128, c = 0.875); the others are clipped hard."""
    B, T, d, p = 4, 40, 16, 24
    A, G = operands(B, T, d, p, torch.float16, seed=4)
    A[0], G[0] = 1.0, 1.15625 / 128
    norms = per_sample_norms(A, G)
    C = 0.875 * norms[0].item()  # sample 0's factor is exactly 0.875
    c = fp32_at_most((C / norms).clamp(max=1.0))
    c[0] = 0.875  # C / norm is 0.875 up to fp64 rounding
    assert (c[1:] < 0.5).all()
    for b in range(B):
        alone = torch.zeros(B)
        alone[b] = c[b]
        out = kernels.clipped_weight_grad(
            A, G, alone, splits=2, config=small_tiles(rescale, flatten)
        )
        norm = out.double().norm().item()
        assert C * (1 - 1e-6) <= norm <= C * (1 + 1e-6)  # fp32 accumulation error only


def test_clip_schedule():
    """Samples by ascending c; the chain of ratios times the last scale gives back each c (the
    rescaling kernel's weights), ratios <= 1, and a zero c drops its sample."""
    c = torch.tensor([0.5, 0.0, 1.0, 1e-3, 0.0, 0.25])
    c32, order, scale, ratio = kernels.clip_schedule(c)
    assert torch.equal(c32, c)
    assert torch.equal(scale, c[order.long()]) and (scale[1:] >= scale[:-1]).all()
    assert (ratio <= 1).all() and (ratio >= 0).all()
    weights = torch.empty(len(c), dtype=torch.float64)
    for k in range(len(c)):
        weights[k] = ratio[k + 1 :].double().prod() * scale[-1].double()
    assert torch.allclose(weights, scale.double(), rtol=1e-6, atol=0)


def folded_toward_zero(X, c, T):
    """(X's token rows times their sample's c rounded to nearest, the same rounded toward zero):
    the fp32 product stepped down one ulp where rounding to the 16-bit dtype went up (fp64
    check)."""
    product = X.float() * c.repeat_interleave(T)[:, None]
    nearest = product.to(X.dtype)
    toward_zero = torch.where(
        nearest.double().abs() > product.double().abs(),
        torch.nextafter(nearest, torch.zeros_like(nearest)),
        nearest,
    )
    return nearest, toward_zero


@interpreted
def test_fold_rounds_each_product_toward_zero():
    """fold_clip_factors: each token row times its sample's fp32 c, the fp32 product rounded to
    fp16 toward zero (never above it: no ulp shrink of c needed), exactly as an fp64 check of
    the product rounded to nearest and stepped down where it went up."""
    B, T, n = 3, 7, 1100  # n past one block of columns
    X = torch.randn(B * T, n).half()
    c = torch.tensor([0.3, 1.0, 0.0123])
    folded = kernels.fold_clip_factors(X, c, T)
    nearest, expected = folded_toward_zero(X, c, T)
    assert folded.dtype == torch.float16 and torch.equal(folded, expected)
    assert (nearest != expected).float().mean() > 0.2  # a fair share were rounded up


@interpreted
def test_fold_blocks_that_start_inside_a_sample():
    """Samples shorter than a block (7 and 999 elements: a block spans several, found by a
    division within the block) and longer (1100: at most one boundary per block, found by a
    comparison), over several blocks, so most blocks start inside a sample: every element gets
    its own sample's factor (the factors all differ). And samples of whole blocks (each block
    inside one sample, the last one ending the operand: no factor read past the last sample's)."""
    block = kernels.clipped_gemm.FOLD_BLOCK
    cases = ((300, 1, 7), (5, 3, 333), (4, 1, 1100), (3, 2, block))
    for B, T, n in cases:
        assert (T * n < block) == (n in (7, 333)) and B * T * n > 2 * block
        c = torch.rand(B) + 0.5
        X = torch.randn(B * T, n).half()
        folded = kernels.fold_clip_factors(X, c, T)
        assert torch.equal(folded, folded_toward_zero(X, c, T)[1])


@interpreted
def test_fold_many_equals_each_fold_alone():
    """fold_clip_factors_many: one launch over operands of different widths and tokens per
    sample (one past a block, one empty), each result bit for bit what folding it alone gives
    (rounded toward zero, checked above), as views of one buffer."""
    B = 3
    c = torch.tensor([0.3, 1.0, 0.0123])
    shapes = [(5, 2100), (1, 7), (4, 0), (2, 64)]  # (T, n)
    Xs = [torch.randn(B * T, n).half() for T, n in shapes]
    many = kernels.fold_clip_factors_many(Xs, c, [T for T, _ in shapes])
    for X, (T, _), folded in zip(Xs, shapes, many, strict=True):
        assert folded.shape == X.shape and torch.equal(folded, folded_toward_zero(X, c, T)[1])
    assert len({f.untyped_storage().data_ptr() for f in many if f.numel()}) == 1
    # Nothing cached per operand size (they change with B and T; the per-block tables kept for
    # parameter sizes would grow with them)
    from dp_cost.flash.kernels import common

    tables = len(common._BLOCK_TABLES)
    for B in (1, 2, 5):
        kernels.fold_clip_factors_many([torch.randn(B * 3, 9).half()], torch.ones(B), [3])
    assert len(common._BLOCK_TABLES) == tables
    with pytest.raises(ValueError, match="one 16-bit dtype"):
        kernels.fold_clip_factors_many([Xs[0], Xs[1].float()], c, [5, 1])


@pytest.mark.gpu
@on_gpu
def test_fold_on_the_gpu_rounds_toward_zero_as_interpreted():
    """The compiled fold, bit for bit the fp64 check above, in bf16 and fp16, on the interpreted
    tests' operands and a 1b step's (whole samples a block many times over, operands of
    different sizes in one launch, rows of c per operand)."""
    B = 4
    shapes = [(1, 7), (3, 333), (1, 1100), (2, 1024), (512, 2048), (64, 8192), (0, 5)]  # (T, n)
    for dtype in (torch.bfloat16, torch.float16):
        Xs = [torch.randn(B * T, n, device="cuda").to(dtype) for T, n in shapes]
        c = torch.rand(3, B, device="cuda") + 0.01
        rows = [i % 3 for i in range(len(Xs))]
        many = kernels.fold_clip_factors_many(Xs, c, [T for T, _ in shapes], None, rows)
        for X, (T, _), row, folded in zip(Xs, shapes, rows, many, strict=True):
            assert torch.equal(folded, folded_toward_zero(X, c[row], T)[1])
        alone = kernels.fold_clip_factors(Xs[4], c[0], shapes[4][0])
        assert torch.equal(alone, folded_toward_zero(Xs[4], c[0], shapes[4][0])[1])


@interpreted
def test_fold_many_takes_each_operand_its_row_of_c():
    """rows: c [P, B] and operand i folded with row rows[i] (per-layer clipping), in one launch,
    each bit for bit what folding it alone with that row gives."""
    B = 2
    c = torch.tensor([[0.3, 1.0], [0.0123, 0.7], [1.0, 0.01]])
    shapes, rows = [(5, 2100), (1, 7), (2, 64)], [2, 0, 1]
    Xs = [torch.randn(B * T, n).half() for T, n in shapes]
    many = kernels.fold_clip_factors_many(Xs, c, [T for T, _ in shapes], None, rows)
    for X, (T, _), row, folded in zip(Xs, shapes, rows, many, strict=True):
        assert torch.equal(folded, folded_toward_zero(X, c[row], T)[1])
    with pytest.raises(ValueError, match="with rows"):
        kernels.fold_clip_factors_many(Xs, c, [T for T, _ in shapes])


@interpreted
@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("use_sink", [False, True])
def test_flash_step_folds_many_layers_per_launch_interpreted(monkeypatch, use_sink, per_layer):
    """The wiring of the grouped fold: Linear layers of different widths under fp16 autocast
    (the CUDA check patched to pass on CPU), c folded into each layer's narrower operand by
    launches of up to FOLD_GROUP_BYTES: one launch for all, or one per layer (bound 0), give
    the same gradients bit for bit, on the .grad path and the sink path, each within fp16
    rounding of an fp64 clipped sum for the same clip factors. Per-layer clipping: c [P, B],
    each layer folded with its own row in the same shared launches."""
    from dp_cost.flash.rules import linear as linear_rule

    monkeypatch.setattr(kernels, "clipped_weight_grad_supported", lambda A, G: True)
    monkeypatch.setattr(
        kernels, "clipped_weight_grad_supported_each", lambda pairs: [True] * len(pairs)
    )
    monkeypatch.setattr(fused, "KERNELS_ON_CPU", True)
    launches = []
    fold_many = kernels.fold_clip_factors_many
    monkeypatch.setattr(
        kernels,
        "fold_clip_factors_many",
        lambda Xs, c, tokens, *rest: launches.append(len(Xs)) or fold_many(Xs, c, tokens, *rest),
    )
    B, T = 3, 6
    widths = [(16, 40), (40, 8), (8, 8)]  # fold into G, into A, into G (d == p)
    results, inputs, output_grads = [], {}, {}

    def record(module, args, out):  # the fp16 A flash keeps, and G
        inputs[module] = args[0].half()
        # a copy: flash folds c into its G in place
        out.register_hook(lambda g: output_grads.setdefault(module, g.clone()))

    for bound in (2**30, 0):
        monkeypatch.setattr(linear_rule, "FOLD_GROUP_BYTES", bound)
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(d, p, bias=False) for d, p in widths))
        x = torch.randn(B, T, widths[0][0])
        flash = FlashClipping(model, route="gram", tile_size=4)
        for layer in model:
            layer.register_forward_hook(record)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        flash.backward(out.float().square().sum())
        if per_layer:  # [P, B]
            norms = flash.per_parameter_squared_norms().sqrt()
            c = (norms.median(1, keepdim=True).values / (norms + 1e-6)).clamp(max=1.0)
        else:
            norms = flash.per_sample_squared_norms().sqrt()
            c = (norms.median() / (norms + 1e-6)).clamp(max=1.0)
        launches.clear()
        sink = RecordingSink() if use_sink else None
        flash.accumulate_clipped_grads(c, sink=sink)
        assert launches == ([3] if bound else [1, 1, 1])
        if use_sink:
            grads = [sink.got[id(layer.weight)][0] for layer in model]
        else:
            grads = [layer.weight.grad for layer in model]
        for layer, grad in zip(model, grads, strict=True):
            factors = c[[id(p) for p in flash.params].index(id(layer.weight))] if per_layer else c
            expected = clipped_sum(inputs[layer], output_grads[layer], factors)
            assert relative_error(grad, expected) < 4e-3
        results.append(grads)
        flash.release()
    for grouped, alone in zip(*results, strict=True):
        assert torch.equal(grouped, alone)


@interpreted
def test_fold_in_place_overwrites_the_operand_it_owns():
    """in_place: the operand itself is folded and returned (no new memory); a non-contiguous
    one is copied first and the copy folded; the others land in a new buffer, their operands
    untouched. Every result equals the out-of-place fold bit for bit."""
    torch.manual_seed(0)
    B, T = 3, 4
    c = torch.rand(B)
    owned, kept = torch.randn(B * T, 8).half(), torch.randn(B * T, 16).half()
    strided = torch.randn(8, B * T).half().T  # [B*T, 8], not contiguous
    expected = [kernels.fold_clip_factors(X, c, T) for X in (owned, kept, strided)]
    before = kept.clone()
    folded = kernels.fold_clip_factors_many([owned, kept, strided], c, [T] * 3, [True, False, True])
    assert folded[0] is owned and torch.equal(kept, before)
    assert folded[2].data_ptr() != strided.data_ptr()
    for result, reference in zip(folded, expected, strict=True):
        assert torch.equal(result, reference)


@interpreted
def test_two_layers_given_one_gradient_fold_their_own_copies(monkeypatch):
    """y = a(x) + b(x): autograd hands both layers the same gradient tensor. Folding c into
    one G in place must not fold it into the other's: each call's G is its own (flash.capture
    copies an aliased one). Both clipped sums within fp16 rounding of fp64 brute force."""

    monkeypatch.setattr(
        kernels, "clipped_weight_grad_supported_each", lambda pairs: [True] * len(pairs)
    )
    monkeypatch.setattr(fused, "KERNELS_ON_CPU", True)
    torch.manual_seed(0)
    B, T = 3, 5
    model = nn.ModuleDict({"a": nn.Linear(12, 6, bias=False), "b": nn.Linear(12, 6, bias=False)})
    x = torch.randn(B, T, 12)
    flash = FlashClipping(model, route="gram", tile_size=4)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model["a"](x) + model["b"](x)
    G = (out.float() * 0 + torch.randn(B, T, 6)).half()  # the gradient both layers get
    flash.backward((out.float() * G.float()).sum())
    c = torch.tensor([0.5, 1.0, 0.25])
    flash.accumulate_clipped_grads(c)
    expected = clipped_sum(x.half(), G, c)
    for name in ("a", "b"):
        assert relative_error(model[name].weight.grad, expected) < 4e-3, name


@interpreted
def test_shape_errors():
    A, G = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.clipped_weight_grad(A, G.half(), torch.ones(2))
    with pytest.raises(ValueError, match=r"c must have shape \[2\]"):
        kernels.clipped_weight_grad(A, G, torch.ones(3))
    with pytest.raises(ValueError, match="out must be fp32"):
        kernels.clipped_weight_grad(A, G, torch.ones(2), out=torch.zeros(4, 5))


def linear_step(B, T, d, p, device, dtype, chunks=1):
    """A bias-free Linear (fp32 weights) under autocast in ``dtype``, through flash's Gram route
    and clipped GEMM, in ``chunks`` chunks. The output gradient is a fixed tensor exact in
    ``dtype``, so A and G are known exactly: returns (.grad, flash's norms, fp64 reference
    norms, the fp64 clipped sum for flash's clip factors, and for fp64 ones, C)."""
    gen = torch.Generator().manual_seed(B * T + d)
    x = torch.randn(B, T, d, generator=gen).to(device)
    weight_of_out = torch.randn(B, T, p, generator=gen).to(device, dtype)
    layer = nn.Linear(d, p, bias=False).to(device)
    A, G = x.to(dtype), weight_of_out
    reference_norms = per_sample_norms(A, G)
    C = reference_norms.median().item()
    flash = FlashClipping(layer, route="gram", tile_size=64)
    flash_norms, factors = [], []
    for rows in torch.arange(B).chunk(chunks):
        with torch.autocast(device, dtype=dtype):
            out = layer(x[rows])
        flash.backward((out.float() * weight_of_out[rows].float()).sum())
        norms = flash.per_sample_squared_norms().sqrt()
        factors.append((C / (norms + 1e-6)).clamp(max=1.0))
        flash.accumulate_clipped_grads(factors[-1])
        flash_norms.append(norms)
        flash.release()
    reference_c = (C / (reference_norms + 1e-6)).clamp(max=1.0)
    return (
        layer.weight.grad,
        torch.cat(flash_norms),
        reference_norms,
        clipped_sum(A, G, torch.cat(factors)),
        clipped_sum(A, G, reference_c),
    )


@interpreted
def test_flash_step_takes_the_kernel_interpreted(monkeypatch):
    """The wiring of the exact path: a Linear under fp16 autocast (fp32 weight), two chunks (the
    second adds into .grad), its clipped gradient through clipped_weight_grad (run on CPU
    tensors by the interpreter) with fp32 clip factors. Against the fp64 sum for the same
    factors: 1e-5, where the CPU path (c folded into fp16 G, shrunk by an ulp) is further off."""
    from dp_cost.flash.rules import linear as linear_rule

    monkeypatch.setattr(linear_rule, "EXACT_CLIPPED_GEMM", True)
    monkeypatch.setattr(fused, "KERNELS_ON_CPU", True)
    calls = []
    check = kernels.clipped_weight_grad_supported
    monkeypatch.setattr(  # the check asks for CUDA
        kernels,
        "clipped_weight_grad_supported",
        lambda A, G: calls.append(A.dtype) or check(A, G) or True,
    )
    grad, _, _, expected, _ = linear_step(4, 30, 16, 24, "cpu", torch.float16, chunks=2)
    assert calls == [torch.float16, torch.float16]
    assert relative_error(grad, expected) < 1e-5
    monkeypatch.setattr(kernels, "clipped_weight_grad_supported", lambda A, G: False)
    grad, _, _, expected, _ = linear_step(4, 30, 16, 24, "cpu", torch.float16, chunks=2)
    assert relative_error(grad, expected) > 1e-4


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize(
    "B, T, d, p",
    [
        (3, 257, 48, 48),
        (8, 512, 256, 1024),
        (2, 1, 64, 64),
        (4, 512, 2048, 2048),
        (1, 4096, 256, 256),
    ],
)
def test_kernel_on_cuda(B, T, d, p, accumulate):
    """Autotuned, bf16 (exact in the fp64 reference: only fp32 accumulation differs); the last
    shape has few output tiles, so its tokens are split over programs."""
    A, G = operands(B, T, d, p, torch.bfloat16, seed=5, device="cuda")
    c = torch.rand(B, device="cuda") + 0.01
    grad = torch.randn(p, d, device="cuda") if accumulate else None
    expected = clipped_sum(A, G, c) + (grad.double() if accumulate else 0)
    out = kernels.clipped_weight_grad(A, G, c, out=grad)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize(
    "B, T, d, p", [(3, 257, 48, 48), (8, 512, 256, 1024), (2, 1, 64, 64), (4, 512, 2048, 2048)]
)
def test_flash_bf16_step_on_cuda(monkeypatch, B, T, d, p, exact):
    """flash's bf16 update (autocast, fp32 weight) within 5e-3 of the fp64 clipped sum, with
    flash's own norms and clip factors against fp64 ones (the earlier bf16 c, rounded down and
    shrunk by an ulp, was 1e-2 off). Against the fp64 sum for flash's own clip factors: the
    default (fp32 c folded into bf16, rounded toward zero) loses under one bf16 ulp per element
    (2.8e-3 on average); the exact kernel fp32 rounding only."""
    from dp_cost.flash.rules import linear as linear_rule

    monkeypatch.setattr(linear_rule, "EXACT_CLIPPED_GEMM", exact)
    grad, norms, reference_norms, for_flash_c, reference = linear_step(
        B, T, d, p, "cuda", torch.bfloat16
    )
    assert relative_error(norms, reference_norms) < 1e-4
    assert relative_error(grad, for_flash_c) < (1e-5 if exact else 4e-3)
    assert relative_error(grad, reference) <= 5e-3


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("exact", [False, True])
def test_each_sample_stays_within_the_clip_norm_on_cuda(exact):
    """As on CPU, at a 1b layer's shape in bf16, for both CUDA paths: every sample clipped, each
    one's contribution alone never above C by more than fp32 error; the exact kernel also no
    further below it, the default (truncated bf16 operand) within one bf16 ulp."""
    B, T, d, p = 4, 512, 2048, 2048
    A, G = operands(B, T, d, p, torch.bfloat16, seed=6, device="cuda")
    A[0], G[0] = 1.0, 1.15625 / 128  # the bf16 rounding tie: c * g rounds up at c = 0.875
    norms = per_sample_norms(A, G)
    C = 0.875 * norms[0].item()
    c = fp32_at_most((C / norms).clamp(max=1.0))
    c[0] = 0.875
    assert (c[1:] < 0.5).all()
    for b in range(B):
        alone = torch.zeros(B, device="cuda")
        alone[b] = c[b]
        if exact:
            clipped = kernels.clipped_weight_grad(A, G, alone)
        else:
            G2 = kernels.fold_clip_factors(G.flatten(0, 1), alone, T)
            clipped = torch.mm(G2.T, A.flatten(0, 1), out_dtype=torch.float32)
        norm = clipped.double().norm().item()
        assert C * (1 - (1e-5 if exact else 2**-7)) <= norm <= C * (1 + 1e-5)
