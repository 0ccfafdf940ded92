"""The attention function behind ``attn_implementation="hf_flash"``.

This module is plain PyTorch on top of :mod:`hf_flash.interface` and :mod:`hf_flash.decode`;
it never imports transformers, so it can be unit-tested on its own.
:mod:`hf_flash.integration.registration` plugs it into transformers' ``AttentionInterface``,
and the mask function of :mod:`hf_flash.integration.masks` into ``AttentionMaskInterface``
(re-exported here).

Contract with transformers (5.17 ... 5.x)::

    hf_flash_attention_forward(module, query, key, value, attention_mask, dropout, scaling, ...)
        query (B, Hq, Sq, D), key/value (B, Hkv, Skv, D)  ->  (out (B, Sq, Hq, D), None)

``attention_mask`` is what :func:`~hf_flash.integration.masks.hf_flash_mask` returned for this forward pass: ``None`` (no
padding: every key is valid), a 2-D bool ``(B, M)`` key mask with ``M <= Skv``, or an integer
``(B, S)`` tensor of positions within packed sequences (read as ``position_ids``), or an int32
``(B, Sq, 2)`` tensor of each query row's key range ``[lo, hi)`` (a mask function with image
blocks, :func:`~hf_flash.integration.masks.row_key_bounds`: causality, the window and padding
are inside it, and the kernels' ``key_bounds`` apply it). Keys at index
``>= M`` are never valid: that is how a StaticCache's zero-padded ``max_cache_len`` buffer is
described, exactly as transformers' FlashAttention path does. The queries are the last ``Sq``
positions of the mask (``M - Sq ... M - 1``), except a single query (a decode step), which sits
at the end of its row's valid keys: a static-cache decode step gets its mask padded with False to
the cache length (one input shape for the compiled step), so ``M`` is not its position there.

Left- and right-padded batches never gather or copy tokens. The valid keys of row ``b`` form one
contiguous block ``[s_b, e_b)`` (left or right padding, checked by :func:`hf_flash_mask`), so the
flattened
``(B * S, H, D)`` tensors can be cut into five varlen "sequences" per row, with boundaries
computed on the device (no host sync, CUDA-graph safe)::

    row b, keys    |  pad [0, s)  | valid [s, e) | pad [e, Skv) |
                 A: q [0, qs)  k {}          pad queries see no key: output 0
                 B: q {}       k [0, s)      swallows the left padding
                 C: q [qs, qe) k [s, e)      the real attention (bottom-right aligned)
                 D: q [qe, Sq) k {}          right-pad queries: output 0
                 E: q {}       k [e, Skv)    swallows the right padding / unused cache slots

``qs, qe`` are ``s, e`` moved into query coordinates (``- (M - Sq)``, or ``- (e - 1)`` for a
single query, clamped to ``[0, Sq]``).
For non-causal attention without a window every query is kept (segment C holds all ``Sq``
queries), which is also what eager attention computes for padded query rows.

Padding inside a row (a 0 between two 1s; :func:`hf_flash_mask` marks such a mask,
:func:`~hf_flash.integration.masks.has_holes`) cannot be cut that way: each row's valid keys, and
its queries at valid positions, are gathered into one varlen sequence and the output scattered
back, zero at padded query rows, as transformers' flash_attention_2 unpads every padding mask.
Causal alignment and a sliding window then count valid tokens only, as there (without a window
that is exactly eager's result). A few host reads per layer: this is the eager-mode path for odd
masks, never taken while compiling.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import as_int
from ..decode import MAX_DECODE_QUERIES, attend_kv
from ..interface import dense_attention, flash_attn_varlen_func, varlen_attention
from . import ATTN_IMPLEMENTATION
from .common import cast_to_kernel_dtype, flash_window
from .continuous_batching import paged_cache_attention, updated_step_attention
from .masks import has_holes, hf_flash_mask, is_row_bounds, key_blocks

__all__ = ["ATTN_IMPLEMENTATION", "hf_flash_attention_forward", "hf_flash_mask"]


# --------------------------------------------------------------------------------------------
# Attention function (every layer)
# --------------------------------------------------------------------------------------------


def hf_flash_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[Tensor] = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function running hf_flash's kernels.

    Arguments:
        module: the attention module (reads ``is_causal`` and the projection dtype).
        query: (B, Hq, Sq, D). key, value: (B, Hkv, Skv, D), Hq a multiple of Hkv (GQA/MQA are
            never expanded). RoPE already applied; any strides with a unit last stride.
        attention_mask: None, the 2-D bool key mask from :func:`hf_flash_mask`, its int64
            positions within packed sequences (taken as ``position_ids``), or its int32 per-row
            key ranges (B, Sq, 2) (image blocks; ``is_causal`` and ``sliding_window`` are then
            already inside them).
        dropout: float. Attention dropout (the module passes 0 in eval).
        scaling: float. Softmax scale; default 1/sqrt(D).
        sliding_window: int. Key j is visible to query i iff ``i - w < j <= i`` (causal).
        softcap: float. Logit soft-capping (Gemma 2); None or 0 disables it.
        is_causal: bool. Defaults to ``module.is_causal``.
        s_aux: None or (Hq,) learnable attention sinks (gpt-oss): one more logit per head in
            every row's softmax, with no value; every path takes them (``learnable_sink``).
        kwargs: ``position_ids`` (packed sequences are detected from restarts), and
            ``cu_seq_lens_q/k``, ``max_length_q/k`` from ``DataCollatorWithFlattening``.
            transformers' continuous batching (``generate_batch``) passes its batch keywords
            (``read_index``, ``write_index``, ``block_table``, ...) and, before 5.24, the
            ``PagedAttentionCache`` as ``cache``: the step runs on the varlen or paged kernels,
            see :mod:`hf_flash.integration.continuous_batching`.

    Return:
        (out (B, Sq, Hq, D), None). Attention probabilities are never materialised.
    """
    _check_inputs(query, key, value, kwargs)
    if _is_positions(attention_mask):
        # positions within packed sequences (hf_flash_mask's packed_positions): the model's own
        # position_ids, when it passes them, say the same
        kwargs["position_ids"] = attention_mask
        attention_mask = None
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    opts = dict(
        dropout_p=float(dropout or 0.0),
        softmax_scale=scaling,
        causal=causal,
        window_size=flash_window(sliding_window),
        softcap=float(softcap or 0.0),
        learnable_sink=s_aux,
    )
    cache = kwargs.pop("cache", None)
    # transformers' continuous batching (generate_batch): 5.17 ... 5.23 hand the paged cache
    # over as cache=; from 5.24 on the attention module has updated it, and only the batch
    # keywords (write_index among them) say it is such a step
    if cache is not None or kwargs.get("write_index") is not None:
        if value.shape[-1] != query.shape[-1]:
            raise ValueError(
                f"continuous batching with hf_flash needs one head dim for query and value, got "
                f"{query.shape[-1]} and {value.shape[-1]}"
            )
        if cache is None:
            return updated_step_attention(module, query, key, value, opts, kwargs), None
        return paged_cache_attention(module, query, key, value, cache, opts, kwargs), None

    _, _, seqlen_q, head_dim = query.shape
    seqlen_k = key.shape[2]

    # (B, S, H, D) views; projections are usually laid out this way already, so no copy.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    v_head_dim = v.shape[-1]
    if v_head_dim < head_dim:  # MLA-style smaller value heads: pad, crop the output below
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))
    q, k, v = cast_to_kernel_dtype(module, q, k, v)

    if is_row_bounds(attention_mask):
        out = _bounded_attention(q, k, v, attention_mask, opts, kwargs)
    elif attention_mask is not None and has_holes(attention_mask):
        out = _gathered_attention(q, k, v, attention_mask, causal, opts)
    elif _decode_shaped(seqlen_q, seqlen_k, attention_mask, opts, kwargs):
        out = _decode_attention(q, k, v, attention_mask, opts)
    elif attention_mask is not None:
        out = _padded_attention(q, k, v, attention_mask, causal, opts)
    elif _has_varlen_kwargs(kwargs):
        out = _packed_attention(
            q, k, v, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"],
            kwargs["max_length_q"], kwargs["max_length_k"], opts,
        )  # fmt: skip
    else:  # rows may hold packed sequences (position_ids restarts), found inside the op
        self_attention = seqlen_q == seqlen_k and seqlen_q > 1
        position_ids = kwargs.get("position_ids") if self_attention else None
        out = dense_attention(q, k, v, **opts, position_ids=position_ids)

    if v_head_dim < head_dim:
        out = out[..., :v_head_dim]
    return out, None


def _is_positions(mask: Optional[Tensor]) -> bool:
    return mask is not None and mask.dim() == 2 and not mask.is_floating_point() and mask.dtype != torch.bool


def _check_inputs(query, key, value, kwargs) -> None:
    """What this attention function refuses, before any kernel runs."""
    if kwargs.get("output_attentions", False):
        raise ValueError(
            "output_attentions=True needs the attention probabilities, which hf_flash never "
            "materialises; call model.set_attn_implementation('eager') to get them"
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"expected 4-D (batch, heads, seq, head_dim) query/key/value, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if any(n == 0 for n in query.shape) or any(n == 0 for n in key.shape):
        raise ValueError(
            f"hf_flash got an empty tensor: query {tuple(query.shape)}, key {tuple(key.shape)}"
        )


def _decode_shaped(seqlen_q: int, seqlen_k: int, mask, opts, kwargs) -> bool:
    if seqlen_q >= seqlen_k or opts["dropout_p"] > 0.0 or _has_varlen_kwargs(kwargs):
        return False
    if mask is not None:
        # one query per row sits at the end of its row's valid block (module docstring); several
        # queries of a right-padded chunk do not, and go through the varlen path
        return seqlen_q == 1
    return seqlen_q <= MAX_DECODE_QUERIES


def _decode_attention(q, k, v, mask, opts) -> Tensor:
    """Decode step on :func:`hf_flash.decode.attend_kv`: row b attends its valid keys
    ``[s_b, e_b)`` (from the mask, on the device: no host sync; computed once per mask tensor,
    not once per layer) or all of them without a mask."""
    key_start = key_end = None
    if mask is not None:
        if mask.dtype != torch.bool:
            mask = mask != 0
        key_start, key_end = key_blocks(mask)
    return attend_kv(
        q, k, v, key_start=key_start, key_end=key_end, softmax_scale=opts["softmax_scale"],
        causal=opts["causal"], window_size=opts["window_size"], softcap=opts["softcap"],
        learnable_sink=opts["learnable_sink"],
    )  # fmt: skip


def _bounded_attention(q, k, v, bounds: Tensor, opts, kwargs) -> Tensor:
    """Each query row attends its key range ``bounds[b, i] = [lo, hi)`` (hf_flash_mask's
    :func:`~hf_flash.integration.masks.row_key_bounds`: the mask function's causal, window and
    image-block structure and the padding are all in it, so the layer's causal flag and
    ``sliding_window`` are not applied again), through the dense kernels' ``key_bounds``."""
    batch, seqlen_q = q.shape[:2]
    if _has_varlen_kwargs(kwargs):
        raise ValueError(
            "packed sequences (cu_seq_lens_q/k) with a mask function that has image blocks are not "
            "supported by hf_flash; pass padded rows with an attention_mask instead"
        )
    if tuple(bounds.shape[:2]) != (batch, seqlen_q):
        raise ValueError(
            f"the per-row key ranges from hf_flash's mask function have shape "
            f"{tuple(bounds.shape)}, but the layer has batch {batch} and {seqlen_q} queries"
        )
    return dense_attention(
        q, k, v, opts["dropout_p"], opts["softmax_scale"], False, (-1, -1), opts["softcap"],
        learnable_sink=opts["learnable_sink"], key_bounds=bounds.to(q.device),
    )  # fmt: skip


def _has_varlen_kwargs(kwargs) -> bool:
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    return all(kwargs.get(n) is not None for n in names)


def _packed_attention(q, k, v, cu_q, cu_k, max_q, max_k, opts):
    """Sequences already concatenated along the sequence axis (padding-free training)."""
    batch, seqlen_q = q.shape[:2]
    device = q.device
    cu_q = cu_q.to(device=device, dtype=torch.int32)
    cu_k = cu_k.to(device=device, dtype=torch.int32)
    out = flash_attn_varlen_func(
        q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
        cu_q, cu_k, as_int(max_q), as_int(max_k), **opts,
    )  # fmt: skip
    return out.view(batch, seqlen_q, *out.shape[1:])


def _check_padding_mask(mask: Tensor, batch: int, seqlen_q: int, seqlen_k: int) -> Tensor:
    """The (B, M) key mask as bool on the queries' device, after checking its shape."""
    if mask.dim() != 2 or mask.shape[0] != batch:
        raise ValueError(
            f"attention_mask must be a 2-D (batch={batch}, kv_len) padding mask, got shape "
            f"{tuple(mask.shape)}; custom 4-D masks need attn_implementation='sdpa' or 'eager'"
        )
    m = mask.shape[1]
    if m > seqlen_k or m < seqlen_q:
        raise ValueError(
            f"attention_mask covers {m} keys, but the layer has {seqlen_q} queries and "
            f"{seqlen_k} keys; it must cover between seqlen_q and seqlen_k positions"
        )
    return mask if mask.dtype == torch.bool else mask != 0


def _gathered_attention(q, k, v, mask: Tensor, causal: bool, opts) -> Tensor:
    """Padding inside a row (module docstring): each row's valid keys, and its queries at valid
    positions (every query for non-causal attention without a window, and a single decode query),
    gathered into one varlen sequence per row; the output is scattered back, zero elsewhere."""
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    mask = _check_padding_mask(mask, batch, seqlen_q, seqlen_k).to(q.device)
    m = mask.shape[1]
    keys = torch.nn.functional.pad(mask, (0, seqlen_k - m), value=False)  # [B, Skv]; >= M invalid
    keep_all_queries = seqlen_q == 1 or (not causal and tuple(opts["window_size"]) == (-1, -1))
    if keep_all_queries:
        queries = torch.ones(batch, seqlen_q, dtype=torch.bool, device=q.device)
    else:
        queries = mask[:, m - seqlen_q :]  # the queries sit at key positions M - Sq ... M - 1
    len_q, len_k = queries.sum(dim=1), keys.sum(dim=1)  # [B]
    max_q, max_k = torch.stack((len_q.max(), len_k.max())).tolist()  # one host read for both
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    if max_q == 0 or max_k == 0:  # no valid key (or query) anywhere: every output row is zero
        return out
    cu_q = torch.nn.functional.pad(len_q.cumsum(0), (1, 0)).to(torch.int32)
    cu_k = torch.nn.functional.pad(len_k.cumsum(0), (1, 0)).to(torch.int32)
    # boolean indexing keeps row-major order: row b's tokens are cu[b]:cu[b+1]
    got = varlen_attention(
        q[queries], k[keys], v[keys], cu_q, cu_k, max_q, max_k, **opts, check_cu_seqlens=False,
    )  # fmt: skip
    out[queries] = got
    return out


def _padded_attention(q, k, v, mask: Tensor, causal: bool, opts) -> Tensor:
    """Attention over the padded (B, S, H, D) tensors through the varlen kernel, cutting each row
    into the five segments of the module docstring. Device-only arithmetic: no host sync, so the
    StaticCache decode step can be captured in a CUDA graph."""
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    mask = _check_padding_mask(mask, batch, seqlen_q, seqlen_k).to(q.device)
    # Non-causal attention without a window is a pure key-padding mask: every query row sees
    # the valid keys (as eager computes it). Otherwise queries sit at key positions M-Sq..M-1.
    keep_all_queries = not causal and tuple(opts["window_size"]) == (-1, -1)
    cu_q, cu_k = _segment_boundaries(mask, seqlen_q, seqlen_k, keep_all_queries)
    # The boundaries are valid by construction: skip the varlen API's host-side check (a sync).
    out = varlen_attention(
        q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
        cu_q, cu_k, seqlen_q, seqlen_k, **opts, check_cu_seqlens=False,
    )  # fmt: skip
    return out.view(batch, seqlen_q, *out.shape[1:])


def _segment_boundaries(mask: Tensor, seqlen_q: int, seqlen_k: int, keep_all_queries: bool):
    """cu_seqlens_q/k (int32, 5 * B + 1) of the segments A..E per row (module docstring)."""
    batch, m = mask.shape
    start, end = key_blocks(mask)  # computed once per mask tensor, not per layer
    if keep_all_queries:
        q_start = torch.zeros_like(start)
        q_end = torch.full_like(start, seqlen_q)
    else:
        # key position of query 0: the last Sq mask positions; a single query at the end of its
        # row's valid block (the padded static-cache decode mask, module docstring)
        shift = end - 1 if seqlen_q == 1 else m - seqlen_q
        q_start = (start - shift).clamp(0, seqlen_q)
        q_end = (end - shift).clamp(0, seqlen_q)
    zero = torch.zeros_like(start)
    full_q = torch.full_like(start, seqlen_q)
    full_k = torch.full_like(start, seqlen_k)
    rows = torch.arange(batch, device=mask.device, dtype=torch.int64).unsqueeze(1)
    # end of segments A, B, C, D, E in each row, offset by the row's first flattened token
    q_ends = torch.stack([q_start, q_start, q_end, full_q, full_q], dim=1) + rows * seqlen_q
    k_ends = torch.stack([zero, start, end, end, full_k], dim=1) + rows * seqlen_k
    first = torch.zeros(1, dtype=torch.int64, device=mask.device)
    cu_q = torch.cat([first, q_ends.reshape(-1)]).to(torch.int32)
    cu_k = torch.cat([first, k_ends.reshape(-1)]).to(torch.int32)
    return cu_q, cu_k
