"""Fused decode for Llama and Mistral attention on a StaticCache or DynamicCache, one model
instance at a time.

transformers' decode step for one attention layer is: project q/k/v, apply RoPE to q and k,
``cache.update`` (copy k/v into the cache; the argument is ``past_key_values`` before
transformers 5.24), then attention over the cache. With
``attn_implementation="hf_flash"`` the patched forward does the last three in one
:func:`hf_flash.flash_attn_with_kvcache` launch: the kernel rotates q and the new k, appends k/v
to the cache buffers in place, and attends (split-KV, GQA groups read each K/V tile once).

* ``StaticLayer``: the cache's own bookkeeping (``cumulative_length``) advances exactly as
  ``StaticLayer.update`` would advance it. Decided from shapes and types only, never from
  tensor values, so the step stays free of host syncs and CUDA-graph capturable.
* ``DynamicLayer`` (eager only): its keys/values become leading views of buffers with spare
  slots (:func:`_dynamic_buffers`), so the kernel appends in place instead of transformers'
  ``torch.cat`` of the whole history, and the rotary launch and the cat copies of every layer
  and step go away. The views are ordinary (B, H, n, D) tensors to everything else in
  transformers (crop, reorder, reset, the generic path all keep working).

When the fused path applies:

* the layer's cache is a plain ``StaticLayer`` or ``DynamicLayer`` that already holds the prompt;
  sliding-window, offloaded and quantized caches take transformers' path, which runs the
  generic hf_flash attention function;
* at most :data:`hf_flash.decode.MAX_DECODE_QUERIES` new tokens (decode, speculative steps);
  prefill takes the generic path;
* inference (``module.training`` is False), no ``output_attentions``, and the attention mask is
  None or the 2-D key mask of :func:`hf_flash.integration.masks.hf_flash_mask` (left
  padding: each row's first valid key becomes the decode op's ``key_start``).

RoPE angles are the model's own (``position_embeddings`` from its rotary module, any scaling
type, ``attention_scaling`` included), handed to the kernel as per-token tables, so
left-padded rows use their own positions. Everything else (projections, LoRA adapters, o_proj)
is the module's code path.

Patching is per instance (:mod:`hf_flash.integration.patching`): the module gets an
instance-level ``forward`` that takes the fused path or calls the forward it replaced
(transformers' class forward, or the fused-RoPE forward of
:mod:`hf_flash.integration.rope_patch`). :func:`revert_model` restores it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._checks import DTYPES
from ..decode import MAX_DECODE_QUERIES, decode_attention, full_lengths
from .common import flash_window
from .families import patch_target
from .masks import has_holes, key_blocks
from .patching import cache_parameter, is_wrapped, unwrap_forwards, wrap_instances

__all__ = ["patch_model", "revert_model", "is_patched"]

_RECORD = "_hf_flash_decode_original"  # on a patched module: (attribute name, what it held)


def patch_model(model) -> bool:
    """Enable the fused StaticCache/DynamicCache decode path in this model's attention modules.

    Returns True when the model's family has the ``fused_decode`` patch
    (:mod:`hf_flash.integration.families`: llama, mistral) and its attention modules are
    patched (or already were); False, changing nothing, for other families. Idempotent. The
    fused path only runs while ``config._attn_implementation == "hf_flash"``.
    """
    target = patch_target(model, "fused_decode")
    if target is None:
        return False
    modeling, family = target
    found, _ = wrap_instances(model, getattr(modeling, family.attention), _RECORD, _make_forward)
    return found


def revert_model(model) -> int:
    """Undo :func:`patch_model` on every module of ``model``; returns how many were reverted."""
    return unwrap_forwards(model, _RECORD)


def is_patched(module) -> bool:
    return is_wrapped(module, _RECORD)


def _make_forward(fallback):
    # the fourth parameter: "cache" from transformers 5.24 on, "past_key_values" before; the
    # call is handed on to ``fallback`` exactly as it came, under whichever name it used
    cache_name = cache_parameter(fallback)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args,
                **kwargs):  # fmt: skip
        cache = args[0] if args else kwargs.get(cache_name)
        found = _fusable_layer(self, hidden_states, position_embeddings, attention_mask, cache,
                               kwargs)  # fmt: skip
        if found is None:
            return fallback(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        layer, static = found
        return _fused_decode(self, layer, static, hidden_states, position_embeddings, attention_mask)

    return forward


_LAYER_CLASSES: list = []


def _layer_classes():
    # looked up once: an import statement here costs ~1 us per layer call on every decode step
    # (a plain list, not functools.lru_cache, which dynamo warns about and traces through)
    if not _LAYER_CLASSES:
        from transformers.cache_utils import DynamicLayer, StaticLayer

        _LAYER_CLASSES.extend((StaticLayer, DynamicLayer))
    return _LAYER_CLASSES[0], _LAYER_CLASSES[1]


def _fusable_layer(module, hidden_states, position_embeddings, attention_mask, cache, kwargs):
    """(layer, is it a StaticLayer) to decode into (a StaticLayer or a DynamicLayer), or None
    when this call must take the regular path."""
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
    static_cls, dynamic_cls = _layer_classes()
    static = type(layer) is static_cls
    if static:
        if not getattr(layer, "is_initialized", False):
            return None
    elif type(layer) is dynamic_cls:
        # grown in place (see _dynamic_buffers): eager only, and only once the prompt is in
        if torch.compiler.is_compiling() or not getattr(layer, "is_initialized", False):
            return None
        if not isinstance(layer.keys, Tensor) or layer.keys.dim() != 4 or layer.keys.shape[2] == 0:
            return None
    else:
        return None
    if hidden_states.dim() != 3 or not 1 <= hidden_states.shape[1] <= MAX_DECODE_QUERIES:
        return None
    if layer.keys.dtype not in DTYPES or layer.keys.stride(-1) != 1:
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
        or has_holes(attention_mask)  # padding inside a row: the attention gathers tokens
    ):
        return None
    return layer, static


def _fused_decode(module, layer, static, hidden_states, position_embeddings, attention_mask):
    batch, seqlen, _ = hidden_states.shape
    head_dim = module.head_dim
    dtype = layer.keys.dtype
    # (B, S, H, D) straight from the projections: the kernel's layout, no transposes
    q = _as(module.q_proj(hidden_states).view(batch, seqlen, -1, head_dim), dtype)
    k = _as(module.k_proj(hidden_states).view(batch, seqlen, -1, head_dim), dtype)
    v = _as(module.v_proj(hidden_states).view(batch, seqlen, -1, head_dim), dtype)
    # transformers' tables repeat each angle for both halves (rotate-half): keep the first half
    cos, sin = position_embeddings
    half = head_dim // 2
    cos, sin = cos[..., :half], sin[..., :half]
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if static:  # StaticLayer: its fill level lives on the device
        k_cache, v_cache = layer.keys, layer.values
        lens = layer.cumulative_length.to(torch.int32).expand(batch).contiguous()
    else:  # DynamicLayer: the host knows the length
        past = layer.keys.shape[2]
        k_cache, v_cache = _dynamic_buffers(layer, past + seqlen)
        lens = full_lengths(batch, past, q.device, True)
    key_start: Optional[Tensor] = None
    if attention_mask is not None:
        # every layer of a step gets the mask function's tensor: in eager mode its bounds are
        # computed once per step (masks.KEY_BLOCKS), while tracing inline
        key_start = key_blocks(attention_mask.to(q.device).bool())[0]
    out, _ = decode_attention(
        q, k_cache, v_cache, k_new=k, v_new=v, key_end=lens, key_start=key_start,
        rotary_cos=cos, rotary_sin=sin, softmax_scale=module.scaling, causal=True,
        window_size=flash_window(getattr(module.config, "sliding_window", None)),
        cache_heads_first=True,
    )  # fmt: skip
    if k_cache is layer.keys:
        layer.cumulative_length.add_(seqlen)
    else:  # the layer's keys/values: views of the buffers, now one step longer
        total = layer.keys.shape[2] + seqlen
        layer.keys, layer.values = k_cache[:, :, :total], v_cache[:, :, :total]
    out = out.reshape(batch, seqlen, -1)
    return module.o_proj(out), None


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    # a no-op .to() still costs an operator dispatch, three per layer and decode step
    return t if t.dtype == dtype else t.to(dtype)


# A DynamicLayer grows by torch.cat: a new tensor every step, with no room to append into. For
# the fused path its keys/values become leading views ``buf[:, :, :n]`` of buffers with spare
# slots; the kernel writes the new tokens at ``n`` and the views are extended. Everything that
# reads or replaces ``layer.keys`` keeps working: readers see an ordinary (B, H, n, D) tensor;
# crop() slices the view (the buffer is kept, later tokens overwrite the cropped ones); cat,
# batch_select_indices or reset() replace it with a plain tensor, which the next fused step
# copies into a new buffer. The buffer is the view's ``_base``, so nothing else holds memory.
_GROWTH_MIN = 256  # slots added at least, and the rounding of the capacity


def _buffer_of(view: Tensor) -> Optional[Tensor]:
    """The buffer ``view`` leads, if it is ``buf[:, :, :n]`` of a 4-D buffer, else None."""
    base = view._base
    if base is None or base.dim() != 4 or base.dtype != view.dtype:
        return None
    if base.data_ptr() != view.data_ptr() or base.stride() != view.stride():
        return None
    if base.shape[:2] != view.shape[:2] or base.shape[3] != view.shape[3]:
        return None
    return base


def _dynamic_buffers(layer, needed: int) -> Tuple[Tensor, Tensor]:
    """(key, value) buffers of at least ``needed`` slots whose leading part holds the layer's
    keys/values; new buffers (capacity ~1.25x, rounded) when they are missing or too short."""
    keys, values = layer.keys, layer.values
    kb, vb = _buffer_of(keys), _buffer_of(values)
    if kb is not None and vb is not None and kb.shape[2] >= needed and vb.shape[2] >= needed:
        return kb, vb
    grow = max(needed // 4, _GROWTH_MIN)
    capacity = -(-(needed + grow) // _GROWTH_MIN) * _GROWTH_MIN
    past = keys.shape[2]
    bufs = []
    for t in (keys, values):
        buf = t.new_empty((t.shape[0], t.shape[1], capacity, t.shape[3]))
        buf[:, :, :past].copy_(t)
        bufs.append(buf)
    return bufs[0], bufs[1]
