"""The attention and mask functions behind ``attn_implementation="hf_flash"``.

This module is plain PyTorch on top of :mod:`hf_flash.interface`; it never imports transformers,
so it can be unit-tested on its own. :mod:`hf_flash.integration.registration` plugs the two
functions into transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

Contract with transformers (5.17 ... 5.x)::

    hf_flash_attention_forward(module, query, key, value, attention_mask, dropout, scaling, ...)
        query (B, Hq, Sq, D), key/value (B, Hkv, Skv, D)  ->  (out (B, Sq, Hq, D), None)

``attention_mask`` is what :func:`hf_flash_mask` returned for this forward pass: ``None`` (no
padding: every key is valid) or a 2-D bool ``(B, M)`` key mask with ``M <= Skv``. Keys at index
``>= M`` are never valid: that is how a StaticCache's zero-padded ``max_cache_len`` buffer is
described, exactly as transformers' FlashAttention path does. The queries are the last ``Sq``
positions of the mask (``M - Sq ... M - 1``), except a single query (a decode step), which sits
at the end of its row's valid keys: a static-cache decode step gets its mask padded with False to
the cache length (one input shape for the compiled step), so ``M`` is not its position there.

Padded batches never gather or copy tokens. The valid keys of row ``b`` form one contiguous block
``[s_b, e_b)`` (left or right padding, checked by :func:`hf_flash_mask`), so the flattened
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
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import Tensor

from ..interface import host_reads_allowed, interpreter_active
from ..kernels.key_mask import key_mask_rows
from . import ATTN_IMPLEMENTATION

__all__ = ["ATTN_IMPLEMENTATION", "hf_flash_attention_forward", "hf_flash_mask"]

_HALF = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Mask function (once per forward pass and mask type)
# --------------------------------------------------------------------------------------------


def hf_flash_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[Tensor] = None,
    **kwargs,
) -> Optional[Tensor]:
    """FlashAttention-style mask for transformers' ``AttentionMaskInterface``.

    Returns ``None`` when every key of the layer is valid, else a 2-D bool ``(batch, M)`` key mask
    (``M <= kv_length``; see the module docstring). For one query on a static cache layer
    (``q_offset`` a tensor) ``M`` is always ``kv_length``, the entries past the tokens written so
    far False, and the mask is returned even when every slot is valid: a compiled decode step
    then sees one kind of input on every step, the one that fills the cache included. Causality, sliding windows and packed sequences are not encoded here: the kernel
    applies them.

    Arguments (transformers' mask-interface keywords):
        batch_size, q_length, kv_length: int. Sizes of this layer's attention.
        q_offset: int or 0-d tensor. Tokens the cache held before this forward pass (a tensor for
            StaticCache layers).
        kv_offset: int. Absolute position of key index 0 (sliding-window caches).
        attention_mask: (batch, >= kv_length) bool, or None. The user's padding mask.
        kwargs: ``use_vmap=True`` means the model combined a custom ``or``/``and`` mask function
            (e.g. bidirectional image tokens), which a flash kernel cannot express: rejected.

    Outside torch.compile the mask is read once on the host (one Triton launch,
    :mod:`hf_flash.kernels.key_mask`, and one sync per forward pass and mask type, as
    transformers' own flash mask reads it): an all-valid mask becomes None, and padding in
    the middle of a row raises. That read stays on decode steps too: the decode path would
    otherwise attend the padding inside a row (a right-padded prompt continued by generate is
    the usual way to get one), and eager generate() already waits for the device once per step
    (its stopping check), so the read only waits for the few mask ops queued since. The row
    bounds it computes are kept for the attention layers of the same forward pass
    (:func:`_key_blocks`). While compiling nothing is read back: the mask is passed on as is,
    and it must then be left/right padding (what tokenizers and generate produce); with no user
    mask, a static cache layer's valid slots (its fill level, a device tensor) become a
    ``kv_length`` mask built on the device.
    """
    if kwargs.get("use_vmap", False):
        raise ValueError(
            "attn_implementation='hf_flash' cannot apply this model's custom mask function "
            "(an or_mask_function/and_mask_function, e.g. bidirectional attention over image "
            "tokens); load the model with attn_implementation='sdpa' or 'eager' for this input"
        )
    compiling = torch.compiler.is_compiling()
    # a one-token step on a static cache layer (q_offset: its fill-level tensor): the key mask
    # keeps the cache's full width every step, and is never replaced by None (see below)
    static_step = q_length == 1 and isinstance(q_offset, Tensor)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"hf_flash needs a 2-D (batch, kv_len) padding mask, got shape "
                f"{tuple(attention_mask.shape)}; custom 4-D masks need attn_implementation='sdpa'"
            )
        mask = attention_mask[:, -kv_length:]
        if compiling:  # no host reads while tracing; the attention handles any contiguous mask
            return mask if mask.dtype == torch.bool else mask != 0
        width = kv_length if static_step else mask.shape[1]
        out, start, end, all_valid, contiguous = _mask_stats(mask, width)
        if not contiguous:
            raise ValueError(
                "attention_mask has padding inside a sequence (a 0 between two 1s in a row); "
                "hf_flash supports left and right padding only. Pack such inputs as separate "
                "sequences (position_ids restarts) instead"
            )
        # None (no padding) would make a compiled static-cache step see a second kind of input
        # on its last step, when the cache is full: a recompile and a second CUDA graph
        if all_valid and mask.shape[1] == kv_length and not static_step:
            return None
        _remember_key_blocks(out, start, end)
        return out
    # No user mask: every key written so far is valid. Only a static cache has more key slots
    # (zero-filled) than that, and its layers report how many tokens they hold.
    valid = q_offset + q_length - kv_offset
    if isinstance(valid, Tensor):
        if compiling:
            # no host read while tracing: the first ``valid`` of the kv_length slots, built on
            # the device at the cache's fixed size (one input shape for every decode step)
            slots = torch.arange(kv_length, device=valid.device)
            return (slots < valid).unsqueeze(0).expand(batch_size, kv_length)
        valid = int(valid)
    if valid >= kv_length and not static_step:
        return None
    device = kwargs.get("device")
    if device is None:
        device = q_offset.device if isinstance(q_offset, Tensor) else "cpu"
    mask = torch.ones(batch_size, min(valid, kv_length), dtype=torch.bool, device=device)
    return _fixed_size_for_decode(mask, q_length, kv_length, q_offset)


def _fixed_size_for_decode(mask: Tensor, q_length: int, kv_length: int, q_offset) -> Tensor:
    """A one-token step on a static cache layer (``q_offset`` is its fill-level tensor) gets its
    key mask padded with False up to the cache's ``kv_length`` slots.

    generate() builds this mask outside the compiled decode step and feeds it in; at its natural
    length (past + 1) it grows every step, so Inductor would see a new input shape and record a
    new CUDA graph per token. Padded, the shape is fixed. The meaning is unchanged: a single
    query sits at the end of its row's valid block (module docstring), and the appended False
    entries lie beyond it. Several queries keep the natural length, which places them.
    """
    if q_length != 1 or not isinstance(q_offset, Tensor) or mask.shape[1] >= kv_length:
        return mask
    return torch.nn.functional.pad(mask, (0, kv_length - mask.shape[1]), value=False)


def _mask_stats(mask: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor, bool, bool]:
    """``(out, start, end, all_valid, contiguous)`` of a (B, M) padding mask, one device sync:
    ``out`` the (B, width) bool mask (``width >= M``, padded with False), ``start``/``end``
    each row's valid block in ``out`` as int32 device tensors (:func:`_valid_block`'s
    convention), ``all_valid`` every one of the M entries valid, ``contiguous`` every row's
    valid entries contiguous. One Triton launch (:mod:`hf_flash.kernels.key_mask`) where the
    kernels run; torch ops on a CPU without Triton's interpreter."""
    rows = key_mask_rows if mask.is_cuda or interpreter_active() else _mask_rows_torch
    out, stats = rows(mask, width)
    start, end = stats[0], stats[1]
    starts, ends, counts = stats.tolist()
    all_valid = all(c == mask.shape[1] for c in counts)
    contiguous = all(e - s == c for s, e, c in zip(starts, ends, counts))
    return out, start, end, all_valid, contiguous


def _mask_rows_torch(mask: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """:func:`hf_flash.kernels.key_mask.key_mask_rows` in torch ops, where Triton cannot run (a
    CPU without its interpreter): ``(out, stats)`` with the same meaning."""
    out = mask if mask.dtype == torch.bool else mask != 0
    out = torch.nn.functional.pad(out, (0, width - mask.shape[1]), value=False)
    start, end = _valid_block(out)
    return out, torch.stack([start, end, out.sum(dim=1)]).to(torch.int32)


def first_valid(mask: Tensor) -> Tensor:
    """Per row of a (B, M) bool key mask, the index of the first True entry (M if none), int64."""
    # int64 throughout: Inductor (torch 2.11) mis-types an int32 where/amin reduction whose
    # scalar branch it promotes to int64, and fails to compile the static-cache decode step
    pos = torch.arange(mask.shape[1], device=mask.device, dtype=torch.int64)
    return torch.where(mask, pos, mask.shape[1]).amin(dim=1)


def _valid_block(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per row, the first valid index and one past the last: ``[s, e)``; ``s = e = M`` if none."""
    start = first_valid(mask)
    pos = torch.arange(mask.shape[1], device=mask.device, dtype=torch.int64)
    end = torch.where(mask, pos + 1, 0).amax(dim=1)
    return start, torch.maximum(end, start)


# int32 (key_start, key_end) of the last few key masks seen by the decode path, as
# (weakref to the mask, its version counter, bounds). Every layer of a forward pass gets the
# same mask tensor (the one hf_flash_mask returned), so the bounds are computed once per pass
# and mask type instead of once per layer; a model with sliding and full layers alternates
# between two masks, hence a few entries. A new tensor, or the same one modified in place (its
# version changes), misses.
_KEY_BLOCKS_SLOTS = 4
_key_blocks_cache: list = []


def _cacheable_mask(mask) -> bool:
    # inference tensors have no version counter to detect in-place changes; while tracing or
    # capturing a CUDA graph, tensors made there hold no value outside it
    return (
        type(mask) is Tensor
        and host_reads_allowed()  # first: dynamo cannot trace is_inference()
        and not mask.is_inference()
    )


def _key_blocks(mask: Tensor) -> tuple[Tensor, Tensor]:
    """int32 ``(key_start, key_end)`` of each row's valid block, cached per mask tensor."""
    cacheable = _cacheable_mask(mask)
    if cacheable:
        version = mask._version
        for ref, ver, blocks in _key_blocks_cache:
            if ref() is mask and ver == version:
                return blocks
    start, end = _valid_block(mask)
    blocks = (start.to(torch.int32), end.to(torch.int32))
    if cacheable:
        _store_key_blocks(mask, blocks)
    return blocks


def _remember_key_blocks(mask: Tensor, start: Tensor, end: Tensor) -> None:
    """Record int32 bounds hf_flash_mask has already computed, for the attention layers to
    reuse."""
    if _cacheable_mask(mask):
        _store_key_blocks(mask, (start, end))


def _store_key_blocks(mask: Tensor, blocks) -> None:
    global _key_blocks_cache
    live = [e for e in _key_blocks_cache if e[0]() is not None and e[0]() is not mask]
    ref = weakref.ref(mask, _forget_key_blocks)
    _key_blocks_cache = [(ref, mask._version, blocks)] + live[: _KEY_BLOCKS_SLOTS - 1]


def _forget_key_blocks(dead: weakref.ref) -> None:
    """A cached mask died: free its bounds with it. Small device tensors kept alive past their
    forward pass shift the caching allocator's small-block pattern from one generate() call to
    the next; a fresh StaticCache (generate makes one per call) then gets its fill-level tensors
    at new addresses, and the compiled decode step re-records its CUDA graph on every call."""
    global _key_blocks_cache
    _key_blocks_cache = [e for e in _key_blocks_cache if e[0] is not dead]


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
        attention_mask: None or the 2-D bool key mask from :func:`hf_flash_mask`.
        dropout: float. Attention dropout (the module passes 0 in eval).
        scaling: float. Softmax scale; default 1/sqrt(D).
        sliding_window: int. Key j is visible to query i iff ``i - w < j <= i`` (causal).
        softcap: float. Logit soft-capping (Gemma 2); None or 0 disables it.
        is_causal: bool. Defaults to ``module.is_causal``.
        s_aux: attention sinks; not supported (raises).
        kwargs: ``position_ids`` (packed sequences are detected from restarts), and
            ``cu_seq_lens_q/k``, ``max_length_q/k`` from ``DataCollatorWithFlattening``.
            ``cache`` (a ``PagedAttentionCache``) with its batch keywords comes from
            transformers' continuous batching (``generate_batch``): the step runs on the varlen
            or paged kernels, see :mod:`hf_flash.integration.continuous_batching`.

    Return:
        (out (B, Sq, Hq, D), None). Attention probabilities are never materialised.
    """
    if s_aux is not None:
        raise ValueError(
            "hf_flash does not support attention sinks (s_aux); use attn_implementation='eager' "
            "or 'sdpa' for this model"
        )
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
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    opts = dict(
        dropout_p=float(dropout or 0.0),
        softmax_scale=scaling,
        causal=causal,
        window_size=_window(sliding_window),
        softcap=float(softcap or 0.0),
    )
    cache = kwargs.pop("cache", None)
    if cache is not None:  # transformers' continuous batching (generate_batch)
        if value.shape[-1] != query.shape[-1]:
            raise ValueError(
                f"continuous batching with hf_flash needs one head dim for query and value, got "
                f"{query.shape[-1]} and {value.shape[-1]}"
            )
        from .continuous_batching import paged_cache_attention

        return paged_cache_attention(module, query, key, value, cache, opts, kwargs), None

    batch, _, seqlen_q, head_dim = query.shape
    seqlen_k = key.shape[2]

    # (B, S, H, D) views; projections are usually laid out this way already, so no copy.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    v_head_dim = v.shape[-1]
    if v_head_dim < head_dim:  # MLA-style smaller value heads: pad, crop the output below
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))
    q, k, v = _cast_to_kernel_dtype(module, q, k, v)

    if _decode_shaped(seqlen_q, seqlen_k, attention_mask, opts, kwargs):
        out = _decode_attention(q, k, v, attention_mask, opts)
    elif attention_mask is not None:
        out = _padded_attention(q, k, v, attention_mask, causal, opts)
    elif _has_varlen_kwargs(kwargs):
        out = _packed_attention(
            q, k, v, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"],
            kwargs["max_length_q"], kwargs["max_length_k"], opts,
        )  # fmt: skip
    else:
        packed = None
        if seqlen_q == seqlen_k and seqlen_q > 1:
            packed = _boundaries_from_position_ids(kwargs.get("position_ids"), batch, seqlen_q)
        if packed is not None:
            cu, max_len = packed
            out = _packed_attention(q, k, v, cu, cu, max_len, max_len, opts)
        else:
            from hf_flash.interface import flash_attn_func

            out = flash_attn_func(q, k, v, **opts)

    if v_head_dim < head_dim:
        out = out[..., :v_head_dim]
    return out, None


# Few queries over a longer history (a decode step): the split-KV decode kernel reads each K/V
# tile once per GQA group and spreads long contexts over the GPU; the prefill kernel would give
# each (row, query head) one program. More queries than this is a prefill chunk.
DECODE_MAX_QUERIES = 16


def _decode_shaped(seqlen_q: int, seqlen_k: int, mask, opts, kwargs) -> bool:
    if seqlen_q >= seqlen_k or opts["dropout_p"] > 0.0 or _has_varlen_kwargs(kwargs):
        return False
    if mask is not None:
        # one query per row sits at the end of its row's valid block (module docstring); several
        # queries of a right-padded chunk do not, and go through the varlen path
        return seqlen_q == 1
    return seqlen_q <= DECODE_MAX_QUERIES


def _decode_attention(q, k, v, mask, opts) -> Tensor:
    """Decode step on :func:`hf_flash.kvcache.attend_kv`: row b attends its valid keys
    ``[s_b, e_b)`` (from the mask, on the device: no host sync; computed once per mask tensor,
    not once per layer) or all of them without a mask."""
    from hf_flash.kvcache import attend_kv

    key_start = key_end = None
    if mask is not None:
        if mask.dtype != torch.bool:
            mask = mask != 0
        key_start, key_end = _key_blocks(mask)
    return attend_kv(
        q, k, v, key_start=key_start, key_end=key_end, softmax_scale=opts["softmax_scale"],
        causal=opts["causal"], window_size=opts["window_size"], softcap=opts["softcap"],
    )  # fmt: skip


def _window(sliding_window) -> tuple[int, int]:
    if sliding_window is None or sliding_window is False:
        return (-1, -1)
    w = int(sliding_window)
    if w <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be a positive int or None")
    # transformers' window counts the query itself: i - w < j <= i (flash-attn's inclusive left).
    return (w - 1, w - 1)


def _cast_to_kernel_dtype(module, q, k, v):
    """PEFT (fp32 layer norms) and autocast hand over fp32 q/k/v; run them in the half dtype the
    model computes in, as transformers' flash path does. A genuinely fp32 model stays fp32."""
    if q.dtype != torch.float32:
        return q, k.to(q.dtype), v.to(q.dtype)
    target = None
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        target = torch.get_autocast_dtype(device_type)
    else:
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_is_quantized"):
            target = getattr(config, "dtype", None)
        else:
            for sub in module.modules():
                if isinstance(sub, torch.nn.Linear):
                    target = sub.weight.dtype
                    break
    if target in _HALF:
        return q.to(target), k.to(target), v.to(target)
    return q, k.float(), v.float()


def _has_varlen_kwargs(kwargs) -> bool:
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    return all(kwargs.get(n) is not None for n in names)


def _packed_attention(q, k, v, cu_q, cu_k, max_q, max_k, opts):
    """Sequences already concatenated along the sequence axis (padding-free training)."""
    from hf_flash.interface import flash_attn_varlen_func

    batch, seqlen_q = q.shape[:2]
    device = q.device
    cu_q = cu_q.to(device=device, dtype=torch.int32)
    cu_k = cu_k.to(device=device, dtype=torch.int32)
    out = flash_attn_varlen_func(
        q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
        cu_q, cu_k, _as_int(max_q), _as_int(max_k), **opts,
    )  # fmt: skip
    return out.view(batch, seqlen_q, *out.shape[1:])


def _as_int(x) -> int:
    return int(x.item()) if isinstance(x, Tensor) else int(x)


# The boundaries found in the last position_ids tensor seen. Every layer of a forward pass (and
# its gradient-checkpointing recomputation) gets the same tensor object, so the host read below
# happens once per forward pass instead of once per layer.
_last_boundaries: tuple = (None, None, None)  # (weakref to position_ids, key, boundaries)


def _boundaries_from_position_ids(position_ids, batch: int, seqlen: int):
    """(cu_seqlens, max_seqlen) if position_ids restart inside a row (packed sequences), else
    None. A new sequence starts wherever the position does not follow its predecessor, the rule
    transformers' own masks use. Reads the boundaries on the host: one sync per position_ids
    tensor (cached while that tensor is alive and unmodified)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != seqlen:
        return None
    if position_ids.shape[0] not in (1, batch):
        return None
    if torch.compiler.is_compiling() or position_ids.is_inference():
        # inference-mode tensors have no version counter to key a cache on
        return _find_boundaries(position_ids, batch, seqlen)
    global _last_boundaries
    key = (position_ids._version, batch, seqlen)
    ref, last_key, value = _last_boundaries
    if ref is not None and ref() is position_ids and last_key == key:
        return value
    value = _find_boundaries(position_ids, batch, seqlen)
    _last_boundaries = (weakref.ref(position_ids, _forget_boundaries), key, value)
    return value


def _forget_boundaries(dead: weakref.ref) -> None:
    """The cached position_ids died: free its boundaries with it (see _forget_key_blocks)."""
    global _last_boundaries
    if _last_boundaries[0] is dead:
        _last_boundaries = (None, None, None)


def _find_boundaries(position_ids, batch: int, seqlen: int):
    pos = position_ids.expand(batch, seqlen)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    idx = starts.reshape(-1).nonzero().flatten().cpu()  # the one host read
    if idx.numel() == batch:
        return None  # one sequence per row: the dense kernel is the fast path
    cu = torch.cat([idx, idx.new_tensor([batch * seqlen])]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return cu.to(position_ids.device), max_len


def _padded_attention(q, k, v, mask: Tensor, causal: bool, opts) -> Tensor:
    """Attention over the padded (B, S, H, D) tensors through the varlen kernel, cutting each row
    into the five segments of the module docstring. Device-only arithmetic: no host sync, so the
    StaticCache decode step can be captured in a CUDA graph."""
    from hf_flash.interface import varlen_attention

    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
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
    if mask.dtype != torch.bool:
        mask = mask != 0
    mask = mask.to(q.device)
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
    start, end = _valid_block(mask)
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
