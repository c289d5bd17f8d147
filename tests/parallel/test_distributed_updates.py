"""Every trainer under torchrun (2 ranks, gloo, CPU) against the single-process definition on
the same global batch: each rank steps on its own slice (different samples per rank), and the
update must equal the brute-force DP-SGD update of the whole batch (fp32, 1e-5), the noise must
be added once (std sigma*C/B of the global batch)."""

import functools
import json
import os

import pytest
import torch
from forked_ranks import forked_ranks
from test_trainers import SMALL, make_batch, per_sample_grads

import models
import trainers
from dp_cost.flash import sinks

HERE = os.path.dirname(os.path.abspath(__file__))
SEQ, C = 12, 0.05


def run_ranks(script, *args, timeout=600, ranks=2):
    """Run ``script`` (next to this file) on ``ranks`` ranks as torchrun would (forked from this
    process: tests/forked_ranks.py); it must succeed."""
    done = forked_ranks(os.path.join(HERE, script), *args, ranks=ranks, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]


def torchrun(tmp_path, jobs: dict, ranks=2) -> dict:
    """{job name: {(case, trainer): {"grad", "loss", ...}}} of one torchrun launch on ``ranks``
    ranks running every job (see one_step_per_rank.run_job): one launch, so the interpreters,
    imports and process group are paid once for many checks."""
    jobs_file, out = tmp_path / "jobs.json", tmp_path / "saved.pt"
    jobs_file.write_text(json.dumps(jobs))
    run_ranks(
        "one_step_per_rank.py", "--jobs", str(jobs_file), "--max_grad_norm", str(C),
        "--seq", str(SEQ), "--out", str(out), ranks=ranks,
    )  # fmt: skip
    return torch.load(out)


def clipped_mean(grads, batch_size):
    """The DP-SGD update direction with noise 0 from per-sample gradients [n, P]."""
    factors = (C / (grads.norm(dim=1) + 1e-6)).clamp(max=1.0)
    assert factors.max() < 1  # every sample clipped: a wrong norm changes the update
    return (factors[:, None] * grads).sum(0) / batch_size


@functools.cache
def global_batch_grads(samples):
    """Per-sample gradients [samples, P] of the global batch of ``samples`` on SMALL's initial
    model, taken one sample at a time; each size's once a test process: the checks of every job
    read them (the tensors are never changed in place)."""
    torch.manual_seed(0)
    model = models.build_model(SMALL)
    inputs, targets = make_batch(samples, SEQ, seed=3)
    return per_sample_grads(model, inputs, targets)


@functools.cache
def parameter_shapes():
    """The shapes of SMALL's parameters, in the order the flattened gradients are."""
    return [p.shape for p in models.build_model(SMALL).parameters()]


def references(samples, batch_size):
    """(plain mean gradient, DP-SGD clipped mean gradient with noise 0) of the global batch,
    from per-sample gradients taken one sample at a time."""
    grads = global_batch_grads(samples)
    return grads.sum(0) / batch_size, clipped_mean(grads, batch_size)


def per_layer_references(samples, batch_size):
    """(per-layer clipped mean gradient with noise 0, count of samples each parameter's bound
    clips) of the global batch: each parameter tensor's per-sample gradient clipped to
    C_l = C / sqrt(P), from per-sample gradients taken one sample at a time."""
    grads = global_batch_grads(samples)
    sizes = [shape.numel() for shape in parameter_shapes()]
    bound = C / len(sizes) ** 0.5
    clipped, counts = [], []
    for grad in grads.split(sizes, dim=1):
        factors = (bound / (grad.norm(dim=1) + 1e-6)).clamp(max=1.0)
        clipped.append((factors[:, None] * grad).sum(0) / batch_size)
        counts.append(int((factors < 1).sum()))
    return torch.cat(clipped), counts


def noise_free_update(samples, batch_size, clipping="flat"):
    """The brute force's DP-SGD update with noise 0 (flat or per-layer clipping): what a noisy
    step's update less its noise is; zeros for an empty draw."""
    if samples == 0:
        return torch.zeros(sum(shape.numel() for shape in parameter_shapes()), dtype=torch.double)
    if clipping == "per_layer":
        return per_layer_references(samples, batch_size)[0]
    return references(samples, batch_size)[1]


def check_per_layer_update(saved, names, cases=None):
    """Per-layer clipping's update equals the definition, replicas agree, and the merged record
    counts each parameter's clipped samples over the global batch."""
    for case in cases or CASES:
        samples, batch_size, _ = map(int, case.split(","))
        reference, counts = per_layer_references(samples, batch_size)
        _, flat = references(samples, batch_size)
        for name in names:
            where = ("per_layer", case, name)
            assert relative(saved[case, name]["grad"], reference) < 1e-5, where
            assert relative(saved[case, name]["grad"], flat) > 1e-2, where  # not flat clipping
            assert saved[case, name]["replicas_agree"], where
            record = saved[case, name]["clipping"]
            assert record["samples"] == samples, where
            assert [p["clipped_samples"] for p in record["parameters"]] == counts, where


def relative(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


TRAINERS = {"ddp": ["standard", "dpsgd", "ghost", "flash"], "fsdp": ["standard", "ghost", "flash"]}


# An even split with 2 chunks per rank; a Poisson-like 4 + 3 split; a 2 + 1 split one sample per
# chunk (rank 1 runs a stand-in chunk); one sample in all (rank 1 holds none); one sample per
# rank, of a batch of 2 and of a short Poisson-like draw of 4. Under DDP flash gathers per-sample
# gradients where the busiest rank holds one sample (the last three), else sums clipped ones.
CASES = ["8,8,3", "7,8,2", "3,4,1", "1,4,1", "2,2,1", "2,4,4"]


def flash_gathers(distributed, samples):
    return distributed == "ddp" and (samples + 1) // 2 == 1


# flash's collectives run asynchronously, in buckets, while its clipped GEMMs (or, gathering, the
# backward) do: here buckets of 3000 bytes, so several, of one tensor and of several (FSDP2's
# rank-major with padded pieces: the vocabulary is odd), all pending (DDP) or the older ones
# waited for past 5000 bytes (FSDP2); the noise test has several buckets too (flash draws the
# noise once per parameter, in the few groups its last collectives land in, not per bucket),
# each collective waited for at once.
SMALL_BUCKETS = {"bucket_bytes": 3000, "in_flight_bytes": 5000}
# The cases of the step CUDA graphs replay (padded chunks of P = min(cap, B / 2) per rank): 4 + 4
# in two chunks of 3, the second padded by 2; a Poisson-like 4 + 3 in chunks of 2 (rank 1's
# second padded); 2 + 1 one sample per chunk (rank 1's second chunk all padding); one sample in
# all (rank 1's only chunk all padding); one per rank.
PADDED_CASES = ["8,8,3", "7,8,2", "3,4,1", "1,4,2", "2,2,1"]
# flash's noise through padded chunks, added once: a draw of 5 in chunks of 3 (one chunk per rank,
# the second rank's padded), of 8 (two chunks per rank: noise in the last one only), and an
# empty draw (one all-padding chunk on every rank: its noise enters the sum over ranks there).
PADDED_NOISE_CASES = ["5,8,3", "8,8,3", "0,8,3"]
# A full batch, an empty Poisson draw (no rank has a sample: noise alone, still once), and
# one sample per rank (flash under DDP: every rank adds the same draw to its replica).
NOISE_CASES = ["8,8,8", "0,8,8", "2,8,8"]
SIGMA = 2.0


def dp_trainers(distributed):
    return [n for n in TRAINERS[distributed] if n != "standard"]


def every_job() -> dict:
    """The jobs of the test below, run in one torchrun launch."""
    jobs = {}
    for distributed in ("ddp", "fsdp"):
        jobs[f"update {distributed}"] = {
            "distributed": distributed, "trainers": TRAINERS[distributed], "cases": CASES,
            **SMALL_BUCKETS,
        }  # fmt: skip
        if distributed == "fsdp":  # the gradients reduce-scattered once, after the last chunk
            jobs["update fsdp logical"] = {
                "distributed": "fsdp", "trainers": ["standard", "flash"], "cases": CASES,
                "fsdp_sync": "logical", **SMALL_BUCKETS,
            }  # fmt: skip
        per_layer = ["dpsgd", "flash"] if distributed == "ddp" else ["flash"]
        jobs[f"per_layer {distributed}"] = {
            "distributed": distributed, "trainers": per_layer, "cases": CASES,
            "clipping": "per_layer", **SMALL_BUCKETS,
        }  # fmt: skip
        if distributed == "fsdp":  # per-layer sums held to the last chunk
            jobs["per_layer fsdp logical"] = {
                "distributed": "fsdp", "trainers": ["flash"], "cases": CASES,
                "clipping": "per_layer", "fsdp_sync": "logical", **SMALL_BUCKETS,
            }  # fmt: skip
        # The noise: a noisy step's update less the brute force's (noise 0).
        # per-layer: noise of C (its sensitivity), added once
        jobs[f"per_layer noise {distributed}"] = {
            "distributed": distributed, "trainers": per_layer, "cases": NOISE_CASES,
            "noise_multiplier": SIGMA, "clipping": "per_layer",
        }  # fmt: skip
        jobs[f"noise {distributed}"] = {  # FSDP2: each collective waited for at once
            "distributed": distributed, "trainers": dp_trainers(distributed),
            "cases": NOISE_CASES, "noise_multiplier": SIGMA, "in_flight_bytes": 0,
            "bucket_bytes": SMALL_BUCKETS["bucket_bytes"],
        }  # fmt: skip
    for distributed in ("ddp", "fsdp"):  # flash on checkpointed blocks, flat and per-layer
        jobs[f"checkpointed {distributed}"] = {
            "distributed": distributed, "trainers": ["flash"], "cases": CASES,
            "checkpointing": True, **SMALL_BUCKETS,
        }  # fmt: skip
    jobs["checkpointed per_layer ddp"] = {
        "distributed": "ddp", "trainers": ["flash"], "cases": CASES, "checkpointing": True,
        "clipping": "per_layer", **SMALL_BUCKETS,
    }  # fmt: skip
    jobs["checkpointed per_layer fsdp logical"] = {
        "distributed": "fsdp", "trainers": ["flash"], "cases": CASES, "checkpointing": True,
        "clipping": "per_layer", "fsdp_sync": "logical", **SMALL_BUCKETS,
    }  # fmt: skip
    for noise in (0.0, SIGMA):  # DDP's noise drawn while checkpointed blocks are clipped
        jobs[f"checkpointed noise {noise}"] = {
            "distributed": "ddp", "trainers": ["flash"], "cases": ["8,8,8"],
            "noise_multiplier": noise, "checkpointing": True, "num_layers": 4,
            "clipping": "per_layer", "bucket_bytes": 1,  # every gradient sent alone
        }  # fmt: skip
    jobs.update(textbook_jobs())
    jobs["padded step ddp"] = {
        "distributed": "ddp", "trainers": ["standard", "flash"], "cases": PADDED_CASES,
        "padded_step": True, **SMALL_BUCKETS,
    }  # fmt: skip
    jobs["padded noise"] = {
        "distributed": "ddp", "trainers": ["flash"], "cases": PADDED_NOISE_CASES,
        "padded_step": True, "noise_multiplier": SIGMA,
    }  # fmt: skip
    return jobs


# A trainer tests define in one file (tests/textbook_dpsgd.py: DP-SGD by microbatches of one),
# registered by the job, run by the Runner in near-equal and padded chunks.
TEXTBOOK_CASES = ["7,8,2", "2,2,1", "1,4,1"]


def textbook_jobs() -> dict:
    return {
        f"textbook {kind}": {
            "distributed": "ddp", "trainers": ["textbook_dpsgd"], "cases": TEXTBOOK_CASES,
            "padded_step": kind == "padded",
        }
        for kind in ("eager", "padded")
    }  # fmt: skip


def check_textbook(saved):
    for kind in ("eager", "padded"):
        check_update(saved[f"textbook {kind}"], "ddp", ["textbook_dpsgd"], TEXTBOOK_CASES)


def test_every_trainer_under_ddp_and_fsdp2_steps_as_the_definition(tmp_path):
    """One launch; each check below names its job: (1) the update of every trainer equals the
    single-process definition, DDP and FSDP2 (standard and flash also with FSDP2's sync held to
    the last chunk); (2) the step a CUDA graph captures under DDP;
    (3) the noise is added once."""
    saved = torchrun(tmp_path, every_job())
    check_update(saved["update fsdp logical"], "fsdp", ["standard", "flash"])
    for distributed in ("ddp", "fsdp"):
        check_update(saved[f"update {distributed}"], distributed)
        per_layer = ["dpsgd", "flash"] if distributed == "ddp" else ["flash"]
        check_per_layer_update(saved[f"per_layer {distributed}"], per_layer)
        if distributed == "fsdp":
            check_per_layer_update(saved["per_layer fsdp logical"], per_layer)
        check_noise_added_once(
            saved[f"per_layer noise {distributed}"], distributed, NOISE_CASES, per_layer,
            "per_layer",
        )  # fmt: skip
        check_noise_added_once(saved[f"noise {distributed}"], distributed)
    for distributed in ("ddp", "fsdp"):
        check_update(saved[f"checkpointed {distributed}"], distributed, ["flash"])
    check_per_layer_update(saved["checkpointed per_layer fsdp logical"], ["flash"])
    check_per_layer_update(saved["checkpointed per_layer ddp"], ["flash"])
    check_checkpointed_noise(saved["checkpointed noise 0.0"], saved[f"checkpointed noise {SIGMA}"])
    check_padded_step(saved["padded step ddp"])
    check_textbook(saved)
    check_noise_added_once(saved["padded noise"], "ddp", PADDED_NOISE_CASES, ["flash"])


def check_checkpointed_noise(quiet, noisy):
    """DDP, per-layer flash on 4 checkpointed blocks: the blocks' clipped sums are sent (rank 0
    adding its noise to each bucket) from inside torch's recomputation, which restores the
    random state each block's forward began with. The noise (the noisy step's update less the
    quiet one's) has std sigma * C / B and differs from block to block (a draw from torch's
    restored state would be the same in every block)."""
    import dataclasses

    model = models.build_model(dataclasses.replace(SMALL, num_layers=4))
    sizes = [p.numel() for p in model.parameters()]
    names = [name for name, _ in model.named_parameters()]
    noise = noisy["8,8,8", "flash"]["grad"] - quiet["8,8,8", "flash"]["grad"]
    pieces = dict(zip(names, noise.split(sizes), strict=True))
    std = SIGMA * C / 8
    assert abs(noise.std().item() / std - 1) < 0.1
    q = [pieces[f"blocks.{b}.attn.qlinear.weight"] for b in range(4)]
    for b in range(1, 4):
        assert relative(q[b], q[b - 1]) > 0.5, b  # independent draws, not one repeated


def check_update(saved, distributed, names=None, cases=CASES):
    for case in cases:
        samples, batch_size, _ = map(int, case.split(","))
        mean, clipped = references(samples, batch_size)
        for name in names or TRAINERS[distributed]:
            reference = mean if name == "standard" else clipped
            where = (distributed, case, name)
            assert relative(saved[case, name]["grad"], reference) < 1e-5, where
            assert saved[case, name]["replicas_agree"], where
        if "flash" in (names or TRAINERS[distributed]):
            assert saved[case, "flash"]["gathered"] == flash_gathers(distributed, samples), case
        # the loss of the global batch, the same for every trainer
        assert len({saved[case, name]["loss"] for name in names or TRAINERS[distributed]}) == 1


def check_padded_step(saved):
    """--cuda_graph under DDP replays the Runner's padded_step's chunks: every rank runs the
    busiest rank's count of chunks of P samples, stand-ins weighted 0: the same update (flash's
    clipped sums, also at one sample per chunk), and the global batch's loss over its real
    samples. Which ranks agree (capture, chunk counts) is one collective: a flag false on one
    rank is false on all."""
    assert saved["agreed"] == [False, True]
    for case in PADDED_CASES:
        samples, batch_size, physical = map(int, case.split(","))
        mean, clipped = references(samples, batch_size)
        for name, reference in (("standard", mean), ("flash", clipped)):
            assert relative(saved[case, name]["grad"], reference) < 1e-5, ("padded", case, name)
            assert saved[case, name]["replicas_agree"], ("padded", case, name)
        # Never gathered: gathering takes a step's one chunk and hands .grad over to the gathers
        assert not saved[case, "flash"]["gathered"], case
        torch.manual_seed(0)
        model = models.build_model(SMALL)
        inputs, targets = make_batch(samples, SEQ, seed=3)
        with torch.no_grad():  # the global batch's loss, from the whole batch at once
            loss = trainers.token_losses(model(inputs), targets).mean().item()
        for name in ("standard", "flash"):
            assert saved[case, name]["loss"] == pytest.approx(loss, rel=1e-5), (case, name)


def check_noise_added_once(noisy, distributed, cases=NOISE_CASES, names=None, clipping="flat"):
    """The noise, each noisy update less the brute force's noise-free one, has the std of
    sigma C / B of the global batch and mean 0."""
    for case in cases:
        samples, batch_size, _ = map(int, case.split(","))
        clean = noise_free_update(samples, batch_size, clipping)
        for name in names or dp_trainers(distributed):
            where = ("noise", distributed, case, name)
            noise = noisy[case, name]["grad"] - clean
            expected = SIGMA * C / 8  # sigma * C / B of the global batch; twice-added: x sqrt(2)
            assert abs(noise.std().item() / expected - 1) < 0.05, where
            assert abs(noise.mean().item()) < 0.05 * expected, where
            assert noisy[case, name]["replicas_agree"], where
        # flash's noise after the sum, every parameter in one draw: of what landed before the
        # step, or of a group the last collectives land in (not one per bucket)
        draws = noisy[case, "flash"]["noise_draws"]
        assert sum(draws) == len(parameter_shapes()), case
        assert 1 <= len(draws) <= sinks.LANDING_GROUPS + 1, case
        gathered = flash_gathers(distributed, samples)
        assert noisy[case, "flash"]["gathered"] == gathered, (distributed, case)


# A global batch of 5 on 2 ranks (3 + 2 samples; 4 + 1 in chunks of 2): the divisor is 5
ODD_BATCH_CASES = ["5,5,5", "5,5,2"]


def test_any_batch_size_and_fsdp2_noise_streams_through_make_trainer(tmp_path):
    """What make_trainer builds is right however it is called: (1) a batch size that is not a
    multiple of the ranks divides by B (Opacus' optimizers take B / W as each rank's expected
    batch), under DDP and FSDP2; (2) under FSDP2 with every rank's torch seed alike, the noise
    on the ranks' shards is independent, with the std of sigma C / B: flash seeds each rank's
    stream itself; Opacus (ghost) draws the whole noise on every rank and keeps its shard."""
    jobs = {
        f"odd {distributed}": {"distributed": distributed, "trainers": TRAINERS[distributed],
                               "cases": ODD_BATCH_CASES}
        for distributed in ("ddp", "fsdp")
    }  # fmt: skip
    jobs["streams"] = {
        "distributed": "fsdp", "trainers": ["ghost", "flash"], "cases": ["8,8,8"],
        "noise_multiplier": SIGMA, "reseed": False, "local_grads": True,
    }  # fmt: skip
    saved = torchrun(tmp_path, jobs)
    for distributed in ("ddp", "fsdp"):
        check_update(saved[f"odd {distributed}"], distributed, cases=ODD_BATCH_CASES)
    noisy = saved["streams"]
    for name in ("ghost", "flash"):
        # each rank's shards less the same rows of the brute force's noise-free update
        local = noisy["8,8,8", name, "local"]
        shards = [
            torch.cat([piece.reshape(-1) for piece in pieces]).double() - clean
            for pieces, clean in zip(local, rows_of_each_rank(noise_free_update(8, 8), local))
        ]
        size = min(len(shard) for shard in shards)
        first, second = shards[0][:size], shards[1][:size]
        assert not torch.allclose(first, second), name
        assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1].item()) < 0.1, name
        for shard in shards:
            assert abs(shard.std().item() / (SIGMA * C / 8) - 1) < 0.05, name


def rows_of_each_rank(full, local) -> list:
    """``full`` (flattened over SMALL's parameters) cut as FSDP2 shards it: each rank's rows of
    each parameter (``local``: each rank's gradient pieces, rows rank after rank), flattened."""
    shapes = parameter_shapes()
    cut = [[] for _ in local]
    for i, flat in enumerate(full.split([shape.numel() for shape in shapes])):
        rows, start = flat.reshape(shapes[i]), 0
        for rank, pieces in enumerate(local):
            cut[rank].append(rows[start : start + len(pieces[i])].reshape(-1))
            start += len(pieces[i])
        assert start == shapes[i][0], (i, start, shapes[i])
    return [torch.cat(pieces) for pieces in cut]


# (distributed, one sample per rank) with per-layer clipping
PER_LAYER_BRANCH_VARIANTS = [("ddp", False), ("fsdp", False), ("fsdp", True), ("ddp", True)]
# (distributed, one sample per rank, bf16)
BRANCH_VARIANTS = [("ddp", False, False), ("fsdp", False, False), ("fsdp", True, False),
                   ("ddp", True, False), ("ddp", True, True)]  # fmt: skip


def test_a_layer_only_one_rank_reaches(tmp_path):
    """A data-dependent branch taken on rank 0 only: both ranks still issue the same
    collectives (the rank that skipped it hands over zeros in its place), and flash's update is
    the brute-force clipped mean of the global batch, each sample through its own branch. With
    one sample per rank, flash under DDP gathers per-sample gradients (the script checks); in a
    bf16 step, in bf16, the zeros of the rank that skipped the branch too (to bf16's precision).
    Every variant in one launch."""
    from branch_per_rank import INPUTS, ONE_PER_RANK, TARGETS, build

    out = tmp_path / "branch.pt"
    variants = [f"{d},{int(one)},{int(bf16)}" for d, one, bf16 in BRANCH_VARIANTS]
    # per-layer clipping: rank 0 reaches the expert layer, rank 1 hands over its zeros; the
    # collectives still pair up
    per_layer = [f"{d},{int(one)},0,per_layer" for d, one in PER_LAYER_BRANCH_VARIANTS]
    run_ranks("branch_per_rank.py", "--variants", *variants, *per_layer, "--out", str(out),
              timeout=300)  # fmt: skip
    saved = torch.load(out)
    for variant, (_, one_per_rank, bf16) in zip(variants, BRANCH_VARIANTS):
        rows = ONE_PER_RANK if one_per_rank else slice(None)
        inputs, targets = INPUTS[rows], TARGETS[rows]
        reference = clipped_mean(per_sample_grads(build(), inputs, targets), len(inputs))
        assert relative(saved[variant], reference) < (2e-2 if bf16 else 1e-5), variant
    for variant, (_, one_per_rank) in zip(per_layer, PER_LAYER_BRANCH_VARIANTS):
        rows = ONE_PER_RANK if one_per_rank else slice(None)
        inputs, targets = INPUTS[rows], TARGETS[rows]
        model = build()
        grads = per_sample_grads(model, inputs, targets)
        sizes = [p.numel() for p in model.parameters()]
        bound = C / len(sizes) ** 0.5
        reference = torch.cat([
            ((bound / (g.norm(dim=1) + 1e-6)).clamp(max=1.0)[:, None] * g).sum(0) / len(inputs)
            for g in grads.split(sizes, dim=1)
        ])  # fmt: skip
        assert relative(saved[variant], reference) < 1e-5, variant


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_replayed_ddp_steps_equal_the_definition(tmp_path):
    """--cuda_graph under DDP on 2 GPUs (NCCL): standard captures after DDP's 11 eager steps,
    flash after one; every step, eager and replayed, on Poisson-like draws of 8, 1, 5 and 3
    samples against an expected batch of 4 (padded chunks of P per rank: more chunks than the
    capture's, a rank with nothing, one padded), is the single-process update of the draw
    divided by the expected batch, the same on both replicas; the loss is the draw's mean."""
    out, cases, draws = tmp_path / "replayed.pt", ["4,1", "4,2"], ["8", "1", "5", "3"]
    args = ["--seq", str(SEQ), "--max_grad_norm", str(C), "--out", str(out)]
    run_ranks("replayed_steps_per_rank.py", "--cases", *cases, "--draws", *draws, *args)
    saved = torch.load(out)
    for case in cases:
        batch_size = int(case.split(",")[0])
        for name in ("standard", "flash"):
            got = saved[case, name]
            assert got["error"] is None and got["replays"] == len(draws), (case, name)
            assert got["eager_steps"] == (11 if name == "standard" else 1), (case, name)
            for step, (size, grad) in enumerate(zip(got["sizes"], got["grads"], strict=True)):
                mean, clipped = references(size, batch_size)
                reference = mean if name == "standard" else clipped
                assert relative(grad, reference) < 1e-5, (case, name, step, size)
                torch.manual_seed(0)
                inputs, targets = make_batch(size, SEQ, seed=3)
                with torch.no_grad():
                    loss = trainers.token_losses(models.build_model(SMALL)(inputs), targets)
                assert got["losses"][step] == pytest.approx(loss.mean().item(), rel=1e-5)
            assert got["replicas_agree"], (case, name)
        # Replays never gather (a padded step has any number of chunks); the eager steps may.
        assert not saved[case, "flash"]["gathered"], case


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_replayed_ddp_noise_is_fresh_and_added_once(tmp_path):
    """flash's noise in replayed DDP steps: std sigma*C/B of the global batch (once per
    coordinate: one draw on every replica, after the last chunk's sum over the ranks), a fresh
    draw at each replay, replicas equal."""
    out, sigma = tmp_path / "noisy.pt", 2.0
    args = ["--seq", str(SEQ), "--max_grad_norm", str(C), "--noise_multiplier", str(sigma)]
    cases = ("2,1", "4,2", "8,3")  # one chunk per rank, and two (noise in the last one only)
    run_ranks("replayed_steps_per_rank.py", "--cases", *cases, *args, "--out", str(out))
    saved = torch.load(out)
    for case in cases:
        samples = int(case.split(",")[0])
        got = saved[case, "flash"]
        assert got["replays"] == 2 and got["replicas_agree"], (case, got["error"])
        noises = [grad - references(samples, samples)[1] for grad in got["grads"][-2:]]
        for noise in noises:
            assert abs(noise.std().item() / (sigma * C / samples) - 1) < 0.05, case
        assert relative(noises[1], noises[0]) > 1, case  # independent draws: about sqrt(2)


# On 3 ranks: 9 samples in chunks of 2 (3 + 3 + 3: two chunks per rank) and of 1 (three chunks
# per rank: sums held over two chunks), a Poisson-like 7 of an expected 9 (3 + 2 + 2), 4 in
# chunks of 1 (2 + 1 + 1: the other ranks run a stand-in chunk).
THREE_RANK_CASES = ["9,9,2", "9,9,1", "7,9,2", "4,9,1"]
# per-layer clipping also at one sample per rank
PER_LAYER_THREE_RANK_CASES = [*THREE_RANK_CASES, "3,3,1"]


def test_fsdp2_sync_per_chunk_and_per_logical_batch_give_the_same_update_on_3_ranks(tmp_path):
    """FSDP2 on 3 ranks (the sharding pads rows to a multiple of 3), standard and flash, with the
    gradients reduce-scattered after every chunk and once after the last: each the
    single-process definition of the global batch, so the same update; with "logical" no
    gradient reaches a shard before the last chunk. Per-layer clipping too (flash under both
    syncs and DDP, dpsgd under DDP), and flash on checkpointed blocks."""
    jobs = {
        sync: {"distributed": "fsdp", "trainers": ["standard", "flash"],
               "cases": THREE_RANK_CASES, "fsdp_sync": sync, "probe_sync": True,
               **SMALL_BUCKETS}
        for sync in ("chunk", "logical")
    }  # fmt: skip
    # flash reducing every chunk, gathering the next chunk's units (the root and both blocks)
    # after a chunk's backward
    jobs["prefetched chunk"] = {**jobs["chunk"], "trainers": ["flash"], "forward_prefetch": 3}
    # per-layer clipping on 3 ranks: flash under FSDP2 (both syncs; the gathers ahead under
    # "chunk" only) and DDP, dpsgd under DDP
    for sync in ("chunk", "logical"):
        jobs[f"per_layer {sync}"] = {
            "distributed": "fsdp", "trainers": ["flash"], "cases": PER_LAYER_THREE_RANK_CASES,
            "fsdp_sync": sync, "clipping": "per_layer", "forward_prefetch": 3, **SMALL_BUCKETS,
        }  # fmt: skip
    jobs["per_layer ddp"] = {
        "distributed": "ddp", "trainers": ["dpsgd", "flash"], "cases": PER_LAYER_THREE_RANK_CASES,
        "clipping": "per_layer", **SMALL_BUCKETS,
    }  # fmt: skip
    # flash on checkpointed blocks: FSDP2 per-layer, DDP flat
    jobs["checkpointed per_layer fsdp"] = {
        "distributed": "fsdp", "trainers": ["flash"], "cases": PER_LAYER_THREE_RANK_CASES,
        "clipping": "per_layer", "checkpointing": True, "forward_prefetch": 3, **SMALL_BUCKETS,
    }  # fmt: skip
    jobs["checkpointed prefetched fsdp"] = {  # flat: the gathers after the second backward
        "distributed": "fsdp", "trainers": ["flash"], "cases": THREE_RANK_CASES,
        "checkpointing": True, "forward_prefetch": 3, **SMALL_BUCKETS,
    }  # fmt: skip
    jobs["checkpointed ddp"] = {
        "distributed": "ddp", "trainers": ["flash"], "cases": THREE_RANK_CASES,
        "checkpointing": True, **SMALL_BUCKETS,
    }  # fmt: skip
    jobs.update(textbook_jobs())
    saved = torchrun(tmp_path, jobs, ranks=3)
    check_per_layer_update(
        saved["checkpointed per_layer fsdp"], ["flash"], PER_LAYER_THREE_RANK_CASES
    )
    check_update(saved["checkpointed ddp"], "ddp", ["flash"], THREE_RANK_CASES)
    check_update(saved["checkpointed prefetched fsdp"], "fsdp", ["flash"], THREE_RANK_CASES)
    check_update(saved["prefetched chunk"], "fsdp", ["flash"], THREE_RANK_CASES)
    check_textbook(saved)
    for job in ("per_layer chunk", "per_layer logical"):
        check_per_layer_update(saved[job], ["flash"], PER_LAYER_THREE_RANK_CASES)
    check_per_layer_update(saved["per_layer ddp"], ["dpsgd", "flash"], PER_LAYER_THREE_RANK_CASES)
    for sync in ("chunk", "logical"):
        check_update(saved[sync], "fsdp", ["standard", "flash"], THREE_RANK_CASES)
    for case in THREE_RANK_CASES:
        for name in ("standard", "flash"):
            per_chunk = saved["chunk"][case, name]["grad"]
            assert relative(saved["logical"][case, name]["grad"], per_chunk) < 1e-6, (case, name)
            # and they do differ in when: a shard's gradient after a chunk that is not the last
            assert saved["chunk"][case, name]["synced_after_a_chunk"], (case, name)
            assert not saved["logical"][case, name]["synced_after_a_chunk"], (case, name)


def test_checkpointed_flash_sends_in_one_order_and_keeps_replicas_alike():
    """DDP × 2, flash on checkpointed blocks (tests/parallel/checkpointed_ranks.py): a branch
    only rank 0 takes does not change which parameter each rank's collectives carry (per-layer
    and flat clipping give the gradients of the model without checkpointing), and a step whose
    noise rank 0 adds to the sum followed by one where every replica draws it leaves the
    replicas equal."""
    done = forked_ranks(os.path.join(HERE, "checkpointed_ranks.py"), ranks=2)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["per_layer"] < 1e-6 and found["flat"] < 1e-6, found
    assert found["replicas_apart"] == 0.0, found
