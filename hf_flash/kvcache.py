"""``flash_attn_with_kvcache``: attention over a KV cache with in-place append, flash-attn 2.x API.

One call appends the new keys/values to the cache (rotating the keys), rotates the queries, and
attends over everything the cache holds for each batch row, in one kernel launch (plus a small
combine launch when the key range is split across programs). See :mod:`hf_flash.kernels.decode`
for the algorithm.

Which cache rows a batch row attends to, for ``cache_seqlens = 5``, ``cache_leftpad = 2``,
two new tokens (``k``/``v`` with seqlen 2) and ``seqlen_q = 2``, causal::

    cache row       0 1 2 3 4 5 6 7
    contents        . . c c c n n .      c: cached, n: appended by this call, .: unused
    query 0         0 0 1 1 1 1 0 0
    query 1         0 0 1 1 1 1 1 0

Causal masking is bottom-right aligned over the rows actually attended (``leftpad`` to
``cache_seqlens + seqlen_new``); sliding windows count in the same coordinates. Rotary angles
use the cache row: new key ``t`` at row ``cache_seqlens + t``, query ``i`` at
``cache_seqlens + i`` (causal or windowed) or at ``cache_seqlens`` (otherwise), as flash-attn.

GQA: query head ``h`` reads K/V head ``h // (nheads // nheads_k)``; the kernel processes the
query heads of a group together so each K/V tile is read once per group.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _checks
from ._checks import unit_last_stride
from ._runtime import host_reads_allowed
from .decode import decode_attention

__all__ = ["flash_attn_with_kvcache"]


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    cache_seqlens: Optional[Union[int, Tensor]] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    learnable_sink: Optional[Tensor] = None,
):
    """Attention of ``q`` over a KV cache, appending ``k``/``v`` to it in place first.

    Typical decode step: ``out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
    cache_seqlens=lens, causal=True)`` then ``lens += 1``. The new tokens are written to the
    cache and attended in the same launch, so no separate cache update is needed. No host
    synchronisation happens on the launch path: the call can be captured in a CUDA graph
    (input values are checked on the host first, one sync, except while capturing or compiling).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim). float16, bfloat16 or float32. seqlen_q >= 1
            (several queries: speculative or chunked decoding, with bottom-right causal).
        k_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with ``block_table``
            (num_pages, page_size, nheads_k, headdim), page_size a multiple of 16. Same dtype as
            q. Any strides with a unit last stride (e.g. a transposed (B, H, S, D) buffer).
            Updated in place when ``k`` is given.
        v_cache: same shape as k_cache.
        k: (batch, seqlen_new, nheads_k, headdim). Optional new keys, appended at
            ``cache_seqlens`` (after rotary, if given). Default None.
        v: (batch, seqlen_new, nheads_k, headdim). New values; with k or not at all.
        rotary_cos: (seqlen_ro, rotary_dim / 2), seqlen_ro >= the cache's row count. With
            rotary_sin, rotates q and the new k in the kernel (see module docstring for the
            positions); only together with k/v. Features past rotary_dim are unchanged.
            hf_flash extension: per-token tables (batch or 1, seqlen_new, rotary_dim / 2) hold
            the angles of the new tokens themselves (new key t and query t use row t; needs
            seqlen_q == seqlen_new), for callers whose positions are not cache rows
            (transformers' left-padded batches).
        rotary_sin: same shape as rotary_cos.
        cache_seqlens: int or (batch,) int32 on q's device. Tokens already in each row's cache
            (before this call's append). Default None: the whole cache (needs k=None).
        cache_batch_idx: (batch,) int32. Row ``b`` uses cache row ``cache_batch_idx[b]``.
            Default None: row b. Not with block_table.
        cache_leftpad: (batch,) int32. Row b's cache starts at row ``cache_leftpad[b]``
            (left-padded prompts); earlier rows are ignored. Default None: 0.
        block_table: (batch, max_pages_per_sequence) int32. Paged cache: logical row p of
            batch row b lives in page ``block_table[b, p // page_size]``. Default None.
        softmax_scale: float. Default 1 / sqrt(headdim).
        causal: bool. Bottom-right aligned causal mask (query i sees keys up to
            ``seqlen_k - seqlen_q + i``, seqlen_k counted from the left pad, new tokens
            included).
        window_size: (left, right). Sliding window in the same coordinates; a negative bound is
            unbounded.
        softcap: float. If > 0, scores become ``softcap * tanh(scores / softcap)``.
        rotary_interleaved: bool. True: rotate pairs (2i, 2i + 1) (GPT-J); False: pairs
            (i, i + rotary_dim / 2) ("rotate half", Llama). Default True, as flash-attn.
        alibi_slopes: (nheads,) or (batch, nheads), float32. Bias ``-slope * |i' - j|`` in the
            same coordinates.
        num_splits: int. Number of key-range splits (flash-decoding). 0 picks one from the
            batch, heads, cache size and SM count; 1 disables the combine step.
        return_softmax_lse: bool. Also return the log-sum-exp.
        learnable_sink: (nheads,) sink logits, as in :func:`hf_flash.flash_attn_func` (gpt-oss);
            the log-sum-exp includes them. Default None.

    Return:
        out: (batch, seqlen_q, nheads, headdim), q's dtype.
        softmax_lse [if return_softmax_lse]: (batch, nheads, seqlen_q), float32, natural log;
            +inf for queries that see no key (their output is 0).
    """
    if not torch.compiler.is_compiling():
        _validate(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, softmax_scale, window_size, softcap, alibi_slopes,
            num_splits, learnable_sink,
        )  # fmt: skip
    _checks.check_cache_strides(k_cache, v_cache)
    batch = q.shape[0]
    if cache_seqlens is None:
        full = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
        cache_seqlens = torch.full((batch,), full, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if rotary_cos is not None and (
        rotary_cos.stride(-1) != 1 or rotary_cos.stride() != rotary_sin.stride()
    ):
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    local = _checks.kernel_window(False, window_size) != (-1, -1)
    out, lse = decode_attention(
        unit_last_stride(q), k_cache, v_cache, k_new=unit_last_stride(k),
        v_new=unit_last_stride(v), key_end=cache_seqlens, key_start=cache_leftpad,
        cache_batch_idx=cache_batch_idx, block_table=block_table, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, alibi_slopes=alibi_slopes, softmax_scale=scale, causal=causal,
        window_size=window_size, softcap=softcap, rotary_interleaved=rotary_interleaved,
        rotary_q_per_row=causal or local, num_splits=num_splits, sinks=learnable_sink,
    )  # fmt: skip
    return (out, lse) if return_softmax_lse else out


# --------------------------------------------------------------------------------------------
# Validation (every check before any kernel runs; the value checks cost one device sync)
# --------------------------------------------------------------------------------------------


def _validate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
              cache_leftpad, block_table, softmax_scale, window_size, softcap, alibi_slopes,
              num_splits, learnable_sink=None) -> None:  # fmt: skip
    _checks.check_tensor_basics(q, k_cache, v_cache)
    _checks.check_dims(
        4, "(q (batch, seqlen_q, nheads, headdim), caches (batch_cache, seqlen_cache, nheads_k, "
        "headdim) or, paged, (num_pages, page_size, nheads_k, headdim))",
        q=q, k_cache=k_cache, v_cache=v_cache,
    )  # fmt: skip
    _checks.check_caches(k_cache, v_cache)
    batch, _, nheads, head_dim = q.shape
    _, cache_rows, nheads_k, cache_dim = k_cache.shape
    _checks.check_heads(nheads, nheads_k, nheads_k, head_dim, cache_dim, cache_dim)
    _checks.check_options(
        softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, nheads=nheads, batch=batch, learnable_sink=learnable_sink,
        device=q.device,
    )  # fmt: skip
    capacity = _check_cache_layout(q, k_cache, cache_batch_idx, block_table)
    seqlen_new = _checks.check_new_tokens(q, k, v, nheads_k, head_dim)
    if seqlen_new and cache_seqlens is None:
        raise ValueError("appending k/v needs cache_seqlens (where each row's new tokens go)")
    _check_rotary(q, k, rotary_cos, rotary_sin, seqlen_new, capacity)
    if cache_seqlens is not None and not isinstance(cache_seqlens, int):
        _checks.check_index_tensor("cache_seqlens", cache_seqlens, batch, q.device)
    elif isinstance(cache_seqlens, int) and not 0 <= cache_seqlens + seqlen_new <= capacity:
        raise ValueError(
            f"cache_seqlens={cache_seqlens} plus {seqlen_new} new tokens does not fit a cache "
            f"of {capacity} rows"
        )
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            _checks.check_index_tensor(name, t, batch, q.device)
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits={num_splits!r} must be an int >= 0 (0 = automatic)")
    if host_reads_allowed():  # reading values syncs: not while tracing or capturing
        _check_index_values(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                            batch, capacity, seqlen_new)  # fmt: skip


def _check_cache_layout(q, k_cache, cache_batch_idx, block_table) -> int:
    """Paged or not, the cache fits the batch; returns the rows each batch row can hold."""
    batch = q.shape[0]
    cache_rows = k_cache.shape[1]
    if block_table is not None:
        _checks.check_paged_cache(block_table, batch, cache_rows, q.device)
        if cache_batch_idx is not None:
            raise ValueError(
                "cache_batch_idx cannot be combined with block_table: the page table already "
                "selects each row's cache"
            )
        return block_table.shape[1] * cache_rows
    if cache_batch_idx is None and k_cache.shape[0] != batch:
        raise ValueError(
            f"k_cache holds {k_cache.shape[0]} sequences but q has batch {batch}; pass "
            f"cache_batch_idx to pick cache rows, or caches of batch size {batch}"
        )
    return cache_rows


def _check_rotary(q, k, rotary_cos, rotary_sin, seqlen_new: int, capacity: int) -> None:
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("pass both rotary_cos and rotary_sin or neither")
    if rotary_cos is None:
        return
    batch, seqlen_q, _, head_dim = q.shape
    if k is None:
        raise ValueError(
            "rotary_cos/rotary_sin are applied to q and the new k only: pass k and v too, "
            "or rotate q yourself"
        )
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor")
        if t.dim() not in (2, 3) or t.device != q.device:
            raise ValueError(
                f"{name} must be (seqlen_ro, rotary_dim / 2) or per token (batch, seqlen_new, "
                f"rotary_dim / 2), on {q.device}; got shape {tuple(t.shape)} on {t.device}"
            )
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(
            f"rotary_cos {tuple(rotary_cos.shape)} and rotary_sin "
            f"{tuple(rotary_sin.shape)} differ in shape"
        )
    rotary_dim = 2 * rotary_cos.shape[-1]
    if not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"rotary_dim = 2 * rotary_cos.shape[-1] = {rotary_dim} must be in 1..headdim "
            f"({head_dim})"
        )
    if rotary_cos.dim() == 3:
        if rotary_cos.shape[0] not in (1, batch) or rotary_cos.shape[1] != seqlen_new:
            raise ValueError(
                f"per-token rotary tables have shape {tuple(rotary_cos.shape)}; expected "
                f"({batch} or 1, seqlen_new={seqlen_new}, rotary_dim / 2)"
            )
        if seqlen_q != seqlen_new:
            raise ValueError(
                f"per-token rotary tables need seqlen_q ({seqlen_q}) == seqlen_new "
                f"({seqlen_new}): query i is rotated like new token i"
            )
    elif rotary_cos.shape[0] < capacity:
        raise ValueError(
            f"rotary_cos/sin have {rotary_cos.shape[0]} positions but the cache holds "
            f"{capacity} rows; they must cover every cache row"
        )


def _check_index_values(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                        batch: int, capacity: int, seqlen_new: int) -> None:  # fmt: skip
    """The index tensors' values (one device sync)."""
    if isinstance(cache_seqlens, Tensor):
        lens = cache_seqlens.tolist()
        bad = [b for b, n in enumerate(lens) if not 0 <= n <= capacity - seqlen_new]
        if bad:
            b = bad[0]
            raise ValueError(
                f"cache_seqlens[{b}]={lens[b]} plus {seqlen_new} new tokens does not fit a "
                f"cache of {capacity} rows (cache_seqlens must be in [0, {capacity - seqlen_new}])"
            )
    else:
        n = capacity if cache_seqlens is None else cache_seqlens
        lens = [n] * batch
    if cache_leftpad is not None:
        pads = cache_leftpad.tolist()
        for b, (p, n) in enumerate(zip(pads, lens)):
            if not 0 <= p <= n:
                raise ValueError(
                    f"cache_leftpad[{b}]={p} must be in [0, cache_seqlens[{b}]={n}]"
                )
    if cache_batch_idx is not None:
        idx = cache_batch_idx.tolist()
        if min(idx) < 0 or max(idx) >= k_cache.shape[0]:
            raise ValueError(
                f"cache_batch_idx values must be in [0, {k_cache.shape[0]}), got {idx[:8]}..."
            )
    if block_table is not None:
        page_size = k_cache.shape[1]
        for b, n in enumerate(lens):
            used = -(-(n + seqlen_new) // page_size)
            pages = block_table[b, :used]
            if used and (int(pages.min()) < 0 or int(pages.max()) >= k_cache.shape[0]):
                raise ValueError(
                    f"block_table[{b}] refers to pages outside [0, {k_cache.shape[0]}) within "
                    f"its first {used} entries (the pages holding its {n + seqlen_new} tokens)"
                )
