"""bench_flash's bookkeeping on CPU: goal checks, step rows, route floors, and each route's work."""

import gzip
import json

import pytest
import torch

import bench_flash
from dp_cost.flash import engine as flash_clip
from dp_cost.measure import processes
from dp_cost.report import step_goals
from tests.cli_helpers import benchmark_script


def result(trainer, batch, seq, dtype, ms, peak, status="ok"):
    return {
        "config": {"trainer": trainer, "batch_size": batch, "seq_len": seq, "dtype": dtype},
        "status": status,
        "median_time_ms": ms if status == "ok" else None,
        "peak_memory_mb": peak if status == "ok" else None,
    }


def test_step_rows_and_misses():
    results = [
        result("standard", 8, 1024, "bfloat16", 100.0, 1000.0),
        result("flash", 8, 1024, "bfloat16", 130.0, 1040.0),
        result("ghost", 8, 1024, "bfloat16", 180.0, 1200.0),
        result("dpsgd", 8, 1024, "bfloat16", 0, 0, status="oom"),
    ]
    (row,) = step_goals.step_rows(results)
    # bf16 (8, 1024): 1.12, tighter than the 1.20 of fp32 at that shape
    assert row["time_x"] == pytest.approx(1.3) and row["time_goal"] == 1.12
    assert row["peak_x"] == pytest.approx(1.04)
    assert row["ghost_over_flash"] == pytest.approx(180 / 130)
    assert row["dpsgd_over_flash"] is None
    misses = row["misses"]
    assert misses[0] == "flash/standard time 1.30 vs goal <= 1.12 (+16.1%)"
    assert misses[1].startswith("ghost/flash time 1.38 vs goal >= 1.60")
    assert misses[2] == "dpsgd/flash time: not measured"
    assert len(misses) == 3  # the peak goal is met
    assert "all met" not in step_goals.format_step_table([row])


def test_all_goals_met():
    results = [
        result("standard", 2, 4096, "float32", 100.0, 1000.0),
        result("flash", 2, 4096, "float32", 110.0, 1000.0),
        result("ghost", 2, 4096, "float32", 200.0, 1000.0),
        result("dpsgd", 2, 4096, "float32", 111.0, 1000.0),
    ]
    (row,) = step_goals.step_rows(results)
    assert row["misses"] == []
    assert "all met" in step_goals.format_step_table([row])


def lora_result(trainer, ms, chunks_replayed=0, eager_chunks=0, graph=False):
    """A LoRA config's result as the toolkit writes it, Poisson draws timed by their mean."""
    config = {
        "trainer": trainer, "batch_size": 16, "seq_len": 256, "dtype": "bfloat16",
        "model": "meta-llama/Llama-3.2-3B-Instruct", "use_lora": True, "lora_rank": 32,
        "physical_batch_size": 2, "cuda_graph": graph,
    }  # fmt: skip
    out = {"config": config, "status": "ok", "avg_time_ms": ms, "median_time_ms": 1.0}
    out["peak_memory_mb"], out["physical_step_times_ms"] = 1000.0, [1.0] * eager_chunks
    if graph:
        out["cuda_graph"] = {"captured": True, "timed_chunk_replays": chunks_replayed}
    return out


def test_lora_rows_compare_graphed_means_and_count_the_chunks_replayed():
    """Both graphed: flash / standard by mean time over the same draws against 1.05; flash
    graphed against standard eager against 0.5 (3B bf16); the timed chunks replayed >= 95%
    for each (a step run eagerly timed each of its chunks)."""
    results = [
        lora_result("standard", 400.0),
        lora_result("standard", 100.0, chunks_replayed=270, graph=True),
        lora_result("flash", 500.0),
        lora_result("flash", 110.0, chunks_replayed=240, eager_chunks=30, graph=True),
    ]
    (row,) = step_goals.step_rows(results)
    assert row["graphed_x"] == pytest.approx(1.1) and row["over_eager_x"] == pytest.approx(0.275)
    assert row["replayed"]["standard_graph"] == 1.0
    assert row["replayed"]["flash_graph"] == pytest.approx(240 / 270)
    assert row["misses"] == [
        "flash_graph chunks replayed 0.8888888888888888 vs goal >= 0.95",
        "flash/standard time, both graphed 1.10 vs goal <= 1.05 (+4.8%)",
    ]  # ghost and dpsgd did not run: no goal of theirs
    assert "89%" in step_goals.format_step_table([row])


def test_step_plan_skips_fp32_at_16384():
    configs = bench_flash.step_configs(["float32", "bfloat16"], steps=3, warmup_steps=1)
    shapes = {(c.dtype, c.batch_size, c.seq_len) for c in configs}
    assert ("float32", 1, 16384) not in shapes and ("bfloat16", 1, 16384) in shapes
    assert len(configs) == len(bench_flash.TRAINERS) * 7
    assert {c.attention for c in configs if c.dtype == "bfloat16"} == {"sdpa"}
    assert all(c.model == "1b" and c.trace for c in configs)  # host time, GPU busy


def test_route_floors_match_a_hand_count():
    B, T, d, p = 2, 1024, 64, 32
    costs = bench_flash.route_costs(B, T, d, p, elem=2)
    # Gram: lower triangles of the two T x T Gram matrices (T^2/2 dots of length d or p, 2 FLOPs
    # each) per sample, plus the clipped-gradient GEMM 2BTdp; A and G (2 bytes) read twice.
    assert costs["gram"] == (B * T * T * (d + p) + 2 * B * T * d * p, 2 * 2 * B * T * (d + p))
    assert costs["direct"][0] == 2 * 2 * B * T * d * p
    assert costs["product"] == (2 * B * T * d * p, 2 * (B * T * (d + p) + 3 * B * d * p))


@pytest.mark.parametrize("route", ["gram", "direct", "product"])
def test_each_route_computes_the_layer_work(route):
    module = torch.nn.Linear(6, 5, bias=False)
    layer = flash_clip.Layer(
        "l",
        module,
        flash_clip.NORM_RULES[torch.nn.Linear],
        {"weight": module.weight},
        route=route,
        tile_size=4,
    )
    A, G = torch.randn(3, 7, 6), torch.randn(3, 7, 5)
    clip = torch.rand(3)
    norms, clipped = bench_flash.run_route(layer, A, G, clip, route)
    per_sample = torch.einsum("btp,btd->bpd", G, A)  # brute force: G_b^T A_b
    torch.testing.assert_close(norms, per_sample.square().sum((1, 2)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(clipped, torch.einsum("b,bpd->pd", clip, per_sample))


def test_cli_rejects_bad_shapes(capsys):
    assert bench_flash.main(["steps", "--shapes", "8by512"]) == 2
    assert "BxT" in capsys.readouterr().err


def test_host_time_and_gpu_busy_goals():
    results = [
        result("standard", 8, 512, "bfloat16", 100.0, 1000.0),
        result("flash", 8, 512, "bfloat16", 107.0, 1000.0),
        result("ghost", 8, 512, "bfloat16", 200.0, 1000.0),
        result("dpsgd", 8, 512, "bfloat16", 120.0, 1000.0),
    ]
    timeline = {"standard": (40.0, 0.95), "flash": (50.0, 0.90), "ghost": (60.0, 0.8)}
    for r in results:
        r["host_time_ms"], r["gpu_busy_fraction"] = timeline.get(
            r["config"]["trainer"], (None,) * 2
        )
    (row,) = step_goals.step_rows(results)
    assert row["host_ms"] == {"standard": 40.0, "flash": 50.0, "ghost": 60.0, "dpsgd": None}
    assert row["host_x"] == pytest.approx(1.25) and row["busy_gap"] == pytest.approx(0.05)
    assert row["misses"] == [
        "flash/standard host time 1.25 vs goal <= 1.10 (+13.6%)",
        "standard-flash GPU busy 0.05 vs goal <= 0.03 (+66.7%)",
    ]
    line = step_goals.format_step_table([row]).splitlines()[-1]
    assert "| 40.0 / 50.0 / 60.0 / - | 95 / 90 / 80 / - |" in line


def test_hf_plan_is_the_lora_configs_with_poisson_draws():
    configs = bench_flash.hf_step_configs(steps=3, warmup_steps=2)
    assert len(configs) == 3 * len(bench_flash.TRAINERS)  # 3B fp32 and bf16, 8B bf16
    shapes = {
        (
            c.model.rsplit("/")[-1],
            c.dtype,
            c.lora_rank,
            c.seq_len,
            c.batch_size,
            c.physical_batch_size,
        )
        for c in configs
    }
    assert shapes == {
        ("Llama-3.2-3B-Instruct", "float32", 32, 256, 16, 2),
        ("Llama-3.2-3B-Instruct", "bfloat16", 32, 256, 16, 2),
        ("Llama-3.1-8B-Instruct", "bfloat16", 16, 512, 16, 4),
    }
    assert all(c.use_lora and c.poisson and c.trace and c.attention == "sdpa" for c in configs)
    assert len({c.seed for c in configs}) == 1  # every trainer times the same draws
    assert len({c.config_dir for c in configs}) == len(configs)  # one run directory holds them
    # --dtypes narrows them: one device call per dtype fits its time limit
    only_fp32 = bench_flash.hf_step_configs(3, 2, dtypes=["float32"])
    assert {(c.model.rsplit("/")[-1], c.dtype) for c in only_fp32} == {
        ("Llama-3.2-3B-Instruct", "float32")
    }


def test_hf_steps_on_cpu_with_the_tiny_model(tmp_path):
    """--hf's path with tiny-llama standing in: workers, result files, rows, the table."""
    spec = (("tiny-llama", 4, 16, 6, 4, ("float32",)),)
    configs = bench_flash.hf_step_configs(1, 1, specs=spec, device="cpu")
    results = processes.run_configs(configs, str(tmp_path))
    assert [r["status"] for r in results] == ["ok"] * len(bench_flash.TRAINERS)
    (row,) = step_goals.step_rows(results)
    assert (row["model"], row["batch"], row["seq"], row["physical"]) == (
        "tiny-llama LoRA r4",
        6,
        16,
        4,
    )
    assert row["time_goal"] == step_goals.HF_TIME_GOAL and row["peak_goal"] is None
    assert all(row[f"{name}_ms"] > 0 for name in bench_flash.TRAINERS)
    # CPU: no CUDA trace, so no host time or GPU-busy fraction, and the reason is recorded.
    assert set(row["host_ms"].values()) == {None} and set(row["gpu_busy"].values()) == {None}
    saved = json.loads((tmp_path / results[1]["config_dir"] / "result.json").read_text())
    assert saved["host_time_ms"] is None and "timeline_note" in saved["env"]
    assert "tiny-llama LoRA r4 | float32 | 6 | 16 | 4 |" in step_goals.format_step_table([row])


def graphed(r, captured=True):
    r["config"]["cuda_graph"] = True
    r["cuda_graph"] = {"captured": captured, "replays": 3 if captured else 0}
    return r


def test_graphed_rows_take_flash_graph_against_standard_eager():
    results = [
        result("standard", 8, 512, "bfloat16", 100.0, 1000.0),
        graphed(result("standard", 8, 512, "bfloat16", 90.0, 1300.0)),
        result("flash", 8, 512, "bfloat16", 120.0, 1010.0),
        graphed(result("flash", 8, 512, "bfloat16", 99.0, 1274.0)),
        result("ghost", 8, 512, "bfloat16", 300.0, 1000.0),
        result("dpsgd", 8, 512, "bfloat16", 200.0, 1000.0),
    ]
    for r in results:
        name = r["config"]["trainer"] + ("_graph" if r["config"].get("cuda_graph") else "")
        r["host_time_ms"] = {"standard": 80.0, "flash": 95.0, "flash_graph": 2.0}.get(name)
        r["gpu_busy_fraction"] = 0.9
    (row,) = step_goals.step_rows(results)
    assert row["flash_graphed"] and row["flash_ms"] == 99.0
    assert row["time_x"] == pytest.approx(0.99)
    assert row["eager_x"] == pytest.approx(1.2) and row["graphed_x"] == pytest.approx(1.1)
    # peaks like with like: flash's graph against standard's graph (each graph's pool holds
    # more than its eager step), not against standard's eager peak (1.27 here)
    assert row["peak_x"] == pytest.approx(0.98) and row["peak_against"] == "standard_graph"
    # The host-time goal is the eager step's (a replay's host time is a launch per chunk).
    assert row["host_x"] == pytest.approx(95.0 / 80.0)
    assert any(miss.startswith("flash/standard host time 1.19") for miss in row["misses"])
    line = step_goals.format_step_table([row]).splitlines()[-1]
    assert "| 99.0 (graph) |" in line and "| 1.20 / 1.10 |" in line
    # A capture that failed ran flash eagerly: the goals take the eager flash config then.
    results[3] = graphed(result("flash", 8, 512, "bfloat16", 121.0, 1020.0), captured=False)
    (row,) = step_goals.step_rows(results)
    assert not row["flash_graphed"] and row["flash_ms"] == 120.0
    assert row["peak_against"] == "standard" and row["peak_x"] == pytest.approx(1.01)
    # standard's capture failed (it ran eagerly): flash's graph against standard's eager peak
    results[1] = graphed(result("standard", 8, 512, "bfloat16", 90.0, 1300.0), captured=False)
    results[3] = graphed(result("flash", 8, 512, "bfloat16", 99.0, 1274.0))
    (row,) = step_goals.step_rows(results)
    assert row["peak_against"] == "standard" and row["peak_x"] == pytest.approx(1.274)


def test_with_graphs_adds_a_graphed_config_of_standard_and_flash_only():
    configs = bench_flash.with_graphs(
        bench_flash.step_configs(["bfloat16"], steps=3, warmup_steps=2, shapes=[(8, 512)])
    )
    assert [(c.trainer, c.cuda_graph) for c in configs] == [
        ("standard", False),
        ("standard", True),
        ("flash", False),
        ("flash", True),
        ("ghost", False),
        ("dpsgd", False),
    ]


def test_steps_with_no_config_left_is_one_error_line(tmp_path, capsys):
    """--hf 8B holds no fp32 config: exit 2, one line, before any device probe or directory."""
    argv = ["steps", "--hf_only", "--hf", "8B", "--dtypes", "float32"]
    assert bench_flash.main([*argv, "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--hf 8B --dtypes float32" in err
    assert not (tmp_path / "out").exists()


def test_graph_replays_lists_each_rank_and_compares_flash_with_standard_of_its_shape(
    tmp_path, capsys
):
    """benchmarks/graph_replays.py: one row per rank's result file (result.json repeats rank
    0's), the share of the timed chunks replayed (a step run eagerly timed each of its chunks),
    flash's mean over standard's of the same shape and rank."""
    graph_replays = benchmark_script("graph_replays.py")

    def write(config_dir, name, trainer, mean, replayed, eager_chunks):
        result = {
            "status": "ok", "config": {"trainer": trainer}, "avg_time_ms": mean,
            "step_times_ms": [mean] * 3, "physical_step_times_ms": [1.0] * eager_chunks,
            "cuda_graph": {"timed_chunk_replays": replayed, "timed_padding_samples": 2},
        }  # fmt: skip
        (tmp_path / config_dir).mkdir(exist_ok=True)
        (tmp_path / config_dir / name).write_text(json.dumps(result))

    for shape, standard_ms in (("bs32_ddp2x", 100.0), ("bs16_ddp2x", 40.0)):
        for rank in (0, 1):
            write(f"standard_{shape}", f"result.rank{rank}.json", "standard", standard_ms, 9, 0)
            write(f"flash_{shape}", f"result.rank{rank}.json", "flash", 96.0, 9, 1)
        write(f"flash_{shape}", "result.json", "flash", 1e6, 0, 0)  # rank 0's again: not read
    assert graph_replays.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 8  # header, separator, 2 shapes x 2 trainers x 2 ranks
    assert "| flash_bs32_ddp2x | 1 | 3 | 96.0 | 90.0% | 10 | 2 | 0.960 |" in lines
    assert "| flash_bs16_ddp2x | 0 | 3 | 96.0 | 90.0% | 10 | 2 | 2.400 |" in lines


def test_host_work_counts_the_gpu_waiting_for_a_late_launch():
    """benchmarks/host_work.py's gpu_idle on a hand-made trace (µs): of each gap in the GPU's
    activity, the part from the GPU going idle to the end of the next activity's launch call is a
    wait for the host, also where that call began before the GPU went idle; a gap whose launch
    call ended in time, or that has no launch call in the trace, is idle but not a wait; a
    kernel inside an earlier, longer one adds no gap; ties and copies are activity too."""
    host_work = benchmark_script("host_work.py")

    def launch(ts, dur, correlation):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur,
                "args": {"correlation": correlation}}  # fmt: skip

    def kernel(ts, dur, correlation, name):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"correlation": correlation}}  # fmt: skip

    events = [
        launch(0, 5, 1), kernel(10, 100, 1, "a"),  # busy 10..110
        launch(20, 5, 2), kernel(130, 50, 2, "b"),  # queued in time: a 20 µs gap, no wait
        launch(300, 10, 3), kernel(330, 10, 3, "c"),  # launched late: waited 180..310
        kernel(332, 3, 4, "inside c"),  # within c's busy time: no gap
        launch(335, 30, 5), kernel(370, 5, 5, "d"),  # call began before idle (340): waited 25
        kernel(400, 5, 6, "no launch call"),  # idle 25, not a wait
        {"cat": "kernel", "name": "no args", "ts": 420, "dur": 5},  # idle 15, not a wait
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 420, "dur": 5},  # a tie: no gap
    ]  # fmt: skip
    idle = host_work.gpu_idle(events)
    assert idle["idle_ms"] == pytest.approx((20 + 150 + 30 + 25 + 15) / 1000)
    assert idle["waiting_for_host_ms"] == pytest.approx((130 + 25) / 1000)
    first, second = idle["largest_waits"]
    assert first == {"wait_ms": pytest.approx(0.13), "at_ms": pytest.approx(0.32), "kernel": "c"}
    assert second == {"wait_ms": pytest.approx(0.025), "at_ms": pytest.approx(0.36), "kernel": "d"}
    assert host_work.gpu_idle([]) == {
        "idle_ms": 0.0,
        "waiting_for_host_ms": 0.0,
        "largest_waits": [],
    }


def test_trace_host_diff_counts_each_microsecond_once(tmp_path, capsys):
    """benchmarks/trace_host_diff.py on hand-made traces (µs): an event's self time is its
    duration less that of the events nested in it on its thread, Python functions and torch ops
    alike; threads are apart; a bound method's address is dropped from its name."""
    diff = benchmark_script("trace_host_diff.py")

    def event(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    events = [
        event("python_function", "a.py(1): step", 0, 100),
        event("python_function", "a.py(5): hook", 10, 30),  # inside step
        event("cpu_op", "aten::mm", 15, 20),  # inside hook
        event("cpu_op", "aten::mm", 50, 10),  # inside step, after hook
        event("python_function", "<built-in method stride of Tensor object at 0x1>", 70, 5),
        event("python_function", "<built-in method stride of Tensor object at 0x2>", 80, 5),
        event("cpu_op", "aten::mm", 20, 40, tid=2),  # another thread: nests in nothing
        {"ph": "i", "cat": "cpu_op", "name": "aten::mm", "ts": 0},  # no duration: not counted
        event("kernel", "gemm", 0, 1000),  # GPU: not host time
    ]
    self_us, calls = diff.host_self_times(events)
    assert self_us == {
        "a.py(1): step": 100 - 30 - 10 - 5 - 5,
        "a.py(5): hook": 30 - 20,
        "op aten::mm": 20 + 10 + 40,
        "<built-in method stride of Tensor": 10,
    }
    assert calls["op aten::mm"] == 3 and calls["<built-in method stride of Tensor"] == 2
    baseline, other = tmp_path / "base", tmp_path / "other"
    baseline.mkdir()
    other.mkdir()
    (baseline / "trace.1.pt.trace.json").write_text(json.dumps({"traceEvents": events[:1]}))
    (other / "trace.2.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    assert diff.main([str(baseline), str(other), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "    0.07      0.00      0      0.07      3  op aten::mm" in out
    assert diff.main([str(tmp_path), str(other)]) == 2  # no trace in it: one error line
    assert capsys.readouterr().err.count("\n") == 1
    # A distributed config holds a trace per rank: rank 0's is read, whatever the glob's order.
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    (ranks / "rank1.1.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    (ranks / "rank0.2.pt.trace.json").write_text(json.dumps({"traceEvents": events[:1]}))
    assert diff.trace_path(str(ranks)) == str(ranks / "rank0.2.pt.trace.json")
    (ranks / "rank0.3.pt.trace.json").write_text("{}")  # two of rank 0: which is meant is unclear
    assert diff.main([str(ranks), str(other)]) == 2
    assert "found 2" in capsys.readouterr().err


def test_trace_host_diff_counts_the_recorded_steps_host_events_alone():
    """Host events outside the trace's train_step range (the toolkit's wait for the GPU after
    the step) are not the step's host work; autograd's thread inside the range's time is."""
    diff = benchmark_script("trace_host_diff.py")

    def event(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    events = [
        event("user_annotation", "train_step", 0, 100),
        event("gpu_user_annotation", "train_step", 0, 300, tid=7),  # the GPU's: not a range
        event("python_function", "a.py(1): step", 0, 90),
        event("cpu_op", "aten::mm", 40, 20, tid=2),  # autograd's thread, inside the step
        event("python_function", "torch/cuda/__init__.py(1): synchronize", 100, 200),
        event("cpu_op", "aten::add", 150, 10, tid=2),  # after the step
    ]
    self_us, calls = diff.host_self_times(events)
    assert self_us == {"a.py(1): step": 90, "op aten::mm": 20}
    assert sum(calls.values()) == 2


def test_trace_host_diff_gpu_time_by_kernel_and_launching_function():
    """--gpu: each GPU event's time goes to its kernel's name and the innermost Python function
    around its launch (matched by correlation id), so one kernel launched from two places is two
    rows; a launch outside any function, or a kernel whose launch is not in the trace, is "?"."""
    diff = benchmark_script("trace_host_diff.py")

    def event(cat, name, ts, dur, tid=1, correlation=None):
        args = {} if correlation is None else {"correlation": correlation}
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
                "args": args}  # fmt: skip

    events = [
        event("python_function", "optim/sgd.py(1): step", 0, 100),
        event("python_function", "flash/clip.py(9): accumulate_many", 200, 100),
        event("python_function", "flash/clip.py(20): inner", 210, 20),  # inside accumulate_many
        event("cuda_runtime", "cudaLaunchKernel", 10, 2, correlation=1),  # in step
        event("cuda_runtime", "cudaLaunchKernel", 215, 2, correlation=2),  # in inner
        event("cuda_runtime", "cudaLaunchKernel", 250, 2, correlation=3),  # after inner
        event("cuda_runtime", "cudaLaunchKernel", 400, 2, correlation=4),  # in no function
        event("kernel", "void multi_tensor_apply_kernel<Add>(x)", 20, 7, tid=7, correlation=1),
        event("kernel", "void multi_tensor_apply_kernel<Mul>(x)", 300, 5, tid=7, correlation=2),
        event("kernel", "void multi_tensor_apply_kernel<Add>(x)", 310, 3, tid=7, correlation=3),
        event("gpu_memset", "Memset (Device)", 410, 1, tid=7, correlation=4),
        event("kernel", "gemm", 500, 11, tid=7, correlation=99),  # its launch not traced
    ]
    busy_us, counts = diff.gpu_times(events)
    assert busy_us == {
        "void multi_tensor_apply_kernel <- optim/sgd.py(1): step": 7,
        "void multi_tensor_apply_kernel <- flash/clip.py(20): inner": 5,
        "void multi_tensor_apply_kernel <- flash/clip.py(9): accumulate_many": 3,
        "Memset <- ?": 1,
        "gemm <- ?": 11,
    }
    assert sum(counts.values()) == 5


def test_trace_overlap_reads_the_light_traces_where_a_config_has_them(tmp_path):
    """benchmarks/trace_overlap.py passes HTA one trace per rank: the light ones
    (rank<N>.timeline.json[.gz]) where the config kept them, else the full ones."""
    overlap = benchmark_script("trace_overlap.py")
    for name in ("rank0.1.pt.trace.json.gz", "rank1.2.pt.trace.json.gz", "result.rank0.json"):
        (tmp_path / name).write_text("{}")
    assert overlap.rank_traces(str(tmp_path)) == {
        0: str(tmp_path / "rank0.1.pt.trace.json.gz"),
        1: str(tmp_path / "rank1.2.pt.trace.json.gz"),
    }
    for name in ("rank0.timeline.json.gz", "rank1.timeline.json.gz"):
        (tmp_path / name).write_text("{}")
    assert overlap.rank_traces(str(tmp_path)) == {
        0: str(tmp_path / "rank0.timeline.json.gz"),
        1: str(tmp_path / "rank1.timeline.json.gz"),
    }
    assert overlap.rank_traces(str(tmp_path / "none")) == {}


def test_trace_exposed_splits_a_step_into_what_ran_alone(tmp_path, capsys):
    """benchmarks/trace_exposed.py on a hand-made light trace (µs): a collective overlapped by a
    GEMM for part of its time, a second kind of collective alone, a kernel alone; each exposed
    microsecond counted once, in its window, and the kinds counted; rank 0's trace of a config
    directory is the one read; a trace with no GPU kernel is one error line."""
    exposed = benchmark_script("trace_exposed.py")

    def kernel(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        kernel("ncclDevKernel_AllGather_RING_LL", 1000, 4000),  # 1000-5000
        kernel("nvjet_gemm", 3000, 4000),  # 3000-7000: 2000 of it beside the all-gather
        kernel("Memset (Device)", 6000, 500, cat="gpu_memset"),  # inside the GEMM's time
        kernel("ncclDevKernel_ReduceScatter_Sum_f32", 8000, 3000),  # 8000-11000, alone
        kernel("ncclDevKernel_ReduceScatter_Sum_f32", 12000, 1000),  # alone
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 20000},  # host
    ]
    found = exposed.exposure(events, window_ms=5.0)
    assert found["span_ms"] == pytest.approx(12.0)  # from the first GPU event, 1000
    assert found["communication_ms"] == pytest.approx(8.0)
    assert found["computation_ms"] == pytest.approx(4.0)
    assert found["communication_alone_ms"] == pytest.approx(2.0 + 3.0 + 1.0)
    assert found["computation_alone_ms"] == pytest.approx(2.0)
    # by kernel, each its own time with no collective beside it (two at once both count)
    assert found["alone_kernels"] == [("nvjet_gemm", 2.0), ("Memset (Device)", 0.5)]
    kinds = found["collectives"]
    assert kinds["AllGather"] == {"count": 1, "ms": 4.0, "first_ms": 0.0, "last_ms": 4.0}
    assert kinds["ReduceScatter"]["count"] == 2 and kinds["ReduceScatter"]["ms"] == 4.0
    # windows of 5 ms from 1000 µs: the GEMM's 2 ms alone (5000-7000) split at 6000 µs
    assert found["windows"] == {
        0.0: (pytest.approx(1.0), pytest.approx(2.0)),
        5.0: (pytest.approx(1.0), pytest.approx(3.0)),
        10.0: (pytest.approx(0.0), pytest.approx(1.0)),
    }
    folder = tmp_path / "flash_bs32_fsdp4x"
    folder.mkdir()
    for rank, trace in ((0, events), (1, events[:1])):
        with gzip.open(folder / f"rank{rank}.timeline.json.gz", "wt") as f:
            json.dump({"traceEvents": trace}, f)
    assert exposed.main([str(folder), "--window_ms", "5"]) == 0
    out = capsys.readouterr().out
    assert "rank0.timeline.json.gz" in out and "ReduceScatter: 2 kernels, 4.0 ms" in out
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": events[-1:]}))
    assert exposed.main([str(empty)]) == 1
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_scaling_table_ratios_and_efficiencies(tmp_path):
    """benchmarks/scaling_table.py on hand-made results: flash / standard within a mode, weak
    scaling t1 / tW at 8 per rank, strong scaling t1 / (W tW) at the 1-GPU global batch, a
    failed config shown by its status, an unreadable file a warning."""
    scaling_table = benchmark_script("scaling_table.py")

    def write(name, trainer, ms, batch, distributed="none", ranks=1, status="ok", **config):
        folder = tmp_path / name
        folder.mkdir()
        config = {"trainer": trainer, "batch_size": batch, "seq_len": 1024,
                  "distributed": distributed, "world_size": ranks, **config}  # fmt: skip
        result = {"config": config, "status": status, "median_time_ms": ms,
                  "peak_memory_mb": 10.0}  # fmt: skip
        (folder / "result.json").write_text(json.dumps(result))

    write("a", "standard", 100.0, 8)
    write("b", "flash", 110.0, 8)
    write("c", "standard", 125.0, 32, "ddp", 4)  # weak: 100 / 125 = 80%
    write("d", "flash", 137.5, 32, "ddp", 4)  # weak: 110 / 137.5 = 80%
    write("e", "standard", 50.0, 8, "fsdp", 4)  # strong: 100 / (4 * 50) = 50%
    write("f", "flash", None, 8, "fsdp", 4, status="oom")
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "result.json").write_text("{broken")
    found = scaling_table.results(str(tmp_path))
    rows = scaling_table.table(found).splitlines()
    ddp = next(r for r in rows if r.startswith("| DDP x4 |"))
    assert "| 1.10 |" in ddp and "80% / 80% / –" in ddp
    fsdp = next(r for r in rows if r.startswith("| FSDP2 x4 |"))
    assert "| oom |" in fsdp and "50% / – / –" in fsdp
    assert len(found) == 6


def test_scaling_table_warns_where_a_mode_repeats(tmp_path, capsys):
    """Two runs of one mode in one folder: the later (by path) fills the row, and a warning
    names the repeat instead of pairing one run's standard with another run's flash silently."""
    scaling_table = benchmark_script("scaling_table.py")
    for run, ms in (("run1", 100.0), ("run2", 120.0)):
        folder = tmp_path / run / "standard"
        folder.mkdir(parents=True)
        config = {"trainer": "standard", "batch_size": 8, "seq_len": 1024}
        result = {"config": config, "status": "ok", "median_time_ms": ms, "peak_memory_mb": 1.0}
        (folder / "result.json").write_text(json.dumps(result))
    row = next(r for r in scaling_table.table(scaling_table.results(str(tmp_path))).splitlines()
               if r.startswith("| 1 GPU |"))  # fmt: skip
    assert "| 120.0 |" in row
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "run2" in err and "standard/flat" in err
