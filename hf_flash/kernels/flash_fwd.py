"""FlashAttention-2 forward pass in Triton.

Algorithm (Dao, "FlashAttention-2", 2023): each program owns BLOCK_M query rows of one
(batch, head), keeps them in registers, and streams the visible key/value tiles of the
sequence, maintaining the running row maximum ``m``, the running sum of exponentials ``l`` and
the unnormalised output ``acc`` (online softmax). The output is ``acc / l`` and the saved
log-sum-exp ``m + log(l)`` lets the backward recompute probabilities without storing them.

Supported: float16 / bfloat16 (float32 accumulation) and float32 (IEEE dot products, no TF32);
head dims 1..512 (padded to a power of two inside the kernel, masked on load/store); GQA/MQA by
indexing the K/V head; causal (bottom-right) and sliding windows with whole tiles skipped;
softcap; ALiBi; dropout (Philox, replayed by the backward); per-row key ranges in place of
causal/window masks (``key_bounds``: gemma3's bidirectional image blocks); dense and packed
(varlen) batches.
Addresses are computed in int64 so sequences of millions of tokens do not overflow.
"""

import torch
import triton
import triton.language as tl

from . import configs
from .launch import CachedLauncher
from .flash_common import LN2, LOG2E, dropout_keep, query_tile_key_runs, scores_log2, seq_bounds, visible


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q,
    k_base, v_base, stride_kn, stride_vn, offs_n0, offs_d,
    start, end, pos_m, offs_m, seqlen_k, window_left, window_right, key_lo, key_hi,
    qk_scale, softcap, alibi_slope,
    rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k, dropout_p,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    ROW_BOUNDS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of (acc, l_i, m_i) over key tiles [start, end); ``key_lo`` /
    ``key_hi`` ([BLOCK_M]) are the rows' key ranges with ``ROW_BOUNDS``."""
    d_ok = offs_d < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        kt_ptrs = k_base + tl.cast(start_n, tl.int64) * stride_kn + offs_n0[None, :] * stride_kn + offs_d[:, None]
        v_ptrs = v_base + tl.cast(start_n, tl.int64) * stride_vn + offs_n0[:, None] * stride_vn + offs_d[None, :]
        if MASKED:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None] & (offs_n[None, :] < seqlen_k), other=0.0)
        elif HEAD_DIM == BLOCK_D:
            kt = tl.load(kt_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
        if DOT_FP32:
            kt = kt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        s2, _t = scores_log2(
            qk, pos_m[:, None], offs_n[None, :], qk_scale, softcap, alibi_slope, HAS_SOFTCAP, HAS_ALIBI
        )
        if MASKED:
            vis = visible(
                pos_m[:, None], offs_n[None, :], seqlen_k, window_left, window_right, MASK_LEFT, MASK_RIGHT
            )
            if ROW_BOUNDS:
                vis = vis & (offs_n[None, :] >= key_lo[:, None]) & (offs_n[None, :] < key_hi[:, None])
            s2 = tl.where(vis, s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        # rows that have seen no key yet keep m = -inf; subtract 0 instead to avoid inf - inf
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s2 - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            keep = dropout_keep(
                rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k, offs_m[:, None], offs_n[None, :], dropout_p
            )
            p = tl.where(keep, p * (1.0 / (1.0 - dropout_p)), 0.0)
        if MASKED:
            v = tl.load(v_ptrs, mask=d_ok[None, :] & (offs_n[:, None] < seqlen_k), other=0.0)
        elif HEAD_DIM == BLOCK_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_fwd_kernel(
    Q, K, V, Out, Lse, CuSeqlensQ, CuSeqlensK, Alibi, Rng, Sinks, KeyBounds,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    stride_ab, stride_bb, stride_bm,
    seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k, nheads, group,
    window_left, window_right, qk_scale, softcap, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    REVERSE_M: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr, ROW_BOUNDS: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // nheads
    h = bh % nheads
    if REVERSE_M:
        # causal: the last query tiles see the most keys; start them first to shorten the tail
        pid_m = tl.num_programs(0) - 1 - pid_m
    q_start, q_len, k_start, k_len = seq_bounds(CuSeqlensQ, CuSeqlensK, b, seqlen_q, seqlen_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    shift = k_len - q_len  # bottom-right alignment
    kv_h = h // group

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    pos_m = offs_m + shift
    b64 = b.to(tl.int64)

    q_ptrs = (
        Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + (q_start + m0).to(tl.int64) * stride_qm
        + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :]
    )  # fmt: skip
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = K + b64 * stride_kb + kv_h.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + kv_h.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn

    alibi_slope = 0.0
    if HAS_ALIBI:
        alibi_slope = tl.load(Alibi + b64 * stride_ab + h)
    rng_seed = 0
    rng_offset = 0
    if HAS_DROPOUT:
        rng_seed = tl.load(Rng)
        rng_offset = tl.load(Rng + 1)

    if HAS_SINKS:
        # a learnable sink (gpt-oss): one more logit per head, in every row's softmax, with no
        # value; it opens the running max and sum, so a row that sees no key outputs 0
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sinks + h).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    key_lo, key_hi, lo, a, bnd, hi = query_tile_key_runs(
        KeyBounds, stride_bb, stride_bm, b64, q_start, offs_m, row_ok, q_len, k_len, m0, shift,
        window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, ROW_BOUNDS,
    )  # fmt: skip
    # left edge of a sliding window (masked), interior (unmasked), right edge / causal diagonal
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_n0, offs_d,
        lo, a, pos_m, offs_m, k_len, window_left, window_right, key_lo, key_hi, qk_scale, softcap, alibi_slope,
        rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k, dropout_p,
        BLOCK_N, HEAD_DIM, BLOCK_D, True, MASK_LEFT, MASK_RIGHT, ROW_BOUNDS,
        HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_FP32, PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_n0, offs_d,
        a, bnd, pos_m, offs_m, k_len, window_left, window_right, key_lo, key_hi, qk_scale, softcap, alibi_slope,
        rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k, dropout_p,
        BLOCK_N, HEAD_DIM, BLOCK_D, False, MASK_LEFT, MASK_RIGHT, ROW_BOUNDS,
        HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_FP32, PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_n0, offs_d,
        bnd, hi, pos_m, offs_m, k_len, window_left, window_right, key_lo, key_hi, qk_scale, softcap, alibi_slope,
        rng_seed, rng_offset, bh, max_seqlen_q, max_seqlen_k, dropout_p,
        BLOCK_N, HEAD_DIM, BLOCK_D, True, MASK_LEFT, MASK_RIGHT, ROW_BOUNDS,
        HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_FP32, PRECISION,
    )  # fmt: skip

    # rows that saw no key (and no sink): output 0 and lse = +inf (the backward's exp(s - lse)
    # is then 0)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) * LN2)

    o_ptrs = (
        Out + b64 * stride_ob + h.to(tl.int64) * stride_oh + (q_start + m0).to(tl.int64) * stride_om
        + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_d[None, :]
    )  # fmt: skip
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    l_ptrs = Lse + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m
    tl.store(l_ptrs, lse, mask=row_ok)


def _dense_or_varlen_strides(t: torch.Tensor, varlen: bool):
    """(batch, seq, head) strides; packed tensors have no batch axis (stride 0)."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def bounds_strides(key_bounds, varlen: bool):
    """(batch, row) strides of ``key_bounds`` ((B, Sq, 2), packed (Tq, 2)); 0, 0 without."""
    if key_bounds is None:
        return 0, 0
    assert key_bounds.dtype == torch.int32 and key_bounds.stride(-1) == 1
    if varlen:
        return 0, key_bounds.stride(0)
    return key_bounds.stride(0), key_bounds.stride(1)


def kernel_flags(q, window_left, window_right, softcap, alibi_slopes, dropout_p, key_bounds=None):
    """Compile-time switches shared by the forward and backward launchers."""
    dot_fp32 = q.dtype == torch.float32 or (configs.interpreting() and q.dtype == torch.bfloat16)
    # per-row key bounds replace the causal / window masks (the public API checks it)
    assert key_bounds is None or (window_left < 0 and window_right < 0)
    return dict(
        ROW_BOUNDS=key_bounds is not None,
        MASK_LEFT=window_left >= 0,
        MASK_RIGHT=window_right >= 0,
        HAS_SOFTCAP=softcap > 0.0,
        HAS_ALIBI=alibi_slopes is not None,
        HAS_DROPOUT=dropout_p > 0.0,
        # Triton's interpreter multiplies bf16 tiles wrongly; it computes them in fp32 instead.
        DOT_FP32=dot_fp32,
        PRECISION="ieee" if dot_fp32 else "tf32",
    )


def forward_path(q, k, v, out, *, varlen, causal, window_left, window_right, softcap,
                 alibi_slopes, dropout_p, softmax_scale, sinks=None, key_bounds=None,
                 **_) -> str:  # fmt: skip
    """Which kernel :func:`flash_attn_forward` runs for these arguments: ``"hopper"`` (the
    Gluon sm_90a kernel, :mod:`hf_flash.kernels.hopper`) when it covers the call and the device
    allows it (:func:`configs.hopper_enabled`), else ``"triton"`` (this module's kernel). The
    Hopper kernel takes fp16/bf16 calls, causal or not, GQA/MQA, sliding windows and softcap
    (``SOFTCAP_DISPATCH_HEAD_DIMS``: at head dim 64 the Triton forward measured faster with a
    softcap), without ALiBi, dropout, sinks or per-row key bounds, on tensors TMA can address
    (``out`` None: the output is still to be allocated like q, which then is addressable too):
    dense calls at head dim 64, 128 or 256, packed calls (``varlen``: cu_seqlens, causal
    alignment per sequence) at head dim 64, 128 or 256 (``VARLEN_DISPATCH_HEAD_DIMS``) unless
    switched off (:func:`configs.hopper_varlen_enabled`, ``HF_FLASH_HOPPER_VARLEN=0``)."""
    if sinks is not None or key_bounds is not None or not configs.hopper_enabled(q.device):
        return "triton"
    if varlen and not configs.hopper_varlen_enabled():
        return "triton"
    from .hopper import attention_fwd as hopper  # Gluon: imported only where it can run

    if varlen and q.shape[-1] not in hopper.VARLEN_DISPATCH_HEAD_DIMS:
        return "triton"
    if softcap > 0.0 and q.shape[-1] not in hopper.SOFTCAP_DISPATCH_HEAD_DIMS:
        return "triton"
    covered = hopper.supports(
        q, k, v, causal=causal, window=(window_left, window_right), softcap=softcap,
        alibi=alibi_slopes, dropout=dropout_p, softmax_scale=softmax_scale, varlen=varlen,
    ) and (out is None or hopper.tma_compatible(out))  # fmt: skip
    return "hopper" if covered else "triton"


@configs.on_input_device
def flash_attn_forward(
    q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
    sinks=None, key_bounds=None,
):  # fmt: skip
    """Launch the forward kernel. Tensors are validated by the caller (hf_flash.interface).

    Dense: q/out (B, Sq, H, D), k/v (B, Sk, Hk, D), lse (B, H, Sq).
    Packed: q/out (Tq, H, D), k/v (Tk, Hk, D), lse (H, Tq), cu_seqlens int32 (B + 1,).
    ``sinks``: None or (H,) float32 learnable sink logits (in the scaled scores' units); the
    lse then includes them.
    ``key_bounds``: None or int32 (B, Sq, 2) / packed (Tq, 2), unit last stride: query row i
    sees keys ``key_bounds[..., i, 0] <= j < key_bounds[..., i, 1]`` (key indices of its own
    sequence, clamped to it), in place of causal and window masks (which must then be off).
    ``window_right`` must already be 0 for causal attention. Calls the Gluon Hopper kernel
    covers run on it (:func:`forward_path`); both write the same outputs.
    """
    options = dict(
        varlen=cu_seqlens_q is not None, causal=causal, window_left=window_left,
        window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes,
        dropout_p=dropout_p, softmax_scale=softmax_scale, sinks=sinks, key_bounds=key_bounds,
    )  # fmt: skip
    if forward_path(q, k, v, out, **options) == "hopper":
        from .hopper.attention_fwd import hopper_attention_forward

        hopper_attention_forward(
            q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, window=(window_left, window_right), softcap=softcap,
        )  # fmt: skip
        return
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        nheads, head_dim = q.shape[1], q.shape[2]
        nheads_k = k.shape[1]
        seqlen_q = seqlen_k = 0  # read per sequence from cu_seqlens
        stride_lb, stride_lh = 0, lse.stride(0)
    else:
        batch, seqlen_q, nheads, head_dim = q.shape
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
        stride_lb, stride_lh = lse.stride(0), lse.stride(1)
    if q.numel() == 0 or batch == 0 or max_seqlen_q == 0:
        return
    if max_seqlen_k == 0:
        out.zero_()
        if sinks is None:
            lse.fill_(float("inf"))
        else:  # only the sink in every row's softmax
            lse.copy_(sinks.view(1, -1, 1).expand_as(lse) if not varlen else sinks[:, None].expand_as(lse))
        return
    cfg = configs.fwd_config(head_dim, q.dtype, q.device)
    flags = kernel_flags(q, window_left, window_right, softcap, alibi_slopes, dropout_p, key_bounds)
    stride_ab = 0
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        stride_ab = alibi_slopes.stride(0)
    grid = (configs.cdiv(max_seqlen_q, cfg["BLOCK_M"]), batch * nheads)
    _FORWARD(
        grid,
        (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, sinks, key_bounds),
        (
            *_dense_or_varlen_strides(q, varlen), *_dense_or_varlen_strides(k, varlen),
            *_dense_or_varlen_strides(v, varlen), *_dense_or_varlen_strides(out, varlen),
            stride_lb, stride_lh, stride_ab, *bounds_strides(key_bounds, varlen),
            seqlen_q, seqlen_k, int(max_seqlen_q), int(max_seqlen_k), nheads, nheads // nheads_k,
            int(window_left), int(window_right),
        ),
        (float(softmax_scale), float(softcap), float(dropout_p)),
        _FORWARD.meta_for(
            HEAD_DIM=head_dim, BLOCK_D=configs.head_dim_block(head_dim),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], IS_VARLEN=varlen,
            REVERSE_M=window_right >= 0 or key_bounds is not None, HAS_SINKS=sinks is not None,
            **flags, **configs.launch_options(cfg, varlen),
        ),
    )  # fmt: skip


# cached launches (kernels/launch.py): ~100 us less host time per call than kernel[grid](...)
_FORWARD = CachedLauncher(_flash_fwd_kernel)
