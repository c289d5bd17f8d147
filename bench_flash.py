"""Flash Clipping benchmarks: per-layer norm work against its floor, and whole steps against goals.

    python bench_flash.py kernels [--dtype bfloat16] [--output_dir DIR]   # GPU
    python bench_flash.py steps [--dtypes float32 bfloat16] [--hf | --hf_only] [--cuda_graph]
        [--trainers standard flash]

``kernels``: for each Linear shape of the ``1b`` model at the step goals' (B, T), each norm
route's time (gram, direct, product) next to its floor, max(FLOPs / GEMM rate, bytes / copy
bandwidth), both rates measured in the same run. ``steps``: the step goals (flash / standard time
and peak, speed against Opacus' ghost clipping and hooks), every config in its own worker through
the toolkit's one path (``measure.processes.run_configs``); ``--hf`` adds the LoRA configs
(``HF_STEPS``, random weights, Poisson-sampled batches: the same ``--hf_steps`` seeded draws for
every trainer, compared by their mean time, so by their total); a traced step after the timed
ones gives each trainer's host time and GPU-busy fraction. Misses say by how much. Results:
``<output_dir>/<run>/bench_*.md`` and ``.json``, beside the configs' result files.
"""

from __future__ import annotations  # noqa: I001

import argparse
import dataclasses
import os
import sys
import time


TRAINERS = ("standard", "flash", "ghost", "dpsgd")
HF_DRAWS = 30  # timed Poisson draws per LoRA config (--hf_steps)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("kernels", "steps"))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    dtypes = ("float32", "bfloat16")
    parser.add_argument("--dtypes", nargs="+", choices=dtypes, default=list(dtypes))
    shapes_help = "(batch, seq) pairs, e.g. 8x512 2x4096 (default: the goals' shapes)"
    parser.add_argument("--shapes", nargs="+", metavar="BxT", help=shapes_help)
    parser.add_argument(
        "--hf",
        nargs="*",
        default=None,
        metavar="NAME",
        help="steps: add the Hugging Face LoRA configs (HF_STEPS; with NAMEs, those whose model "
        "name contains one, e.g. --hf 3B)",
    )
    parser.add_argument("--hf_only", action="store_true", help="steps: the LoRA configs alone")
    graph_help = "steps: standard and flash also as CUDA graphs (the goals take flash's graph)"
    parser.add_argument("--cuda_graph", action="store_true", help=graph_help)
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument("--steps", type=int, default=3)
    hf_steps_help = "steps: timed Poisson draws per LoRA config, the same for every trainer"
    parser.add_argument("--hf_steps", type=int, default=HF_DRAWS, help=hf_steps_help)
    parser.add_argument("--warmup_steps", type=int, default=2)
    parser.add_argument("--output_dir", default="./runs")
    parser.add_argument("--run_name", default=None)
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and argument mistakes answer before torch is imported


import torch  # noqa: E402

import models  # noqa: E402
from dp_cost.core.files import atomic_write, write_json  # noqa: E402
from dp_cost.core.hf_architectures import default_attention  # noqa: E402
from dp_cost.flash import engine as flash_clip  # noqa: E402
from dp_cost.flash.clip import ClipFactors, accumulate_weighted_sums  # noqa: E402
from dp_cost.flash.rules.linear import direct_squared_norms, gram_squared_norms, linear_route  # noqa: E402
from dp_cost.measure import processes  # noqa: E402
from dp_cost.measure.config import ExperimentConfig  # noqa: E402
from dp_cost.report import step_goals  # noqa: E402
from dp_cost.report import summary as report  # noqa: E402

# The 1b shapes the step goals are set for (report.step_goals); the attention each dtype is
# benchmarked with.
STEP_SHAPES = tuple(step_goals.STEP_GOALS)
ATTENTION = {"float32": "explicit", "bfloat16": "sdpa"}
BF16_ONLY = {(1, 16384)}  # explicit fp32 attention cannot hold B*H*T^2 probabilities there
# Hugging Face LoRA configs: (model, LoRA rank, seq, batch, physical batch, dtypes).
HF_STEPS = (
    ("meta-llama/Llama-3.2-3B-Instruct", 32, 256, 16, 2, ("float32", "bfloat16")),
    ("meta-llama/Llama-3.1-8B-Instruct", 16, 512, 16, 4, ("bfloat16",)),
)
# The routes flash runs (gram and direct: the fused Triton kernels on CUDA in 16-bit), and the
# torch paths they replaced, measured beside them.
ROUTES_MEASURED = ("gram", "gram_torch", "direct", "direct_torch", "product")


def bench_config(trainer: str, **settings) -> ExperimentConfig:
    """One step config of the bench: every trainer's steps are followed by an untimed traced
    step (host time and GPU-busy fraction), its trace left uncompressed."""
    return ExperimentConfig(
        trainer=trainer, default_model="1b", trace=True, trace_gzip=False, **settings
    )


def with_graphs(configs: list[ExperimentConfig]) -> list[ExperimentConfig]:
    """``configs`` and, after each of a graphed trainer's (step_goals.GRAPHED), the same with its
    steps replayed as CUDA graphs."""
    out = []
    for config in configs:
        out.append(config)
        if config.trainer in step_goals.GRAPHED:
            out.append(dataclasses.replace(config, cuda_graph=True))
    return out


def step_configs(
    dtypes, steps: int, warmup_steps: int, shapes=None, trainers=TRAINERS
) -> list[ExperimentConfig]:
    return [
        bench_config(
            trainer,
            batch_size=batch,
            seq_len=seq,
            model="1b",
            dtype=dtype,
            attention=ATTENTION[dtype],
            steps=steps,
            warmup_steps=warmup_steps,
            device="cuda",
        )
        for dtype in dtypes
        for batch, seq in shapes or STEP_SHAPES
        if not (dtype == "float32" and (batch, seq) in BF16_ONLY)
        for trainer in trainers
    ]


def hf_step_configs(
    steps: int,
    warmup_steps: int,
    specs=HF_STEPS,
    device: str = "cuda",
    dtypes=None,
    trainers=TRAINERS,
) -> list[ExperimentConfig]:
    """The LoRA configs of ``specs`` (in ``dtypes``) per trainer, as ``--mode=hf`` builds them,
    Poisson sampling on (as DP training runs): every trainer's config has the same seed, so the
    same draws."""
    return [
        bench_config(
            trainer,
            batch_size=batch,
            seq_len=seq,
            max_physical_batch_size=physical,
            model=model,
            use_lora=True,
            lora_rank=rank,
            poisson=True,
            lr=1e-5,
            dtype=dtype,
            attention=default_attention(model),
            steps=steps,
            warmup_steps=warmup_steps,
            device=device,
        )
        for model, rank, seq, batch, physical, spec_dtypes in specs
        for dtype in spec_dtypes
        if dtypes is None or dtype in dtypes
        for trainer in trainers
    ]


# ---------------------------------------------------------------- kernel level


def _time_ms(fn, *args, repeats: int = 3) -> float:
    """Median CUDA-event time of ``fn(*args)`` after one warm-up call."""
    fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def card_rates(dtype: torch.dtype) -> dict:
    """The card's dense GEMM rate (FLOP/s) in ``dtype`` and its device-to-device copy bandwidth
    (bytes/s, read + write), measured now: the floors are relative to this card, this run."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    gemm_ms = _time_ms(torch.matmul, a, b)
    src = torch.empty(2**28, device="cuda", dtype=torch.uint8)  # 256 MiB: far beyond L2
    dst = torch.empty_like(src)
    copy_ms = _time_ms(dst.copy_, src)
    return {
        "gemm_flops": 2 * n**3 / (gemm_ms / 1e3),
        "copy_bytes_per_s": 2 * src.numel() / (copy_ms / 1e3),
    }


def route_costs(B: int, T: int, d: int, p: int, elem: int) -> dict[str, tuple]:
    """(FLOPs, bytes) each route must at least do per layer call: its floor on any tiling.

    gram: the lower triangles of A A^T and G G^T (T^2 (d+p) FLOPs per sample, symmetric) plus the
    clipped GEMM (2BTdp, the weight gradient's own FLOPs), A and G read once for each; direct:
    G_b^T A_b (2BTdp) plus the clipped GEMM, A and G read twice; product: G_b^T A_b only (it
    replaces the weight gradient), A and G read once, B*d*p written and read twice.
    """
    ag_bytes = B * T * (d + p) * elem
    weight_grad_flops = 2 * B * T * d * p
    return {
        "gram": (B * T * T * (d + p) + weight_grad_flops, 2 * ag_bytes),
        "direct": (2 * weight_grad_flops, 2 * ag_bytes),
        "product": (weight_grad_flops, ag_bytes + 3 * B * d * p * elem),
    }


def run_route(layer, A, G, c, route: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's squared norms [B] and clipped weight gradient by ``route``, as a step does."""
    rule, c = layer.rule, ClipFactors(c)  # a step makes one per chunk
    if route == "gram_torch":  # the torch Gram path, then the same clipped GEMM
        norms = gram_squared_norms(A, G, layer.tile_size, fused=False)
        return norms, rule.clipped_grads(layer, A, G, c)["weight"]
    if route == "direct_torch":  # the torch direct path (blocks through HBM), same clipped GEMM
        norms = direct_squared_norms(A, G, layer.block_numel, fused=False)
        return norms, rule.clipped_grads(layer, A, G, c)["weight"]
    if route == "product":
        grads = rule.per_sample_grads(layer, A, G, {"weight"})["weight"]
        norms = torch.linalg.vector_norm(grads.flatten(1), dim=1, dtype=torch.float32).square()
        weight = layer.params["weight"]
        weight.grad = None
        accumulate_weighted_sums([weight], [grads], c)
        return norms, weight.grad
    layer.route = route
    return rule.squared_norms(layer, A, G), rule.clipped_grads(layer, A, G, c)["weight"]


def shape_rows(B: int, T: int, d: int, p: int, dtype: torch.dtype, rates: dict) -> list[dict]:
    """Each route's time on random A [B, T, d] and G [B, T, p] against its floor."""
    module = torch.nn.Linear(d, p, bias=False, device="cuda")
    layer = flash_clip.Layer(
        f"{d}x{p}", module, flash_clip.NORM_RULES[torch.nn.Linear], {"weight": module.weight}
    )
    A = torch.randn(B, T, d, device="cuda", dtype=dtype)
    G = torch.randn(B, T, p, device="cuda", dtype=dtype)
    clip_factors = torch.rand(B, device="cuda")
    costs = route_costs(B, T, d, p, A.element_size())
    auto = linear_route(layer, T)
    rows = []
    for route in ROUTES_MEASURED:
        try:
            ms = _time_ms(run_route, layer, A, G, clip_factors, route)
        except torch.OutOfMemoryError:
            ms = None
        torch.cuda.empty_cache()
        flops, moved = costs[route.removesuffix("_torch")]
        floor_ms = 1e3 * max(flops / rates["gemm_flops"], moved / rates["copy_bytes_per_s"])
        rows.append(
            {
                "batch": B,
                "seq": T,
                "d": d,
                "p": p,
                "route": route,
                "auto": route == auto,  # what flash runs for this layer
                "ms": ms,
                "floor_ms": floor_ms,
                "x_floor": None if ms is None else ms / floor_ms,
                # the model's own weight-gradient GEMM: what standard pays for this layer
                "weight_grad_ms": 1e3 * 2 * B * T * d * p / rates["gemm_flops"],
            }
        )
    return rows


def kernel_rows(dtype: torch.dtype, shapes=None) -> tuple[list[dict], dict]:
    rates = card_rates(dtype)
    linear_shapes = sorted(
        {
            (m.in_features, m.out_features)
            for m in models.build_model("1b", "meta").modules()
            if isinstance(m, torch.nn.Linear)
        }
    )
    rows = []
    for B, T in shapes or STEP_SHAPES:
        for d, p in linear_shapes:
            rows += shape_rows(B, T, d, p, dtype, rates)
    return rows, rates


def format_kernel_table(rows: list[dict]) -> str:
    lines = [
        "| B | T | d x p | route | auto | ms | floor ms | x floor | weight-grad GEMM floor ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = "OOM" if r["ms"] is None else f"{r['ms']:.3f}"
        x = "-" if r["x_floor"] is None else f"{r['x_floor']:.1f}"
        lines.append(
            f"| {r['batch']} | {r['seq']} | {r['d']}x{r['p']} | {r['route']} | "
            f"{'yes' if r['auto'] else ''} | {ms} | {r['floor_ms']:.3f} | {x} | "
            f"{r['weight_grad_ms']:.3f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def step_plan(args, shapes) -> list[ExperimentConfig]:
    counts = (args.steps, args.warmup_steps)
    configs = [] if args.hf_only else step_configs(args.dtypes, *counts, shapes, args.trainers)
    if args.hf is not None or args.hf_only:
        specs = [spec for spec in HF_STEPS if any(name in spec[0] for name in args.hf or [""])]
        hf_counts = (args.hf_steps, args.warmup_steps)
        configs += hf_step_configs(*hf_counts, specs, dtypes=args.dtypes, trainers=args.trainers)
    return with_graphs(configs) if args.cuda_graph else configs


def parse_shapes(words: list[str] | None) -> list[tuple[int, int]] | None:
    """--shapes' BxT words as (batch, seq) pairs (None when not given); ValueError if one is
    not a pair of positive numbers."""
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in words or []] or None
    if shapes and any(len(s) != 2 or min(s) <= 0 for s in shapes):
        raise ValueError
    return shapes


def kernels_report(dtype_name: str, shapes, card: str) -> tuple[str, str, str, dict]:
    """(file name, header, table, JSON payload) of the norm routes per Linear shape."""
    rows, rates = kernel_rows(getattr(torch, dtype_name), shapes)
    header = (
        f"# Flash norm routes per Linear shape of 1b, {dtype_name}, {card}\n\n"
        f"Measured now: GEMM {rates['gemm_flops'] / 1e12:.0f} TFLOP/s, "
        f"copy {rates['copy_bytes_per_s'] / 1e9:.0f} GB/s (read + write).\n\n"
    )
    payload = {"card": card, "dtype": dtype_name, "rates": rates, "rows": rows}
    return f"bench_kernels_{dtype_name}", header, format_kernel_table(rows), payload


def steps_report(configs: list[ExperimentConfig], run_dir: str, card: str):
    """(file name, header, table, JSON payload) of the step goals, the configs run into
    ``run_dir`` (and summarised there)."""
    # Steps run in forked workers: this process must not have touched CUDA beyond the check.
    results = processes.run_configs(configs, run_dir)
    rows = step_goals.step_rows(results)
    header = (
        f"# Flash Clipping step goals, {card}\n\nHost time and GPU busy: one step after "
        "the timed ones, traced for CUDA activity alone (host: the step's first CUDA call to "
        "the end of its last kernel launch).\n\n"
    )
    report.write_summary(run_dir, results)
    return "bench_steps", header, step_goals.format_step_table(rows), {"card": card, "rows": rows}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError:
        print(f"error: --shapes takes BxT pairs like 8x512, got {args.shapes}", file=sys.stderr)
        return 2
    configs = step_plan(args, shapes) if args.what == "steps" else []
    if args.what == "steps" and not configs:
        wanted = f"--hf {' '.join(args.hf or [])} --dtypes {' '.join(args.dtypes)}"
        print(f"error: no LoRA config (HF_STEPS) matches {wanted}", file=sys.stderr)
        return 2
    device = processes.probe_device()  # in a child: step workers fork from this process
    if not device["cuda"]:
        print("error: bench_flash.py needs a CUDA GPU (CPU checks: pytest)", file=sys.stderr)
        return 1
    card = device["name"]
    run_name = args.run_name or f"bench_flash_{time.strftime('%Y%m%d_%H%M%S')}"
    run_dir = os.path.join(args.output_dir, run_name)
    os.makedirs(run_dir, exist_ok=True)
    if args.what == "kernels":
        name, header, table, payload = kernels_report(args.dtype, shapes, card)
    else:
        name, header, table, payload = steps_report(configs, run_dir, card)
    with atomic_write(os.path.join(run_dir, name + ".md")) as f:
        f.write(header + table + "\n")
    write_json(os.path.join(run_dir, name + ".json"), payload)
    print(header + table)
    print(f"\nWritten: {os.path.join(run_dir, name)}.md, .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
