"""What a config trains on: the model, its per-sample loss and where each batch comes from."""

from __future__ import annotations

import functools

import torch

from dp_cost.core.hf_architectures import HF_CONFIGS
from dp_cost.hf import data as hf_data
from dp_cost.hf import models as hf_models
from dp_cost.hf import privacy
from dp_cost.lm import model as models
from dp_cost.parallel.mode import distributed_mode
from dp_cost.parallel.ranks import share


def builds_shards_only(config) -> bool:
    """Whether the model is built with its parameters on the meta device and each rank
    materializes only its FSDP2 shards: a Hugging Face model of random weights under FSDP2 (no
    rank ever holds the whole model; a pretrained one is loaded whole)."""
    shards = distributed_mode(config.distributed).shards
    return config.model in HF_CONFIGS and shards and not config.pretrained


class Workload:
    """The causal LM trains on one fixed synthetic batch of tokens (inputs and next-token
    targets); a Hugging Face classifier on a synthetic (or local) SNLI-shaped dataset, with
    Poisson sampling of each logical batch unless disabled. ``on_phase`` gets the phase names
    ``0_model_loaded`` (and ``dataset_prepared``); ``env`` gains what was built."""

    def __init__(
        self, config, device: torch.device, on_phase, env: dict, rank: int = 0, world_size: int = 1
    ):
        self.config, self.device = config, device
        # Distributed: every rank draws the same global batch and keeps its own share of it.
        self.rank, self.world_size = rank, world_size
        self.draws: list[int] = []  # the global size of every batch handed out, in order
        generator = torch.Generator().manual_seed(config.seed)
        # Set by a model whose FSDP2 shards each rank materializes (make_trainer calls it once
        # the model is sharded); None: the model is built whole, here.
        self.materialize = None
        if config.model in HF_CONFIGS:
            empty = builds_shards_only(config)
            self.model, env["model_info"] = hf_models.build_hf_model(
                config.model,
                device=device,
                use_lora=config.use_lora,
                lora_rank=config.lora_rank,
                pretrained=config.pretrained,
                attention="explicit" if config.attention == "explicit" else "sdpa",
                seed=config.seed,
                empty_weights=empty,
                activation_checkpointing=config.activation_checkpointing,
            )
            if empty:
                self.materialize = functools.partial(
                    hf_models.materialize_shards, device=device, seed=config.seed
                )
            on_phase("0_model_loaded")
            vocab = self.model.config.vocab_size
            if config.dataset_path:
                self.inputs, self.labels = hf_data.load_snli(
                    config.dataset_path, config.seq_len, vocab
                )
            else:
                self.inputs, self.labels = hf_data.synthetic_snli(
                    config.dataset_size, config.seq_len, vocab, config.seed
                )
            on_phase("dataset_prepared")
            self.loss_fn = hf_models.sequence_classification_loss
            self.sample_rate = config.batch_size / len(self.inputs)
            self.generator = generator
        else:
            self.model = models.build_model(
                config.model,
                device=device,
                attention=config.attention,
                activation_checkpointing=config.activation_checkpointing,
                **config.model_overrides,
            )
            on_phase("0_model_loaded")
            tokens = torch.randint(
                self.model.config.vocab_size,
                (config.batch_size, config.seq_len + 1),
                generator=generator,
            ).to(device)
            self.inputs, self.labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            self.loss_fn = None  # the trainers' default: mean token cross-entropy
            self.sample_rate = None
        env["parameters"] = models.count_parameters(self.model)

    def host_dataset(self) -> list[torch.Tensor]:
        """The dataset batches are drawn from, when it is a host-side table apart from the
        batches (HF): not part of a training step's memory."""
        return [self.inputs, self.labels] if self.sample_rate is not None else []

    def batch(self):
        """The next logical batch (inputs, targets) on the device: this rank's share of it."""
        inputs, labels = self._global_batch()
        self.draws.append(len(inputs))
        if self.world_size == 1:
            return inputs, labels
        mine = share(len(inputs), self.rank, self.world_size)
        return inputs[mine.start : mine.stop], labels[mine.start : mine.stop]

    def _global_batch(self):
        if self.sample_rate is None:
            return self.inputs, self.labels
        if self.config.poisson:
            # Possibly empty (probability (1-q)^N): the trainers take that step too, as the
            # accountant assumes.
            index = privacy.poisson_batch(len(self.inputs), self.sample_rate, self.generator)
        else:
            index = torch.randperm(len(self.inputs), generator=self.generator)[
                : self.config.batch_size
            ]
        return self.inputs[index].to(self.device), self.labels[index].to(self.device)
