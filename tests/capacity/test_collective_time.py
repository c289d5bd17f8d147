"""Several ranks' step time: collectives in the op record, in DDP's planned buckets, in the
card's table and in the time model, each against a count or a time worked out by hand here;
the calibration script on gloo's CPU ranks."""

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional

import models
from dp_cost.capacity import card_rates, fake_step, op_list, step_time
from dp_cost.capacity.op_list import COLLECTIVE, GEMM, Op, OpRecord
from dp_cost.capacity.planned_ranks import planned_ranks
from dp_cost.capacity.step_time import StepCosts
from dp_cost.measure import worker
from dp_cost.measure.config import ExperimentConfig
from tests.capacity.card_table import card_table
from tests.cli_helpers import ROOT, benchmark_script
from tests.forked_ranks import forked_ranks

# 2 ranks: every collective 100 µs at 1 KiB, 1000 µs at 1 MiB (log-linear between); 7 µs to issue
COLLECTIVES = {
    "2": {
        "gpu_us": {
            name: [[1024, 100.0], [2**20, 1000.0]]
            for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
        },
        "host_us": {
            name: 7.0 for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
        },
        "measured": {"commit": "test"},
    }
}


def near(expected: float):
    return pytest.approx(expected, rel=1e-4)  # the GEMMs' K is rounded: 1000 µs within 0.01


def rates_of(tmp_path, **settings) -> card_rates.CardRates:
    path = tmp_path / "card.json"
    path.write_text(json.dumps(card_table(collectives=COLLECTIVES, **settings)))
    return card_rates.load_card(str(path))


def gemm_of(rates, target_us: float) -> Op:
    """A bf16 GEMM whose table time is ``target_us`` (every GEMM at 100 TFLOP/s)."""
    side = 1024
    k = round(target_us * 100e6 / (2 * side * side))
    gemm = Op("aten.mm", GEMM, 0, 0, "bfloat16", True, 0, gemm=(1, side, side, k))
    assert rates.gemm_us("bfloat16", 1, side, side, k) == pytest.approx(target_us, rel=1e-3)
    return gemm


def collective(name: str, moved: int, backward: bool) -> Op:
    return Op("c10d.x", COLLECTIVE, 0, moved, "float32", backward, 0, collective=name)


def test_a_collectives_time_is_the_tables_between_its_sizes_and_grows_with_bytes_beyond(tmp_path):
    """At a size measured, its time; between two, log-linear (the geometric mean at the
    geometric mean size: 2^15 B between 100 and 1000 µs is 316.2 µs); below the smallest, its
    latency; beyond the largest, in proportion to the bytes. Only the ranks measured."""
    rates = rates_of(tmp_path)
    assert rates.collective_ranks() == [2]
    assert rates.collective_us("all_reduce", 2**20, 2) == (7.0, pytest.approx(1000.0))
    assert rates.collective_us("all_gather", 2**15, 2)[1] == pytest.approx(1000 / 10**0.5)
    assert rates.collective_us("broadcast", 10, 2)[1] == pytest.approx(100.0)
    assert rates.collective_us("reduce_scatter", 2**22, 2)[1] == pytest.approx(4000.0)
    with pytest.raises(KeyError):
        rates.collective_us("all_reduce", 1024, 4)


def missing_broadcast(section):
    del section["2"]["gpu_us"]["broadcast"]


def a_size_twice(section):
    section["2"]["gpu_us"]["all_reduce"] = [[1024, 100.0], [1024, 200.0]]


def a_list(section):
    section["2"]["gpu_us"] = [1, 2]


def negative_host(section):
    section["2"]["host_us"]["all_gather"] = -1.0


def negative_host_row(section):
    costs = {"forward": 1.0, "backward": -1.0, "finish": 1.0}
    section["2"]["host_by_trainer"] = {"flash@fsdp": {"op_us": costs, "fixed_us": costs}}


@pytest.mark.parametrize(
    "breaks, message",
    [(missing_broadcast, "not all of"), (a_size_twice, "a size twice"), (a_list, "not a card"),
     (negative_host, "not positive"), (negative_host_row, "a host cost is negative")],
)  # fmt: skip
def test_a_broken_collectives_section_is_one_line(tmp_path, breaks, message):
    """Every kind the op record sees must be measured (flash under FSDP2 broadcasts), each
    size once, every time positive: else the table is refused when read, not a plan later."""
    broken = json.loads(json.dumps(COLLECTIVES))
    breaks(broken)
    path = tmp_path / "card.json"
    path.write_text(json.dumps(card_table(collectives=broken)))
    with pytest.raises(card_rates.CardRatesError, match=message):
        card_rates.load_card(str(path))


def test_a_backward_reduction_overlaps_the_kernels_after_it_and_pythons_does_not(tmp_path):
    """GEMM (1000 µs), an all-reduce of 1 MiB (1000 µs) after it, GEMM (1000 µs). Issued by
    the backward (DDP's bucket), it starts when the first GEMM ends (its input) and runs beside
    the second: the step is 2 GEMMs, 5 + 1000 + 1000 µs. Issued by Python (flash's clipped
    sums), the second GEMM waits for it: 5 + 3000 µs. Last in a chunk, a backward reduction is
    waited for at the chunk's end."""
    rates = rates_of(tmp_path, backward_us=5.0)
    gemm = gemm_of(rates, 1000.0)
    for backward, expected in ((True, 2005.0), (False, 3005.0)):
        ops = [(gemm, "backward"), (collective("all_reduce", 2**20, backward), "backward")]
        costs = StepCosts(rates, "standard", ranks=("ddp", 2))
        played = step_time.play([*ops, (gemm, "backward")], costs)
        assert played["step"] == near(expected)
        assert played["comm"] == near(1000.0) and played["gpu"] == near(2000)
    last = [(gemm, "backward"), (collective("reduce_scatter", 2**20, True), "backward")]
    played = step_time.play(last, StepCosts(rates, "standard", ranks=("ddp", 2)))
    assert played["step"] == near(5 + 1000 + 1000)
    # after the backward (DDP's finalize, FSDP2's last callback) the step waits for them
    after = dataclasses.replace(gemm, backward=False)
    played = step_time.play(
        [*last, (after, "finish")], StepCosts(rates, "standard", ranks=("ddp", 2))
    )
    assert played["step"] == near(5 + 1000 + 1000 + 1000)


def test_a_gather_starts_when_issued_and_the_kernels_after_it_wait_for_it(tmp_path):
    """GEMM (1000 µs), then an all-gather of 1 MiB (1000 µs; FSDP2's next layer), then a GEMM
    that needs it. The gather's input is a parameter's shard, there already: it starts when the
    host has issued it (at 5 + 7 µs), beside the first GEMM (5 to 1005 µs), and the second GEMM
    starts when both are done: 12 + 1000 + 1000 µs (after the first GEMM: 3005). A gather
    issued while the link is busy waits for the link."""
    rates = rates_of(tmp_path, forward_us=5.0)
    gemm = gemm_of(rates, 1000.0)
    gather = collective("all_gather", 2**20, False)
    ops = [(gemm, "forward"), (gather, "forward"), (gemm, "forward")]
    assert step_time.play(ops, StepCosts(rates, "standard", ranks=("ddp", 2)))["step"] == near(
        2012.0
    )
    ops = [(gather, "forward"), (gather, "forward"), (gemm, "forward")]
    played = step_time.play(ops, StepCosts(rates, "standard", ranks=("ddp", 2)))
    assert played["step"] == near(7 + 2000 + 1000)  # link busy for two gathers
    # In the backward FSDP2 issues the next layer's gather before this layer's kernels run:
    # they wait for the gather before it (ends at 1007), not for that one (2007).
    backward = dataclasses.replace(gather, backward=True)
    ops = [(backward, "backward"), (backward, "backward"), (gemm, "backward")]
    played = step_time.play(ops, StepCosts(rates, "standard", ranks=("fsdp", 2)))
    assert played["step"] == near(7 + 1000 + 1000)


def test_the_op_record_sees_each_collective_by_the_bytes_of_its_whole_tensor():
    """On a fake group of 2 ranks: an all-reduce of 1000 floats moves 4000 B; a gather into
    2 x 1000 floats and a reduce-scatter out of them 8000 B (the whole tensor, not the shard)."""
    with planned_ranks(2, "cpu"), OpRecord() as record:
        whole, shard = torch.zeros(2000), torch.zeros(1000)
        dist.all_reduce(shard)
        dist.all_gather_into_tensor(whole, shard)
        dist.reduce_scatter_tensor(shard, whole)
        dist.broadcast(shard, src=0)
        functional.all_gather_tensor(shard, 0, dist.group.WORLD)  # DTensor's kind: returns it
    collectives = [(op.collective, op.bytes) for op in record.ops if op.kind == COLLECTIVE]
    assert collectives == [
        ("all_reduce", 4000), ("all_gather", 8000), ("reduce_scatter", 8000), ("broadcast", 4000),
        ("all_gather", 8000),
    ]  # fmt: skip
    assert (
        set(op_list.COLLECTIVES.values()) == card_rates.COLLECTIVE_KINDS
    )  # what the table measures


def test_planned_ddp_all_reduces_every_gradient_once_in_the_synced_backward():
    """Standard under DDP x 2, a rank's 4 samples in chunks of 2: DDP reduces nothing in the
    first (no_sync) chunk and, in the second's backward, each bucket once: its all-reduces
    move every trainable parameter's bytes once (counted from the model itself), and nothing
    more is allocated for them (the peak is the plan's without the reductions, which a test of
    DDP's buckets checks)."""
    config = ExperimentConfig(
        trainer="standard", model="tiny", seq_len=32, batch_size=8, distributed="ddp",
        world_size=2, max_physical_batch_size=2,
    )  # fmt: skip
    step = fake_step.predict(config, worker.build_trainer, record_ops=True)
    model = models.build_model("tiny", device="meta")
    parameter_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    chunks, _ = step_time.chunk_groups(step["ops"], step["marks"])
    reduced = [[op for op, _ in chunk if op.collective == "all_reduce" and op.backward]
               for chunk in chunks]  # fmt: skip
    assert reduced[0] == [] and sum(op.bytes for op in reduced[1]) == parameter_bytes
    assert len(reduced[1]) == len(
        dist._compute_bucket_assignment_by_size(
            [p for p in model.parameters() if p.requires_grad],
            [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20],
        )[0]
    )


def test_a_ddp_steps_extra_chunks_do_not_sync_its_gradients():
    """Standard under DDP x 2 at physical 2: the fake step records three chunks, the last of
    them synced; a rank's 16 samples in 8 chunks sync once, as its 3 chunks do: the same
    communication, and five more unsynced chunks than 3."""
    config = ExperimentConfig(
        trainer="standard", model="tiny", seq_len=32, batch_size=32, distributed="ddp",
        world_size=2, max_physical_batch_size=2,
    )  # fmt: skip
    step = fake_step.predict(config, worker.build_trainer, record_ops=True)
    rates = card_rates.card_rates("NVIDIA H200")
    three, eight = (step_time.config_time(config, step, rates, n) for n in (3, 8))
    assert eight["comm_ms"] == pytest.approx(three["comm_ms"]) and three["comm_ms"] > 0
    chunks, _ = step_time.chunk_groups(step["ops"], step["marks"])
    middle = step_time.play(chunks[1], StepCosts(rates, "standard", ranks=("ddp", 2)),
                            ("forward", "backward"))  # fmt: skip
    assert eight["step_ms"] - three["step_ms"] == pytest.approx(5 * middle["step"] / 1e3)


def test_the_calibration_script_writes_its_ranks_collectives_into_a_table(tmp_path):
    """benchmarks/collective_rates.py on 2 gloo ranks (host clocks): the table it writes into
    keeps what it had, and the toolkit reads its collectives back for 2 ranks."""
    path = tmp_path / "card.json"
    path.write_text(json.dumps(card_table()))
    job = forked_ranks(
        f"{ROOT}/benchmarks/collective_rates.py", "--device", "cpu", "--quick", "--out",
        str(path), ranks=2, timeout=120,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    table = json.loads(path.read_text())
    assert table["gemm"] == card_table()["gemm"]
    rates = card_rates.load_card(str(path))
    assert rates.collective_ranks() == [2]
    assert set(table["collectives"]["2"]["gpu_us"]) == {
        "all_reduce", "reduce_scatter", "all_gather", "broadcast"
    }  # fmt: skip
    assert table["collectives"]["2"]["measured"]["backend"] == "gloo"
    assert set(table["collectives"]["2"]["host_by_trainer"]) == {"standard@ddp", "standard@fsdp"}
    assert rates.host_us("standard", "forward", "lm", ("fsdp", 2)) == (
        table["collectives"]["2"]["host_by_trainer"]["standard@fsdp"]["op_us"]["forward"],
        table["collectives"]["2"]["host_by_trainer"]["standard@fsdp"]["fixed_us"]["forward"],
    )


def test_a_trainers_host_costs_under_ranks_are_its_row_measured_under_them(tmp_path):
    """Under FSDP2 on 2 ranks, flash's row measured there ("flash@fsdp"); a model kind
    without its own such row takes it too; on ranks not measured, or in one process, the
    one-process rows."""
    collectives = json.loads(json.dumps(COLLECTIVES))
    row = {"op_us": {"forward": 40.0, "backward": 50.0, "finish": 60.0},
           "fixed_us": {"forward": 1.0, "backward": 2.0, "finish": 3.0}}  # fmt: skip
    collectives["2"]["host_by_trainer"] = {"flash@fsdp": row}
    path = tmp_path / "card.json"
    path.write_text(json.dumps(card_table(collectives=collectives, forward_us=10.0)))
    rates = card_rates.load_card(str(path))
    assert rates.host_us("flash", "backward", "lm", ("fsdp", 2)) == (50.0, 2.0)
    assert rates.host_us("flash", "backward", "lora", ("fsdp", 2)) == (50.0, 2.0)
    assert rates.host_us("flash", "forward", "lm", ("ddp", 2)) == (10.0, 0.0)
    assert rates.host_us("flash", "forward", "lm", ("fsdp", 4)) == (10.0, 0.0)
    assert rates.host_us("flash", "forward", "lm") == (10.0, 0.0)


def test_a_measured_steps_chunks_on_rank_0_come_from_its_share():
    recost = benchmark_script("time_recost.py")
    result = {"config": {"model": "1b", "batch_size": 16, "world_size": 2,
                         "max_physical_batch_size": 4}}  # fmt: skip
    assert recost.chunks_and_prediction(result) == (2, None)
    result["config"].update(batch_size=17)  # rank 0's share: 9 samples, chunks of at most 4
    assert recost.chunks_and_prediction(result) == (3, None)
