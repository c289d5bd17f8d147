"""The time model (capacity.step_time, card_rates, op_list) on hand-made op lists and card
tables, whose times are worked out by hand here, and the op record against torch's own FLOP
counter."""

import dataclasses
import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dp_cost.capacity import card_rates, step_time
from dp_cost.capacity.op_list import ATTENTION, GEMM, MEMORY, SYNC, VIEW, Op, OpRecord
from dp_cost.capacity.step_time import StepCosts
from dp_cost.measure.config import ExperimentConfig
from tests.capacity.card_table import SIDES, THIN_RATE, card_table
from tests.cli_helpers import benchmark_script


def rates_of(tmp_path, **settings) -> card_rates.CardRates:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "card.json"
    path.write_text(json.dumps(card_table(**settings)))
    return card_rates.load_card(str(path))


def op(kind, segment=0, flops=0, moved=0, gemm=None, backward=False, name="aten.x", **more):
    return Op(name, kind, flops, moved, "bfloat16", backward, segment, gemm=gemm, **more)


def test_a_host_bound_step_takes_the_hosts_time_a_gpu_bound_one_the_gpus(tmp_path):
    """10 µs a forward op on the host. Ten elementwise kernels of 2 µs (the floor): the GPU
    waits for each launch, the step is the host's 100 µs (and the last kernel's 2). Ten GEMMs
    of 1000 µs: the GPU never waits after the first launch, the step is 10 + 10,000 µs."""
    rates = rates_of(tmp_path, forward_us=10.0, floor_us=2.0, tflops=100.0)
    small = [(op(MEMORY, moved=8), "forward")] * 10
    played = step_time.play(small, StepCosts(rates, "standard"))
    assert played["step"] == pytest.approx(102.0)
    assert played["host"] == pytest.approx(100.0) and played["gpu"] == pytest.approx(20.0)
    side = 1024 * 1024**0  # 2·1024³ FLOPs at 100 TFLOP/s: 21.47 µs; scale K for 1000 µs
    k = round(1000 * 100e6 / (2 * side * side))
    big = [(op(GEMM, gemm=(1, side, side, k)), "forward")] * 10
    kernel = rates.gemm_us("bfloat16", 1, side, side, k)
    played = step_time.play(big, StepCosts(rates, "standard"))
    assert played["step"] == pytest.approx(10.0 + 10 * kernel)
    graphed = step_time.play(big, StepCosts(rates, "standard", graphed=True))
    assert graphed["step"] == pytest.approx(10 * kernel) and graphed["host"] == 0


def test_a_sync_makes_the_host_wait_for_the_gpu(tmp_path):
    """A GEMM of ~1000 µs, a sync (.item()), then a forward op: the op is issued only after the
    GEMM is done, so its kernel ends at 10 + GEMM + 20 (the sync) + 10 + 2."""
    rates = rates_of(tmp_path, forward_us=10.0, sync_us=20.0, floor_us=2.0)
    gemm = op(GEMM, gemm=(1, 16384, 16384, 16384))
    kernel = rates.gemm_us("bfloat16", 1, 16384, 16384, 16384)
    ops = [(gemm, "forward"), (op(SYNC), "forward"), (op(MEMORY, moved=8), "forward")]
    played = step_time.play(ops, StepCosts(rates, "standard"))
    assert played["step"] == pytest.approx(10 + kernel + 20 + 10 + 2)


def test_each_ops_phase_and_chunk_come_from_the_phase_marks():
    """Two chunks (forward_done, _clip_inputs_saved, backward_done each), then the finish. What
    a chunk dispatches after its backward's end and before the sync that reads its loss (an
    optimizer's step skipped, Opacus' clipping) is of the finish's kind, though the ops sit
    before the next chunk's first mark; the optimizer's own .item() is no such sync."""
    marks = ["forward_done", "_clip_inputs_saved", "backward_done"] * 2 + ["step_done"]
    ops = [op(MEMORY, segment=s, name=f"op{s}") for s in range(3)]
    ops += [op(MEMORY, 3, name="clip"), op(SYNC, 3, name="opt_item", optimizer=True)]
    ops += [op(MEMORY, 3, name="clip2"), op(SYNC, 3, name="loss_item")]
    ops += [op(MEMORY, segment=s, name=f"op{s}") for s in range(3, 8)]
    chunks, finish = step_time.chunk_groups(ops, marks)
    assert [[(o.name, phase) for o, phase in chunk] for chunk in chunks] == [
        [("op0", "forward"), ("op1", "backward"), ("op2", "finish")],
        [("clip", "finish"), ("opt_item", "finish"), ("clip2", "finish"), ("loss_item", "finish"),
         ("op3", "forward"), ("op4", "backward"), ("op5", "finish")],
    ]  # fmt: skip
    assert [(o.name, phase) for o, phase in finish] == [("op6", "finish"), ("op7", "finish")]


def test_chunks_beyond_the_recorded_ones_cost_what_the_last_recorded_one_did(tmp_path):
    """Recorded: chunk 1 of one op, chunk 2 of two, a finish of one (host-bound, 10 µs each
    and a 2 µs kernel); a batch of 5 chunks adds 3 more of the second chunk's 22 µs."""
    rates = rates_of(tmp_path, forward_us=10.0, finish_us=10.0, floor_us=2.0)
    marks = ["forward_done", "backward_done", "forward_done", "backward_done", "step_done"]
    ops = [op(MEMORY, 0, moved=8), op(MEMORY, 2, moved=8), op(MEMORY, 2, moved=8)]
    ops.append(op(MEMORY, 4, moved=8))
    recorded = step_time.predicted_time(ops, marks, StepCosts(rates, "standard"), 2)
    assert recorded["step_ms"] * 1e3 == pytest.approx(12 + 22 + 12)
    five = step_time.predicted_time(ops, marks, StepCosts(rates, "standard"), 5)
    assert five["step_ms"] * 1e3 == pytest.approx(12 + 22 + 12 + 3 * 22)


def test_gemm_times_are_the_grids_on_it_and_grow_with_the_work_beyond_it(tmp_path):
    rates = rates_of(tmp_path, tflops=100.0, floor_us=2.0)
    large = SIDES[-1]
    on_grid = rates.gemm_us("bfloat16", 1, large, large, large)
    assert on_grid == pytest.approx(2 * large**3 / 100e6)
    assert rates.gemm_us("bfloat16", 2, large, large, large) == pytest.approx(2 * on_grid)
    between = rates.gemm_us("bfloat16", 1, large, large, 4096)  # K between 1024 and 16384
    assert between == pytest.approx(2 * large * large * 4096 / 100e6)  # t ∝ K: exact in logs
    assert rates.gemm_us("bfloat16", 1, 1, 1, 1) == pytest.approx(2.0)  # below the grid: floor
    # a batch of dot products longer than the grid: the thin table, times the outputs
    thin = rates.gemm_us("bfloat16", 4, 1, 1, 2**20)
    assert thin == pytest.approx(4 * 2**20 / THIN_RATE)
    assert rates.gemm_us("bfloat16", 4, 2, 3, 2**20) == pytest.approx(6 * thin)


def test_attention_and_memory_times(tmp_path):
    rates = rates_of(tmp_path, attention_tflops=50.0, gbps=1000.0, floor_us=2.0,
                     memory_ops={"aten.sum.dim_IntList": 100.0})  # fmt: skip
    flops = 10**12
    assert rates.attention_us("bfloat16", "forward", 128, 2048, flops) == pytest.approx(2e4)
    assert rates.memory_us(2**30) == pytest.approx(2**30 / 1e6)  # 1000 GB/s: 1e6 bytes a µs
    assert rates.memory_us(16) == pytest.approx(2.0)  # the floor
    # an op measured slower per byte than an add takes its own rate
    assert rates.memory_us(2**20, "aten.sum.dim_IntList") == pytest.approx(2**20 / 100.0)


@pytest.mark.parametrize(
    "broken, message",
    [
        ("[]", "not a JSON object"),
        ("{", "Expecting"),
        (json.dumps({**card_table(), "schema": 1}), "schema 1"),
        (json.dumps(card_table(fixed_us={"forward": -1.0, "backward": 0.0, "finish": 0.0})),
         "a host cost is negative"),
        (json.dumps({k: v for k, v in card_table().items() if k != "host"}), "'host'"),
        (json.dumps({**card_table(), "gemm": {"bfloat16": [[16, 16, 16, 1], [16, 64, 16, 1]]}}),
         "the GEMM grid lacks"),
    ],
)  # fmt: skip
def test_a_broken_table_is_one_line(tmp_path, broken, message):
    path = tmp_path / "broken.json"
    path.write_text(broken)
    with pytest.raises(card_rates.CardRatesError) as error:
        card_rates.load_card(str(path))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_shipped_h200_table_loads_with_every_trainers_host_costs():
    assert "NVIDIA H200" in card_rates.shipped_cards()
    rates = card_rates.card_rates("NVIDIA H200")
    trainers = ("standard", "dpsgd", "ghost", "flash")
    assert set(rates.host_by_trainer) == {
        t + kind for t in trainers for kind in ("", "+hf", "+lora")
    }
    # an H200's bf16 GEMM of 4096³ runs at hundreds of TFLOP/s, fp32 at tens
    bf16 = 2 * 4096**3 / rates.gemm_us("bfloat16", 1, 4096, 4096, 4096) / 1e6
    fp32 = 2 * 4096**3 / rates.gemm_us("float32", 1, 4096, 4096, 4096) / 1e6
    assert 300 < bf16 < 1000 and 20 < fp32 < 70
    assert card_rates.card_file_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3.json"


def test_the_op_record_counts_flops_as_torchs_counter_does():
    """A Linear's forward and backward: the GEMM FLOPs the record gives, against torch's
    FlopCounterMode over the same work; a view launches nothing; .item() is a sync; the
    optimizer's ops are marked as its."""
    layer = torch.nn.Linear(48, 24)
    x = torch.randn(6, 10, 48, requires_grad=True)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    with FlopCounterMode(display=False) as counter:
        layer(x).sum().backward()
    record = OpRecord()
    with record:
        out = layer(x)
        record.mark("forward_done")
        out.sum().backward()
        record.mark("backward_done")
        out.sum().item()
        optimizer.step()
    gemms = [o for o in record.ops if o.kind == GEMM]
    assert sum(o.flops for o in gemms) == counter.get_total_flops()
    assert all(o.backward for o in gemms if o.segment == 1)
    assert not any(o.backward for o in record.ops if o.segment == 0)
    assert any(o.kind == VIEW for o in record.ops)
    assert [o.kind for o in record.ops if o.name == "aten._local_scalar_dense.default"] == [SYNC]
    assert {o.name for o in record.ops if o.optimizer} >= {"aten.add_.Tensor"}
    moved = next(o.bytes for o in record.ops if o.optimizer)
    assert moved == 3 * 4 * layer.weight.numel() or moved == 3 * 4 * layer.bias.numel()


def test_the_optimizers_foreach_steps_move_the_tensors_they_write_in_place():
    """torch.optim's foreach steps write their tensor lists in place and return nothing: each is
    a kernel moving what it reads and writes, counted from the parameters' sizes; Adam's count
    of its steps (scalars the host keeps) launches nothing."""
    layer = torch.nn.Linear(48, 24)
    weights = 4 * sum(p.numel() for p in layer.parameters())  # one list's bytes, fp32
    for optimizer, op, lists in (
        (torch.optim.SGD(layer.parameters(), lr=0.1, foreach=True), "_foreach_add_.List", 3),
        (
            torch.optim.Adam(layer.parameters(), lr=0.1, foreach=True),
            "_foreach_addcdiv_.ScalarList",
            4,
        ),
    ):  # read p and g, write p; read p, exp_avg and the denominator, write p
        layer(torch.randn(6, 48)).sum().backward()
        record = OpRecord()
        with record:
            optimizer.step()
        step = [o for o in record.ops if o.name == f"aten.{op}"]
        assert [(o.kind, o.bytes, o.optimizer) for o in step] == [(MEMORY, lists * weights, True)]
        foreach = [o for o in record.ops if o.name.startswith("aten._foreach_")]
        counted = {o.name: o.kind for o in foreach if o.name != "aten._foreach_add_.Tensor"}
        assert set(counted.values()) == {MEMORY}, counted
    steps = [o.kind for o in foreach if o.name == "aten._foreach_add_.Tensor"]
    assert steps == [VIEW]  # Adam's step counts


def test_an_out_buffer_is_written_once_and_not_read():
    """An op's ``out=`` buffers (a result written into them, FSDP2's copies) count once, as
    written, whether the op returns them or not: an add moves its two inputs and its output."""
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    size = 64 * 32 * 4
    record = OpRecord()
    with record:
        torch.ops.aten.add.out(a, b, out=torch.empty_like(a))
        torch.ops.aten._foreach_add.List_out([a, b], [b, a], out=[torch.empty_like(a)] * 2)
    moved = {o.name: o.bytes for o in record.ops if o.kind == MEMORY}
    assert moved == {"aten.add.out": 3 * size, "aten._foreach_add.List_out": 6 * size}


def test_the_card_measures_every_foreach_step_sgd_and_adam_dispatch():
    """The card's table rates torch.optim's foreach steps as its SGD and Adam dispatch them
    (benchmarks/kernel_rates.optimizer_cases): every foreach op over the parameters' lists
    that a step records is one the card measures (the step counts' add runs on the host)."""
    cases = benchmark_script("kernel_rates.py").optimizer_cases(4, device="cpu")
    measured = {str(op) for op, *_ in cases}
    layer = torch.nn.Linear(48, 24)
    weights = 4 * sum(p.numel() for p in layer.parameters())
    dispatched = set()
    for optimizer in (torch.optim.SGD(layer.parameters(), lr=0.1, foreach=True),
                      torch.optim.Adam(layer.parameters(), lr=0.1, foreach=True)):  # fmt: skip
        layer(torch.randn(6, 48)).sum().backward()
        record = OpRecord()
        with record:
            optimizer.step()
        dispatched |= {o.name for o in record.ops if "_foreach_" in o.name and o.bytes >= weights}
    assert dispatched and dispatched <= measured, dispatched - measured
    for op, args, kwargs in cases:  # each case runs as its step does
        op(*args, **kwargs)


def test_a_cpu_attention_is_counted_with_torchs_attention_formulas():
    q = torch.randn(2, 4, 64, 32, requires_grad=True)
    record = OpRecord()
    with record:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.sum().backward()
    attention = [o for o in record.ops if o.kind == ATTENTION]
    assert [o.backward for o in attention] == [False, True]
    assert attention[0].flops == 4 * 2 * 4 * 64 * 64 * 32  # QKᵀ and PV
    assert attention[1].flops == math.floor(2.5 * attention[0].flops)
    assert {(o.seq_len, o.head_dim) for o in attention} == {(64, 32)}


def test_a_plan_gives_each_configs_time_and_the_fine_tunes(tmp_path):
    """The CLI's plan on the shipped H200 table: ms a step, samples a second from it, and with
    --epochs the fine-tune's steps and hours from the same ms; several ranks: timed where the
    table has their collectives (2), else no time, and why (4)."""
    from tests.cli_helpers import SMALL_MODEL, in_process

    base = ["--mode=capacity", "--trainers", "standard", "flash", "--batch_sizes", "4",
            "--seq_lens", "16", *SMALL_MODEL, "--output_dir", tmp_path]  # fmt: skip
    run = in_process(*base, "--run_name", "one", "--epochs", "2", "--dataset_size", "10")
    assert run.returncode == 0, run.stderr
    assert "predicted ms (NVIDIA H200)" in run.stdout and "ms a step on NVIDIA H200" in run.stdout
    entries = json.loads((tmp_path / "one" / "capacity.json").read_text())["configs"]
    for entry in entries:
        time = entry["predicted_time"]
        assert time["card"] == "NVIDIA H200" and time["step_ms"] > 0
        assert time["samples_per_s"] == pytest.approx(4 / (time["step_ms"] / 1e3))
        tune = time["fine_tune"]
        assert tune["steps"] == 3 * 2  # ceil(10 / 4) steps an epoch
        assert tune["wall_hours"] == pytest.approx(6 * time["step_ms"] / 3.6e6)
        # a tiny model's kernels are shorter than their launches: the host bounds its step,
        # and the table says so in its own column
        assert time["bound_by"] == "host" and "host's speed" in time["bound_note"]
    table = (tmp_path / "one" / "capacity.md").read_text()
    header = next(line for line in table.splitlines() if "predicted ms" in line)
    column = [c.strip() for c in header.split("|")].index("bound by")
    rows = [line for line in table.splitlines() if line.startswith("| standard")]
    assert rows and all(row.split("|")[column].strip() == "host" for row in rows)
    for ranks in ("2", "4"):
        run = in_process(*base, "--run_name", ranks, "--distributed", "ddp", "--world_size", ranks)
        assert run.returncode == 0, run.stderr
        entries = json.loads((tmp_path / ranks / "capacity.json").read_text())["configs"]
        times = [e["predicted_time"] for e in entries]
        if ranks == "2":
            assert all(time["step_ms"] > 0 and time["comm_ms"] > 0 for time in times)
        else:
            assert all(time["step_ms"] is None for time in times)
            assert all("no calibration of 4 ranks' collectives" in time["why"] for time in times)


def test_a_graphed_plans_peak_is_called_a_lower_bound(tmp_path):
    """A CUDA graph's private pool holds more than the eager step the fake step runs: the plan
    says its peak is a bound, in capacity.json and capacity.md (the CLI plans --cuda_graph on
    a CUDA machine only: the prediction here is made directly); an eager plan says nothing."""
    from dp_cost.capacity.result import capacity_result
    from dp_cost.core.schema import empty_result
    from dp_cost.measure import worker
    from dp_cost.report import capacity as report_capacity

    results = []
    for graphed in (True, False):
        config = ExperimentConfig(trainer="standard", batch_size=2, seq_len=16, cuda_graph=graphed)
        result = empty_result(config.to_dict(), config.config_dir, "ok", None)
        result["prediction"] = capacity_result(config, worker.build_trainer)
        results.append(result)
    report_capacity.write_capacity_files(str(tmp_path), results)
    entries = json.loads((tmp_path / "capacity.json").read_text())["configs"]
    (graphed,) = [e for e in entries if e["config_dir"].endswith("_graph")]
    (eager,) = [e for e in entries if not e["config_dir"].endswith("_graph")]
    assert "lower bound" in graphed["peak_note"] and eager["peak_note"] is None
    assert "Peaks that are bounds" in (tmp_path / "capacity.md").read_text()
    assert graphed["predicted_time"]["graphed"] and graphed["predicted_time"]["host_ms"] == 0
    assert eager["predicted_time"]["host_ms"] > 0


def test_the_candidate_physical_batches_halve_a_ranks_share():
    from dp_cost.capacity.recommend import candidate_batches

    assert candidate_batches(8) == [8, 4, 2, 1]
    assert candidate_batches(6) == [6, 3, 2, 1]
    assert candidate_batches(5) == [5, 3, 2, 1]
    assert candidate_batches(1) == [1]


def test_recommend_ranks_the_dp_trainers_by_their_fastest_fitting_batch(tmp_path, capsys):
    """--recommend on a budget where the whole batch does not fit dpsgd or flash: each config's
    best is a candidate that fits, none faster among those that fit; the DP trainers are named
    fastest first, once each whatever the physical caps asked; standard only for reference.
    On a budget nothing fits, no trainer is recommended, and each says why."""
    from dp_cost.report import capacity as report_capacity
    from tests.cli_helpers import SMALL_MODEL, in_process

    base = ["--mode=capacity", "--seq_lens", "64", *SMALL_MODEL, "--recommend", "--output_dir",
            tmp_path]  # fmt: skip
    run = in_process(*base, "--batch_sizes", "8", "--trainers", "standard", "dpsgd", "flash",
                     "--gpu_memory", "0.86", "--run_name", "rec")  # fmt: skip
    assert run.returncode == 0, run.stderr
    entries = json.loads((tmp_path / "rec" / "capacity.json").read_text())["configs"]
    best = {}
    for e in entries:
        candidates = e["recommendation"]["candidates"]
        assert [c["physical_batch_size"] for c in candidates] == [8, 4, 2, 1]
        chosen = e["recommendation"]["best"]
        assert chosen in candidates and chosen["fits"]
        assert all(c["samples_per_s"] <= chosen["samples_per_s"] for c in candidates if c["fits"])
        assert not any(c.get("samples_per_s") for c in candidates if not c["fits"])
        if e["trainer"] == "dpsgd":  # its whole batch does not fit: a smaller one is chosen
            assert not candidates[0]["fits"] and chosen["physical_batch_size"] < 8
        best[e["trainer"]] = chosen["samples_per_s"]
    order = sorted(("dpsgd", "flash"), key=lambda t: -best[t])
    # the same configs again under another physical cap: one line, each trainer named once
    again = [{**e, "config_dir": e["config_dir"] + "_pb4"} for e in entries]
    (line,) = report_capacity.recommendation_lines(entries + again).strip().splitlines()[1:]
    assert line.startswith("- 1b, batch 8")
    assert line.index(f"run {order[0]} at") < line.index(f"then {order[1]} at")
    assert line.count(f"{order[0]} at") == 1 and line.count("standard at") == 1
    assert "for reference, no DP: standard at" in line
    assert line in (tmp_path / "rec" / "capacity.md").read_text()
    # in this test, not one of its own: the plan costs most of the test's time
    recommend_check_against_steps_set_by_hand(tmp_path / "rec", entries, tmp_path, capsys)
    # nothing fits: a batch of 1 (one candidate to plan, not four) fits 0.74 GiB no more than
    # the batch of 8's chunks of 1 do
    run = in_process(*base, "--batch_sizes", "1", "--trainers", "dpsgd", "--gpu_memory", "0.74",
                     "--run_name", "none")  # fmt: skip
    assert run.returncode == 0, run.stderr
    text = (tmp_path / "none" / "capacity.md").read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("- 1b, batch 1")]
    assert "no DP trainer to run" in line and "dpsgd: no physical batch fits 0.74 GiB" in line
    for refused, why in (([], "--gpu_memory GiB"),
                         (["--gpu_memory", "80", "--distributed", "ddp", "--world_size", "4"],
                          "no collectives of 4 ranks (measured: 2")):  # fmt: skip
        run = in_process("--mode=capacity", "--recommend", *refused, "--output_dir", tmp_path)
        assert run.returncode == 2 and why in run.stderr


def recommend_check_against_steps_set_by_hand(plan_dir, entries, tmp_path, capsys) -> None:
    """benchmarks/recommend_check.py on a real --recommend plan, its candidates "measured" by
    hand-made result files (the whole batch's as a measuring run writes it, with no cap; the
    plan's own folder passed among them): measured as predicted, the choice is the fastest
    (agrees); the slowest fitting candidate measured fastest instead, the choice is named
    slower by the ratio set here; measured as fast as the choice, it still agrees; the choice
    failed on the card, or measured with another optimizer, it is not measured; a fitting
    candidate left out is named, a broken file and a step of other settings get a warning."""
    script = benchmark_script("recommend_check.py")
    dp = [e for e in entries if e["trainer"] != "standard"]
    choice = max(dp, key=lambda e: e["recommendation"]["best"]["samples_per_s"])
    chosen = (choice["trainer"], choice["recommendation"]["best"]["physical_batch_size"])
    choice_ms = choice["recommendation"]["best"]["step_ms"]
    fitting = [(e, c) for e in dp for c in e["recommendation"]["candidates"] if c["fits"]]
    named = [((e["trainer"], c["physical_batch_size"]), c["step_ms"]) for e, c in fitting]
    slowest = max(named, key=lambda pair: pair[1])[0]
    left_out = next(name for name, _ in named if name not in (slowest, chosen))

    def check(folder_name, ms=None, chosen_fields=None, chosen_config=None):
        """The script on the candidates measured as predicted but for ``ms`` (name -> ms),
        the choice's result and config updated with ``chosen_fields`` and ``chosen_config``:
        (its verdict, out, err)."""
        folder = tmp_path / folder_name
        for entry, candidate in fitting:
            name = (entry["trainer"], candidate["physical_batch_size"])
            if name == left_out:
                continue
            result = json.loads((plan_dir / entry["config_dir"] / "result.json").read_text())
            config = result["config"]
            config["capacity"] = False  # measured
            config["max_physical_batch_size"] = name[1] if name[1] < config["batch_size"] else None
            result.update(status="ok", median_time_ms=(ms or {}).get(name, candidate["step_ms"]))
            if name == chosen:
                result.update(chosen_fields or {})
                config.update(chosen_config or {})
            (folder / f"{name[0]}_pb{name[1]}").mkdir(parents=True)
            (folder / f"{name[0]}_pb{name[1]}" / "result.json").write_text(json.dumps(result))
        (folder / "broken").mkdir()
        (folder / "broken" / "result.json").write_text("{not json")
        capsys.readouterr()
        out_file = tmp_path / f"{folder_name}.json"
        argv = [str(plan_dir), str(folder), str(plan_dir), "--out", str(out_file)]
        assert script.main(argv) == 0
        printed = capsys.readouterr()
        (found,) = json.loads(out_file.read_text())
        return found, printed.out, printed.err

    found, out, err = check("as_predicted")
    assert len(err.strip().splitlines()) == 1 and "broken" in err
    assert tuple(found["choice"]) == chosen and tuple(found["fastest"]) == chosen
    assert found["verdict"] == "agrees" and ": agrees" in out
    assert [tuple(m) for m in found["not_measured"]] == [left_out]
    found, out, _ = check("slowest_fastest", ms={slowest: 1.0})
    assert tuple(found["fastest"]) == slowest and found["fastest_ms"] == 1.0
    assert found["verdict"] == "differs" and f"differs (the choice {choice_ms - 1:+.1%})" in out
    found, _, _ = check("a_tie", ms={slowest: choice_ms})
    assert found["verdict"] == "agrees"
    found, _, _ = check("choice_failed", chosen_fields={"status": "oom", "median_time_ms": None})
    assert found["verdict"] == "choice not measured" and chosen in map(tuple, found["not_measured"])
    found, _, err = check("other_optimizer", chosen_config={"optimizer": "adam"})
    assert found["verdict"] == "choice not measured" and "optimizer differ" in err
    assert script.main([str(tmp_path / "no_such_run"), str(tmp_path)]) == 2


def two_rank_plan(plan_dir, samples_per_s: dict) -> list[dict]:
    """A --recommend plan of two ranks planned under both shardings, written as capacity.json
    with its configs' result.json: ``samples_per_s`` (trainer, sharding) -> the best candidate's
    rate at physical batch 4 (None: nothing fits); physical 2 fits at half that rate."""
    entries = []
    for (trainer, sharding), rate in samples_per_s.items():
        config = {"trainer": trainer, "distributed": sharding, "world_size": 2, "model": "1b",
                  "batch_size": 8, "seq_len": 64, "dtype": "bf16", "capacity": True}  # fmt: skip
        candidates = [
            {"physical_batch_size": 4, "fits": rate is not None, "step_ms": rate and 8e3 / rate,
             "samples_per_s": rate},
            {"physical_batch_size": 2, "fits": True, "step_ms": rate and 16e3 / rate,
             "samples_per_s": rate and rate / 2},
        ] if rate else [{"physical_batch_size": 4, "fits": False}]  # fmt: skip
        best = candidates[0] if rate else None
        recommendation = {"gpu_memory_gib": 80, "candidates": candidates, "best": best,
                          "why": None if rate else "no physical batch fits 80 GiB"}  # fmt: skip
        config_dir = f"{trainer}_{sharding}"
        (plan_dir / config_dir).mkdir(parents=True)
        (plan_dir / config_dir / "result.json").write_text(json.dumps({"config": config}))
        entries.append({**config, "config_dir": config_dir, "lora_rank": None,
                        "recommendation": recommendation})  # fmt: skip
    (plan_dir / "capacity.json").write_text(json.dumps({"configs": entries}))
    return entries


def test_recommend_ranks_every_trainer_under_every_sharding_in_one_answer(tmp_path, capsys):
    """Two ranks planned under DDP and FSDP2: one paragraph ranks each (trainer, sharding) by
    its best, the fastest named first with its sharding, one that fits nowhere says why, one
    the run could not plan says why once (whatever the caps), and standard's fastest sharding
    is the reference. benchmarks/recommend_check.py compares the
    choice with the measured candidates of both shardings (a run with no cap measured at a
    rank's whole share): a faster one measured under the other sharding makes it differ."""
    from dp_cost.parallel.mode import sharded_modes
    from dp_cost.report import capacity as report_capacity

    ddp, fsdp = sharded_modes()
    rates = {("standard", ddp): 30.0, ("standard", fsdp): 40.0, ("flash", ddp): 20.0,
             ("flash", fsdp): 25.0, ("ghost", ddp): 22.0, ("ghost", fsdp): None}  # fmt: skip
    plan_dir = tmp_path / "plan"
    entries = two_rank_plan(plan_dir, rates)
    config = {"trainer": "dpsgd", "distributed": fsdp, "world_size": 2, "model": "1b",
              "batch_size": 8, "seq_len": 64, "dtype": "bf16"}  # fmt: skip
    skipped = {"config": config, "status": "skipped", "error": "no FSDP2 path\n(use flash)"}
    capped = {**skipped, "config": {**config, "max_physical_batch_size": 2}}  # the same contender
    refused = report_capacity.refused_entries([skipped, capped, {"status": "error"}])
    (line,) = report_capacity.recommendation_lines(entries, refused).strip().splitlines()[1:]
    words = {sharding: report_capacity.contender_words({"trainer": "t", "distributed": sharding,
             "world_size": 2})[len("t under "):] for sharding in (ddp, fsdp)}  # fmt: skip
    assert line.count(f"; dpsgd under {words[fsdp]}: skipped: no FSDP2 path (use flash)") == 1
    assert line.startswith("- 1b, batch 8, seq 64, bf16, 2 × 80 GiB: run flash under ")
    order = [f"flash under {words[fsdp]}", f"ghost under {words[ddp]}", f"flash under {words[ddp]}"]
    assert [line.index(f"{name} at physical batch 4") for name in order] == sorted(
        line.index(f"{name} at physical batch 4") for name in order
    )
    assert f"ghost under {words[fsdp]}: no physical batch fits 80 GiB" in line
    assert f"for reference, no DP: standard under {words[fsdp]} at physical batch 4" in line
    script = benchmark_script("recommend_check.py")
    measured = tmp_path / "measured"
    steps = {("flash", fsdp): 300.0, ("flash", ddp): 250.0, ("ghost", ddp): 400.0}
    for (trainer, sharding), ms in steps.items():
        config = {"trainer": trainer, "distributed": sharding, "world_size": 2, "model": "1b",
                  "batch_size": 8, "seq_len": 64, "dtype": "bf16",  # a rank's whole share: 4
                  "max_physical_batch_size": None if trainer == "flash" else 4}  # fmt: skip
        (measured / f"{trainer}_{sharding}").mkdir(parents=True)
        (measured / f"{trainer}_{sharding}" / "result.json").write_text(
            json.dumps({"config": config, "status": "ok", "median_time_ms": ms})
        )
    capsys.readouterr()
    assert script.main([str(plan_dir), str(measured), "--out", str(tmp_path / "check.json")]) == 0
    (found,) = json.loads((tmp_path / "check.json").read_text())
    assert found["choice"] == [f"flash under {words[fsdp]}", 4]
    assert found["fastest"] == [f"flash under {words[ddp]}", 4] and found["verdict"] == "differs"
    assert found["measured_order"] == [f"flash under {words[ddp]}", f"flash under {words[fsdp]}",
                                       f"ghost under {words[ddp]}"]  # fmt: skip
    assert "differs (the choice +20.0%)" in capsys.readouterr().out


def test_attention_rates_hold_at_the_lengths_measured_and_go_by_the_ops_direction(tmp_path):
    """Rates are interpolated between the lengths measured and held beyond them (never
    extrapolated to zero or past the card); a recomputed forward in a checkpointed backward
    (dispatched by autograd) is a forward."""
    table = card_table()
    table["attention"]["bfloat16"]["128"] = {
        "forward": [[128, 100.0], [4096, 400.0]], "backward": [[128, 50.0], [4096, 200.0]]
    }  # fmt: skip
    path = tmp_path / "card.json"
    path.write_text(json.dumps(table))
    rates = card_rates.load_card(str(path))
    flops = 10**12
    assert rates.attention_us("bfloat16", "forward", 128, 16, flops) == pytest.approx(1e4)
    assert rates.attention_us("bfloat16", "forward", 128, 2**17, flops) == pytest.approx(2500)
    middle = rates.attention_us("bfloat16", "forward", 128, 724, flops)  # √(128·4096)
    assert middle == pytest.approx(1e6 / 250, rel=1e-3)
    recomputed = op(ATTENTION, flops=flops, backward=True, seq_len=128, head_dim=128,
                    name="aten._scaled_dot_product_flash_attention_for_cpu.default")  # fmt: skip
    backward = dataclasses.replace(
        recomputed, name=recomputed.name.replace(".default", "_backward.default")
    )
    costs = [StepCosts(rates, "standard").op(o, "backward")[1] for o in (recomputed, backward)]
    assert costs == [pytest.approx(1e4), pytest.approx(2e4)]


def test_the_optimizers_item_makes_no_wait(tmp_path):
    """torch.optim reads Adam's step count with .item() on the fake step's CPU tensors; on
    CUDA it lives on the host: the host goes on while the GPU runs the GEMM."""
    rates = rates_of(tmp_path, forward_us=10.0, finish_us=10.0, sync_us=20.0, floor_us=2.0)
    gemm = (op(GEMM, gemm=(1, 16384, 16384, 16384)), "forward")
    item = (op(SYNC, optimizer=True), "finish")
    played = step_time.play([gemm, item], StepCosts(rates, "standard"))
    assert played["step"] == pytest.approx(10 + rates.gemm_us("bfloat16", 1, 16384, 16384, 16384))


def test_a_card_is_found_by_any_spelling_and_a_time_is_compared_on_its_own_card():
    from dp_cost.report import capacity as report_capacity

    assert card_rates.card_rates("nvidia h200").card == "NVIDIA H200"
    predicted = {"card": "NVIDIA H200", "step_ms": 110.0}
    on_it = {"env": {"device": "NVIDIA H200"}, "median_time_ms": 100.0}
    assert report_capacity.step_time_error(on_it, predicted) == pytest.approx(0.1)
    elsewhere = {"env": {"device": "NVIDIA H100 80GB HBM3"}, "median_time_ms": 100.0}
    assert report_capacity.step_time_error(elsewhere, predicted) is None


def card_rates_script():
    return benchmark_script("card_rates.py")


@pytest.mark.parametrize("model_kind", ["lm", "hf", "lora"])
def test_the_shipped_table_still_describes_the_planned_steps_it_was_measured_on(model_kind):
    """The host costs are fitted to the calibration steps' host time over their planned ops: if
    the trainers' planned op lists change, the table no longer describes them (measure it
    again, python benchmarks/card_rates.py). The calibration configs' ops at the shallower
    depth, counted today, against the counts the table was made with (within 5%: a few ops
    differ between torch versions)."""
    from dp_cost.capacity import fake_step
    from dp_cost.measure import worker

    script = card_rates_script()
    table = card_rates.card_rates("NVIDIA H200").path
    by_trainer = json.loads(open(table).read())["host"]["by_trainer"]
    blocks = script.HOST_DEPTHS[0]
    for trainer in ("standard", "dpsgd", "ghost", "flash"):
        config = script.calibration_config(trainer, model_kind, device="cpu")
        with script.depth(config, blocks) as config:
            planned = fake_step.predict(config, worker.build_trainer, record_ops=True)
        counted, _ = script.planned_op_counts(planned)
        row = by_trainer[trainer + card_rates.MODEL_KINDS[model_kind]]
        for phase, count in row["by_depth"][str(blocks)]["planned_ops"].items():
            assert counted[phase] == pytest.approx(count, rel=0.05, abs=2), (trainer, phase)


def test_the_calibration_fit_takes_the_hosts_growth_per_op_and_the_rest_as_fixed():
    """Host µs = fixed + µs an op × ops, measured at several depths: the least-squares line
    (exact where the points lie on one). Ops that do not grow: their mean time, fixed. A line
    whose intercept would be negative: the line through the origin."""
    fit = card_rates.fit_host
    points = {
        depth: ({"forward": 500 + 4 * ops, "finish": finish, "backward": 40 + 2 * ops + noise},
                {"forward": ops, "finish": 3, "backward": ops})
        for depth, ops, finish, noise in ((2, 100, 300.0, 0), (4, 200, 320.0, 10),
                                          (8, 400, 340.0, -15), (16, 800, 320.0, 5))
    }  # fmt: skip
    fitted = fit(points)
    assert fitted["op_us"]["forward"] == pytest.approx(4) and fitted["fixed_us"]["forward"] == 500
    assert fitted["op_us"]["finish"] == 0 and fitted["fixed_us"]["finish"] == 320
    # noise orthogonal to a constant and to the ops (it sums to 0, and to 0 weighted by them):
    # least squares finds the line beneath it
    assert fitted["op_us"]["backward"] == pytest.approx(2) and fitted["fixed_us"]["backward"] == 40
    steep = {2: ({"forward": 100.0}, {"forward": 100}), 6: ({"forward": 700.0}, {"forward": 300})}
    with pytest.raises(ValueError, match="two"):  # one depth cannot tell the parts apart
        fit({2: ({"forward": 100.0}, {"forward": 100})})
    through_origin = (100 * 100 + 300 * 700) / (100**2 + 300**2)
    assert fit(steep) == {
        "op_us": {"forward": round(through_origin, 3)},
        "fixed_us": {"forward": 0.0},
    }


def test_each_chunks_forward_and_backward_and_the_finish_cost_their_fixed_host_time_once(
    tmp_path,
):
    """Two recorded chunks of a forward op and a backward op each, a finish of two ops, in a
    batch of three chunks; host-bound (10 µs an op, 2 µs kernels, syncs free) with 100, 50 and
    30 µs fixed: each chunk pays 100 + 50 beside its ops, the step its finish's 30 once; a
    chunk's own finish (Opacus' clipping between chunks, before the sync reading the previous
    chunk's loss) pays its ops only. Graphed, none."""
    fixed = {"forward": 100.0, "backward": 50.0, "finish": 30.0}
    rates = rates_of(tmp_path, forward_us=10.0, backward_us=10.0, finish_us=10.0, floor_us=2.0,
                     sync_us=0.0, fixed_us=fixed)  # fmt: skip
    marks = ["forward_done", "backward_done"] * 2 + ["step_done"]
    ops = [op(MEMORY, 0, moved=8), op(MEMORY, 1, moved=8)]
    ops += [op(MEMORY, 2, moved=8, name="clip"), op(SYNC, 2), op(MEMORY, 2, moved=8)]
    ops += [op(MEMORY, 3, moved=8), op(MEMORY, 4, moved=8), op(MEMORY, 4, moved=8)]
    timed = step_time.predicted_time(ops, marks, StepCosts(rates, "standard"), 3)
    chunk_one = 100 + 10 + 50 + 10 + 2
    chunk_two = 10 + 2 + 100 + 10 + 50 + 10 + 2  # the clip op, its kernel waited for, then as one
    finish = 30 + 10 + 10 + 2
    assert timed["step_ms"] * 1e3 == pytest.approx(chunk_one + 2 * chunk_two + finish)
    graphed = step_time.predicted_time(ops, marks, StepCosts(rates, "standard", graphed=True), 3)
    assert graphed["host_ms"] == 0


def test_a_configs_host_costs_are_its_model_kinds_row(tmp_path):
    """LoRA fine-tunes read the +lora row, other Hugging Face models the +hf row, the LM its
    trainer's own; a row not measured falls back to the trainer's, then the standard one's."""
    table = card_table()
    rows = table["host"]["by_trainer"]
    for name, scale in (("flash", 2), ("flash+hf", 3), ("standard+lora", 5)):
        rows[name] = {part: {phase: scale * us for phase, us in rows["standard"][part].items()}
                      for part in ("op_us", "fixed_us")}  # fmt: skip
    path = tmp_path / "card.json"
    path.write_text(json.dumps(table))
    rates = card_rates.load_card(str(path))
    kinds = {
        step_time.model_kind(ExperimentConfig(trainer="flash", batch_size=2, seq_len=8, **m))
        for m in ({"model": "meta-llama/Llama-3.2-1B"},)
    }
    assert kinds == {"hf"}
    lora = ExperimentConfig(trainer="flash", batch_size=2, seq_len=8, model="tiny-llama",
                            use_lora=True)  # fmt: skip
    assert step_time.model_kind(lora) == "lora"
    assert step_time.model_kind(ExperimentConfig(trainer="flash", batch_size=2, seq_len=8)) == "lm"
    assert rates.host_us("flash", "forward", "lm")[0] == 20.0
    assert rates.host_us("flash", "forward", "hf")[0] == 30.0
    assert rates.host_us("flash", "forward", "lora")[0] == 20.0  # flash's own, before standard's
    assert rates.host_us("ghost", "forward", "lora")[0] == 50.0  # standard's LoRA row
    assert rates.host_us("ghost", "forward", "hf")[0] == 10.0


def test_an_uncapped_poisson_batch_is_timed_at_its_expected_size():
    """Its memory is planned at the rare largest draw; its time at the logical batch."""
    from dp_cost.capacity.result import capacity_result
    from dp_cost.measure import worker

    config = ExperimentConfig(trainer="standard", model="tiny-llama", batch_size=4, seq_len=16,
                              dataset_size=64)  # fmt: skip
    prediction = capacity_result(config, worker.build_trainer)
    assert prediction["physical_batch_size"] > 4 and prediction["physical_batch_note"]
    assert prediction["time"]["physical_batch_size"] == 4 and prediction["time"]["chunks"] == 1


def test_a_physical_batch_is_reported_as_the_chunk_it_runs_as():
    """4 samples a rank at a cap of 3 run as chunks of 2 and 2 (Runner's near-equal chunks):
    the plan at 3 is physical 2's, so the table, plot and capacity.json say 2, once."""
    from dp_cost.capacity import predictions as planned

    assert [planned.runs_as(p, 4) for p in (1, 2, 3, 4, 6)] == [1, 2, 2, 4, 6]
    assert [planned.runs_as(p, 10) for p in (3, 4, 5, 6, 9)] == [3, 4, 5, 5, 5]
    config = ExperimentConfig(trainer="standard", batch_size=4, seq_len=16)
    steps = planned.Predictions(config, build_trainer=None)
    for physical, peak in ((3, 300), (2, 200), (4, 400)):
        steps.steps[physical, 16] = {"peak": peak * 2**20, "requests": [], "step_requests": []}
    listed = steps.by_physical_batch()
    assert [(p["physical_batch_size"], p["peak_memory_mb"]) for p in listed] == [(2, 200), (4, 400)]


def test_a_step_says_whether_its_host_or_its_gpu_bounds_it(tmp_path, monkeypatch):
    """A planned step's time names the side that is busier: with host costs of 0 µs the GPU,
    with 1 ms an op the host, and then a note that the time moves with the host's speed."""
    from dp_cost.capacity import fake_step
    from dp_cost.measure import worker

    config = ExperimentConfig(trainer="standard", batch_size=2, seq_len=16)
    step = fake_step.predict(config, worker.build_trainer, record_ops=True)
    for host_us, bound in ((0.0, "gpu"), (1000.0, "host")):
        rates = rates_of(tmp_path / bound, forward_us=host_us, backward_us=host_us,
                         finish_us=host_us, sync_us=0.0)  # fmt: skip
        monkeypatch.setattr(step_time, "card_rates", lambda card, rates=rates: rates)
        time = step_time.planned_time(config, step, physical=2, samples=2)
        assert time["bound_by"] == bound
        assert (time["bound_note"] is not None) == (bound == "host")
        assert (time["host_ms"] > time["gpu_ms"]) == (bound == "host")


def step_releasing(first_mib: int, second_mib: int) -> dict:
    """A planned step of a block of ``first_mib`` freed, then one of ``second_mib`` (larger, so
    the first's cached segment cannot hold it): without limit the allocator reserves both, in
    a smaller room it returns the first's segment to the card and places the second."""
    mib = 2**20
    requests = [(1, first_mib * mib), (1, -first_mib * mib), (2, second_mib * mib)]
    return {"peak": second_mib * mib, "requests": [], "step_requests": requests}


def test_a_poisson_plan_fits_only_within_its_reserved_peak_without_limit():
    """A fit that needs the allocator to release its cached segments is a fit for fixed-size
    batches and not for Poisson-sampled ones (a draw's chunks of other sizes fragment the
    cache: on 2 x H200 such a plan ran out of memory with draws and ran with fixed batches):
    fits, needed_room and the search each decide by the rule of the config's sampling."""
    from dp_cost.capacity import card, searches

    budget = 1.0  # a room of 1 GiB less the CUDA context: about 275 MiB
    room = card.allocator_room_bytes(budget)
    step = step_releasing(200, 250)
    assert card.reserved_peak(step) == 450 * 2**20 > room  # both segments cached
    assert card.fits(step, budget) and not card.fits(step, budget, release=False)
    assert card.needed_room(step) <= room < card.needed_room(step, release=False)
    assert card.needed_room(step, release=False) == card.reserved_peak(step)
    poisson = ExperimentConfig(trainer="flash", model="tiny-llama", batch_size=4, seq_len=16,
                               poisson=True)  # fmt: skip
    assert not card.releases_cache(poisson)
    assert card.releases_cache(dataclasses.replace(poisson, poisson=False))
    assert card.releases_cache(dataclasses.replace(poisson, model="tiny"))  # one fixed batch

    def at(physical):  # a second block that grows 40 MiB a sample: 130, 170, 210, 250, ...
        return step_releasing(100, 90 + 40 * physical)

    found = {}
    for release in (True, False):
        axis = searches.Axis(
            judged="batch_sizes_judged", predicted=at, line=lambda passes: (1, 2, 2),
            search=searches.largest_passing, entry=lambda p: {"physical_batch_size": p},
            release=release,
        )  # fmt: skip
        found[release] = searches.largest_on_card(axis, budget, 1)["physical_batch_size"]
        fitting = [p for p in range(1, 50) if card.fits(at(p), budget, release=release)]
        assert found[release] == max(fitting)
    assert found[False] == found[True] - 2  # the first 100 MiB kept cached: 2 samples fewer


def test_capacity_json_states_each_configs_fit_rule(tmp_path):
    """Each prediction says how its fit was decided (``fit_rule``), capacity.json carries it
    and capacity.md's notes say what Poisson sampling changes."""
    from dp_cost.capacity.card import FIT_RULES
    from dp_cost.capacity.result import capacity_result
    from dp_cost.core.schema import empty_result
    from dp_cost.measure import worker
    from dp_cost.report import capacity as report_capacity

    config = ExperimentConfig(trainer="standard", model="tiny-llama", batch_size=2, seq_len=16,
                              poisson=True, gpu_memory=[80.0])  # fmt: skip
    result = empty_result(config.to_dict(), config.config_dir, "ok", None)
    result["prediction"] = capacity_result(config, worker.build_trainer)
    assert result["prediction"]["fit_rule"] == FIT_RULES[False] != FIT_RULES[True]
    report_capacity.write_capacity_files(str(tmp_path), [result])
    written = json.loads((tmp_path / "capacity.json").read_text())
    assert written["configs"][0]["fit_rule"] == FIT_RULES[False]
    causal_lm = dataclasses.replace(config, model="tiny")  # one fixed batch, whatever --poisson
    assert capacity_result(causal_lm, worker.build_trainer)["fit_rule"] == FIT_RULES[True]


def test_each_search_and_the_recommendation_judge_by_the_configs_rule():
    """A step that fits a 1 GiB card only by the allocator releasing its cached segments, at
    every physical batch and length: a Hugging Face model's Poisson-sampled config finds none
    and recommends none, a fixed-size one and the causal LM find the search's cap; a search by
    runs (--find_max_batch) probes fixed-size batches and is planned by their rule."""
    import types

    from dp_cost.capacity import recommend, searches

    def at(physical, seq_len=None, ops=False):
        return step_releasing(200, 250)

    for model, poisson, release in (("tiny-llama", True, False), ("tiny-llama", False, True),
                                    ("tiny", True, True)):  # fmt: skip
        config = ExperimentConfig(trainer="flash", model=model, batch_size=2, seq_len=64,
                                  poisson=poisson, gpu_memory=[1.0])  # fmt: skip
        stub = types.SimpleNamespace(config=config, planned=2, at=at,
                                     at_seq_len=lambda seq_len: at(2, seq_len))  # fmt: skip
        for axis in (searches.batch_axis(stub), searches.seq_len_axis(stub)):
            assert axis.release is release
            found = searches.largest_on_card(axis, 1.0, 1)
            value = found["seq_len"] if axis.cap is None else found["physical_batch_size"]
            assert (value > 0) is release, (model, poisson)
        if not release:
            candidates = recommend.recommendation(config, stub)["candidates"]
            assert candidates and not any(c["fits"] for c in candidates)


def test_a_search_by_runs_is_planned_by_its_probes_rule(monkeypatch):
    """--find_max_batch's probes run fixed-size batches (capacity.probing), so the card's
    prediction they start from is judged by the replay's rule even where the config's budgets
    are judged by the Poisson rule (the same step: the budget finds none, the card the cap)."""
    import types

    from dp_cost.capacity import result as capacity

    step = {**step_releasing(200, 250), "roles": {}, "state": {}, "parameters": 1,
            "trainable_parameters": 1}  # fmt: skip
    config = ExperimentConfig(trainer="flash", model="tiny-llama", batch_size=2, seq_len=64,
                              poisson=True, gpu_memory=[1.0], find_max_batch=True)  # fmt: skip
    stub = types.SimpleNamespace(config=config, planned=2, note=None, at=lambda *a, **k: step,
                                 by_physical_batch=list, by_seq_len=list)  # fmt: skip
    monkeypatch.setattr(capacity, "Predictions", lambda config, build: stub)
    monkeypatch.setattr(capacity, "planned_time", lambda *args: {"step_ms": None})
    planned = capacity.capacity_result(config, build_trainer=None, card_gib=1.0)
    assert planned["largest_physical_batch"][0]["physical_batch_size"] == 0
    assert planned["card"]["physical_batch_size"] > 0
