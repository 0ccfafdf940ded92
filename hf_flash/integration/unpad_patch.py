"""Padding-free forward passes for padded batches, one model instance at a time.

A right- or left-padded batch ``(B, S)`` with a 2-D ``attention_mask`` spends the projections,
the MLP, the norms and LoRA on every pad token: with sequences of random lengths about half the
work is padding, whatever the attention kernel does. transformers' FlashAttention path unpads
only inside each attention call. This patch unpads once, around the whole decoder stack: the
base model (``LlamaModel``, ``MistralModel``, ...) of a model on ``attn_implementation="hf_flash"``
gets an instance-level ``forward`` that, for a padded batch without a KV cache (training, or
scoring with ``use_cache=False``)::

    input_ids / inputs_embeds (B, S[, H])  --gather valid tokens-->  (1, T[, H])
    position_ids (given, or the default 0..S-1)  --gather-->  (1, T): each token keeps its position
    cu_seq_lens_q/k = [0, n_0, n_0 + n_1, ...], max_length_q/k = max n_b   (int32, host ints)
    attention_mask  -->  None

then runs the model's own forward on the packed row (every attention call takes hf_flash's varlen
path from the ``cu_seq_lens`` keywords, so no token sees another row) and scatters the hidden
states back to ``(B, S, H)``. The outputs at the valid positions are those of the padded forward;
at padding positions the hidden states are zero (the FlashAttention convention; eager returns
values there that depend on the mask, and nothing should read them). ``output_hidden_states``
are re-padded the same way.

When it applies (anything else runs the model's forward untouched):

* a 2-D ``attention_mask`` with at least one padding entry, each row's valid tokens contiguous
  (left or right padding; a 0 between two 1s keeps the per-layer path, where each attention
  call gathers the valid tokens);
* no cache: ``cache`` (``past_key_values`` before transformers 5.24) is None and ``use_cache``
  resolves to False (the argument, else the config, else False under gradient checkpointing in
  training, as transformers resolves it);
  generate's prefill fills a cache in the padded layout and is left alone;
* 2-D (or absent) ``position_ids``, no ``cu_seq_lens``/``max_length`` keywords already given,
  and not while torch.compile traces (the mask is read on the host: one sync per forward pass,
  which replaces the packed-sequence detection's own read).

The patch goes on the base model classes of the families whose row in
:mod:`hf_flash.integration.families` lists ``unpad``, per instance
(:mod:`hf_flash.integration.patching`); :func:`revert_model` removes it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from torch import Tensor

from .families import patch_target
from .masks import mask_rows
from .patching import CACHE_NAMES, is_wrapped, unwrap_forwards, wrap_instances

__all__ = ["patch_model", "revert_model", "is_patched", "unpad_inputs"]

_RECORD = "_hf_flash_unpad_original"  # on a patched module: (attribute name, what it held)
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def patch_model(model) -> bool:
    """Run padded, cache-free forward passes of this model's base model padding-free.

    Returns True when the model's family has the ``unpad`` patch
    (:mod:`hf_flash.integration.families`) and its base model is patched (or already was);
    False, changing nothing, otherwise.
    """
    target = patch_target(model, "unpad")
    if target is None:
        return False
    modeling, family = target
    cls = getattr(modeling, family.base_model)
    # idempotent: post_init runs once per nested PreTrainedModel
    found, _ = wrap_instances(
        model, cls, _RECORD, lambda inner, f=cls.forward: _make_forward(f, inner)
    )
    return found


def revert_model(model) -> int:
    """Undo :func:`patch_model` on every module of ``model``; returns how many were reverted."""
    return unwrap_forwards(model, _RECORD)


def is_patched(module) -> bool:
    """True if this base model unpads padded batches."""
    return is_wrapped(module, _RECORD)


def _make_forward(class_forward, inner):
    signature = inspect.signature(class_forward)

    @functools.wraps(class_forward)
    def forward(self, *args, **kwargs):
        if _RECORD not in self.__dict__:  # reverted while a wrapper still held this function
            return inner(*args, **kwargs)
        # Decode steps and traced calls take the model's forward untouched, before any binding:
        # dynamo cannot trace Signature.bind after generate() mutated a dict it proxies, and a
        # graph break here splits a compiled (CUDA-graph) decode step into one frame per layer.
        if torch.compiler.is_compiling() or _has_cache(kwargs):
            return inner(*args, **kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return inner(*args, **kwargs)  # let the model's own forward report the bad call
        call = dict(bound.arguments)
        call.pop("self", None)
        extra = call.pop(_var_keyword_name(signature), None) or {}
        plan = _plan(self, call, extra)
        if plan is None:
            return inner(*args, **kwargs)
        packed_call, index, batch, seqlen = plan
        out = inner(**packed_call, **extra)
        return _repad_output(out, index, batch, seqlen)

    return forward


def _var_keyword_name(signature) -> Optional[str]:
    for p in signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return p.name
    return None


def _has_cache(kwargs: dict) -> bool:
    # either name: transformers >= 5.24 takes "cache" and still maps "past_key_values" to it
    return any(kwargs.get(name) is not None for name in CACHE_NAMES)


def _resolved_use_cache(module, call) -> bool:
    use_cache = call.get("use_cache")
    if use_cache is None:
        use_cache = getattr(module.config, "use_cache", False)
    if use_cache and getattr(module, "gradient_checkpointing", False) and module.training:
        use_cache = False  # what transformers does (with a warning) before building a cache
    return bool(use_cache)


def _plan(module, call: dict, extra: dict):
    """(packed keyword arguments, flat valid-token index, B, S), or None to run untouched."""
    mask = call.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.dim() != 2 or torch.compiler.is_compiling():
        return None
    if _has_cache(call) or _has_cache(extra) or _resolved_use_cache(module, call):
        return None
    if any(extra.get(k) is not None for k in _VARLEN_KEYS):
        return None
    ids, embeds = call.get("input_ids"), call.get("inputs_embeds")
    if (ids is None) == (embeds is None):
        return None  # the model's forward raises its own error
    source = ids if ids is not None else embeds
    batch, seqlen = source.shape[:2]
    if tuple(mask.shape) != (batch, seqlen):
        return None
    position_ids = call.get("position_ids")
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[-1] != seqlen
                                     or position_ids.shape[0] not in (1, batch)):
        return None
    packed = unpad_inputs(mask)
    if packed is None:
        return None
    index, cu_seqlens, max_len = packed
    new = dict(call)
    new["attention_mask"] = None
    if ids is not None:
        new["input_ids"] = ids.reshape(-1)[index].unsqueeze(0)
    else:
        new["inputs_embeds"] = embeds.reshape(batch * seqlen, *embeds.shape[2:])[index].unsqueeze(0)
    if position_ids is None:
        start = call.get("cache_position")  # transformers < 5.20 forwards take it; else arange
        base = start if isinstance(start, Tensor) and start.shape == (seqlen,) else None
        if base is None:
            base = torch.arange(seqlen, device=source.device)
        position_ids = base.unsqueeze(0)
    new["position_ids"] = position_ids.expand(batch, seqlen).reshape(-1)[index].unsqueeze(0)
    if "cache_position" in new and new["cache_position"] is not None:
        new["cache_position"] = torch.arange(index.numel(), device=source.device)
    new.update(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_len,
               max_length_k=max_len)  # fmt: skip
    return new, index, batch, seqlen


def unpad_inputs(mask: Tensor):
    """For a 2-D padding mask, ``(flat index of the valid tokens, cu_seqlens int32, max length)``
    with every row one sequence, or None when there is nothing to unpad (no padding, a row whose
    valid tokens are not contiguous, or no valid token at all). Reads each row's valid block
    once (:func:`hf_flash.integration.masks.mask_rows`: one launch and one sync)."""
    rows = mask_rows(mask.detach(), mask.shape[1])
    lengths = rows.host_count
    if rows.all_valid or sum(lengths) == 0 or not rows.contiguous:
        return None
    seqlen = mask.shape[1]
    index = torch.cat([
        torch.arange(b * seqlen + s, b * seqlen + e, dtype=torch.int64)
        for b, (s, e) in enumerate(zip(rows.host_start, rows.host_end))
    ])  # fmt: skip
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return (
        index.to(mask.device, non_blocking=True),
        cu.to(mask.device, non_blocking=True),
        max(lengths),
    )


def _repad(t, index: Tensor, batch: int, seqlen: int, total: int):
    if not isinstance(t, Tensor) or t.dim() < 2 or tuple(t.shape[:2]) != (1, total):
        return t
    flat = t[0]
    full = flat.new_zeros((batch * seqlen, *flat.shape[1:]))
    full = full.index_copy(0, index, flat)
    return full.view(batch, seqlen, *flat.shape[1:])


def _repad_output(out, index: Tensor, batch: int, seqlen: int):
    total = index.numel()

    def repad(value):
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, Tensor) for v in value):
            return type(value)(_repad(v, index, batch, seqlen, total) for v in value)
        return _repad(value, index, batch, seqlen, total)

    if hasattr(out, "keys") and hasattr(out, "__setitem__"):  # a transformers ModelOutput
        for key in list(out.keys()):
            if key not in CACHE_NAMES:
                out[key] = repad(out[key])
        return out
    if isinstance(out, tuple):
        return tuple(repad(v) for v in out)
    return out
