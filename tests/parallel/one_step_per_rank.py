"""Run by torchrun (2 ranks, gloo, CPU) from test_distributed_updates.py: one step of every trainer
under DDP or FSDP2 on the slices of one global batch, for each job of a list; rank 0 saves each
trainer's gradient (the full tensors, put together from FSDP2's shards) for the test to compare
with a brute force."""

import argparse
import contextlib
import json
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_trainers import SMALL, make_batch  # noqa: E402
from textbook_dpsgd import TextbookDPSGD  # noqa: E402

import models  # noqa: E402
import trainers  # noqa: E402
from dp_cost.flash import clip as flash_clip  # noqa: E402
from dp_cost.flash import sinks as buckets  # noqa: E402
from dp_cost.parallel import fsdp, ranks  # noqa: E402
from dp_cost.parallel.mode import distributed_mode  # noqa: E402
from dp_cost.training.clipping import merged_record  # noqa: E402
from tests.torchrun_exit import leave_without_teardown  # noqa: E402


def full_gradients(model) -> torch.Tensor:
    grads = []
    for p in model.parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads.append(grad.reshape(-1))
    return torch.cat(grads).double()


def clipping_record(runner) -> dict | None:
    """The trainer's ``clipping`` record (None: not private)."""
    privacy = runner.trainer.privacy
    return privacy.clipping_record() if privacy else None


@contextlib.contextmanager
def counted_noise_draws():
    """A list of the tensor counts of each call flash's noise makes (its CPU path's one draw
    function) while the context is open."""
    draws, draw = [], flash_clip.add_exact64_noise_

    def counted(tensors, *args, **kwargs):
        draws.append(len(tensors))
        return draw(tensors, *args, **kwargs)

    flash_clip.add_exact64_noise_ = counted
    try:
        yield draws
    finally:
        flash_clip.add_exact64_noise_ = draw


def gathering_recorded(runner):
    """A function saying whether the runner's last step gathered per-sample gradients (flash's
    gathered chunk step ran in it); always False for another trainer."""
    steps = []
    inner = getattr(runner.trainer, "gathered_chunk_step", None)
    if inner is not None:

        def recorded(chunk):
            steps.append(runner.steps_taken)
            return inner(chunk)

        runner.trainer.gathered_chunk_step = recorded
    return lambda: bool(steps) and steps[-1] == runner.steps_taken


def sync_recorded(runner, model):
    """A function saying whether, in the runner's last step, the model's parameters had a
    gradient after its first chunk (which must not be the step's last): FSDP2 reduce-scattered
    it then (fsdp_sync "chunk"), or holds it back for the last (fsdp_sync "logical"). Read in
    the step the test checks, on a model without gradients before it."""
    seen = []
    inner = runner.trainer.chunk_step

    def recorded(chunk):
        loss = inner(chunk)
        if not seen:
            assert not chunk.is_last, "probe_sync needs two chunks or more a rank"
            seen.append(any(p.grad is not None for p in model.parameters()))
        return loss

    runner.trainer.chunk_step = recorded
    return lambda: seen[-1]


def every_rank_gradients(model, info) -> list:
    """[(full gradient, gradient pieces)] of every rank, in rank order: each rank's gradient
    tensors (FSDP2: its row shards of each parameter, Shard(0) on one mesh), sent in two tensor
    collectives (an all-gather a parameter, or a pickled all_gather_object, cost a quarter of a
    step's CPU), and the full gradients put together on every rank (the shards concatenated in
    the mesh's rank order, as DTensor.full_tensor does)."""
    pieces, order = [], None
    for p in model.parameters():
        if isinstance(p.grad, DTensor):
            assert p.grad.placements == (Shard(0),) and p.grad.device_mesh.ndim == 1
            order = p.grad.device_mesh.mesh.tolist()
            pieces.append(p.grad.to_local())
        else:
            pieces.append(p.grad)
    rows = torch.tensor([len(piece) for piece in pieces])  # a shard's rows differ by rank
    every_rows = [torch.empty_like(rows) for _ in range(info.world_size)]
    dist.all_gather(every_rows, rows)
    shapes = [
        [(int(n), *p.shape[1:]) for n, p in zip(counts, model.parameters())]
        for counts in every_rows
    ]
    sizes = [[torch.Size(shape).numel() for shape in of_rank] for of_rank in shapes]
    longest = max(sum(of_rank) for of_rank in sizes)
    flat = torch.zeros(longest, dtype=torch.double)  # exact for fp32 and bf16 gradients
    mine = torch.cat([piece.reshape(-1).double() for piece in pieces])
    flat[: len(mine)] = mine
    every_flat = [torch.empty_like(flat) for _ in range(info.world_size)]
    dist.all_gather(every_flat, flat)
    every = [
        [piece.reshape(shape) for piece, shape in zip(f[: sum(n)].split(n), of_rank)]
        for f, n, of_rank in zip(every_flat, sizes, shapes)
    ]
    out = []
    for own_pieces in every:
        grads = []
        for i, p in enumerate(model.parameters()):
            if isinstance(p.grad, DTensor):
                grad = torch.cat([every[r][i] for r in order])
                assert grad.shape == p.shape, (grad.shape, p.shape)
            else:
                grad = own_pieces[i]
            grads.append(grad.reshape(-1))
        out.append((torch.cat(grads), own_pieces))
    return out


def run_job(job: dict, info, max_grad_norm: float, seq: int) -> dict:
    """One job: each trainer's one step on each case. ``job``: distributed, trainers, cases
    ("global_samples,batch_size,physical" each), and optionally noise_multiplier, bucket_bytes
    (flash's bucket size), in_flight_bytes (FSDP2: bytes behind the newest), padded_step (the
    step CUDA graphs replay: padded chunks of P samples, every rank as many), fsdp_sync (FSDP2:
    "chunk" or "logical"), clipping ("flat" or "per_layer"), probe_sync (also record
    synced_after_a_chunk: see sync_recorded), reseed (false: every rank seeded alike before the
    step), local_grads (also save every rank's gradient tensors, a list a rank: FSDP2's
    shards), checkpointing (the model's blocks checkpointed), num_layers (the model's blocks,
    SMALL's by default), forward_prefetch (FSDP2: units of the next chunk's forward flash
    gathers after a chunk's backward)."""
    defaults = buckets.BUCKET_BYTES, buckets.ShardedGradients.IN_FLIGHT_BYTES
    all_reduce_default = buckets.ALL_REDUCE_BUCKET_BYTES
    buckets.BUCKET_BYTES = job.get("bucket_bytes") or defaults[0]
    buckets.ALL_REDUCE_BUCKET_BYTES = job.get("bucket_bytes") or all_reduce_default
    prefetch_default = fsdp.FORWARD_PREFETCH_UNITS
    fsdp.FORWARD_PREFETCH_UNITS = job.get("forward_prefetch", prefetch_default)
    in_flight = job.get("in_flight_bytes")
    buckets.ShardedGradients.IN_FLIGHT_BYTES = defaults[1] if in_flight is None else in_flight
    if "textbook_dpsgd" in job["trainers"] and "textbook_dpsgd" not in trainers.TRAINERS:
        trainers.register_trainer("textbook_dpsgd")(TextbookDPSGD)  # a trainer tests define
    mode = distributed_mode(job["distributed"], info.world_size)
    saved = {"agreed": [mode.on_every_rank(flag, torch.device("cpu"))
                        for flag in (info.rank == 0, True)]}  # fmt: skip
    for case in job["cases"]:
        samples, batch_size, physical = map(int, case.split(","))
        inputs, targets = make_batch(samples, seq, seed=3)
        mine = ranks.share(samples, info.rank, info.world_size)
        local = slice(mine.start, mine.stop)
        for name in job["trainers"]:
            torch.manual_seed(0)
            config = replace(
                SMALL, activation_checkpointing=job.get("checkpointing", False),
                num_layers=job.get("num_layers", SMALL.num_layers),
            )  # fmt: skip
            model = models.build_model(config)
            trainer = trainers.make_trainer(
                name,
                model,
                lr=1.0,
                batch_size=batch_size,
                max_physical_batch_size=physical,
                max_grad_norm=max_grad_norm,
                noise_multiplier=job.get("noise_multiplier", 0.0),
                distributed=job["distributed"],
                fsdp_sync=job.get("fsdp_sync", "chunk"),
                clipping=job.get("clipping", "flat"),
            )
            # each rank its own torch stream, as the CLI's workers; "reseed" false: every rank
            # the same one (a trainer must then keep its ranks' noise apart itself)
            torch.manual_seed(100 + info.rank if job.get("reseed", True) else 100)
            gathered = gathering_recorded(trainer)
            synced = sync_recorded(trainer, model) if job.get("probe_sync") else None
            with counted_noise_draws() as noise_draws:
                if job.get("padded_step"):
                    size = trainer.physical_size()
                    out = trainer.padded_step(inputs[local], targets[local], size)
                else:
                    out = trainer.step(inputs[local], targets[local])
            every = every_rank_gradients(model, info)
            grad = every[0][0]
            records = [None] * info.world_size  # each rank's count of its clipped samples
            if clipping_record(trainer) is not None:  # a private trainer's, on every rank
                dist.all_gather_object(records, clipping_record(trainer))
            if job.get("local_grads"):  # each rank's own gradient tensors (FSDP2: its shards)
                saved[case, name, "local"] = [pieces for _, pieces in every]
            saved[case, name] = {
                "grad": grad,
                "loss": out["loss"],
                # every rank's replica is rank 0's
                "replicas_agree": all(torch.equal(g, grad) for g, _ in every),
                "gathered": gathered(),  # flash: per-sample gradients gathered
                "clipping": merged_record(records) if records[0] else None,
                "noise_draws": noise_draws,  # flash's: the tensors each draw noised
            }
            if synced is not None:
                saved[case, name]["synced_after_a_chunk"] = synced()
    buckets.BUCKET_BYTES, buckets.ShardedGradients.IN_FLIGHT_BYTES = defaults
    buckets.ALL_REDUCE_BUCKET_BYTES = all_reduce_default
    fsdp.FORWARD_PREFETCH_UNITS = prefetch_default
    return saved


def main():
    """Every job of ``--jobs`` (a JSON file: {name: job}) in one process group: one torchrun
    launch (interpreters, imports, the group) for many checks. Saves {name: run_job(...)}."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", required=True, help="JSON file: {name: job} (see run_job)")
    parser.add_argument("--max_grad_norm", type=float, default=0.05)
    parser.add_argument("--seq", type=int, default=12)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.jobs) as f:
        jobs = json.load(f)
    info = ranks.from_environment()
    dist.init_process_group("gloo")
    saved = {name: run_job(job, info, args.max_grad_norm, args.seq) for name, job in jobs.items()}
    if info.rank == 0:
        torch.save(saved, args.out)
    dist.barrier()
    leave_without_teardown()


if __name__ == "__main__":
    main()
