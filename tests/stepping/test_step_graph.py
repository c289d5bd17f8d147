"""The step replayed as CUDA graphs of a padded chunk (--cuda_graph): exact against the
brute-force reference of tests/test_trainers.py and against the eager step for every Poisson
draw's size, fresh noise at every replay; and the refusals and CPU errors, which CI checks."""

import contextlib
import glob
import json
import math
import os

import pytest
import torch
from cli_helpers import SMALL_MODEL, TORCHRUN_ENV, cli, small_run_args
from test_trainers import (
    SMALL,
    flat_params,
    make_batch,
    per_sample_grads,
    reference_update,
    relative_error,
)

import models
import profiling_script
import trainers
from dp_cost.core.settings import UsageError
from dp_cost.measure import plan
from dp_cost.measure.config import ExperimentConfig
from dp_cost.measure.processes import skip_reason
from dp_cost.stepping import graph

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


def graphed_trainer(name, model, batch, **options):
    return trainers.make_trainer(name, model, batch_size=batch, cuda_graph=True, **options)


def plain_copy(model, device=CUDA):
    """The model's current weights in a fresh model, without flash's hooks and with every
    parameter trainable (flash's engine turns off requires_grad on the weights it manages), for
    the brute-force reference."""
    fresh = models.build_model(SMALL, device=device, attention=model.config.attention)
    fresh.load_state_dict(model.state_dict())
    return fresh


def update_of(trainer, model, inputs, targets, lr):
    """Take one step; the update it applied, -lr * p.grad (p.grad is the graph's own tensor
    after a replay, written by it)."""
    before = flat_params(model)
    trainer.step(inputs, targets)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
    grads = torch.cat([grad.reshape(-1) for grad in grads]).double()  # None: an empty batch's
    assert torch.allclose(flat_params(model) - before, -lr * grads, atol=1e-6)
    return -lr * grads


@pytest.mark.parametrize("physical", [None, 2])
@pytest.mark.parametrize("name", ["standard", "flash"])
@pytest.mark.gpu
@needs_cuda
def test_replayed_steps_match_brute_force(name, physical):
    torch.manual_seed(0)
    model = models.build_model(SMALL, device=CUDA, attention="sdpa")
    batches = [tuple(t.to(CUDA) for t in make_batch(5, 7, seed=s)) for s in range(3)]
    lr, clip = 0.5, 0.05
    trainer = graphed_trainer(
        name, model, 5, lr=lr, max_grad_norm=clip, noise_multiplier=0.0,
        max_physical_batch_size=physical,
    )  # fmt: skip
    trainer.step(*batches[0])  # eager, then captured
    assert trainer.graphs.graphs is not None and trainer.graphs.error is None
    for inputs, targets in batches[1:]:
        if name == "flash":
            ref, norms = reference_update(plain_copy(model), inputs, targets, clip, lr)
            assert (norms > clip).any()  # clipping is exercised
        else:
            ref = -lr * per_sample_grads(plain_copy(model), inputs, targets).mean(0)
        update = update_of(trainer, model, inputs, targets, lr)
        assert relative_error(update, ref) < 1e-5
    assert trainer.graphs.graphs.replays == 2
    assert trainer.graphs.result()["captured"]


@pytest.mark.parametrize("name", ["standard", "flash"])
@pytest.mark.gpu
@needs_cuda
def test_replayed_adam_steps_are_torch_adams_on_brute_force_gradients(name):
    """Under --cuda_graph Adam is built capturable (its step count lives on the device): an
    eager step, then three replays, each the step torch's own eager Adam takes on a plain copy
    of the model given the brute-force gradient (clipped for flash, noise 0).

    Where the true gradient is zero (a key bias under softmax), the computed one is rounding
    noise, different in any two summation orders, and Adam's division by sqrt(v) + eps turns
    it into a step the two orders do not share. So the exact check is on the coordinates whose
    gradient was signal at every step (about 83% here; on the CPU the eager trainers agree
    there within 2e-6)."""
    torch.manual_seed(1)
    model = models.build_model(SMALL, device=CUDA, attention="sdpa")
    reference = plain_copy(model)
    reference_adam = torch.optim.Adam(reference.parameters(), lr=1e-2)
    sizes = [p.numel() for p in reference.parameters()]
    start, signal, clip = flat_params(model), None, 0.05
    trainer = graphed_trainer(
        name, model, 5, lr=1e-2, max_grad_norm=clip, noise_multiplier=0.0, optimizer="adam"
    )
    for seed in range(4):
        inputs, targets = (t.to(CUDA) for t in make_batch(5, 7, seed=20 + seed))
        if name == "flash":
            grad = -reference_update(reference, inputs, targets, clip, 1.0)[0]
        else:
            grad = per_sample_grads(reference, inputs, targets).mean(0)
        is_signal = grad.abs() > 1e-5 * grad.abs().max()
        signal = is_signal if signal is None else signal & is_signal
        for p, g in zip(reference.parameters(), grad.split(sizes)):
            p.grad = g.view_as(p).to(p.dtype)
        reference_adam.step()
        trainer.step(inputs, targets)
        moved, expected = flat_params(model) - start, flat_params(reference) - start
        assert signal.float().mean() > 0.5
        assert relative_error(moved[signal], expected[signal]) < 1e-5, seed
    assert trainer.graphs.graphs.replays == 3


@pytest.mark.gpu
@needs_cuda
def test_replays_draw_fresh_noise_of_sigma_c_over_b():
    torch.manual_seed(3)
    model = models.build_model(SMALL, device=CUDA)
    inputs, targets = (t.to(CUDA) for t in make_batch(4, 6))
    sigma, clip = 0.7, 0.05
    trainer = graphed_trainer("flash", model, 4, lr=1.0, max_grad_norm=clip, noise_multiplier=sigma)
    trainer.step(inputs, targets)
    noises = []
    for _ in range(2):
        ref, _ = reference_update(plain_copy(model), inputs, targets, clip, 1.0)
        noises.append(update_of(trainer, model, inputs, targets, 1.0) - ref)
    expected = sigma * clip / 4
    for noise in noises:
        assert abs(noise.std().item() / expected - 1) < 0.05
    # Two replays, two draws: independent noise has correlation ~0 (1/sqrt(n) ~ 0.013 here).
    assert abs(torch.corrcoef(torch.stack(noises))[0, 1].item()) < 0.1


@pytest.mark.parametrize("physical", [2, 3])
@pytest.mark.parametrize("name", ["standard", "flash"])
@pytest.mark.gpu
@needs_cuda
def test_every_poisson_draw_replays_the_eager_step(name, physical):
    """Batches of 0, 1, P-1, P, P+1 and 3P-1 samples (expected batch 4) each replay the
    captured chunks, padded, and give the eager trainer's step on the same batch (a copy of
    the model, no graph) to 1e-6 relative in fp32, noise 0; the counts say how many chunks
    ran and how many rows were padding. Inside eager() a step runs eagerly, and the replays
    after it bind .grad to the graphs' tensors again."""
    torch.manual_seed(0)
    model = models.build_model(SMALL, device=CUDA)
    eager_model = plain_copy(model)
    options = dict(lr=0.5, max_grad_norm=0.05, noise_multiplier=0.0)
    graphed = graphed_trainer(name, model, 4, max_physical_batch_size=physical, **options)
    eager = trainers.make_trainer(
        name, eager_model, batch_size=4, max_physical_batch_size=physical, **options
    )
    sizes = [4, 0, 1, physical - 1, physical, physical + 1, 3 * physical - 1, 4]
    for seed, batch in enumerate(sizes):
        inputs, targets = (t.to(CUDA) for t in make_batch(batch, 6, seed=seed + 10))
        context = graphed.graphs.eager() if seed == len(sizes) - 2 else contextlib.nullcontext()
        with context:
            graphed_update, graphed_loss = update_and_loss(graphed, model, inputs, targets)
        eager_update, eager_loss = update_and_loss(eager, eager_model, inputs, targets)
        # The loss of the draw's real samples: summed inside the graphs, read after the step.
        assert graphed_loss == (None if eager_loss is None else pytest.approx(eager_loss))
        if batch == 0:  # noise 0: flash's noise-only step is zero too, standard's skipped
            assert not graphed_update.any() and not eager_update.any()
            continue
        assert relative_error(graphed_update, eager_update) < 1e-6, batch
    counts = graphed.graphs.counts()
    replayed_sizes = sizes[1:-2] + sizes[-1:]
    assert counts["chunk_replays"] == sum(math.ceil(n / physical) for n in replayed_sizes)
    assert counts["padding_samples"] == sum(-n % physical for n in replayed_sizes)
    assert counts["replays"] == len(replayed_sizes) - (name == "standard")  # its empty step
    assert all(p.grad is grad for p, grad in graphed.graphs.graphs.grads)
    with pytest.raises(ValueError, match=r"captured for samples of shape \(6,\), got \(7,\)"):
        graphed.step(*(t.to(CUDA) for t in make_batch(4, 7)))


def update_and_loss(trainer, model, inputs, targets):
    """update_of's update, and the loss the step reported."""
    losses = []
    step = trainer.step
    trainer.step = lambda x, y: losses.append(step(x, y)["loss"])
    try:
        return update_of(trainer, model, inputs, targets, 0.5), losses[0]
    finally:
        trainer.step = step


@pytest.mark.gpu
@needs_cuda
def test_cli_records_the_graph_and_its_peak(tmp_path):
    """--mode=memory: timed steps replayed, the breakdown measured on an eager step."""
    args = ["--mode=memory", "--model", "tiny", "--trainers", "standard", "flash"]
    args += ["--batch_sizes", "2", "--seq_lens", "8", "--steps", "2", "--warmup_steps", "1"]
    args += ["--output_dir", str(tmp_path), "--run_name", "r", *SMALL_MODEL]
    done = cli(*args, "--device", "cuda", "--cuda_graph")
    assert done.returncode == 0, done.stderr
    paths = sorted(glob.glob(str(tmp_path / "r" / "*_graph*" / "result.json")))
    assert len(paths) == 2
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        assert result["status"] == "ok"
        graph = result["cuda_graph"]
        assert graph["captured"] and graph["error"] is None
        # The warm-up step was eager and captured after; both timed steps replayed.
        assert graph["timed_replays"] == 2 and result["physical_step_times_ms"] == []
        assert graph["capture_peak_mb"] > 0 and result["breakdown"]


def test_on_the_cpu_nothing_is_captured_and_the_result_says_why():
    """On the CPU every step runs eagerly and exactly."""
    torch.manual_seed(0)
    model = models.build_model(SMALL)
    trainer = trainers.make_trainer(
        "flash", model, lr=0.5, batch_size=4, max_grad_norm=0.05, noise_multiplier=0.0,
        cuda_graph=True,
    )  # fmt: skip
    for _ in range(2):
        inputs, targets = make_batch(4, 6)
        ref, _ = reference_update(plain_copy(model, "cpu"), inputs, targets, 0.05, 0.5)
        assert relative_error(update_of(trainer, model, inputs, targets, 0.5), ref) < 1e-5
    result = trainer.graphs.result()
    assert not result["captured"] and result["replays"] == 0
    assert "no step on CUDA had a sample" in result["error"]


def test_a_capture_bypasses_the_kept_device_tables(monkeypatch):
    """A kept table may be evicted while a graph reads it, and a captured one holds its rows only
    after a replay: while capturing, every table is made anew and kept alive with the graphs."""
    from dp_cost.flash.kernels import common

    rows = [[11, 12], [13, 14]]
    kept = common.int64_table(rows, torch.device("cpu"))
    monkeypatch.setattr(common, "capturing", lambda: True)
    cached = dict(common._DEVICE_TABLES)
    captured = common.int64_table(rows, torch.device("cpu"))
    assert captured is not kept and torch.equal(captured, kept)
    assert common._DEVICE_TABLES == cached  # neither read nor written
    monkeypatch.undo()
    assert common.int64_table(rows, torch.device("cpu")) is kept


def test_opacus_trainers_are_refused():
    model = models.build_model(SMALL)
    for name in ("dpsgd", "ghost"):
        with pytest.raises(ValueError, match="--cuda_graph captures the standard and flash"):
            trainers.make_trainer(name, model, lr=0.1, batch_size=2, cuda_graph=True)
    assert trainers.make_trainer("flash", model, lr=0.1, batch_size=2, cuda_graph=False)


def test_on_cpu_the_flag_is_one_error_line(tmp_path):
    args = small_run_args(tmp_path, "flash")
    done = cli(*args, "--device", "cpu", "--cuda_graph")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --cuda_graph replays CUDA graphs: it needs a CUDA device"
    ]
    assert not os.path.exists(tmp_path / "r")


@pytest.mark.parametrize(
    "extra, env, message",
    [
        (["--ncu"], {}, "--ncu profiles one eager step in named phases: drop --cuda_graph"),
        (
            ["--distributed", "fsdp"],  # as torchrun starts rank 0 of two
            TORCHRUN_ENV,
            "--cuda_graph captures the step of one process or of DDP: FSDP2 decides",
        ),
    ],
)  # fmt: skip
def test_plan_refuses_graphs_with_ncu_or_fsdp(extra, env, message, monkeypatch):
    """On a CUDA machine (cuda_available stubbed): one UsageError naming the conflict."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = profiling_script.parse_args(["--mode=profile", "--cuda_graph", *extra])
    with pytest.raises(UsageError, match=message):
        plan.make_plan(args, cuda_available=lambda: True)


def test_graphs_under_ddp_are_planned(monkeypatch):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    args = profiling_script.parse_args(["--mode=profile", "--cuda_graph", "--distributed", "ddp"])
    configs = plan.make_plan(args, cuda_available=lambda: True).configs
    assert configs and all(c.cuda_graph and c.distributed == "ddp" for c in configs)
    assert trainers.refusal("flash", "ddp", cuda_graph=True) is None
    assert trainers.refusal("standard", "ddp", cuda_graph=True) is None
    assert "FSDP2 decides" in trainers.refusal("standard", "fsdp", cuda_graph=True)
    assert "Opacus' step" in trainers.refusal("ghost", "ddp", cuda_graph=True)


def test_a_skipped_config_says_why():
    assert "Opacus' step" in skip_reason(ExperimentConfig("dpsgd", 8, 64, cuda_graph=True))
    assert skip_reason(ExperimentConfig("flash", 8, 64, cuda_graph=True)) is None


def test_plan_says_how_often_a_poisson_draw_takes_a_second_chunk(tmp_path):
    """With a cap at B or above, the graphs' chunk is the expected batch B and a draw above it
    replays two chunks: the plan's note gives that share, P(n > B) binomial over the dataset's
    N (math.comb here, lgamma in the plan), N the synthetic dataset's --dataset_size or a
    dataset file's rows; a cap below B (the mode's default is 1) needs no note."""

    def note_of(*argv):
        argv = ["--mode=hf", "--model_name", "tiny-llama", "--max_physical_batch_size", *argv]
        args = profiling_script.parse_args(argv)
        return plan.make_plan(args, cuda_available=lambda: True).note

    def above(n, b):
        pmf = [math.comb(n, k) * (b / n) ** k * (1 - b / n) ** (n - k) for k in range(b + 1)]
        return 1 - sum(pmf)

    note = note_of("16", "--cuda_graph", "--batch_size", "16", "--dataset_size", "200")
    assert f"about {100 * above(200, 16):.2g}% of steps at batch 16" in note
    assert 0.42 < above(200, 16) < 0.45  # Poisson(16)'s 43%
    rows = tmp_path / "snli.jsonl"
    rows.write_text('{"premise": "a", "hypothesis": "b", "label": 0}\n' * 20)
    note = note_of("16", "--cuda_graph", "--batch_size", "16", "--dataset_path", str(rows))
    assert f"about {100 * above(20, 16):.2g}% of steps at batch 16" in note
    # Nothing to say: a cap below the batch, fixed-size batches, no graph, or only trainers a
    # graph skips.
    assert note_of("4", "--cuda_graph", "--batch_size", "16") is None
    assert note_of("16", "--cuda_graph", "--no_poisson", "--batch_size", "16") is None
    assert note_of("16", "--batch_size", "16") is None
    assert note_of("16", "--cuda_graph", "--trainers", "dpsgd", "ghost") is None


class Batch:
    """What captures_after reads of a batch: a CUDA one without a GPU."""

    is_cuda, device = True, torch.device("cpu")

    def __init__(self, samples: int):
        self.samples = samples

    def __len__(self):
        return self.samples


@pytest.fixture
def one_rank(tmp_path):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


def test_a_capture_waits_for_ddps_11th_iteration_and_a_sample(one_rank):
    """DDP times its first 10 iterations (forwards that sync gradients) with CUDA events, read
    in the next: standard under DDP is captured only after its 11th, whatever the steps around
    it (chunks that do not sync, forwards without grad, empty batches do not count); flash at
    its first batch with a sample. Any drawn size may be captured after (the graphs' chunk is
    padded); an empty draw on every rank may not."""
    torch.manual_seed(0)
    model = models.build_model(SMALL)
    trainer = trainers.make_trainer(
        "standard", model, lr=0.1, batch_size=4, max_physical_batch_size=2, distributed="ddp"
    )
    replayer = graph.Replayer(enabled=True)
    inputs, targets = make_batch(4, 6)
    for _ in range(9):
        trainer.step(inputs, targets)  # two chunks: the first one's forward does not sync
        with torch.no_grad():
            trainer.trainer.forward_model(inputs)
        trainer.step(inputs[:0], targets[:0])  # an empty Poisson draw: no forward
    assert trainer.trainer.forward_model.iterations == 9
    assert not replayer.captures_after(Batch(4), trainer)
    assert "give --warmup_steps 11" in replayer.result()["error"]
    trainer.step(inputs, targets)
    assert replayer.captures_after(Batch(4), trainer)  # this step is DDP's 11th
    assert replayer.captures_after(Batch(3), trainer) and replayer.captures_after(Batch(1), trainer)
    assert not replayer.captures_after(Batch(0), trainer)
    with replayer.eager():
        assert not replayer.captures_after(Batch(2), trainer)
    assert not graph.Replayer(enabled=False).captures_after(Batch(2), trainer)
    flash = trainers.make_trainer("flash", models.build_model(SMALL), lr=0.1, batch_size=4)
    assert flash.trainer.capture.ready() and graph.Replayer(True).captures_after(Batch(1), flash)


@pytest.mark.parametrize("warmup, noted", [("1", True), ("11", False)])
def test_the_plan_says_when_standard_under_ddp_would_capture_late(warmup, noted, monkeypatch):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    argv = ["--mode=profile", "--cuda_graph", "--distributed", "ddp", "--warmup_steps", warmup]
    note = plan.make_plan(profiling_script.parse_args(argv), cuda_available=lambda: True).note
    assert ("give --warmup_steps 11" in (note or "")) == noted
    argv = [*argv[:-2], "--trainers", "flash"]  # flash captures after its first batch with a sample
    assert not plan.make_plan(profiling_script.parse_args(argv), cuda_available=lambda: True).note


class Stream:
    def wait_stream(self, other):
        pass


@pytest.mark.parametrize("distributed", ["none", "ddp"])
def test_a_failed_capture_runs_eagerly_alone_ends_a_ddp_config(distributed, request, monkeypatch):
    """One process: the steps go on eagerly, the error kept. Under DDP a failed capture leaves
    DDP's reducer and the noise generators mid-step, and a rank that captured would replay
    collectives the others do not: every rank's config ends with the error (CUDA's streams and
    the capture are stand-ins here; the eager step before it runs for real, on the CPU)."""
    if distributed == "ddp":
        request.getfixturevalue("one_rank")
    for name, stand_in in {
        "current_stream": lambda device=None: Stream(),
        "Stream": lambda device=None: Stream(),
        "stream": lambda stream: contextlib.nullcontext(),
        "set_stream": lambda stream: None,
        "synchronize": lambda device=None: None,
    }.items():
        monkeypatch.setattr(torch.cuda, name, stand_in)

    def failing_capture(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graph, "ChunkGraphs", failing_capture)
    torch.manual_seed(0)
    trainer = trainers.make_trainer(
        "standard", models.build_model(SMALL), lr=0.1, batch_size=4, distributed=distributed
    )
    replayer = graph.Replayer(enabled=True)
    inputs, targets = make_batch(4, 6)
    if distributed == "none":
        assert replayer.capture_after(trainer, inputs, targets)["loss"] is not None
        assert replayer.graphs is None and "not permitted" in replayer.error
        return
    with pytest.raises(RuntimeError, match="capture failed on a rank .*not permitted"):
        replayer.capture_after(trainer, inputs, targets)
