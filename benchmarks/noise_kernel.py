"""Flash's fused noise kernel (Gaussian noise drawn and added in one pass) on every trainable
parameter of a model, fp32, against torch's draw-then-add, torch's foreach add of noise drawn
beforehand (the read-and-write floor), and the two draws dpsgd and ghost can take
(--noise_sampler): Opacus' own (_generate_noise, then summed_grad + noise, per tensor) and the
64-bit transform through the same call. Prints each one's ms (the median of
triton.testing.do_bench's repetitions), its ratio to the fused kernel's, and exact64 / opacus.

    python benchmarks/noise_kernel.py --model 1b
    python benchmarks/noise_kernel.py --model 1b --tree /tmp/old   # another checkout's kernel

``--tree DIR`` imports dp_cost from another checkout (``git archive <commit> | tar -x -C DIR``):
its kernel is timed beside this one's on the same tensors.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kernel_from(tree: str, name: str):
    """``add_gaussian_noise_`` of the dp_cost checkout at ``tree`` (a module of its own)."""
    path = os.path.join(tree, "dp_cost", "flash", "kernels", "noise.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.add_gaussian_noise_


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1b")
    parser.add_argument("--tree", help="another checkout whose kernel is timed too")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO_ROOT)
    import torch
    import triton

    from dp_cost.training import opacus_noise
    from models import build_model

    if not torch.cuda.is_available():
        print("noise_kernel.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [p.shape for p in build_model(args.model, "meta").parameters() if p.requires_grad]
    grads = [torch.zeros(shape, device="cuda") for shape in shapes]
    elements = sum(g.numel() for g in grads)
    print(f"card: {torch.cuda.get_device_name()}; {args.model}: {len(grads)} tensors, "
          f"{elements / 1e9:.3f}G fp32 elements")  # fmt: skip
    fused = kernel_from(REPO_ROOT, "noise_here")
    drawn = [torch.randn_like(g) for g in grads]  # the floor's noise, drawn beforehand

    def torch_draw_then_add():
        for g in grads:
            g.add_(torch.randn_like(g), alpha=1e-3)

    timed = {"fused (this tree)": lambda: fused(grads, 1e-3)}
    if args.tree:
        other = kernel_from(os.path.abspath(args.tree), "noise_there")
        timed[f"fused ({args.tree})"] = lambda: other(grads, 1e-3)
    timed["torch randn + add_ per tensor"] = torch_draw_then_add
    timed["foreach add_ of drawn noise (floor)"] = lambda: torch._foreach_add_(grads, drawn)
    exact64 = opacus_noise.Exact64Generator(None)
    for sampler, generator in (("opacus", None), ("exact64", exact64)):
        timed[f"Opacus' add_noise, --noise_sampler {sampler}"] = lambda generator=generator: [
            g + opacus_noise.generate_noise(1e-3, g, generator) for g in grads
        ]
    times = {name: triton.testing.do_bench(fn, rep=300, return_mode="median")
             for name, fn in timed.items()}  # fmt: skip
    reference = times["fused (this tree)"]
    for name, ms in times.items():
        print(f"{name:45s} {ms:8.3f} ms   {ms / reference:5.2f} x this tree's kernel")
    opacus, ours = (times[f"Opacus' add_noise, --noise_sampler {s}"] for s in ("opacus", "exact64"))
    print(f"--noise_sampler exact64 / opacus: {ours / opacus:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
