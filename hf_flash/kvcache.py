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

from .interface import (
    _check_heads,
    _check_options,
    _check_tensor_basics,
    _prepare,
    eager_call,
    host_reads_allowed,
    interpreter_active,
)
from .kernels import decode as _decode

__all__ = ["flash_attn_with_kvcache", "attend_kv", "append_attend_paged"]

PAGE_MULTIPLE = 16


# --------------------------------------------------------------------------------------------
# Custom op (mutates the caches)
# --------------------------------------------------------------------------------------------


def _attn_with_kvcache_impl(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
    cache_leftpad, block_table, alibi_slopes, softmax_scale, rotary_q_per_row, window_left,
    window_right, softcap, rotary_interleaved, num_splits, cache_heads_first,
):  # fmt: skip
    """``cache_heads_first``: the caches are (batch, nheads_k, seqlen, headdim) buffers
    (transformers' layout), viewed here, inside the op, so torch.compile sees the buffers
    themselves as the mutated arguments."""
    if cache_heads_first:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    out = torch.empty_like(q)
    b, s, h, _ = q.shape
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    _decode.flash_decode(
        q, k_cache, v_cache, k, v, out, lse,
        cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, block_table=block_table,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        rotary_q_per_row=rotary_q_per_row, softmax_scale=softmax_scale,
        window_left=window_left, window_right=window_right, softcap=softcap,
        alibi_slopes=alibi_slopes, num_splits=num_splits,
    )  # fmt: skip
    return out, lse


@torch.library.custom_op("hf_flash::attn_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    cache_seqlens: Tensor,
    cache_batch_idx: Optional[Tensor],
    cache_leftpad: Optional[Tensor],
    block_table: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    softmax_scale: float,
    rotary_q_per_row: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    num_splits: int,
    cache_heads_first: bool,
) -> Tuple[Tensor, Tensor]:
    return _attn_with_kvcache_impl(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, alibi_slopes, softmax_scale, rotary_q_per_row, window_left,
        window_right, softcap, rotary_interleaved, num_splits, cache_heads_first,
    )  # fmt: skip


def _run_attn_with_kvcache(*args) -> Tuple[Tensor, Tensor]:
    """Call the op (same arguments as :func:`_attn_with_kvcache`).

    Under torch.compile, or with fake/functional tensors, this is the custom op: the tracer
    must see the cache mutation. In eager mode the op's body runs directly, and the mutated
    caches get their version bump by hand: the dispatcher's generic in-place wrapper for a
    mutating custom op costs ~0.1-0.2 ms of host time per call (it rebuilds the schema's
    argument list for every argument), which a decode step pays once per layer.
    """
    if not eager_call(*(a for a in args if isinstance(a, Tensor))):
        return _attn_with_kvcache(*args)
    out = _attn_with_kvcache_impl(*args)
    if args[3] is not None:  # new k/v were appended: k_cache and v_cache changed in place
        torch.autograd.graph.increment_version(args[1])
        torch.autograd.graph.increment_version(args[2])
    return out


@_attn_with_kvcache.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
      cache_leftpad, block_table, alibi_slopes, softmax_scale, rotary_q_per_row, window_left,
      window_right, softcap, rotary_interleaved, num_splits, cache_heads_first):  # fmt: skip
    b, s, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_index_tensor(name: str, t, batch: int, device) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32 or tuple(t.shape) != (batch,):
        raise ValueError(
            f"{name} must be an int32 tensor of shape ({batch},), got dtype={t.dtype}, "
            f"shape={tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _validate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
              cache_leftpad, block_table, softmax_scale, window_size, softcap, alibi_slopes,
              num_splits) -> None:  # fmt: skip
    _check_tensor_basics(q, k_cache, v_cache)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D, got shape {tuple(t.shape)}: q (batch, seqlen_q, nheads, "
                "headdim), caches (batch_cache, seqlen_cache, nheads_k, headdim) or, paged, "
                "(num_pages, page_size, nheads_k, headdim)"
            )
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape"
        )
    batch, seqlen_q, nheads, head_dim = q.shape
    _, cache_rows, nheads_k, cache_dim = k_cache.shape
    _check_heads(nheads, nheads_k, nheads_k, head_dim, cache_dim, cache_dim)
    _check_options(0.0, softmax_scale, window_size, softcap, alibi_slopes, nheads, batch)

    if block_table is not None:
        if not isinstance(block_table, Tensor) or block_table.dtype != torch.int32:
            raise TypeError("block_table must be an int32 tensor (batch, max_pages_per_sequence)")
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise ValueError(
                f"block_table has shape {tuple(block_table.shape)}; expected ({batch}, "
                "max_pages_per_sequence >= 1)"
            )
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
        if cache_rows % PAGE_MULTIPLE:
            raise ValueError(
                f"page size (k_cache.shape[1]) is {cache_rows}; paged caches need a multiple of "
                f"{PAGE_MULTIPLE}"
            )
        if cache_batch_idx is not None:
            raise ValueError(
                "cache_batch_idx cannot be combined with block_table: the page table already "
                "selects each row's cache"
            )
        capacity = block_table.shape[1] * cache_rows
    else:
        if cache_batch_idx is None and k_cache.shape[0] != batch:
            raise ValueError(
                f"k_cache holds {k_cache.shape[0]} sequences but q has batch {batch}; pass "
                "cache_batch_idx to pick cache rows, or caches of batch size "
                f"{batch}"
            )
        capacity = cache_rows

    if (k is None) != (v is None):
        raise ValueError("pass both k and v (new tokens to append) or neither")
    seqlen_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(
                    f"{name} must match q's dtype and device ({q.dtype}, {q.device}), got "
                    f"({t.dtype}, {t.device})"
                )
            if t.dim() != 4 or t.shape[0] != batch or tuple(t.shape[2:]) != (nheads_k, head_dim):
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; expected ({batch}, seqlen_new, "
                    f"{nheads_k}, {head_dim})"
                )
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k has {k.shape[1]} new tokens but v has {v.shape[1]}")
        if cache_seqlens is None:
            raise ValueError(
                "appending k/v needs cache_seqlens (where each row's new tokens go)"
            )
        seqlen_new = k.shape[1]

    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("pass both rotary_cos and rotary_sin or neither")
    if rotary_cos is not None:
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

    if cache_seqlens is not None and not isinstance(cache_seqlens, int):
        _check_index_tensor("cache_seqlens", cache_seqlens, batch, q.device)
    elif isinstance(cache_seqlens, int) and not 0 <= cache_seqlens + seqlen_new <= capacity:
        raise ValueError(
            f"cache_seqlens={cache_seqlens} plus {seqlen_new} new tokens does not fit a cache "
            f"of {capacity} rows"
        )
    if cache_batch_idx is not None:
        _check_index_tensor("cache_batch_idx", cache_batch_idx, batch, q.device)
    if cache_leftpad is not None:
        _check_index_tensor("cache_leftpad", cache_leftpad, batch, q.device)
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits={num_splits!r} must be an int >= 0 (0 = automatic)")

    if not host_reads_allowed():  # reading values syncs: not while tracing or capturing
        return
    # value checks (one device sync)
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
        page_size = cache_rows
        for b, n in enumerate(lens):
            used = -(-(n + seqlen_new) // page_size)
            pages = block_table[b, :used]
            if used and (int(pages.min()) < 0 or int(pages.max()) >= k_cache.shape[0]):
                raise ValueError(
                    f"block_table[{b}] refers to pages outside [0, {k_cache.shape[0]}) within "
                    f"its first {used} entries (the pages holding its {n + seqlen_new} tokens)"
                )


# --------------------------------------------------------------------------------------------
# Decode-shaped attention without a cache update (for hf_flash's transformers integration)
# --------------------------------------------------------------------------------------------


def attend_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_start: Optional[Tensor] = None,
    key_end: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = True,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> Tensor:
    """A few queries over a contiguous block of keys per row, on the split-KV decode kernel.

    For decode steps of caches that hand the attention their whole history (transformers'
    DynamicCache): the prefill kernel would give each query head one program and read K/V once
    per query head; this reads each K/V tile once per GQA group, split across the GPU.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), any
    strides with a unit last stride. Row b attends keys ``[key_start[b], key_end[b])`` (int32
    device tensors; default the whole of k), its queries bottom-right aligned at ``key_end[b]``
    (left padding: ``key_start`` is the pad length). Masks and window as
    :func:`flash_attn_with_kvcache`. Shapes are checked; the index values are not read (no host
    sync), so the caller vouches for ``0 <= key_start <= key_end <= seqlen_k``. Returns
    (batch, seqlen_q, nheads, headdim).

    Host cost (it runs once per layer of every decode step): the checks run in full for each
    new combination of shapes (seqlen_k aside), dtypes, devices and options, which is then
    remembered, so the layers and steps after it only look the combination up; the default
    ``key_end`` tensor is reused while batch, seqlen_k and device stay the same.
    """
    if not torch.compiler.is_compiling():
        key = _attend_kv_key(q, k, v, key_start, key_end, softmax_scale, window_size, softcap)
        if key is None or key not in _ATTEND_KV_CHECKED:
            _check_attend_kv(q, k, v, key_start, key_end, softmax_scale, window_size, softcap)
            if key is not None:
                if len(_ATTEND_KV_CHECKED) >= _ATTEND_KV_CHECKED_MAX:
                    _ATTEND_KV_CHECKED.clear()
                _ATTEND_KV_CHECKED.add(key)
        elif k.shape != v.shape:  # the one check that reads seqlen_k, left out of the key
            _check_attend_kv(q, k, v, key_start, key_end, softmax_scale, window_size, softcap)
    q, k, v = _prepare(q), _prepare(k), _prepare(v)
    eager = eager_call(q, k, v)
    if key_end is None:
        key_end = _full_lengths(q.shape[0], k.shape[1], q.device, eager)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    args = (
        q, k, v, None, None, None, None, key_end, None, key_start, None, None,
        float(scale), True, left, right, float(softcap), False, 0, False,
    )  # fmt: skip
    if eager and type(key_end) is Tensor and (key_start is None or type(key_start) is Tensor):
        # nothing is appended, so no cache version to bump: the op's body, without the
        # dispatcher (see _run_attn_with_kvcache)
        out, _ = _attn_with_kvcache_impl(*args)
    else:
        out, _ = _attn_with_kvcache(*args)
    return out


def _check_attend_kv(q, k, v, key_start, key_end, softmax_scale, window_size, softcap) -> None:
    _check_tensor_basics(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, nheads, headdim)")
    if k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape, with q's batch "
            f"({q.shape[0]})"
        )
    _check_heads(q.shape[2], k.shape[2], v.shape[2], q.shape[3], k.shape[3], v.shape[3])
    _check_options(0.0, softmax_scale, window_size, softcap, None, q.shape[2], q.shape[0])
    for name, t in (("key_start", key_start), ("key_end", key_end)):
        if t is not None:
            _check_index_tensor(name, t, q.shape[0], q.device)


# Argument combinations attend_kv has checked (see _attend_kv_key); cleared when full.
_ATTEND_KV_CHECKED: set = set()
_ATTEND_KV_CHECKED_MAX = 256
_SCALARS = (int, float, type(None))


def _attend_kv_key(q, k, v, key_start, key_end, softmax_scale, window_size, softcap):
    """Everything :func:`_check_attend_kv` reads except seqlen_k, as a hashable tuple; None when
    an argument is of a kind the key cannot describe (the checks then run in full)."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor):
        return None
    if type(softmax_scale) not in _SCALARS or type(softcap) not in _SCALARS:
        return None
    if type(window_size) is not tuple or len(window_size) != 2:
        return None
    if type(window_size[0]) is not int or type(window_size[1]) is not int:
        return None
    index = []
    for t in (key_start, key_end):
        if t is None:
            index.append(None)
        elif type(t) is Tensor:
            index.append((t.dtype, t.shape, t.device))
        else:
            return None
    device = q.device
    # CPU tensors are accepted only while the interpreter is on, which may change at run time
    interp = interpreter_active() if device.type == "cpu" else None
    return (
        q.dtype, k.dtype, v.dtype, device, k.device, v.device, q.shape, k.shape[0], k.shape[2:],
        v.shape[0], v.shape[2:], softmax_scale, window_size, softcap, *index, interp,
    )  # fmt: skip


_last_full_lengths: tuple = (None, None)  # ((batch, seqlen_k, device), int32 tensor)


def _full_lengths(batch: int, seqlen_k: int, device, eager: bool) -> Tensor:
    """(batch,) int32 tensor of seqlen_k: every row attends all of k. The kernel only reads it,
    so the last one is reused while batch, seqlen_k and device are unchanged: made once per
    decode step instead of once per layer. Only for plain eager calls (``eager``): never while
    tracing (fake tensors) or capturing a CUDA graph (a tensor made then holds no value outside
    the graph, and one used inside a graph must not be freed by a later replacement)."""
    global _last_full_lengths
    key = (batch, seqlen_k, device)
    cacheable = eager and host_reads_allowed()
    last_key, tensor = _last_full_lengths
    if cacheable and last_key == key:
        return tensor
    tensor = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
    if cacheable:
        _last_full_lengths = (key, tensor)
    return tensor


def append_attend_paged(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor,
    v: Tensor,
    block_table: Tensor,
    seqlens_k: Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = True,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> Tensor:
    """Append new keys/values to a paged cache and attend, for batches padded with dummy rows
    (transformers' continuous-batching decode step under CUDA graphs).

    Like :func:`flash_attn_with_kvcache` with a ``block_table``, except that the lengths come as
    ``seqlens_k`` (keys of each row after the append) and a row with ``seqlens_k[b] == 0`` is a
    padding row: it writes nothing, reads nothing (its page-table row may hold -1) and its
    output is 0::

        row    seqlens_k   cache rows written      keys attended
        real   n >= S_new  n - S_new ... n - 1     0 ... n - 1 (bottom-right causal)
        pad    0           none                    none (output 0)

    q: (batch, seqlen_new, nheads, headdim); k, v: (batch, seqlen_new, nheads_k, headdim);
    k_cache, v_cache: (num_pages, page_size, nheads_k, headdim), page_size a multiple of 16,
    unit last stride (updated in place); block_table: (batch, max_pages) int32 page indices;
    seqlens_k: (batch,) int32 on q's device. Shapes are checked; the values are not read (no
    host sync, CUDA-graph capturable), so the caller vouches that every real row fits its pages
    (``seqlen_new <= seqlens_k[b] <= max_pages * page_size``) and that those pages exist.
    Masks and window as :func:`flash_attn_with_kvcache`. Returns (batch, seqlen_new, nheads,
    headdim).
    """
    if not torch.compiler.is_compiling():
        _check_tensor_basics(q, k_cache, v_cache)
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                raise ValueError(
                    f"{name} must be a 4-D tensor: q (batch, seqlen_new, nheads, headdim), k/v "
                    "(batch, seqlen_new, nheads_k, headdim), caches (num_pages, page_size, "
                    "nheads_k, headdim)"
                )
        if k_cache.shape != v_cache.shape:
            raise ValueError(
                f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape"
            )
        batch, seqlen_new = q.shape[:2]
        _, page_size, nheads_k, head_dim = k_cache.shape
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != (batch, seqlen_new, nheads_k, head_dim):
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; expected ({batch}, {seqlen_new}, "
                    f"{nheads_k}, {head_dim}) (q's batch and tokens, the cache's heads)"
                )
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(
                    f"{name} must match q's dtype and device ({q.dtype}, {q.device}), got "
                    f"({t.dtype}, {t.device})"
                )
        _check_heads(q.shape[2], nheads_k, nheads_k, q.shape[3], head_dim, head_dim)
        _check_options(0.0, softmax_scale, window_size, softcap, None, q.shape[2], batch)
        if page_size % PAGE_MULTIPLE:
            raise ValueError(
                f"page size (k_cache.shape[1]) is {page_size}; paged caches need a multiple of "
                f"{PAGE_MULTIPLE}"
            )
        if not isinstance(block_table, Tensor) or block_table.dtype != torch.int32:
            raise TypeError("block_table must be an int32 tensor (batch, max_pages_per_sequence)")
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise ValueError(
                f"block_table has shape {tuple(block_table.shape)}; expected ({batch}, "
                "max_pages_per_sequence >= 1)"
            )
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
        _check_index_tensor("seqlens_k", seqlens_k, batch, q.device)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on its last (headdim) dimension")
    # A padding row gets cache_seqlens = cache_leftpad = capacity: its keys and its append slots
    # all lie at cache rows >= capacity, which the kernel never loads or stores.
    capacity = block_table.shape[1] * k_cache.shape[1]
    real = seqlens_k > 0
    cache_seqlens = torch.where(real, seqlens_k - k.shape[1], capacity).to(torch.int32)
    leftpad = torch.where(real, 0, capacity).to(torch.int32)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    out, _ = _run_attn_with_kvcache(
        _prepare(q), k_cache, v_cache, _prepare(k), _prepare(v), None, None, cache_seqlens,
        None, leftpad, block_table, None, float(scale), True, left, right, float(softcap),
        False, 0, False,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


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
        window_size: (left, right). Sliding window in the same coordinates; -1 = unbounded.
        softcap: float. If > 0, scores become ``softcap * tanh(scores / softcap)``.
        rotary_interleaved: bool. True: rotate pairs (2i, 2i + 1) (GPT-J); False: pairs
            (i, i + rotary_dim / 2) ("rotate half", Llama). Default True, as flash-attn.
        alibi_slopes: (nheads,) or (batch, nheads), float32. Bias ``-slope * |i' - j|`` in the
            same coordinates.
        num_splits: int. Number of key-range splits (flash-decoding). 0 picks one from the
            batch, heads, cache size and SM count; 1 disables the combine step.
        return_softmax_lse: bool. Also return the log-sum-exp.

    Return:
        out: (batch, seqlen_q, nheads, headdim), q's dtype.
        softmax_lse [if return_softmax_lse]: (batch, nheads, seqlen_q), float32, natural log;
            +inf for queries that see no key (their output is 0).
    """
    if not torch.compiler.is_compiling():
        _validate(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, softmax_scale, window_size, softcap, alibi_slopes,
            num_splits,
        )  # fmt: skip
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            # a copy would swallow the in-place append
            raise ValueError(f"{name} must have unit stride on its last (headdim) dimension")
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
    left, right = int(window_size[0]), int(window_size[1])
    local = (left, right) != (-1, -1)
    if causal:
        right = 0
    out, lse = _run_attn_with_kvcache(
        _prepare(q), k_cache, v_cache,
        _prepare(k) if k is not None else None, _prepare(v) if v is not None else None,
        rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        alibi_slopes, float(scale), bool(causal or local), left, right, float(softcap),
        bool(rotary_interleaved), int(num_splits), False,
    )  # fmt: skip
    return (out, lse) if return_softmax_lse else out
