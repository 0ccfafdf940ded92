"""gpt-oss (learnable attention sinks, alternating sliding and full layers, MoE) on "hf_flash":
a tiny random model against transformers' eager attention, the model's own reference path.

The sinks reach hf_flash's kernels as ``s_aux`` on every attention path: dense and padded
prefill, packed rows, the training backward (the sinks' own gradient included) and decode.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, GptOssConfig  # noqa: E402

import hf_flash  # noqa: E402
from hf_flash.reference import FWD_FACTOR, GRAD_FACTOR  # noqa: E402
from tiny_models import assert_model_close  # noqa: E402

pytestmark = pytest.mark.integration

VOCAB = 128


def _config():
    return GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
        vocab_size=VOCAB, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def trio():
    """(hf_flash fp32, eager fp32, eager fp64) with the same random weights and sinks."""
    hf_flash.register()
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(
        _config(), attn_implementation="eager", experts_implementation="eager"  # fp64 needs eager MoE
    ).eval()
    with torch.no_grad():
        for layer in eager.model.layers:  # sinks of both signs and sizes, not the init's zeros
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks) * 2)
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation("hf_flash")
    return ours, eager, copy.deepcopy(eager).double()


def test_gpt_oss_loads_on_hf_flash():
    hf_flash.register()
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="hf_flash")
    assert model.config._attn_implementation == "hf_flash"


def _padded(device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :4] = 0
    mask[1, :4] = 0
    return ids.to(device), mask.to(device)


def test_forward_and_gradients_equal_eager(trio, device):
    """Padded batch (left padding; 11 tokens > the window of 6): logits, and the gradients of
    every weight, the sinks included, within the error rule of eager in float32."""
    ours, eager, exact = (m.to(device) for m in trio)
    ids, mask = _padded(device)
    results = {}
    for name, model in (("ours", ours), ("lowp", eager), ("exact", exact)):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask).logits
        valid = mask.bool()
        logits[valid].float().square().mean().backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (logits[valid].detach().float(), grads)
    assert_model_close("logits", results["ours"][0], results["exact"][0], results["lowp"][0],
                       FWD_FACTOR, torch.float32)  # fmt: skip
    grads = results["ours"][1]
    assert any("sinks" in n for n in grads)
    assert grads.keys() == results["exact"][1].keys()
    for n in grads:
        assert_model_close(f"grad {n}", grads[n], results["exact"][1][n], results["lowp"][1][n],
                           GRAD_FACTOR, torch.float32)  # fmt: skip


def test_packed_rows_equal_separate_sequences(trio, device):
    ours, eager, exact = (m.to(device) for m in trio)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (5, 9, 4)]
    ids = torch.cat(seqs)[None].to(device)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None].to(device)
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=pos).logits[0]
        alone = {name: torch.cat([m(input_ids=s[None].to(device)).logits[0] for s in seqs]).float()
                 for name, m in (("lowp", eager), ("exact", exact))}  # fmt: skip
    assert_model_close("packed", got, alone["exact"], alone["lowp"], FWD_FACTOR, torch.float32)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_equals_eager(trio, cache, device):
    """Token for token in float32, prefill and decode over a left-padded batch whose prompts
    are longer than the sliding window."""
    ours, eager, _ = (m.to(device) for m in trio)
    ids, mask = _padded(device)
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    if cache == "static":
        gen["cache_implementation"] = "static"
    expected = eager.generate(ids, attention_mask=mask, **gen)
    got = ours.generate(ids, attention_mask=mask, **gen)
    assert torch.equal(got, expected), f"hf_flash {got.tolist()} != eager {expected.tolist()}"
