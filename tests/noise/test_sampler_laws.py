"""The noise samplers' laws against what they do: the tail bound against a brute force over
splits of the shift on a small grid, torch's CPU sampler's exits counted by sampling (and
torch's CUDA sampler's on a GPU), and the 64-bit transform's law."""

import functools
import itertools
import math

import pytest
import torch
from scipy import stats

from dp_cost.noise import laws
from dp_cost.noise.exact64 import add_exact64_noise_, box_muller64, exact64_normal


@functools.cache
def radius_grid(bits: int, offset: float) -> torch.Tensor:
    """Every radius a pair of a ``bits``-bit law takes, one per point of its uniforms' grid
    (computed once a law: the brute force below asks for thousands of shifts)."""
    ks = torch.arange(2**bits, dtype=torch.float64)
    return (-2 * ((ks + offset) * 2.0**-bits).log()).sqrt()


def exact_pair_exit(law: laws.NoiseLaw, shift: float) -> float:
    """P(r > z_max - shift) for one pair of ``law``, by enumerating its whole radius grid."""
    if shift <= 0:
        return 0.0
    radii = radius_grid(law.bits, law.offset)
    return (radii > law.z_max - shift).double().mean().item()


@pytest.mark.parametrize("shift", [0.05, 0.3, 1.0, 2.5])
def test_exit_bound_covers_every_split_on_a_small_grid(shift):
    """On a 12-bit law (every radius enumerable) the bound is at least sum_p P(r > z_max - a_p)
    at every split of a brute-force grid over 3 pairs, and within 2x of the worst one found
    when the shift is spread over many pairs (each pair then exits only from the atom)."""
    law = laws.NoiseLaw("a 12-bit test law", 12, 1.0)
    bound = laws.exit_bound(law, 3, shift)
    steps = 30
    for i, j in itertools.product(range(steps + 1), repeat=2):
        a1, a2 = shift * i / steps, shift * j / steps
        if a1**2 + a2**2 > shift**2:
            continue
        a3 = math.sqrt(max(shift**2 - a1**2 - a2**2, 0.0))
        total = sum(exact_pair_exit(law, a) for a in (a1, a2, a3))
        assert total <= bound * (1 + 1e-12), (a1, a2, a3)
    pairs = 10**4
    spread = pairs * exact_pair_exit(law, shift / math.sqrt(pairs))
    assert spread <= laws.exit_bound(law, pairs, shift) <= 2 * spread or spread >= 0.5


def test_each_laws_z_max_is_its_smallest_uniforms_radius():
    """Read from the sources: torch's CPU uniform 1 - x / 2^24 (z_max 5.7681, the radius the
    CPU sampler's largest draws take), curand's (x + 1/2) / 2^32, the 64-bit transform's
    (x + 1/2) / 2^64 (the Triton kernel's bound)."""
    assert laws.NOISE_LAWS["torch_cpu"].z_max == pytest.approx(5.76811, abs=1e-5)
    assert laws.NOISE_LAWS["torch_cuda"].z_max == pytest.approx(math.sqrt(66 * math.log(2)))
    assert laws.NOISE_LAWS["exact64"].z_max == pytest.approx(math.sqrt(130 * math.log(2)))
    # a shift spread over d / 2 pairs: the atom alone puts the 1b model's CUDA term near 0.14
    cuda = laws.exit_bound(laws.NOISE_LAWS["torch_cuda"], 1_171_795_968 // 2, 1.0)
    assert 1_171_795_968 / 2 * 2.0**-32 <= cuda < 0.15
    assert laws.exit_bound(laws.NOISE_LAWS["exact64"], 1_171_795_968 // 2, 1.0) < 1e-10


def pair_coordinates(z: torch.Tensor, partner: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two coordinates of each Box-Muller pair, as views of ``z``: torch's CPU sampler pairs
    element j with j + 8 in every block of 16 (normal_fill_16), CUDA's element i with i + T (T
    its threads)."""
    blocks = z.view(-1, 2, partner)
    return blocks[:, 0], blocks[:, 1]


def count_exits(draw, steps: int, dimension: int, partner: int, law: laws.NoiseLaw, shift):
    """Of ``steps`` draws of ``dimension`` coordinates, how many moved by ``shift`` spread alike
    over every pair (outward along (1, 1)) left the support (a pair's radius beyond z_max);
    and the largest unmoved radius seen (the support's edge is never crossed by the draw)."""
    pairs = dimension // 2
    move = shift / math.sqrt(pairs) / math.sqrt(2)  # per coordinate
    edge = law.z_max + laws.RADIUS_SLACK / 10
    near_edge = (edge - 2 * move) ** 2  # only pairs beyond this squared radius can leave
    exits, largest = 0, 0.0
    for _ in range(steps):
        first, second = pair_coordinates(draw(dimension), partner)
        squared = first.square().add_(second.square())  # the pairs' squared radii, in one pass
        top = squared.max()
        largest = max(largest, top.sqrt().item())
        if top.item() > near_edge:  # some pair is near the edge: which ones, and does one leave
            near = squared > near_edge
            moved = (first[near] + move).square() + (second[near] + move).square()
            exits += bool((moved > edge**2).any())
    return exits, largest


def assert_exit_rate_within_bound(exits: int, steps: int, bound: float):
    """The bound holds (the observed rate's 99.9% lower confidence limit is below it) and is
    not loose by more than 4x (the upper limit is above a quarter of it)."""
    lower = stats.beta.ppf(0.001, exits, steps - exits + 1) if exits else 0.0
    upper = stats.beta.ppf(0.999, exits + 1, steps - exits)
    assert lower <= bound <= 4 * upper, (exits, steps, bound)


def test_torch_cpu_sampler_leaves_its_support_as_its_law_says():
    """torch.normal on the CPU, 2^22 coordinates moved by 1 std in all, spread over every pair:
    about one step in 16 leaves the support (its top atom, probability 2^-24 a pair, half of
    its angles outward) — an order above what a law cut continuously at z_max allows."""
    torch.manual_seed(2026)
    law, dimension, steps = laws.NOISE_LAWS["torch_cpu"], 2**22, 120
    exits, largest = count_exits(
        lambda d: torch.normal(0.0, 1.0, size=(d,)), steps, dimension, 8, law, 1.0
    )
    assert largest <= law.z_max + laws.RADIUS_SLACK  # the pairs are the sampler's
    bound = laws.exit_bound(law, dimension // 2, 1.0)
    assert bound == pytest.approx(2**21 * 2.0**-24, rel=1e-3)  # the atom's term
    assert_exit_rate_within_bound(exits, steps, bound)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_cuda_sampler_leaves_its_support_as_its_law_says():
    """torch.normal on CUDA: curand_normal4 gives each thread's four normals to elements i, i +
    T, i + 2T, i + 3T (T = the kernel's threads: 256 a block, 8 blocks an SM on an H200/H100),
    pairs (i, i + T); 1 std spread over 5.4e8 pairs leaves the support in about 6% of steps."""
    props = torch.cuda.get_device_properties(0)
    threads = props.multi_processor_count * (props.max_threads_per_multi_processor // 256) * 256
    dimension, steps = 4 * threads * (2**30 // (4 * threads)), 300
    law = laws.NOISE_LAWS["torch_cuda"]
    torch.manual_seed(2026)
    exits, largest = count_exits(
        lambda d: torch.normal(0.0, 1.0, size=(d,), device="cuda"),
        steps, dimension, threads, law, 1.0,
    )  # fmt: skip
    assert largest <= law.z_max + laws.RADIUS_SLACK
    assert_exit_rate_within_bound(exits, steps, laws.exit_bound(law, dimension // 2, 1.0))


def test_exact64_transform_reaches_its_top_and_is_gaussian():
    """The torch twin of flash's kernel: words (0, 0) give the top radius sqrt(130 ln 2); a
    million draws have the Gaussian's mean, variance and tail beyond 3 (within 5 sigma)."""
    zero = torch.zeros(1, dtype=torch.int64)
    z_cos, z_sin = box_muller64(zero, zero, zero)
    assert z_cos.item() == pytest.approx(laws.NOISE_LAWS["exact64"].z_max, rel=1e-7)  # fp32
    assert z_sin.item() == 0.0
    torch.manual_seed(0)
    z = exact64_normal(10**6 + 1).double()  # odd: the last pair's second normal dropped
    assert z.shape == (10**6 + 1,)
    n = z.numel()
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / n)
    beyond = (z.abs() > 3).double().mean().item()
    expected = 2 * stats.norm.sf(3)
    assert abs(beyond - expected) < 5 * math.sqrt(expected / n)


def test_exact64_noise_is_added_in_bounded_pieces_to_any_tensor():
    """add_exact64_noise_ adds std * N(0, 1) to every element of every tensor given: one longer
    than a draw's piece, small ones drawn together, a bf16 one, and a non-contiguous view
    (leaving the rest of its base alone); the draws of different tensors are independent."""
    torch.manual_seed(1)
    long, small, half = torch.zeros(2**21 + 3), torch.zeros(5000), torch.zeros(4096).bfloat16()
    base = torch.zeros(64, 64)
    add_exact64_noise_([long, small, half, base.t()[:, :32]], 0.5)
    assert (long != 0).all() and abs(long.std().item() - 0.5) < 0.01
    assert abs(torch.corrcoef(torch.stack([long[: 2**20], long[2**20 : 2**21]]))[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack([long[:5000], small]))[0, 1]) < 0.06
    assert (small != 0).all() and abs(small.std().item() - 0.5) < 0.03
    assert abs(half.float().std().item() - 0.5) < 0.04
    assert (base[:32] != 0).all() and not base[32:].any()
