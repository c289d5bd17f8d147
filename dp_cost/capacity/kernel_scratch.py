"""Memory a CUDA kernel takes from the caching allocator for itself, beside its outputs: a
registry, one function per op, of the scratch buffers the kernel allocates and frees within
the call. A fake tensor's meta kernel makes only the outputs, yet these requests move where
the allocator's blocks land and so its reserved peak (the 1b model's bias gradients at
(2, 4096) in fp32 take a 132 MiB reduction buffer a layer; cuDNN's attention backward a 64.5 MiB
workspace a layer at (4, 2048); the softmax backward of the math attention a temporary of its
[B, H, T, T] gradient). Known and not modelled (listed by the benchmark on a card): the
memory-efficient attention's backward buffers (129 MiB in all a layer of the 1b model in fp32
at (2, 4096), one case measured) and cub's temporary storage in the embedding backward's sort.

By hand, as ``attention``'s kernel choice is: torch sizes these in C++, for CUDA tensors only.
The rules are torch 2.11's on sm90 (H100 and H200: 132 multiprocessors, 2048 threads each),
checked for every case of ``benchmarks/kernel_scratch.py``'s grid and configs by
tests/capacity/test_kernel_scratch.py.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

aten = torch.ops.aten

OUTPUTS = None  # in a rule's list: where the op's outputs are taken (else before them all)
MULTIPROCESSORS = 132  # H100 SXM and H200
THREADS_PER_MULTIPROCESSOR = 2048
WARP = 32
MAX_THREADS = 512  # a reduction block's, before its output vector divides it
VALUES_PER_THREAD = (16, 256)  # the least and the most a thread of a reduction sums


def _last_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _reduction_dims(shape, strides, reduced: set[int]) -> list[tuple[int, int, bool]]:
    """The input as TensorIterator lays a reduction out: (size, input stride, reduced) per
    dimension, size-1 ones dropped; reduced dimensions first, by input stride ascending, then
    the kept ones by the output's stride ascending (the output is a new tensor, contiguous
    over the kept dimensions in their order: its strides decide before the input's);
    neighbours that are one run of memory in both the input and the output merged."""
    kept_after, output_strides = 1, {}
    for d in reversed(range(len(shape))):
        if d not in reduced:
            output_strides[d] = kept_after
            kept_after *= shape[d]
    dims = [
        (shape[d], strides[d], output_strides.get(d, 0), d in reduced)
        for d in range(len(shape))
        if shape[d] != 1
    ]
    dims.sort(key=lambda dim: (not dim[3], dim[2] if not dim[3] else dim[1]))
    merged: list[tuple[int, int, int, bool]] = []
    for size, stride, output_stride, is_reduced in dims:
        if merged:
            last_size, last_stride, last_output, last_reduced = merged[-1]
            if (
                last_reduced == is_reduced
                and last_stride * last_size == stride
                and last_output * last_size == output_stride
            ):
                merged[-1] = (last_size * size, last_stride, last_output, is_reduced)
                continue
        merged.append((size, stride, output_stride, is_reduced))
    return [(size, stride, is_reduced) for size, stride, _, is_reduced in merged]


def _output_vector(dims, num_reduce: int, element: int, offset: int) -> int:
    """get_output_vec_size: 4, halved until it divides the output's extent and every other
    input stride and the input's address is aligned to it."""
    vector = 4
    values = [dims[num_reduce][0]] + [stride for i, (_, stride, _) in enumerate(dims)
                                       if i != num_reduce]  # fmt: skip
    while vector > 1 and (offset * element) % (vector * element):
        vector //= 2
    for value in values:
        while vector > 1 and value % vector:
            vector //= 2
    return vector


def _block(dim0: int, dim1: int, most: int) -> tuple[int, int]:
    """set_block_dimension: a block's width (a warp at most) and height, within ``most``
    threads, each a power of two."""
    dim0_pow2, dim1_pow2 = min(_last_pow2(dim0), most), min(_last_pow2(dim1), most)
    height = min(dim1_pow2, most // min(dim0_pow2, WARP))
    return min(dim0_pow2, most // height), height


def reduction_buffers(
    tensor: torch.Tensor,
    reduced: set[int],
    dtype: torch.dtype | None = None,
    read: torch.dtype | None = None,
) -> list[int]:
    """The requests of ``gpu_reduce_kernel`` (sum, mean) over the ``reduced`` dimensions of
    ``tensor`` (summed as ``dtype``, read as a copy in ``read``, where given): where blocks
    share an output, its staging buffer in global memory and an int semaphore per output block;
    [] where each block reduces its own outputs. setReduceConfig's launch arithmetic. An input
    past 32-bit indexing (2 GiB of offsets) torch splits into launches, each with buffers of its
    own: planned as one launch (the split launches' buffers may be larger or smaller)."""
    if tensor.numel() == 0:
        return []  # nothing to reduce: no kernel runs
    element = (read or tensor.dtype).itemsize
    # the sum's accumulator: double for double, int64 for integers, float otherwise
    summed = dtype or tensor.dtype
    accumulator = 4 if summed.is_floating_point and summed != torch.float64 else 8
    dims = _reduction_dims(tensor.shape, tensor.stride(), reduced)
    outputs = math.prod(size for size, _, is_reduced in dims if not is_reduced)
    inputs = math.prod(size for size, _, is_reduced in dims if is_reduced)
    num_reduce = sum(1 for dim in dims if dim[2])
    if not dims or inputs <= 1:
        return []
    along_input = num_reduce == len(dims) or dims[0][1] < dims[num_reduce][1]
    dim0, dim1 = (inputs, outputs) if along_input else (outputs, inputs)
    fastest = dims[0][1] if along_input else dims[num_reduce][1]
    vector = 1
    if fastest == 1:
        if along_input and dim0 >= 128 and num_reduce == 1:
            # loads of input_vec_size values (8 for a 16-bit sum, else 4): it moves the block's
            # width only where no buffer follows, but is kept as torch has it
            dim0 //= 8 if element == 2 else 4
        elif not along_input:
            offset = tensor.storage_offset() if read is None else 0  # a copy starts a storage
            vector = _output_vector(dims, num_reduce, element, offset)
            dim0 //= vector
    width, height = _block(dim0, dim1, MAX_THREADS // vector)
    step_input = step_output = 1
    if along_input:
        step_input *= width
    else:
        step_output *= width
    least, largest = VALUES_PER_THREAD
    if math.ceil(inputs / step_input) < min(height * 16, largest):
        return []  # each warp its own outputs: no reduction across blocks
    step_input *= height
    values_per_thread = math.ceil(inputs / step_input)
    grid = math.ceil(outputs // vector / step_output)
    target_grid = MULTIPROCESSORS * (THREADS_PER_MULTIPROCESSOR // (width * height))
    if values_per_thread < largest or grid > target_grid:
        return []
    ctas = max(
        math.ceil(values_per_thread / largest),
        min(math.ceil(target_grid / grid), math.ceil(values_per_thread / least)),
    )
    if ctas <= 1:
        return []
    size = accumulator * outputs * ctas
    return [size if along_input else size * width * vector, 4 * grid]


def _reduced_dims(tensor: torch.Tensor, dims) -> set[int]:
    if dims is None or len(dims) == 0 or tensor.dim() == 0:
        return set(range(tensor.dim()))
    return {d % tensor.dim() for d in dims}


def _sum_buffers(tensor, dims=None, keepdim=False, *, dtype=None) -> list[int]:
    """A sum's buffers, and first the copy it reads where the kernel reads another dtype than
    the input's (integers and booleans summed as int64, a sum to another dtype; but a 16-bit
    float summed to float32 is read as it is): ``self.to`` in make_reduction."""
    summed = dtype or (tensor.dtype if tensor.is_floating_point() else torch.int64)
    low_to_float = tensor.dtype in (torch.float16, torch.bfloat16) and summed == torch.float32
    read = tensor.dtype if low_to_float else summed
    reduced = _reduced_dims(tensor, dims)
    if read == tensor.dtype:
        return reduction_buffers(tensor, reduced, summed)
    return [tensor.numel() * read.itemsize, *reduction_buffers(tensor, reduced, summed, read)]


def _cudnn_attention_backward_workspace(grad_out, query, key, value, *args, **kwargs) -> list[int]:
    """cuDNN's attention backward: a dense copy of the output's gradient where its rows are
    not (a broadcast one), then one workspace: an fp32 accumulator of the query's gradient, a
    second one where the key heads are grouped (fewer than the query's), a float per row and
    256 bytes."""
    batch, heads, tokens, head_dim = query.shape
    rows = batch * heads * tokens
    grouped = key.shape[1] != heads
    copy = [grad_out.numel() * grad_out.element_size()] if grad_out.stride(-1) != 1 else []
    return [*copy, 4 * rows * head_dim * (2 if grouped else 1) + 4 * rows + 256]


def _softmax_backward_temporary(grad_output, output, dim, input_dtype) -> list[int]:
    """The softmax backward's temporary the size of the gradient it is given (the math
    attention's [B, H, T, T] probabilities: 1 GiB a layer for Llama-3.2-1B in fp32 at
    (2, 2048))."""
    return [grad_output.numel() * grad_output.element_size()]


SORTED_EMBEDDING_BACKWARD = 3072  # more indices than this: the sorting backward
ROWS_PER_PARTIAL_SUM = 10  # NROWS_PER_THREAD: the rows one partial sum of a segment adds


def _embedding_backward_buffers(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    """The embedding's backward over many indices: it sorts them (sorted, original positions,
    a range; the counts when scaled by frequency), finds each distinct row's segment and splits
    segments into partial sums of ROWS_PER_PARTIAL_SUM rows, each an fp32 row of the gradient
    (sized for the most there could be: 70.4 MiB for 8,192 tokens of width 2048). cub's own
    temporary storage for the sort and the scans (a few hundred KB) is not modelled."""
    count = indices.numel()
    # the gradient made contiguous first, on either path
    dense = [] if grad.is_contiguous() else [grad.numel() * grad.element_size()]
    if count <= SORTED_EMBEDDING_BACKWARD and not scale_grad_by_freq:
        return dense  # one kernel over the features, nothing sorted
    index = indices.element_size()
    segments = min(count, num_weights)
    partials = count // ROWS_PER_PARTIAL_SUM + segments
    accumulator = 8 if grad.dtype == torch.float64 else 4
    return [
        *dense,
        index * count, index * count, index * count,  # sorted, original positions, a range
        *([index * count] if scale_grad_by_freq else []),
        OUTPUTS,  # the gradient of the whole table, then the segments
        index * count, 8,  # each segment's start, how many
        index * segments, index * segments, 8,  # partial sums a segment, their offsets, total
        index * partials,  # each partial sum's start
        partials * grad.shape[-1] * accumulator,  # the partial sums
    ]  # fmt: skip


SCRATCH = {
    aten.sum.dim_IntList: _sum_buffers,
    aten.sum.default: lambda tensor, *, dtype=None: _sum_buffers(tensor, dtype=dtype),
    aten.mean.dim: _sum_buffers,
    aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_attention_backward_workspace,
    aten._softmax_backward_data.default: _softmax_backward_temporary,
    aten.embedding_dense_backward.default: _embedding_backward_buffers,
}


def scratch_requests(func, args, kwargs) -> tuple[list[int], list[int]]:
    """The scratch requests ``func``'s CUDA kernel makes on these (fake) arguments: those taken
    before the op's outputs and those after, in order; all are freed, latest first, before the
    call returns. ([], []) for an op not in the registry."""
    rule = SCRATCH.get(func)
    if rule is None:
        return [], []
    # a DTensor's op runs its kernel on this rank's shard (read without dispatching an op)
    args = tree_map(lambda arg: arg._local_tensor if isinstance(arg, DTensor) else arg, args)
    sizes = rule(*args, **kwargs)
    if OUTPUTS not in sizes:
        return [], sizes
    split = sizes.index(OUTPUTS)
    return sizes[:split], sizes[split + 1 :]


def scratch_bytes(func, args, kwargs) -> list[int]:
    """Every scratch request of ``func``'s kernel on these arguments, in order."""
    before, after = scratch_requests(func, args, kwargs)
    return before + after
