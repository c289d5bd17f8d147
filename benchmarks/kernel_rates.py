"""The kernels' side of a card's time calibration (``benchmarks/card_rates.py`` writes them into
its table): GEMMs on a grid of shapes per dtype, fused attention by sequence length and head
size, an elementwise kernel by the bytes it moves, and the rates of the memory-bound ops a step
spends its other GPU time in, each kernel replayed in a CUDA graph so that its GPU time is
timed apart from the host's launches.
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

GEMM_SIDES = (16, 64, 256, 1024, 4096, 16384)
QUICK_SIDES = (16, 1024, 16384)
THIN_BATCHES = (1, 2, 4, 8, 16, 64)  # cuBLAS changes path between 1 and 2
THIN_LENGTHS = tuple(2**e for e in range(14, 25, 2))  # 16384 .. 16.8M
ATTENTION_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192)
ATTENTION_HEADS = (64, 128)
ATTENTION_TOKENS = 65536  # batch x length x heads/16 kept about constant: every length a big launch
MEMORY_ELEMENTS = [2**e for e in range(8, 29, 2)]


def graphed_us(function, *args, replays: int = 3, **kwargs) -> float:
    """µs of one ``function(*args, **kwargs)``, its kernels captured in a CUDA graph as many
    times over as make about 2 ms, the graph replayed (the median of ``replays``)."""

    def work():
        function(*args, **kwargs)

    probe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            work()
    torch.cuda.current_stream().wait_stream(stream)
    probe[0].record()
    work()
    probe[1].record()
    torch.cuda.synchronize()
    once_ms = max(probe[0].elapsed_time(probe[1]), 1e-3)
    repeat = max(1, min(200, int(2.0 / once_ms)))  # about 2 ms of GPU a replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            work()
    times = []
    for _ in range(replays + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeat)
    del graph
    return statistics.median(times[1:])


def gemm_rows(dtype: torch.dtype, sides) -> list[list]:
    rows = []
    for m in sides:
        for n in sides:
            for k in sides:
                a = torch.randn(m, k, device="cuda", dtype=dtype)
                b = torch.randn(k, n, device="cuda", dtype=dtype)
                out = torch.empty(m, n, device="cuda", dtype=dtype)
                rows.append([m, n, k, round(graphed_us(torch.mm, a, b, out=out), 3)])
    torch.cuda.empty_cache()
    return rows


def thin_gemm_rows(dtype: torch.dtype, batches, lengths) -> list[list]:
    """Batched dot products, [b, 1, K]·[b, K, 1] (what Opacus' ghost norms reduce T×T Grams
    with): cuBLAS runs these far below the card's bandwidth."""
    rows = []
    for batch in batches:
        for length in lengths:
            a = torch.randn(batch, 1, length, device="cuda", dtype=dtype)
            b = torch.randn(batch, length, 1, device="cuda", dtype=dtype)
            out = torch.empty(batch, 1, 1, device="cuda", dtype=dtype)
            rows.append([batch, length, round(graphed_us(torch.bmm, a, b, out=out), 3)])
    torch.cuda.empty_cache()
    return rows


def attention_rows(dtype: torch.dtype, head_dim: int, lengths) -> dict[str, list]:
    rows: dict[str, list] = {"forward": [], "backward": []}
    heads = 16
    for length in lengths:
        batch = max(1, ATTENTION_TOKENS // length)
        shape = (batch, heads, length, head_dim)
        q, k, v = (
            torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in "qkv"
        )
        grad = torch.randn(shape, device="cuda", dtype=dtype)
        forward_us = graphed_us(F.scaled_dot_product_attention, q, k, v, is_causal=True)
        backward_us = graphed_us(attention_backward, q, k, v, grad) - forward_us
        flops = sdpa_flop_count(shape, shape, shape)
        backward_flops = sdpa_backward_flop_count(shape, shape, shape, shape)
        rows["forward"].append([length, round(flops / forward_us / 1e6, 2)])
        rows["backward"].append([length, round(backward_flops / max(backward_us, 1e-3) / 1e6, 2)])
    torch.cuda.empty_cache()
    return rows


def attention_backward(q, k, v, grad) -> None:
    """A causal attention's forward and backward (the backward's time: this less the forward)."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.autograd.grad(out, (q, k, v), grad)


def memory_rows(elements) -> list[list]:
    rows = []
    for count in elements:
        x, y, out = (torch.randn(count, device="cuda") for _ in range(3))
        rows.append([3 * 4 * count, round(graphed_us(torch.add, x, y, out=out), 3)])
    torch.cuda.empty_cache()
    return rows


def memory_op_rates() -> dict[str, float]:
    """Bytes a µs of the ops a training step spends its non-GEMM time in, each at a size of
    the 1b model's (8, 1024) step, where they are slower per byte than an elementwise add;
    bytes as the time model counts them (``capacity.op_list``: every tensor read and
    written)."""
    from dp_cost.capacity.op_list import OpRecord

    aten = torch.ops.aten
    tokens, width, vocab = 8192, 2048, 32000
    x32 = torch.randn(tokens, width, device="cuda")
    x16 = x32.bfloat16()
    weight, bias = torch.ones(width, device="cuda"), torch.zeros(width, device="cuda")
    _, mean, rstd = aten.native_layer_norm(x32, [width], weight, bias, 1e-5)
    logits = torch.randn(4096, vocab, device="cuda")
    logp = torch.log_softmax(logits, -1)
    target = torch.randint(vocab, (4096,), device="cuda")
    loss, total_weight = aten.nll_loss_forward(logp, target, None, 1, -100)
    ids = torch.randint(vocab, (tokens,), device="cuda")
    cases = [
        (aten._to_copy.default, (x32,), {"dtype": torch.bfloat16}),
        (aten.add.Tensor, (x16, x16), {}),
        (aten.mul.Tensor, (x16, x16), {}),
        (aten.sum.dim_IntList, (x16, [0]), {}),
        (aten.native_layer_norm.default, (x32, [width], weight, bias, 1e-5), {}),
        (aten.native_layer_norm_backward.default,
         (x32, x32, [width], mean, rstd, weight, bias, [True, True, True]), {}),
        (aten.gelu.default, (x16,), {}),
        (aten.gelu_backward.default, (x16, x16), {}),
        (aten._log_softmax.default, (logits, -1, False), {}),
        (aten._log_softmax_backward_data.default, (logp, logp, -1, torch.float32), {}),
        (aten.nll_loss_forward.default, (logp, target, None, 1, -100), {}),
        (aten.nll_loss_backward.default,
         (torch.ones_like(loss), logp, target, None, 1, -100, total_weight), {}),
        (aten.embedding_dense_backward.default, (x32, ids, vocab, -1, False), {}),
    ]  # fmt: skip
    rates = {}
    for op, args, kwargs in cases + optimizer_cases(width):
        record = OpRecord()
        with record:
            op(*args, **kwargs)
        moved = sum(o.bytes for o in record.ops if o.name == str(op))
        try:
            rates[str(op)] = round(moved / graphed_us(op, *args, **kwargs), 1)
        except RuntimeError as error:  # not capturable: its rate stays unmeasured
            print(f"{op}: not measured ({' '.join(str(error).split())[:120]})", file=sys.stderr)
    return rates


def optimizer_cases(width: int, device: str = "cuda") -> list[tuple]:
    """torch.optim's foreach steps, SGD's and Adam's, each one launch over many tensors (square
    matrices and vectors, as a model's weights and norms): (op, args, kwargs) as their
    ``step`` dispatches them. Scalars of 1, so that a graph's replays keep the values finite."""
    aten = torch.ops.aten

    def tensors():
        return [torch.rand(width, width, device=device) + 1 for _ in range(48)] + [
            torch.rand(width, device=device) + 1 for _ in range(48)
        ]

    params, grads, exp_avg, exp_avg_sq, denom = (tensors() for _ in range(5))
    ones = [1.0] * len(params)
    return [
        (aten._foreach_add_.List, (params, grads), {"alpha": 1.0}),
        (aten._foreach_lerp_.Scalar, (exp_avg, grads, 1.0), {}),
        (aten._foreach_mul_.Scalar, (exp_avg_sq, 1.0), {}),
        (aten._foreach_addcmul_.Scalar, (exp_avg_sq, grads, grads), {"value": 1.0}),
        (aten._foreach_sqrt.default, (exp_avg_sq,), {}),
        (aten._foreach_div_.ScalarList, (denom, ones), {}),
        (aten._foreach_add_.Scalar, (denom, 1.0), {}),
        (aten._foreach_addcdiv_.ScalarList, (params, exp_avg, denom, ones), {}),
    ]
