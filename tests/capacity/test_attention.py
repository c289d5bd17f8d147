"""The planned step's attention against what CUDA did: the kernel torch chose and the bytes it
kept for the backward, for every case of benchmarks/attention_backends.py's grid, as measured on
an H200 (torch 2.11, cuDNN 9.19; tests/fixtures/cuda_attention_h200.json)."""

import json
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from dp_cost.capacity import attention, fake_step, storage_record
from dp_cost.measure import worker
from dp_cost.measure.config import ExperimentConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
MEASURED = json.loads((ROOT / "tests/fixtures/cuda_attention_h200.json").read_text())
sys.path.insert(0, str(ROOT / "benchmarks"))
import attention_backends  # noqa: E402  (the grid's inputs, built as on the card)


def _case_id(case):
    return "{dtype}-d{head_size}-{mask}-g{groups}-t{seq}-p{dropout}".format(**case)


def saved_bytes(query, key, value, attn_mask, is_causal, enable_gqa, dropout_p) -> int:
    """What the forward keeps beyond its inputs, each storage once (as the benchmark counts)."""
    inputs = {
        storage_record.storage_key(t) for t in (query, key, value, attn_mask) if t is not None
    }
    saved = {}

    def pack(tensor):
        if storage_record.storage_key(tensor) not in inputs:
            saved[storage_record.storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with attention.CudaAttention():
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                enable_gqa=enable_gqa,
            )  # fmt: skip
    out.float().sum().backward()  # the chosen kernel's backward runs on fake tensors too
    return sum(saved.values())


def _inputs(case):
    grid = {k: case[k] for k in ("dtype", "head_size", "mask", "groups", "seq", "dropout")}
    return attention_backends.case_inputs(**grid, device="cpu")


def test_the_kernel_chosen_is_cudas_in_every_measured_case():
    with FakeTensorMode():
        for case in MEASURED["cases"]:
            query, key, value, attn_mask, is_causal, enable_gqa, dropout_p = _inputs(case)
            chosen = attention.cuda_backend(
                query, key, value, attn_mask, dropout_p, is_causal, enable_gqa
            )
            assert chosen == case["backend"], _case_id(case)


# What each kernel keeps, run op by op on fake tensors (the slow part): every dtype, mask,
# grouping and dropout at head size 192 and the length that is no multiple of 16
KEPT_CASES = [c for c in MEASURED["cases"] if c["dropout"] or (c["head_size"] == 192
              and c["seq"] % 16)]  # fmt: skip


@pytest.mark.parametrize("case", KEPT_CASES, ids=_case_id)
def test_what_the_chosen_kernel_keeps_is_what_cudas_kept(case):
    with FakeTensorMode():
        assert saved_bytes(*_inputs(case)) == case["saved_bytes"]


def test_an_eager_llama_step_is_planned_with_the_masks_and_heads_a_real_one_gets(monkeypatch):
    """On the card an eager Llama forward on the toolkit's inputs built no mask and asked for
    causal grouped-query attention (the table's ``models``); the planned step asks the same,
    and a graphed one (whose capture transformers treats as tracing) builds its mask."""
    measured = {
        (call["mask"], call["is_causal"], call["enable_gqa"])
        for row in MEASURED["models"]
        for call in row["calls"]
    }
    assert measured == {(None, True, True)}
    seen = set()
    choose = attention.cuda_backend

    def recorded(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        seen.add((None if attn_mask is None else "mask", is_causal, enable_gqa))
        return choose(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)

    monkeypatch.setattr(attention, "cuda_backend", recorded)
    shape = dict(trainer="standard", model="tiny-llama", seq_len=32, batch_size=2, attention="sdpa")
    for graphed, expected in ((False, {(None, True, True)}), (True, {("mask", False, False)})):
        seen.clear()
        fake_step.predict(ExperimentConfig(cuda_graph=graphed, **shape), worker.build_trainer)
        assert seen == expected, graphed


def test_fp32_grouped_query_attention_is_planned_with_the_math_kernels_softmax(monkeypatch):
    """The miss this fixes (Llama-3.2-3B fp32 planned 17% under): fp32 Llama, grouped heads,
    takes CUDA's math kernel, which keeps each layer's [B, H, T, T] softmax in fp32, where the
    CPU's kernel keeps none; bf16 takes cuDNN's."""
    layers, heads, batch, seq = 2, 4, 2, 256
    shape = dict(
        trainer="standard",
        model="tiny-llama",
        seq_len=seq,
        batch_size=batch,
        attention="sdpa",
        max_physical_batch_size=batch,
    )
    fp32 = fake_step.predict(ExperimentConfig(dtype="float32", **shape), worker.build_trainer)
    bf16 = fake_step.predict(ExperimentConfig(dtype="bfloat16", **shape), worker.build_trainer)
    assert fp32["attention_backends"] == {"MATH": layers}
    assert bf16["attention_backends"] == {"CUDNN_ATTENTION": layers}
    monkeypatch.setattr(  # the CPU's own kernel, as the planned step ran before
        attention.CudaAttention, "attention", lambda self, *args, **kw: self._replaced(*args, **kw)
    )
    cpu = fake_step.predict(ExperimentConfig(dtype="float32", **shape), worker.build_trainer)
    softmax = batch * heads * seq * seq * 4
    assert fp32["peak"] - cpu["peak"] >= layers * softmax


def test_a_configs_prediction_names_the_attention_kernel_it_planned():
    from dp_cost.capacity.result import capacity_result

    config = ExperimentConfig(trainer="standard", model="tiny-llama", seq_len=32, batch_size=2,
                              attention="sdpa", dtype="bfloat16")  # fmt: skip
    prediction = capacity_result(config, worker.build_trainer)
    assert prediction["attention_kernels"] == {"CUDNN_ATTENTION": 2}
    assert "attention's kernel" in prediction["method"]


def test_a_checkpointed_blocks_recomputation_runs_the_same_kernel():
    """The recomputation runs inside the backward (where a TorchFunctionMode is not active): it
    must take the kernel the forward took, or torch's checkpoint refuses the step."""
    config = ExperimentConfig(trainer="flash", model="tiny-llama", seq_len=32, batch_size=2,
                              attention="sdpa", dtype="float32",
                              activation_checkpointing=True)  # fmt: skip
    predicted = fake_step.predict(config, worker.build_trainer)
    assert set(predicted["attention_backends"]) == {"MATH"}


def test_a_plans_patches_are_undone_however_it_ends(monkeypatch):
    """The plan patches torch's attention and optimizer globals and transformers' mask check
    while it runs; a later real run in the same process must find them as they were."""
    import torch.optim.optimizer as optimizer_module
    from transformers import masking_utils

    before = (F.scaled_dot_product_attention, masking_utils.find_packed_sequence_indices,
              optimizer_module._get_foreach_kernels_supported_devices,
              list(optimizer_module._foreach_supported_types))  # fmt: skip

    def now():
        return (F.scaled_dot_product_attention, masking_utils.find_packed_sequence_indices,
                optimizer_module._get_foreach_kernels_supported_devices,
                list(optimizer_module._foreach_supported_types))  # fmt: skip

    config = ExperimentConfig(trainer="standard", model="tiny-llama", seq_len=16, batch_size=2,
                              attention="sdpa", optimizer="adam")  # fmt: skip
    fake_step.predict(config, worker.build_trainer)
    assert now() == before

    def broken(*args, **kwargs):
        raise RuntimeError("a trainer that fails to build")

    with pytest.raises(RuntimeError, match="fails to build"):
        fake_step.predict(config, broken)
    assert now() == before

    class Refused:  # a context entered before the patches' own fails
        def __enter__(self):
            raise RuntimeError("no process group")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(fake_step, "planned_ranks", lambda *args, **kwargs: Refused())
    with pytest.raises(RuntimeError, match="no process group"):
        fake_step.predict(config, worker.build_trainer)
    assert now() == before


def test_the_planned_optimizer_takes_cudas_foreach_path(monkeypatch):
    """On CUDA torch.optim's Adam updates every parameter at once (foreach), its square roots a
    list as large as the parameters; on CPU tensors it loops. The plan must take CUDA's path:
    dpsgd's peak (after the backward, per-sample gradients still held) grows by those roots."""
    import contextlib

    config = ExperimentConfig(trainer="dpsgd", model="tiny", seq_len=16, batch_size=4,
                              optimizer="adam")  # fmt: skip
    planned = fake_step.predict(config, worker.build_trainer, record_ops=True)
    optimizer_ops = {op.name for op in planned["ops"] if op.optimizer}
    assert "aten._foreach_sqrt.default" in optimizer_ops
    assert "aten.sqrt.default" not in optimizer_ops
    monkeypatch.setattr(fake_step, "_foreach_as_on_cuda", contextlib.nullcontext)
    looped = fake_step.predict(config, worker.build_trainer)
    assert planned["peak"] > looped["peak"]


def test_the_math_softmax_holds_its_kernels_intermediates():
    """CUDA's ``_safe_softmax`` (the math attention's) makes a softmax, a full-size mask of the
    -inf entries and its result, all through the allocator; a meta kernel makes the result
    alone, so the plan runs it as the kernel composes it."""
    from dp_cost.capacity.allocator import request_bytes

    record = storage_record.StorageRecord()
    with FakeTensorMode(), record:
        scores = torch.randn(2, 4, 64, 64)
        first = len(record.events)  # the op's own allocations from here
        torch.ops.aten._safe_softmax(scores, -1)
    made = [e["size"] for e in record.events[first:] if e["action"] == "alloc"]
    full, mask = request_bytes(2 * 4 * 64 * 64 * 4), request_bytes(2 * 4 * 64 * 64)
    assert made.count(full) == 2 and mask in made  # the softmax and the result; the mask
    # the record, entered again inside its own dispatch, still follows a storage resized in
    # place (FSDP2's way with its unsharded parameters, no op dispatched)
    with FakeTensorMode(), record:
        scores = torch.randn(2, 4, 64, 64)
        torch.ops.aten._safe_softmax(scores, -1)
        storage = torch.empty(2).untyped_storage()
        storage.resize_(0)
        storage.resize_(1 << 20)
    assert record.events[-1]["action"] == "alloc" and record.events[-1]["size"] == 1 << 20
