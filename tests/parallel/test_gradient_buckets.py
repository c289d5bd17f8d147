"""flash's collectives before any process group: which tensors share a collective, and how many
wait at once (GradientBuckets with a recording _send/_land, no torch.distributed)."""

import pytest
import torch
from torch import nn

from dp_cost.flash import sinks as buckets

BUCKET = 1000  # bytes: a gradient of 250 bytes or more is sent alone


class RecordingBuckets(buckets.GradientBuckets):
    """Sends nothing: records each collective, and after each launch the bytes the ones behind
    the newest still hold."""

    def __init__(self, in_flight_bytes):
        super().__init__()
        self.IN_FLIGHT_BYTES = in_flight_bytes
        self.sent, self.landed, self.held_behind, self.pending_after = [], [], [], []
        self.params: list[nn.Parameter] = []  # alive, so their ids name them

    def add(self, grad: torch.Tensor) -> None:
        self.params.append(nn.Parameter(torch.zeros_like(grad)))
        self._add(self.params[-1], grad)

    def label(self, bucket) -> list[str]:
        index = {id(param): i for i, param in enumerate(self.params)}
        return [f"p{index[id(param)]}" for param, _ in bucket]

    def _send(self, bucket):
        self.sent.append(self.label(bucket))
        return None, torch.cat([grad.flatten() for _, grad in bucket]), None

    def _launch(self, bucket, bounded=True):
        super()._launch(bucket, bounded)
        behind = list(self.pending)[:-1]
        self.held_behind.append(sum(sent.nbytes for _, _, sent, _ in behind))
        self.pending_after.append(len(self.pending))

    def _land(self, bucket, work, sent, received):
        self.landed.append(self.label(bucket))


def hand_over(sink, sizes, dtype=torch.float32):
    for numel in sizes:
        sink.add(torch.ones(numel, dtype=dtype))
    sink._drain()


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    monkeypatch.setattr(buckets, "BUCKET_BYTES", BUCKET)


# fp32: 100 elements = 400 bytes, sent alone; 20 elements = 80 bytes, bucketed
SIZES = [100, 20, 20, 100, 20, 100, 100, 20]


@pytest.mark.parametrize("limit", [None, 0, 400, 900])
def test_every_collective_lands_once_in_order_and_the_window_holds(limit):
    sink = RecordingBuckets(limit)
    hand_over(sink, SIZES)
    # large ones alone as they arrive; the small ones fill one bucket, sent at the end
    assert sink.sent == [["p0"], ["p3"], ["p5"], ["p6"], ["p1", "p2", "p4", "p7"]]
    assert sink.landed == sink.sent and not sink.pending and sink.pending_bytes == 0
    if limit is None:  # nothing waited for before the end
        assert sink.held_behind == [0, 400, 800, 1200, 1600]
    elif limit == 0:  # each waited for at once, the newest too
        assert sink.pending_after == [0] * 5
    else:
        assert max(sink.held_behind) <= limit
        assert max(sink.held_behind) > limit - 400  # waits only as much as it must


def test_buckets_hold_one_dtype():
    sink = RecordingBuckets(None)
    for dtype in [torch.float32, torch.float32, torch.bfloat16, torch.float32]:
        sink.add(torch.ones(10, dtype=dtype))
    sink._drain()
    assert sink.sent == [["p0", "p1"], ["p2"], ["p3"]]


def test_ddps_all_reduces_take_larger_buckets_than_the_other_collectives(monkeypatch):
    """DDP's sink (SummedGradients) fills buckets of ALL_REDUCE_BUCKET_BYTES, the others of
    BUCKET_BYTES: a gradient sent alone by FSDP2's sink shares a collective under DDP."""
    monkeypatch.setattr(buckets, "ALL_REDUCE_BUCKET_BYTES", 4 * BUCKET)

    class RecordingSums(buckets.SummedGradients):
        def __init__(self):
            super().__init__()
            self.sent = []

        def _send(self, bucket):
            self.sent.append([tuple(grad.shape) for _, grad in bucket])
            return None, torch.cat([grad.flatten() for _, grad in bucket]), None

        def _land(self, bucket, work, sent, received):
            pass

    others, sums = RecordingBuckets(None), RecordingSums()
    hand_over(others, [100, 100, 400])  # fp32: 400, 400 and 1600 bytes
    params = [nn.Parameter(torch.zeros(n)) for n in (100, 100, 400)]
    for param in params:
        sums(param, torch.ones_like(param))
    sums.finish(params)
    assert others.sent == [["p0"], ["p1"], ["p2"]]  # each at least a quarter of BUCKET
    assert sums.sent == [[(400,)], [(100,), (100,)]]  # 1600 bytes alone; the two 400s together
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)  # landed in place
