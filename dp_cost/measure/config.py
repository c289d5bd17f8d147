"""``ExperimentConfig``: one measured configuration, the settings table (``core.settings``)
written out as a dataclass; its distributed mode as an object (``parallel.mode``); what differs
between two configs' recorded settings (``--resume``'s change check). Torch-free: the plan's
checks build configs before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from dp_cost.core.hf_architectures import default_attention
from dp_cost.core.settings import CONFIG_FIELDS, SETTINGS
from dp_cost.parallel.mode import SingleProcess, distributed_mode

AXES_REQUIRED = ("trainer", "batch_size", "seq_len")  # no default: every config names them


@dataclass
class ExperimentConfig:
    """One measured configuration: one field per row of ``SETTINGS`` (a test keeps the two
    equal: names, order and defaults)."""

    trainer: str
    batch_size: int
    seq_len: int
    max_physical_batch_size: int | None = None
    lora_rank: int = 16
    dtype: str = "float32"
    attention: str = "explicit"
    activation_checkpointing: bool = False
    cuda_graph: bool = False
    model: str = "tiny"
    distributed: str = "none"
    world_size: int = 1
    fsdp_sync: str = "chunk"
    rank_timeout: float = 600.0
    optimizer: str = "sgd"
    lr: float = 1e-4
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    clipping: str = "flat"
    steps: int = 3
    warmup_steps: int = 1
    seed: int = 0
    device: str = "cpu"
    flash_route: str = "auto"
    noise_sampler: str = "opacus"
    trace: bool = True
    trace_gzip: bool | None = None
    breakdown: bool = False
    save_snapshot: bool = False
    host_work: bool = False
    ncu: bool = False
    detailed_memory: bool = False
    use_lora: bool = False
    pretrained: bool = False
    dataset_path: str | None = None
    dataset_size: int = 10000
    poisson: bool = True
    delta: float = 1e-5
    capacity: bool = False
    gpu_memory: list | None = None
    find_max_batch: bool = False
    find_max_seq_len: bool = False
    validate: bool = False
    card: str = "NVIDIA H200"
    epochs: int | None = None
    recommend: bool = False
    model_overrides: dict = field(default_factory=dict)
    default_model: str = "tiny"

    @property
    def physical_batch_size(self) -> int:
        """Per rank: the logical batch's share of one rank unless --max_physical_batch_size."""
        return self.max_physical_batch_size or self.batch_size // self.world_size

    @property
    def default_attention(self) -> str:
        return default_attention(self.model)

    @property
    def distributed_mode(self) -> SingleProcess:
        """The distributed mode as an object (what differs between one process, DDP, FSDP2)."""
        return distributed_mode(self.distributed, self.world_size)

    @property
    def config_dir(self) -> str:
        """``<trainer>_bs<B>_seq<T>`` plus the parts of settings that differ from their
        default."""
        return "".join(part for s in SETTINGS if s.dir_part and (part := s.dir_part(self)))

    def to_dict(self) -> dict:
        """The config as ``result.json`` records it."""
        data = {s.name: getattr(self, s.name) for s in CONFIG_FIELDS if s.recorded}
        data["model_overrides"] = dict(self.model_overrides or {})
        data["physical_batch_size"] = self.physical_batch_size
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ExperimentConfig:
        """The config a ``result.json`` recorded (``to_dict``'s inverse): what is not a field
        (``physical_batch_size``, derived; a setting since removed) is left out, and a setting
        added after the file was written takes its default."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def changed_settings(old: dict, new: dict) -> list[str]:
    """Recorded settings whose value differs between two configs' dicts; a setting added after
    ``old`` was written reads as its default there."""
    defaults = ExperimentConfig(trainer="", batch_size=0, seq_len=0).to_dict()
    return sorted(k for k in new if old.get(k, defaults.get(k)) != new[k])
