"""The capacity prediction (fake tensors) against what the trainers really allocate on the CPU,
and the searches and checks around it."""

import dataclasses
import glob
import json
import math
import multiprocessing
import os
import shutil
import types

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import models
from dp_cost.capacity import card, fake_step, predictions, probing, searches, storage_record
from dp_cost.capacity.result import capacity_result
from dp_cost.hf import draws
from dp_cost.measure import processes, worker
from dp_cost.measure.config import ExperimentConfig
from dp_cost.report import capacity as report_capacity
from tests.capacity.held_state import held_state_bytes
from tests.cli_helpers import SMALL_MODEL, in_process
from tests.forked_ranks import forked_ranks

TRAINERS = ("standard", "dpsgd", "ghost", "flash")
TINY_LM = dict(model="tiny", seq_len=32, batch_size=6, max_physical_batch_size=2)
TINY_LLAMA_LORA = dict(
    model="tiny-llama", seq_len=24, batch_size=6, max_physical_batch_size=2, use_lora=True,
    lora_rank=4, attention="sdpa",
)  # fmt: skip


@pytest.mark.parametrize("shape", [TINY_LM, TINY_LLAMA_LORA], ids=["tiny-lm", "tiny-llama-lora"])
@pytest.mark.parametrize("trainer", TRAINERS)
def test_predicted_state_equals_the_real_trainers(shape, trainer):
    """Parameters, gradients, Adam's states and the DP state held after a step: the fake step's
    bytes equal the real step's, role by role, for every trainer."""
    config = ExperimentConfig(trainer=trainer, optimizer="adam", **shape)
    predicted = fake_step.predict(config, worker.build_trainer)
    assert predicted["state"] == held_state_bytes(config)
    trainable = predicted["trainable_parameters"]
    assert predicted["state"]["optimizer_states"] >= 2 * 4 * trainable  # exp_avg, exp_avg_sq


RANKS = 2
HERE = os.path.dirname(os.path.abspath(__file__))


def held_by_rank(tmp_path, configs: list[dict]) -> list[list[dict]]:
    """Per config, each rank's ``held_state_bytes`` from one job of RANKS ranks (forked as
    torchrun would start them: tests/forked_ranks.py)."""
    configs_file, out = tmp_path / "configs.json", tmp_path / "held.json"
    configs_file.write_text(json.dumps(configs))
    done = forked_ranks(
        os.path.join(HERE, "state_per_rank.py"), "--configs", configs_file, "--out", out,
        ranks=RANKS,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


# One chunk a rank (2 samples each): what a rank holds after a step does not depend on how its
# share was chunked (one process's chunked state is checked above, against the real trainers),
# and a chunk is most of a prediction's cost: this test plans 14 configs.
ONE_CHUNK_A_RANK = {"batch_size": 2 * RANKS, "max_physical_batch_size": None}
DISTRIBUTED = [
    (distributed, trainer, {**shape, **ONE_CHUNK_A_RANK})
    for distributed, names in (("ddp", TRAINERS), ("fsdp", ("standard", "ghost", "flash")))
    for trainer in names
    for shape in (TINY_LM, TINY_LLAMA_LORA)
]


def test_predicted_state_per_rank_equals_the_real_ranks(tmp_path):
    """Planned in one process for RANKS ranks (a fake process group), the bytes rank 0 holds
    after a step equal, role by role, what rank 0 of a real torchrun job (gloo) holds: DDP's
    replicas, FSDP2's shards (a 1/RANKS share of parameters, gradients and Adam's states)."""
    fields = [
        dict(trainer=trainer, distributed=distributed, optimizer="adam", **shape)
        for distributed, trainer, shape in DISTRIBUTED
    ]
    held = held_by_rank(tmp_path, fields)
    replicated = {}  # (trainer, model) -> the Adam states a DDP rank holds: one process's
    for config_fields, ranks_held in zip(fields, held, strict=True):
        config = ExperimentConfig(**config_fields, world_size=RANKS)
        predicted = fake_step.predict(config, worker.build_trainer)
        assert predicted["state"] == ranks_held[0], config_fields
        key = (config.trainer, config.model)
        if config.distributed == "ddp":
            replicated[key] = ranks_held[0]["optimizer_states"]
        # Sharded: 1/RANKS of a replica's Adam states (the tiny LM's: LoRA's are so small
        # that the allocator's 512-byte blocks round them up more than sharding halves them).
        elif not config.use_lora:
            share = predicted["state"]["optimizer_states"] / replicated[key]
            assert share == pytest.approx(1 / RANKS, rel=0.05), config_fields


def test_dpsgd_under_fsdp2_is_skipped_with_the_trainers_reason(tmp_path):
    run = in_process(
        "--mode=capacity", "--model", "tiny", *SMALL_MODEL, "--seq_lens", "16", "--batch_sizes",
        "4", "--trainers", "dpsgd", "standard", "--distributed", "fsdp", "--world_size", "2",
        "--output_dir", str(tmp_path), "--run_name", "r",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    results = {}
    for path in glob.glob(str(tmp_path / "r" / "*" / "result.json")):
        with open(path) as f:
            result = json.load(f)
        results[result["config"]["trainer"]] = result
    assert results["dpsgd"]["status"] == "skipped" and "FSDP2" in results["dpsgd"]["error"]
    assert results["standard"]["status"] == "ok"
    assert results["standard"]["config"]["world_size"] == 2


def test_ghost_plans_under_fsdp2_where_a_parameter_has_fewer_rows_than_ranks():
    """tiny-llama's classifier head has 3 rows: on 4 ranks one shard is empty and DTensor's
    sum of Opacus' noise and the shard comes out replicated; the ghost optimizer puts each
    noised gradient back on its parameter's placement, so the optimizer's step runs (it
    failed in place, a DTensor error)."""
    config = ExperimentConfig(
        trainer="ghost", model="tiny-llama", use_lora=True, lora_rank=4, batch_size=8,
        seq_len=16, attention="sdpa", capacity=True, distributed="fsdp", world_size=4,
    )  # fmt: skip
    assert fake_step.predict(config, worker.build_trainer)["peak"] > 0


def test_ghost_keeps_its_running_sum_beside_the_chunks_gradient():
    """Opacus' ghost clipping copies each chunk's clipped gradient into a running sum (a
    deepcopy) and the next chunk's gradient is built beside it: two chunks peak one set of
    gradient bytes above one chunk of the same size, an independent count."""
    peaks = {}
    for batch in (4, 8):
        config = ExperimentConfig(trainer="ghost", model="tiny", seq_len=64, batch_size=batch,
                                  max_physical_batch_size=4)  # fmt: skip
        peaks[batch] = fake_step.predict(config, worker.build_trainer)["peak"]
    parameter_bytes = 4 * models.count_parameters(models.build_model("tiny", device="meta"))
    assert peaks[8] - peaks[4] == pytest.approx(parameter_bytes, rel=0.02)


def test_planned_ddp_holds_its_buckets_and_their_rebuild():
    """Under DDP a rank holds, beside one process's step on its share, a flat copy of the
    gradients in DDP's buckets, and in the iteration that rebuilds them a second set: twice the
    parameters' bytes, an independent count."""
    shape = dict(trainer="standard", model="tiny", seq_len=32, optimizer="adam")
    alone = fake_step.predict(ExperimentConfig(batch_size=2, **shape), worker.build_trainer)
    ranks = ExperimentConfig(batch_size=4, distributed="ddp", world_size=2, **shape)
    replicated = fake_step.predict(ranks, worker.build_trainer)
    parameter_bytes = 4 * models.count_parameters(models.build_model("tiny", device="meta"))
    assert replicated["peak"] - alone["peak"] == pytest.approx(2 * parameter_bytes, rel=0.01)


def test_a_storage_resized_in_place_is_freed_and_allocated_again():
    """FSDP2 frees a gathered parameter by resizing its storage to nothing and gathers it
    back into the same storage: the record sees a free and a new allocation."""
    record = storage_record.StorageRecord()
    with record:
        tensor = torch.empty(1000)
        tensor.untyped_storage().resize_(0)
        tensor.untyped_storage().resize_(4000)
    steps = [(event["action"], event["size"]) for event in record.events]
    assert steps == [("alloc", 4096), ("free_completed", 4096), ("alloc", 4096)]
    assert torch.UntypedStorage.resize_ is record._storage_resize  # restored on leaving


def mem_tracker_peak(config: ExperimentConfig) -> int:
    """torch's MemTracker's peak of a real CPU step of ``config`` (after a warm-up step)."""
    torch.manual_seed(0)
    model = models.build_model(config.model)
    trainer = worker.build_trainer(config, model, None, lambda name: None)
    tokens = torch.randint(model.config.vocab_size, (config.batch_size, config.seq_len + 1))
    trainer.step(tokens[:, :-1], tokens[:, 1:])
    tracker = MemTracker()
    tracker.track_external(model, trainer.trainer.optimizer)
    with tracker:
        trainer.step(tokens[:, :-1], tokens[:, 1:])
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_whole_peak_within_ten_percent_of_torch_mem_tracker():
    """Where torch's own MemTracker applies (every parameter trainable: the standard step), the
    predicted peak is within 10% of its peak of a real CPU step (measured in a forked child:
    MemTracker leaves state behind that moves later CPU peaks of this process)."""
    config = ExperimentConfig(trainer="standard", model="tiny", seq_len=64, batch_size=8)
    predicted = fake_step.predict(config, worker.build_trainer)["peak"]
    predicted -= card.GPU_OVERHEADS["cublas_workspace_bytes"]  # CUDA's alone: no CPU step has
    with multiprocessing.get_context("fork").Pool(1) as pool:
        tracked = pool.apply(mem_tracker_peak, (config,))
    assert abs(predicted - tracked) / tracked <= 0.10, (predicted, tracked)


def test_cublas_workspaces_are_made_by_the_first_gemm_of_each_thread():
    """cuBLAS allocates a workspace (32 MiB on Hopper) through the caching allocator at the first
    GEMM of each thread's handle: the forward's, right after that GEMM's output, and autograd's
    backward thread's at the first GEMM of the backward (as an H200's allocation history shows
    them). No other op makes one, and a second step makes none."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = torch.nn.Linear(8, 8)
    with FakeTensorMode(allow_non_fake_inputs=True), storage_record.StorageRecord() as record:
        x = torch.ones(4, 8).relu()  # no GEMM
        first = len(record.events)
        y = layer(x)
        forward_end = len(record.events)
        y.sum().backward()
        step_end = len(record.events)
        layer(x).sum().backward()  # a second step
    made = [i for i, e in enumerate(record.events) if e["addr"] <= storage_record.WORKSPACE_KEYS]
    assert len(made) == 2 and first < made[0] < forward_end < made[1] < step_end
    workspace = card.GPU_OVERHEADS["cublas_workspace_bytes"] // 2
    assert all(record.events[i]["size"] == workspace for i in made)
    assert record.events[made[0] - 1]["size"] == 512  # the forward GEMM's output, [4, 8] fp32
    assert all(record.events[i]["addr"] in record.held() for i in made)  # never freed


def test_dp_state_grows_with_the_physical_batch_as_per_sample_gradients_do():
    """dpsgd keeps one gradient per sample of a chunk: its peak over standard's grows by the
    parameters' bytes per extra sample (Opacus' grad_sample), an independent count."""
    shape = dict(model="tiny", seq_len=16)
    peaks = {}
    for trainer in ("standard", "dpsgd"):
        for physical in (2, 4):
            config = ExperimentConfig(trainer=trainer, batch_size=physical, **shape)
            peaks[trainer, physical] = fake_step.predict(config, worker.build_trainer)["peak"]
    parameter_bytes = 4 * models.count_parameters(models.build_model("tiny", device="meta"))
    extra = (peaks["dpsgd", 4] - peaks["standard", 4]) - (peaks["dpsgd", 2] - peaks["standard", 2])
    assert extra == pytest.approx(2 * parameter_bytes, rel=0.05)


@pytest.mark.parametrize("guess", [1, 5, 31, 32, 33, 60, 500])
@pytest.mark.parametrize("budget", [10, 40, 79])
def test_the_budget_search_finds_the_boundary_from_any_guess(guess, budget):
    def peak(physical):  # an affine peak, as a step's is
        return (2 + physical) * 2**30

    def passes(physical):
        return peak(physical) <= budget * 2**30

    found, judged = searches.largest_passing(passes, guess)
    fits = [p for p in range(1, 200) if passes(p)]
    assert found == (max(fits) if fits else 0)
    assert len(judged) <= 2 * math.ceil(math.log2(abs(guess - found) + 1)) + 2
    if found:  # the answer and the one above it were both judged
        assert found in judged and found + 1 in judged


def step_needing(room_bytes: int, allocated: int) -> dict:
    """A predicted step of one request of ``room_bytes`` (what the allocator must place) and an
    allocated peak of ``allocated`` (what the first guess's line is drawn through)."""
    return {"peak": allocated, "requests": [], "step_requests": [(1, room_bytes)]}


@pytest.mark.parametrize("budget", [79, 140])
def test_the_first_guess_follows_the_room_the_step_needs(budget):
    """Fragmentation grows with the batch, so the allocated peak's slope overshoots the largest
    batch that fits (ghost's first guesses: 4 to 7 samples over). The guess refined through the
    room the step at the first guess needs (card.needed_room, bisected over replays) finds the
    same answer in fewer judgements; needed_room is the least room ``fits`` accepts."""
    gib = card.GIB

    def step(physical):  # allocated: affine; the room it needs: 1% more per 4 samples
        allocated = (2 + physical) * gib
        return step_needing(int(allocated * (1 + physical / 400)), allocated)

    for physical in (8, 30):
        needed = card.needed_room(step(physical))
        room = card.allocator_room_bytes(budget)
        assert card.fits(step(physical), budget) == (needed <= room)
        assert needed - card.ROOM_STEP < step(physical)["step_requests"][0][1] <= needed
    found = {}
    for refinable in (False, True):
        predicted = set()

        def at(physical, predicted=predicted):
            predicted.add(physical)
            return step(physical)

        axis = searches.Axis(
            judged="batch_sizes_judged", predicted=at,
            line=lambda passes: (8, 9, 8), search=searches.largest_passing,
            entry=lambda physical: {"physical_batch_size": physical},
            refinable=lambda low, guess, on=refinable: on and low < guess,
        )  # fmt: skip
        result = searches.largest_on_card(axis, budget, 1)
        found[refinable] = result["physical_batch_size"], len(predicted)
    fitting = [p for p in range(1, 1000) if card.fits(step(p), budget)]
    assert found[True][0] == found[False][0] == max(fitting)
    assert found[True][1] < found[False][1] and found[True][1] <= 2 + 4  # the line's two


def test_where_nothing_fits_the_refined_search_predicts_no_batch_below_one():
    """A model whose step does not fit at one sample (8B full fine-tuning with Adam in one
    80 GiB process): the answer is 0, from the rank's share and one sample predicted, no batch
    of fewer than one sample asked for and no line drawn through a second."""
    asked = []

    def at(physical):
        asked.append(physical)
        return step_needing((100 + physical) * card.GIB, (100 + physical) * card.GIB)

    stub = types.SimpleNamespace(
        config=types.SimpleNamespace(batch_size=8, world_size=1, model="8b", poisson=False),
        at=at,
        planned=8,
    )
    result = searches.largest_on_card(searches.batch_axis(stub), 80, 1)
    assert result["physical_batch_size"] == 0 and min(asked) == 1
    assert set(asked) == {8, 1}  # the share and one sample: no line, no second point


def test_the_batch_search_stops_at_its_cap_and_says_more_may_fit(monkeypatch):
    """A small model fits tens of thousands of samples on a large card: the search judges no
    physical batch above MAX_PHYSICAL_BATCH, and a cap that fits is reported as such (the
    table's "16+"), not as the largest that fits; where the answer is below the cap, it is
    found exactly, as before."""
    assert f"{searches.MAX_PHYSICAL_BATCH}+" in report_capacity.NOTES  # the table's note
    monkeypatch.setattr(searches, "MAX_PHYSICAL_BATCH", 16)
    config = ExperimentConfig(trainer="standard", model="tiny", batch_size=4, seq_len=16,
                              capacity=True, gpu_memory=[80.0, 0.79])  # fmt: skip
    result = capacity_result(config, worker.build_trainer)
    large, small = result["largest_physical_batch"]
    assert large["physical_batch_size"] == 16 and large["search_capped"]
    assert max(p["physical_batch_size"] for p in result["predictions"]) <= 16
    assert large["batch_sizes_judged"] <= 2 * math.ceil(math.log2(16)) + 2
    # 0.79 GiB: less than the CUDA context leaves room for nothing; not the cap
    assert small["physical_batch_size"] == 0 and not small["search_capped"]
    line = report_capacity.entry({"status": "ok", "config": config.to_dict(), "prediction": result})
    header, body = report_capacity.table_cells([line])
    assert body[0][header.index("largest physical at 80 GiB")] == "16+"


def test_the_search_sees_the_one_chunk_step_at_the_logical_batch():
    """Below the logical batch the step runs chunks whose gradients add up, so its peak dips
    where the physical batch reaches the logical one: the search checks both pieces."""
    batch = 8

    def peak(physical):  # chunked: flat and high below the batch; one chunk: grows from lower
        return (10 if physical < batch else 9 + 0.1 * (physical - batch)) * 2**20

    for budget_mb, want in ((9.05, 8), (9.55, 13), (8.5, 0), (10.45, 22), (9.95, 17)):
        for guess in (1, 3, 8, 12, 30):
            fits = lambda p, mb=budget_mb: peak(p) <= mb * 2**20  # noqa: E731
            found, judged = searches.largest_physical(fits, guess, batch)
            assert found == want, (budget_mb, guess, found, judged)
            if found:
                assert found in judged and found + 1 in judged


def test_find_max_batch_probes_from_the_prediction_and_keeps_every_probe():
    """Each probe is a measured config at one physical batch (two steps after a warm-up, no
    trace); the search starts at the card's predicted largest batch, and ends with the largest
    that ran beside the next, which did not."""
    config = ExperimentConfig(trainer="flash", model="tiny", batch_size=8, seq_len=16,
                              capacity=True, find_max_batch=True, device="cuda")  # fmt: skip
    prediction = {
        "card": {"gpu_memory_gib": 79.0, "physical_batch_size": 40},
        "predictions": [{"physical_batch_size": 37, "peak_memory_mb": 1234.0}],
    }
    asked = []

    def run_probe(probe, name):
        asked.append((probe.max_physical_batch_size, probe.batch_size, name))
        assert not probe.capacity and not probe.trace and probe.steps == 2
        fits = probe.max_physical_batch_size <= 37
        status = "ok" if fits else "oom"
        return {"status": status, "peak_memory_mb": 1000.0 if fits else None, "error": None}

    found = probing.find_max_batch(config, prediction, run_probe)
    assert found["largest_physical_batch"] == 37 and found["predicted_largest"] == 40
    assert found["predicted_peak_mb"] == 1234.0 and found["measured_peak_mb"] == 1000.0
    assert [p["physical_batch_size"] for p in found["probes"]] == [a[0] for a in asked]
    assert {37, 38} <= {a[0] for a in asked} and len(asked) <= math.ceil(math.log2(40)) + 3
    assert all(batch == max(8, physical) for physical, batch, _ in asked)
    assert asked[0][2] == "probe_pb40.json"


def test_find_max_batch_stops_on_an_error_that_is_not_memory():
    config = ExperimentConfig(trainer="flash", model="tiny", batch_size=8, seq_len=16)
    prediction = {"card": {"physical_batch_size": 4}, "predictions": []}
    found = probing.find_max_batch(
        config, prediction, lambda probe, name: {"status": "error", "error": "ValueError: x"}
    )
    assert found["largest_physical_batch"] is None and "ValueError: x" in found["error"]
    assert len(found["probes"]) == 1


@pytest.mark.parametrize("longest_that_runs, found", [(1000, 960), (5000, 1024), (10, 0)])
def test_find_max_seq_len_probes_multiples_of_64_up_to_the_models_longest(longest_that_runs, found):
    """Probes at the config's physical batch, sequence lengths in steps of 64 from the
    predicted longest, never past the model's longest (the tiny LM's: 1024); the answer and the
    step above it both probed when the model allows one."""
    config = ExperimentConfig(trainer="standard", model="tiny", batch_size=8, seq_len=16,
                              max_physical_batch_size=4, capacity=True, find_max_seq_len=True,
                              device="cuda")  # fmt: skip
    prediction = {"card": {"seq_len": 640}, "physical_batch_size": 4,
                  "seq_len_predictions": [{"seq_len": 960, "peak_memory_mb": 99.0}]}  # fmt: skip
    asked = []

    def run_probe(probe, name):
        asked.append(probe.seq_len)
        assert (probe.max_physical_batch_size, probe.batch_size) == (4, 8)
        assert not probe.find_max_seq_len and not probe.poisson and probe.steps == 2
        assert name == f"probe_seq{probe.seq_len}.json"
        runs = probe.seq_len <= longest_that_runs
        return {"status": "ok" if runs else "oom", "peak_memory_mb": 1.0 if runs else None}

    searched = probing.find_max_seq_len(config, prediction, run_probe)
    assert searched["longest_seq_len"] == found and searched["predicted_longest"] == 640
    assert [p["seq_len"] for p in searched["probes"]] == asked
    assert all(seq_len % 64 == 0 and 0 < seq_len <= 1024 for seq_len in asked)
    assert found + 64 in asked or found == 1024
    if found:
        assert found in asked
    assert searched["predicted_peak_mb"] == (99.0 if found == 960 else None)


def test_the_predicted_longest_sequence_is_the_last_step_that_fits():
    """--find_max_seq_len's card: the longest multiple of 64 tokens whose replayed step fits the
    card, the next one not (each judged by the same fit as the batch search)."""
    config = ExperimentConfig(trainer="flash", model="tiny", batch_size=2, seq_len=64,
                              find_max_seq_len=True, capacity=True)  # fmt: skip
    budget = 0.9  # GiB, 173 MiB beside the CUDA context: some hundreds of tokens, not 1024
    result = capacity_result(config, worker.build_trainer, budget)
    longest = result["card"]["seq_len"]
    assert 64 <= longest < 1024 and result["card"]["physical_batch_size"] == 2

    def fits_at(seq_len):
        at = predictions.with_physical_batch(dataclasses.replace(config, seq_len=seq_len), 2)
        return card.fits(fake_step.predict(at, worker.build_trainer), budget)

    assert fits_at(longest) and not fits_at(longest + 64)
    judged = {p["seq_len"] for p in result["seq_len_predictions"]}
    assert {longest, longest + 64} <= judged


def test_the_sequence_search_stays_within_the_models_longest():
    """A config already at the model's longest sequence (the tiny LM's 1024) is searched below
    it: no prediction past what the model takes."""
    config = ExperimentConfig(trainer="standard", model="tiny", batch_size=1, seq_len=1024,
                              find_max_seq_len=True, capacity=True)  # fmt: skip
    result = capacity_result(config, worker.build_trainer, 80.0)
    assert result["card"]["seq_len"] == 1024
    assert max(p["seq_len"] for p in result["seq_len_predictions"]) == 1024


def test_several_ranks_leave_nccl_its_buffers():
    """The same requests fit a card alone and not beside NCCL's buffers (two ranks): room is
    the card less the CUDA context, and less NCCL's buffers with ranks."""
    card_gib = 2.0
    one = card.allocator_room_bytes(card_gib, 1)
    assert one == 2 * 2**30 - card.GPU_OVERHEADS["cuda_context_bytes"]
    assert card.allocator_room_bytes(card_gib, 2) == one - card.GPU_OVERHEADS["nccl_buffers_bytes"]
    tensor = one // 2**21 * 2**21  # a 2 MiB multiple: its own segment, whole
    prediction = {"requests": [(1, tensor)], "step_requests": []}
    assert card.fits(prediction, card_gib, 1)
    assert not card.fits(prediction, card_gib, 2)


@pytest.mark.parametrize(
    "search, probes, told",
    [
        ("find_max_batch", [(36, "ok"), (37, "oom")], "batch 36 runs (the next one does not)"),
        ("find_max_batch", [(1, "oom")], "no physical batch runs"),
        ("find_max_seq_len", [(960, "ok"), (1024, "ok")], "sequence length 1024 runs"),
    ],
)  # fmt: skip
def test_a_search_by_runs_is_told_as_it_ended(search, probes, told):
    """The run's line: what runs, and "the next one does not" only where a larger probe ran out
    of memory (not at the model's longest sequence, where none is probed)."""
    from dp_cost.measure import progress

    chosen = probing.SEARCHES[search]
    largest = max((value for value, status in probes if status == "ok"), default=0)
    result = {
        "status": "ok",
        "prediction": {"peak_memory_mb": 1.0, "largest_physical_batch": []},
        search: {
            chosen.found: largest,
            "probes": [{chosen.probed: value, "status": status} for value, status in probes],
        },
    }
    line = progress.describe(result)
    assert f"found by {len(probes)} runs: " in line and told in line
    assert ("the next one does not" in line) == ("the next one does not" in told)


def test_an_uncapped_poisson_batch_is_planned_at_its_rare_quantile():
    config = ExperimentConfig(
        trainer="standard", model="tiny-llama", batch_size=16, seq_len=8, dataset_size=10000
    )
    planned, note = predictions.planned_physical_batch(config)
    assert draws.draw_above_probability(planned, 16, 10000) <= predictions.POISSON_QUANTILE
    assert draws.draw_above_probability(planned - 1, 16, 10000) > predictions.POISSON_QUANTILE
    assert planned > 16 and "Poisson" in note
    capped = ExperimentConfig(**{**config.__dict__, "max_physical_batch_size": 4})
    assert predictions.planned_physical_batch(capped) == (4, None)


# A model whose step grows by ~0.6 MB a sample at seq 128: the search for the largest batch at
# 0.9 GiB takes a couple of predictions (the smaller SMALL_MODEL fits hundreds of samples there,
# found by a dozen and more, each a new shape the fake tensors' cache has not seen).
SEARCHED_MODEL = ["--hidden_dim", "64", "--num_layers", "1", "--num_heads", "2", "--vocab_size",
                  "4000", "--max_seq_len", "128", "--seq_lens", "128"]  # fmt: skip

# Broken predictions a report must skip with one warning (a result.json edited by hand, or
# written by another version).
BROKEN_PREDICTIONS = [
    "abc",
    {"peak_memory_mb": 1.0, "largest_physical_batch": [1]},
    {"peak_memory_mb": 1.0, "physical_batch_size": 2, "predictions": [], "overheads": {},
     "largest_physical_batch": [{"gpu_memory_gib": "80", "physical_batch_size": 3}]},
]  # fmt: skip


def test_capacity_mode_writes_its_report_and_skips_a_broken_prediction(tmp_path):
    """One capacity run (its report read here), then its report again after each broken
    prediction in turn, in a copy of the run."""
    run = in_process(
        "--mode=capacity", "--model", "tiny", *SEARCHED_MODEL, "--batch_sizes", "2",
        "--gpu_memory", "0.9", "0.9", "--output_dir", str(tmp_path), "--run_name", "plan",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    with open(os.path.join(tmp_path, "plan", "capacity.json")) as f:
        written = json.load(f)
    assert sorted(e["trainer"] for e in written["configs"]) == sorted(TRAINERS)
    for entry in written["configs"]:
        (budget,) = entry["largest_physical_batch"]
        assert budget["gpu_memory_gib"] == 0.9 and budget["physical_batch_size"] > 0
        assert entry["predicted_peak_mb"] > 0 and entry["measured_peak_mb"] is None
    assert written["margins"]["cuda_context_bytes"] > 0
    assert os.path.isfile(os.path.join(tmp_path, "plan", "visualizations", "capacity.png"))
    assert "largest physical at 0.9 GiB" in run.stdout
    with open(os.path.join(tmp_path, "plan", "report.html")) as f:
        page = f.read()
    assert "Will it fit?" in page and "largest physical at 0.9 GiB" in page
    assert "capacity.png" in page and "<h2>Summary</h2>" not in page
    assert "NOISY" not in page and "spread" not in page  # no step was timed
    with open(os.path.join(tmp_path, "plan", "run.json")) as f:  # its workers side by side
        load = json.load(f)["machine_load"]
    configs = [ExperimentConfig(t, batch_size=2, seq_len=8, capacity=True) for t in TRAINERS]
    assert load["own_processes"] == processes.workers_at_once(configs, None)
    for n, prediction in enumerate(BROKEN_PREDICTIONS):
        broken = tmp_path / f"broken{n}"
        shutil.copytree(tmp_path / "plan", broken)
        (path,) = glob.glob(os.path.join(broken, "flash_*", "result.json"))
        with open(path) as f:
            result = json.load(f)
        result["prediction"] = prediction
        with open(path, "w") as f:
            json.dump(result, f)
        report = in_process("--mode=report", "--input_dir", broken)
        assert report.returncode == 0, report.stderr
        assert "Traceback" not in report.stderr
        assert "'prediction' has the wrong type" in report.stderr, prediction
        with open(broken / "capacity.json") as f:
            assert [e["trainer"] for e in json.load(f)["configs"]] == ["standard", "dpsgd", "ghost"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode=capacity", "--gpu_memory", "-3"], "finite positive number of GiB"),
        (["--mode=capacity", "--gpu_memory", "inf"], "finite positive number of GiB"),
        (["--mode=capacity", "--gpu_memory", "1e300"], "finite positive number of GiB"),
        (["--mode=capacity", "--validate", "--device", "cpu"], "needs a CUDA device"),
        (["--mode=capacity", "--find_max_batch", "--device", "cpu"], "needs a CUDA device"),
        (["--mode=test", "--find_max_batch"], "applies only to --mode=capacity; mode is test"),
        (["--mode=test", "--gpu_memory", "80"], "applies only to --mode=capacity; mode is test"),
        (["--mode=test", "--validate"], "applies only to --mode=capacity; mode is test"),
        (["--mode=test", "--world_size", "2"], "needs --mode=capacity"),
        (
            ["--mode=capacity", "--distributed", "none", "--world_size", "2"],
            "not none: give one, or neither to plan both",
        ),
        (
            ["--mode=capacity", "--world_size", "2", "--fsdp_sync", "logical"],
            "--fsdp_sync applies to --distributed fsdp",
        ),
        (["--mode=capacity", "--distributed", "fsdp"], "give their number, --world_size W"),
        (["--mode=capacity", "--distributed", "ddp", "--world_size", "0"], "must be in 1.."),
        (["--mode=capacity", "--distributed", "ddp", "--world_size", "9999"], "must be in 1.."),
        (["--mode=capacity", "--distributed", "ddp", "--world_size", "x"], "invalid int value"),
        (
            ["--mode=capacity", "--distributed", "ddp", "--world_size", "2", "--batch_sizes", "3"],
            "does not split evenly over 2 ranks",
        ),
        (
            ["--mode=capacity", "--distributed", "ddp", "--world_size", "2", "--find_max_batch"],
            "planned (--world_size W), not searched",
        ),
        (["--mode=capacity", "--save_snapshot"], "mode is capacity without --validate"),
        (["--mode=capacity", "--find_max_seq_len", "--device", "cpu"], "needs a CUDA device"),
        (["--mode=test", "--find_max_seq_len"], "applies only to --mode=capacity; mode is test"),
        (["--mode=capacity", "--find_max_seq_len", "--find_max_batch"], "one search a run"),
        (
            ["--mode=capacity", "--find_max_seq_len", "--max_seq_len", "32", "--seq_lens", "16"],
            "multiples of 64 tokens",
        ),
        (
            ["--mode=capacity", "--distributed", "ddp", "--world_size", "2", "--find_max_seq_len"],
            "planned (--world_size W), not searched",
        ),
        (["--mode=capacity", "--distributed", "fsdp", "--world_size", "1"], "2 or more ranks"),
        (
            ["--mode=capacity", "--distributed", "ddp", "--world_size", "2", "--validate"],
            "the ranks of a torchrun job",
        ),
        (["--mode=capacity", "--card", "GeForce 256"], "no time calibration for card 'GeForce"),
        (["--mode=capacity", "--epochs", "0"], "--epochs must be 1..1000000, got 0"),
        (["--mode=capacity", "--epochs", "1" + "0" * 400], "--epochs must be 1..1000000"),
        (["--mode=capacity", "--dataset_size", "5"], "applies only to Hugging Face models"),
        (["--mode=capacity", "--recommend"], "give its memory, --gpu_memory GiB"),
        (["--mode=test", "--card", "NVIDIA H200"], "applies only to --mode=capacity"),
    ],
)
def test_bad_capacity_input_is_one_line_and_exit_2(args, message, tmp_path, capsys):
    import profiling_script

    assert profiling_script.main([*args, "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and message in err
    assert os.listdir(tmp_path) == []


def test_planning_ranks_without_a_sharding_plans_every_sharding():
    """--world_size W > 1 without --distributed plans DDP and FSDP2 alike (each config once a
    sharding, each checked); one rank, or a sharding given, plans that one alone."""
    import profiling_script
    from dp_cost.measure import plan
    from dp_cost.parallel.mode import sharded_modes

    def planned(*argv, cuda=False):
        args = profiling_script.parse_args(["--mode=capacity", "--trainers", "flash", *argv])
        return plan.make_plan(args, lambda: cuda)

    def configs(*argv, cuda=False):
        return [(c.distributed, c.world_size) for c in planned(*argv, cuda=cuda).configs]

    both = configs("--world_size", "2", "--batch_sizes", "4", "8")
    assert both == [(s, 2) for s in sharded_modes() for _ in (4, 8)] and len(sharded_modes()) == 2
    one = sharded_modes()[0]
    assert configs("--world_size", "2", "--distributed", one) == [(one, 2)]
    assert configs() == [("none", 1)]
    # a graph captures DDP's step, not FSDP2's: the plan of every sharding leaves FSDP2 out, and
    # says so first
    graphed = planned("--world_size", "2", "--cuda_graph", cuda=True)
    assert [(c.distributed, c.cuda_graph) for c in graphed.configs] == [(one, True)]
    assert graphed.note.startswith(f"note: not planned under --distributed {sharded_modes()[1]}")


def test_validate_keeps_the_prediction_whatever_the_measurement(monkeypatch, tmp_path):
    """--validate: the measured run's outcome (here an out-of-memory) becomes the result's
    status; the prediction stays, and an error is computed only beside a measured peak."""
    config = ExperimentConfig(
        trainer="standard", model="tiny", batch_size=2, seq_len=16, capacity=True, validate=True
    )
    measured = {"status": "oom", "error": "CUDA out of memory", "peak_memory_mb": None,
                "config": {}}  # fmt: skip
    monkeypatch.setattr(worker, "classified_run", lambda c, path, rank_setup: dict(measured))
    result = worker.predict_experiment(config, str(tmp_path))
    assert result["status"] == "oom" and result["config"]["capacity"] is True
    assert result["prediction"]["peak_memory_mb"] > 0
    assert report_capacity.entry(result)["prediction_error"] is None
    measured.update(status="ok", error=None, peak_memory_mb=2.0)
    result = worker.predict_experiment(config, str(tmp_path))
    error = report_capacity.entry(result)["prediction_error"]
    assert error == pytest.approx(result["prediction"]["peak_memory_mb"] / 2.0 - 1)


def test_a_capacity_run_whose_configs_were_all_skipped_still_reports(tmp_path):
    run = in_process(
        "--mode=capacity", "--model", "tiny", *SMALL_MODEL, "--seq_lens", "16", "--batch_sizes",
        "2", "--trainers", "ghost", "--clipping", "per_layer", "--output_dir", str(tmp_path),
        "--run_name", "plan",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    with open(os.path.join(tmp_path, "plan", "capacity.json")) as f:
        written = json.load(f)
    assert written["configs"] == [] and written["not_predicted"][0]["status"] == "skipped"
    assert "Summary:" not in run.stdout and "Not predicted" in run.stdout
