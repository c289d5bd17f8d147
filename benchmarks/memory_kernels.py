"""Flash's memory-bound kernels of the clipped step, on the operands one 1b step gives them:
the Linear biases' per-sample gradients (token sums of G), the clip factors folded into each
Gram-route Linear's narrower operand, and per-layer clipping's norms of one block's kept
per-sample gradients (each layer's own: a segmented sum of the row norms' partials, timed beside
their plain sum and beside torch.segment_reduce of the same partials). For each (B, T), each
block configuration's ms (the mean of triton.testing.do_bench's repetitions) and the bandwidth
it reached (bytes read and written once).

    python benchmarks/memory_kernels.py --shapes 8x512 8x1024

``--tree DIR`` imports dp_cost from another checkout (e.g. ``git archive <commit> | tar -x -C
DIR``) to time its kernels on the same operands; a tree whose kernels take no warps setting
times only the configurations of its own warps. The first configuration of each list is the
code's own; every result is checked against torch before it is timed.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (tokens, columns, warps) of the token sums; (elements, warps) of the fold. The code's own
# configuration is timed first, then these.
TOKEN_SUM_CONFIGS = [(64, 128, 4), (32, 256, 4), (32, 128, 8), (64, 256, 8), (128, 128, 8)]
FOLD_CONFIGS = [(512, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]


def fold_groups(clipped_gemm, groups, c, tokens: int) -> list:
    """One fold launch per group of operands, as the Linear rule launches them."""
    return [clipped_gemm.fold_clip_factors_many(g, c, [tokens] * len(g)) for g in groups]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8x512", "8x1024"], help="BxT")
    parser.add_argument("--model", default="1b")
    parser.add_argument("--tree", default=REPO_ROOT, help="the checkout to import dp_cost from")
    parser.add_argument("--own_only", action="store_true", help="the code's own configurations")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.tree, "dp_cost", "flash", "kernels", "__init__.py")):
        print(f"memory_kernels.py: --tree {args.tree} holds no dp_cost checkout", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.abspath(args.tree))
    import torch
    import triton.testing

    from dp_cost.flash.kernels import clipped_gemm, weighted_sums
    from dp_cost.flash.kernels.common import block_offsets
    from dp_cost.flash.rules.linear import FOLD_GROUP_BYTES
    from models import CONFIGS, build_model

    if not torch.cuda.is_available():
        print("memory_kernels.py needs a GPU", file=sys.stderr)
        return 2
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes]
        if any(len(s) != 2 for s in shapes):
            raise ValueError
    except ValueError:
        print(
            f"memory_kernels.py: --shapes takes BxT, e.g. 8x512; got {args.shapes}", file=sys.stderr
        )
        return 2
    print(f"card: {torch.cuda.get_device_name()}; dp_cost from {os.path.abspath(args.tree)}")
    if args.model not in CONFIGS:
        print(f"memory_kernels.py: --model must be one of {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    # (in, out, has bias) of every Linear of the model, read off it on the meta device, and
    # (in, out) of those of its first block
    model = build_model(args.model, "meta")
    linears = [
        (m.in_features, m.out_features, m.bias is not None)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    first_block = [
        (m.in_features, m.out_features)
        for m in model.blocks[0].modules()
        if isinstance(m, torch.nn.Linear)
    ]
    # A tree from before the warps settings launches with Triton's default, 4 warps.
    token_sum_warps = getattr(weighted_sums, "TOKEN_SUM_WARPS", None)
    fold_warps = getattr(clipped_gemm, "FOLD_WARPS", None)
    dtype, device = torch.bfloat16, torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    for B, T in shapes:
        gram = [(d, p, bias) for d, p, bias in linears if d * p > T * (d + p)]
        # The token sums: G [B, T, p] of each Gram-route Linear with a bias.
        sources = [
            torch.randn(B, T, p, device=device, dtype=dtype, generator=generator)
            for d, p, bias in gram
            if bias
        ]
        reference = [s.float().sum(1) for s in sources]
        read = sum(s.numel() * s.element_size() for s in sources)
        written = sum(r.numel() * 4 for r in reference)
        token_sum_own = (
            weighted_sums.TOKEN_SUM_TOKENS,
            weighted_sums.TOKEN_SUM_COLUMNS,
            token_sum_warps or 4,
        )
        token_sum_configs = [token_sum_own] + ([] if args.own_only else TOKEN_SUM_CONFIGS)
        for tokens, columns, warps in token_sum_configs:
            if token_sum_warps is None and warps != 4:
                continue  # this tree's kernel cannot take it
            weighted_sums.TOKEN_SUM_TOKENS, weighted_sums.TOKEN_SUM_COLUMNS = tokens, columns
            weighted_sums.TOKEN_SUM_WARPS = warps

            token_sums = functools.partial(weighted_sums.token_sums_many, sources)
            for out, ref in zip(token_sums(), reference, strict=True):
                torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)
            ms = triton.testing.do_bench(token_sums, rep=200)
            print(
                f"({B}, {T}) token sums of {len(sources)} G, {read / 2**30:.2f} GiB: tokens "
                f"{tokens} columns {columns} warps {warps}: {ms:.3f} ms, "
                f"{(read + written) / ms / 1e6:.0f} GB/s"
            )
        weighted_sums.TOKEN_SUM_TOKENS, weighted_sums.TOKEN_SUM_COLUMNS = token_sum_own[:2]
        weighted_sums.TOKEN_SUM_WARPS = token_sum_own[2]
        del sources, reference
        # The fold: each Gram-route Linear's narrower operand [B*T, min(d, p)], launched in
        # groups of FOLD_GROUP_BYTES of operands, as the Linear rule folds them.
        narrows = [
            torch.randn(B * T, min(d, p), device=device, dtype=dtype, generator=generator)
            for d, p, _ in gram
        ]
        groups, group, held = [], [], 0
        for narrow in narrows:
            group.append(narrow)
            held += narrow.numel() * narrow.element_size()
            if held >= FOLD_GROUP_BYTES:
                groups.append(group)
                group, held = [], 0
        groups += [group] if group else []
        c = torch.rand(B, device=device, generator=generator)
        moved = 2 * sum(n.numel() * n.element_size() for n in narrows)
        per_token = c.repeat_interleave(T)[:, None]
        fold_own = (clipped_gemm.FOLD_BLOCK, fold_warps or 4)
        for block, warps in [fold_own] + ([] if args.own_only else FOLD_CONFIGS):
            if fold_warps is None and warps != 4:
                continue  # this tree's kernel cannot take it
            clipped_gemm.FOLD_BLOCK, clipped_gemm.FOLD_WARPS = block, warps

            fold = functools.partial(fold_groups, clipped_gemm, groups, c, T)
            for folded, group in zip(fold(), groups, strict=True):
                for out, narrow in zip(folded, group, strict=True):
                    expected = narrow.float() * per_token
                    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=0)
            ms = triton.testing.do_bench(fold, rep=200)
            print(
                f"({B}, {T}) fold of {len(narrows)} operands in {len(groups)} launches: "
                f"block {block} warps {warps}: {ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s"
            )
        clipped_gemm.FOLD_BLOCK, clipped_gemm.FOLD_WARPS = fold_own
        del narrows, groups
        torch.cuda.empty_cache()
        # Per-layer norms: the kept per-sample gradients [B, p, d] of the first block's
        # product-route Linears (a checkpointed block's per-layer clipping, one call a block).
        kept = [
            torch.randn(B, p, d, device=device, dtype=dtype, generator=generator)
            for d, p in first_block
            if d * p <= T * (d + p)
        ]
        if kept:
            expected = torch.stack([g.float().flatten(1).square().sum(1) for g in kept])
            each = functools.partial(weighted_sums.squared_row_norms_many, kept, True)
            torch.testing.assert_close(each(), expected, rtol=1e-4, atol=0)
            plain = functools.partial(weighted_sums.squared_row_norms_many, kept)
            read = sum(g.numel() * g.element_size() for g in kept)
            sizes = tuple(g[0].numel() for g in kept)
            offsets = block_offsets(device, sizes, weighted_sums.ROW_NORM_BLOCK)
            partials = torch.rand(int(offsets[-1]), B, device=device, generator=generator)
            segmented = functools.partial(
                torch.segment_reduce, partials, "sum", offsets=offsets, axis=0
            )
            for name, run in (
                ("each layer's (segmented sum)", each),
                ("summed over layers (plain sum)", plain),
                ("torch.segment_reduce of the partials alone", segmented),
            ):
                ms = triton.testing.do_bench(run, rep=200)
                print(
                    f"({B}, {T}) norms of {len(kept)} kept per-sample gradients, "
                    f"{read / 2**30:.2f} GiB, {name}: {ms:.3f} ms"
                )
            del kept, partials
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
