"""Gradient checkpointing that keeps the attention output instead of recomputing it.

With plain (non-reentrant) activation checkpointing every decoder layer runs its forward twice:
once in the forward pass, keeping only the layer's input, and again in the backward pass to
rebuild what the layer's backward needs. The second run includes the FlashAttention forward
kernel, whose output and log-sum-exp are exactly what the attention backward reads. PyTorch's
selective activation checkpointing (SAC: ``create_selective_checkpoint_contexts`` in
``torch.utils.checkpoint``) can keep chosen ops' outputs from the first run and hand them to the
recomputation, so the attention forward kernel runs once per layer per step::

                    forward pass                 backward pass (recomputation)
    plain        q,k,v -> attn_fwd -> o_proj     q,k,v -> attn_fwd -> o_proj  -> attn_bwd
    kept         q,k,v -> attn_fwd -> o_proj     q,k,v -> (kept out, lse) -> o_proj -> attn_bwd

Cost: per checkpointed layer the attention output (tokens x heads x head_dim in the compute
dtype, the size of the layer's hidden states for most models) and the log-sum-exp (tokens x
heads, float32) stay alive from the forward to the backward pass.

The op kept is ``torch.ops.hf_flash.attn_fwd`` (dense and varlen/packed attention, padded batches
included): what :func:`hf_flash.flash_attn_func`, :func:`hf_flash.flash_attn_varlen_func` and
``attn_implementation="hf_flash"`` run whenever they are differentiated. It always goes through
the dispatcher, where SAC's dispatch mode sees it; the direct kernel launches that skip the
dispatcher (KV-cache decode, inference rotary) are inference-only.

Speed, measured in the LoRA recipe on an H100 (1.2B Llama shape, 32K tokens): +13% tokens/s
(16.5K -> 18.7K) for +1.9 GiB of peak memory, against recomputing the attention forward (the
prediction was about +10%: 16 layers x 4.4 TFLOP at ~368 TFLOP/s saved from a ~2 s step). SAC's
dispatch modes see every op of the checkpointed layer (in the forward pass and in the
recomputation), which adds host time per op; long contexts hide it behind the GPU work, short
ones may not.

Attention dropout stays exact: the op takes its dropout seed (``rng_state``) as an input drawn
from torch's generator just before it, and the checkpoint replays the RNG state for the
recomputation (``preserve_rng_state=True``, the default, required here), so the recomputed
backward regenerates the same mask the kept output was computed with.

Usage with transformers (5.23 names it ``activation_checkpointing_enable``; 5.17 has only the
now deprecated ``gradient_checkpointing_enable``, which :func:`enable_activation_checkpointing`
falls back to)::

    import hf_flash
    hf_flash.enable_activation_checkpointing(model, hf_flash.gradient_checkpointing_kwargs())
    # transformers >= 5.23, the same thing:
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=hf_flash.gradient_checkpointing_kwargs()
    )

or with ``torch.utils.checkpoint`` directly::

    torch.utils.checkpoint.checkpoint(
        layer, hidden, use_reentrant=False, context_fn=hf_flash.attention_checkpoint_context
    )

This module imports neither transformers nor the kernels: the policy recognises the op by name.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.utils.checkpoint as _checkpoint

__all__ = [
    "ATTENTION_OP_NAME",
    "attention_checkpoint_context",
    "attention_checkpoint_policy",
    "enable_activation_checkpointing",
    "gradient_checkpointing_kwargs",
]

ATTENTION_OP_NAME = "hf_flash::attn_fwd"
"""The custom op whose outputs are kept (``torch.ops.hf_flash.attn_fwd``)."""

# Selective activation checkpointing in eager mode arrived in torch 2.4 (hf_flash needs >= 2.6);
# looked up once, so the policy below (called for every op of every checkpointed forward) is cheap.
_CREATE_SAC = getattr(_checkpoint, "create_selective_checkpoint_contexts", None)
_POLICY = getattr(_checkpoint, "CheckpointPolicy", None)


def _require_sac() -> None:
    if _CREATE_SAC is None or _POLICY is None:
        raise RuntimeError(
            "keeping the attention outputs needs selective activation checkpointing "
            "(torch.utils.checkpoint.create_selective_checkpoint_contexts and CheckpointPolicy), "
            f"which torch {torch.__version__} lacks; upgrade torch (hf_flash supports >= 2.6), or "
            "use plain checkpointing: gradient_checkpointing_kwargs(keep_attention=False)"
        )


def attention_checkpoint_policy(ctx, op, *args, **kwargs):
    """SAC policy: ``MUST_SAVE`` for hf_flash's attention forward op, ``PREFER_RECOMPUTE`` for
    every other op (what plain checkpointing does with all of them). For
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts``, or to combine with your own
    rules."""
    # An OpOverload's name() is "namespace::name" for the default overload. Compared by name:
    # the op need not be registered yet when the policy is built.
    name = getattr(op, "name", None)
    if callable(name) and name() == ATTENTION_OP_NAME:
        return _POLICY.MUST_SAVE
    return _POLICY.PREFER_RECOMPUTE


def attention_checkpoint_context() -> Tuple[Any, Any]:
    """The ``context_fn`` for non-reentrant ``torch.utils.checkpoint.checkpoint``: a fresh pair of
    (forward, recompute) contexts that keep hf_flash's attention outputs (call once per
    checkpointed region, which ``checkpoint`` does)."""
    _require_sac()
    return _CREATE_SAC(attention_checkpoint_policy)


def gradient_checkpointing_kwargs(keep_attention: bool = True, **checkpoint_kwargs) -> dict:
    """Keyword arguments for transformers' ``model.gradient_checkpointing_enable(
    gradient_checkpointing_kwargs=...)`` (or ``activation_checkpointing_enable``), which passes
    them to ``torch.utils.checkpoint.checkpoint``.

    Arguments:
        keep_attention: bool. True: keep hf_flash's attention outputs from the forward pass (the
            attention forward kernel runs once per layer per step instead of twice; costs the
            attention output and log-sum-exp of every checkpointed layer). False: plain
            non-reentrant checkpointing. Default True.
        checkpoint_kwargs: further ``torch.utils.checkpoint.checkpoint`` options
            (``determinism_check``, ``debug``, ...). ``use_reentrant`` must be False (SAC exists
            only for the non-reentrant implementation; it is the default here).
            ``preserve_rng_state`` must stay True with ``keep_attention`` (see the module
            docstring). ``context_fn`` cannot be combined with ``keep_attention``.

    Return:
        dict, e.g. ``{"use_reentrant": False, "context_fn": attention_checkpoint_context}``.
    """
    if not isinstance(keep_attention, bool):
        raise TypeError(f"keep_attention must be a bool, got {type(keep_attention).__name__}")
    kwargs = {"use_reentrant": False, **checkpoint_kwargs}
    if not keep_attention:
        return kwargs
    if kwargs["use_reentrant"] is not False:
        raise ValueError(
            f"use_reentrant={kwargs['use_reentrant']!r} cannot keep the attention outputs: "
            "selective activation checkpointing needs the non-reentrant checkpoint "
            "(use_reentrant=False). Pass use_reentrant=False, or keep_attention=False for "
            "plain reentrant checkpointing"
        )
    if kwargs.get("preserve_rng_state", True) is not True:
        raise ValueError(
            f"preserve_rng_state={kwargs['preserve_rng_state']!r} with keep_attention=True: the "
            "recomputation must replay the forward's RNG state so that attention dropout's "
            "backward regenerates the mask the kept output was computed with. Leave "
            "preserve_rng_state=True (the default), or pass keep_attention=False"
        )
    if kwargs.get("context_fn") is not None:
        raise ValueError(
            "context_fn is already given; keep_attention=True supplies its own "
            "(hf_flash.attention_checkpoint_context). Pass keep_attention=False to use yours, "
            "or add hf_flash.attention_checkpoint_policy's rule to your own SAC policy"
        )
    _require_sac()  # fail at set-up, not in the first training step
    kwargs["context_fn"] = attention_checkpoint_context
    return kwargs


def enable_activation_checkpointing(model, checkpoint_kwargs: dict | None = None) -> None:
    """Switch on transformers' activation (gradient) checkpointing for ``model`` under the name
    the installed transformers has: ``activation_checkpointing_enable`` (5.23+) or, on older
    releases, ``gradient_checkpointing_enable`` (deprecated in 5.23).

    Arguments:
        model: a transformers ``PreTrainedModel`` (peft's wrappers forward the call).
        checkpoint_kwargs: dict or None. Options for ``torch.utils.checkpoint.checkpoint``, e.g.
            :func:`gradient_checkpointing_kwargs`'s result. Default None (transformers' own).
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
