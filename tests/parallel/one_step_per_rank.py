"""Run by torchrun (2 ranks, gloo, CPU) from test_distributed_updates.py: one step of every trainer
under DDP or FSDP2 on the slices of one global batch, for each job of a list; rank 0 saves each
trainer's gradient (the full tensors, gathered from FSDP2's shards) for the test to compare with
a brute force."""

import argparse
import json
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_trainers import SMALL, make_batch  # noqa: E402
from textbook_dpsgd import TextbookDPSGD  # noqa: E402

import models  # noqa: E402
import trainers  # noqa: E402
from dp_cost.flash import sinks as buckets  # noqa: E402
from dp_cost.parallel import ranks  # noqa: E402
from dp_cost.parallel.mode import distributed_mode  # noqa: E402
from dp_cost.stepping.protocol import Chunk, StepPlan  # noqa: E402
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


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def synced_after_a_chunk(name, job, batch_size, physical, max_grad_norm, inputs, targets):
    """Whether a fresh trainer's parameters have a gradient after one chunk that is not the
    logical batch's last: FSDP2 reduce-scattered it then (fsdp_sync "chunk"), or holds it back
    for the last (fsdp_sync "logical")."""
    torch.manual_seed(0)
    model = models.build_model(SMALL)
    trainer = trainers.make_trainer(
        name, model, lr=1.0, batch_size=batch_size, max_physical_batch_size=physical,
        max_grad_norm=max_grad_norm, noise_multiplier=0.0, distributed=job["distributed"],
        fsdp_sync=job.get("fsdp_sync", "chunk"), clipping=job.get("clipping", "flat"),
    )  # fmt: skip
    plan = StepPlan(busiest_batch=len(inputs), chunk_count=2)
    trainer.trainer.start_step(plan)
    trainer.trainer.chunk_step(Chunk(inputs[:physical], targets[:physical], None, False, plan))
    return any(p.grad is not None for p in model.parameters())


def run_job(job: dict, info, max_grad_norm: float, seq: int) -> dict:
    """One job: each trainer's one step on each case. ``job``: distributed, trainers, cases
    ("global_samples,batch_size,physical" each), and optionally noise_multiplier, bucket_bytes
    (flash's bucket size), in_flight_bytes (FSDP2: bytes behind the newest), padded_step (the
    step CUDA graphs replay: padded chunks of P samples, every rank as many), fsdp_sync (FSDP2:
    "chunk" or "logical"), clipping ("flat" or "per_layer"), probe_sync (also record
    synced_after_a_chunk), reseed (false: every rank seeded alike before the step), local_grads
    (also save every rank's local gradient), checkpointing (the model's blocks checkpointed),
    num_layers (the model's blocks, SMALL's by default)."""
    defaults = buckets.BUCKET_BYTES, buckets.ShardedGradients.IN_FLIGHT_BYTES
    buckets.BUCKET_BYTES = job.get("bucket_bytes") or defaults[0]
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
            if job.get("padded_step"):
                size = trainer.physical_size()
                out = trainer.padded_step(inputs[local], targets[local], size)
            else:
                out = trainer.step(inputs[local], targets[local])
            grad = full_gradients(model)
            rank0 = grad.clone()
            dist.broadcast(rank0, 0)
            agree = torch.tensor([float(torch.equal(grad, rank0))])
            dist.all_reduce(agree, op=dist.ReduceOp.MIN)  # every rank's replica is rank 0's
            records = [None] * info.world_size  # each rank's count of its clipped samples
            dist.all_gather_object(records, clipping_record(trainer))
            if job.get("local_grads"):  # each rank's own gradient tensors (FSDP2: its shards)
                own_grad = torch.cat([local_tensor(p.grad).reshape(-1) for p in model.parameters()])
                every_rank = [None] * info.world_size
                dist.all_gather_object(every_rank, own_grad)
                saved[case, name, "local"] = every_rank
            saved[case, name] = {
                "grad": grad,
                "loss": out["loss"],
                "replicas_agree": bool(agree.item()),
                "gathered": gathered(),  # flash: per-sample gradients gathered
                "clipping": merged_record(records) if records[0] else None,
            }
            if job.get("probe_sync"):  # every rank holds a sample: the same collectives
                saved[case, name]["synced_after_a_chunk"] = synced_after_a_chunk(
                    name, job, batch_size, physical, max_grad_norm, inputs[local], targets[local]
                )
    buckets.BUCKET_BYTES, buckets.ShardedGradients.IN_FLIGHT_BYTES = defaults
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
