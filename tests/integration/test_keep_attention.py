"""transformers' gradient checkpointing with ``hf_flash.gradient_checkpointing_kwargs()``: on tiny
models the attention forward kernel runs once per layer per step (twice with plain
checkpointing), and the gradients equal those of plain checkpointing and of no checkpointing
exactly, with LoRA or plain parameters, dense, padded and packed inputs, and attention dropout.

Why exact: the kept output and log-sum-exp are what the recomputation would produce (the same
deterministic kernels on bitwise equal inputs), and the backward pass then runs the same ops."""

from __future__ import annotations

import pytest
import torch

import hf_flash
from tiny_models import VOCAB, load

hf_flash.register()

LAYERS = 2  # tiny_models' num_hidden_layers
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _batch(device, layout: str) -> dict:
    g = torch.Generator().manual_seed(21)
    if layout == "dense":
        ids = torch.randint(3, VOCAB, (1, 24), generator=g)
        batch = {"input_ids": ids, "labels": ids}
    elif layout == "padded":  # right padding: the varlen path with a 2-D mask
        ids = torch.randint(3, VOCAB, (2, 20), generator=g)
        mask = torch.ones_like(ids)
        mask[1, -6:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    else:  # packed: three sequences in one row, restarting position_ids
        ids = torch.randint(3, VOCAB, (1, 24), generator=g)
        pos = torch.cat([torch.arange(n) for n in (9, 7, 8)]).unsqueeze(0)
        batch = {"input_ids": ids, "position_ids": pos, "labels": ids}
    return {k: v.to(device) for k, v in batch.items()}


def _model(device, root, family: str, lora: bool, attention_dropout: float = 0.0):
    model = load(family, "hf_flash", root, device=device)
    if attention_dropout:
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = attention_dropout
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(
            model,
            LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                       target_modules=LORA_TARGETS),
        )  # fmt: skip
    else:
        # the embedding's backward may accumulate with atomics on GPUs: keep the test exact
        model.get_input_embeddings().weight.requires_grad_(False)
    return model.train()


def _step(model, batch, mode: str, seed: int = 0):
    """Loss and gradients of one step; mode: none (no checkpointing), plain or keep."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if mode == "none":
        base.gradient_checkpointing_disable()
    else:
        base.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=hf_flash.gradient_checkpointing_kwargs(
                keep_attention=mode == "keep"
            )
        )
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def _assert_same(ref, got, what):
    (loss_r, grads_r), (loss_g, grads_g) = ref, got
    assert torch.equal(loss_r, loss_g), f"{what}: loss {loss_r.item()} vs {loss_g.item()}"
    assert grads_r.keys() == grads_g.keys() and grads_r
    for n in grads_r:
        diff = (grads_r[n] - grads_g[n]).abs().max().item()
        assert torch.equal(grads_r[n], grads_g[n]), f"{what}: grad {n} differs by {diff:.3e}"


@pytest.mark.parametrize(
    "family, layout, lora",
    [
        ("llama", "dense", True),
        ("llama", "padded", True),
        ("llama", "packed", True),
        ("mistral", "padded", False),  # sliding window, plain parameters
    ],
    ids=["llama-dense-lora", "llama-padded-lora", "llama-packed-lora", "mistral-padded-full"],
)
def test_attention_runs_once_per_layer_and_gradients_are_unchanged(
    root, launches, family, layout, lora, device
):
    model = _model(device, root, family, lora)
    batch = _batch(device, layout)
    results, counts = {}, {}
    for mode in ("none", "plain", "keep"):
        launches.update(fwd=0, bwd=0)
        results[mode] = _step(model, batch, mode)
        counts[mode] = dict(launches)
    assert counts == {
        "none": {"fwd": LAYERS, "bwd": LAYERS},
        "plain": {"fwd": 2 * LAYERS, "bwd": LAYERS},
        "keep": {"fwd": LAYERS, "bwd": LAYERS},
    }
    if lora:
        assert all("lora_" in n for n in results["keep"][1])
    _assert_same(results["plain"], results["keep"], "keep vs plain checkpointing")
    _assert_same(results["none"], results["keep"], "keep vs no checkpointing")


def test_attention_dropout_gives_identical_gradients(root, launches, device):
    model = _model(device, root, "llama", lora=True, attention_dropout=0.3)
    batch = _batch(device, "dense")
    results = {mode: _step(model, batch, mode, seed=5) for mode in ("none", "plain", "keep")}
    _assert_same(results["plain"], results["keep"], "dropout: keep vs plain checkpointing")
    _assert_same(results["none"], results["keep"], "dropout: keep vs no checkpointing")
    other = _step(model, batch, "keep", seed=6)
    assert not torch.equal(other[0], results["keep"][0]), "attention dropout is not active"
    assert launches["fwd"] == (1 + 2 + 1 + 1) * LAYERS


def test_reentrant_checkpointing_is_refused(root, device):
    with pytest.raises(ValueError, match=r"use_reentrant=True cannot keep the attention outputs"):
        hf_flash.gradient_checkpointing_kwargs(use_reentrant=True)
    # handing the context to reentrant checkpointing by hand fails in torch, before any step
    model = _model(device, root, "llama", lora=False)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={
            "use_reentrant": True, "context_fn": hf_flash.attention_checkpoint_context,
        }
    )  # fmt: skip
    with pytest.raises(ValueError, match="use_reentrant=False"):
        model(**_batch(device, "dense"))
