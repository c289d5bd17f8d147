"""How far one sample's clipped contribution reaches past C, per DP trainer and dtype, on the
stress shapes of tests/test_dp_fidelity.py (long sequence, wide layers, large vocabulary, two
seeds each): the largest ||released gradient of one sample|| / C, against the trainer's
sensitivity margin (the accountant's sensitivity is (1 + margin) C). Then, why the Opacus
trainers take their norms in fp64 on the CPU: torch's fp32 norm of one N(0, 1) row of n
elements on the device, relative to fp64's, against the trainers' per_sample_norms.

    python benchmarks/clip_sensitivity.py --device cuda
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    sys.path[:0] = [REPO_ROOT, os.path.join(REPO_ROOT, "tests")]
    import torch
    from test_dp_fidelity import STRESS, contribution_over_bound

    if args.device == "cuda":
        print(f"card: {torch.cuda.get_device_name()}")
    print(f"{'trainer':8s} {'dtype':9s} {'largest / C - 1':>16s} {'margin':>10s}")
    for name in ("dpsgd", "ghost", "flash"):
        for dtype in (torch.float32, torch.bfloat16):
            ratios, margin = [], 0.0
            for config, seq in STRESS.values():
                for seed in range(2):
                    ratio, margin = contribution_over_bound(
                        name, config, seq, dtype, seed, args.device
                    )
                    ratios.append(ratio)
            print(f"{name:8s} {str(dtype)[6:]:9s} {max(ratios) - 1:16.2e} {margin:10.2e}")
    from dp_cost.training.opacus_trainers import per_sample_norms

    print(f"\n{'row elements':>12s} {'torch norm / fp64 - 1':>22s} {'per_sample_norms':>17s}")
    torch.manual_seed(0)
    for elements in (10**6, 10**7, 6 * 10**7):
        row = torch.randn(1, elements, device=args.device)
        exact = row.double().norm()
        plain = (row.norm(dim=1).double() / exact - 1).item()
        ours = (per_sample_norms(row).double() / exact - 1).item()
        print(f"{elements:12.0e} {plain:22.2e} {ours:17.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
