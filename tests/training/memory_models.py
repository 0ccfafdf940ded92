"""The tiny LoRA Llama the memory-feature tests train, one step's loss and gradients, and the
comparisons (bitwise, or the docs/design.md error rule against a float64 run of the same weights).

The model: hf_flash.recipes.model.TINY_SHAPE (hidden 64, MLP 128, 2 layers, 2 query / 1 key-value
heads, head_dim 32) with a 256-token context, vocab 128, peft LoRA r=8 on q, k, v, o, gate, up and
down with random A and B (init_lora_weights=False, so every adapter gets a non-zero gradient).
The same seed gives the same weights whatever the attention implementation and dtype, so a
float64 eager model is the exact reference of a float32 one.
"""

from __future__ import annotations

import torch

import hf_flash
from hf_flash.recipes.model import TINY_SHAPE
from hf_flash.reference import FWD_FACTOR, GRAD_FACTOR, assert_close_to_ref

VOCAB = 128
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_lora_model(attn: str, dtype=torch.float32, layers: int = 2, lora_dropout: float = 0.0,
                    device="cpu"):  # fmt: skip
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    if attn == "hf_flash":
        hf_flash.register()
    config = LlamaConfig(
        **{**TINY_SHAPE, "max_position_embeddings": 256, "num_hidden_layers": layers},
        vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    torch.manual_seed(1)
    model = get_peft_model(
        model,
        LoraConfig(r=8, lora_alpha=16, lora_dropout=lora_dropout, init_lora_weights=False,
                   target_modules=LORA_TARGETS),
    )  # fmt: skip
    return model.to(device=device, dtype=dtype).train()


def batch(rows: int = 2, seq: int = 64, device="cpu", seed: int = 7) -> dict:
    ids = torch.randint(3, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(device)
    return {"input_ids": ids, "labels": ids}


def checkpointing(model, keep_attention: bool = False) -> dict:
    """Switch on plain (or keep-attention) checkpointing; returns the kwargs used."""
    kwargs = hf_flash.gradient_checkpointing_kwargs(keep_attention=keep_attention)
    hf_flash.enable_activation_checkpointing(model.get_base_model(), kwargs)
    return kwargs


def step(model, inputs: dict):
    """Loss and the LoRA gradients of one forward and backward pass."""
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    return loss.detach(), grads


def assert_bitwise(ref, got, what: str) -> None:
    (loss_r, grads_r), (loss_g, grads_g) = ref, got
    assert torch.equal(loss_r, loss_g), f"{what}: loss {loss_r.item()!r} vs {loss_g.item()!r}"
    assert grads_r.keys() == grads_g.keys()
    for n in grads_r:
        diff = (grads_r[n] - grads_g[n]).abs().max().item()
        assert torch.equal(grads_r[n], grads_g[n]), f"{what}: grad {n} differs by {diff:.3e}"


def assert_within_rule(exact, lowp, got, dtype, what: str) -> None:
    """docs/design.md's rule for a computation that reorders float sums: ``got``'s error against the
    float64 run ``exact`` is at most 2x (loss) / 3x (gradients) the error of ``lowp`` (the same
    model in ``dtype`` without the feature) against it, plus the ``dtype`` floor."""
    (loss_e, grads_e), (loss_l, grads_l), (loss_g, grads_g) = exact, lowp, got
    assert_close_to_ref(f"{what}: loss", loss_g, loss_e, loss_l, FWD_FACTOR, dtype)
    assert grads_e.keys() == grads_l.keys() == grads_g.keys()
    for n in grads_e:
        assert_close_to_ref(f"{what}: grad {n}", grads_g[n], grads_e[n], grads_l[n], GRAD_FACTOR, dtype)
