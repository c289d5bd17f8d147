"""Flash's Triton Gram kernel against brute force on CPU, interpreted (TRITON_INTERPRET=1), with
explicit tiles: autotuning needs a GPU driver, so the autotuned path and bf16 (which the
interpreter cannot represent) are checked compiled, in tests/flash/test_flash_kernels_gpu.py."""

import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # set by conftest.py where there is no GPU
    pytest.skip("kernels compile here: test_flash_kernels_gpu.py", allow_module_level=True)
flash_kernels = pytest.importorskip("dp_cost.flash.kernels", reason="needs triton")
gram = pytest.importorskip("dp_cost.flash.kernels.gram", reason="needs triton")
noise_kernels = pytest.importorskip("dp_cost.flash.kernels.noise", reason="needs triton")
triton = pytest.importorskip("triton")
tl = triton.language
from dp_cost.noise.exact64 import box_muller64  # noqa: E402


def per_sample_squared_norms(A, G):
    """Brute force: form each sample's gradient G_b^T A_b in fp64 and square-sum it."""
    return torch.einsum("btp,btd->bpd", G.double(), A.double()).square().sum((1, 2))


def relative_error(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


def test_kernel_is_interpreted_on_cpu():
    assert type(gram._gram_pair_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize(
    "B, T, d, p, block_t",
    [
        (2, 1, 8, 8, 16),  # one token: a single diagonal pair, mostly masked
        (3, 257, 48, 48, 64),  # T one past a tile, d = p not a multiple of the K block
        (2, 70, 20, 33, 32),  # d != p, both smaller than the K block
        (1, 64, 16, 16, 32),  # B = 1, T an exact multiple of the tile
    ],
)
def test_fp32_matches_brute_force(B, T, d, p, block_t):
    torch.manual_seed(T)
    A, G = torch.randn(B, T, d), torch.randn(B, T, p)
    norms = flash_kernels.gram_squared_norms(A, G, block_t=block_t, block_k=32)
    assert norms.dtype == torch.float32 and norms.shape == (B,)
    assert relative_error(norms, per_sample_squared_norms(A, G)) < 1e-5


def test_strided_inputs_and_fp16():
    torch.manual_seed(1)
    A = torch.randn(2, 48, 70).mT  # [2, 70, 48], not contiguous
    G = torch.randn(2, 70, 40)
    expected = per_sample_squared_norms(A, G)
    assert relative_error(flash_kernels.gram_squared_norms(A, G, 32, 32), expected) < 1e-5
    # fp16 inputs on the low-precision path, fp32 accumulation: rounding of the inputs only
    half = flash_kernels.gram_squared_norms(A.half(), G.half(), 32, 32)
    assert relative_error(half, per_sample_squared_norms(A.half(), G.half())) < 1e-4


def test_shape_errors():
    with pytest.raises(ValueError, match="share a dtype"):
        flash_kernels.gram_squared_norms(torch.randn(1, 2, 3), torch.randn(1, 2, 3).half())
    with pytest.raises(ValueError, match=r"A \[B, T, d\]"):
        flash_kernels.gram_squared_norms(torch.randn(1, 2, 3), torch.randn(1, 3, 3))


def test_pair_index_covers_every_tile_pair_once():
    """The grid launches only the n(n+1)/2 pairs t <= s and each program recovers its (s, t)
    from a float square root: with 10 tiles (55 pairs, ten rows s of the triangle) every pair
    must be counted exactly once, which brute force over all token pairs checks: here every
    pair's share of the total is at least 1.9e-4, 19 times the tolerance, so one pair lost or
    counted twice fails (with 33 tiles the smallest share was 1.6e-5)."""
    torch.manual_seed(2)
    # the interpreter runs one program per pair (~30 ms each); the fp32 root is first off (and
    # corrected) past 10^7 pairs, so more rows of the triangle would exercise nothing new
    A, G = torch.randn(1, 10 * 16, 16), torch.randn(1, 10 * 16, 16)
    norms = flash_kernels.gram_squared_norms(A, G, block_t=16, block_k=16)
    assert relative_error(norms, per_sample_squared_norms(A, G)) < 1e-5


def noise_added(tensors, std, seed):
    """The noise the kernel adds to copies of ``tensors`` after torch.manual_seed(seed)."""
    copies = [t.clone() for t in tensors]
    torch.manual_seed(seed)
    flash_kernels.add_gaussian_noise_(copies, std)
    return [c - t for c, t in zip(copies, tensors)]


def test_noise_kernel_is_gaussian_independent_and_reproducible():
    """The noise of 65,000 elements (32 blocks, the last part-filled; the interpreter takes
    ~40 ms a block) drawn under two seeds, against N(0, 0.25): the two draws pooled (130,000
    normals) give the mean within 5 standard errors, the std within 1% (5.1 standard errors of
    0.00196) and the share past 3 sigma within 5, each failed by a true Gaussian with a
    probability under 1e-6."""
    torch.manual_seed(0)
    tensors = [torch.randn(65_000), torch.zeros(4097), torch.zeros(3)]
    big, edge, tiny = noise_added(tensors, 0.5, seed=1)
    other = noise_added(tensors, 0.5, seed=2)[0]
    assert not torch.equal(other, big)
    pooled = torch.cat([big, other])
    n = pooled.numel()
    assert abs(pooled.mean().item()) < 5 * 0.5 / n**0.5  # 5 standard errors
    assert abs(pooled.std().item() / 0.5 - 1) < 0.01  # the std's standard error is ~0.00196
    outside = (pooled.abs() > 1.5).float().mean().item()  # P(|z| > 3) = 0.0027 for a Gaussian
    assert abs(outside - 0.0027) < 5 * (0.0027 / n) ** 0.5
    # every element of every tensor drawn: block edges (4096 | 4097) and a 3-element tensor
    assert (edge != 0).all() and (tiny != 0).all()
    # tensors, blocks and seeds get independent draws, not the same stream
    assert abs(torch.corrcoef(torch.stack([big[:4097], edge]))[0, 1].item()) < 0.1
    assert abs(torch.corrcoef(torch.stack([big[:4096], big[4096:8192]]))[0, 1].item()) < 0.1
    assert abs(torch.corrcoef(torch.stack([big, other]))[0, 1].item()) < 0.1
    # a lane's eight normals (three Philox draws) go to the eight eighths of a block
    block = noise_kernels.NOISE_BLOCK
    whole = big.numel() // block  # 31 blocks: each eighth 7,936 normals (a correlation's sd 0.011)
    eighths = big[: whole * block].view(whole, 8, block // 8).transpose(0, 1).reshape(8, -1)
    assert (torch.corrcoef(eighths) - torch.eye(8)).abs().max().item() < 0.1
    again = noise_added(tensors, 0.5, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(again, (big, edge, tiny)))


@triton.jit
def _transform_kernel(high, low, angle, out_cos, out_sin, N: tl.constexpr):
    lanes = tl.arange(0, N)
    z_cos, z_sin = noise_kernels.uniform64_to_normal(
        tl.load(high + lanes), tl.load(low + lanes), tl.load(angle + lanes), False
    )
    tl.store(out_cos + lanes, z_cos)
    tl.store(out_sin + lanes, z_sin)


def test_noise_transform_reaches_the_64_bit_tail_unclamped():
    """The Box-Muller radius from two Philox words: at the smallest uniform, 2^-65, it is
    sqrt(130 ln 2) = 9.49 (Triton's randn stops at 5.68, clamping u at 1e-7); every uniform below
    1e-7 keeps its own radius (none clamped), and each radius equals the fp64 formula's."""
    words = [
        (0, 0), (0, 1), (0, 2), (0, 1000), (0, 2**31), (1, 0), (428, 0),  # u below 1e-7
        (2**20, 7), (2**31, 0), (2**32 - 1, 2**32 - 1),  # middle, and u rounding to 1
    ]  # fmt: skip
    n = 16
    high = torch.tensor([h for h, _ in words] + [0] * (n - len(words)), dtype=torch.int64)
    low = torch.tensor([lo for _, lo in words] + [0] * (n - len(words)), dtype=torch.int64)
    as_uint32 = lambda t: t.to(torch.uint32)  # noqa: E731
    angle = as_uint32(torch.zeros(n, dtype=torch.int64))
    out_cos, out_sin = torch.empty(n), torch.empty(n)
    _transform_kernel[(1,)](as_uint32(high), as_uint32(low), angle, out_cos, out_sin, N=n)
    u = (high.double() * 2.0**32 + low.double() + 0.5) / 2.0**64
    expected = (-2 * u.log()).sqrt()
    radius = out_cos[: len(words)].double()
    assert radius[0].item() == pytest.approx(math.sqrt(130 * math.log(2)), rel=1e-6)
    assert noise_kernels.Z_MAX == pytest.approx(9.4926, abs=1e-4)
    assert radius[0].item() == pytest.approx(noise_kernels.Z_MAX, rel=1e-6)
    assert torch.allclose(radius, expected[: len(words)], rtol=1e-5, atol=1e-6)
    # its torch twin (the law flash draws where the kernel does not run) gives the same pairs
    twin_cos, twin_sin = box_muller64(high, low, torch.zeros(n, dtype=torch.int64))
    assert torch.allclose(twin_cos.float(), out_cos, rtol=1e-5, atol=1e-6)
    assert torch.allclose(twin_sin.float(), out_sin, atol=1e-6)
    tail = radius[:7]  # all of these u lie below Triton's clamp: distinct, decreasing radii
    clamped = math.sqrt(-2 * math.log(1e-7))  # 5.68: the radius where Triton clamps
    assert (tail > clamped).all() and (tail[1:] < tail[:-1]).all()
    assert radius[-1].item() == 0.0 and out_sin.isfinite().all()  # u = 1: radius 0, no NaN


def test_grouped_layers_sum_to_brute_force():
    """Many layers in one launch (each layer's pointers and widths read from a table): the sum
    over layers of brute-force per-sample norms, fp16 inputs (bf16 cannot be interpreted). A
    layer whose rows are not feature-contiguous, or whose width breaks the alignment the kernel
    is promised (d = 20: widths must be multiples of 16), goes through the one-layer kernel
    instead; the total is the same."""
    torch.manual_seed(3)
    B, T = 2, 70
    widths = [(16, 48), (32, 64), (20, 24)]
    pairs = [(torch.randn(B, T, d).half(), torch.randn(B, T, p).half()) for d, p in widths]
    pairs.append((torch.randn(B, 32, T).half().mT, torch.randn(B, T, 16).half()))  # strided A
    assert [gram._groupable(A, G) for A, G in pairs] == [True, True, False, False]
    expected = sum(per_sample_squared_norms(A, G) for A, G in pairs)
    norms = flash_kernels.gram_squared_norms_grouped(pairs)
    assert norms.dtype == torch.float32 and relative_error(norms, expected) < 1e-4
    with pytest.raises(ValueError, match="one B, T and dtype"):
        flash_kernels.gram_squared_norms_grouped([pairs[0], (pairs[1][0][:1], pairs[1][1][:1])])


def test_grouped_layers_per_layer_match_each_brute_force():
    """per_layer=True: one launch, each layer's own per-sample norms [L, B] in the pairs' order
    (per-layer clipping), a layer the group kernel cannot take (d = 20) in its row too."""
    torch.manual_seed(6)
    B, T = 3, 33
    widths = [(16, 48), (20, 24), (32, 16)]
    pairs = [(torch.randn(B, T, d).half(), torch.randn(B, T, p).half()) for d, p in widths]
    norms = flash_kernels.gram_squared_norms_grouped(pairs, per_layer=True)
    assert norms.shape == (len(pairs), B) and norms.dtype == torch.float32
    for row, (A, G) in zip(norms, pairs, strict=True):
        assert relative_error(row, per_sample_squared_norms(A, G)) < 1e-4


def test_weighted_sums_take_each_source_its_row_of_weights():
    """rows: weights [P, B], source i weighted by row rows[i] (per-layer clipping), in one
    launch, against fp64 brute force; a [B] weight with rows (or [P, B] without) is refused."""
    torch.manual_seed(7)
    B = 3
    weights = torch.rand(4, B)
    sources = [torch.randn(B, 2049), torch.randn(B, 7).half(), torch.randn(B, 1)]
    targets = [torch.randn(2049), torch.randn(7), torch.randn(1)]
    rows, accumulate = [2, 0, 3], [True, False, True]
    expected = [
        (t.double() if acc else 0) + weights[r].double() @ s.double()
        for t, s, r, acc in zip(targets, sources, rows, accumulate)
    ]
    flash_kernels.weighted_sums_(targets, sources, weights, accumulate, rows)
    for target, reference in zip(targets, expected):
        assert relative_error(target, reference) < 1e-6
    with pytest.raises(ValueError, match="with rows"):
        flash_kernels.weighted_sums_(targets[:1], sources[:1], weights[0], [False], [0])
    with pytest.raises(ValueError, match="with rows"):
        flash_kernels.weighted_sums_(targets[:1], sources[:1], weights, [False])


def test_weighted_sums_match_brute_force():
    """Clipped sums of kept per-sample gradients, several tensors per launch: fp64 reference
    target (+)= w @ source, overwriting or accumulating per target, sizes around the block
    (2049 = one block + 1, a 1-element tensor), fp16 sources into fp32 targets, B = 1 and 3."""
    torch.manual_seed(4)
    for B in (1, 3):
        weights = torch.rand(B)
        sources = [torch.randn(B, 2049), torch.randn(B, 40, 125).half(), torch.randn(B, 1)]
        targets = [torch.randn(2049), torch.randn(40, 125), torch.randn(1)]
        accumulate = [True, False, True]
        expected = [
            (t.double() if acc else 0) + weights.double() @ s.double().flatten(1)
            for t, s, acc in zip(targets, sources, accumulate)
        ]
        flash_kernels.weighted_sums_(targets, sources, weights, accumulate)
        for target, reference in zip(targets, expected):
            assert relative_error(target.flatten(), reference) < 1e-6
    with pytest.raises(ValueError, match="does not match"):
        flash_kernels.weighted_sums_([torch.zeros(4)], [torch.zeros(2, 5)], torch.ones(2), [False])


def test_device_tables_are_kept_by_content_and_bounded():
    """A table asked for again with equal rows is the kept one; other rows (a flag, a pointer)
    give a table of those rows; at most DEVICE_TABLES_KEPT are held, the least recently used
    dropped first. Then weighted sums on the same tensors twice, overwriting then accumulating
    with other weights: the second launch must read its own flags, not the first's table."""
    from dp_cost.flash.kernels import common

    device = torch.device("cpu")
    first = common.int64_table([[7, 8, 1], [9, 10, 0]], device)
    assert common.int64_table([[7, 8, 1], [9, 10, 0]], device) is first
    other = common.int64_table([[7, 8, 1], [9, 10, 1]], device)
    assert other is not first and other.tolist() == [[7, 8, 1], [9, 10, 1]]
    assert common.int64_table([3, 4], device).tolist() == [3, 4]
    for n in range(2 * common.DEVICE_TABLES_KEPT):
        common.int64_table([n], device)
        assert len(common._DEVICE_TABLES) <= common.DEVICE_TABLES_KEPT
    assert common.int64_table([[7, 8, 1], [9, 10, 0]], device) is not first  # dropped

    torch.manual_seed(5)
    sources, targets = [torch.randn(3, 50), torch.randn(3, 7)], [torch.empty(50), torch.empty(7)]
    w1, w2 = torch.rand(3), torch.rand(3)
    flash_kernels.weighted_sums_(targets, sources, w1, [False, False])
    flash_kernels.weighted_sums_(targets, sources, w2, [True, True])
    for target, source in zip(targets, sources):
        assert relative_error(target, (w1 + w2).double() @ source.double()) < 1e-6


def check_token_sums(token_sums_many, sources, B):
    sums = token_sums_many(sources)
    for source, total in zip(sources, sums):
        assert total.dtype == torch.float32 and total.shape == (B, source.shape[2])
        assert relative_error(total, source.double().sum(1)) < 1e-6
    assert len({total.untyped_storage().data_ptr() for total in sums}) == len(sums)


@pytest.mark.parametrize("B", [1, 3])
def test_token_sums_match_fp64(B):
    """Biases' per-sample gradients, many layers per launch: each [B, p] in fp32 and its own
    storage against an fp64 sum over tokens; widths around the 128-column block (1, 127, 129,
    300), T not a multiple of the 64-token tile and past it, a strided source (every other
    sample of a bigger batch), fp16 and fp32 sources; a launch of aligned sources alone (widths
    and strides multiples of 8: the wide loads' path); empty lists and T = 0."""
    from dp_cost.flash.kernels import weighted_sums

    torch.manual_seed(6)
    for T, dtype in ((70, torch.float16), (5, torch.float32), (128, torch.float32)):
        wide = torch.randn(2 * B, T, 129).to(dtype)
        wide8 = torch.randn(2 * B, T, 136).to(dtype)
        aligned = [torch.randn(B, T, p).to(dtype) for p in (8, 136)] + [wide8[::2, :, 8:]]
        assert all(s.data_ptr() % 16 == 0 and s.stride(1) % 8 == 0 for s in aligned)
        unaligned = [torch.randn(B, T, p).to(dtype) for p in (1, 127, 300)] + [wide[::2]]
        for sources in (unaligned, aligned):
            check_token_sums(weighted_sums.token_sums_many, sources, B)
    assert weighted_sums.token_sums_many([]) == []
    empty = weighted_sums.token_sums_many([torch.randn(B, 0, 7)])
    assert torch.equal(empty[0], torch.zeros(B, 7))
    with pytest.raises(ValueError, match="one B, T"):
        weighted_sums.token_sums_many([torch.randn(B, 4, 3), torch.randn(B, 5, 3)])
    with pytest.raises(ValueError, match="columns contiguous"):
        weighted_sums.token_sums_many([torch.randn(B, 3, 4).mT])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_squared_row_norms_match_fp64(dtype, monkeypatch):
    """Per-sample squared norms summed over kept per-sample gradients of several sizes in one
    launch (one block + 1 elements per row, a row within one block, one element per row, seven
    blocks' worth; samples scaled apart so a row mixed up with another shows), against an fp64
    reference. Each source's own (per-layer clipping) sums its blocks' partials a tile of rows
    at a time: tiles of 2 rows at B = 3 and 8 at B = 1 here, so a source spans several tiles
    and a part-filled last."""
    from dp_cost.flash.kernels import weighted_sums

    torch.manual_seed(5)
    monkeypatch.setattr(weighted_sums, "SEGMENT_TILE", 8)
    block = flash_kernels.ROW_NORM_BLOCK
    for B in (1, 3):
        scale = torch.tensor([1.0, 10.0, 0.1])[:B]
        sources = [
            (torch.randn(B, *shape) * scale.view(B, *[1] * len(shape))).to(dtype)
            for shape in ((block + 1,), (4, 25), (1,), (7, block))
        ]
        expected = sum(x.double().flatten(1).square().sum(1) for x in sources)
        norms = flash_kernels.squared_row_norms_many(sources)
        assert norms.dtype == torch.float32 and norms.shape == (B,)
        assert relative_error(norms, expected) < 1e-6
        each = flash_kernels.squared_row_norms_many(
            sources + [torch.zeros(B, 0, dtype=dtype)], True
        )
        assert each.shape == (len(sources) + 1, B) and not each[-1].any()  # an empty source: 0
        for norms, x in zip(each, sources):  # each=True: each source's own norms
            assert relative_error(norms, x.double().flatten(1).square().sum(1)) < 1e-6
    assert torch.equal(flash_kernels.squared_row_norms_many([torch.zeros(0, 7)]), torch.zeros(0))
    with pytest.raises(ValueError, match="one dtype"):
        flash_kernels.squared_row_norms_many([torch.zeros(2, 3), torch.zeros(2, 3).half()])
    with pytest.raises(ValueError, match="one batch size"):
        flash_kernels.squared_row_norms_many([torch.zeros(2, 3), torch.zeros(3, 3)])
    with pytest.raises(ValueError, match="at least one"):
        flash_kernels.squared_row_norms_many([])


def per_sample_norm_layer_grads(x, g, eps, rms):
    """Brute force: autograd through the layer one sample at a time, in fp64."""
    d = x.shape[-1]
    weights, biases = [], []
    for x_b, g_b in zip(x.double(), g.double()):
        w = torch.ones(d, dtype=torch.float64, requires_grad=True)
        b = torch.zeros(d, dtype=torch.float64, requires_grad=True)
        if rms:
            y = torch.nn.functional.rms_norm(x_b, (d,), w, eps) + b
        else:
            y = torch.nn.functional.layer_norm(x_b, (d,), w, b, eps)
        grad_w, grad_b = torch.autograd.grad(y, (w, b), g_b)
        weights.append(grad_w)
        biases.append(grad_b)
    return torch.stack(weights), torch.stack(biases)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("blocks", [(8, 32), (None, None)], ids=["blocked", "whole_rows"])
@pytest.mark.parametrize(
    "B, T, d",
    [
        (2, 17, 48),  # T past a token tile, d past a feature block (and not a power of two)
        (1, 1, 5),  # one token, one partial block
        (3, 16, 32),  # exact multiples
    ],
)
def test_norm_layer_grads_match_autograd(rms, blocks, B, T, d):
    """Both kernels: the blocked one (rows reread per feature block) and the whole-row one
    (each row on chip once; here 128 / 1024 / 256 tokens per tile for d = 48 / 5 / 32)."""
    torch.manual_seed(T + d)
    # rows far from zero mean: the variance is taken around the mean, not as E[x^2] - mean^2
    x = torch.randn(B, T, 2 * d)[:, :, :d] * 3 + 50  # token stride 2d: strided rows
    g = torch.randn(B, T, d)
    block_t, block_d = blocks
    weight, bias = flash_kernels.norm_layer_per_sample_grads(
        x, g, eps=1e-5, rms=rms, block_t=block_t, block_d=block_d
    )
    expected_weight, expected_bias = per_sample_norm_layer_grads(x, g, 1e-5, rms)
    assert weight.dtype == torch.float32 and weight.shape == (B, d)
    assert weight.is_contiguous() and bias.is_contiguous()  # the clipped-sum kernel takes them
    assert relative_error(weight, expected_weight) < 1e-4
    assert relative_error(bias, expected_bias) < 1e-5


@pytest.mark.parametrize(
    "B, T, d, p, blocks",
    [
        (2, 1, 8, 8, (16, 16, 16)),  # one token, a single masked tile
        (3, 257, 48, 48, (32, 32, 16)),  # T past a token block, d = p past an output tile
        (2, 70, 20, 33, (16, 32, 32)),  # d != p, rectangular tiles
    ],
)
def test_direct_kernel_matches_brute_force(B, T, d, p, blocks):
    torch.manual_seed(T + p)
    A, G = torch.randn(B, T, d), torch.randn(B, T, p)
    norms = flash_kernels.direct_squared_norms(A, G, blocks=blocks)
    assert norms.dtype == torch.float32
    assert relative_error(norms, per_sample_squared_norms(A, G)) < 1e-5
    # strided A (token-major storage read through a transpose) and fp16 inputs
    A_strided = torch.randn(B, d, T).mT
    norms = flash_kernels.direct_squared_norms(A_strided.half(), G.half(), blocks=blocks)
    expected = per_sample_squared_norms(A_strided.half(), G.half())
    assert relative_error(norms, expected) < 1e-4


@pytest.mark.parametrize("rms", [False, True])
def test_norm_layer_grads_many_match_autograd(rms):
    """Several layers in one launch (the layer a grid axis, pointers from a table): each layer's
    per-sample gradients as autograd gives them, one x strided, T past a tile."""
    torch.manual_seed(11)
    B, T, d = 2, 37, 48
    pairs = [
        (torch.randn(B, T, 2 * d)[:, :, :d] * 3 + 50 if i == 1 else torch.randn(B, T, d),
         torch.randn(B, T, d))
        for i in range(3)
    ]  # fmt: skip
    grouped = flash_kernels.norm_layer_per_sample_grads_many(pairs, 1e-5, rms)
    for (x, g), (weight, bias) in zip(pairs, grouped, strict=True):
        expected_weight, expected_bias = per_sample_norm_layer_grads(x, g, 1e-5, rms)
        assert weight.shape == (B, d) and weight.is_contiguous() and bias.is_contiguous()
        assert relative_error(weight, expected_weight) < 1e-4
        assert relative_error(bias, expected_bias) < 1e-5


def test_norm_layer_grads_many_splits_past_the_grid(monkeypatch):
    """More layers than CUDA's grid z axis holds: several launches, results in order."""
    from dp_cost.flash.kernels import norm_layer

    monkeypatch.setattr(norm_layer, "MAX_LAYERS_PER_LAUNCH", 2)
    torch.manual_seed(12)
    pairs = [(torch.randn(2, 9, 16), torch.randn(2, 9, 16)) for _ in range(5)]
    grouped = flash_kernels.norm_layer_per_sample_grads_many(pairs, 1e-5, False)
    assert len(grouped) == 5
    for (x, g), (weight, bias) in zip(pairs, grouped, strict=True):
        expected_weight, expected_bias = per_sample_norm_layer_grads(x, g, 1e-5, False)
        assert relative_error(weight, expected_weight) < 1e-4
        assert relative_error(bias, expected_bias) < 1e-5


def test_norm_layer_grads_many_refuses_mixed_shapes():
    x, y = torch.randn(2, 4, 8), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="one shape"):
        flash_kernels.norm_layer_per_sample_grads_many([(x, x), (y, y)], 1e-5, False)


@pytest.mark.parametrize("T, d", [(5, 8192), (300, 48)])
def test_norm_layer_whole_rows_several_tiles_per_program(T, d, monkeypatch):
    """The whole-row kernel with each program summing two consecutive tiles in registers: at
    d = 8192 (one token per tile) T = 5 gives 3 programs a sample, the last one's second tile
    past T (masked); at d = 48 (128-token tiles) T = 300 gives 2, the second's first tile part
    past T and its second wholly. The tiling picks two tiles a program by itself only from 2048
    tiles over the batch (B = 2, T = 1029 at d = 8192: 1030 programs of 8192 elements, ~45 s
    interpreted), checked without a launch; the kernel then runs at small T with that tiling
    asked for."""
    from dp_cost.flash.kernels import norm_layer

    tiles = norm_layer._whole_row_tiles
    assert tiles(2, 1029, 8192) == (1, 2, 515)  # (tokens a tile, tiles a program, programs)

    def two_tiles_per_program(B, T, D):
        block_t, _, _ = tiles(B, T, D)
        return block_t, 2, triton.cdiv(triton.cdiv(T, block_t), 2)

    monkeypatch.setattr(norm_layer, "_whole_row_tiles", two_tiles_per_program)
    torch.manual_seed(8)
    B = 2
    x, g = torch.randn(B, T, d) * 3 + 50, torch.randn(B, T, d)
    weight, bias = flash_kernels.norm_layer_per_sample_grads(x, g, eps=1e-5, rms=False)
    expected_weight, expected_bias = per_sample_norm_layer_grads(x, g, 1e-5, False)
    assert relative_error(weight, expected_weight) < 1e-5
    assert relative_error(bias, expected_bias) < 1e-5


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("blocks", [(8, 32), (None, None)], ids=["blocked", "whole_rows"])
def test_norm_layer_grads_with_zero_eps(rms, blocks):
    """eps = 0 is a legal LayerNorm/RMSNorm: the masked rows of a partial token tile (T = 17
    with 8- or 128-token tiles) have zero variance, and must not turn into inf * 0 = NaN."""
    torch.manual_seed(7)
    x, g = torch.randn(2, 17, 48), torch.randn(2, 17, 48)
    block_t, block_d = blocks
    weight, bias = flash_kernels.norm_layer_per_sample_grads(
        x, g, eps=0.0, rms=rms, block_t=block_t, block_d=block_d
    )
    expected_weight, expected_bias = per_sample_norm_layer_grads(x, g, 0.0, rms)
    assert torch.isfinite(weight).all()
    assert relative_error(weight, expected_weight) < 1e-4
    assert relative_error(bias, expected_bias) < 1e-5
