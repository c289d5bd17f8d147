"""Clip factors, the per-sample norms and clipped sums of kept per-sample gradients (rows of
[B, n]), the clipped sums written into .grad, and the Gaussian noise."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch._utils import _unflatten_dense_tensors

from dp_cost.flash.fused import triton_kernels
from dp_cost.flash.precision import accumulation_dtype, wider
from dp_cost.noise.exact64 import add_exact64_noise_

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the weighted sums' (Triton's)
# The sink path's kept per-sample gradients are summed in groups of up to this many bytes of fp32
# sums, a launch each (sums_in_groups): the most the grouping adds to the clipping's peak.
SUMMED_AT_ONCE_BYTES = 128 * 2**20
CPU_ROW_CHUNK = 2**16  # columns per chunk: bounds the temporary of the CPU sum of squares


def squared_row_norms(x: Tensor) -> Tensor:
    """||x_b||^2 of each row of [B, n], accumulated in fp32 or wider, with no copy of the rows.

    CUDA: vector_norm's tree reduction. CPU: vector_norm's fp32 reduction drifts on long rows
    (6e-5 relative at 2M elements, 2e-5 on the tiny model's output layer), so a sum of squares
    per chunk of columns (pairwise, ~1e-8), the chunks summed in fp64.
    """
    if x.device.type != "cpu" or is_fake(x):  # a planned step's fake tensors: CUDA's memory
        return torch.linalg.vector_norm(x, dim=1, dtype=accumulation_dtype(x)).square()
    chunks = x.split(CPU_ROW_CHUNK, dim=1)
    total = sum(c.to(accumulation_dtype(x)).square().sum(1, dtype=torch.float64) for c in chunks)
    return total.to(accumulation_dtype(x))


def squared_row_norms_many(grads: list[Tensor]) -> list[Tensor]:
    """The sum over ``grads`` of squared_row_norms(grad.flatten(1)), [B], one term per (dtype,
    device): one launch over all their sample rows, not a reduction per tensor (LoRA keeps
    hundreds of per-sample gradients per chunk and flash is launch/CPU-bound there). CUDA:
    flash.kernels.squared_row_norms_many where it takes them (the clipped sums' conditions),
    else a multi-tensor norm. CPU accumulates in fp64 (fp32 drifts on long rows, see
    squared_row_norms)."""
    groups: dict[tuple, list[Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.dtype, grad.device), []).append(grad)
    terms = []
    kernels = triton_kernels()
    for members in groups.values():
        acc = accumulation_dtype(members[0])
        pairs = [(g, g) for g in members]
        if kernels is not None and all(kernels.weighted_sums_supported_each(pairs)):
            terms.append(kernels.squared_row_norms_many(members).to(acc))
            continue
        rows = [row for grad in members for row in grad.unbind(0)]
        on_cpu = members[0].device.type == "cpu"
        norms = torch._foreach_norm(rows, 2, dtype=torch.float64 if on_cpu else acc)
        terms.append(torch.stack(norms).view(len(members), -1).square().sum(0).to(acc))
    return terms


def squared_row_norms_each(grads: list[Tensor]) -> Tensor:
    """squared_row_norms of each of ``grads`` [B, ...] (rows: its flattened samples), a row
    each in order, [len(grads), B] (per-layer clipping's norms of kept per-sample gradients):
    on CUDA one launch per dtype for all of them (flash.kernels.squared_row_norms_many), else a
    reduction each."""
    terms: list = [None] * len(grads)
    groups: dict[tuple, list[int]] = {}
    kernels = triton_kernels()
    pairs = [(grad, grad) for grad in grads]
    supported = kernels.weighted_sums_supported_each(pairs) if kernels is not None else ()
    for i, grad in enumerate(grads):
        if supported and supported[i]:
            groups.setdefault((grad.dtype, grad.device), []).append(i)
        else:
            terms[i] = squared_row_norms(grad if grad.dim() == 2 else grad.flatten(1))
    for members in groups.values():
        norms = kernels.squared_row_norms_many([grads[i] for i in members], each=True)
        norms = norms.to(accumulation_dtype(grads[members[0]]))
        if len(members) == len(grads):  # every one in one launch, in order
            return norms
        for i, norm in zip(members, norms.unbind(0)):
            terms[i] = norm
    return stacked(terms)


def stacked(terms: list[Tensor]) -> Tensor:
    """[B] terms as the rows of one [n, B], in the widest of their dtypes."""
    dtype = functools.reduce(wider, [term.dtype for term in terms])
    return torch.stack([term.to(dtype) for term in terms])


def round_down(c: Tensor, dtype: torch.dtype) -> Tensor:
    """Clip factors in ``dtype``, rounded toward zero: a factor rounded up (bf16 keeps 8 bits)
    would let a sample's clipped gradient exceed C, the bound DP's noise is calibrated to."""
    low = c.to(dtype)
    if dtype == c.dtype:
        return low
    return torch.where(low.to(c.dtype) > c, torch.nextafter(low, torch.zeros_like(low)), low)


class ClipFactors:
    """One chunk's clip factors c [B], with the casts the layers need made once per chunk (not
    once per layer: flash is launch-bound at short sequences). Per-layer clipping: c [P, B], a
    row per parameter (a rule's calls then come with their rows; ``row(r)``: one row's)."""

    def __init__(self, c: Tensor):
        self.c = c
        self._cast: dict[torch.dtype, Tensor] = {}
        # per_token's, by (dtype, tokens): looked up by a loop over layers with no call
        self.cached_per_token: dict[tuple, Tensor] = {}
        self._schedule: tuple[Tensor, ...] | None = None
        self._rows: dict[int, ClipFactors] = {}

    def row(self, index: int) -> ClipFactors:
        """The factors of row ``index`` of a [P, B] c, made once per chunk."""
        if index not in self._rows:
            self._rows[index] = ClipFactors(self.c[index])
        return self._rows[index]

    def to(self, dtype: torch.dtype) -> Tensor:
        """c in ``dtype``, rounded toward zero (see round_down). In 16-bit dtypes also shrunk by
        one ulp at 1 (2u; bf16: 2^-7): the operand the clipped GEMM reads is c * g rounded to
        nearest, up to u larger than c * g in each element, so a sample's clipped contribution
        could exceed C by that much (0.4% measured with g and c at a rounding tie). Costs 0.8%
        of a clipped gradient where a 16-bit GEMM reads c * g (CPU); fp32 stays exact, and so
        do the CUDA kernels, which take fp32 c (accumulate_weighted_sums, and the Linear's
        clipped GEMM: gemm_schedule)."""
        if dtype not in self._cast:
            c = self.c
            if torch.finfo(dtype).bits == 16:
                c = c * (1 - torch.finfo(dtype).eps)
            self._cast[dtype] = round_down(c, dtype)
        return self._cast[dtype]

    def gemm_schedule(self) -> tuple[Tensor, ...]:
        """dp_cost.flash.kernels.clip_schedule(c): the fp32 clip factors in the order the Linear's
        clipped GEMM kernel takes the samples, made once per chunk."""
        if self._schedule is None:
            self._schedule = triton_kernels().clip_schedule(self.c)
        return self._schedule

    def per_token(self, dtype: torch.dtype, tokens: int) -> Tensor:
        """c repeated for each of a sample's ``tokens`` rows of a flattened [B*T, n], [B*T, 1]
        ([P, B*T, 1] for a [P, B] c)."""
        key = (dtype, tokens)
        if key not in self.cached_per_token:
            per_token = self.to(dtype).repeat_interleave(tokens, dim=-1)
            self.cached_per_token[key] = per_token[..., None]
        return self.cached_per_token[key]


class DeviceIndices:
    """Index tensors made once per key on the device and reused by every chunk: a host-to-device
    copy per chunk costs time and cannot be captured in a CUDA graph."""

    def __init__(self):
        self._made: dict[tuple, Tensor] = {}

    def get(self, key: tuple, values: Callable[[], list[int]], device) -> Tensor:
        if key not in self._made:
            self._made[key] = torch.tensor(values(), dtype=torch.int64).to(device)
        return self._made[key]

    def columns(self, params: list[nn.Parameter], rows: list[int], device) -> Tensor:
        """rows[i] repeated for each element of params[i]: the row of each column of their
        [B, sum of numels] concatenation."""
        key = ("columns", *map(id, params), *rows)
        return self.get(key, lambda: [r for p, r in zip(params, rows) for _ in range(p.numel())],
                        device)  # fmt: skip


class ClipFactorsByParameter:
    """A chunk's clip factors for each parameter: one ClipFactors for all of them (flat
    clipping, c [B]) or one per parameter (per-layer clipping, c [P, B], the row of each
    parameter in ``rows``)."""

    def __init__(self, c: Tensor, rows: dict[int, int], indices: DeviceIndices):
        self.device = c.device
        self.shared = ClipFactors(c) if c.dim() == 1 else None
        self.by_row = ClipFactors(c) if c.dim() == 2 else None  # [P, B]: each row a parameter's
        self.c = c
        self.indices = indices
        self._row = rows  # id(parameter) -> its row of c

    def of(self, param: nn.Parameter) -> ClipFactors:
        if self.shared is not None:
            return self.shared
        return self.by_row.row(self._row[id(param)])

    def for_rules(self, rows_of_calls: Callable[[], Any]) -> tuple[ClipFactors, Any]:
        """What the rules take: the shared factors (flat clipping), or the [P, B] factors and
        each layer's row of them (per-layer: ``rows_of_calls()``, found only then)."""
        if self.shared is not None:
            return self.shared, None
        return self.by_row, rows_of_calls()

    def sums_of(self, params: list[nn.Parameter], grads: list[Tensor]) -> list[Tensor]:
        """weighted_sums of each parameter's [B, N] per-sample gradients by its factors."""
        if self.shared is not None:
            return weighted_sums(grads, self.shared)
        return weighted_sums(grads, self.by_row, [self._row[id(p)] for p in params])

    def concatenated_sum(self, params: list[nn.Parameter], grads: Tensor) -> Tensor:
        """sum_b c_b(p) * grads[b] of the [B, N] concatenation of ``params``' per-sample
        gradients, [N]. Per parameter: each column scaled by its parameter's factors in fp32 or
        wider (the factors, rounded toward zero, are not rounded again), then summed over B."""
        if self.shared is not None:
            return weighted_sum(grads, self.shared)
        rows = [self._row[id(p)] for p in params]
        per_column = self.c.index_select(0, self.indices.columns(params, rows, self.device))
        wide = wider(grads.dtype, self.c.dtype)
        return (grads.to(wide) * per_column.T.to(wide)).sum(0)  # per_column: [N, B]


def sums_in_groups(kept: list, c: ClipFactorsByParameter) -> dict[int, Tensor]:
    """id(param) -> the clipped sum of its kept per-sample gradient, for each (param, [B, ...])
    of ``kept`` whose sum (fp32 [n]) is no larger than the per-sample gradient it replaces; a
    launch per group of up to SUMMED_AT_ONCE_BYTES of sums, each group's per-sample gradients
    dropped once summed (they leave ``kept``; the others stay, in order). So the bytes held
    never grow by more than a group's sums, and the sink path makes a few launches where a
    launch per parameter was Python on the step's path."""
    sums: dict[int, Tensor] = {}
    rest: list = []
    group: list = []
    group_bytes = 0

    def flush():
        params, grads = [p for p, _ in group], [g for _, g in group]
        group.clear()
        sums.update(zip(map(id, params), c.sums_of(params, grads), strict=True))

    while kept:
        param, grad = kept.pop()
        if grad.shape[0] * grad.element_size() < 4:
            rest.append((param, grad))
            continue
        group.append((param, grad if grad.dim() == 2 else grad.flatten(1)))
        group_bytes += 4 * (grad.numel() // grad.shape[0])
        del grad
        if group_bytes >= SUMMED_AT_ONCE_BYTES:
            flush()
            group_bytes = 0
    if group:
        flush()
    kept.extend(reversed(rest))
    return sums


def accumulate_into_grad(param: nn.Parameter, grad: Tensor) -> None:
    """param.grad += grad (param.grad = grad when there is none yet)."""
    if grad.dtype != param.dtype or grad.shape != param.shape:  # no op where none is needed
        grad = grad.to(param.dtype).view(param.shape)
    param.grad = grad if param.grad is None else param.grad.add_(grad)


def accumulate_many(params: list[nn.Parameter], sums: Tensor) -> None:
    """accumulate_into_grad for many parameters from one flat ``sums`` [sum of their numels], with
    multi-tensor kernels; each .grad gets its own storage (not a view of ``sums``), as autograd
    would give it (the memory census counts distinct storages whole, by owner: views of one
    buffer would put every small parameter's gradient in one module group). torch's
    unflatten_dense_tensors (what DDP's buckets use) makes the shaped views in one call, not one
    Python op per parameter (LoRA: hundreds per chunk)."""
    grads = _unflatten_dense_tensors(sums, params)
    fresh = [i for i, param in enumerate(params) if param.grad is None]
    if len(fresh) < len(params):
        held = [i for i, param in enumerate(params) if param.grad is not None]
        torch._foreach_add_([params[i].grad for i in held], [grads[i] for i in held])
    if not fresh:
        return
    if {params[i].dtype for i in fresh} == {sums.dtype}:  # not all(genexpr): a call each
        # x * 1 is x exactly: one call makes every copy in its own storage (a torch.empty_like
        # per parameter costs host time: 200 small parameters at the 1b model)
        new = torch._foreach_mul([grads[i] for i in fresh], 1.0)
    else:  # cast to each parameter's dtype on the way
        new = [torch.empty_like(params[i]) for i in fresh]
        torch._foreach_copy_(new, [grads[i] for i in fresh])
    for i, grad in zip(fresh, new, strict=True):
        params[i].grad = grad


def accumulate_weighted_sums(params, grads, c: ClipFactors, rows: list[int] | None = None) -> None:
    """param.grad += sum_b c_b * grad[b] for each per-sample gradient grad [B, ...]; ``rows``:
    c is [P, B] and params[i] takes its row rows[i] (per-layer clipping).

    On CUDA: flash.kernels.weighted_sums_, one launch per dtype pair for all of them, fp32 clip
    factors (no 16-bit rounding of c: each c_b * g_b is formed in fp32) and fp32 accumulation
    straight into .grad. Elsewhere (or for a tensor the kernel cannot take) one [B] x [B, n]
    product per parameter."""
    kernels = triton_kernels()
    fused, targets, sources, accumulate, fused_rows = [], [], [], [], []
    pairs = [(p.grad if p.grad is not None else p, g.flatten(1)) for p, g in zip(params, grads)]
    supported = kernels.weighted_sums_supported_each(pairs) if kernels is not None else ()
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        target, source = pairs[i]
        if supported and supported[i]:
            fused.append(param)
            accumulate.append(param.grad is not None)
            targets.append(target if param.grad is not None else torch.empty_like(param))
            sources.append(source)
            fused_rows.append(0 if rows is None else rows[i])
        else:
            weights = c.to(grad.dtype) if rows is None else c.to(grad.dtype)[rows[i]]
            accumulate_into_grad(param, weights @ source)
    if fused:
        kernels.weighted_sums_(
            targets, sources, c.to(torch.float32), accumulate, None if rows is None else fused_rows
        )
        for param, target in zip(fused, targets, strict=True):
            param.grad = target


def clip_per_sample(
    params,
    grads: list[Tensor],
    factors: Callable[[Tensor], Tensor],
    divisor: int,
    per_layer: bool = False,
    counts=None,
) -> None:
    """param.grad += sum_b c_b * grad[b] for per-sample gradients grads [B, ...] of ``params``
    held whole (flash under DDP at one sample per rank, gathered), with c = factors(each
    sample's norm over all of them) / divisor; ``per_layer``: c = factors of each parameter's
    own norms [P, B] (per-layer clipping), added to ``counts`` (a training.clipping.
    ClippedCounts) if given."""
    if not per_layer:
        norms = sum(squared_row_norms_many(grads)).sqrt()
        accumulate_weighted_sums(params, grads, ClipFactors(factors(norms) / divisor))
        return
    squared = torch.stack([sum(squared_row_norms_many([grad])) for grad in grads])
    c = factors(squared.sqrt())
    if counts is not None:
        counts.add(squared, c)
    accumulate_weighted_sums(params, grads, ClipFactors(c / divisor), list(range(len(params))))


def weighted_sum(grads: Tensor, c: ClipFactors) -> Tensor:
    """sum_b c_b * grads[b] of a [B, N] concatenation, [N]. CUDA: the weighted-sums kernel (fp32
    c, accumulated and written in fp32: 16-bit gradients are not rounded on the way); else one
    [B] x [B, N] product in the gradients' dtype."""
    kernels = triton_kernels()
    wide = wider(grads.dtype, torch.float32)
    if is_fake(grads) and grads.is_contiguous() and grads.dtype in KERNEL_DTYPES:
        # A planned step: the kernel's memory (its [N] result in fp32, no other buffer); the
        # product's ops for the time model, written into the target's own storage.
        target = grads.new_empty(grads.shape[1], dtype=wide)
        out = target if grads.dtype == wide else target.view(grads.dtype)[: grads.shape[1]]
        torch.mm(c.to(grads.dtype)[None], grads, out=out[None])
        return target
    if kernels is not None and grads.is_cuda:
        target = grads.new_empty(grads.shape[1], dtype=wide)
        if kernels.weighted_sums_supported(target, grads):
            kernels.weighted_sums_([target], [grads], c.to(torch.float32), [False])
            return target
    return c.to(grads.dtype) @ grads


def weighted_sums(grads: list[Tensor], c: ClipFactors, rows: list[int] | None = None) -> list:
    """[weighted_sum(grad, c)] for [B, N_i] gradients, [N_i] each (``rows``: c is [P, B] and
    grads[i] takes row rows[i], per-layer clipping). CUDA: one weighted-sums launch per dtype
    for all of them, fp32 targets (a launch each costs its Python: the 1b model keeps 80
    per-sample weight gradients a chunk); elsewhere, and on a planned step's fake tensors,
    weighted_sum of each."""
    kernels = triton_kernels()
    # a planned step's tensors are all fake: the first says it
    fused = [] if kernels is None or not grads or is_fake(grads[0]) else grads
    supported = kernels.weighted_sums_supported_each([(g, g) for g in fused]) if fused else ()
    sums: list = [None] * len(grads)
    members, targets = [], []
    for i, grad in enumerate(grads):
        if supported and supported[i]:
            members.append(i)
            wide = wider(grad.dtype, torch.float32)
            targets.append(grad.new_empty(grad.shape[1], dtype=wide))
        else:
            sums[i] = weighted_sum(grad, c if rows is None else c.row(rows[i]))
    if members:
        sources, kept_rows = [grads[i] for i in members], None
        if rows is not None:
            kept_rows = [rows[i] for i in members]
        kernels.weighted_sums_(targets, sources, c.to(torch.float32), [False] * len(members),
                               kept_rows)  # fmt: skip
        for i, target in zip(members, targets, strict=True):
            sums[i] = target
    return sums


def fused_noise(tensors: list[torch.Tensor]) -> bool:
    """Whether add_gaussian_noise draws the noise of ``tensors`` with the fused Triton kernel:
    contiguous CUDA tensors of one device, where Triton is there."""
    if not tensors or len({t.device for t in tensors}) != 1 or not tensors[0].is_cuda:
        return False
    return all([t.is_contiguous() for t in tensors]) and triton_kernels() is not None


def add_gaussian_noise(
    tensors: list[torch.Tensor], std: float, generator: torch.Generator | None = None
) -> None:
    """t += N(0, std^2) elementwise for each tensor, drawn from ``generator`` (default: torch's
    of the device) by the 64-bit Box-Muller transform (noise.laws' "exact64"). CUDA: one fused
    Triton kernel (noise drawn and added in one pass); elsewhere the same transform in torch
    operations (noise.exact64)."""
    if fused_noise(tensors):
        triton_kernels().add_gaussian_noise_(tensors, std, generator)
        return
    add_exact64_noise_(tensors, std, generator)
