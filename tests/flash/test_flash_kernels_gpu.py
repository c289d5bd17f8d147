"""The compiled, autotuned Gram kernel on a GPU: bf16 on tensor cores and IEEE fp32, against
brute force (run on the device; skipped without CUDA)."""

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


# bf16 inputs are exact in the fp64 reference; only the fp32 accumulation differs.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms", [False, True])
def test_norm_layer_grads_many_on_cuda(dtype, rms):
    """Several layers' per-sample norm-layer gradients in one launch (one strided x) equal the
    one-layer kernel's: the same tiles and arithmetic, a layer axis more (the sums' order may
    differ with the loads' layout: to fp32 rounding)."""
    from dp_cost.flash import kernels as flash_kernels

    torch.manual_seed(5)
    pairs = [
        ((torch.randn(8, 512, 2 * 2048, device="cuda") + 1).to(dtype)[:, :, :2048] if i == 1
         else (torch.randn(8, 512, 2048, device="cuda") + 1).to(dtype),
         torch.randn(8, 512, 2048, device="cuda").to(dtype))
        for i in range(3)
    ]  # fmt: skip
    assert all(flash_kernels.norm_layer_grads_many_supported(x, g) for x, g in pairs)
    grouped = flash_kernels.norm_layer_per_sample_grads_many(pairs, 1e-5, rms)
    for (x, g), (weight, bias) in zip(pairs, grouped, strict=True):
        one_weight, one_bias = flash_kernels.norm_layer_per_sample_grads(x, g, 1e-5, rms)
        for actual, expected in ((weight, one_weight), (bias, one_bias)):
            error = ((actual - expected).abs().max() / expected.abs().max()).item()
            assert error < 1e-6


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-4)])
@pytest.mark.parametrize("B, T, d, p", [(3, 257, 48, 48), (8, 512, 256, 1024), (2, 1, 64, 64)])
def test_gram_kernel_on_cuda(dtype, tolerance, B, T, d, p):
    from dp_cost.flash import kernels as flash_kernels

    torch.manual_seed(0)
    A = torch.randn(B, T, d, device="cuda").to(dtype)
    G = torch.randn(B, T, p, device="cuda").to(dtype)
    expected = torch.einsum("btp,btd->bpd", G.double(), A.double()).square().sum((1, 2))
    norms = flash_kernels.gram_squared_norms(A, G)
    error = ((norms.double() - expected).abs().max() / expected.abs().max()).item()
    assert error < tolerance


def test_flash_gram_route_runs_the_fused_kernel_on_cuda(monkeypatch):
    """flash's Gram route goes through the Triton kernel for bf16 on CUDA (the torch path
    stays for CPU, fp32 and fused=False); both match brute force on a bf16 layer of the 1b
    model's shape."""
    from dp_cost.flash import kernels as flash_kernels
    from dp_cost.flash.rules import linear as linear_rule

    calls = []
    kernel = flash_kernels.gram_squared_norms
    monkeypatch.setattr(
        flash_kernels, "gram_squared_norms", lambda *a, **k: calls.append(a[0].shape) or kernel(*a)
    )
    torch.manual_seed(1)
    A = torch.randn(4, 512, 2048, device="cuda").bfloat16()
    G = torch.randn(4, 512, 2048, device="cuda").bfloat16()
    expected = torch.einsum("btp,btd->bpd", G.double(), A.double()).square().sum((1, 2))

    def error(norms):
        return ((norms.double() - expected).abs().max() / expected.abs().max()).item()

    assert error(linear_rule.gram_squared_norms(A, G, 512)) < 1e-4
    assert calls == [A.shape]
    # the torch path rounds its T x T products to bf16
    assert error(linear_rule.gram_squared_norms(A, G, 512, fused=False)) < 1e-2
    assert calls == [A.shape]
    # fp32 keeps the torch path (cuBLAS' IEEE fp32 GEMMs are faster than the kernel's dots)
    linear_rule.gram_squared_norms(A.float(), G.float(), 512)
    assert calls == [A.shape]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_kernel_on_cuda(dtype):
    """Fused noise on the GPU: N(0, std^2) added in place, in the tensors' own dtype."""
    from dp_cost.flash import kernels as flash_kernels

    torch.manual_seed(0)
    base = [torch.randn(3_000_000, device="cuda").to(dtype), torch.zeros(4097, device="cuda")]
    noisy = [t.clone() for t in base]
    flash_kernels.add_gaussian_noise_(noisy, 0.01)
    noise = (noisy[0].double() - base[0].double()) / 0.01
    assert noisy[0].dtype == dtype
    assert abs(noise.mean().item()) < 5 / noise.numel() ** 0.5
    # bf16 rounds x + noise to 8 bits: the noise keeps its scale only roughly then
    assert abs(noise.std().item() - 1) < (0.01 if dtype == torch.float32 else 0.1)
    assert (noisy[1] != 0).all()


def test_noise_kernel_tail_over_1e11_draws():
    """The sampler's tail, which DP's guarantee rests on: over >= 1e11 draws, the count of
    |z| > 6 is within 3 standard deviations of the Gaussian's (197 expected; Triton's randn,
    which stops at 5.68, gives none), and none exceeds the transform's bound Z_MAX."""
    import math

    from dp_cost.flash import kernels as flash_kernels
    from dp_cost.flash.kernels.noise import Z_MAX

    torch.manual_seed(11)
    buffer = torch.empty(2**30, device="cuda")
    rounds = math.ceil(1e11 / buffer.numel())
    beyond_6, beyond_5_7, largest = 0, 0, 0.0
    for _ in range(rounds):
        buffer.zero_()
        flash_kernels.add_gaussian_noise_([buffer], 1.0)
        magnitude = buffer.abs()
        beyond_6 += int(torch.count_nonzero(magnitude > 6))
        beyond_5_7 += int(torch.count_nonzero(magnitude > 5.7))
        largest = max(largest, magnitude.max().item())
    draws = rounds * buffer.numel()
    tail = math.erfc(6 / math.sqrt(2))  # P(|z| > 6) = 1.97e-9
    expected, spread = draws * tail, math.sqrt(draws * tail * (1 - tail))
    assert abs(beyond_6 - expected) <= 3 * spread, (beyond_6, expected, spread)
    tail_5_7 = math.erfc(5.7 / math.sqrt(2))
    assert abs(beyond_5_7 - draws * tail_5_7) <= 3 * math.sqrt(draws * tail_5_7)
    assert 6 < largest <= Z_MAX


def test_grouped_kernel_on_cuda():
    """All Gram-route layers of a step in one launch: layers of the 1b model's shapes, bf16."""
    from dp_cost.flash import kernels as flash_kernels

    torch.manual_seed(2)
    widths = [(2048, 2048), (2048, 8192), (8192, 2048)]
    pairs = [
        (
            torch.randn(2, 512, d, device="cuda").bfloat16(),
            torch.randn(2, 512, p, device="cuda").bfloat16(),
        )
        for d, p in widths
    ]
    expected = sum(
        torch.einsum("btp,btd->bpd", G.double(), A.double()).square().sum((1, 2)) for A, G in pairs
    )
    norms = flash_kernels.gram_squared_norms_grouped(pairs)
    assert ((norms.double() - expected).abs().max() / expected.abs().max()).item() < 1e-4


def test_weighted_sums_on_cuda():
    """Clipped sums of kept bf16 per-sample gradients into fp32 .grad buffers, one launch:
    against an fp64 reference, overwriting one target and accumulating into another."""
    from dp_cost.flash import kernels as flash_kernels

    torch.manual_seed(3)
    weights = torch.rand(8, device="cuda")
    sources = [torch.randn(8, 2048, 2048, device="cuda").bfloat16() for _ in range(2)]
    targets = [torch.randn(2048, 2048, device="cuda") for _ in range(2)]
    expected = [
        targets[0].double() + torch.einsum("b,bpd->pd", weights.double(), sources[0].double()),
        torch.einsum("b,bpd->pd", weights.double(), sources[1].double()),
    ]
    flash_kernels.weighted_sums_(targets, sources, weights, [True, False])
    for target, reference in zip(targets, expected):
        error = ((target.double() - reference).abs().max() / reference.abs().max()).item()
        assert error < 1e-6


@pytest.mark.parametrize("B", [1, 8, 33])
def test_each_layers_row_norms_on_cuda(B):
    """Per-layer clipping's norms of kept bf16 per-sample gradients, each layer's own: 1b block
    shapes (thousands of partial rows a layer, many tiles of the segmented sum) beside a layer
    of one element and an empty one, a batch that is not a power of two; against fp64."""
    from dp_cost.flash import kernels as flash_kernels

    torch.manual_seed(9)
    shapes = [(2048, 2048), (8192, 2048), (1,), (0,), (2048, 8192)]
    sources = [torch.randn(B, *shape, device="cuda").bfloat16() for shape in shapes]
    each = flash_kernels.squared_row_norms_many(sources, each=True)
    assert each.shape == (len(sources), B) and each.dtype == torch.float32
    for norms, source in zip(each, sources):
        expected = source.double().flatten(1).square().sum(1)
        assert ((norms.double() - expected).abs() <= 1e-5 * expected.abs() + 1e-30).all()


def test_token_sums_on_cuda():
    """The biases' per-sample gradients of 1b-shaped bf16 output gradients (widths 2048 and
    8192, T = 512) and a narrow fp32 one, one launch, against an fp64 sum over tokens."""
    from dp_cost.flash import kernels as flash_kernels

    torch.manual_seed(5)
    sources = [torch.randn(8, 512, p, device="cuda").bfloat16() for p in (2048, 8192, 2048)]
    sums = flash_kernels.token_sums_many(sources)
    for source, total in zip(sources, sums):
        expected = source.double().sum(1)
        assert ((total.double() - expected).abs().max() / expected.abs().max()).item() < 1e-6
    narrow = torch.randn(2, 1000, 3, device="cuda")
    (total,) = flash_kernels.token_sums_many([narrow])
    expected = narrow.double().sum(1)
    assert ((total.double() - expected).abs().max() / expected.abs().max()).item() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("blocks", [(None, None), (16, 256)], ids=["whole_rows", "blocked"])
def test_norm_layer_grads_on_cuda(dtype, rms, blocks):
    """Per-sample LayerNorm / RMSNorm gradients at a 1b shape against fp64 autograd per sample
    (the closed form sum_t g_t * xhat_t is what autograd gives; checked in the CPU tests)."""
    from dp_cost.flash import kernels as flash_kernels

    torch.manual_seed(4)
    # B = 8: the whole-row kernel sums two tiles per program (the 1b model's shape)
    x = (torch.randn(8, 1024, 2048, device="cuda") + 1).to(dtype)
    g = torch.randn(8, 1024, 2048, device="cuda").to(dtype)
    weight, bias = flash_kernels.norm_layer_per_sample_grads(x, g, 1e-5, rms, *blocks)
    x64, g64 = x.double(), g.double()
    if rms:
        xhat = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5)
    else:
        var, mean = torch.var_mean(x64, -1, keepdim=True, correction=0)
        xhat = (x64 - mean) * torch.rsqrt(var + 1e-5)
    expected_weight, expected_bias = (g64 * xhat).sum(1), g64.sum(1)
    for actual, expected in ((weight, expected_weight), (bias, expected_bias)):
        error = ((actual.double() - expected).abs().max() / expected.abs().max()).item()
        assert error < 1e-5


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-4)])
@pytest.mark.parametrize("B, T, d, p", [(3, 257, 48, 48), (8, 512, 256, 1024), (2, 1, 64, 64)])
def test_direct_kernel_on_cuda(dtype, tolerance, B, T, d, p):
    """The direct route's fused kernel, autotuned, against brute force; flash's direct
    route matches too, through the kernel in bf16 and the torch path in fp32."""
    from dp_cost.flash import kernels as flash_kernels
    from dp_cost.flash.rules import linear as linear_rule

    fused = linear_rule.fused_norms_available(torch.empty(0, device="cuda", dtype=dtype))
    assert fused == (dtype == torch.bfloat16)
    torch.manual_seed(5)
    A = torch.randn(B, T, d, device="cuda").to(dtype)
    G = torch.randn(B, T, p, device="cuda").to(dtype)
    expected = torch.einsum("btp,btd->bpd", G.double(), A.double()).square().sum((1, 2))
    for norms in (
        flash_kernels.direct_squared_norms(A, G),
        linear_rule.direct_squared_norms(A, G, 2**20),
    ):
        error = ((norms.double() - expected).abs().max() / expected.abs().max()).item()
        assert error < tolerance


@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("route", ["gram", "product"])
def test_per_layer_rows_through_the_cuda_kernels_in_bf16(route, use_sink):
    """Per-layer clipping in bf16 on CUDA: each parameter's norms are a row of the grouped Gram
    launch (gram) or of the kept per-sample gradients' one launch (product), and its clipped sum
    reads its own row of random [P, B] factors in the shared fold or weighted-sum launch, on the
    .grad path and the sink path. Against fp32 per-sample gradients of the same bf16 model:
    within 1e-2, and more than 5e-2 from what the next parameter's row would give."""
    import copy

    from flash_reference import RecordingSink
    from torch import nn

    from dp_cost.flash.engine import FlashClipping

    torch.manual_seed(11)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 64), nn.Linear(64, 32)
    ).cuda()
    x = torch.randn(6, 48, 64, device="cuda")

    def losses(m, inputs):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(inputs).float().square().sum((1, 2))

    reference = copy.deepcopy(model)
    params = list(reference.parameters())
    per_sample = [  # [B, n] per parameter
        torch.stack(grads).flatten(1)
        for grads in zip(
            *[torch.autograd.grad(losses(reference, x[b : b + 1])[0], params) for b in range(6)]
        )
    ]
    expected_norms = torch.stack([g.double().square().sum(1) for g in per_sample])
    factors = torch.rand(len(params), 6, device="cuda")
    flash = FlashClipping(model, route=route)
    flash.backward(losses(model, x).sum())
    norms = flash.per_parameter_squared_norms().double()
    assert (
        (norms - expected_norms).abs().max(1).values / expected_norms.max(1).values
    ).max() < 1e-2
    sink = RecordingSink() if use_sink else None
    flash.accumulate_clipped_grads(factors, sink=sink)
    for i, (param, grads) in enumerate(zip(model.parameters(), per_sample, strict=True)):
        got = (sink.got[id(param)][0] if use_sink else param.grad).double().flatten()
        error = {}
        for which, row in (("own", factors[i]), ("next", factors[(i + 1) % len(params)])):
            expected = (row.double()[:, None] * grads.double()).sum(0)
            error[which] = ((got - expected).abs().max() / expected.abs().max()).item()
        assert error["own"] < 1e-2 < 5e-2 < error["next"], (route, tuple(param.shape), error)


def test_noise_transform_with_the_gpus_own_math_matches_fp64():
    """The compiled kernel forms ln, sin and cos with the GPU's approximations (the interpreted
    one, tests/flash/test_flash_kernels.py, with exact ones). Against the fp64 transform over
    2^22 random word triples and the tail's smallest uniforms. The radius r = sqrt(2 D) comes
    from D = 32 ln 2 - ln x, a difference of two numbers near 22.18 held in fp32 (an ulp is
    1.9e-6): that rounding and the approximate log's error, 4e-6 at most together, move r by
    4e-6 / r (at most sqrt(8e-6) = 2.8e-3, near r = 0); the angle's fp32 rounding and the
    approximate sine and cosine add about 7e-7 r. So each normal is within 1e-5 + 4e-6 / r
    where r > 0.1 and within 3e-3 everywhere, and in the tail (r > 5, where the law's grid
    allows 1e-5, noise/laws.py) each radius within 1e-6 relative. The exact fp32 functions
    share the first term."""
    import triton
    import triton.language as tl

    from dp_cost.flash.kernels.noise import uniform64_to_normal

    @triton.jit
    def transform(high, low, angle, out_cos, out_sin, BLOCK: tl.constexpr):
        lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        z_cos, z_sin = uniform64_to_normal(
            tl.load(high + lanes), tl.load(low + lanes), tl.load(angle + lanes), True
        )
        tl.store(out_cos + lanes, z_cos)
        tl.store(out_sin + lanes, z_sin)

    n = 2**22
    generator = torch.Generator(device="cuda").manual_seed(3)
    words = torch.randint(0, 2**32, (3, n), device="cuda", generator=generator)
    words[0, :1024] = 0  # the tail: u below 2^-32, radii from 6.66 to 9.49
    words[1, :1024] = torch.arange(1024, device="cuda") * 4_000_000
    high, low, angle = (w.to(torch.uint32) for w in words)
    out_cos, out_sin = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    transform[(n // 1024,)](high, low, angle, out_cos, out_sin, BLOCK=1024)
    x = words[0].double() + (words[1].double() + 0.5) * 2.0**-32
    radius = (2 * (32 * math.log(2) - x.log())).clamp(min=0).sqrt()
    theta = words[2].double() * (2 * math.pi / 2**32)
    error = torch.maximum(
        (out_cos.double() - radius * theta.cos()).abs(),
        (out_sin.double() - radius * theta.sin()).abs(),
    )
    got = torch.hypot(out_cos.double(), out_sin.double())
    tail = radius > 5
    print(
        f"largest error: {error.max().item():.2e}; beyond the bound where r > 0.1: "
        f"{(error - 4e-6 / radius)[radius > 0.1].max().item():.2e}; tail radius, relative "
        f"{((got - radius)[tail] / radius[tail]).abs().max().item():.2e}"
    )
    assert (error <= 1e-5 + 4e-6 / radius)[radius > 0.1].all()
    assert error.max().item() < 3e-3
    assert ((got - radius)[tail] / radius[tail]).abs().max().item() < 1e-6
    assert radius[:1024].min().item() > 6.6 and got[:1024].max().item() <= 9.4927
