"""Fused decode for Llama and Mistral attention on a StaticCache, one model instance at a time.

transformers' decode step for one attention layer is: project q/k/v, apply RoPE to q and k,
``past_key_values.update`` (copy k/v into the cache), then attention over the cache. With
``attn_implementation="hf_flash"`` and a :class:`transformers.StaticCache`, the patched forward
does the last three in one :func:`hf_flash.flash_attn_with_kvcache` launch: the kernel rotates q
and the new k, appends k/v to the cache buffers in place, and attends (split-KV, GQA groups read
each K/V tile once). The cache's own bookkeeping (``cumulative_length``) advances exactly as
``StaticLayer.update`` would advance it.

When the fused path applies (all decided from shapes and types, never from tensor values, so
the step stays free of host syncs and CUDA-graph capturable):

* the layer's cache is a plain ``StaticLayer`` that already holds the prompt (``is_initialized``);
  sliding-window, offloaded, quantized and dynamic caches take transformers' path, which runs
  the generic hf_flash attention function;
* at most ``MAX_FUSED_QUERIES`` new tokens (decode, speculative steps); prefill takes the
  generic path;
* inference (``module.training`` is False), no ``output_attentions``, and the attention mask is
  None or the 2-D key mask of :func:`hf_flash.integration.attention.hf_flash_mask` (left
  padding: each row's first valid key becomes ``cache_leftpad``).

RoPE angles are the model's own (``position_embeddings`` from its rotary module, any scaling
type, ``attention_scaling`` included), handed to the kernel as per-token tables, so
left-padded rows use their own positions. Everything else (projections, LoRA adapters, o_proj)
is the module's code path.

Patching is per instance: the module gets an instance-level ``forward`` that takes the fused
path or calls the forward it replaced (transformers' class forward, or the fused-RoPE forward
of :mod:`hf_flash.integration.rope_patch`). :func:`revert_model` restores it. When accelerate
hooked the module, the patch goes to ``module._old_forward``, which its wrapper calls.
"""

from __future__ import annotations

import functools
import importlib
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .attention import first_valid
from .instance_patch import unwrap_forwards, wrap_forward

__all__ = ["patch_model", "revert_model", "is_patched", "MAX_FUSED_QUERIES", "FAMILIES"]

MAX_FUSED_QUERIES = 16
_ORIGINAL = "_hf_flash_decode_original"  # on a patched module: (attribute name, what it held)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# model_type -> (modeling module, attention class)
FAMILIES: Dict[str, Tuple[str, str]] = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaAttention"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralAttention"),
}


def patch_model(model) -> bool:
    """Enable the fused StaticCache decode path in this model's Llama/Mistral attention modules.

    Returns True when ``config.model_type`` is llama or mistral and its attention modules are
    patched (or already were); False, changing nothing, for other families. Idempotent. The
    fused path only runs while ``config._attn_implementation == "hf_flash"``.
    """
    from .registration import check_transformers_version

    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in FAMILIES:
        return False
    check_transformers_version()
    module_name, cls_name = FAMILIES[family]
    cls = getattr(importlib.import_module(module_name), cls_name)
    found = False
    for module in model.modules():
        if type(module) is not cls:
            continue
        found = True
        wrap_forward(module, _ORIGINAL, _make_forward)
    return found


def revert_model(model) -> None:
    """Undo :func:`patch_model` on every module of ``model`` (no-op where not patched)."""
    unwrap_forwards(model, _ORIGINAL)


def is_patched(module) -> bool:
    return _ORIGINAL in module.__dict__


def _make_forward(fallback):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):  # fmt: skip
        layer = _fusable_layer(self, hidden_states, position_embeddings, attention_mask,
                               past_key_values, kwargs)  # fmt: skip
        if layer is None:
            return fallback(hidden_states, position_embeddings, attention_mask, past_key_values,
                            **kwargs)  # fmt: skip
        return _fused_decode(self, layer, hidden_states, position_embeddings, attention_mask)

    forward.__hf_flash_fused_decode__ = True
    return forward


@functools.lru_cache(maxsize=None)
def _static_layer_cls():
    # looked up once: an import statement here costs ~1 us per layer call on every decode step
    from transformers.cache_utils import StaticLayer

    return StaticLayer


def _fusable_layer(module, hidden_states, position_embeddings, attention_mask, cache, kwargs):
    """The StaticLayer to decode into, or None when this call must take the regular path."""
    config = module.config
    if config._attn_implementation != "hf_flash" or module.training:
        return None
    if cache is None or kwargs.get("output_attentions", False) or position_embeddings is None:
        return None
    if getattr(cache, "offloading", False):
        return None
    layers = getattr(cache, "layers", None)
    if layers is None or module.layer_idx >= len(layers):
        return None
    layer = layers[module.layer_idx]
    if type(layer) is not _static_layer_cls() or not getattr(layer, "is_initialized", False):
        return None
    if hidden_states.dim() != 3 or not 1 <= hidden_states.shape[1] <= MAX_FUSED_QUERIES:
        return None
    if layer.keys.dtype not in _DTYPES or layer.keys.stride(-1) != 1:
        return None
    if layer.keys.shape[0] != hidden_states.shape[0]:
        return None
    cos = position_embeddings[0]
    if cos.dim() != 3 or cos.shape[-1] != module.head_dim or cos.shape[1] != hidden_states.shape[1]:
        return None
    if attention_mask is not None and (
        not isinstance(attention_mask, Tensor)
        or attention_mask.dim() != 2
        or attention_mask.shape[0] != hidden_states.shape[0]
    ):
        return None
    return layer


def _fused_decode(module, layer, hidden_states, position_embeddings, attention_mask):
    from hf_flash import kvcache

    batch, seqlen, _ = hidden_states.shape
    head_dim = module.head_dim
    dtype = layer.keys.dtype
    # (B, S, H, D) straight from the projections: the kernel's layout, no transposes
    q = module.q_proj(hidden_states).view(batch, seqlen, -1, head_dim).to(dtype)
    k = module.k_proj(hidden_states).view(batch, seqlen, -1, head_dim).to(dtype)
    v = module.v_proj(hidden_states).view(batch, seqlen, -1, head_dim).to(dtype)
    # transformers' tables repeat each angle for both halves (rotate-half): keep the first half
    cos, sin = position_embeddings
    half = head_dim // 2
    cos, sin = cos[..., :half], sin[..., :half]
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    lens = layer.cumulative_length.to(torch.int32).expand(batch).contiguous()
    leftpad: Optional[Tensor] = None
    if attention_mask is not None:
        leftpad = first_valid(attention_mask.to(q.device).bool()).to(torch.int32)
    window = getattr(module.config, "sliding_window", None)
    # transformers' window w: key j visible to query i iff i - w < j <= i
    left = int(window) - 1 if window else -1
    out, _ = kvcache._run_attn_with_kvcache(
        q, layer.keys, layer.values, k, v, cos, sin, lens, None, leftpad, None, None,
        float(module.scaling), True, left, 0, 0.0, False, 0, True,
    )  # fmt: skip
    layer.cumulative_length.add_(seqlen)
    out = out.reshape(batch, seqlen, -1)
    return module.o_proj(out), None
