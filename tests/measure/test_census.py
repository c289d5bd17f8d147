"""The module-group census and phase costs (module_memory.py) on CPU: the group table by name,
the census against bytes counted directly (tiny Llama with LoRA, every trainer), its effect on the
measured peak, and phase costs against hand-computed values."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/huggingface_hub read it at import
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("peft")

from dp_cost.core import schema  # noqa: E402
from dp_cost.hf import data as hf_data  # noqa: E402
from dp_cost.hf import models as hf_models  # noqa: E402
from dp_cost.measure import census as module_memory  # noqa: E402
from dp_cost.measure import phases  # noqa: E402
from trainers import make_trainer  # noqa: E402

VOCAB = hf_models.HF_CONFIGS["tiny-llama"]["vocab_size"]


@pytest.mark.parametrize(
    "name, group",
    [
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", "lora"),
        ("base_model.model.model.layers.0.mlp.down_proj.lora_B.default", "lora"),
        ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "attention"),
        ("_module.model.layers.3.self_attn.o_proj.weight", "attention"),
        ("model.layers.0.mlp.gate_proj.weight", "mlp"),
        ("model.layers.0.post_attention_layernorm.weight", "norm"),
        ("model.layers.0.input_layernorm", "norm"),
        ("model.norm.weight", "norm"),
        ("model.embed_tokens.weight", "embedding"),
        ("base_model.model.score.modules_to_save.default.weight", "classifier_head"),
        ("score.weight", "classifier_head"),
        # The toolkit's own LM (models.py) maps too.
        ("blocks.0.attn.qkv.weight", "attention"),
        ("blocks.0.mlp.fc1.bias", "mlp"),
        ("blocks.1.ln2.weight", "norm"),
        ("ln_f.bias", "norm"),
        ("tok_emb.weight", "embedding"),
        ("pos_emb.weight", "embedding"),
        ("lm_head.weight", "classifier_head"),
        ("model.rotary_emb", None),
        ("model.layers.0", None),
    ],
)
def test_module_group_table(name, group):
    assert schema.module_group(name) == group


def tiny_lora_trainer(name, physical=3):
    """(model, trainer, reference parameter bytes taken before the trainer wrapped the model:
    flash turns requires_grad off on the parameters it manages)."""
    torch.manual_seed(0)
    model, _ = hf_models.build_hf_model("tiny-llama", use_lora=True, lora_rank=4)
    reference = reference_parameter_bytes(model)
    trainer = make_trainer(
        name,
        model,
        lr=0.1,
        batch_size=6,
        max_physical_batch_size=physical,
        loss_fn=hf_models.sequence_classification_loss,
    )
    return model, trainer, reference


def reference_parameter_bytes(model, only=None):
    """(all, trainable) bytes per group, found by module type, not by name patterns; ``only``:
    count just the parameters whose id is in it."""
    from peft.tuners.lora import LoraLayer
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

    def nbytes(params):
        return sum(p.numel() * p.element_size() for p in params if only is None or id(p) in only)

    lora = {id(p) for m in model.modules() if isinstance(m, LoraLayer) for p in
            [*m.lora_A.parameters(), *m.lora_B.parameters()]}  # fmt: skip
    owners = {
        "attention": [m for m in model.modules() if isinstance(m, LlamaAttention)],
        "mlp": [m for m in model.modules() if isinstance(m, LlamaMLP)],
        "norm": [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)],
        "embedding": [m for m in model.modules() if isinstance(m, torch.nn.Embedding)],
        "classifier_head": [model.base_model.model.score],
    }
    total, trainable = {}, {}
    for group, modules in owners.items():
        params = [p for m in modules for p in m.parameters() if id(p) not in lora]
        total[group] = nbytes(params)
        trainable[group] = nbytes(p for p in params if p.requires_grad)
    lora_params = [p for p in model.parameters() if id(p) in lora]
    total["lora"] = trainable["lora"] = nbytes(lora_params)
    assert sum(total.values()) == nbytes(model.parameters())  # every parameter has a group
    return total, trainable


def flash_keeps_per_sample(model, seq_len, trained):
    """Parameters whose per-sample grads flash keeps, by its rule (not by running it): Linears
    with d*p <= T*(d+p), every Linear's bias, and norm layers; ``trained``: ids of the
    optimizer's parameters (flash turns requires_grad off on what it manages)."""
    kept = set()
    for m in model.modules():
        linear = isinstance(m, torch.nn.Linear)
        if (linear and m.in_features * m.out_features <= seq_len * (m.in_features + m.out_features)
                or isinstance(m, torch.nn.RMSNorm)):  # fmt: skip
            kept |= {id(p) for p in m.parameters(recurse=False) if id(p) in trained}
        elif linear and m.bias is not None and id(m.bias) in trained:
            kept.add(id(m.bias))
    return kept


def census_of_one_step(trainer, seq_len=12, seed=1):
    inputs, labels = hf_data.synthetic_snli(6, seq_len, VOCAB, seed=seed)
    trainer.step(inputs, labels)  # warm-up: optimizer state and Opacus' buffers exist
    census = module_memory.ModuleCensus(trainer)
    with census.observing():
        trainer.step(inputs, labels)
    assert census.steps_observed == 1
    return census.result()


def mb_to_bytes(value):
    return round(value * schema.MB)


# trainer -> (gradient copies after the step, per-sample gradients per chunk sample; flash keeps
# them for some layers only, checked separately)
EXPECTED_STATE = {"standard": (1, 0), "dpsgd": (2, 1), "flash": (1, 0)}


@pytest.mark.parametrize("name", sorted(EXPECTED_STATE))
def test_census_parameters_gradients_and_per_sample_state_against_direct_counts(name):
    model, trainer, (total, trainable) = tiny_lora_trainer(name, physical=3)  # chunks of 3, 3
    result = census_of_one_step(trainer)
    if name == "flash":  # seen at its _clip_inputs_saved event: one chunk's kept grads
        trained = {id(p) for p in trainer.trainer.parameters}
        kept = reference_parameter_bytes(model, only=flash_keeps_per_sample(model, 12, trained))
        kept = kept[0]  # (all bytes of the kept parameters; they are trained ones)
        assert sum(kept.values()) > 0  # the classifier head (d x 3) keeps them at T=12
    groups = result["groups"]
    copies, per_sample = EXPECTED_STATE[name]
    for group in total:
        assert mb_to_bytes(groups[group]["parameters_mb"]) == total[group], group
        assert mb_to_bytes(groups[group]["trainable_parameters_mb"]) == trainable[group], group
        # Opacus after the step: p.grad and its accumulated summed_grad, one of each.
        assert mb_to_bytes(groups[group]["gradients_mb"]) == copies * trainable[group], group
        # One chunk's per-sample gradients at its backward_done: 3 x the trainable bytes.
        expected = 3 * (kept[group] if name == "flash" else per_sample * trainable[group])
        assert mb_to_bytes(groups[group]["per_sample_gradients_mb"]) == expected, group
        assert groups[group]["norm_samples_mb"] == 0
    assert result["phase_of"]["norm_samples_mb"] is None  # only ghost keeps norm samples
    # LoRA freezes the base weights: the adapters' inputs are saved (by autograd, or by flash,
    # which turns requires_grad off on what it manages and keeps A itself).
    kept = "dp_saved_tensors_mb" if name == "flash" else "activations_mb"
    assert groups["lora"][kept] > 0 and groups["mlp"]["activations_mb"] > 0
    assert groups["embedding"]["activations_mb"] == 0  # frozen embedding: nothing to save
    if name == "dpsgd":
        assert result["phase_of"]["per_sample_gradients_mb"] == "backward_done"


def test_census_ghost_norm_samples_and_activations_linear_in_sequence_length():
    model, trainer, _ = tiny_lora_trainer("ghost", physical=3)
    groups = census_of_one_step(trainer, seq_len=12)["groups"]
    tensors = {"lora": 0, "classifier_head": 0}
    for name, p in model.named_parameters():
        if p.requires_grad:
            tensors[schema.module_group(name)] += 1
    for group, count in tensors.items():  # _norm_sample: one fp32 per sample and tensor
        assert mb_to_bytes(groups[group]["norm_samples_mb"]) == 3 * 4 * count
        assert groups[group]["per_sample_gradients_mb"] == 0
    longer = census_of_one_step(trainer, seq_len=24)["groups"]
    for group in ("mlp", "norm", "lora"):  # per-token work: bytes double with T
        assert longer[group]["activations_mb"] == pytest.approx(
            2 * groups[group]["activations_mb"], rel=0.05
        )


def test_census_leaves_the_measured_peak_unchanged():
    _, trainer, _ = tiny_lora_trainer("dpsgd", physical=3)
    inputs, labels = hf_data.synthetic_snli(6, 12, VOCAB, seed=1)
    trainer.step(inputs, labels)
    census = module_memory.ModuleCensus(trainer)

    def observed():
        with census.observing():
            trainer.step(inputs, labels)

    plain = [phases.cpu_step_peak_bytes(lambda: trainer.step(inputs, labels)) for _ in range(2)]
    assert phases.cpu_step_peak_bytes(observed) in range(min(plain), max(plain) + 1)


def test_phase_costs_from_snapshots():
    snap = lambda name, t, peak=None: {
        "name": name,
        "timestamp": t,
        "allocated_mb": peak and peak - 1,
        "phase_peak_mb": peak,
    }
    # Two steps; the first has two physical chunks.
    snapshots = [
        snap("forward_done", 1.0, 10),
        snap("backward_done", 1.5, 30),
        snap("forward_done", 2.0, 12),
        snap("backward_done", 2.25, 20),
        snap("step_done", 2.5, 5),
        snap("forward_done", 11.0, 11),
        snap("backward_done", 12.0, 25),
        snap("step_done", 12.5, 6),
    ]
    costs = module_memory.phase_costs(snapshots, [0.5, 10.0])
    # forward: 0.5+0.5=1.0 s and 1.0 s; backward 0.5+0.25 and 1.0; optimizer 0.25 and 0.5.
    assert costs["forward"]["time_ms"] == pytest.approx(1000.0)
    assert costs["backward"]["time_ms"] == pytest.approx(875.0)
    assert costs["optimizer_step"]["time_ms"] == pytest.approx(375.0)
    assert costs["backward"]["peak_mb"] == 30 and costs["forward"]["peak_mb"] == 12
    assert costs["optimizer_step"]["allocated_after_mb"] == 5
    cpu = module_memory.phase_costs([{**s, "phase_peak_mb": None} for s in snapshots], [0.5, 10.0])
    assert cpu["forward"]["peak_mb"] is None and "not measured on CPU" in cpu["memory_note"]
