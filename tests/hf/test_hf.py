"""HF Llama classifiers (hf_models.py): DP updates against a brute-force per-sample reference,
LoRA parameter split, the shipped configs' published sizes, offline behaviour, task and
accounting helpers. CPU only, no network: the Hub is switched off before anything imports it."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/huggingface_hub read it at import
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import copy  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("peft")

from dp_cost.capacity import model_facts  # noqa: E402
from dp_cost.hf import configs as hf_configs  # noqa: E402
from dp_cost.hf import data as hf_data  # noqa: E402
from dp_cost.hf import models as hf_models  # noqa: E402
from dp_cost.hf import privacy  # noqa: E402
from trainers import make_trainer  # noqa: E402

DP_TRAINERS = ["dpsgd", "ghost", "flash"]
TINY = "tiny-llama"
VOCAB = hf_configs.HF_CONFIGS[TINY]["vocab_size"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def tiny_model(use_lora, seed=0):
    torch.manual_seed(seed)
    model, info = hf_models.build_hf_model(TINY, use_lora=use_lora, lora_rank=4, seed=seed)
    if use_lora:  # peft starts lora_B at 0, which makes lora_A's gradient 0: perturb it
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
    return model, info


def test_initial_weights_come_from_the_seed_and_each_parameters_name():
    """Random weights depend on the seed and the parameter's name only: two builds agree, another
    seed differs, LoRA's base weights and the head's trainable copy equal the full build's, by
    HF's and peft's rules (N(0, 0.02) weights, the padding row 0, norms 1, lora_B 0)."""
    full = dict(hf_models.build_hf_model(TINY, seed=3)[0].named_parameters())
    again = dict(hf_models.build_hf_model(TINY, seed=3)[0].named_parameters())
    other = dict(hf_models.build_hf_model(TINY, seed=4)[0].named_parameters())
    assert all(torch.equal(full[n], again[n]) for n in full)
    assert not torch.equal(full["score.weight"], other["score.weight"])
    embedding = full["model.embed_tokens.weight"]
    assert (embedding[hf_configs.PAD_TOKEN_ID] == 0).all()
    assert abs(embedding.std().item() - 0.02) < 0.002
    assert all((p == 1).all() for n, p in full.items() if "norm" in n)
    lora = dict(hf_models.build_hf_model(TINY, seed=3, use_lora=True, lora_rank=4)[0]
                .named_parameters())  # fmt: skip
    for name, value in lora.items():
        if "lora_B" in name:
            assert (value == 0).all()
        elif "lora_A" not in name:
            assert torch.equal(value, full[hf_models.PEFT_NAME_PARTS.sub("", name)]), name


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def reference_update(model, inputs, labels, max_grad_norm):
    """(1/B) sum_b c_b grad_b over the trainable parameters, and the per-sample norms."""
    model = copy.deepcopy(model)
    params = trainable(model)
    rows = []
    for b in range(inputs.shape[0]):
        model.zero_grad(set_to_none=True)
        loss = hf_models.sequence_classification_loss(model, inputs[b : b + 1], labels[b : b + 1])
        loss.sum().backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in params]))
    grads = torch.stack(rows).double()
    norms = grads.norm(dim=1)
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return (factors[:, None] * grads).sum(0) / inputs.shape[0], norms


def left_padded(inputs: torch.Tensor) -> torch.Tensor:
    """Pad tokens before each sequence (left padding, which HF's classifier pooling supports):
    the pad embedding row then sits inside every sample's forward, and gets no gradient."""
    padded = inputs.clone()
    for b in range(len(padded)):
        padded[b, : 1 + b % 3] = hf_configs.PAD_TOKEN_ID
    return padded


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("use_lora", [False, True])
@pytest.mark.parametrize("name", DP_TRAINERS)
def test_noise_free_update_matches_brute_force(name, use_lora, padding):
    model, _ = tiny_model(use_lora)
    inputs, labels = hf_data.synthetic_snli(5, 10, VOCAB, seed=1)
    if padding == "left":
        inputs = left_padded(inputs)
    _, norms = reference_update(model, inputs, labels, 1.0)
    max_grad_norm = norms.median().item()  # some samples clipped, some not
    ref, norms = reference_update(model, inputs, labels, max_grad_norm)
    assert (norms > max_grad_norm).any() and (norms < max_grad_norm).any()
    params = trainable(model)  # before wrapping: flash turns requires_grad off while it manages
    trainer = make_trainer(
        name,
        model,
        lr=0.1,
        max_grad_norm=max_grad_norm,
        noise_multiplier=0.0,
        batch_size=5,
        max_physical_batch_size=2,
        loss_fn=hf_models.sequence_classification_loss,
    )
    out = trainer.step(inputs, labels)
    assert len(out["physical_step_times_ms"]) == 3  # physical 2 < logical 5: chunks 2,2,1
    update = torch.cat([p.grad.reshape(-1) for p in params]).double()
    assert ((update - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_lora", [False, True])
def test_replayed_flash_step_matches_brute_force_on_cuda(use_lora):
    """--cuda_graph on a Llama classifier (peft's LoRA layers, left padding, padded chunks of
    2): replayed steps of 5 samples (chunks 2, 2, 1 + a stand-in) and of a Poisson draw of 3
    (divided by the expected 5) against brute force on the model as the step before left it."""
    model, _ = tiny_model(use_lora)
    model.cuda()
    batches = [hf_data.synthetic_snli(5, 10, VOCAB, seed=s) for s in (1, 2)]
    batches = [(left_padded(x).cuda(), y.cuda()) for x, y in batches]
    _, norms = reference_update(model, *batches[1], 1.0)
    max_grad_norm = norms.median().item()  # some samples clipped, some not
    params = trainable(model)
    trainer = make_trainer(
        "flash",
        model,
        lr=1e-3,  # small: the norms after the first step stay on both sides of C
        max_grad_norm=max_grad_norm,
        noise_multiplier=0.0,
        batch_size=5,
        max_physical_batch_size=2,
        loss_fn=hf_models.sequence_classification_loss,
        cuda_graph=True,
    )
    trainer.step(*batches[0])  # eager, then captured
    assert trainer.graphs.graphs is not None, trainer.graphs.error
    for inputs, labels in (batches[1], (batches[1][0][:3], batches[1][1][:3])):
        reference_model, _ = tiny_model(use_lora)  # no flash hooks, every trainable one trainable
        reference_model.cuda().load_state_dict(model.state_dict())
        ref, norms = reference_update(reference_model, inputs, labels, max_grad_norm)
        ref *= len(inputs) / 5  # the divisor is the expected batch
        clipped = (norms > max_grad_norm).any() and (norms < max_grad_norm).any()
        assert clipped or len(inputs) < 5
        trainer.step(inputs, labels)
        update = torch.cat([p.grad.reshape(-1) for p in params]).double()
        assert ((update - ref).norm() / ref.norm()).item() < 1e-5
    assert trainer.graphs.counts() == {"replays": 2, "chunk_replays": 5, "padding_samples": 2}


@pytest.mark.parametrize("use_lora", [False, True])
@pytest.mark.parametrize("name", ["standard", *DP_TRAINERS])
def test_every_trainer_steps_in_bf16_with_adam(name, use_lora):
    model, _ = tiny_model(use_lora)
    inputs, labels = hf_data.synthetic_snli(4, 12, VOCAB, seed=2)
    params = trainable(model)
    before = [p.detach().clone() for p in params]
    trainer = make_trainer(
        name,
        model,
        lr=1e-3,
        batch_size=4,
        max_physical_batch_size=3,
        optimizer="adam",
        dtype=torch.bfloat16,
        loss_fn=hf_models.sequence_classification_loss,
    )
    out = trainer.step(inputs, labels)
    assert torch.isfinite(torch.tensor(out["loss"]))
    assert all(not torch.equal(b, p) for b, p in zip(before, params))  # Adam moves every one


def test_rms_norms_are_torch_rms_norm_and_nothing_is_shared():
    model, _ = tiny_model(use_lora=False)
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kinds = {type(m) for m in model.modules()}
    assert LlamaRMSNorm not in kinds and torch.nn.RMSNorm in kinds
    norm = model.model.norm
    assert norm.eps == hf_configs.HF_CONFIGS[TINY]["rms_norm_eps"]
    # Same math as HF's module.
    x = torch.randn(2, 3, norm.weight.shape[0])
    with torch.no_grad():
        norm.weight.normal_()
    ref = LlamaRMSNorm(norm.weight.shape[0], eps=norm.eps)
    ref.weight = norm.weight
    assert torch.allclose(norm(x), ref(x), rtol=1e-6, atol=1e-6)
    hf_models.check_no_shared_parameters(model)  # config says tie_word_embeddings=True


def test_lora_trains_only_adapters_and_head():
    model, info = tiny_model(use_lora=True)
    cfg = hf_configs.HF_CONFIGS[TINY]
    d, m, r = cfg["hidden_size"], cfg["intermediate_size"], 4
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    per_layer = r * ((d + q) * 2 + (d + kv) * 2 + (d + m) * 3)  # q,o + k,v + gate,up,down
    head = d * hf_configs.NUM_LABELS
    assert info["trainable_params"] == cfg["num_hidden_layers"] * per_layer + head
    full, full_info = tiny_model(use_lora=False)
    assert info["frozen_params"] == full_info["trainable_params"]
    assert full_info["frozen_params"] == 0 and full_info["lora_rank"] is None
    assert info["lora_rank"] == r and info["config"] == TINY
    for name, p in model.named_parameters():
        adapter = "lora_A" in name or "lora_B" in name or "modules_to_save" in name
        assert p.requires_grad == adapter, name


@pytest.mark.parametrize(
    "name, published_lm, lm_head",
    [
        ("meta-llama/Llama-3.2-1B-Instruct", 1_235_814_400, False),  # tied: no separate head
        ("meta-llama/Llama-3.2-3B", 3_212_749_824, False),
        ("meta-llama/Llama-3.1-8B-Instruct", 8_030_261_248, True),  # untied 128256 x 4096 head
        ("meta-llama/Llama-3.1-70B-Instruct", 70_553_706_496, True),
    ],
)
def test_shipped_configs_give_published_sizes(name, published_lm, lm_head):
    cfg = hf_configs.HF_CONFIGS[name]
    model, info = hf_models.build_hf_model(name, device="meta")
    assert all(p.is_meta for p in model.parameters())  # built in place: no host copy
    # The classifier = the LM without its LM head, plus a hidden x 3 score head.
    expected = published_lm - lm_head * cfg["vocab_size"] * cfg["hidden_size"]
    assert info["trainable_params"] == expected + 3 * cfg["hidden_size"]
    # The plan's size guard counts the same model (it refused 8B on the CPU as "about 8.8B":
    # grouped-query attention ignored, tied embeddings counted twice).
    assert model_facts.parameter_count(name, {}) == expected + 3 * cfg["hidden_size"]


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown HF model"):
        hf_models.build_hf_model("nope/nope", device="meta")


def test_pretrained_offline_without_cache_raises_one_line_without_token(tmp_path, capsys):
    secret = "hf_SECRETtoken0123456789"
    with pytest.raises(RuntimeError) as excinfo:
        hf_models.build_hf_model(
            "meta-llama/Llama-3.2-1B-Instruct",
            pretrained=True,
            token=secret,
            cache_dir=str(tmp_path / "empty-cache"),
        )
    message = str(excinfo.value)
    assert "\n" not in message and "Llama-3.2-1B-Instruct" in message
    assert secret not in message
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err
    assert excinfo.value.__cause__ is None and excinfo.value.__suppress_context__


def test_synthetic_snli_layout_and_determinism():
    inputs, labels = hf_data.synthetic_snli(64, 16, VOCAB, seed=3)
    assert inputs.shape == (64, 16) and inputs.dtype == torch.int64
    assert labels.shape == (64,) and labels.dtype == torch.int64
    assert set(labels.tolist()) == {0, 1, 2}
    assert ((inputs == hf_configs.SEP_TOKEN_ID).sum(1) == 1).all()  # one separator per row
    sep = (inputs == hf_configs.SEP_TOKEN_ID).int().argmax(1)
    assert (sep >= 1).all() and (sep <= 14).all()  # premise and hypothesis both non-empty
    content = inputs[inputs != hf_configs.SEP_TOKEN_ID]
    assert content.min() >= hf_configs.FIRST_CONTENT_ID and content.max() < VOCAB
    assert not (inputs == hf_configs.PAD_TOKEN_ID).any()
    again = hf_data.synthetic_snli(64, 16, VOCAB, seed=3)
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)
    other = hf_data.synthetic_snli(64, 16, VOCAB, seed=4)
    assert not torch.equal(other[0], inputs)


def test_load_snli_local_jsonl(tmp_path):
    path = tmp_path / "snli.jsonl"
    records = [
        {"premise": "A man plays a guitar.", "hypothesis": "A man makes music.", "label": 0},
        {"sentence1": "Two dogs run.", "sentence2": "Cats sleep.", "gold_label": "contradiction"},
        {"premise": "Skip me.", "hypothesis": "No gold label.", "gold_label": "-"},
        {"premise": "x " * 50, "hypothesis": "long", "label": "neutral"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    inputs, labels = hf_data.load_snli(path, seq_len=16, vocab_size=VOCAB)
    assert inputs.shape == (3, 16) and labels.tolist() == [0, 2, 1]
    first = hf_data.hash_tokenize("A man plays a guitar.", VOCAB)
    assert inputs[0, : len(first)].tolist() == first
    assert inputs[0, len(first)] == hf_configs.SEP_TOKEN_ID
    assert inputs[0, -1] == hf_configs.PAD_TOKEN_ID  # short pair: right-padded
    assert not (inputs[2] == hf_configs.PAD_TOKEN_ID).any()  # long pair: truncated
    assert hf_data.hash_tokenize("A man", VOCAB) == hf_data.hash_tokenize("a MAN", VOCAB)


def test_right_padding_does_not_change_the_logits():
    """Causal attention + last-non-pad pooling: right pads need no attention mask."""
    model, _ = tiny_model(use_lora=False)
    model.eval()
    inputs, labels = hf_data.synthetic_snli(2, 8, VOCAB, seed=5)
    padded = torch.cat([inputs, torch.full((2, 4), hf_configs.PAD_TOKEN_ID)], dim=1)
    with torch.no_grad():
        a = hf_models.sequence_classification_loss(model, inputs, labels)
        b = hf_models.sequence_classification_loss(model, padded, labels)
    assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_epsilon_monotone(accountant):
    e = lambda sigma, steps: privacy.epsilon(sigma, 0.01, [1] * steps, 1e-5, accountant)
    assert 0 < e(1.0, 100) < e(1.0, 1000)
    assert e(2.0, 1000) < e(1.0, 1000)
    assert privacy.epsilon(0.0, 0.01, [1] * 10) == float("inf")
    assert privacy.epsilon(1.0, 0.01, []) == 0.0
    with pytest.raises(ValueError, match="accountant"):
        privacy.epsilon(1.0, 0.01, [1] * 10, accountant="gdp?")


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_epsilon_of_steps_that_reuse_the_last_batch(accountant):
    """k steps on one Poisson sample are accounted as one step at sigma / sqrt(k). Without
    subsampling (q = 1) every step sees the same data anyway, so reuse changes nothing; with
    q < 1 reusing a batch costs more privacy than drawing fresh ones."""

    def e(q, steps, uses):  # the last of ``steps`` steps' draws taken by ``uses`` of them
        return privacy.epsilon(1.0, q, [1] * (steps - uses) + [uses], 1e-5, accountant)

    assert e(1.0, 50, 4) == pytest.approx(e(1.0, 50, 1), rel=1e-3)
    assert e(0.01, 50, 4) > e(0.01, 50, 1)
    assert e(0.01, 4, 4) > e(0.01, 4, 1)  # every step on one batch
    # draws reused anywhere, by their counts: two draws of 2 steps each as one history entry
    assert privacy.epsilon(1.0, 0.01, [2, 1, 2], 1e-5, accountant) == pytest.approx(
        privacy.epsilon(1.0, 0.01, [1, 2, 2], 1e-5, accountant), rel=1e-9
    )
    with pytest.raises(ValueError, match="at least one step"):
        privacy.epsilon(1.0, 0.01, [1, 0])


def test_poisson_batch_is_bernoulli_per_sample():
    g = torch.Generator().manual_seed(0)
    n, q = 1000, 0.05
    sizes = []
    for _ in range(200):
        batch = privacy.poisson_batch(n, q, g)
        assert batch.dtype == torch.int64 and batch.ndim == 1
        assert (batch[1:] > batch[:-1]).all() and batch.min() >= 0 and batch.max() < n
        sizes.append(len(batch))
    mean = sum(sizes) / len(sizes)
    # E = qN = 50, sd of the mean over 200 draws = sqrt(qN(1-q)/200) ~ 0.49: 4 sd.
    assert abs(mean - q * n) < 2.0
    assert len(privacy.poisson_batch(10, 0.0, g)) == 0
    assert len(privacy.poisson_batch(10, 1.0, g)) == 10
