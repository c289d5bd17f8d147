"""What a trainer really holds after two steps on the CPU, by role: the reference the capacity
prediction's exact parts are checked against (one process here, or one rank of a torchrun job
in state_per_rank.py)."""

import math

import torch
from torch.distributed.tensor import DTensor

import models
from dp_cost.hf import models as hf_models
from dp_cost.measure import worker
from dp_cost.measure.config import ExperimentConfig
from dp_cost.parallel.ranks import share


def held_state_bytes(config: ExperimentConfig, rank: int = 0, world_size: int = 1) -> dict:
    """Bytes by role of what the trainer of ``config`` holds after two real steps on this
    rank's share of a global batch (each storage once, in the CUDA allocator's 512-byte
    blocks, as the prediction counts them; FSDP2: this rank's shards)."""
    torch.manual_seed(0)
    if config.model in hf_models.HF_CONFIGS:
        model, _ = hf_models.build_hf_model(
            config.model, use_lora=config.use_lora, lora_rank=config.lora_rank, attention="sdpa"
        )
        loss_fn = hf_models.sequence_classification_loss
        vocab = model.config.vocab_size
        inputs = torch.randint(3, vocab, (config.batch_size, config.seq_len))
        targets = torch.randint(3, (config.batch_size,))
    else:
        model, loss_fn = models.build_model(config.model), None
        inputs = torch.randint(model.config.vocab_size, (config.batch_size, config.seq_len))
        targets = torch.randint(model.config.vocab_size, (config.batch_size, config.seq_len))
    mine = share(config.batch_size, rank, world_size)
    trainer = worker.build_trainer(config, model, loss_fn, lambda name: None)
    for _ in range(2):
        trainer.step(inputs[mine.start : mine.stop], targets[mine.start : mine.stop])
    seen, sizes = set(), {}
    for role, _, tensor in trainer.trainer.memory().tensors:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        blocks = max(1, math.ceil(storage.nbytes() / 512)) * 512
        sizes[role] = sizes.get(role, 0) + blocks
    return sizes
