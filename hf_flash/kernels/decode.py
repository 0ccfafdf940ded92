"""Split-KV attention over a KV cache ("flash-decoding") with in-kernel append and rotary.

Decode reads the whole KV cache once per step and does almost no arithmetic, so the kernel is
organised around memory traffic:

* one program per (split, batch row, K/V head, query tile). All query heads of a GQA group and
  all ``seqlen_q`` rows are stacked in the M dimension of one tile (row ``r`` is query
  ``r // group`` of head ``kv_head * group + r % group``), so every K/V tile is read once per
  group, not once per query head. M is padded to 16 for ``tl.dot``.
* the visible key range of a row tile is cut into ``num_splits`` contiguous runs of
  ``BLOCK_N`` keys. The cut follows the true length read in-kernel from ``cache_seqlens`` (it
  stays on the device: no host sync, CUDA-graph capturable), so a large static cache holding a
  short sequence still spreads over every split. Each split writes an fp32 partial output and a
  log2-domain log-sum-exp; ``_combine_kernel`` merges them. With one split the main kernel
  writes the final output itself and there is no second launch.
* new keys/values (``k``/``v``) are appended at ``cache_seqlens`` in the same launch: split
  ``s`` stores new-key tiles ``s, s + num_splits, ...`` (rotated when rotary is on), while the
  attention loop reads new keys from ``k``/``v`` directly (rotating them again), never from the
  cache positions being written, so no program waits for another.
* paged caches: the physical row of logical key ``p`` is
  ``block_table[b, p // page_size] * page_size + p % page_size``, gathered per key row, so any
  page size works (the API asks for multiples of 16).

Positions: with ``cache_leftpad`` the keys of row ``b`` are cache rows
``[leftpad[b], cache_seqlens[b] + seqlen_new)``; masking (causal bottom-right, window, ALiBi)
uses logical key indices counted from ``leftpad``. Rotary angles use physical cache rows,
as flash-attn does: new key ``t`` sits at row ``cache_seqlens + t``, query ``i`` at
``cache_seqlens + i`` (causal or windowed attention) or ``cache_seqlens`` (otherwise).
Per-token tables (an hf_flash extension for transformers, whose positions ignore left padding)
give the angles of the new tokens directly: table row ``t`` for new key ``t`` and for query
``t`` (or row 0 for every query, as above). No load or store ever goes past the cache's
``capacity`` rows, whatever ``cache_seqlens`` holds.

Supported: float16 / bfloat16 (float32 accumulation) and float32; head dims 1..512; softcap,
ALiBi, sliding windows. Addresses are computed in int64.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import configs
from .flash_common import LN2, scores_log2, visible
from .launch import CachedLauncher


@triton.jit
def _rotary_index(d, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """For feature index tile ``d``: (partner feature, cos/sin column, sign, rotated?)."""
    if INTERLEAVED:
        # pairs (2i, 2i + 1)
        pair = d + 1 - 2 * (d % 2)
        col = d // 2
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    else:
        # pairs (i, i + ROTARY_DIM / 2)
        first = d < ROTARY_DIM // 2
        pair = tl.where(first, d + ROTARY_DIM // 2, d - ROTARY_DIM // 2)
        col = tl.where(first, d, d - ROTARY_DIM // 2)
        sign = tl.where(first, -1.0, 1.0)
    rot = d < ROTARY_DIM
    pair = tl.where(rot, pair, d)
    col = tl.where(rot, col, 0)
    return pair, col, sign, rot


@triton.jit
def _load_rotated(
    X, row_off, d, pos, mask, Cos, Sin, stride_cs,
    HAS_ROTARY: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """Load ``X[row_off + d]`` (broadcastable 2-D offset tiles) and rotate feature pairs by the
    angle of position ``pos``. Returns float32; out-of-mask elements are 0."""
    x = tl.load(X + row_off + d, mask=mask, other=0.0).to(tl.float32)
    if HAS_ROTARY:
        pair, col, sign, rot = _rotary_index(d, ROTARY_DIM, INTERLEAVED)
        m = mask & rot
        xp = tl.load(X + row_off + pair, mask=m, other=0.0).to(tl.float32)
        c = tl.load(Cos + pos * stride_cs + col, mask=m, other=1.0).to(tl.float32)
        s = tl.load(Sin + pos * stride_cs + col, mask=m, other=0.0).to(tl.float32)
        x = tl.where(rot, x * c + sign * xp * s, x)
    return x


@triton.jit
def _cache_rows(BlockTable, b64, stride_btb, phys, ok, stride_page, stride_row, PAGED: tl.constexpr,
                page_size):  # fmt: skip
    """int64 element offsets of cache rows ``phys`` (relative to the batch/head base)."""
    if PAGED:
        page = tl.load(BlockTable + b64 * stride_btb + phys // page_size, mask=ok, other=0)
        return page.to(tl.int64) * stride_page + (phys % page_size).to(tl.int64) * stride_row
    return phys.to(tl.int64) * stride_row


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, pos_m, slope,
    K, V, Knew, Vnew, BlockTable, Cos, Sin,
    b64, stride_btb, page_size, stride_kp, stride_kn, stride_vp, stride_vn,
    stride_knn, stride_vnn, stride_cs,
    start, end, leftpad, cache_len, k_len, capacity, rot_shift, offs_d, d_ok,
    window_left, window_right, qk_scale, softcap,
    FROM_NEW: tl.constexpr, PAGED: tl.constexpr,
    HAS_ROTARY: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Online-softmax update over logical keys [start, end). ``K``/``V`` point at this
    (cache row, K/V head); ``Knew``/``Vnew`` at this (batch row, K/V head) of the new keys.
    FROM_NEW tiles may hold new keys (logical index >= cache_len - leftpad). STAGES: software
    pipeline depth of this loop (its shared-memory buffers are not shared with other loops)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(start, end, BLOCK_N, num_stages=STAGES):
        offs_n = start_n + offs_n0  # logical key index
        phys = leftpad + offs_n  # cache row
        # (capacity: never touch memory past the cache, whatever cache_seqlens says)
        in_seq = (offs_n < k_len) & (phys < capacity)
        if FROM_NEW:
            from_cache = in_seq & (phys < cache_len)
            from_new = in_seq & (phys >= cache_len)
        else:
            from_cache = in_seq
        rows_k = _cache_rows(BlockTable, b64, stride_btb, phys, from_cache, stride_kp, stride_kn,
                             PAGED, page_size)  # fmt: skip
        if EVEN_D:
            kt_mask = from_cache[None, :]
        else:
            kt_mask = from_cache[None, :] & d_ok[:, None]
        kt = tl.load(K + rows_k[None, :] + offs_d[:, None], mask=kt_mask, other=0.0)  # [D, N]
        if FROM_NEW:
            t = tl.maximum(phys - cache_len, 0).to(tl.int64)
            kn = _load_rotated(
                Knew, t[None, :] * stride_knn, offs_d[:, None], phys[None, :] - rot_shift,
                from_new[None, :] & d_ok[:, None], Cos, Sin, stride_cs,
                HAS_ROTARY, ROTARY_DIM, INTERLEAVED,
            )  # fmt: skip
            # round to the cache dtype, exactly as the appended copy is stored
            kt = tl.where(from_new[None, :], kn.to(kt.dtype), kt)
        if DOT_FP32:
            kt = kt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PRECISION)  # [M, N]
        s2, _t = scores_log2(
            qk, pos_m[:, None], offs_n[None, :], qk_scale, softcap, slope[:, None],
            HAS_SOFTCAP, HAS_ALIBI,
        )  # fmt: skip
        vis = visible(pos_m[:, None], offs_n[None, :], k_len, window_left, window_right,
                      MASK_LEFT, MASK_RIGHT)  # fmt: skip
        s2 = tl.where(vis, s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        # rows that have seen no key yet keep m = -inf; subtract 0 instead to avoid inf - inf
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s2 - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        rows_v = _cache_rows(BlockTable, b64, stride_btb, phys, from_cache, stride_vp, stride_vn,
                             PAGED, page_size)  # fmt: skip
        if EVEN_D:
            v_mask = from_cache[:, None]
        else:
            v_mask = from_cache[:, None] & d_ok[None, :]
        v = tl.load(V + rows_v[:, None] + offs_d[None, :], mask=v_mask, other=0.0)  # [N, D]
        if FROM_NEW:
            t = tl.maximum(phys - cache_len, 0).to(tl.int64)
            vn = tl.load(Vnew + t[:, None] * stride_vnn + offs_d[None, :],
                         mask=from_new[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
            v = tl.where(from_new[:, None], vn, v)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _append_new(
    K, V, Knew, Vnew, BlockTable, Cos, Sin,
    b64, stride_btb, page_size, stride_kp, stride_kn, stride_vp, stride_vn,
    stride_knn, stride_vnn, stride_cs,
    cache_len, seqlen_new, capacity, rot_shift, split, num_splits, offs_d, d_ok,
    PAGED: tl.constexpr, HAS_ROTARY: tl.constexpr, ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Store new keys (rotated) and values at cache rows cache_len + t, for the tiles of t
    owned by this split."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_t in tl.range(split * BLOCK_N, seqlen_new, num_splits * BLOCK_N, num_stages=1):
        t = start_t + offs_n0
        phys = cache_len + t
        ok = (t < seqlen_new) & (phys < capacity)
        t64 = t.to(tl.int64)
        mask = ok[:, None] & d_ok[None, :]
        kn = _load_rotated(
            Knew, t64[:, None] * stride_knn, offs_d[None, :], phys[:, None] - rot_shift, mask,
            Cos, Sin, stride_cs, HAS_ROTARY, ROTARY_DIM, INTERLEAVED,
        )  # fmt: skip
        rows_k = _cache_rows(BlockTable, b64, stride_btb, phys, ok, stride_kp, stride_kn, PAGED,
                             page_size)  # fmt: skip
        tl.store(K + rows_k[:, None] + offs_d[None, :], kn.to(K.dtype.element_ty), mask=mask)
        vn = tl.load(Vnew + t64[:, None] * stride_vnn + offs_d[None, :], mask=mask, other=0.0)
        rows_v = _cache_rows(BlockTable, b64, stride_btb, phys, ok, stride_vp, stride_vn, PAGED,
                             page_size)  # fmt: skip
        tl.store(V + rows_v[:, None] + offs_d[None, :], vn, mask=mask)


@triton.jit
def _decode_kernel(
    Q, K, V, Knew, Vnew, Out, Lse, OutPart, LsePart,
    CacheSeqlens, CacheBatchIdx, CacheLeftpad, BlockTable, Cos, Sin, Alibi,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_knb, stride_knn, stride_knh,
    stride_vnb, stride_vnn, stride_vnh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    stride_btb, stride_cb, stride_cs, stride_ab,
    batch, nheads, seqlen_q, seqlen_new, group, page_size, capacity, num_splits,
    window_left, window_right, qk_scale, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_NEW: tl.constexpr, PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr, HAS_ROTARY: tl.constexpr, ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, ROTARY_Q_PER_ROW: tl.constexpr, ROTARY_PER_TOKEN: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(0)
    bk = tl.program_id(1)
    pid_m = tl.program_id(2)
    nheads_k = nheads // group
    b = bk // nheads_k
    kv_h = bk % nheads_k
    b64 = b.to(tl.int64)

    cache_len = tl.load(CacheSeqlens + b)  # rows already in the cache (physical)
    leftpad = 0
    if HAS_LEFTPAD:
        leftpad = tl.load(CacheLeftpad + b)
    k_len = cache_len - leftpad
    if HAS_NEW:
        k_len += seqlen_new
    shift = k_len - seqlen_q  # bottom-right alignment

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    # cache and new-key bases for this (batch row, K/V head)
    if PAGED:
        k_base = K + kv_h.to(tl.int64) * stride_kh
        v_base = V + kv_h.to(tl.int64) * stride_vh
    else:
        cb = b64
        if HAS_BATCH_IDX:
            cb = tl.load(CacheBatchIdx + b).to(tl.int64)
        k_base = K + cb * stride_kb + kv_h.to(tl.int64) * stride_kh
        v_base = V + cb * stride_vb + kv_h.to(tl.int64) * stride_vh
    # (stride of a page = the cache's batch stride)
    # rotary angles: row p of the table for cache row p, or, with per-token tables
    # (batch, seqlen_new, rotary_dim / 2), row t of this batch row's table for new token t
    rot_shift = 0
    cos_base = Cos
    sin_base = Sin
    if HAS_ROTARY:
        if ROTARY_PER_TOKEN:
            rot_shift = cache_len
            cos_base = Cos + b64 * stride_cb
            sin_base = Sin + b64 * stride_cb
    knew_base = Knew
    vnew_base = Vnew
    if HAS_NEW:
        knew_base = Knew + b64 * stride_knb + kv_h.to(tl.int64) * stride_knh
        vnew_base = Vnew + b64 * stride_vnb + kv_h.to(tl.int64) * stride_vnh
        if pid_m == 0:
            _append_new(
                k_base, v_base, knew_base, vnew_base, BlockTable, cos_base, sin_base,
                b64, stride_btb, page_size, stride_kb, stride_kn, stride_vb, stride_vn,
                stride_knn, stride_vnn, stride_cs,
                cache_len, seqlen_new, capacity, rot_shift, split, num_splits, offs_d, d_ok,
                PAGED, HAS_ROTARY, ROTARY_DIM, INTERLEAVED, BLOCK_N,
            )  # fmt: skip

    # query rows of this tile: r -> (query index r // group, head kv_h * group + r % group)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seqlen_q * group
    qi = offs_m // group
    head = kv_h * group + offs_m % group
    pos_m = qi + shift  # logical key position of each row
    q_off = b64 * stride_qb + qi.to(tl.int64) * stride_qm + head.to(tl.int64) * stride_qh
    q_mask = row_ok[:, None] & d_ok[None, :]
    if HAS_ROTARY:
        if ROTARY_Q_PER_ROW:
            q_pos = cache_len - rot_shift + qi
        else:
            q_pos = cache_len - rot_shift + 0 * qi
        qf = _load_rotated(
            Q, q_off[:, None], offs_d[None, :], q_pos[:, None], q_mask, cos_base, sin_base,
            stride_cs, HAS_ROTARY, ROTARY_DIM, INTERLEAVED,
        )  # fmt: skip
        q = qf.to(Q.dtype.element_ty)
    else:
        q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(Alibi + b64 * stride_ab + head, mask=row_ok, other=0.0)

    # visible keys of the tile's rows, then this split's share of them
    qi_lo = pid_m * BLOCK_M // group
    qi_hi = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, seqlen_q - 1)
    hi = k_len
    if MASK_RIGHT:
        hi = tl.minimum(hi, qi_hi + shift + window_right + 1)
    hi = tl.maximum(hi, 0)
    lo = 0
    if MASK_LEFT:
        lo = (tl.maximum(qi_lo + shift - window_left, 0) // BLOCK_N) * BLOCK_N
    lo = tl.minimum(lo, hi)
    # balanced: split s takes tiles [s * n / S, (s + 1) * n / S), so they differ by at most one
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    s_lo = tl.minimum(lo + (split * n_tiles // num_splits) * BLOCK_N, hi)
    s_hi = tl.minimum(lo + ((split + 1) * n_tiles // num_splits) * BLOCK_N, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    cache_hi = s_hi
    if HAS_NEW:
        # tiles before the first new key read the cache only
        new_tile = ((cache_len - leftpad) // BLOCK_N) * BLOCK_N
        cache_hi = tl.maximum(tl.minimum(s_hi, new_tile), s_lo)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, pos_m, slope,
        k_base, v_base, knew_base, vnew_base, BlockTable, cos_base, sin_base,
        b64, stride_btb, page_size, stride_kb, stride_kn, stride_vb, stride_vn,
        stride_knn, stride_vnn, stride_cs,
        s_lo, cache_hi, leftpad, cache_len, k_len, capacity, rot_shift, offs_d, d_ok,
        window_left, window_right, qk_scale, softcap,
        False, PAGED, HAS_ROTARY, ROTARY_DIM, INTERLEAVED, BLOCK_N, EVEN_D,
        MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_FP32, PRECISION, NUM_STAGES,
    )  # fmt: skip
    if HAS_NEW:
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, pos_m, slope,
            k_base, v_base, knew_base, vnew_base, BlockTable, cos_base, sin_base,
            b64, stride_btb, page_size, stride_kb, stride_kn, stride_vb, stride_vn,
            stride_knn, stride_vnn, stride_cs,
            cache_hi, s_hi, leftpad, cache_len, k_len, capacity, rot_shift, offs_d, d_ok,
            window_left, window_right, qk_scale, softcap,
            True, PAGED, HAS_ROTARY, ROTARY_DIM, INTERLEAVED, BLOCK_N, EVEN_D,
            MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_FP32, PRECISION, 1,
        )  # fmt: skip

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # partials: OutPart (splits, batch, nheads, seqlen_q, HEAD_DIM) fp32,
        # LsePart (splits, batch, nheads, seqlen_q) log2 domain, -inf where the split saw nothing
        lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
        row = ((split.to(tl.int64) * batch + b64) * nheads + head) * seqlen_q + qi
        tl.store(LsePart + row, lse2, mask=row_ok)
        tl.store(OutPart + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=o_mask)
    else:
        # rows that saw no key: output 0 and lse = +inf, as hf_flash's other kernels
        lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) * LN2)
        o_off = b64 * stride_ob + qi.to(tl.int64) * stride_om + head.to(tl.int64) * stride_oh
        tl.store(Out + o_off[:, None] + offs_d[None, :], out.to(Out.dtype.element_ty), mask=o_mask)
        tl.store(Lse + b64 * stride_lb + head.to(tl.int64) * stride_lh + qi, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    OutPart, LsePart, Out, Lse,
    stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
    rows, nheads, seqlen_q, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
):  # fmt: skip
    """One program per (batch, head, query): out = sum_s 2^(lse_s - lse) * out_s."""
    row = tl.program_id(0).to(tl.int64)  # ((b * nheads) + h) * seqlen_q + qi
    qi = row % seqlen_q
    h = (row // seqlen_q) % nheads
    b = row // (seqlen_q * nheads)
    offs_s = tl.arange(0, BLOCK_S)
    lse_s = tl.load(LsePart + offs_s.to(tl.int64) * rows + row, mask=offs_s < num_splits,
                    other=float("-inf"))  # fmt: skip
    m = tl.max(lse_s, 0)
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse_s - m_sub), 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    offs_c = tl.arange(0, CHUNK_S)
    for s0 in range(0, num_splits, CHUNK_S):
        s = s0 + offs_c
        s_ok = s < num_splits
        r = s.to(tl.int64) * rows + row
        w = tl.exp2(tl.load(LsePart + r, mask=s_ok, other=float("-inf")) - m_sub)  # [CHUNK_S]
        o = tl.load(OutPart + r[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(w[:, None] * o, 0)
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("inf"), (m_sub + tl.log2(tl.where(empty, 1.0, total))) * LN2)
    tl.store(Out + b * stride_ob + qi * stride_om + h * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=d_ok)  # fmt: skip
    tl.store(Lse + b * stride_lb + h * stride_lh + qi, lse)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; the interpreter pretends to have 8, so tests
    exercise the split heuristic on tiny shapes."""
    return configs.sm_count(device, 8)


def decode_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """BLOCK_N / warps / stages of the split kernel. Decode is bandwidth-bound: enough loads in
    flight matters more than tile shape, hence several pipeline stages of modest key tiles."""
    if configs.interpreting():
        cfg = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    elif configs.head_dim_block(head_dim) > 256:
        # head dims 257..512 (not swept on hardware): the query tile is at most 32 rows here
        # (_Plan), 32 x 512 x 2 = 32 KB (64 KB in float32) of shared memory, plus the streamed
        # K and V tiles, stages x 2 x 16 x 512 x 2 bytes: 2 stages 64 KB in 16-bit, 96 KB in all
        # (under sm_86 / Ada's 99 KB); one stage before Ampere (64 KB on Turing) and in float32,
        # 64 + 64 = 128 KB (A100, Hopper). The fp32 accumulator, 32 x 512 over 256 threads, is
        # 64 registers each.
        two = dtype != torch.float32 and configs._capability(device)[0] >= 8
        cfg = {"BLOCK_N": 16, "num_warps": 8, "num_stages": 2 if two else 1}
    elif dtype == torch.float32:
        cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    elif configs.head_dim_block(head_dim) <= 128:
        # H100 (benchmarks/results/decode_sweep-*.json, B in {1, 16} x L in {4K, 32K}): 3
        # stages were the fastest at every point of that sweep (B=16 32K: 696 vs 707 us with 4;
        # B=1 32K, 16 splits: 63.6 vs 64.4). But with 3 stages two programs fit on an SM, and
        # when the grid is more than one wave (B=64: 512 programs, no split) the kernel fell 11%
        # behind SDPA (3099 vs 2779 us at 32K; 2790 with 4 stages). So: 4 stages, which keep one
        # program per SM, unless the grid fits in one wave ("one_wave_stages").
        cfg = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4, "one_wave_stages": 3}
    else:
        cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
    return configs._pick("decode", cfg)


# A split should stream at least this many key tiles: below it the fixed cost of a program
# (loading q, writing an fp32 partial) outweighs the parallelism gained.
MIN_TILES_PER_SPLIT = 2
MAX_SPLITS = 128
# Programs per SM that one "wave" counts: the Hopper config's 128 KB of pipeline buffers leave
# room for one. One wave of one program per SM is also the fastest split: in the H100 sweep at
# B=1 (8 programs per split) 16 splits beat 32 at 32K (54.1 vs 56.8 us) and 15 beat 31 at 4K
# (17.0 vs 19.1 us); each extra split pays a prologue and a partial write.
PROGRAMS_PER_SM = 1


def choose_num_splits(programs: int, max_keys: int, block_n: int, device: torch.device) -> int:
    """Key-range splits for ``programs`` (batch x K/V heads x query tiles) programs.

    The cache capacity bounds the work (a host-side number: true lengths stay on the device).
    Grids that already fill the GPU are not split. Otherwise, among split counts that leave
    each split ``MIN_TILES_PER_SPLIT`` tiles, take the smallest whose waves of programs are
    within 5% as full as the best choice's, up to ~4 waves (wave quantisation: 192 programs on
    132 slots run in two waves, the second half empty, so 128 programs finish as fast).
    """
    tiles = configs.cdiv(max(max_keys, 1), block_n)
    return _best_splits(max(programs, 1), tiles, PROGRAMS_PER_SM * sm_count(device))


# The search below costs ~2 us per candidate and runs once per layer of every decode step;
# its inputs repeat (a DynamicCache grows by one key tile every BLOCK_N steps), so it is
# memoised. Entries are three ints; the bound only caps a long-running server's memory.
@functools.lru_cache(maxsize=4096)
def _best_splits(programs: int, tiles: int, slots: int) -> int:
    # at most ~4 waves: beyond that, quantisation gains are small and partials cost more
    most = min(
        MAX_SPLITS, configs.cdiv(tiles, MIN_TILES_PER_SPLIT), configs.cdiv(4 * slots, programs)
    )
    if most <= 1 or programs >= 0.8 * slots:
        return 1

    def efficiency(splits: int) -> float:
        total = programs * splits
        return total / (configs.cdiv(total, slots) * slots)

    best = max(efficiency(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if efficiency(s) >= 0.95 * best)


def _strides3(t):
    return t.stride()[:3] if t is not None else (0, 0, 0)


class _Plan:
    """What a launch needs beyond pointers, strides and the split count, derived from shapes,
    dtypes and flags only, so it is computed once per distinct combination (every layer of
    every decode step repeats one)."""

    __slots__ = ("block_n", "m_tiles", "meta", "combine", "combine_meta")

    def __init__(self, head_dim, dtype, device, rows, flags):
        (has_new, paged, has_batch_idx, has_leftpad, has_rotary, rotary_dim, interleaved,
         q_per_row, per_token, mask_left, mask_right, has_softcap, has_alibi) = flags  # fmt: skip
        cfg = decode_config(head_dim, dtype, device)
        self.block_n = cfg["BLOCK_N"]
        block_d = configs.head_dim_block(head_dim)
        # at most 64 stacked query rows per tile; 32 past head dim 256 (see decode_config)
        block_m = max(16, min(64 if block_d <= 256 else 32, configs.next_power_of_2(rows)))
        self.m_tiles = configs.cdiv(rows, block_m)
        dot_fp32 = dtype == torch.float32 or (configs.interpreting() and dtype == torch.bfloat16)
        common = dict(
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=self.block_n,
            HAS_NEW=has_new, PAGED=paged, HAS_BATCH_IDX=has_batch_idx, HAS_LEFTPAD=has_leftpad,
            HAS_ROTARY=has_rotary, ROTARY_DIM=rotary_dim, INTERLEAVED=interleaved,
            ROTARY_Q_PER_ROW=q_per_row, ROTARY_PER_TOKEN=per_token,
            MASK_LEFT=mask_left, MASK_RIGHT=mask_right, HAS_SOFTCAP=has_softcap,
            HAS_ALIBI=has_alibi,
        )  # fmt: skip
        # by (split, grid of at most one wave): constexprs and options of the main kernel
        self.meta = {}
        for one_wave in (False, True):
            stages = cfg.get("one_wave_stages", cfg["num_stages"]) if one_wave else cfg["num_stages"]
            for split in (False, True):
                self.meta[split, one_wave] = _DECODE.meta(
                    **common, SPLIT=split, DOT_FP32=dot_fp32, PRECISION="ieee" if dot_fp32 else "tf32",
                    NUM_STAGES=stages, num_warps=cfg["num_warps"], num_stages=stages,
                )  # fmt: skip
        self.combine = dict(
            HEAD_DIM=head_dim, BLOCK_D=block_d, CHUNK_S=8, num_warps=4 if head_dim > 64 else 2
        )
        self.combine_meta = {}  # by BLOCK_S

    def combine_for(self, num_splits: int):
        block_s = max(2, configs.next_power_of_2(num_splits))
        meta = self.combine_meta.get(block_s)
        if meta is None:
            meta = self.combine_meta[block_s] = _COMBINE.meta(BLOCK_S=block_s, **self.combine)
        return meta


# Launched once or twice per layer of every decode step: cached launches (see .launch)
_DECODE = CachedLauncher(_decode_kernel)
_COMBINE = CachedLauncher(_combine_kernel)


_PLANS: dict = {}
_PLANS_MAX = 256


def _plan(head_dim, dtype, device, rows, flags) -> _Plan:
    if configs._OVERRIDE is not None:  # a sweep is forcing launch parameters: no caching
        return _Plan(head_dim, dtype, device, rows, flags)
    key = (head_dim, dtype, device, rows, flags, configs.interpreting())
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(head_dim, dtype, device, rows, flags)
    return plan


@configs.on_input_device
def flash_decode(
    q, k_cache, v_cache, k_new, v_new, out, lse, *, cache_seqlens, cache_batch_idx,
    cache_leftpad, block_table, rotary_cos, rotary_sin, rotary_interleaved, rotary_q_per_row,
    softmax_scale, window_left, window_right, softcap, alibi_slopes, num_splits,
):  # fmt: skip
    """Launch the split-KV kernel (and the combine kernel when it splits). Inputs are validated
    by hf_flash.kvcache and hf_flash.decode.

    q/out (B, Sq, H, D); k_cache/v_cache (B_cache, S_cache, Hk, D) or, with ``block_table``
    (B, pages_per_seq), (num_pages, page_size, Hk, D); k_new/v_new (B, S_new, Hk, D) or None;
    lse (B, H, Sq) float32; cache_seqlens int32 (B,); rotary_cos/sin (S_ro, rotary_dim / 2)
    indexed by cache row, or per token (B or 1, S_new, rotary_dim / 2), same strides for both.
    ``window_right`` must already be 0 for causal attention. ``num_splits`` 0 picks one.
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    if q.numel() == 0:
        return
    seqlen_new = k_new.shape[1] if k_new is not None else 0
    paged = block_table is not None
    if paged:
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
    else:
        page_size = 1
        capacity = k_cache.shape[1]
    has_rotary = rotary_cos is not None and k_new is not None
    per_token = has_rotary and rotary_cos.dim() == 3
    flags = (
        k_new is not None, paged, cache_batch_idx is not None, cache_leftpad is not None,
        has_rotary, 2 * rotary_cos.shape[-1] if has_rotary else 0, bool(rotary_interleaved),
        bool(rotary_q_per_row), per_token, window_left >= 0, window_right >= 0, softcap > 0.0,
        alibi_slopes is not None,
    )  # fmt: skip
    plan = _plan(head_dim, q.dtype, q.device, seqlen_q * group, flags)
    programs = batch * nheads_k * plan.m_tiles
    if num_splits <= 0:
        num_splits = choose_num_splits(programs, capacity, plan.block_n, q.device)
    num_splits = int(max(1, min(num_splits, MAX_SPLITS)))
    split = num_splits > 1
    if split:
        out_part = torch.empty(
            (num_splits, batch, nheads, seqlen_q, head_dim), dtype=torch.float32, device=q.device
        )
        lse_part = torch.empty(
            (num_splits, batch, nheads, seqlen_q), dtype=torch.float32, device=q.device
        )
    else:
        out_part = lse_part = None
    stride_cb = rotary_cos.stride(0) if per_token and rotary_cos.shape[0] > 1 else 0
    stride_ab = 0
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        stride_ab = alibi_slopes.stride(0)
    stride_o = out.stride()
    stride_l = lse.stride()
    _DECODE(
        (num_splits, batch * nheads_k, plan.m_tiles),
        (q, k_cache, v_cache, k_new, v_new, out, lse, out_part, lse_part,
         cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos, rotary_sin,
         alibi_slopes),
        (*q.stride()[:3],
         *_strides3(k_cache), *_strides3(v_cache), *_strides3(k_new), *_strides3(v_new),
         *stride_o[:3],
         *stride_l[:2],
         block_table.stride(0) if paged else 0,
         stride_cb, rotary_cos.stride(-2) if has_rotary else 0,
         stride_ab,
         batch, nheads, seqlen_q, seqlen_new, group, page_size, capacity, num_splits,
         int(window_left), int(window_right)),
        (float(softmax_scale), float(softcap)),
        plan.meta[split, num_splits * programs <= sm_count(q.device)],
    )  # fmt: skip
    if split:
        total_rows = batch * nheads * seqlen_q
        _COMBINE(
            (total_rows,),
            (out_part, lse_part, out, lse),
            (*stride_o[:3], *stride_l[:2], total_rows, nheads, seqlen_q, num_splits),
            (),
            plan.combine_for(num_splits),
        )  # fmt: skip
