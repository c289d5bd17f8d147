"""flash under FSDP2 reducing every chunk, gathering the next chunk's first units after a
chunk's backward (dp_cost.parallel.fsdp.FORWARD_PREFETCH_UNITS), on a one-rank gloo group in
this process: where the gathers start, that the next forward waits for them instead of starting
its own, that the step's last chunk gathers nothing ahead (the optimizer step changes the shards
after it), that with fsdp_sync "logical" no chunk does, and the update as one process's.
Exactness on 3 ranks: tests/parallel/test_distributed_updates.py."""

from dataclasses import replace

import pytest
import torch
from test_sharded_landing import whole_parameters
from test_trainers import SMALL, make_batch
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

import models
import trainers
from dp_cost.flash import engine as flash_engine
from dp_cost.parallel import fsdp


def gathers_and_passes(monkeypatch, units: list, events: list) -> None:
    """Log into ``events``: ("gather", unit index, async) where a unit's gather starts (not a
    call that finds one pending or the unit whole), ("forward", unit index) as a unit's forward
    starts, and "backward" as flash's backward of a chunk returns."""
    index = {id(unit._get_fsdp_state()._fsdp_param_group): i for i, unit in enumerate(units)}
    unshard = FSDPParamGroup.unshard

    def logged_unshard(group, async_op=False):
        if group._all_gather_result is None and not group.is_unsharded:
            events.append(("gather", index[id(group)], async_op))
        return unshard(group, async_op)

    monkeypatch.setattr(FSDPParamGroup, "unshard", logged_unshard)
    for i, unit in enumerate(units):
        unit.register_forward_pre_hook(  # before FSDP2's own: its gather is logged after
            lambda module, args, i=i: events.append(("forward", i)), prepend=True
        )
    backward = flash_engine.FlashClipping.backward

    def logged_backward(engine, *args, **kwargs):
        backward(engine, *args, **kwargs)
        events.append("backward")

    monkeypatch.setattr(flash_engine.FlashClipping, "backward", logged_backward)


@pytest.mark.parametrize(
    ("sync", "checkpointed"), [("chunk", False), ("logical", False), ("chunk", True)]
)
def test_a_chunk_gathers_the_next_forwards_first_units_after_its_backward(
    one_rank, monkeypatch, sync, checkpointed
):
    """Checkpointed, flat clipping runs two backwards a chunk: the gathers come after the
    second (after the first, its recomputation would take them)."""
    monkeypatch.setattr(fsdp, "FORWARD_PREFETCH_UNITS", 2)  # the root and the first block
    config = replace(SMALL, activation_checkpointing=checkpointed)
    inputs, targets = make_batch(6, 16, seed=5)
    stepped, events = {}, []
    for mode in ("none", "fsdp"):
        torch.manual_seed(0)
        runner = trainers.make_trainer(
            "flash", models.build_model(config), lr=0.05, batch_size=6, noise_multiplier=0.0,
            distributed=mode, max_physical_batch_size=2, fsdp_sync=sync if mode == "fsdp" else None,
        )  # fmt: skip
        if mode == "fsdp":
            units = fsdp.forward_units(runner.trainer.model)
            assert len(units) == 1 + SMALL.num_layers  # the root, then each block
            gathers_and_passes(monkeypatch, units, events)
        for _ in range(2):  # three chunks a step
            runner.step(inputs, targets)
        stepped[mode] = whole_parameters(runner.trainer.engine.params)
    # what each chunk does between its backward's end and the next forward's first unit
    between, gathered_ahead = [], None
    for event in events:
        if event == "backward":
            gathered_ahead = []
        elif event[0] == "forward" and event[1] == 0 and gathered_ahead is not None:
            between.append(gathered_ahead)
            gathered_ahead = None
        elif event[0] == "gather" and gathered_ahead is not None:
            gathered_ahead.append(event[1:])
    # reducing every chunk, step 1's chunks 1 and 2: the root and the first block,
    # asynchronously; chunk 3 (the step's last): none, step 2's first forward gathers its own
    ahead = [(0, True), (1, True)] if sync == "chunk" else []
    assert between == [ahead, ahead, [], ahead, ahead], events
    for alone, ranked in zip(stepped["none"], stepped["fsdp"], strict=True):
        torch.testing.assert_close(ranked, alone, rtol=1e-5, atol=1e-7)
    if checkpointed:  # (its recomputations run the blocks' forwards again)
        return
    # each unit's forward: whether its own pre-forward starts a gather (FSDP2's, not async):
    # not for the units gathered ahead, the later block's always
    own = [
        (event[1], events[i + 1] == ("gather", event[1], False))
        for i, event in enumerate(events)
        if event[0] == "forward"
    ]
    first, ahead_of_it = [(0, True), (1, True), (2, True)], [(0, False), (1, False), (2, True)]
    later = ahead_of_it if sync == "chunk" else first
    assert own == (first + later * 2) * 2, events
