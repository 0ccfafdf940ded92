"""Training set-ups on "hf_flash": peft LoRA with gradient checkpointing (the recipe's set-up),
torch.compile, attention dropout, and an encoder (non-causal) model with padding."""

from __future__ import annotations

import copy

import torch

import hf_flash
from hf_flash.reference import FWD_FACTOR, GRAD_FACTOR
from tiny_models import VOCAB, assert_model_close, load

hf_flash.register()


def _right_padded(device):
    """Right padding only: eager in float64 stays finite (no fully masked query row)."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, VOCAB, (2, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids.to(device), mask.to(device), labels.to(device)


def _step(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {
        n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters() if p.requires_grad
    }
    return out.loss.detach(), grads


def _as_eager(peft_model, dtype):
    other = copy.deepcopy(peft_model).to(dtype)
    other.base_model.model.set_attn_implementation("eager")
    return other


def test_lora_with_gradient_checkpointing(root, device):
    from peft import LoraConfig, get_peft_model

    base = load("llama", "hf_flash", root, device=device)
    torch.manual_seed(0)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )  # fmt: skip
    ours = get_peft_model(base, lora)
    lowp = _as_eager(ours, torch.float32)
    exact = _as_eager(ours, torch.float64)
    for m in (ours, lowp, exact):
        m.train()
        m.base_model.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    assert ours.base_model.model.config._attn_implementation == "hf_flash"
    batch = _right_padded(device)
    res = {k: _step(m, *batch) for k, m in (("ours", ours), ("lowp", lowp), ("exact", exact))}
    assert_model_close("loss", res["ours"][0], res["exact"][0], res["lowp"][0], FWD_FACTOR, torch.float32)
    grads = res["ours"][1]
    assert grads and all("lora_" in n for n in grads)
    for n, g in grads.items():
        assert_model_close(
            f"grad {n}", g, res["exact"][1][n], res["lowp"][1][n], GRAD_FACTOR, torch.float32
        )


def test_torch_compile_training_step(root, device):
    ours = load("llama", "hf_flash", root, device=device).train()
    lowp = load("llama", "eager", root, device=device).train()
    exact = load("llama", "eager", root, dtype=torch.float64, device=device).train()
    # aot_eager traces forward and backward through dynamo/AOTAutograd (the custom ops' fake
    # implementations included) without a C++ toolchain; the GPU suite compiles with inductor.
    compiled = torch.compile(ours, backend="aot_eager")
    batch = _right_padded(device)
    res = {k: _step(m, *batch) for k, m in (("ours", compiled), ("lowp", lowp), ("exact", exact))}
    assert_model_close("loss", res["ours"][0], res["exact"][0], res["lowp"][0], FWD_FACTOR, torch.float32)
    for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"):
        assert_model_close(
            f"grad {n}", res["ours"][1][n], res["exact"][1][n], res["lowp"][1][n],
            GRAD_FACTOR, torch.float32,
        )  # fmt: skip


def test_attention_dropout_in_training(root, tmp_path, device):
    from transformers import AutoModelForCausalLM

    model = load("llama", "hf_flash", root, device=device)
    model.config.attention_dropout = 0.3
    model.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="hf_flash").to(device)
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(12)).to(device)
    with torch.no_grad():
        model.eval()
        clean = model(input_ids=ids).logits
        model.train()
        torch.manual_seed(5)
        a = model(input_ids=ids).logits
        torch.manual_seed(5)
        b = model(input_ids=ids).logits
        torch.manual_seed(6)
        c = model(input_ids=ids).logits
    assert torch.isfinite(a).all()
    assert torch.equal(a, b), "dropout must follow torch's generator"
    assert not torch.equal(a, c) and not torch.allclose(a, clean)


def test_encoder_model_with_padding(device):
    """A bidirectional (is_causal=False) encoder: padding is a key mask, no causal alignment."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    lowp = BertModel(config).to(device).eval()
    with torch.no_grad():
        for name, p in lowp.named_parameters():
            if name.endswith(("query.weight", "key.weight")):
                p.mul_(20.0)
    exact = copy.deepcopy(lowp).double()
    ours = copy.deepcopy(lowp)
    ours.set_attn_implementation("hf_flash")
    ids = torch.randint(3, VOCAB, (3, 18), generator=torch.Generator().manual_seed(13)).to(device)
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    mask[1, :4] = 0
    with torch.no_grad():
        outs = {k: m(input_ids=ids, attention_mask=mask).last_hidden_state
                for k, m in (("ours", ours), ("lowp", lowp), ("exact", exact))}  # fmt: skip
    valid = mask.bool()
    assert_model_close(
        "encoder hidden states", outs["ours"][valid], outs["exact"][valid], outs["lowp"][valid],
        FWD_FACTOR, torch.float32,
    )  # fmt: skip
