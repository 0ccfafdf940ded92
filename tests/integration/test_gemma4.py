"""Gemma 4 on "hf_flash" (issue 18): its global (full-attention) layers have heads of 512
(``global_head_dim``), its sliding layers heads of 16 here. A tiny random text model, built
offline from a config, matches eager within hf_flash.reference's error rule at model level:
logits against float64 eager, with eager in the test dtype as the budget; and the gradients of
the global layer's projections. (No padded batch: eager's reference logits are not finite there
in this tiny model.)"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_flash.reference import FWD_FACTOR, GRAD_FACTOR

from tiny_models import assert_model_close

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4ForCausalLM"):  # pragma: no cover - transformers < 5.x
    pytest.skip("this transformers has no Gemma 4", allow_module_level=True)


def _config():
    return transformers.Gemma4TextConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=16, layer_types=["sliding_attention", "full_attention"],
        sliding_window=8, global_head_dim=512,
    )  # fmt: skip


def _models(device):
    """(eager float64, eager float32, hf_flash float32) with the same random weights. Each
    model gets its own config: _from_config records the attention implementation on it."""
    torch.manual_seed(0)
    eager = transformers.Gemma4ForCausalLM._from_config(copy.deepcopy(_config()), attn_implementation="eager",
                                                        dtype=torch.float32)  # fmt: skip
    flash = transformers.Gemma4ForCausalLM._from_config(copy.deepcopy(_config()), attn_implementation="hf_flash",
                                                        dtype=torch.float32)  # fmt: skip
    flash.load_state_dict(eager.state_dict())
    assert flash.model.layers[1].self_attn.head_dim == 512
    assert flash.config._attn_implementation == "hf_flash" and eager.config._attn_implementation == "eager"
    exact = copy.deepcopy(eager).double()
    return tuple(m.to(device).eval() for m in (exact, eager, flash))


def _check(device, dtype):
    exact, eager, flash = _models(device)
    eager, flash = eager.to(dtype), flash.to(dtype)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(1)).to(device)
    outs = []
    for model in (exact, eager, flash):
        logits = model(input_ids=ids).logits
        logits.double().pow(2).mean().backward()
        outs.append(logits.double())
    assert_model_close("logits", outs[2], outs[0], outs[1], FWD_FACTOR, dtype)
    for name in ("q_proj", "k_proj", "v_proj"):
        grads = [getattr(m.model.layers[1].self_attn, name).weight.grad.double() for m in (exact, eager, flash)]
        assert_model_close(f"global layer {name} grad", grads[2], grads[0], grads[1], GRAD_FACTOR, dtype)


def test_tiny_gemma4_matches_eager_fp32(device):
    _check(device, torch.float32)


@pytest.mark.gpu
def test_tiny_gemma4_matches_eager_bf16_gpu(device):
    _check(device, torch.bfloat16)
