"""flash's FSDP2 sink on a one-rank gloo group in this process: a landed shard's gradient (set,
then added to), and that landing and reading the local shards make no autograd Function call
(DTensor.to_local in grad mode is one: a score of Python calls a parameter, a step's hundreds)."""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import _api as dtensor_api

from dp_cost.flash import sinks


def test_landed_shards_are_the_sums_with_no_autograd_function(one_rank, monkeypatch):
    model = fully_shard(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    params = list(model.parameters())
    calls = []
    apply = dtensor_api._ToTorchTensor.apply
    monkeypatch.setattr(
        dtensor_api._ToTorchTensor, "apply", lambda *a: calls.append(a) or apply(*a)
    )
    sums = [[torch.randn(p.shape) for p in params] for _ in range(2)]
    for chunk in sums:  # the first lands into no .grad, the second adds to it
        sink = sinks.ShardedGradients()
        for param, full in zip(reversed(params), reversed(chunk)):
            sink(param, full)
        sink.finish(params)
    local = sinks.local_gradients(params)
    assert not calls  # before full_tensor below, which makes them
    assert all(t is p.grad._local_tensor for t, p in zip(local, params))
    for param, first, second in zip(params, *sums):
        assert torch.allclose(param.grad.full_tensor(), first + second)


def test_a_gradient_sent_alone_takes_no_op_it_does_not_need(one_rank, monkeypatch):
    """Each parameter's sum sent alone (a bucket of one), already fp32 and of its shape: sent
    as the tensor itself flattened and landed with no split, slice or dtype promotion, counted
    by torch's profiler as --host_work counts operator dispatches (a no-op cast or view is
    still a dispatch, and the sink runs once per parameter: hundreds a step). The landed
    gradients are the sums."""
    monkeypatch.setattr(sinks, "BUCKET_BYTES", 16)  # every gradient alone
    model = fully_shard(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    params = list(model.parameters())
    sums = [torch.randn(p.shape) for p in params]
    sink = sinks.ShardedGradients()
    sinks.wider(torch.float32, torch.float32)  # cached: only its first call asks torch
    with torch.profiler.profile() as prof:
        for param, full in zip(reversed(params), reversed(sums)):
            sink(param, full)
        sink.finish(params)
    ops = {event.key: event.count for event in prof.key_averages()}
    # (aten::slice not among them: gloo's reduce-scatter slices its input itself; NCCL's not)
    unneeded = ("aten::split_with_sizes", "aten::promote_types", "aten::to", "aten::reshape",
                "aten::cat", "aten::contiguous")  # fmt: skip
    assert not {op: ops[op] for op in unneeded if op in ops}
    for param, full in zip(params, sums):
        assert torch.equal(param.grad.full_tensor(), full)


def test_a_steps_last_collectives_land_in_groups_of_about_equal_bytes(one_rank, monkeypatch):
    """A sink that does not land at finish: landed_groups yields each parameter once, in the
    order its bucket was sent (every bucket of one gradient here), in as many groups as asked
    where the bytes allow, the bytes split about evenly."""
    monkeypatch.setattr(sinks, "ALL_REDUCE_BUCKET_BYTES", 16)  # every gradient alone
    # bytes of the weights: 256 four times, then 128 four times (512 a group of three)
    widths = [8, 8, 8, 8, 4, 4, 4, 4]
    params = [nn.Parameter(torch.zeros(width, 8)) for width in widths]
    sums = [torch.randn(p.shape) for p in params]
    sink = sinks.SummedGradients(lands_at_finish=False)
    for param, full in zip(params, sums):
        sink(param, full)
    sink.finish(params)
    assert len(sink.pending) == len(params)  # sent, none landed
    groups = list(sink.landed_groups(3))
    position = {id(p): i for i, p in enumerate(params)}
    assert [[position[id(p)] for p in group] for group in groups] == [[0, 1], [2, 3], [4, 5, 6, 7]]
    assert not sink.pending
    for param, full in zip(params, sums):
        assert torch.equal(param.grad, full)
    # one group asked: every gradient in it; more groups than buckets: one a bucket
    for count, sizes in ((1, [8]), (20, [1] * 8)):
        sink = sinks.SummedGradients(lands_at_finish=False)
        for param, full in zip(params, sums):
            param.grad = None
            sink(param, full)
        sink.finish(params)
        assert [len(group) for group in sink.landed_groups(count)] == sizes


def test_a_sharded_steps_last_collectives_land_in_groups_into_the_shards(one_rank, monkeypatch):
    """FSDP2's sink, every sum sent alone: none landed before landed_groups (each parameter
    pending, no gradient yet), then two groups of two, each shard its sum."""
    monkeypatch.setattr(sinks, "BUCKET_BYTES", 16)
    model = fully_shard(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
    params = list(model.parameters())
    sums = [torch.randn(p.shape) for p in params]
    sink = sinks.ShardedGradients(lands_at_finish=False)
    for param, full in zip(reversed(params), reversed(sums)):
        sink(param, full)
    sink.finish(params)
    assert sink.pending_parameters() == {id(p) for p in params}
    assert all(p.grad is None for p in params)
    groups = list(sink.landed_groups(2))
    assert [len(group) for group in groups] == [2, 2]
    landed = [p for group in groups for p in group]
    assert sorted(map(id, landed)) == sorted(map(id, params))
    for param, full in zip(params, sums):
        assert torch.equal(param.grad.full_tensor(), full)


def test_a_captured_step_lands_its_last_collectives_at_finish(one_rank, monkeypatch):
    """flash under DDP leaves its last chunk's collectives to optimizer_step (``landing``), but
    not while a CUDA graph is captured: there the last chunk and the finish are graphs of their
    own, and a collective started in one cannot be waited for in another."""
    from test_trainers import SMALL

    import models
    import trainers
    from dp_cost.flash import cuda_graphs

    runner = trainers.make_trainer(
        "flash", models.build_model(SMALL), lr=0.1, batch_size=4, distributed="ddp"
    )
    flash = runner.trainer
    sink = flash.landing_sink()
    assert not sink.lands_at_finish and flash.landing is sink
    monkeypatch.setattr(cuda_graphs, "capturing", lambda: True)
    sink = flash.landing_sink()
    assert sink.lands_at_finish and flash.landing is None


def whole_parameters(params) -> list[torch.Tensor]:
    """Each parameter whole (an FSDP2 shard gathered), for comparing a run's with another's."""
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in params]


@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_step_landing_in_groups_updates_every_parameter_once(
    one_rank, monkeypatch, distributed, optimizer
):
    """flash on one rank, every gradient its own collective and (FSDP2) the older ones waited
    for within the chunk, so a step's noise and optimizer step run over what landed first and
    then several groups: two steps' parameters equal one process's (whose optimizer steps every
    parameter at once), and every parameter's Adam step count is 2."""
    from test_trainers import SMALL, make_batch

    import models
    import trainers
    from dp_cost.training import flash_trainer

    monkeypatch.setattr(sinks, "BUCKET_BYTES", 16)
    monkeypatch.setattr(sinks, "ALL_REDUCE_BUCKET_BYTES", 16)
    monkeypatch.setattr(sinks.ShardedGradients, "IN_FLIGHT_BYTES", 4096)  # of about 22 KB
    stepped, updates = {}, []
    noise_and_step = flash_trainer.FlashClippingTrainer.noise_and_step

    def counted(trainer, params):
        updates.append(len(params))
        return noise_and_step(trainer, params)

    monkeypatch.setattr(flash_trainer.FlashClippingTrainer, "noise_and_step", counted)
    inputs, targets = make_batch(4, 16, seed=3)
    for mode in ("none", distributed):
        updates.clear()
        torch.manual_seed(0)
        model = models.build_model(SMALL)
        runner = trainers.make_trainer(
            "flash", model, lr=0.05, batch_size=4, optimizer=optimizer, noise_multiplier=0.0,
            distributed=mode, max_physical_batch_size=2,
        )  # fmt: skip
        for _ in range(2):
            runner.step(inputs, targets)
        flash = runner.trainer
        stepped[mode] = whole_parameters(flash.engine.params)
        if optimizer == "adam":
            counts = {int(flash.optimizer.state[p]["step"]) for p in flash.engine.params}
            assert counts == {2}, mode
        every = len(flash.engine.params)
        # one process: one update a step; ranks: several a step, none of every parameter
        assert updates == [every] * 2 if mode == "none" else len(updates) > 2 * 2, updates
        assert mode == "none" or max(updates) < every, updates
    for alone, ranked in zip(stepped["none"], stepped[distributed], strict=True):
        torch.testing.assert_close(ranked, alone, rtol=1e-5, atol=1e-7)


def test_a_sink_left_pending_sends_its_last_bucket_without_waiting(one_rank, monkeypatch):
    """A sink whose caller lands its collectives later (the step's last, or a chunk's whose
    last reduce-scatters run beside the next forward): its finish sends the open bucket of small
    gradients without waiting for the large one before it, which the in-flight bound would
    otherwise make the compute stream wait for there."""
    monkeypatch.setattr(sinks, "BUCKET_BYTES", 64)  # the 3 x 4 weight (48 B) alone, the rest share
    monkeypatch.setattr(sinks.ShardedGradients, "IN_FLIGHT_BYTES", 16)
    model = fully_shard(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1)))
    params = list(model.parameters())  # weight 3 x 4, bias 3, weight 1 x 3, bias 1
    sums = [torch.randn(p.shape) for p in params]
    for lands in (True, False):
        sink = sinks.ShardedGradients(lands_at_finish=lands)
        for param, full in zip(params, sums):
            sink(param, full)
        sink.finish(params)
        # the large weight and the bucket of the other three still pending where not landed
        assert [len(bucket) for bucket, *_ in sink.pending] == ([] if lands else [1, 3])
        sink.land_pending()
    for param, full in zip(params, sums):
        torch.testing.assert_close(param.grad.full_tensor(), 2 * full)


def test_a_chunks_last_reduce_scatters_land_a_quarter_into_the_next_chunks_forward(
    one_rank, monkeypatch
):
    """FSDP2 reducing every chunk, three chunks a step: what each chunk's sink leaves pending at
    its finish lands inside the next chunk's forward, as the managed layer a quarter of the way
    in starts (not at the chunk's end, where it would run alone, nor at the forward's end,
    where the step's peak is), and the step updates the parameters as one process does."""
    from test_trainers import SMALL, make_batch

    import models
    import trainers

    monkeypatch.setattr(sinks, "BUCKET_BYTES", 16)  # every gradient its own reduce-scatter
    monkeypatch.setattr(sinks.ShardedGradients, "IN_FLIGHT_BYTES", 4096)
    events = []
    land_pending = sinks.ShardedGradients.land_pending

    def logged(sink):
        events.append(("land", len(sink.pending)))
        land_pending(sink)

    monkeypatch.setattr(sinks.ShardedGradients, "land_pending", logged)
    inputs, targets = make_batch(6, 16, seed=5)
    stepped = {}
    for mode in ("none", "fsdp"):
        torch.manual_seed(0)
        runner = trainers.make_trainer(
            "flash", models.build_model(SMALL), lr=0.05, batch_size=6, noise_multiplier=0.0,
            distributed=mode, max_physical_batch_size=2,
        )  # fmt: skip
        layers = runner.trainer.engine.layers
        for index, layer in enumerate(layers):
            layer.module.register_forward_pre_hook(
                lambda module, args, index=index: events.append(("layer", index))
            )
        events.clear()
        runner.step(inputs, targets)
        stepped[mode] = whole_parameters(runner.trainer.engine.params)
    # the three forwards' layers in order; a landing of what the chunk before left pending
    # right after the quarter layer's start in the second and third
    quarter = len(layers) // 4
    landed = [i for i, event in enumerate(events) if event[0] == "land" and event[1]]
    assert len(landed) == 2, events
    for position in landed:
        assert events[position - 1] == ("layer", quarter), events
    forwards = [e for e in events if e[0] == "layer"]
    assert forwards == [("layer", i) for i in range(len(layers))] * 3
    for alone, ranked in zip(stepped["none"], stepped["fsdp"], strict=True):
        torch.testing.assert_close(ranked, alone, rtol=1e-5, atol=1e-7)
