import gzip
import json
from pathlib import Path

import pytest

from dp_cost.core import kernel_names as kernels

FIXTURE = Path(__file__).parent.parent / "fixtures" / "kernel_names.txt"


def fixture_rows() -> list[tuple[str, str]]:
    """(expected category, kernel name) from the fixture, comments and blank lines skipped."""
    rows = []
    for line in FIXTURE.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            category, name = line.split("\t", 1)
            rows.append((category, name))
    return rows


ROWS = fixture_rows()


@pytest.mark.parametrize(("category", "name"), ROWS, ids=[f"{c}:{n[:60]}" for c, n in ROWS])
def test_fixture_name_category(category, name):
    assert kernels.categorize(name) == category


def test_fixture_covers_every_category():
    assert len(ROWS) >= 40
    assert {category for category, _ in ROWS} == set(kernels.CATEGORIES)


def test_rules_use_only_schema_categories():
    assert kernels.CATEGORIES == (
        "gemm",
        "attention",
        "elementwise",
        "reduction",
        "norm_clip",
        "optimizer",
        "other",
    )
    assert {category for category, _ in kernels.RULES} <= set(kernels.CATEGORIES)


@pytest.mark.parametrize(
    ("name", "category"),
    [
        # norm_clip wins over optimizer: _foreach_norm runs in a multi_tensor_apply_kernel.
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<"
            "at::native::(anonymous namespace)::TensorListMetadata<1>, "
            "at::native::(anonymous namespace)::LpNormFunctor<float, 2, float, 1, 1, 0>, "
            "float*, int>(...)",
            "norm_clip",
        ),
        ("aten::_foreach_norm", "norm_clip"),
        (
            "void at::native::lpnorm_cleanup<float, 2, float>(float const*, float*, int)",
            "norm_clip",
        ),
        # ... and over reduction: a reduce_kernel over NormTwoOps is a norm.
        (
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
            "at::native::NormTwoOps<float, float, float>, unsigned int, float, 4> >(...)",
            "norm_clip",
        ),
        # "normal" is the DP noise, not a norm; "Histogram" is not a Gram matrix.
        (
            "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel"
            "<float, 4, at::native::templates::cuda::normal_kernel<at::CUDAGeneratorImpl*>(...)",
            "elementwise",
        ),
        ("void cub::DeviceRadixSortHistogramKernel<...>", "other"),
        ("_gram_squared_norms_kernel", "norm_clip"),
        # flash's own Triton kernels: the Gram norms, and the noise drawn and added in one pass
        ("_gram_group_kernel", "norm_clip"),
        ("_add_noise_kernel", "elementwise"),
        ("triton_red_fused_bmm_gram_0", "norm_clip"),
        ("triton_poi_fused_clip_div_1", "norm_clip"),
        # attention beats gemm (cutlass inside), gemm beats reduction (splitK reduce of a GEMM).
        ("fmha_cutlassB_f16_aligned_64x128_k64_sm80(PyTorchMemEffAttention::...)", "attention"),
        (
            "void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float>(...)",
            "gemm",
        ),
        # a Triton GEMM template fused with a clamp is clipping work.
        ("triton_tem_fused_clamp_mm_3", "norm_clip"),
        ("flash_fwd_kernel", "attention"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
            "(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, at::native::"
            "(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)0, "
            "false>, ...>(...)",
            "optimizer",
        ),
        ("hadamard_transform_kernel", "other"),
        ("", "other"),
    ],
)
def test_precedence(name, category):
    assert kernels.categorize(name) == category


def test_short_name_of_templated_names():
    name = (
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::Half, float, "
        "c10::Half, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(c10::Half*, "
        "c10::Half const*, int)"
    )
    assert kernels.short_name(name) == "at::native::cunn_SoftMaxForward"
    gemv = (
        "std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float, float, "
        "float, float, false, true, true, false, 6, false, cublasGemvParamsEx<int, "
        "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, "
        "cublasGemvTensorStridedBatched<float>, float> >(cublasGemvParamsEx<int, "
        "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, "
        "cublasGemvTensorStridedBatched<float>, float>)"
    )
    assert kernels.short_name(gemv) == "internal::gemvx::kernel"
    nsys = (
        "void at::native::<unnamed>::CatArrayBatchedCopy_aligned16_contig<at::native::<unnamed>::"
        "OpaqueType<(unsigned int)4>, unsigned int, (int)2, (int)128, (int)1>(T1 *, int, T2)"
    )
    assert kernels.short_name(nsys) == "at::native::CatArrayBatchedCopy_aligned16_contig"
    # cut short by the printing tool: no parameter list, an unclosed template
    truncated = "void at::native::<unnamed>::multi_tensor_apply_kernel<at::native::<unnamed>::Fu…"
    assert kernels.short_name(truncated) == "at::native::multi_tensor_apply_kernel"


@pytest.mark.parametrize(
    "name",
    [
        "nvjet_tst_128x256_64x6_2x1_2cta_v_bz_TNT",
        "Memcpy DtoD (Device -> Device)",
        "Memset (Device)",
    ],
)
def test_short_name_keeps_plain_names(name):
    assert kernels.short_name(name) == name


GEMM = "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT"
NORM = (
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
    "at::native::NormTwoOps<float, float, float>, unsigned int, float, 4> >(...)"
)
FILL = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)"
)
KERNELS = [(GEMM, 100.0), (NORM, 30.0), (GEMM, 150.0), (FILL, 5.0), (NORM, 30.0), (FILL, 2.5)]


def test_summarize_totals_and_counts():
    summary = kernels.summarize(KERNELS)
    categories = summary["categories"]
    assert list(categories) == list(kernels.CATEGORIES)  # every category, zeros included
    assert categories["gemm"] == {"time_ms": pytest.approx(0.25), "count": 2}
    assert categories["norm_clip"] == {"time_ms": pytest.approx(0.06), "count": 2}
    assert categories["elementwise"] == {"time_ms": pytest.approx(0.0075), "count": 2}
    assert categories["attention"] == {"time_ms": 0.0, "count": 0}
    assert summary["total_time_ms"] == pytest.approx(0.3175)
    assert summary["total_time_ms"] == pytest.approx(sum(c["time_ms"] for c in categories.values()))
    assert summary["count"] == len(KERNELS) == sum(c["count"] for c in categories.values())
    json.dumps(summary)  # the worker stores it in result.json


def test_summarize_top_ordering():
    top = kernels.summarize(KERNELS)["top"]
    assert [t["full_name"] for t in top] == [GEMM, NORM, FILL]  # by total time, grouped by name
    assert top[0] == {
        "name": GEMM,
        "full_name": GEMM,
        "category": "gemm",
        "time_ms": pytest.approx(0.25),
        "count": 2,
    }
    assert top[1]["name"] == "at::native::reduce_kernel"
    assert top[1]["category"] == "norm_clip"
    assert [t["full_name"] for t in kernels.summarize(KERNELS, top=2)["top"]] == [GEMM, NORM]


def test_summarize_empty():
    summary = kernels.summarize([])
    assert summary["total_time_ms"] == 0.0 and summary["count"] == 0 and summary["top"] == []
    assert all(c == {"time_ms": 0.0, "count": 0} for c in summary["categories"].values())


def test_category_deltas():
    dp = kernels.summarize(KERNELS)
    standard = kernels.summarize([(GEMM, 200.0), (FILL, 5.0)])
    deltas = kernels.category_deltas(dp, standard)
    assert list(deltas) == list(kernels.CATEGORIES)
    assert deltas["gemm"] == pytest.approx(0.05)
    assert deltas["norm_clip"] == pytest.approx(0.06)
    assert deltas["elementwise"] == pytest.approx(0.0025)
    assert deltas["optimizer"] == 0.0
    # the "categories" mapping alone (as the worker stores it) works too
    assert kernels.category_deltas(dp["categories"], standard["categories"]) == deltas


MiB = 2**20


def trace_dict() -> dict:
    """A small Kineto-style trace: CPU ops, runtime calls, kernels, a memcpy and [memory] events."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1000.0, "dur": 20.0, "args": {}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1005, "dur": 4},
        {"ph": "X", "cat": "kernel", "name": GEMM, "ts": 1010.5, "dur": 100.0, "args": {}},
        {"ph": "X", "cat": "kernel", "name": NORM, "ts": 1120, "dur": 30, "args": {}},
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoD (Device -> Device)",
            "ts": 1160,
            "dur": 3,
        },
        {"ph": "X", "cat": "kernel", "name": GEMM, "ts": 1200, "dur": 150.0, "args": {}},
        {
            "ph": "i",
            "name": "[memory]",
            "ts": 1300.0,
            "s": "t",
            "args": {"Device Type": 1, "Device Id": 0, "Bytes": MiB, "Total Allocated": 3 * MiB},
        },
        {
            "ph": "i",
            "name": "[memory]",
            "ts": 1000.0,
            "s": "t",
            "args": {
                "Device Type": 1,
                "Device Id": 0,
                "Bytes": 2 * MiB,
                "Total Allocated": 2 * MiB,
            },
        },
        {
            "ph": "i",
            "name": "[memory]",
            "ts": 900.0,
            "s": "t",
            "args": {"Device Type": 0, "Device Id": -1, "Bytes": 64, "Total Allocated": 0.5 * MiB},
        },
        {
            "ph": "i",
            "name": "[memory]",
            "ts": 2500.0,
            "s": "t",
            "args": {"Device Type": 1, "Device Id": 0, "Bytes": -MiB, "Total Allocated": 2 * MiB},
        },
    ]
    return {"schemaVersion": 1, "deviceProperties": [], "traceEvents": events}


@pytest.fixture(params=["plain", "gzip", "gzip_magic_only"])
def trace_path(request, tmp_path):
    data = json.dumps(trace_dict()).encode()
    if request.param == "plain":
        path = tmp_path / "host_1.1700000000.pt.trace.json"
        path.write_bytes(data)
    elif request.param == "gzip":
        path = tmp_path / "host_1.1700000000.pt.trace.json.gz"
        path.write_bytes(gzip.compress(data))
    else:  # gzipped content under a plain name: detected by the magic bytes
        path = tmp_path / "host_1.1700000000.pt.trace.json"
        path.write_bytes(gzip.compress(data))
    return path


def test_kernels_from_trace(trace_path):
    assert kernels.kernels_from_trace(trace_path) == [
        (GEMM, 100.0, None),
        (NORM, 30.0, None),
        (GEMM, 150.0, None),
    ]
    assert kernels.kernels_from_trace(str(trace_path)) == kernels.kernels_from_trace(trace_path)
    summary = kernels.summarize(kernels.kernels_from_trace(trace_path))
    assert summary["categories"]["gemm"]["time_ms"] == pytest.approx(0.25)
    assert summary["categories"]["other"]["count"] == 0  # the memcpy is not a kernel event


def test_memory_curve_from_trace(trace_path):
    # default: CUDA events, sorted by time, ms from the first one, MiB
    assert kernels.memory_curve_from_trace(trace_path) == [
        (0.0, 2.0),
        (pytest.approx(0.3), 3.0),
        (pytest.approx(1.5), 2.0),
    ]
    assert kernels.memory_curve_from_trace(trace_path, device_type=0) == [(0.0, 0.5)]


def test_memory_curve_falls_back_to_cpu(tmp_path):
    trace = trace_dict()
    trace["traceEvents"] = [
        e for e in trace["traceEvents"] if e["name"] != "[memory]" or e["args"]["Device Type"] == 0
    ]
    path = tmp_path / "cpu.pt.trace.json"
    path.write_text(json.dumps(trace))
    assert kernels.memory_curve_from_trace(path) == [(0.0, 0.5)]
    assert kernels.memory_curve_from_trace(path, device_type=1) == []


def test_trace_as_bare_event_list(tmp_path):
    path = tmp_path / "bare.json"
    path.write_text(json.dumps(trace_dict()["traceEvents"]))
    assert len(kernels.kernels_from_trace(path)) == 3


# ------------------------------------------------- attention by its range, forward and backward
SOFTMAX = "void at::native::cunn_SoftMaxForward<8, float, float, float>(float*, float const*, int)"
SOFTMAX_BWD = "void at::native::cunn_SoftMaxBackward<8, float, float, float>(...)"


def op(name, tid, ts, dur, seq=None, cat="cpu_op"):
    args = {} if seq is None else {"Sequence number": seq, "Fwd thread id": 0}
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def launch(tid, ts, correlation, kernel, kernel_dur):
    """A runtime call on CPU thread ``tid`` and the GPU kernel it launched (same correlation)."""
    return [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": tid, "ts": ts,
         "dur": 1, "args": {"correlation": correlation}},
        {"ph": "X", "cat": "kernel", "name": kernel, "tid": 7, "ts": ts + 5,
         "dur": kernel_dur, "args": {"correlation": correlation}},
    ]  # fmt: skip


def attention_trace() -> list[dict]:
    """One explicit-attention layer: q projection, then q·kᵀ, softmax and probs·v inside the
    "attention" range (forward thread 1), and their backward on the autograd thread 2."""
    return [
        op("aten::linear", 1, 0, 10, seq=1),  # the q projection: outside the range
        *launch(1, 2, 100, GEMM, 10.0),
        op("attention", 1, 20, 50, cat="user_annotation"),
        op("aten::matmul", 1, 21, 10, seq=2),  # q·kᵀ
        *launch(1, 22, 101, GEMM, 20.0),
        op("aten::softmax", 1, 35, 10, seq=3),
        *launch(1, 36, 102, SOFTMAX, 3.0),
        op("aten::matmul", 1, 50, 10, seq=4),  # probs·v
        *launch(1, 51, 103, GEMM, 30.0),
        op("aten::linear", 1, 80, 10, seq=5),  # out projection
        *launch(1, 81, 104, GEMM, 40.0),
        # backward, newest first, on another thread
        op("autograd::engine::evaluate_function: AddmmBackward0", 2, 200, 10, seq=5),
        *launch(2, 201, 105, GEMM, 50.0),
        op("autograd::engine::evaluate_function: BmmBackward0", 2, 220, 10, seq=4),
        *launch(2, 221, 106, GEMM, 60.0),
        *launch(2, 225, 107, GEMM, 70.0),
        op("autograd::engine::evaluate_function: SoftmaxBackward0", 2, 240, 10, seq=3),
        *launch(2, 241, 108, SOFTMAX_BWD, 4.0),
        op("autograd::engine::evaluate_function: AddmmBackward0", 2, 300, 10, seq=1),
        *launch(2, 301, 109, GEMM, 80.0),
    ]


def test_attention_is_what_runs_in_its_range_and_its_backward(tmp_path):
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": attention_trace()}))
    found = kernels.kernels_from_trace(path)
    assert [(dur, cat) for _, dur, cat in found] == [
        (10.0, None),  # q projection
        (20.0, "attention"),  # q·kᵀ
        (3.0, "attention"),  # softmax
        (30.0, "attention"),  # probs·v
        (40.0, None),  # out projection
        (50.0, None),  # its backward
        (60.0, "attention"),  # probs·v backward: two GEMMs
        (70.0, "attention"),
        (4.0, "attention"),  # softmax backward
        (80.0, None),  # q projection backward
    ]
    summary = kernels.summarize(found)["categories"]
    assert summary["attention"] == {"time_ms": pytest.approx(0.187), "count": 6}
    assert summary["gemm"] == {"time_ms": pytest.approx(0.18), "count": 4}
    assert summary["reduction"]["count"] == 0  # both softmax kernels are attention here


def test_without_the_range_names_decide(tmp_path):
    events = [e for e in attention_trace() if e["name"] != kernels.ATTENTION_RANGE]
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps(events))
    assert {cat for _, _, cat in kernels.kernels_from_trace(path)} == {None}


@pytest.mark.parametrize(
    "content",
    [b'{"traceEvents": [{"ph": "X", "cat": "kernel", "na', b"\xff\xfe", b'{"traceEvents": 3}'],
)
def test_a_truncated_or_foreign_trace_is_unreadable(tmp_path, content):
    path = tmp_path / "t.pt.trace.json"
    path.write_bytes(content)
    with pytest.raises(ValueError):  # core.reading.UnreadableFile
        kernels.kernels_from_trace(path)


def profiled_trace(tmp_path) -> Path:
    """A real torch.profiler trace of a few CPU ops, recorded as the traced steps are (memory
    events, shapes, Python stacks), as torch writes it."""
    import torch

    path = tmp_path / "cpu.pt.trace.json"
    with torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
        x = torch.ones(256, 256)
        for _ in range(3):
            x = (x @ x).relu() / 256
        del x
    prof.export_chrome_trace(str(path))
    return path


def full_parse(path) -> list[dict]:
    return [e for e in kernels.load_trace_events(path) if e.get("name") == kernels.MEMORY_EVENT]


def test_memory_events_are_read_without_parsing_the_whole_trace(tmp_path, monkeypatch):
    """A whole trace's memory events are found in its text, not by parsing every event: the
    same events as the full parse, and the full parse is not needed for them."""
    path = profiled_trace(tmp_path)
    expected = full_parse(path)
    assert len(expected) >= 8 and len(kernels.load_trace_events(path)) > 4 * len(expected)
    monkeypatch.setattr(kernels, "load_trace_events", lambda *a, **k: pytest.fail("parsed"))
    assert kernels.memory_events(path) == expected
    gz = tmp_path / "cpu.pt.trace.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert kernels.memory_events(gz) == expected


def test_memory_events_fall_back_to_the_full_parse_where_the_text_is_not_plain(tmp_path):
    """The name elsewhere than as an event's own (a string inside another event, or an event
    whose arguments come first): every event parsed, the same answer. A truncated trace is
    still an unreadable file, not a shorter curve."""
    path = profiled_trace(tmp_path)
    trace = json.loads(path.read_text())
    trace["traceEvents"].insert(0, {"ph": "X", "name": "op", "args": {"note": "[memory]"}})
    odd = {"args": {"Total Allocated": 5, "Device Type": 0}, "name": "[memory]", "ph": "i", "ts": 1}
    trace["traceEvents"].append(odd)
    for event in (trace["traceEvents"][0], odd):
        other = tmp_path / "other.json"
        other.write_text(json.dumps({"traceEvents": [event, *trace["traceEvents"][1:-1]]}))
        assert kernels.memory_events(other) == full_parse(other)
    odd_last = tmp_path / "odd_last.json"
    odd_last.write_text(json.dumps(trace))
    assert kernels.memory_events(odd_last)[-1] == odd
    text = path.read_text()
    truncated = tmp_path / "truncated.pt.trace.json"
    truncated.write_text(text[: text.rindex('"[memory]"') + 200])
    with pytest.raises(kernels.UnreadableFile):
        kernels.memory_events(truncated)
    with pytest.raises(kernels.UnreadableFile):
        kernels.memory_curve_from_trace(truncated)
