"""What a planned step (--mode=capacity's fake tensors) asks of the CPU where the real CPU path
works in pieces: the exact64 noise (pieces of 32,768 elements) and the CPU's fp64 per-sample
norms (blocks of columns) bound the memory of a real CPU run, but on fake tensors each piece is
a few Python-dispatched fake ops for nothing: a 1b model's noise was 36,000 draws, 280 s of
each flash prediction. A planned step takes CUDA's path there (CUDA's memory is what it plans):
the noise adds nothing (one in-place kernel on CUDA), a norm is one reduction. Counted as the
ops a dispatch mode sees, against the same call on real tensors."""

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from dp_cost.flash.clip import squared_row_norms
from dp_cost.noise.exact64 import PAIRS_PER_DRAW, add_exact64_noise_
from dp_cost.training.opacus_trainers import NORM_BLOCK_COLUMNS, per_sample_norms


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def counted(call, *shapes, fake: bool) -> tuple[int, object]:
    """(ops dispatched by call(*tensors), its result) for zero tensors of ``shapes``."""
    mode = FakeTensorMode() if fake else None
    with mode if mode is not None else torch.no_grad():
        tensors = [torch.zeros(shape) for shape in shapes]
        with OpCount() as count:
            result = call(*tensors)
    return count.ops, (tensors, result)


def test_planned_noise_draws_nothing_where_real_noise_draws_in_pieces():
    pieces = 8
    size = pieces * 2 * PAIRS_PER_DRAW
    fake_ops, _ = counted(lambda a, b: add_exact64_noise_([a, b], 1.0), size, (3, 5), fake=True)
    real_ops, (tensors, _) = counted(
        lambda a, b: add_exact64_noise_([a, b], 1.0), size, (3, 5), fake=False
    )
    assert fake_ops == 0
    assert real_ops >= 5 * pieces  # words, transform, cast and add, each piece
    assert tensors[0].std() > 0.9 and tensors[1].abs().sum() > 0  # the real ones noised


def test_planned_norms_are_one_reduction_where_real_ones_go_by_blocks():
    blocks = 16
    shape = (4, blocks * NORM_BLOCK_COLUMNS)
    for norms in (per_sample_norms, squared_row_norms):
        fake_ops, (_, fake_result) = counted(norms, shape, fake=True)
        real_ops, (_, real_result) = counted(norms, shape, fake=False)
        assert fake_ops <= 4 < blocks <= real_ops, (norms.__name__, fake_ops, real_ops)
        assert fake_result.shape == real_result.shape == (4,)


def test_a_planned_gram_runs_one_tile_pair_for_all_and_counts_them_all():
    """flash's Gram norms loop over T/tile (T/tile + 1)/2 pairs of token tiles, the same ops on
    same-shaped slices: a planned step runs one pair, and the op record counts its ops once a
    pair, so the step's GEMMs (and their FLOPs) are the loop's, and so is its peak."""
    import pytest

    from dp_cost.capacity.op_list import GEMM, VIEW, OpRecord
    from dp_cost.capacity.storage_record import StorageRecord
    from dp_cost.flash.rules import linear

    def planned(loop: bool):
        record, ops = StorageRecord(), OpRecord()
        with pytest.MonkeyPatch.context() as patch:
            if loop:  # as a real tensor would: every pair
                patch.setattr(linear, "is_fake", lambda tensor: False)
            with FakeTensorMode(), record, ops:
                A, G = torch.randn(4, 64, 32), torch.randn(4, 64, 48)
                linear.gram_squared_norms(A, G, tile=16, fused=False)
        gemms = [op for op in ops.ops if op.kind == GEMM]
        launched = [op for op in ops.ops if op.kind != VIEW]
        live = peak = 0
        for event in record.events:
            live += event["size"] if event["action"] == "alloc" else -event["size"]
            peak = max(peak, live)
        return len(gemms), sum(op.flops for op in gemms), peak, len(launched)

    one_pair, every_pair = planned(loop=False), planned(loop=True)
    pairs = 4 * 5 // 2
    assert one_pair == every_pair and one_pair[0] == 2 * pairs


def test_a_planned_weighted_sum_holds_what_the_cuda_kernel_writes():
    """flash's weighted sum of a [B, N] concatenation: on CUDA the kernel writes [N] in fp32 (a
    16-bit product would round the sum) and allocates nothing else; the planned step's memory is
    that one fp32 [N] (an H200's allocation history showed it; the CPU's product makes a 16-bit
    [N])."""
    from dp_cost.capacity.storage_record import StorageRecord
    from dp_cost.flash.clip import ClipFactors, weighted_sum

    for dtype in (torch.bfloat16, torch.float32):
        grads, c = torch.randn(4, N).to(dtype), torch.rand(4)
        real = weighted_sum(grads, ClipFactors(c))
        assert real.dtype == dtype  # the CPU's product
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_grads = mode.from_tensor(grads)
            with StorageRecord() as record:
                planned = weighted_sum(fake_grads, ClipFactors(c))
        assert planned.dtype == torch.float32 and planned.shape == (N,)
        check_only_the_target(record, planned)


N = 100_000  # the concatenation's width: its [N] buffers far above the [B] ones


def check_only_the_target(record, planned) -> None:
    """The fp32 [N] target is made first, no [N] beside it, and it alone held."""
    from dp_cost.capacity.allocator import request_bytes
    from dp_cost.capacity.storage_record import WORKSPACE_KEYS

    target = request_bytes(4 * N)  # an fp32 [N], as the allocator rounds it
    tensors = [e for e in record.events if e["addr"] > WORKSPACE_KEYS]  # not cuBLAS's own
    assert tensors[0]["action"] == "alloc" and tensors[0]["size"] == target  # the target first
    live = [0]
    for event in tensors:
        live.append(live[-1] + (event["size"] if event["action"] == "alloc" else -event["size"]))
    assert max(live) < target + 2 * N  # no [N] product beside it (a 16-bit one: 2N bytes)
    held = {key: size for key, size in record.held().items() if key > WORKSPACE_KEYS}
    assert held == {planned.untyped_storage()._cdata: target}


def test_the_planning_modes_answer_a_fake_tensors_device_themselves(monkeypatch):
    """Autograd's engine asks each tensor it touches for its device; on fake tensors every
    question is a Python dispatch down the mode stack, most of a planned step's dispatches. The
    planner's modes (the storage and op records) answer it at the top, so none reaches the fake
    mode, where a mode passing every op on (OpCount) lets each through."""
    import torch._subclasses.fake_tensor as fake_tensor

    from dp_cost.capacity.op_list import OpRecord
    from dp_cost.capacity.storage_record import StorageRecord

    device = torch.ops.prim.device.default
    answer, reached = fake_tensor._DISPATCH_META_HANDLERS[device], []

    def counted_answer(args):
        reached.append(args[0])
        return answer(args)

    monkeypatch.setitem(fake_tensor._DISPATCH_META_HANDLERS, device, counted_answer)

    def questions_reaching_the_fake_mode(*modes) -> tuple[int, torch.device]:
        reached.clear()
        with FakeTensorMode(), contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            weight, inputs = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8)
            (inputs @ weight).relu().sum().backward()
            return len(reached), weight.grad.device

    passed_on, device_seen = questions_reaching_the_fake_mode(OpCount())
    assert passed_on > 0 and device_seen == torch.device("cpu")
    answered, device_seen = questions_reaching_the_fake_mode(StorageRecord(), OpRecord())
    assert answered == 0 and device_seen == torch.device("cpu")
