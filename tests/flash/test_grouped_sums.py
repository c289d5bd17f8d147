"""The sink path's clipped sums of kept per-sample gradients made a group at a time (one
weighted-sums launch per group of up to SUMMED_AT_ONCE_BYTES of sums), against brute force:
c_b * g_b summed over the samples in fp64. The CUDA path runs here with the Triton kernel
interpreted (TRITON_INTERPRET=1) and its support check widened to CPU tensors."""

import os
import weakref

import pytest
import torch
from flash_reference import RecordingSink, assert_close, make_batch, make_model
from flash_reference import sample_losses as losses_of
from torch import nn

from dp_cost.flash import clip
from dp_cost.flash.clip import ClipFactors, ClipFactorsByParameter, DeviceIndices
from dp_cost.flash.engine import FlashClipping


def counted_kernels(monkeypatch, on_cpu: bool = True):
    """flash.kernels with weighted_sums_ counted: each call's number of sources, and which
    earlier sources were still alive at the call. ``on_cpu``: interpreted, the support check
    without its CUDA condition."""
    kernels = pytest.importorskip("dp_cost.flash.kernels", reason="needs triton")
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel is interpreted on the CPU only")
    calls, seen, inner = [], [], kernels.weighted_sums_

    def counted(targets, sources, weights, accumulate, rows=None):
        calls.append({"sources": len(sources), "alive": [r() is not None for r in seen]})
        seen.extend(weakref.ref(s if s._base is None else s._base) for s in sources)
        return inner(targets, sources, weights, accumulate, rows)

    monkeypatch.setattr(kernels, "weighted_sums_", counted)
    if on_cpu:
        monkeypatch.setattr(clip, "triton_kernels", lambda: kernels)
        monkeypatch.setattr(
            kernels,
            "weighted_sums_supported_each",
            lambda pairs: [s.dtype in clip.KERNEL_DTYPES and t.dtype in clip.KERNEL_DTYPES
                           for t, s in pairs],
        )  # fmt: skip
    return calls


def expected_sum(grad, c):
    return (c.double()[:, None] * grad.double().flatten(1)).sum(0)


@pytest.mark.parametrize("per_layer", [False, True])
def test_weighted_sums_of_many_tensors_in_one_call_match_brute_force(monkeypatch, per_layer):
    """Mixed dtypes and shapes (one of 70,000 columns: many blocks), samples scaled apart so
    a row or tensor mixed up with another shows; fp32 sums whatever the gradients' dtype, and
    each per-layer tensor its own row of c."""
    calls = counted_kernels(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    scale = torch.tensor([1.0, 20.0, 0.05])
    shapes = [(3, 7, 5), (3, 1), (3, 70000), (3, 2, 2, 2)]
    grads = [
        (torch.randn(s, generator=gen) * scale.view(3, *[1] * (len(s) - 1))).to(dtype).flatten(1)
        for s in shapes
        for dtype in (torch.float32, torch.bfloat16)
    ]
    c = torch.rand(len(grads) if per_layer else 1, 3, generator=gen)
    rows = list(range(len(grads)))[::-1] if per_layer else None
    factors = ClipFactors(c if per_layer else c[0])
    sums = clip.weighted_sums(grads, factors, rows)
    assert [call["sources"] for call in calls] == [len(grads)]  # one call for all
    for i, (got, grad) in enumerate(zip(sums, grads, strict=True)):
        assert got.dtype == torch.float32 and got.shape == (grad.shape[1],)
        assert_close(got.double(), expected_sum(grad, c[rows[i]] if per_layer else c[0]), 1e-6)


def kept_list(gen, specs):
    """(parameter, per-sample gradient [B, *shape]) for each (B, shape, dtype)."""
    return [
        (
            nn.Parameter(torch.zeros(shape, dtype=dtype)),
            torch.randn(B, *shape, generator=gen).to(dtype),
        )
        for B, shape, dtype in specs
    ]


def test_kept_gradients_are_summed_in_groups_within_the_byte_budget(monkeypatch):
    """Groups of about SUMMED_AT_ONCE_BYTES of fp32 sums (the last gradient in a group takes it
    past), a call each, each group's per-sample gradients dropped before the next group's call;
    a dtype the kernel does not take summed on its own; a gradient whose sum would be larger than
    itself (one bf16 sample: 2 bytes an element against the sum's 4) stays in ``kept``, in
    order, to be summed when its layer comes."""
    calls = counted_kernels(monkeypatch)
    monkeypatch.setattr(clip, "SUMMED_AT_ONCE_BYTES", 4 * 1000)  # 1,000 fp32 elements
    gen = torch.Generator().manual_seed(5)
    specs = [
        (2, (20, 30), torch.float32), (1, (700,), torch.bfloat16), (2, (400,), torch.bfloat16),
        (2, (300,), torch.float32), (1, (50,), torch.bfloat16), (2, (900,), torch.float32),
        (2, (5,), torch.float64),
    ]  # fmt: skip
    kept = kept_list(gen, specs)
    expected = {
        id(p): expected_sum(g, c) for (p, g), c in zip(kept, [torch.tensor([0.3, 0.9])] * 7)
    }
    stays = [kept[1][0], kept[4][0]]
    c = ClipFactorsByParameter(torch.tensor([0.3, 0.9]), {}, DeviceIndices())
    sums = clip.sums_in_groups(kept, c)
    assert [p for p, _ in kept] == stays
    assert set(sums) == set(expected) - set(map(id, stays))
    for key, got in sums.items():
        assert_close(got.double(), expected[key], 1e-6)
    # From the end: (5,) fp64 (not the kernel's: summed on its own), (900,), (300,) reach
    # 1,205 elements -> a call of 2; then (400,) and (20, 30) reach 1,000 -> a call of 2.
    assert [call["sources"] for call in calls] == [2, 2]
    assert not any(calls[1]["alive"])  # the first group's gradients were dropped


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("B", [1, 3])
def test_the_sink_path_hands_over_grouped_sums_as_brute_force(monkeypatch, per_layer, B):
    """The tiny LM with every kept per-sample gradient one by one (no concatenation) and the
    kernel's path: sums made in several groups, handed over in the parameters' reverse order,
    each equal to the brute-force clipped sum (flat, or per-layer with each parameter's own
    factors, rows in flash.params' order)."""
    check_grouped_sink(monkeypatch, per_layer, B, "cpu", rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_layer", [False, True])
def test_on_cuda_the_sink_paths_grouped_sums_are_the_kernels_and_match_brute_force(
    monkeypatch, per_layer
):
    """The same on CUDA, the kernels compiled and their own support check asked."""
    check_grouped_sink(monkeypatch, per_layer, 4, "cuda", rtol=1e-4)


def check_grouped_sink(monkeypatch, per_layer: bool, B: int, device: str, rtol: float) -> None:
    from dp_cost.flash import engine

    calls = counted_kernels(monkeypatch, on_cpu=device == "cpu")
    monkeypatch.setattr(engine, "SMALL_PER_SAMPLE_NUMEL", 0)
    monkeypatch.setattr(clip, "SUMMED_AT_ONCE_BYTES", 4 * 150)
    model, reference = make_model(torch.float32).to(device), make_model(torch.float32).to(device)
    ids, targets = (t.to(device) for t in make_batch(B, 7, seed=B + 1))
    flash = FlashClipping(model, route="product")
    flash.backward(losses_of(model(ids), targets).sum())
    if per_layer:
        norms = flash.per_parameter_squared_norms().sqrt()
    else:
        norms = flash.per_sample_squared_norms().sqrt()
    factors = (0.5 / (norms + 1e-6)).clamp(max=1.0)
    sink = RecordingSink()
    flash.accumulate_clipped_grads(factors, sink=sink)
    flash.release()
    assert 1 < len(calls) < sum(call["sources"] for call in calls)  # groups, not one each
    assert [id(p) for p in sink.order] == [id(p) for p in reversed(flash.params)]
    names = {id(p): name for name, p in model.named_parameters()}
    per_sample = dict(zip(names.values(), per_sample_by_parameter(reference, ids, targets)))
    for row, param in enumerate(flash.params):
        (got,) = sink.got[id(param)]
        c = factors[row] if per_layer else factors
        assert_close(got.double().flatten(), expected_sum(per_sample[names[id(param)]], c), rtol)


def per_sample_by_parameter(model, ids, targets) -> list:
    """Each parameter's per-sample gradients [B, numel], in model.parameters()' order, by
    autograd one sample at a time."""
    params = list(model.parameters())
    grads = [
        torch.autograd.grad(losses_of(model(ids[b : b + 1]), targets[b : b + 1]).sum(), params)
        for b in range(len(ids))
    ]
    return [torch.stack([g[i].flatten() for g in grads]) for i in range(len(params))]
