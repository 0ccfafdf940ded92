"""Pieces shared by the FlashAttention forward and backward kernels.

Scores live in the log2 domain inside the kernels (``exp2`` is one instruction, ``exp`` two):
``s2 = log2(e) * transform(q . k)``, where transform applies the softmax scale, the optional
softcap ``c * tanh(x / c)`` and the optional ALiBi bias. The saved log-sum-exp is in natural log
(the API's unit) and converted on load.

Masking uses key positions: query row ``i`` of a sequence sits at key position
``i + seqlen_k - seqlen_q`` (bottom-right alignment) and sees key ``j`` iff
``pos - window_left <= j <= pos + window_right`` (each side only when enabled; causal is
``window_right = 0``).

Integer divisions only ever see non-negative operands (Triton's ``//`` truncates toward zero
on the GPU, unlike Python's floor division).

Key (or query) ranges are cut into three runs of tiles: tiles that need the mask on the left
edge of the window, tiles fully inside the window and the sequence (no mask, no bounds checks,
the fast path) and tiles on the right edge (the causal diagonal). Tiles outside the window are
never visited, so windowed attention costs O(seqlen * window).

Per-row key bounds (``ROW_BOUNDS``, the ``key_bounds`` argument) replace causal masking and
windows: query row ``i`` sees keys ``lo_i <= j < hi_i`` (clamped to the sequence; ``lo_i >= hi_i``
sees none), one int32 pair per row. Query tiles take the hull of their rows' ranges
(:func:`bounded_key_tile_runs`); the backward's key tiles get the rows that see them from a
pre-pass (:func:`hf_flash.kernels.flash_bwd._bwd_bounds_pre_pass`). Whole tiles outside every
row's range are skipped; tiles inside every row's range run unmasked.
"""

import triton
import triton.language as tl

from . import configs

LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def tanh(x):
    # 1 - 2 / (exp(2x) + 1): exact limits (+-1) when exp2 over/underflows, no NaN.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 / ln(2)


@triton.jit
def seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(first row of the sequence in the packed tensor, its length) for q and k."""
    if IS_VARLEN:
        q_start = tl.load(cu_seqlens_q + b)
        q_len = tl.load(cu_seqlens_q + b + 1) - q_start
        k_start = tl.load(cu_seqlens_k + b)
        k_len = tl.load(cu_seqlens_k + b + 1) - k_start
    else:
        q_start = 0
        q_len = seqlen_q
        k_start = 0
        k_len = seqlen_k
    return q_start, q_len, k_start, k_len


@triton.jit
def key_tile_runs(
    m0, shift, seqlen_k, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
):  # fmt: skip
    """Key tiles for query rows [m0, m0 + BLOCK_M): returns lo <= a <= b <= hi such that
    [lo, a) and [b, hi) need masking and [a, b) is fully visible to every row and in bounds."""
    first = m0 + shift  # key position of the first row
    last = m0 + BLOCK_M - 1 + shift
    hi = seqlen_k
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if MASK_RIGHT:
        hi = tl.minimum(hi, last + window_right + 1)
        full_hi = tl.minimum(full_hi, (tl.maximum(first + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    hi = tl.maximum(hi, 0)
    lo = 0
    full_lo = 0
    if MASK_LEFT:
        lo = (tl.maximum(first - window_left, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last - window_left, 0), BLOCK_N) * BLOCK_N
    lo = tl.minimum(lo, hi)
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b = tl.maximum(tl.minimum(full_hi, hi), a)
    return lo, a, b, hi


@triton.jit
def load_row_bounds(KeyBounds, stride_bb, stride_bm, b64, q_start, offs_m, q_len, k_len):
    """Each query row's key range ``[lo, hi)`` ([BLOCK_M] int32 each), clamped to ``[0, k_len]``;
    rows past ``q_len`` get ``[0, 0)``. ``q_start`` is the sequence's first packed row (varlen)."""
    row_ok = offs_m < q_len
    ptrs = KeyBounds + b64 * stride_bb + (q_start + offs_m).to(tl.int64) * stride_bm
    lo = tl.maximum(tl.load(ptrs, mask=row_ok, other=0), 0)
    hi = tl.minimum(tl.load(ptrs + 1, mask=row_ok, other=0), k_len)
    return lo, hi


@triton.jit
def bounded_key_tile_runs(lo_rows, hi_rows, row_ok, k_len, BLOCK_N: tl.constexpr):
    """:func:`key_tile_runs` for per-row key ranges (:func:`load_row_bounds`; ``row_ok`` marks
    the rows inside the sequence): [lo, hi) covers every row's range, [a, b) lies inside the range
    of every row of the tile (empty when some row sees no key, which must stay at zero)."""
    seen = row_ok & (lo_rows < hi_rows)
    hi = tl.max(tl.where(seen, hi_rows, 0), axis=0)
    lo = (tl.min(tl.where(seen, lo_rows, k_len), axis=0) // BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(tl.max(tl.where(row_ok, lo_rows, 0), axis=0), BLOCK_N) * BLOCK_N
    full_hi = (tl.min(tl.where(row_ok, hi_rows, k_len), axis=0) // BLOCK_N) * BLOCK_N
    lo = tl.minimum(lo, hi)
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b = tl.maximum(tl.minimum(full_hi, hi), a)
    return lo, a, b, hi


@triton.jit
def query_tile_key_runs(
    KeyBounds, stride_bb, stride_bm, b64, q_start, offs_m, row_ok, q_len, k_len, m0, shift,
    window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    ROW_BOUNDS: tl.constexpr,
):  # fmt: skip
    """The key tiles of one query tile, for the forward and the dQ kernel: ``(key_lo, key_hi,
    lo, a, b, hi)``, the rows' key ranges (``ROW_BOUNDS``: :func:`load_row_bounds`; otherwise
    unused placeholders) and the runs of :func:`bounded_key_tile_runs` or :func:`key_tile_runs`."""
    if ROW_BOUNDS:
        key_lo, key_hi = load_row_bounds(KeyBounds, stride_bb, stride_bm, b64, q_start, offs_m, q_len, k_len)
        lo, a, b, hi = bounded_key_tile_runs(key_lo, key_hi, row_ok, k_len, BLOCK_N)
    else:
        key_lo = offs_m
        key_hi = offs_m
        lo, a, b, hi = key_tile_runs(
            m0, shift, k_len, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT
        )
    return key_lo, key_hi, lo, a, b, hi


@triton.jit
def query_tile_runs(
    n0, shift, seqlen_q, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, FULL_KEYS: tl.constexpr,
):  # fmt: skip
    """Query tiles that see any key of [n0, n0 + BLOCK_N): lo <= a <= b <= hi, [a, b) needing
    no mask (only when the key tile lies inside the sequence, FULL_KEYS)."""
    hi = seqlen_q
    lo = 0
    full_lo = 0
    full_hi = (seqlen_q // BLOCK_M) * BLOCK_M
    if MASK_RIGHT:
        # row i sees key j iff j <= i + shift + right  <=>  i >= j - shift - right
        lo = (tl.maximum(n0 - shift - window_right, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - shift - window_right, 0), BLOCK_M) * BLOCK_M
    if MASK_LEFT:
        # row i sees key j iff j >= i + shift - left  <=>  i <= j - shift + left
        hi = tl.minimum(hi, n0 + BLOCK_N - 1 - shift + window_left + 1)
        full_hi = tl.minimum(
            full_hi, (tl.maximum(n0 - shift + window_left + 1, 0) // BLOCK_M) * BLOCK_M
        )
    hi = tl.maximum(hi, 0)
    if not FULL_KEYS:
        full_hi = 0
    lo = tl.minimum(lo, hi)
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b = tl.maximum(tl.minimum(full_hi, hi), a)
    return lo, a, b, hi


@triton.jit
def visible(
    pos, key, seqlen_k, window_left, window_right,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
):  # fmt: skip
    """True where a query at key position ``pos`` may see key ``key`` (broadcastable 2-D index
    tiles, so callers choose the orientation: [M, 1] x [1, N] or [1, M] x [N, 1])."""
    vis = key < seqlen_k
    if MASK_RIGHT:
        vis = vis & (key <= pos + window_right)
    if MASK_LEFT:
        vis = vis & (key >= pos - window_left)
    return vis


@triton.jit
def scores_log2(
    qk, pos, key, qk_scale, softcap, alibi_slope,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    """Raw q.k tile -> log2-domain scores; ``pos``/``key`` are index tiles as in visible().
    Returns (s2, t) with t = tanh(...) when softcapping (the backward needs 1 - t^2)."""
    if HAS_SOFTCAP:
        t = tanh(qk * (qk_scale / softcap))
        s2 = t * (softcap * LOG2E)
    else:
        s2 = qk * (qk_scale * LOG2E)
        t = s2
    if HAS_ALIBI:
        s2 = s2 - (alibi_slope * LOG2E) * tl.abs(pos - key).to(tl.float32)
    return s2, t


@triton.jit
def dropout_keep(rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k, row, col, dropout_p):
    """Keep-mask from Philox, one draw per (batch*head, query row, key); ``row``/``col`` are
    broadcastable 2-D index tiles (local to the sequence)."""
    offsets = (
        rng_offset
        + (bh.to(tl.int64) * max_seqlen_q + row.to(tl.int64)) * max_seqlen_k
        + col.to(tl.int64)
    )
    return tl.rand(rng_seed, offsets) >= dropout_p


@triton.jit
def _dropout_mask_kernel(
    Out, Rng, max_seqlen_q, max_seqlen_k, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    seed = tl.load(Rng)
    offset = tl.load(Rng + 1)
    keep = dropout_keep(
        seed, offset, bh, max_seqlen_q, max_seqlen_k, offs_m[:, None], offs_n[None, :], dropout_p
    )
    ptrs = (
        Out
        + bh.to(tl.int64) * max_seqlen_q * max_seqlen_k
        + offs_m[:, None].to(tl.int64) * max_seqlen_k
        + offs_n[None, :]
    )
    inside = (offs_m[:, None] < max_seqlen_q) & (offs_n[None, :] < max_seqlen_k)
    tl.store(ptrs, keep.to(tl.int8), mask=inside)


@configs.on_input_device
def dropout_keep_mask(rng_state, batch: int, nheads: int, max_seqlen_q: int, max_seqlen_k: int,
                      dropout_p: float):  # fmt: skip
    """Materialise the keep-mask the attention kernels draw for ``rng_state`` (testing aid):
    bool (batch, nheads, max_seqlen_q, max_seqlen_k). For packed batches, sequence b uses the
    top-left ``[:len_q, :len_k]`` corner of ``[b]``."""
    import torch

    out = torch.empty(
        (batch, nheads, max_seqlen_q, max_seqlen_k), dtype=torch.int8, device=rng_state.device
    )
    grid = (configs.cdiv(max_seqlen_q, 16), configs.cdiv(max_seqlen_k, 16), batch * nheads)
    _dropout_mask_kernel[grid](
        out, rng_state, max_seqlen_q, max_seqlen_k, float(dropout_p), BLOCK_M=16, BLOCK_N=16
    )
    return out.bool()
