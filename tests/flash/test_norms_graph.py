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
    launches compute, writing into the outputs its capture returned (as a replay writes into
    its static tensors)."""

    def __init__(self, owner, fail: bool):
        self.owner, self.fail = owner, fail

    def capture_begin(self, capture_error_mode):
        assert capture_error_mode == "thread_local"  # other threads' CUDA calls stay legal

    def capture_end(self):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

    def replay(self):
        (mine,) = [c for c in self.owner.captured.values() if c.graph is self]
        mine.outputs.copy_(self.owner.launches())


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


def test_a_key_seen_again_is_captured_then_replayed_on_new_contents():
    caller = Caller()
    graph = CpuNormsGraph(launches=lambda: caller.inputs * 2)
    assert torch.equal(caller.run(graph, "k"), torch.tensor([2.0, 4.0]))  # first: eager
    assert graph.counts() == {"captures": 0, "replays": 0, "eager": 1, "error": None}
    caller.inputs = torch.tensor([3.0, 4.0])
    got = caller.run(graph, "k")  # again: computed, then captured
    assert torch.equal(got, torch.tensor([6.0, 8.0]))
    assert torch.equal(caller.cache, torch.tensor([30.0, 40.0]))  # this chunk's, not the capture's
    assert graph.counts()["captures"] == 1 and caller.computed == 3  # eager, eager, captured
    (captured,) = graph.captured.values()
    assert got is not captured.outputs  # the capture's outputs are the graph's own
    caller.inputs = torch.tensor([5.0, 6.0])  # new contents where the key says they sat
    caller.cache = None
    got = caller.run(graph, "k")
    assert got is captured.outputs and torch.equal(got, torch.tensor([10.0, 12.0]))
    assert caller.computed == 3  # replayed: nothing computed by the host
    assert caller.cache is captured.state  # the cache as the captured compute left it
    assert graph.counts() == {"captures": 1, "replays": 1, "eager": 2, "error": None}


def test_each_key_seen_twice_gets_a_graph_and_the_least_recent_goes():
    caller = Caller()
    graph = CpuNormsGraph(launches=lambda: caller.inputs * 2)
    for key in "abab":  # alternating keys: each captured on its second sighting
        caller.run(graph, key)
    assert list(graph.captured) == ["a", "b"] and graph.counts()["eager"] == 4
    caller.run(graph, "a")
    caller.run(graph, "b")
    assert graph.counts()["replays"] == 2
    for key in "cdcd":
        caller.run(graph, key)
    assert len(graph.captured) == norms_graph.KEPT_GRAPHS == 3
    assert list(graph.captured) == ["b", "c", "d"]  # "a" was the least recently replayed
    caller.run(graph, "a")  # evicted: eager, a first sighting again
    assert graph.counts()["replays"] == 2 and "a" not in graph.captured
    caller.run(graph, "a")
    assert list(graph.captured) == ["c", "d", "a"]


def test_a_failed_capture_is_not_tried_again_and_the_chunk_is_still_computed():
    caller = Caller()
    graph = CpuNormsGraph(launches=lambda: caller.inputs * 2, fail=True)
    caller.run(graph, "k")
    got = caller.run(graph, "k")
    assert torch.equal(got, torch.tensor([2.0, 4.0]))
    assert torch.equal(caller.cache, caller.inputs * 10)  # the eager chunk's
    assert not graph.captured
    assert graph.error == "operation not permitted when stream is capturing"
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


def _backward(engine, model, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(SMALL.vocab_size, (3, 7), generator=g).to(device)
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


def test_the_norms_state_keeps_what_the_norms_made_not_the_gradients_they_read(monkeypatch):
    """A replay's state outlives its chunk: it must hold the norms' own outputs, never a
    chunk's per-sample gradients (at the 1b model's (8, 1024), 5 GB of them)."""
    from dp_cost.flash import engine as flash_engine

    monkeypatch.setattr(flash_engine, "SMALL_PER_SAMPLE_NUMEL", 64)  # the wide ones are large
    torch.manual_seed(0)
    model = models.build_model(SMALL)
    engine = FlashClipping(model, route="product")
    _backward(engine, model)
    norms = engine.per_sample_squared_norms()
    small, large = engine._per_sample_batches()
    assert small and large
    state = engine._norms_state()
    held = {id(g) for layer in engine.layers for g in layer.per_sample.values()}
    assert len(state) == 2 and state[1] is norms and state[0] is small
    assert all(id(t) not in held for _, t in state[0])  # concatenations, made by the norms
    engine._small = engine._norms = None
    engine._set_norms_state(state)  # as after a replay: the large ones of this chunk again
    assert engine._norms is norms and engine._small[0] is small
    assert [(id(p), id(g)) for p, g in engine._small[1]] == [(id(p), id(g)) for p, g in large]
    engine.remove()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replay_on_cuda_gives_the_eager_clip_factors_bit_for_bit(dtype):
    """One chunk's held A, G and per-sample gradients, asked three times (as three chunks whose
    inputs sit at the same addresses): eager, eager and captured, replayed. The inputs are
    changed in place before the replay: it reads the new contents."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    model = models.build_model(SMALL, device=torch.device("cuda"))
    engine = FlashClipping(model)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        _backward(engine, model.cuda(), device="cuda")

    def of_norms(norms):
        return (0.05 / (norms + 1e-6)).clamp(max=1.0) / 3

    def ask():
        engine._small = engine._norms = None  # a new chunk: nothing made yet
        return engine.clip_factors(of_norms, (0.05, 3), replay=True)

    first, second = ask().clone(), ask().clone()
    assert torch.equal(first, second)
    assert engine.norms_graph.counts() == {"captures": 1, "replays": 0, "eager": 2, "error": None}
    for layer in engine.layers:  # new contents, same addresses
        for call in layer.calls:
            call.G.mul_(3.0)
    engine._small = engine._norms = None
    eager = engine.clip_factors(of_norms, (0.05, 3), replay=False).clone()
    replayed = ask()
    assert engine.norms_graph.counts()["replays"] == 1
    assert torch.equal(replayed, eager) and not torch.equal(replayed, first)
    engine.remove()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_with_the_norms_replayed_equal_steps_without_bit_for_bit(dtype, monkeypatch):
    """Ten steps on CUDA on one batch, with and without the norms' replays (noise 0): the same
    parameters after each step, whether or not the inputs' addresses repeated (counted)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    torch.manual_seed(0)
    start = models.build_model(SMALL, device=device)
    tokens = torch.randint(SMALL.vocab_size, (4, 9), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    runs = {}
    for replay in (False, True):
        monkeypatch.setattr(norms_graph, "REPLAY_NORMS", replay)
        model = copy.deepcopy(start)
        trainer = trainers.make_trainer("flash", model, lr=0.5, noise_multiplier=0.0,
                                        max_grad_norm=0.1, batch_size=4, dtype=dtype)  # fmt: skip
        params = []
        for _ in range(10):
            trainer.step(tokens[:, :-1], tokens[:, 1:])
            params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        runs[replay] = params, trainer.engine.norms_graph.counts()
        trainer.engine.remove()
    for eager, replayed in zip(runs[False][0], runs[True][0], strict=True):
        assert torch.equal(eager, replayed)
    assert runs[False][1] == {"captures": 0, "replays": 0, "eager": 0, "error": None}
    counts = runs[True][1]
    assert counts["error"] is None and counts["replays"] + counts["eager"] == 10, counts
