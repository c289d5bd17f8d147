"""Which kernel CUDA's scaled_dot_product_attention runs, and what it keeps for the backward,
measured on this card: the table --mode=capacity's attention stand-in is checked against
(dp_cost/capacity/attention.py; tests/capacity/test_attention.py reads the stored output).

For every case of a grid (dtype, head size, mask kind, grouped-query heads, a sequence length
that is or is not a multiple of 16; a few with dropout), on this card:
- ``backend``: torch's own choice (``torch._fused_sdp_choice``, the function
  ``F.scaled_dot_product_attention`` asks), by name;
- ``saved_bytes``: the bytes of the storages the forward saved for the backward beyond its
  inputs (``saved_tensors_hooks``, each storage once);
- ``held_bytes``: what ``torch.cuda.memory_allocated`` grew by over the forward, less the
  output (the same bytes seen by the allocator).

Then, for each Hugging Face model named (its shipped config cut to one decoder layer, random
weights, the toolkit's own inputs: no attention mask, per-row position ids), the arguments its
attention hands to ``F.scaled_dot_product_attention`` in an eager forward: whether a mask is
built, ``is_causal``, ``enable_gqa``; transformers decides that from the data, which a fake
tensor does not have.

Prints one JSON object. Usage: python benchmarks/attention_backends.py [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

PARSER = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
PARSER.add_argument("--out", help="also write the JSON here")
PARSER.add_argument(
    "--models",
    nargs="*",
    default=["meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"],
    help="Hugging Face models whose attention calls are logged",
)

if __name__ == "__main__":  # --help answers before torch is imported
    PARSER.parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

BATCH, HEADS = 2, 8
DTYPES = ("float32", "bfloat16", "float16")
HEAD_SIZES = (64, 128, 192, 256)
MASKS = ("causal", "none", "bool", "float")
KV_GROUPS = (1, 4)  # query heads per key/value head: 1, or grouped-query attention
SEQ_LENS = (1024, 1000)


def grid():
    """Every case, as the keyword arguments of ``case_inputs``: the product above without
    dropout, and a few with it (cuDNN takes dropout only in steps of 1/16)."""
    for dtype, head_size, mask, groups, seq in itertools.product(
        DTYPES, HEAD_SIZES, MASKS, KV_GROUPS, SEQ_LENS
    ):
        yield {"dtype": dtype, "head_size": head_size, "mask": mask, "groups": groups, "seq": seq,
               "dropout": 0.0}  # fmt: skip
    for dtype, mask in itertools.product(("float32", "bfloat16"), ("causal", "none")):
        yield {"dtype": dtype, "head_size": 64, "mask": mask, "groups": 1, "seq": 1024,
               "dropout": 0.1}  # fmt: skip


def case_inputs(dtype, head_size, mask, groups, seq, dropout, device):
    """(query, key, value, attn_mask, is_causal, enable_gqa, dropout_p) of one case; the mask as
    Hugging Face's builds it, [B, 1, T, T], bool (True: attend) or additive."""
    dtype = getattr(torch, dtype)
    make = lambda heads: torch.randn(  # noqa: E731
        BATCH, heads, seq, head_size, device=device, dtype=dtype, requires_grad=True
    )
    query, key, value = make(HEADS), make(HEADS // groups), make(HEADS // groups)
    attend = torch.ones(seq, seq, device=device, dtype=torch.bool).tril()
    attend = attend.expand(BATCH, 1, seq, seq).contiguous()
    attn_mask = None
    if mask == "bool":
        attn_mask = attend
    elif mask == "float":
        attn_mask = torch.zeros(attend.shape, device=device, dtype=dtype)
        attn_mask.masked_fill_(~attend, torch.finfo(dtype).min)
    return query, key, value, attn_mask, mask == "causal", groups > 1, dropout


def saved_and_held(query, key, value, attn_mask, is_causal, enable_gqa, dropout_p):
    """(saved_bytes, held_bytes) of one forward; see the module's docstring."""
    operands = (query, key, value, attn_mask)
    inputs = {t.untyped_storage().data_ptr() for t in operands if t is not None}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in inputs:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            enable_gqa=enable_gqa,
        )  # fmt: skip
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    out.float().sum().backward()  # the backward runs: the case is one a training step can take
    return sum(saved.values()), held


def measure_case(case, device) -> dict:
    inputs = case_inputs(**case, device=device)
    query, key, value, attn_mask, is_causal, enable_gqa, dropout_p = inputs
    row = dict(case)
    try:
        choice = torch._fused_sdp_choice(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            enable_gqa=enable_gqa,
        )  # fmt: skip
        row["backend"] = SDPBackend(choice).name
        row["saved_bytes"], row["held_bytes"] = saved_and_held(*inputs)
    except RuntimeError as error:
        row["error"] = str(error).splitlines()[0][:200]
    return row


class SdpaCalls(TorchFunctionMode):
    """Every F.scaled_dot_product_attention call's mask, is_causal and enable_gqa."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query, key = args[0], args[1]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append(
                {
                    "query": list(query.shape),
                    "key": list(key.shape),
                    "mask": None if mask is None else [list(mask.shape), str(mask.dtype)],
                    "is_causal": bool(kwargs.get("is_causal", False)),
                    "enable_gqa": bool(kwargs.get("enable_gqa", False)),
                }
            )
        return func(*args, **kwargs)


def model_calls(name, device) -> list[dict]:
    """The attention calls of one eager forward of ``name`` (one decoder layer), fp32 and under
    bf16 autocast, at (2, 1024)."""
    from transformers import AutoModelForSequenceClassification

    from dp_cost.hf.models import hf_config, sequence_classification_loss

    config = hf_config(name, attention="sdpa")
    config.num_hidden_layers = 1
    model = AutoModelForSequenceClassification.from_config(config).to(device)
    input_ids = torch.randint(3, 1000, (2, 1024), device=device)
    labels = torch.zeros(2, dtype=torch.long, device=device)
    rows = []
    for autocast in (False, True):
        calls = SdpaCalls()
        with calls, torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            sequence_classification_loss(model, input_ids, labels).sum().backward()
        rows.append({"model": name, "autocast_bf16": autocast, "calls": calls.calls[:1]})
    return rows


def main() -> int:
    args = PARSER.parse_args()
    if not torch.cuda.is_available():
        print("error: this measures a CUDA card; none is available", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    import transformers

    result = {
        "device": torch.cuda.get_device_name(device),
        "capability": list(torch.cuda.get_device_capability(device)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "transformers": transformers.__version__,
        "batch": BATCH,
        "heads": HEADS,
        "cases": [measure_case(case, device) for case in grid()],
        "models": [row for name in args.models for row in model_calls(name, device)],
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
