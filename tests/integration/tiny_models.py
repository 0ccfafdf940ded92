"""Tiny randomly initialised models of each supported family, built offline from configs, and the
model-level error rule.

Sizes are chosen for Triton's CPU interpreter: hidden 64, 2 layers, 4 query / 2 key-value heads
(GQA, head_dim 16), vocab 128. Sliding windows are 8 tokens so that the ~24-token test inputs
actually slide. Each model is saved with ``save_pretrained`` and reloaded through
``from_pretrained(attn_implementation=...)``, the path users take.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import transformers

from hf_flash.reference import allowed_error, floor_for, max_abs_err

VOCAB = 128
WINDOW = 8
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# model_type -> (config class name, family-specific config fields): every family of
# hf_flash.integration.families has one (test_models checks it)
TINY_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW, "head_dim": 16}),
    "qwen2": (
        "Qwen2Config",
        {
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
            "layer_types": ["full_attention", "sliding_attention"],
        },
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 5.0,  # small enough to bend the random-weight scores
            "final_logit_softcapping": None,
            "query_pre_attn_scalar": 24,  # scaling 24**-0.5, not head_dim**-0.5
        },
    ),
    "phi3": ("Phi3Config", {}),
}


def config_for(family: str):
    cls_name, extra = TINY_CONFIGS[family]
    return getattr(transformers, cls_name)(**_COMMON, **extra)


@functools.lru_cache(maxsize=None)
def _saved(family: str, root: str) -> str:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config_for(family), attn_implementation="eager", dtype=torch.float32
    )
    # Random init uses std 0.02: scale up so attention is far from uniform and masking errors show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(20.0)
    path = Path(root) / family
    model.save_pretrained(path)
    return str(path)


def load(family: str, attn: str, root, dtype=torch.float32, device="cpu", **kwargs):
    """The saved tiny model of ``family``, loaded with ``attn_implementation=attn``."""
    path = _saved(family, str(root))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn, dtype=dtype, **kwargs
    )
    return model.to(device).eval()


def assert_model_close(name, got, exact, lowp, factor, dtype):
    """hf_flash.reference's error rule at model level: err(got) <= factor * err(eager in dtype)
    + floor, errors measured against eager in float64."""
    # A NaN reference would make every error "inf <= inf": refuse it outright.
    assert torch.isfinite(exact).all() and torch.isfinite(lowp).all(), f"{name}: reference not finite"
    err = max_abs_err(got, exact)
    budget = max_abs_err(lowp, exact)
    allowed = allowed_error(budget, factor, dtype)
    assert err <= allowed, (
        f"{name}: max err {err:.3e} vs float64 eager exceeds {factor}x eager-{dtype}'s own error "
        f"{budget:.3e} + floor {floor_for(dtype):.1e}"
    )
