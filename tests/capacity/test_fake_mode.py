"""The planner's fake mode answers as torch's own FakeTensorMode does: its cache keys tell apart
exactly the tensors torch's metadata record does, its outputs read back from the cache are the
ones torch's mode gives, and a whole planned step is the same with either mode."""

import contextlib
import copy
import itertools
import logging
import os

import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import (
    FakeTensorMode,
    _BypassDispatchCache,
    _CacheKeyState,
    extract_tensor_metadata,
)
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dp_cost.capacity import fake_mode, fake_step, storage_record
from dp_cost.measure import worker
from dp_cost.measure.config import ExperimentConfig


def test_the_fast_paths_are_taken_on_this_torch():
    """Where torch's private methods change, the planner falls back to torch's mode (slower,
    still right): this says so here, where it would otherwise go unnoticed."""
    assert fake_mode.FAST
    assert "_prep_args_for_hash" in vars(fake_mode.PlannedFakeMode)
    mode = fake_mode.PlannedFakeMode()
    with mode:
        x = torch.empty(3)
        for _ in range(2):  # the second a cache hit, made by _fake_tensor's copy
            x.exp()
    assert list(mode._fake_fields) == [torch.device("cpu")]
    assert fake_mode.TORCH_DISPATCH is not None  # torch's dispatch, without its wrappers
    assert not hasattr(fake_mode.PlannedFakeMode.__torch_dispatch__, "__wrapped__")
    assert fake_mode.LEAN_DISPATCH and "dispatch" in vars(fake_mode.PlannedFakeMode)


def test_with_torchs_debug_log_on_the_dispatch_is_torchs(caplog):
    """The lean dispatch leaves the log's set-up out only while the log is off: with it on,
    each op is logged as torch logs it."""
    with caplog.at_level(logging.DEBUG, logger=fake_tensor.log.name):
        with fake_mode.PlannedFakeMode():
            torch.empty(3).exp()
    assert any("FakeTensorMode.__torch_dispatch__" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=fake_tensor.log.name):
        with fake_mode.PlannedFakeMode():
            torch.empty(3).exp()
    assert not caplog.records


def tensors_differing_in_each_field() -> dict[str, torch.Tensor]:
    """Fake tensors, each differing from ``base`` in one thing torch's key records (or in
    none: ``same_as_base``), inside the current fake mode."""
    base = torch.empty(4, 6)
    wide = torch.empty(4, 8)
    with torch.inference_mode():
        inference = torch.empty(4, 6)
    complex_values = torch.empty(4, 6, dtype=torch.complex64)
    return {
        "base": base,
        "same_as_base": torch.empty(4, 6),
        "dtype": torch.empty(4, 6, dtype=torch.bfloat16),
        "shape": torch.empty(6, 4),
        "stride": torch.empty(6, 4).t(),
        "offset": torch.empty(25)[1:].view(4, 6),
        "storage_bytes": torch.empty(30)[:24].view(4, 6),
        "strided_view": wide[:, :6],
        "requires_grad": torch.empty(4, 6, requires_grad=True),
        "inference": inference,
        "complex": complex_values,
        "conj": complex_values.conj(),
        "neg": torch._neg_view(complex_values.conj()),
        "channels_last": torch.empty(2, 3, 4, 6).to(memory_format=torch.channels_last),
        "contiguous_4d": torch.empty(2, 3, 4, 6),
        "scalar": torch.empty(()),
        "empty": torch.empty(0, 6),
    }


def test_the_key_tells_apart_what_torchs_metadata_record_does():
    """For every pair of tensors: equal planned keys exactly where torch's metadata records
    (what its cache key is made of) are equal."""
    with fake_mode.PlannedFakeMode():
        tensors = tensors_differing_in_each_field()
        for (name_a, a), (name_b, b) in itertools.combinations(tensors.items(), 2):
            torch_equal = extract_tensor_metadata(a) == extract_tensor_metadata(b)
            planned_equal = fake_mode.dense_key(a) == fake_mode.dense_key(b)
            assert planned_equal == torch_equal, (name_a, name_b)
    assert fake_mode.dense_key(tensors["base"]) == fake_mode.dense_key(tensors["same_as_base"])


def argument_lists() -> list[tuple[tuple, dict]]:
    """(args, kwargs) of one op, told apart or not by their scalars, containers and tensors,
    built in the current mode."""
    x, transposed = torch.empty(4, 6), torch.empty(6, 4).t()
    conj = torch.empty(4, 6, dtype=torch.complex64).conj()
    others = [1, True, 1.0, -0.0, 0.0, 1j, None, "length_1", torch.float16, torch.device("cpu"),
              [1, 2], (1, 2), torch.Size([1, 2]), [[1], 2], [1, [2]], [], {"a": 1}, {"a": 1.0},
              transposed, conj, x]  # fmt: skip
    lists = [((x, other), {}) for other in others]
    lists += [((x, x), {"alpha": alpha}) for alpha in (2, 2.0, True)]
    lists += [((x,), {"dim": [0, 1]}), ((x,), {"dim": (0, 1)}), ((x, x), {})]
    return lists


def cache_keys(mode: FakeTensorMode) -> list:
    """Each argument list's cache key under ``mode`` (None where it bypasses the cache)."""
    keys = []
    with mode:
        for args, kwargs in argument_lists():
            try:
                state = _CacheKeyState(mode.shape_env)
                keys.append(mode._cache_key(state, torch.ops.aten.add.Tensor, args, kwargs))
            except _BypassDispatchCache:
                keys.append(None)
    return keys


def test_keys_of_whole_argument_lists_are_equal_where_torchs_are():
    """Scalars (True, 1, 1.0; -0.0 and 0.0, which torch also keys alike), lists against
    tuples and sizes, nesting, kwargs: pairs of argument lists get equal keys exactly where
    torch's mode gives them equal keys, and no key made here equals one torch made."""
    torch_keys = cache_keys(FakeTensorMode())
    planned_keys = cache_keys(fake_mode.PlannedFakeMode())
    assert [key is None for key in planned_keys] == [key is None for key in torch_keys]
    pairs = itertools.combinations(range(len(torch_keys)), 2)
    for i, j in pairs:
        if torch_keys[i] is not None and torch_keys[j] is not None:
            torch_equal = torch_keys[i] == torch_keys[j]
            assert (planned_keys[i] == planned_keys[j]) == torch_equal, (i, j)
    assert not set(planned_keys) & set(torch_keys) - {None}


def run_ops(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Ops of every kind the cache serves: new tensors, views of an input, a view of a view,
    in-place ops, several outputs, kwargs, Python numbers, lists of sizes."""
    outputs = [
        x + y, x.mm(y.t()), x.t(), x[1:, 2:], x.view(-1), x.transpose(0, 1).contiguous(),
        x.narrow(1, 2, 3).unsqueeze(0), torch.cat([x, y], dim=1), x.sum(dim=(0,), keepdim=True),
        x.to(torch.bfloat16), x * 2.5, torch.zeros(3, 5, dtype=torch.float16),
        x.expand(2, *x.shape), x.as_strided((2, 2), (1, 3), 1),
    ]  # fmt: skip
    outputs += list(x.split(2, dim=1)) + list(torch.max(x, dim=1))
    z = x.clone()
    outputs += [z.add_(y), z.mul_(3)]
    complex_values = torch.complex(x, y)
    conj = complex_values.conj()
    outputs += [conj, torch._neg_view(conj), conj.clone(), torch.view_as_real(complex_values)]
    return outputs


def described(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[tuple]:
    """What each output is: its type, metadata and Python attributes (its mode as whether it
    is the inputs'), and which input's storage it shares (a view's)."""
    storages = [t.untyped_storage()._cdata for t in inputs]
    return [
        (
            type(out),
            repr(torch._C._dispatch_key_set(out)),
            {k: v is inputs[0].fake_mode if k == "fake_mode" else v for k, v in vars(out).items()},
            out.dtype,
            tuple(out.shape),
            out.stride(),
            out.storage_offset(),
            out.device,
            out.untyped_storage().nbytes(),
            out.requires_grad,
            out.is_conj(),
            out.is_neg(),
            storages.index(out.untyped_storage()._cdata)
            if out.untyped_storage()._cdata in storages
            else None,
        )  # fmt: skip
        for out in outputs
    ]


@pytest.mark.parametrize("requires_grad", [False, True])
def test_outputs_read_from_the_cache_are_the_ones_torchs_mode_gives(requires_grad):
    """The same ops under torch's mode and the planner's, the planner's run twice so that its
    second run is all cache hits (counted): every output alike, views sharing the storage of
    the same input."""
    got, hits = {}, {}
    for name, mode_type in (("torch", FakeTensorMode), ("planned", fake_mode.PlannedFakeMode)):
        mode = mode_type()
        mode.cache_crosscheck_enabled = True  # torch checks each hit against a real dispatch
        with mode:
            x = torch.empty(4, 6, requires_grad=requires_grad)
            y = torch.empty(4, 6)
            first = described(run_ops(x, y), [x, y])
            before = FakeTensorMode.cache_hits
            again = described(run_ops(x, y), [x, y])
            hits[name] = FakeTensorMode.cache_hits - before
        got[name] = first
        if name == "planned":
            assert again == first
    assert got["planned"] == got["torch"]
    # the second run came from the cache, as much of it as from torch's (an output whose
    # dispatch keys differ from the real op's is turned into a bypass, not a hit)
    assert hits["planned"] == hits["torch"] >= 15


def test_a_symbolic_size_takes_torchs_own_path():
    """A tensor of data-dependent size (a ShapeEnv's unbacked symbol) is keyed and read back
    by torch's code, and its ops still give the sizes torch's mode gives."""
    with fake_mode.PlannedFakeMode(shape_env=ShapeEnv()):
        count = torch.empty((), dtype=torch.long).item()
        torch._check(count >= 0)
        symbolic = torch.empty(count, 6)
        assert symbolic._has_symbolic_sizes_strides
        out = (symbolic + 1).sum(0)
        again = (symbolic + 1).sum(0)
        row = symbolic[0]  # plain sizes, a storage of symbolic bytes
        assert not row._has_symbolic_sizes_strides
        rows = [row + 1, row + 1, row.view(2, 3), row.view(2, 3)]
    assert tuple(out.shape) == tuple(again.shape) == (6,)
    assert [tuple(r.shape) for r in rows] == [(6,), (6,), (2, 3), (2, 3)]


SHAPES = {
    "tiny-lm": dict(model="tiny", seq_len=32),
    "tiny-llama-lora": dict(model="tiny-llama", use_lora=True, lora_rank=4, seq_len=24,
                            attention="sdpa"),
    "tiny-lm-fsdp2": dict(model="tiny", seq_len=32, distributed="fsdp", world_size=2),
}  # fmt: skip
# Opacus' per-sample gradients (einsums, its hooks), flash on a Hugging Face model (masks,
# attention kernels, LoRA) and FSDP2's DTensors (their ops carried out by DTensor's own ops): the
# other trainers' plans are checked against real steps elsewhere
PLANNED_BOTH_WAYS = [("dpsgd", "tiny-lm"), ("flash", "tiny-llama-lora"),
                     ("standard", "tiny-lm-fsdp2")]  # fmt: skip


DISPATCH_FILES = (
    os.path.join("capacity", "storage_record.py"),
    os.path.join("capacity", "op_list.py"),
    os.path.join("torch", "_ops.py"),
)


class TorchsModeAndRecords:
    """torch's FakeTensorMode with the records as dispatch modes of their own above it: the
    plain composition that ``storage_record.RecordingFakeMode`` folds into one mode."""

    def __init__(self, record, **kwargs):
        self.fake, self.record = FakeTensorMode(**kwargs), record

    def __enter__(self):
        self.fake.__enter__()
        return self.record.__enter__()

    def __exit__(self, *exc):
        self.record.__exit__(*exc)
        return self.fake.__exit__(*exc)

    def recording_ops(self, ops):
        return ops or contextlib.nullcontext()


@pytest.mark.parametrize(("trainer", "shape"), PLANNED_BOTH_WAYS)
def test_a_planned_step_is_the_same_under_either_mode(trainer, shape, monkeypatch):
    """Each trainer's prediction (peak, each phase's, roles, state, the allocator's requests
    by size and stream, attention kernels, the recorded step's ops) under the planner's mode,
    with the records inside it, equals its prediction under torch's mode with the records as
    modes of their own; so does every allocation recorded and the functions that made it."""
    config = ExperimentConfig(
        trainer=trainer, batch_size=2, max_physical_batch_size=1, optimizer="adam",
        **SHAPES[shape],
    )  # fmt: skip
    events = []
    record_type = storage_record.StorageRecord

    def kept_record():
        events.append(record_type())
        return events[-1]

    monkeypatch.setattr(fake_step, "StorageRecord", kept_record)

    def summary(step):
        requests = [request[1:] for request in step["requests"] + step["step_requests"]]
        keep = ("peak", "phase_peaks", "roles", "state", "attention_backends", "parameters",
                "ops", "marks")  # fmt: skip
        # Each allocation with the step's frames, not the dispatch's (the op record's, where it
        # is a mode, too); the frees are in the requests, up to the step's end (a free after it
        # waits on the collector: nothing the mode decides)
        allocations = [
            (event["size"], event.get("stream"),
             [(frame["filename"], frame["name"]) for frame in event["frames"]
              if not frame["filename"].endswith(DISPATCH_FILES)])
            for event in events.pop().events if event["action"] == "alloc"
        ]  # fmt: skip
        return {key: step[key] for key in keep} | {"requests": requests, "events": allocations}

    planned = summary(fake_step.predict(config, worker.build_trainer, record_ops=True))
    assert planned["ops"] and len(planned["events"]) > 100
    monkeypatch.setattr(fake_step, "RecordingFakeMode", TorchsModeAndRecords)
    plain = summary(fake_step.predict(config, worker.build_trainer, record_ops=True))
    for key, value in planned.items():  # one by one: a failure names what differs
        assert value == plain[key], key


def test_a_planned_step_runs_with_fake_deepcopies_and_no_function_mode(monkeypatch):
    """Inside ``predict``, where the trainer is built and stepped: FakeTensor's deepcopy is the
    plan's, and no TorchFunctionMode sees the step's calls."""
    seen = []

    def build_trainer(*args, **kwargs):
        seen.append(("__deepcopy__" in vars(fake_mode.FakeTensor),
                     torch._C._len_torch_function_stack()))  # fmt: skip
        return worker.build_trainer(*args, **kwargs)

    config = ExperimentConfig(trainer="ghost", batch_size=2, max_physical_batch_size=1,
                              **SHAPES["tiny-lm"])  # fmt: skip
    fake_step.predict(config, build_trainer)
    assert seen == [(True, 0)]


def test_a_deepcopy_inside_the_plan_is_a_new_recorded_storage_and_no_function_mode_is_on():
    """copy.deepcopy of a fake tensor, as Opacus' ghost clipping makes its running sum, is a new
    storage the record counts (requires_grad kept, each tensor copied once per memo), without
    a TorchFunctionMode, which would see every tensor attribute read of the step; FakeTensor is
    as before once the plan ends."""
    record = storage_record.StorageRecord()
    with fake_mode.PlannedFakeMode(), fake_mode.fake_deepcopies(), record:
        assert torch._C._len_torch_function_stack() == 0
        gradient = torch.empty(16, 16).requires_grad_()
        allocations = len(record.events)
        first, second = copy.deepcopy([gradient, gradient])
        assert first is second and first is not gradient and first.requires_grad
        assert first.untyped_storage()._cdata != gradient.untyped_storage()._cdata
        copied_bytes = record.live[storage_record.storage_key(first)]
        assert [event["size"] for event in record.events[allocations:]] == [copied_bytes]
    assert "__deepcopy__" not in vars(fake_mode.FakeTensor)


def test_the_meta_model_made_fake_is_what_to_empty_makes():
    """``_fake_empty`` gives each parameter and buffer the sizes, strides, dtype, bytes and
    requires_grad that ``to_empty`` does under the fake mode, non-contiguous buffers included
    (a slice and an expanded tensor: made by their strides, they would take other bytes), and
    records one allocation each."""

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(6, 4, dtype=torch.bfloat16)
            self.frozen = torch.nn.Parameter(torch.empty(3, 5), requires_grad=False)
            self.register_buffer("transposed", torch.empty(5, 7).t())
            self.register_buffer("sliced", torch.empty(5, 8)[:, :7])  # its own bytes: 140
            self.register_buffer("expanded", torch.empty(5, 1).expand(5, 7))

    def made(materialize):
        record = storage_record.StorageRecord()
        with torch.device("meta"):
            model = Holder()
        with fake_mode.PlannedFakeMode(allow_non_fake_inputs=True), record:
            model = materialize(model)
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return [
            (name, type(t).__name__, tuple(t.shape), t.stride(), t.dtype, t.requires_grad,
             t.untyped_storage().nbytes(), t.device.type)
            for name, t in tensors
        ], len(record.events)  # fmt: skip

    fast = made(fake_step._fake_empty)
    assert fast == made(lambda model: model.to_empty(device="cpu"))
    assert fast[1] == 6 and ((7, 5), (1, 7)) in [(row[2], row[3]) for row in fast[0]]
