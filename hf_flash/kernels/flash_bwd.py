"""FlashAttention-2 backward pass in Triton.

Three launches, none with atomics, so gradients are bitwise deterministic:

1. ``_bwd_preprocess``: ``delta_i = rowsum(dO_i * O_i) - dlse_i`` per query row (the second
   term carries gradients that flow into the returned log-sum-exp: d lse_i / d s_ij = P_ij);
   for the Gluon backward's ``stats_smem`` variants it also lays out lse (times log2 e) and
   delta per query tile, the buffer their producer loads with each Q tile.
2. ``_bwd_dkdv_kernel``: one program per key tile of one K/V head. It walks every query head of
   its GQA group and the query tiles that can see the keys, recomputing
   ``P = exp(S - lse)`` from the saved log-sum-exp, and accumulates
   ``dV += P^T dO`` and ``dK += dS^T Q`` with ``dS = P * (dP - delta)``, ``dP = dO V^T``. The
   reduction over the query-head group happens in registers.
3. ``_bwd_dq_kernel``: one program per query tile: ``dQ += dS K`` over the visible key tiles.

With per-row key bounds (``key_bounds``) a pre-pass, ``_bwd_bounds_pre_pass``, first gives each
key tile the query rows that see any of its keys and the rows that see all of them, so the dK/dV
kernel visits exactly the query tiles in between (all of them when the ranges' ends never
decrease from row to row, as causal-like masks such as gemma3's image blocks) and runs the
fully-visible ones unmasked. No host sync.

Dropout replays the forward's Philox mask: ``dV`` uses the dropped, rescaled probabilities and
``dP`` is masked and rescaled the same way. Softcap multiplies ``dS`` by ``1 - tanh^2``.
"""

import torch
import triton
import triton.language as tl

from . import configs
from .launch import CachedLauncher, LaunchPlan, PlanCache
from .flash_common import (
    LOG2E, dropout_keep, load_row_bounds, query_tile_key_runs, query_tile_runs, scores_log2, seq_bounds,
    visible,
)  # fmt: skip
from .flash_fwd import _dense_or_varlen_strides, bounds_strides, kernel_flags


@triton.jit
def _bwd_preprocess(
    Out, DOut, DLse, Lse, Delta, Stats, Sem, CuSeqlensQ,
    stride_ob, stride_om, stride_oh, stride_db, stride_dm, stride_dh,
    stride_lb, stride_lh,
    seqlen_q, nheads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr, STATS_M: tl.constexpr, ZERO_SEM: tl.constexpr,
):  # fmt: skip
    """delta of BLOCK_M query rows; with STATS_M > 0 (dense calls) also their part of the
    statistics buffer: per (batch, head, STATS_M-row query tile), in that order, a row pair of
    STATS_M floats, lse times log2 e then delta, with lse +inf (P = 0) and delta 0 past the
    sequence's end (the grid then covers every tile's rows, past the end included). ZERO_SEM
    (with STATS_M): the int32 at Sem + tile is zeroed as well, one per tile (the Gluon backward's
    ordered-dQ counters, one per query tile of STATS_M rows)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // nheads
    h = bh % nheads
    q_start, q_len, _ks, _kl = seq_bounds(CuSeqlensQ, CuSeqlensQ, b, seqlen_q, seqlen_q, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if STATS_M == 0:
        if m0 >= q_len:
            return
    else:
        tl.static_assert(not IS_VARLEN and STATS_M % BLOCK_M == 0)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = (q_start + offs_m).to(tl.int64)
    b64 = b.to(tl.int64)
    o = tl.load(
        Out + b64 * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :],
        mask=ok, other=0.0,
    ).to(tl.float32)
    do = tl.load(
        DOut + b64 * stride_db + h * stride_dh + rows[:, None] * stride_dm + offs_d[None, :],
        mask=ok, other=0.0,
    ).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    l_off = b64 * stride_lb + h.to(tl.int64) * stride_lh + rows
    if HAS_DLSE:
        dlse = tl.load(DLse + l_off, mask=row_ok, other=0.0)
        # +inf lse rows have dlse = 0 (nothing depends on them) but keep NaN out regardless
        delta = delta - tl.where(dlse == dlse, dlse, 0.0)
    tl.store(Delta + l_off, delta, mask=row_ok)
    if STATS_M > 0:
        lse = tl.load(Lse + l_off, mask=row_ok, other=float("inf"))
        tile = bh.to(tl.int64) * tl.cdiv(seqlen_q, STATS_M) + m0 // STATS_M
        out = Stats + tile * (2 * STATS_M) + m0 % STATS_M + tl.arange(0, BLOCK_M)
        tl.store(out, lse * LOG2E)
        tl.store(out + STATS_M, tl.where(row_ok, delta, 0.0))
        if ZERO_SEM:
            if m0 % STATS_M == 0:
                tl.store(Sem + tile, 0)


@triton.jit
def _bwd_bounds_pre_pass(
    KeyBounds, QueryRuns, CuSeqlensQ, CuSeqlensK,
    stride_bb, stride_bm, stride_rb, seqlen_q, seqlen_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """For key tile ``pid_n`` of sequence ``b``: ``QueryRuns[b, pid_n] = (first, end, full_first,
    full_end)``, the query rows ``[first, end)`` spanning every row that sees a key of the tile
    (``(0, 0)`` if none) and ``[full_first, full_end)`` rows that all see every key of it (empty
    unless the rows that do are contiguous)."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    q_start, q_len, k_start, k_len = seq_bounds(CuSeqlensQ, CuSeqlensK, b, seqlen_q, seqlen_k, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= k_len:
        return
    n1 = tl.minimum(n0 + BLOCK_N, k_len)
    b64 = b.to(tl.int64)
    first = tl.full([], 2147483647, tl.int32)
    last = tl.full([], -1, tl.int32)
    full_first = tl.full([], 2147483647, tl.int32)
    full_last = tl.full([], -1, tl.int32)
    full_count = tl.full([], 0, tl.int32)
    for m0 in range(0, q_len, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        lo, hi = load_row_bounds(KeyBounds, stride_bb, stride_bm, b64, q_start, offs_m, q_len, k_len)
        sees = (lo < n1) & (hi > n0) & (lo < hi)  # rows past q_len have lo = hi = 0
        full = (offs_m < q_len) & (lo <= n0) & (hi >= n0 + BLOCK_N)
        first = tl.minimum(first, tl.min(tl.where(sees, offs_m, 2147483647), axis=0))
        last = tl.maximum(last, tl.max(tl.where(sees, offs_m, -1), axis=0))
        full_first = tl.minimum(full_first, tl.min(tl.where(full, offs_m, 2147483647), axis=0))
        full_last = tl.maximum(full_last, tl.max(tl.where(full, offs_m, -1), axis=0))
        full_count += tl.sum(full.to(tl.int32), axis=0)
    first = tl.where(last < 0, 0, first)
    exact = (full_count > 0) & (full_count == full_last - full_first + 1)
    full_first = tl.where(exact, full_first, 0)
    full_end = tl.where(exact, full_last + 1, 0)
    out = QueryRuns + b64 * stride_rb + pid_n * 4
    tl.store(out, first)
    tl.store(out + 1, last + 1)
    tl.store(out + 2, full_first)
    tl.store(out + 3, full_end)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v,
    q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
    start, end, offs_n, offs_m0, offs_d, shift, seqlen_q, seqlen_k, window_left, window_right,
    bounds_base, stride_bm,
    qk_scale, softcap, alibi_slope,
    rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k, dropout_p,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    ROW_BOUNDS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate dK, dV of one key tile over query tiles [start, end) of one query head.
    Scores are kept transposed ([BLOCK_N keys, BLOCK_M queries]) so P^T and dS^T feed the
    dV/dK products directly, with dK/dV in the MMA accumulator layout. ``bounds_base``: the
    sequence's first row of the key bounds (``ROW_BOUNDS``)."""
    d_ok = offs_d < HEAD_DIM
    key = offs_n[:, None]  # [BLOCK_N, 1]
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + offs_m0
        row64 = tl.cast(start_m, tl.int64)
        qt_ptrs = q_base + row64 * stride_qm + offs_m0[None, :] * stride_qm + offs_d[:, None]
        do_ptrs = do_base + row64 * stride_dom + offs_m0[:, None] * stride_dom + offs_d[None, :]
        if MASKED:
            row_ok = offs_m < seqlen_q
            qt = tl.load(qt_ptrs, mask=d_ok[:, None] & row_ok[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=d_ok[None, :] & row_ok[:, None], other=0.0)
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            if HEAD_DIM == BLOCK_D:
                qt = tl.load(qt_ptrs)
                do = tl.load(do_ptrs)
            else:
                qt = tl.load(qt_ptrs, mask=d_ok[:, None], other=0.0)
                do = tl.load(do_ptrs, mask=d_ok[None, :], other=0.0)
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        if DOT_FP32:
            qt = qt.to(tl.float32)
            do = do.to(tl.float32)
        pos = (offs_m + shift)[None, :]  # [1, BLOCK_M]
        st = tl.dot(k, qt, input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
        s2t, tt = scores_log2(st, pos, key, qk_scale, softcap, alibi_slope, HAS_SOFTCAP, HAS_ALIBI)
        if MASKED:
            vis = visible(pos, key, seqlen_k, window_left, window_right, MASK_LEFT, MASK_RIGHT)
            if ROW_BOUNDS:
                bounds_ptrs = bounds_base + offs_m.to(tl.int64) * stride_bm
                key_lo = tl.load(bounds_ptrs, mask=offs_m < seqlen_q, other=0)
                key_hi = tl.load(bounds_ptrs + 1, mask=offs_m < seqlen_q, other=0)
                vis = vis & (key >= key_lo[None, :]) & (key < key_hi[None, :])
            s2t = tl.where(vis, s2t, float("-inf"))
        pt = tl.exp2(s2t - (lse * LOG2E)[None, :])
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
        if HAS_DROPOUT:
            keep = dropout_keep(
                rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k, offs_m[None, :], key, dropout_p
            )
            scale_keep = 1.0 / (1.0 - dropout_p)
            p_used = tl.where(keep, pt * scale_keep, 0.0)
            dpt = tl.where(keep, dpt * scale_keep, 0.0)
        else:
            p_used = pt
        dv = tl.dot(p_used.to(do.dtype), do, dv, input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        if HAS_SOFTCAP:
            dst = dst * (1.0 - tt * tt)
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, CuSeqlensQ, CuSeqlensK, Alibi, Rng, KeyBounds, QueryRuns,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lb, stride_lh, stride_ab, stride_bb, stride_bm, stride_rb,
    seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k, nheads, nheads_k, group,
    window_left, window_right, qk_scale, softcap, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    ROW_BOUNDS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // nheads_k
    kv_h = bhk % nheads_k
    q_start, q_len, k_start, k_len = seq_bounds(CuSeqlensQ, CuSeqlensK, b, seqlen_q, seqlen_k, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= k_len:
        return
    shift = k_len - q_len
    b64 = b.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    key_ok = offs_n < k_len
    kv_ok = key_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows_k = (k_start + n0).to(tl.int64)
    k = tl.load(
        K + b64 * stride_kb + kv_h.to(tl.int64) * stride_kh + rows_k * stride_kn
        + tl.arange(0, BLOCK_N)[:, None] * stride_kn + offs_d[None, :],
        mask=kv_ok, other=0.0,
    )  # fmt: skip
    v = tl.load(
        V + b64 * stride_vb + kv_h.to(tl.int64) * stride_vh + rows_k * stride_vn
        + tl.arange(0, BLOCK_N)[:, None] * stride_vn + offs_d[None, :],
        mask=kv_ok, other=0.0,
    )  # fmt: skip
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    rng_seed = 0
    rng_offset = 0
    if HAS_DROPOUT:
        rng_seed = tl.load(Rng)
        rng_offset = tl.load(Rng + 1)
    if ROW_BOUNDS:
        bounds_base = KeyBounds + b64 * stride_bb + q_start.to(tl.int64) * stride_bm
        # the query rows that see this key tile, from _bwd_bounds_pre_pass
        runs = QueryRuns + b64 * stride_rb + pid_n * 4
        hi = tl.load(runs + 1)
        lo = tl.minimum((tl.load(runs) // BLOCK_M) * BLOCK_M, hi)
        a = tl.minimum(tl.maximum(tl.cdiv(tl.load(runs + 2), BLOCK_M) * BLOCK_M, lo), hi)
        bnd = tl.maximum(tl.minimum((tl.load(runs + 3) // BLOCK_M) * BLOCK_M, hi), a)
    else:
        bounds_base = Lse  # not read
        lo, a, bnd, hi = query_tile_runs(
            n0, shift, q_len, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT,
            True,
        )  # fmt: skip
    if n0 + BLOCK_N > k_len:
        a = hi  # the key tile sticks out of the sequence: every query tile needs the bounds mask
        bnd = hi
    for g in range(0, group):
        h = kv_h * group + g
        bh = b * nheads + h
        alibi_slope = 0.0
        if HAS_ALIBI:
            alibi_slope = tl.load(Alibi + b64 * stride_ab + h)
        q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
        do_base = DOut + b64 * stride_dob + h.to(tl.int64) * stride_doh + q_start.to(tl.int64) * stride_dom
        l_off = b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, Lse + l_off, Delta + l_off, stride_qm, stride_dom,
            lo, a, offs_n, offs_m0, offs_d, shift, q_len, k_len, window_left, window_right,
            bounds_base, stride_bm, qk_scale, softcap, alibi_slope, rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k,
            dropout_p, BLOCK_M, HEAD_DIM, BLOCK_D, True, MASK_LEFT, MASK_RIGHT, ROW_BOUNDS,
            HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_FP32, PRECISION,
        )  # fmt: skip
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, Lse + l_off, Delta + l_off, stride_qm, stride_dom,
            a, bnd, offs_n, offs_m0, offs_d, shift, q_len, k_len, window_left, window_right,
            bounds_base, stride_bm, qk_scale, softcap, alibi_slope, rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k,
            dropout_p, BLOCK_M, HEAD_DIM, BLOCK_D, False, MASK_LEFT, MASK_RIGHT, ROW_BOUNDS,
            HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_FP32, PRECISION,
        )  # fmt: skip
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, Lse + l_off, Delta + l_off, stride_qm, stride_dom,
            bnd, hi, offs_n, offs_m0, offs_d, shift, q_len, k_len, window_left, window_right,
            bounds_base, stride_bm, qk_scale, softcap, alibi_slope, rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k,
            dropout_p, BLOCK_M, HEAD_DIM, BLOCK_D, True, MASK_LEFT, MASK_RIGHT, ROW_BOUNDS,
            HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_FP32, PRECISION,
        )  # fmt: skip
    dk = dk * qk_scale  # dS is w.r.t. the scaled scores
    tl.store(
        DK + b64 * stride_dkb + kv_h.to(tl.int64) * stride_dkh + rows_k * stride_dkn
        + tl.arange(0, BLOCK_N)[:, None] * stride_dkn + offs_d[None, :],
        dk.to(DK.dtype.element_ty), mask=kv_ok,
    )  # fmt: skip
    tl.store(
        DV + b64 * stride_dvb + kv_h.to(tl.int64) * stride_dvh + rows_k * stride_dvn
        + tl.arange(0, BLOCK_N)[:, None] * stride_dvn + offs_d[None, :],
        dv.to(DV.dtype.element_ty), mask=kv_ok,
    )  # fmt: skip


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta,
    k_base, v_base, stride_kn, stride_vn,
    start, end, offs_m, offs_n0, offs_d, pos, seqlen_k, window_left, window_right, key_lo, key_hi,
    qk_scale, softcap, alibi_slope,
    rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k, dropout_p,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    ROW_BOUNDS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate dQ of one query tile over key tiles [start, end); ``key_lo`` / ``key_hi``
    ([BLOCK_M]) are the rows' key ranges with ``ROW_BOUNDS``."""
    d_ok = offs_d < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        n64 = tl.cast(start_n, tl.int64)
        kt_ptrs = k_base + n64 * stride_kn + offs_n0[None, :] * stride_kn + offs_d[:, None]
        vt_ptrs = v_base + n64 * stride_vn + offs_n0[None, :] * stride_vn + offs_d[:, None]
        if MASKED:
            ok = d_ok[:, None] & (offs_n[None, :] < seqlen_k)
            kt = tl.load(kt_ptrs, mask=ok, other=0.0)
            vt = tl.load(vt_ptrs, mask=ok, other=0.0)
        elif HEAD_DIM == BLOCK_D:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
            vt = tl.load(vt_ptrs, mask=d_ok[:, None], other=0.0)
        if DOT_FP32:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        key = offs_n[None, :]
        s = tl.dot(q, kt, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        s2, t = scores_log2(s, pos, key, qk_scale, softcap, alibi_slope, HAS_SOFTCAP, HAS_ALIBI)
        if MASKED:
            vis = visible(pos, key, seqlen_k, window_left, window_right, MASK_LEFT, MASK_RIGHT)
            if ROW_BOUNDS:
                vis = vis & (key >= key_lo[:, None]) & (key < key_hi[:, None])
            s2 = tl.where(vis, s2, float("-inf"))
        p = tl.exp2(s2 - lse2[:, None])
        dp = tl.dot(do, vt, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        if HAS_DROPOUT:
            keep = dropout_keep(
                rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k, offs_m[:, None], key, dropout_p
            )
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, CuSeqlensQ, CuSeqlensK, Alibi, Rng, KeyBounds,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_ab, stride_bb, stride_bm,
    seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k, nheads, group,
    window_left, window_right, qk_scale, softcap, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    ROW_BOUNDS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    REVERSE_M: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // nheads
    h = bh % nheads
    if REVERSE_M:
        pid_m = tl.num_programs(0) - 1 - pid_m
    q_start, q_len, k_start, k_len = seq_bounds(CuSeqlensQ, CuSeqlensK, b, seqlen_q, seqlen_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    shift = k_len - q_len
    kv_h = h // group
    b64 = b.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    row_ok = offs_m < q_len
    ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = (q_start + m0).to(tl.int64)
    tile = tl.arange(0, BLOCK_M)[:, None]
    q = tl.load(
        Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + rows * stride_qm
        + tile * stride_qm + offs_d[None, :], mask=ok, other=0.0,
    )  # fmt: skip
    do = tl.load(
        DOut + b64 * stride_dob + h.to(tl.int64) * stride_doh + rows * stride_dom
        + tile * stride_dom + offs_d[None, :], mask=ok, other=0.0,
    )  # fmt: skip
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    l_off = b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m
    lse2 = tl.load(Lse + l_off, mask=row_ok, other=float("inf")) * LOG2E
    delta = tl.load(Delta + l_off, mask=row_ok, other=0.0)
    alibi_slope = 0.0
    if HAS_ALIBI:
        alibi_slope = tl.load(Alibi + b64 * stride_ab + h)
    rng_seed = 0
    rng_offset = 0
    if HAS_DROPOUT:
        rng_seed = tl.load(Rng)
        rng_offset = tl.load(Rng + 1)
    k_base = K + b64 * stride_kb + kv_h.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + kv_h.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
    pos = (offs_m + shift)[:, None]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    key_lo, key_hi, lo, a, bnd, hi = query_tile_key_runs(
        KeyBounds, stride_bb, stride_bm, b64, q_start, offs_m, row_ok, q_len, k_len, m0, shift,
        window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, ROW_BOUNDS,
    )  # fmt: skip
    dq = _dq_tiles(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
        lo, a, offs_m, offs_n0, offs_d, pos, k_len, window_left, window_right, key_lo, key_hi,
        qk_scale, softcap, alibi_slope, rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k,
        dropout_p, BLOCK_N, HEAD_DIM, BLOCK_D, True, MASK_LEFT, MASK_RIGHT, ROW_BOUNDS,
        HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_FP32, PRECISION,
    )  # fmt: skip
    dq = _dq_tiles(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
        a, bnd, offs_m, offs_n0, offs_d, pos, k_len, window_left, window_right, key_lo, key_hi,
        qk_scale, softcap, alibi_slope, rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k,
        dropout_p, BLOCK_N, HEAD_DIM, BLOCK_D, False, MASK_LEFT, MASK_RIGHT, ROW_BOUNDS,
        HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_FP32, PRECISION,
    )  # fmt: skip
    dq = _dq_tiles(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
        bnd, hi, offs_m, offs_n0, offs_d, pos, k_len, window_left, window_right, key_lo, key_hi,
        qk_scale, softcap, alibi_slope, rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k,
        dropout_p, BLOCK_N, HEAD_DIM, BLOCK_D, True, MASK_LEFT, MASK_RIGHT, ROW_BOUNDS,
        HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_FP32, PRECISION,
    )  # fmt: skip
    dq = dq * qk_scale
    tl.store(
        DQ + b64 * stride_dqb + h.to(tl.int64) * stride_dqh + rows * stride_dqm
        + tile * stride_dqm + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=ok,
    )  # fmt: skip


def backward_path(q, k, v, out, dout, dk, dv, *, varlen, causal, window_left, window_right, softcap,
                  alibi_slopes, dropout_p, softmax_scale, sinks=None, key_bounds=None,
                  **_) -> str:  # fmt: skip
    """Which backward kernel :func:`flash_attn_backward` runs for these arguments: ``"hopper"``
    (the Gluon sm_90a kernel, :mod:`hf_flash.kernels.hopper.attention_bwd`) when it covers the
    call and the device allows it (:func:`configs.hopper_enabled`), else ``"triton"`` (this
    module's kernels). The Hopper kernel covers what the Hopper forward covers (fp16/bf16,
    causal or not, sliding windows; no ALiBi, dropout, sinks or key bounds), dense and packed
    (``varlen``: cu_seqlens, each sequence bottom-right aligned on its own), at head dims 64, 128
    and 256 (the softcap at 256 only), with out, dout, dk and dv addressable by TMA too
    (``None``: still to be allocated like q / k, which then are). Packed calls take it whatever
    :func:`configs.hopper_varlen_enabled` says (that switch is the packed forward's). The
    preprocess is this module's on both paths; dQ comes from the Hopper variant itself where it
    computes it (in a fixed order: deterministic), else from the Gluon dQ kernel
    (:mod:`hf_flash.kernels.hopper.attention_dq`, where :func:`gluon_dq_variant` says so) or this
    module's."""
    if sinks is not None or key_bounds is not None or not configs.hopper_backward_enabled(q.device):
        return "triton"
    from .hopper import attention_bwd as hopper  # Gluon: imported only where it can run

    out, dout = (q if t is None else t for t in (out, dout))
    dk, dv = (k if t is None else t for t in (dk, dv))
    covered = hopper.supports(
        q, k, v, out, dout, dk, dv, causal=causal, window=(window_left, window_right),
        softcap=softcap, alibi=alibi_slopes, dropout=dropout_p, softmax_scale=softmax_scale,
        varlen=varlen,
    )  # fmt: skip
    return "hopper" if covered else "triton"


def gluon_dq_variant(q, k, v, dout, dq, *, backward_variant, varlen, causal, window_left, window_right, softcap,
                     dropout_p, softmax_scale, alibi_slopes=None, sinks=None, key_bounds=None, **_):  # fmt: skip
    """The Gluon dQ kernel's variant (:mod:`hf_flash.kernels.hopper.attention_dq`) that computes dQ
    for these arguments, or None where another kernel does: the Hopper backward variant itself
    (its ``dq_atomic`` forms) or this module's dQ kernel. ``backward_variant``: the Hopper dK/dV
    variant the call runs, None where this module's dK/dV kernel runs (:func:`backward_path`).
    Beside a Hopper variant that leaves dQ out, the Gluon dQ runs wherever
    ``attention_dq.covers`` says so; beside this module's dK/dV kernel (the soft-capped calls at
    d128, whose Gluon dK/dV spills) only where, in addition, the call is one the Gluon forward
    covers (fp16/bf16 on sm_90, no ALiBi, dropout, sinks or key bounds) and the Hopper backward is
    switched on (k and v are read only there). ``dout`` / ``dq`` None: still to be allocated
    like q."""
    dout, dq = (q if t is None else t for t in (dout, dq))
    if backward_variant is None:
        if sinks is not None or key_bounds is not None or not configs.hopper_backward_enabled(q.device):
            return None
        from .hopper import attention_fwd

        if not attention_fwd.supports(q, k, v, causal=causal, window=(window_left, window_right), softcap=softcap,
                                      alibi=alibi_slopes, dropout=dropout_p, varlen=varlen,
                                      softmax_scale=softmax_scale):  # fmt: skip
            return None
    else:
        from .hopper import attention_bwd as hopper

        if hopper.VARIANTS[backward_variant].dq_atomic:
            return None
    from .hopper import attention_dq

    if not attention_dq.covers(q, dout, dq, softcap=softcap, varlen=varlen):
        return None
    return attention_dq.variant_for(q.shape[-1], softcap, varlen)


@configs.on_input_device
def flash_attn_backward(
    dout, dlse, q, k, v, out, lse, dq, dk, dv, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
    dropout_p, rng_state, sinks=None, dsinks=None, key_bounds=None,
):  # fmt: skip
    """Launch the three backward kernels; layouts as in flash_fwd.flash_attn_forward. Calls
    the Gluon Hopper dK/dV kernel covers run it in place of the Triton one
    (:func:`backward_path`); both write the same gradients. With learnable ``sinks`` (H,),
    their gradient goes to ``dsinks`` (H,): the sink's probability in row i is
    ``p_i = exp(sink - lse_i)`` and its value is zero, so ``d sink = -sum_i p_i * delta_i`` over
    every row of its head (``delta_i = rowsum(dO_i * O_i) - dlse_i``, the preprocess kernel's
    per-row term); the other gradients keep their form, the sink being inside lse already.
    ``key_bounds``: as in the forward; a pre-pass (one small launch) gives the dK/dV kernel each
    key tile's query rows."""
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        nheads, head_dim = q.shape[1], q.shape[2]
        nheads_k = k.shape[1]
        seqlen_q = seqlen_k = 0
        stride_lb, stride_lh = 0, lse.stride(0)
    else:
        batch, seqlen_q, nheads, head_dim = q.shape
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
        stride_lb, stride_lh = lse.stride(0), lse.stride(1)
    if q.numel() == 0 or k.numel() == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        if dsinks is not None:  # rows that see no key: out = 0, so delta_i = -dlse_i
            _sink_grad(sinks, lse, None if dlse is None else -dlse.float(), varlen, dsinks)
        return
    path = backward_path(
        q, k, v, out, dout, dk, dv, varlen=varlen, causal=causal, window_left=window_left,
        window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
        softmax_scale=softmax_scale, sinks=sinks, key_bounds=key_bounds,
    )  # fmt: skip
    variant, stats_m, dq_sem = None, 0, None
    if path == "hopper":
        from .hopper import attention_bwd as hopper

        variant = hopper.variant_for(head_dim, causal, varlen, 0 if varlen else q.shape[1],
                                     (window_left, window_right))  # fmt: skip
        stats_m = hopper.VARIANTS[variant].stats_rows
        dq_sem = hopper.sem_from_preprocess(q, variant, varlen)
    delta, stats = backward_preprocess(out, dout, dlse, lse, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                                       stats_m=stats_m, dq_sem=dq_sem)  # fmt: skip
    if dsinks is not None:
        _sink_grad(sinks, lse, delta, varlen, dsinks)
    if path == "hopper" and hopper.hopper_attention_backward(
        q, k, v, dout, lse, delta, dq, dk, dv, softmax_scale=softmax_scale, causal=causal, variant=variant,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, window=(window_left, window_right),
        softcap=softcap, stats=stats, dq_sem=dq_sem,
    ):
        return  # the variant computed dQ too
    dq_variant = gluon_dq_variant(
        q, k, v, dout, dq, backward_variant=variant, varlen=varlen, causal=causal, window_left=window_left,
        window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
        softmax_scale=softmax_scale, sinks=sinks, key_bounds=key_bounds,
    )  # fmt: skip

    def gluon_dq():
        from .hopper import attention_dq

        attention_dq.hopper_attention_dq(
            q, k, v, dout, lse, delta, dq, softmax_scale=softmax_scale, causal=causal, variant=dq_variant,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, window=(window_left, window_right),
            softcap=softcap,
        )  # fmt: skip

    if path == "hopper" and dq_variant is not None:
        gluon_dq()
        return
    # the Triton kernels' arguments: dK/dV off Hopper, dQ wherever neither Gluon kernel computed it
    dkdv_cfg, dq_cfg = configs.bwd_configs(head_dim, q.dtype, q.device)
    flags = kernel_flags(q, window_left, window_right, softcap, alibi_slopes, dropout_p, key_bounds)
    block_d = configs.head_dim_block(head_dim)
    stride_ab = alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0
    common = (seqlen_q, seqlen_k, int(max_seqlen_q), int(max_seqlen_k))
    windows = (int(window_left), int(window_right))
    scalars = (float(softmax_scale), float(softcap), float(dropout_p))
    if path != "hopper":
        key_tiles = configs.cdiv(max_seqlen_k, dkdv_cfg["BLOCK_N"])
        query_runs = None
        if key_bounds is not None:
            query_runs = torch.empty((batch, key_tiles, 4), dtype=torch.int32, device=q.device)
            _bwd_bounds_pre_pass[(key_tiles, batch)](
                key_bounds, query_runs, cu_seqlens_q, cu_seqlens_k,
                *bounds_strides(key_bounds, varlen), query_runs.stride(0), seqlen_q, seqlen_k,
                BLOCK_M=64, BLOCK_N=dkdv_cfg["BLOCK_N"], IS_VARLEN=varlen,
            )  # fmt: skip
        _DKDV(
            (key_tiles, batch * nheads_k),
            (q, k, v, dout, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state,
             key_bounds, query_runs),
            (
                *_dense_or_varlen_strides(q, varlen), *_dense_or_varlen_strides(k, varlen),
                *_dense_or_varlen_strides(v, varlen), *_dense_or_varlen_strides(dout, varlen),
                *_dense_or_varlen_strides(dk, varlen), *_dense_or_varlen_strides(dv, varlen),
                stride_lb, stride_lh, stride_ab, *bounds_strides(key_bounds, varlen),
                0 if query_runs is None else query_runs.stride(0),
                *common, nheads, nheads_k, nheads // nheads_k, *windows,
            ),
            scalars,
            _DKDV.meta_for(
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=dkdv_cfg["BLOCK_M"],
                BLOCK_N=dkdv_cfg["BLOCK_N"], IS_VARLEN=varlen,
                **flags, **configs.launch_options(dkdv_cfg, varlen),
            ),
        )  # fmt: skip
    if dq_variant is not None:  # beside the Triton dK/dV kernel
        gluon_dq()
        return
    _DQ(
        (configs.cdiv(max_seqlen_q, dq_cfg["BLOCK_M"]), batch * nheads),
        (q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, key_bounds),
        (
            *_dense_or_varlen_strides(q, varlen), *_dense_or_varlen_strides(k, varlen),
            *_dense_or_varlen_strides(v, varlen), *_dense_or_varlen_strides(dout, varlen),
            *_dense_or_varlen_strides(dq, varlen),
            stride_lb, stride_lh, stride_ab, *bounds_strides(key_bounds, varlen),
            *common, nheads, nheads // nheads_k, *windows,
        ),
        scalars,
        _DQ.meta_for(
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=dq_cfg["BLOCK_M"], BLOCK_N=dq_cfg["BLOCK_N"],
            IS_VARLEN=varlen, REVERSE_M=window_right >= 0 or key_bounds is not None,
            **flags, **configs.launch_options(dq_cfg, varlen),
        ),
    )  # fmt: skip


def stats_numel(batch: int, nheads: int, seqlen_q: int, block_m: int) -> int:
    """Floats in the statistics buffer :func:`_bwd_preprocess` writes for a Gluon ``stats_smem``
    variant: a row pair of ``block_m`` floats per (batch, head, query tile)."""
    return batch * nheads * configs.cdiv(seqlen_q, block_m) * 2 * block_m


def backward_preprocess(out, dout, dlse, lse, *, cu_seqlens_q, max_seqlen_q, stats_m=0, dq_sem=None):
    """The backward's first launch (:func:`_bwd_preprocess`), layouts as in
    :func:`flash_attn_backward`: returns ``delta`` (lse's shape and strides) and, with ``stats_m``
    > 0 (dense calls: the query rows per step of a Gluon ``stats_smem`` variant), the statistics
    buffer that variant reads (per (batch, head, query tile) lse times log2 e, then delta), else
    None. ``dq_sem`` (with ``stats_m``): int32 counters, one per (batch, head, query tile), that
    the launch zeroes too (``hopper.attention_bwd.sem_from_preprocess``), so the backward that
    reads them needs no fill launch of its own."""
    varlen = cu_seqlens_q is not None
    if varlen:
        batch, seqlen_q = cu_seqlens_q.numel() - 1, 0
        nheads, head_dim = out.shape[1], out.shape[2]
        stride_lb, stride_lh = 0, lse.stride(0)
    else:
        batch, seqlen_q, nheads, head_dim = out.shape
        stride_lb, stride_lh = lse.stride(0), lse.stride(1)
    stats, rows = None, max_seqlen_q
    if stats_m:
        if varlen or lse.stride(-1) != 1 or stats_m % 64:
            raise ValueError(f"backward_preprocess: a statistics buffer needs a dense call with lse unit-stride along "
                             f"the rows and a multiple of 64 rows per tile (got varlen={varlen}, lse strides "
                             f"{lse.stride()}, stats_m={stats_m})")  # fmt: skip
        stats = torch.empty(stats_numel(batch, nheads, seqlen_q, stats_m), device=lse.device, dtype=torch.float32)
        rows = configs.cdiv(seqlen_q, stats_m) * stats_m  # every tile's rows, past the end included
    if dq_sem is not None:
        tiles = stats_numel(batch, nheads, seqlen_q, stats_m) // (2 * stats_m) if stats_m else 0
        if not stats_m or dq_sem.dtype != torch.int32 or dq_sem.numel() != tiles or dq_sem.device != lse.device:
            raise ValueError(f"backward_preprocess: dq_sem must be {tiles} int32 counters on {lse.device} (one "
                             f"per query tile of stats_m rows, stats_m > 0), got {dq_sem.numel()} {dq_sem.dtype} "
                             f"with stats_m={stats_m}")  # fmt: skip
    if dlse is not None:
        dlse = dlse.contiguous()
    delta = torch.empty_like(lse)
    tensors = (out, dout, dlse, lse, delta, stats, dq_sem, cu_seqlens_q)
    # everything the launch's grid, integers and constexprs follow from (the launch checks dtypes)
    key = (out.shape, out.stride(), dout.stride(), lse.stride(), None if dlse is None else dlse.stride(), varlen,
           batch, rows, stats_m, dq_sem is not None)  # fmt: skip
    plan = _PREPROCESS_PLANS.get(key, lambda: _preprocess_plan(tensors, varlen, batch, seqlen_q, nheads, head_dim,
                                                               rows, stride_lb, stride_lh, stats_m))  # fmt: skip
    _PREPROCESS.run_plan(plan, tensors)
    return delta, stats


def _preprocess_plan(tensors, varlen, batch, seqlen_q, nheads, head_dim, rows, stride_lb, stride_lh,
                     stats_m) -> LaunchPlan:  # fmt: skip
    """:func:`backward_preprocess`'s launch for its ``tensors`` (the launch's pointer arguments)."""
    out, dout, dlse, _lse, _delta, _stats, dq_sem, _cu = tensors
    block_d = configs.head_dim_block(head_dim)
    pre_m = 64 if block_d <= 256 else 32  # out and dO tiles of pre_m x block_d in registers
    meta = _PREPROCESS.meta_for(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=pre_m, IS_VARLEN=varlen,
                                HAS_DLSE=dlse is not None, STATS_M=stats_m, ZERO_SEM=dq_sem is not None)  # fmt: skip
    ints = (*_dense_or_varlen_strides(out, varlen), *_dense_or_varlen_strides(dout, varlen), stride_lb, stride_lh,
            seqlen_q, nheads)  # fmt: skip
    return LaunchPlan.capture((configs.cdiv(rows, pre_m), batch * nheads), tensors, ints, (), meta, tensors)


# cached launches (kernels/launch.py): ~100 us less host time per call than kernel[grid](...)
_PREPROCESS = CachedLauncher(_bwd_preprocess)
_PREPROCESS_PLANS = PlanCache()
_DKDV = CachedLauncher(_bwd_dkdv_kernel)
_DQ = CachedLauncher(_bwd_dq_kernel)


def _sink_grad(sinks, lse, delta, varlen: bool, dsinks) -> None:
    """``dsinks[h] = -sum over rows of exp(sinks[h] - lse) * delta`` (see
    :func:`flash_attn_backward`); ``delta`` None means zero. lse/delta are (B, H, S) or, packed,
    (H, T)."""
    if delta is None:
        dsinks.zero_()
        return
    s = sinks.float()[:, None] if varlen else sinks.float()[None, :, None]
    p = torch.exp(s - lse)
    dims = (1,) if varlen else (0, 2)
    dsinks.copy_(-(p * delta).sum(dims))
