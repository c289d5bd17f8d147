"""What each ``--mode`` means: its help, whether it measures, and what it does on a machine
without CUDA. Its defaults are the ``modes`` column of the settings table (``core.settings``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    """What ``--mode=<name>`` means: its defaults are the ``modes`` column of ``SETTINGS``; these
    fields say what it does on a machine without CUDA (when the device is not forced to CPU)."""

    name: str
    help: str
    runs: bool = True  # measures (False: renders reports from files)
    # whose defaults apply without CUDA: its shape (model, batches, sequence lengths) replaces
    # the GPU-sized one, given or not (--device cpu keeps a given shape)
    cpu_defaults: str | None = None
    cpu_becomes: bool = False  # ... and the run becomes that mode (name, traces, breakdown)
    cpu_model: str | None = None  # ... or the model it runs without CUDA when none is named
    cpu_message: str = ""
    predicts: bool = False  # predicts on fake tensors: any model, any size, on any machine
    traces: bool = True  # its configs take a torch.profiler trace (unless --no_trace)


MODES = {
    m.name: m
    for m in (
        Mode("test", "CPU, tiny model, every trainer, seconds"),
        Mode(
            "profile",
            "GPU, ~1B-parameter model, torch.profiler traces",
            cpu_defaults="test",
            cpu_becomes=True,
            cpu_message="No CUDA device found: --mode=profile runs the CPU test defaults instead",
        ),
        Mode(
            "memory",
            "where the peak goes: breakdown on, traces off",
            cpu_defaults="test",
            cpu_message="No CUDA device found: the memory breakdown needs one; running the CPU "
            "test defaults instead (breakdown fields are null)",
            traces=False,
        ),
        Mode(
            "hf",
            "Hugging Face Llama sequence classifier (LoRA, Poisson sampling, epsilon)",
            cpu_model="tiny-llama",
            cpu_message="No CUDA device found: --mode=hf runs on the CPU with {model}, "
            "with the hf mode's defaults.",
        ),
        Mode(
            "hf_sweep",
            "seq x batch x physical x LoRA rank sweep of a Hugging Face model",
            cpu_model="tiny-llama",
            cpu_message="No CUDA device found: --mode=hf_sweep runs on the CPU with {model}.",
            traces=False,
        ),
        Mode(
            "capacity",
            "predict each trainer's peak memory without a GPU and the largest physical batch "
            "that fits --gpu_memory",
            predicts=True,
            traces=False,
        ),
        Mode(
            "report",
            "re-render the summary of --input_dir from its result files",
            runs=False,
            traces=False,
        ),  # fmt: skip
        Mode(
            "ncu_report",
            "summarise the Nsight Compute reports in --input_dir",
            runs=False,
            traces=False,
        ),  # fmt: skip
    )
}
RUN_MODES = tuple(name for name, mode in MODES.items() if mode.runs)
