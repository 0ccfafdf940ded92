"""The chunked linear cross-entropy inside a transformers causal LM's own forward.

A ``*ForCausalLM`` model called with ``labels`` (what transformers' ``Trainer`` does) projects
every position through the LM head and upcasts the logits to fp32 before its loss: at 64K tokens
and a 128K vocabulary that is 8 GiB of bf16 logits, 32 GiB in fp32, and their gradient. After
:func:`use_chunked_loss` the model's forward, in training mode and with labels, runs the decoder
and then :func:`hf_flash.training.loss.chunked_linear_cross_entropy` on its last hidden states:
the logits exist one chunk at a time and never reach the caller (``logits`` is None in the
output). Everything else takes the model's own forward unchanged: evaluation (``model.eval()``,
where callers usually want the logits), calls without labels, and generation.

The loss equals transformers' ``ForCausalLMLoss``: labels shifted left by one inside the forward
(or ``shift_labels`` used as given), ``-100`` ignored, the sum divided by ``num_items_in_batch``
when the caller passes it (``Trainer`` does, for exact gradient accumulation) and by the number
of labelled tokens otherwise (a batch with none gives 0, where torch's mean would give NaN).

TRL's ``SFTTrainer`` brings its own fused LM head, which also never builds the full logits: its
calls (``fused_lm_head=True``) pass through this forward untouched, whichever was patched first.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from .loss import IGNORE_INDEX, chunked_linear_cross_entropy

_ATTR = "_hf_flash_original_forward"


class ChunkedLossUnsupported(ValueError):
    """The model's loss is not plain next-token cross-entropy over an unscaled, bias-free head."""


def chunked_loss_problem(model) -> Optional[str]:
    """Why :func:`use_chunked_loss` cannot serve ``model`` (None when it can): the head must be a
    bias-free linear layer whose logits the model neither scales nor soft-caps, and the loss must
    be transformers' causal LM cross-entropy (no MoE router loss added to it)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings") or not hasattr(model, "get_decoder"):
        return f"{type(model).__name__} is not a transformers causal LM (no config/get_decoder/get_output_embeddings)"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        return f"{type(model).__name__} has no output embedding (LM head) weight"
    if getattr(head, "bias", None) is not None:
        return "the LM head has a bias"
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                 "logits_scaling"):  # fmt: skip
        if getattr(text, attr, None) not in (None, 1.0):
            return f"the model's config sets {attr}={getattr(text, attr)!r}, which scales the logits"
    if getattr(text, "output_router_logits", False):
        return "the model adds a router auxiliary loss (output_router_logits=True)"
    loss_type = getattr(model, "loss_type", None) or getattr(config, "loss_type", None)
    if loss_type not in (None, "ForCausalLM"):
        return f"the model's loss_type is {loss_type!r}, not 'ForCausalLM'"
    return None


def _base(model):
    """The transformers model under peft's wrappers (forward is patched there: peft calls it)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def use_chunked_loss(model, chunk_tokens: Optional[int] = None) -> None:
    """Make ``model``'s training forward compute its loss with the chunked linear cross-entropy
    (module docstring). ``model``: a transformers causal LM, or peft's wrapper of one.
    ``chunk_tokens``: tokens per logits chunk (default: 512 MiB of chunk logits). Idempotent;
    :func:`restore_loss` undoes it. Raises :class:`ChunkedLossUnsupported` with the reason for
    models whose loss it would change."""
    base = _base(model)
    problem = chunked_loss_problem(base)
    if problem is not None:
        raise ChunkedLossUnsupported(f"the chunked loss cannot replace this model's loss: {problem}")
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a positive int or None")
    if _ATTR not in base.__dict__:
        setattr(base, _ATTR, base.forward)
    base._hf_flash_chunk_tokens = chunk_tokens
    base.forward = types.MethodType(_forward, base)


def restore_loss(model) -> bool:
    """Undo :func:`use_chunked_loss`; returns whether anything was patched."""
    base = _base(model)
    original = base.__dict__.pop(_ATTR, None)
    if original is None:
        return False
    base.__dict__.pop("forward", None)
    base.__dict__.pop("_hf_flash_chunk_tokens", None)
    return True


def uses_chunked_loss(model) -> bool:
    return _ATTR in _base(model).__dict__


def _forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
             inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, shift_labels=None,
             num_items_in_batch=None, **kwargs):  # fmt: skip
    original = self.__dict__[_ATTR]
    # TRL's fused LM head (patched onto the forward before or after this one) computes its own
    # chunked loss: its calls pass through untouched
    if not self.training or (labels is None and shift_labels is None) or kwargs.get("fused_lm_head"):
        for name, value in (("labels", labels), ("shift_labels", shift_labels),
                            ("num_items_in_batch", num_items_in_batch)):  # fmt: skip
            if value is not None:
                kwargs[name] = value
        return original(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
            logits_to_keep=logits_to_keep, **kwargs,
        )  # fmt: skip
    from transformers.modeling_outputs import CausalLMOutputWithPast

    out = self.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
    )  # fmt: skip
    hidden = out.last_hidden_state
    head = self.get_output_embeddings()
    if shift_labels is None:
        # next-token targets; the last position of every row has none
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    targets = shift_labels.reshape(-1).to(device=head.weight.device, dtype=torch.long)
    hidden = hidden.reshape(-1, hidden.shape[-1]).to(head.weight.device)
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"labels give {targets.shape[0]} targets for {hidden.shape[0]} positions; labels must have "
            "the shape of input_ids (or shift_labels, already shifted)"
        )
    total = chunked_linear_cross_entropy(hidden, head.weight, targets, self._hf_flash_chunk_tokens)
    if num_items_in_batch is None:
        count = (targets != IGNORE_INDEX).sum().clamp(min=1)
    else:
        count = torch.as_tensor(num_items_in_batch, device=total.device)
    loss = total / count.to(total.dtype)
    return CausalLMOutputWithPast(
        loss=loss, logits=None, past_key_values=out.past_key_values,
        hidden_states=getattr(out, "hidden_states", None), attentions=getattr(out, "attentions", None),
    )  # fmt: skip
