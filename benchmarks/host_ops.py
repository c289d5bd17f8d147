"""Host cost of the single operations an eager flash step adds to the non-private one, at a tiny
shape where every kernel is shorter than its launch: µs per call, the cases interleaved over
rounds so a slow spell of the host falls on all of them.

    python benchmarks/host_ops.py --rounds 5
"""

from __future__ import annotations  # noqa: I001

import argparse
import statistics
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--features", type=int, default=2048)
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and argument mistakes answer before torch is imported


import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

CALLS = 200  # calls per timing


def per_call_us(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> int:
    args = build_parser().parse_args()
    if not torch.cuda.is_available():
        print("host_ops.py needs a GPU", file=sys.stderr)
        return 2
    d = args.features
    x32 = torch.randn(1, args.tokens, d, device="cuda", requires_grad=True)
    x16 = x32.detach().to(torch.bfloat16).requires_grad_(True)
    trained = nn.Linear(d, d, device="cuda")
    frozen = nn.Linear(d, d, device="cuda").requires_grad_(False)
    hooked = nn.Linear(d, d, device="cuda")
    hooked.register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    hooked.register_forward_hook(lambda m, args, kwargs, out: None, with_kwargs=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    ln_x = torch.randn(1, args.tokens, d, device="cuda")

    def under_autocast(fn):
        def run():
            with autocast:
                fn()

        return run

    def prehook_on_output():
        out = x16 * 2
        out.grad_fn.register_prehook(lambda grads: None)

    from dp_cost.flash.kernels import norm_layer_per_sample_grads

    cases = {
        "F.linear, trained fp32 weight, fp32 input (standard)": under_autocast(
            lambda: F.linear(x32, trained.weight, trained.bias)
        ),
        "F.linear, frozen fp32 weight, bf16 input (flash)": under_autocast(
            lambda: F.linear(x16, frozen.weight, frozen.bias)
        ),
        "F.linear, frozen fp32 weight, fp32 input": under_autocast(
            lambda: F.linear(x32, frozen.weight, frozen.bias)
        ),
        "module call, no hooks": under_autocast(lambda: trained(x32)),
        "module call, empty pre-hook and hook": under_autocast(lambda: hooked(x32)),
        "x.to(bfloat16)": lambda: x32.to(torch.bfloat16),
        "x * 2 and grad_fn.register_prehook": prehook_on_output,
        "x * 2 alone": lambda: x16 * 2,
        "torch.empty(2, 1, 2, d)": lambda: torch.empty(2, 1, 2, d, device="cuda"),
        "norm_layer_per_sample_grads (Triton launch + sum)": lambda: norm_layer_per_sample_grads(
            ln_x, ln_x, 1e-5, False
        ),
        "torch.mm(a.T, b, out_dtype=fp32)": lambda: torch.mm(
            x16[0].detach().T, x16[0].detach(), out_dtype=torch.float32
        ),
    }
    results: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(args.rounds):
        for name, fn in cases.items():
            results[name].append(per_call_us(fn))
    print(f"card: {torch.cuda.get_device_name()}; torch {torch.__version__}; tokens {args.tokens}")
    for name, values in results.items():
        cells = " ".join(f"{v:6.1f}" for v in values)
        print(f"{name:55s} median {statistics.median(values):6.1f} µs  ({cells})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    sys.exit(main())
