"""The norms phase replayed as a CUDA graph (flash.norms_graph): when it captures, replays and
runs eagerly, on the CPU with a stand-in graph; on CUDA, steps with replays equal steps without,
bit for bit."""

import contextlib
import copy

import pytest
import torch

import models
import trainers
from dp_cost.flash import FlashClipping, norms_graph


class StandInGraph:
    """What the tests need of a CUDA graph: replay runs the function the test says the captured
    launches compute, writing into the outputs the capture returned (as a replay writes into its
    static tensors)."""

    def __init__(self, owner, fail: bool):
        self.owner, self.fail = owner, fail

    def capture_begin(self, capture_error_mode):
        assert capture_error_mode == "thread_local"  # other threads' CUDA calls stay legal

    def capture_end(self):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

    def replay(self):
        self.owner.outputs.copy_(self.owner.launches())


class CpuNormsGraph(norms_graph.NormsGraph):
    def __init__(self, launches, fail=False, capturing=False):
        super().__init__()
        self.launches, self.fail, self.capturing = launches, fail, capturing

    def _capturing(self):
        return self.capturing

    def _side_stream(self):
        return contextlib.nullcontext()

    def _new_graph(self):
        return StandInGraph(self, self.fail)


class Caller:
    """A caller with a cache its compute fills (as FlashClipping's _norms and _small)."""

    def __init__(self):
        self.inputs = torch.tensor([1.0, 2.0])
        self.cache = None
        self.computed = 0

    def compute(self):
        self.computed += 1
        self.cache = self.inputs * 10
        return self.inputs * 2

    def run(self, graph, key):
        return graph.run(key, self.compute, lambda: self.cache, self.set_cache)

    def set_cache(self, cache):
        self.cache = cache


def test_a_key_seen_twice_in_a_row_is_captured_then_replayed_on_new_contents():
    caller = Caller()
    graph = CpuNormsGraph(launches=lambda: caller.inputs * 2)
    assert torch.equal(caller.run(graph, "k"), torch.tensor([2.0, 4.0]))  # first: eager
    assert graph.counts() == {"captures": 0, "replays": 0, "eager": 1, "error": None}
    caller.inputs = torch.tensor([3.0, 4.0])
    got = caller.run(graph, "k")  # again: computed on a side stream, then captured
    assert torch.equal(got, torch.tensor([6.0, 8.0]))
    assert torch.equal(caller.cache, torch.tensor([30.0, 40.0]))  # this chunk's, not the capture's
    assert graph.counts()["captures"] == 1 and caller.computed == 3  # eager, eager, captured
    assert got is not graph.outputs  # the capture's outputs are the graph's own
    caller.inputs = torch.tensor([5.0, 6.0])  # new contents where the key says they sat
    caller.cache = None
    got = caller.run(graph, "k")
    assert got is graph.outputs and torch.equal(got, torch.tensor([10.0, 12.0]))
    assert caller.computed == 3  # replayed: nothing computed by the host
    assert caller.cache is graph.state  # the cache as the captured compute left it
    assert graph.counts() == {"captures": 1, "replays": 1, "eager": 2, "error": None}


def test_another_key_runs_eagerly_and_the_graph_stays_for_its_own():
    caller = Caller()
    graph = CpuNormsGraph(launches=lambda: caller.inputs * 2)
    for _ in range(2):
        caller.run(graph, "a")
    assert torch.equal(caller.run(graph, "b"), torch.tensor([2.0, 4.0]))
    assert graph.key == "a" and graph.counts()["eager"] == 3
    caller.run(graph, "a")
    assert graph.counts()["replays"] == 1
    caller.run(graph, "b")  # "b", "a", "b": never twice in a row, never captured
    assert graph.key == "a" and graph.counts()["captures"] == 1
    caller.run(graph, "b")  # twice in a row now: captured, replacing "a"'s graph
    assert graph.key == "b" and graph.counts()["captures"] == 2


def test_a_failed_capture_is_not_tried_again_and_the_chunk_is_still_computed():
    caller = Caller()
    graph = CpuNormsGraph(launches=lambda: caller.inputs * 2, fail=True)
    caller.run(graph, "k")
    got = caller.run(graph, "k")
    assert torch.equal(got, torch.tensor([2.0, 4.0])) and torch.equal(
        caller.cache, caller.inputs * 10
    )
    assert graph.graph is None and graph.error == "operation not permitted when stream is capturing"
    caller.run(graph, "k")
    assert graph.counts() == {"captures": 0, "replays": 0, "eager": 3, "error": graph.error}


def test_inside_another_capture_it_only_computes():
    caller = Caller()
    graph = CpuNormsGraph(launches=lambda: caller.inputs * 2, capturing=True)
    for _ in range(3):
        assert torch.equal(caller.run(graph, "k"), torch.tensor([2.0, 4.0]))
    assert graph.counts() == {"captures": 0, "replays": 0, "eager": 0, "error": None}
    assert caller.computed == 3


SMALL = models.ModelConfig(
    vocab_size=50, hidden_dim=16, num_layers=2, num_heads=2, mlp_dim=24, max_seq_len=16
)


def _backward(engine, model, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(SMALL.vocab_size, (3, 7), generator=g)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    engine.backward(loss * 3)


def test_the_key_names_every_tensor_the_norms_read_where_it_sits():
    torch.manual_seed(0)
    model = models.build_model(SMALL)
    engine = FlashClipping(model)
    _backward(engine, model)
    key = engine.norms_inputs()
    assert key == engine.norms_inputs()  # nothing moved
    held = [(layer, i) for layer in engine.layers for i in range(len(layer.calls))]
    assert held and len(key) == 1 + len(engine.layers) + 2 * len(held) + 2 * sum(
        len(layer.per_sample) for layer in engine.layers
    )
    layer, i = held[0]
    moved = layer.calls[i].A.clone()  # same contents, another address
    layer.calls[i].A = moved
    assert engine.norms_inputs() != key
    layer.calls[i].A = moved[:, :-1]  # another shape
    assert engine.norms_inputs() != key
    engine.remove()


def test_clip_factors_on_the_cpu_is_the_function_of_the_norms():
    torch.manual_seed(0)
    model = models.build_model(SMALL)
    engine = FlashClipping(model)
    _backward(engine, model)
    norms = engine.per_sample_squared_norms().sqrt()
    engine._norms = None  # computed again below
    got = engine.clip_factors(lambda n: (0.5 / (n + 1e-6)).clamp(max=1.0), (0.5,), replay=True)
    assert torch.equal(got, (0.5 / (norms + 1e-6)).clamp(max=1.0))
    assert engine.norms_graph.counts() == {"captures": 0, "replays": 0, "eager": 0, "error": None}
    engine.remove()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_norms_give_the_eager_steps_bit_for_bit(dtype, monkeypatch):
    """Six steps on CUDA, the batch changing every other step, with and without the norms'
    replays (noise 0): the same parameters after each step, and replays did happen."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    torch.manual_seed(0)
    start = models.build_model(SMALL, device=device)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(SMALL.vocab_size, (4, 8), generator=g).to(device) for _ in range(3)]
    runs = {}
    for replay in (False, True):
        monkeypatch.setattr(norms_graph, "REPLAY_NORMS", replay)
        model = copy.deepcopy(start)
        trainer = trainers.make_trainer("flash", model, lr=0.5, noise_multiplier=0.0,
                                        max_grad_norm=0.1, batch_size=4, dtype=dtype)  # fmt: skip
        params = []
        for step in range(6):
            tokens = batches[step // 2]
            trainer.step(tokens[:, :-1], tokens[:, 1:])
            params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        runs[replay] = params, trainer.engine.norms_graph.counts()
        trainer.engine.remove()
    for eager, replayed in zip(runs[False][0], runs[True][0], strict=True):
        assert torch.equal(eager, replayed)
    assert runs[False][1] == {"captures": 0, "replays": 0, "eager": 0, "error": None}
    counts = runs[True][1]
    assert counts["error"] is None and counts["captures"] >= 1 and counts["replays"] >= 1
    assert counts["captures"] + counts["replays"] + counts["eager"] >= 6
