"""The decode op: a few queries over a KV cache, with an optional in-place append.

One custom op, ``hf_flash::decode``, runs :mod:`hf_flash.kernels.decode` (split-KV attention
with the append and the rotary of the new tokens fused in), and :func:`decode_attention` is its
one entry, called by keyword. Three callers build on it:

* :func:`hf_flash.flash_attn_with_kvcache` (:mod:`hf_flash.kvcache`), flash-attn's public API;
* :func:`attend_kv`: decode-shaped attention over keys that are already in place (the
  transformers attention function's decode steps, e.g. a DynamicCache's whole history);
* :func:`append_attend_paged`: a paged cache with padding rows (continuous batching under CUDA
  graphs);

and the fused decode patch (:mod:`hf_flash.integration.decode_patch`) calls
:func:`decode_attention` itself.

Which cache rows batch row ``b`` attends, with ``S_new`` new tokens appended by the call::

    cache row   0 ... key_start[b] ... key_end[b]-1 | key_end[b] ... key_end[b]+S_new-1
                      |------ cached, attended -----|------ appended, attended ------|

``key_start`` is the first attended row (flash-attn's ``cache_leftpad``), ``key_end`` one past
the last *cached* row (flash-attn's ``cache_seqlens``): the new tokens are written from there
on. With nothing appended ``key_end`` simply ends the attended rows. Queries are bottom-right
aligned at the end of the attended rows. Rows at or past the cache's capacity (its length, or
pages x page size) are never loaded or stored, so ``key_start = key_end = capacity`` makes an
inactive batch row: it writes nothing, reads no cache row, and its output is 0.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _checks
from ._checks import kernel_window, unit_last_stride
from ._runtime import eager_call, host_reads_allowed, interpreter_active
from .kernels import decode as _kernel

__all__ = ["decode_attention", "attend_kv", "append_attend_paged", "full_lengths"]

# Few queries over a longer history (decode, speculative or chunked steps): up to this many
# per row, the split-KV decode kernel serves them (each K/V tile read once per GQA group);
# more is a prefill chunk, which the prefill kernel serves better.
MAX_DECODE_QUERIES = 16

# keyword-only scalar options of the op, named once
_OPTIONS = (
    "float softmax_scale, bool rotary_q_per_row, int window_left, int window_right, "
    "float softcap, bool rotary_interleaved, int num_splits, bool cache_heads_first"
)
_SCHEMA = (
    "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k_new, Tensor? v_new, "
    "Tensor key_end, Tensor? key_start, Tensor? cache_batch_idx, Tensor? block_table, "
    "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? alibi_slopes, *, " + _OPTIONS + ") "
    "-> (Tensor, Tensor)"
)


def _decode_body(q, k_cache, v_cache, k_new, v_new, key_end, key_start, cache_batch_idx,
                 block_table, rotary_cos, rotary_sin, alibi_slopes, *, cache_heads_first,
                 **options):  # fmt: skip
    """``cache_heads_first``: the caches are (batch, nheads_k, seqlen, headdim) buffers
    (transformers' layout), viewed here, inside the op, so torch.compile sees the buffers
    themselves as the mutated arguments."""
    if cache_heads_first:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    out = torch.empty_like(q)
    b, s, h, _ = q.shape
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    _kernel.flash_decode(
        q, k_cache, v_cache, k_new, v_new, out, lse,
        cache_seqlens=key_end, cache_leftpad=key_start, cache_batch_idx=cache_batch_idx,
        block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        alibi_slopes=alibi_slopes, **options,
    )  # fmt: skip
    return out, lse


_decode_op = torch.library.custom_op(
    "hf_flash::decode", _decode_body, mutates_args=("k_cache", "v_cache"), schema=_SCHEMA
)


@_decode_op.register_fake
def _(q, *tensors, **options):
    b, s, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, *, key_end: Tensor,
    key_start: Optional[Tensor] = None, k_new: Optional[Tensor] = None,
    v_new: Optional[Tensor] = None, cache_batch_idx: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
    softmax_scale: float, causal: bool, window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0, rotary_interleaved: bool = False, rotary_q_per_row: bool = True,
    num_splits: int = 0, cache_heads_first: bool = False, sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:  # fmt: skip
    """``(out, lse)`` of ``q`` over the cache rows ``[key_start, key_end + S_new)`` of each
    batch row, after writing ``k_new`` / ``v_new`` (rotated) at ``key_end`` (module docstring).
    ``sinks``: (nheads,) learnable sink logits, folded in after the kernel (:func:`merge_sinks`).

    The one entry to the decode op; inputs are validated by the callers. q / k_new / v_new in
    the kernel layout ``(batch, seqlen, heads, head_dim)``; caches likewise, or
    ``cache_heads_first`` (batch, heads, rows, head_dim) buffers. ``key_end`` / ``key_start``:
    ``(batch,)`` int32 device tensors. ``rotary_q_per_row``: query i is rotated at position
    ``key_end + i`` (else all at ``key_end``, flash-attn's rule without a causal mask or window).

    Under torch.compile, or with fake/functional tensors, this is the custom op: the tracer must
    see the cache mutation. In eager mode the op's body runs directly, and the mutated caches
    get their version bump by hand: the dispatcher's generic in-place wrapper for a mutating
    custom op costs ~0.1-0.2 ms of host time per call, which a decode step pays once per layer.
    """
    left, right = kernel_window(causal, window_size)
    tensors = (q, k_cache, v_cache, k_new, v_new, key_end, key_start, cache_batch_idx,
               block_table, rotary_cos, rotary_sin, alibi_slopes)  # fmt: skip
    options = dict(
        softmax_scale=float(softmax_scale), rotary_q_per_row=bool(rotary_q_per_row),
        window_left=left, window_right=right, softcap=float(softcap),
        rotary_interleaved=bool(rotary_interleaved), num_splits=int(num_splits),
        cache_heads_first=bool(cache_heads_first),
    )  # fmt: skip
    if not eager_call(*(t for t in tensors if t is not None)):
        out, lse = _decode_op(*tensors, **options)
    else:
        out, lse = _decode_body(*tensors, **options)
        if k_new is not None:  # appended: k_cache and v_cache changed in place
            torch.autograd.graph.increment_version(k_cache)
            torch.autograd.graph.increment_version(v_cache)
    if sinks is not None:
        out, lse = merge_sinks(out, lse, sinks)
    return out, lse


def merge_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tuple[Tensor, Tensor]:
    """Attention over keys ``(out (B, S, H, D), lse (B, H, S))`` -> the same attention with one
    more softmax logit per head, ``sinks`` (H,), that carries no value (gpt-oss's sinks). The
    keys' weights shrink by ``Z / (Z + e^sink) = exp(lse - lse')`` with
    ``lse' = logaddexp(lse, sink)``; a row that saw no key (lse = +inf) outputs 0 and gets
    ``lse' = sink``. Exact; for decode, which needs no gradient (the prefill and training
    kernels take the sinks inside, with their gradient)."""
    s = sinks.float().view(1, -1, 1).expand_as(lse)
    empty = torch.isinf(lse)
    merged = torch.where(empty, s, torch.logaddexp(torch.where(empty, s, lse), s))
    share = torch.where(empty, torch.zeros_like(lse), torch.exp(lse - merged))
    out = (out.float() * share.transpose(1, 2).unsqueeze(-1)).to(out.dtype)
    return out, merged


# --------------------------------------------------------------------------------------------
# Keys already in place (transformers' decode steps over a DynamicCache's history)
# --------------------------------------------------------------------------------------------

_last_full_lengths: tuple = (None, None)  # ((batch, n, device), int32 tensor)


def full_lengths(batch: int, n: int, device, eager: bool) -> Tensor:
    """``(batch,)`` int32 tensor of ``n``. The kernel only reads it, so the last one is reused
    while batch, n and device are unchanged: made once per decode step instead of once per
    layer. Reused only for plain eager calls (``eager``, :func:`hf_flash._runtime.eager_call`
    of the call's tensors) outside a CUDA-graph capture: a tensor made while tracing is fake,
    one made while capturing holds no value outside the graph, and one used inside a graph must
    not be freed by a later replacement."""
    global _last_full_lengths
    key = (batch, n, device)
    cacheable = eager and host_reads_allowed()
    last_key, tensor = _last_full_lengths
    if cacheable and last_key == key:
        return tensor
    tensor = torch.full((batch,), n, dtype=torch.int32, device=device)
    if cacheable:
        _last_full_lengths = (key, tensor)
    return tensor


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
    learnable_sink: Optional[Tensor] = None,
) -> Tensor:
    """A few queries over a contiguous block of keys per row, on the split-KV decode kernel.

    For decode steps of caches that hand the attention their whole history (transformers'
    DynamicCache): the prefill kernel would give each query head one program and read K/V once
    per query head; this reads each K/V tile once per GQA group, split across the GPU.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), any
    strides with a unit last stride. Row b attends keys ``[key_start[b], key_end[b])`` (int32
    device tensors; default the whole of k), its queries bottom-right aligned at ``key_end[b]``
    (left padding: ``key_start`` is the pad length). Masks and window as
    :func:`hf_flash.flash_attn_with_kvcache`. Shapes are checked; the index values are not read
    (no host sync), so the caller vouches for ``0 <= key_start <= key_end <= seqlen_k``.
    ``learnable_sink``: (nheads,) sink logits (:func:`merge_sinks`). Returns
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
        if learnable_sink is not None:
            _checks.check_options(
                softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                nheads=q.shape[2], batch=q.shape[0], learnable_sink=learnable_sink,
                device=q.device,
            )  # fmt: skip
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    if key_end is None:
        key_end = full_lengths(q.shape[0], k.shape[1], q.device, eager_call(q, k, v))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, _ = decode_attention(
        q, k, v, key_end=key_end, key_start=key_start, softmax_scale=scale, causal=causal,
        window_size=window_size, softcap=softcap, sinks=learnable_sink,
    )  # fmt: skip
    return out


def _check_attend_kv(q, k, v, key_start, key_end, softmax_scale, window_size, softcap) -> None:
    _checks.check_tensor_basics(q, k, v)
    _checks.check_dims(4, "(batch, seqlen, nheads, headdim)", q=q, k=k, v=v)
    if k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape, with q's batch "
            f"({q.shape[0]})"
        )
    _checks.check_heads(q.shape[2], k.shape[2], v.shape[2], q.shape[3], k.shape[3], v.shape[3])
    _checks.check_options(
        softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, alibi_slopes=None,
        nheads=q.shape[2], batch=q.shape[0],
    )  # fmt: skip
    for name, t in (("key_start", key_start), ("key_end", key_end)):
        if t is not None:
            _checks.check_index_tensor(name, t, q.shape[0], q.device)


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


# --------------------------------------------------------------------------------------------
# Paged caches with padding rows (transformers' continuous batching)
# --------------------------------------------------------------------------------------------


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
    learnable_sink: Optional[Tensor] = None,
) -> Tensor:
    """Append new keys/values to a paged cache and attend, for batches padded with dummy rows
    (transformers' continuous-batching decode step under CUDA graphs).

    Like :func:`hf_flash.flash_attn_with_kvcache` with a ``block_table``, except that the lengths
    come as ``seqlens_k`` (keys of each row after the append) and a row with ``seqlens_k[b] ==
    0`` is a padding row: it writes nothing, reads nothing (its page-table row may hold -1) and
    its output is 0::

        row    seqlens_k   cache rows written      keys attended
        real   n >= S_new  n - S_new ... n - 1     0 ... n - 1 (bottom-right causal)
        pad    0           none                    none (output 0)

    q: (batch, seqlen_new, nheads, headdim); k, v: (batch, seqlen_new, nheads_k, headdim);
    k_cache, v_cache: (num_pages, page_size, nheads_k, headdim), page_size a multiple of 16,
    unit last stride (updated in place); block_table: (batch, max_pages) int32 page indices;
    seqlens_k: (batch,) int32 on q's device. Shapes are checked; the values are not read (no
    host sync, CUDA-graph capturable), so the caller vouches that every real row fits its pages
    (``seqlen_new <= seqlens_k[b] <= max_pages * page_size``) and that those pages exist.
    Masks, window and ``learnable_sink`` as :func:`hf_flash.flash_attn_with_kvcache`. Returns
    (batch, seqlen_new, nheads, headdim).
    """
    if not torch.compiler.is_compiling():
        _check_append_attend_paged(q, k_cache, v_cache, k, v, block_table, seqlens_k,
                                   softmax_scale, window_size, softcap, learnable_sink)  # fmt: skip
    _checks.check_cache_strides(k_cache, v_cache)
    # A padding row becomes an inactive row (module docstring): key_start = key_end = capacity.
    capacity = block_table.shape[1] * k_cache.shape[1]
    real = seqlens_k > 0
    key_end = torch.where(real, seqlens_k - k.shape[1], capacity).to(torch.int32)
    key_start = torch.where(real, 0, capacity).to(torch.int32)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, _ = decode_attention(
        unit_last_stride(q), k_cache, v_cache, k_new=unit_last_stride(k),
        v_new=unit_last_stride(v), key_end=key_end, key_start=key_start, block_table=block_table,
        softmax_scale=scale, causal=causal, window_size=window_size, softcap=softcap,
        sinks=learnable_sink,
    )  # fmt: skip
    return out


def _check_append_attend_paged(q, k_cache, v_cache, k, v, block_table, seqlens_k, softmax_scale,
                               window_size, softcap, learnable_sink=None) -> None:  # fmt: skip
    _checks.check_tensor_basics(q, k_cache, v_cache)
    _checks.check_dims(
        4, "(q (batch, seqlen_new, nheads, headdim), caches (num_pages, page_size, nheads_k, "
        "headdim))", q=q, k_cache=k_cache, v_cache=v_cache,
    )  # fmt: skip
    _checks.check_caches(k_cache, v_cache)
    batch, seqlen_new = q.shape[:2]
    _, page_size, nheads_k, head_dim = k_cache.shape
    if _checks.check_new_tokens(q, k, v, nheads_k, head_dim) != seqlen_new:
        raise ValueError(
            f"k has shape {tuple(k.shape)}; expected ({batch}, {seqlen_new}, {nheads_k}, "
            f"{head_dim}) (q's batch and tokens, the cache's heads)"
        )
    _checks.check_heads(q.shape[2], nheads_k, nheads_k, q.shape[3], head_dim, head_dim)
    _checks.check_options(
        softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, alibi_slopes=None,
        nheads=q.shape[2], batch=batch, learnable_sink=learnable_sink, device=q.device,
    )  # fmt: skip
    _checks.check_paged_cache(block_table, batch, page_size, q.device)
    _checks.check_index_tensor("seqlens_k", seqlens_k, batch, q.device)
