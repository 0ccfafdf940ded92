"""FlashAttention forward for Hopper (sm_90a) in Gluon, after FlashAttention-3's recipe.

One program computes the output of ``CONSUMERS * BLOCK_M`` query rows of one (batch, head):

* a producer partition (one warp) issues TMA copies: the program's Q tile(s) once, then the
  visible K and V tiles into a ``STAGES``-deep shared-memory ring; each copy completes on an
  mbarrier (``k_ready`` / ``v_ready``), and each slot is handed back by the consumers through
  another (``k_empty`` / ``v_empty``), so loads run ahead of the math by up to ``STAGES`` tiles;
* consumer warpgroups own ``BLOCK_M`` query rows each (64 rows per warpgroup of 4 warps: the
  wgmma M) and run S = Q K^T and O += P V as asynchronous wgmma (Q, K and V from shared memory,
  P from registers), with the online softmax in between, in base 2 (``exp2``; the scale is folded
  with log2(e) into one multiplier).

Variants (compile-time):

* ``CONSUMERS``: 2 or 3 four-warp consumer partitions (the default and workers), each with its
  own 64-row Q tile, sharing the K/V ring. (One 8-warp consumer partition on 128 rows measured
  10-15% slower than two 4-warp ones on the H100: the two partitions drift apart and one's softmax
  hides under the other's wgmma; see .notes/hopper.md.)
* ``PINGPONG``: the consumer partitions take turns (an mbarrier per consumer) to issue their
  wgmmas, so the tensor cores run one consumer's GEMMs while another does its softmax (FA3's
  inter-warpgroup schedule). Without it they interleave only as the warp schedulers happen to.
* ``FMA_SCALE``: keep the running max in the raw score domain and compute
  ``exp2(s * scale - m * scale)`` (one FMA per score) instead of scaling the scores first.
* ``OVERLAP``: issue S_{j+1} = Q K_{j+1}^T and O += P_j V_j back to back and compute the softmax of
  S_{j+1} while the P V product runs (FA3's intra-warpgroup pipelining). Without it each wgmma is
  waited for before the next step.

Masking: key tiles that are entirely visible run without a mask; only tiles that cross the causal
diagonal (bottom-right aligned: query row i sees keys ``j <= i + seqlen_k - seqlen_q``) or the
end of the keys are masked, and tiles past the diagonal are never loaded. Programs are ordered
longest first for causal attention (the grid's fastest axis is (batch, head), its slowest the
query tile counted from the end), so the tail of the launch holds the short programs.

Addressing goes through TMA descriptors over (batch, head, seq, dim) views with the tensors' own
strides (int64 in the descriptor; tile coordinates are int32 per axis), so non-contiguous views
and 1M-token sequences need no copies and cannot overflow. Rows past the end of a sequence are
zero-filled on load and clipped on store by the TMA unit. The log-sum-exp is written with int64
pointer arithmetic.

Rows that see no key (causal with seqlen_q > seqlen_k) get output 0 and log-sum-exp +inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
LN2 = gl.constexpr(0.6931471805599453)


@dataclass(frozen=True)
class Variant:
    """One compiled form of the kernel; ``rows`` query rows per program. The producer warp is
    padded to a warpgroup, so a program has (consumers + 1) * 4 warps."""

    name: str
    block_m: int  # rows per consumer partition
    block_n: int  # keys per K/V tile
    stages: int  # K/V ring depth
    consumers: int  # consumer partitions (1, 2 or 3)
    consumer_warps: int  # warps per consumer partition (one warpgroup)
    overlap: bool  # softmax of tile j+1 under the P V wgmma of tile j
    pingpong: bool = False  # consumers take turns issuing their wgmmas
    fma_scale: bool = False  # scale folded into exp2's argument (one FMA per score)
    consumer_regs: int = 0  # register budget of each worker consumer partition (consumers > 1)
    head_dims: tuple = (64, 128)

    @property
    def rows(self) -> int:
        return self.block_m * self.consumers


# Every variant the package compiles and tests. ws2x4 is the plain form (no overlap, no ping-pong,
# scale applied before the max), kept as the reference point of the measurements in
# .notes/hopper.md; the others add FA3's pieces. DEFAULT maps (head_dim, causal) to the variant
# that measured fastest there (H100, 2026-11-24, benchmarks/hopper_attention.py).
VARIANTS = {
    v.name: v
    for v in (
        Variant("ws2x4", block_m=64, block_n=128, stages=2, consumers=2, consumer_warps=4, overlap=False,
                consumer_regs=232),
        Variant("ws2x4-overlap-fma", block_m=64, block_n=128, stages=2, consumers=2, consumer_warps=4,
                overlap=True, fma_scale=True, consumer_regs=232),
        Variant("ws2x4-pp", block_m=64, block_n=128, stages=2, consumers=2, consumer_warps=4, overlap=True,
                pingpong=True, fma_scale=True, consumer_regs=232),
        Variant("ws3x4-pp", block_m=64, block_n=128, stages=2, consumers=3, consumer_warps=4, overlap=True,
                pingpong=True, fma_scale=True, consumer_regs=160, head_dims=(64,)),
        Variant("ws3x4-pp-s3", block_m=64, block_n=128, stages=3, consumers=3, consumer_warps=4, overlap=True,
                pingpong=True, fma_scale=True, consumer_regs=160, head_dims=(64,)),
        Variant("ws3x4-overlap-fma", block_m=64, block_n=128, stages=2, consumers=3, consumer_warps=4,
                overlap=True, fma_scale=True, consumer_regs=160, head_dims=(64,)),
    )
}  # fmt: skip
DEFAULT = {
    (128, False): "ws2x4-overlap-fma",
    (128, True): "ws2x4-overlap-fma",
    (64, False): "ws3x4-pp-s3",
    (64, True): "ws3x4-pp-s3",
}
HEAD_DIMS = (64, 128)
PRODUCER_REGS = 24


@gluon.constexpr_function
def _mma_layout(n, num_warps):
    # wgmma: m16 x n x k16 instructions, warps stacked along M (each warpgroup owns 64 rows)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _producer(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem,
    q_bar, k_ready, v_ready, k_empty, v_empty,
    b, h, kv_h, m0, n_tiles,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
):  # fmt: skip
    mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(
            q_desc, [b, h, m0 + c * BLOCK_M, 0], q_bar, q_smem.index(c).reshape([1, 1, BLOCK_M, HEAD_DIM])
        )
    for j in range(n_tiles):
        slot = j % STAGES
        # a fresh barrier counts as having completed the phase before 0, so the first pass
        # through the ring does not wait
        phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [b, kv_h, j * BLOCK_N, 0], k_ready.index(slot),
            k_smem.index(slot).reshape([1, 1, BLOCK_N, HEAD_DIM]),
        )  # fmt: skip
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            v_desc, [b, kv_h, j * BLOCK_N, 0], v_ready.index(slot),
            v_smem.index(slot).reshape([1, 1, BLOCK_N, HEAD_DIM]),
        )  # fmt: skip


@gluon.jit
def _softmax_step(s, m_i, l_i, rows, j, n_unmasked, seqlen_k, qk_scale,
                  s_layout: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                  FMA_SCALE: gl.constexpr):  # fmt: skip
    """Mask if this tile needs it and update the running max and sum; returns (p, alpha, m, l).

    ``qk_scale`` is softmax_scale * log2(e). With FMA_SCALE the running max stays in the raw
    score domain and ``s * scale - m * scale`` is one fused multiply-add per score (the scale is
    positive, so the max commutes with it); otherwise the scores are scaled first. ``m`` is in the
    domain of the scores it came from; :func:`_log2_max` converts it."""
    if not FMA_SCALE:
        s = s * qk_scale
    if j >= n_unmasked:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        vis = gl.expand_dims(cols, 0) < seqlen_k
        if CAUSAL:
            vis = vis & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        s = gl.where(vis, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # rows that have seen no key yet keep m = -inf; subtract 0 instead to avoid inf - inf
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    if FMA_SCALE:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_sub * qk_scale, 1))
        alpha = gl.exp2((m_i - m_sub) * qk_scale)
    else:
        p = gl.exp2(s - gl.expand_dims(m_sub, 1))
        alpha = gl.exp2(m_i - m_sub)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _turn_wait(turn, k, INDEX: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until it is this consumer's turn to issue its wgmmas (the k-th time).
    The consumers take turns in order 0, 1, ..., so one's softmax runs under another's GEMMs.
    A fresh barrier counts as having completed the phase before 0: consumer 0's first wait
    passes at once, every other one waits for the previous consumer's first hand-over."""
    if PINGPONG:
        if INDEX == 0:
            mbarrier.wait(turn.index(0), (k & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(INDEX), k & 1)


@gluon.jit
def _turn_pass(turn, INDEX: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index((INDEX + 1) % CONSUMERS))


@gluon.jit
def _consumer(
    q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
    o_desc, Lse, stride_lb, stride_lh, stride_lm,
    b, h, m0, n_tiles, n_unmasked, seqlen_q, seqlen_k, qk_scale,
    INDEX: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, NUM_WARPS: gl.constexpr,
    CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, FMA_SCALE: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, NUM_WARPS)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    row0 = m0 + INDEX * BLOCK_M
    # key positions each query row may see, bottom-right aligned
    rows = row0 + gl.arange(0, BLOCK_M, layout=row_s) + (seqlen_k - seqlen_q)
    q_tile = q_smem.index(INDEX)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_bar, 0)
    if OVERLAP:
        if n_tiles > 0:
            mbarrier.wait(k_ready.index(0), 0)
            _turn_wait(turn, 0, INDEX, PINGPONG)
            s = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            _turn_pass(turn, INDEX, CONSUMERS, PINGPONG)
            s = warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(k_empty.index(0))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, rows, 0, n_unmasked, seqlen_k, qk_scale,
                                               s_layout, BLOCK_N, CAUSAL, FMA_SCALE)  # fmt: skip
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(1, n_tiles):
                slot = j % STAGES
                prev = (j - 1) % STAGES
                mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
                mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
                _turn_wait(turn, j, INDEX, PINGPONG)
                s_tok = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)  # fmt: skip
                acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
                _turn_pass(turn, INDEX, CONSUMERS, PINGPONG)
                # S_j is done once at most one group (the P V product) is still running
                s = warpgroup_mma_wait(1, deps=(s_tok,))
                mbarrier.arrive(k_empty.index(slot))
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, rows, j, n_unmasked, seqlen_k, qk_scale,
                                                   s_layout, BLOCK_N, CAUSAL, FMA_SCALE)  # fmt: skip
                # p_op is a register operand of the running wgmma: keep it alive until the wait
                acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
                mbarrier.arrive(v_empty.index(prev))
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            last = (n_tiles - 1) % STAGES
            mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
            _turn_wait(turn, n_tiles, INDEX, PINGPONG)
            acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
            _turn_pass(turn, INDEX, CONSUMERS, PINGPONG)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
            mbarrier.arrive(v_empty.index(last))
    else:
        for j in range(n_tiles):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            _turn_wait(turn, 2 * j, INDEX, PINGPONG)
            s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            _turn_pass(turn, INDEX, CONSUMERS, PINGPONG)
            s = warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(k_empty.index(slot))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, rows, j, n_unmasked, seqlen_k, qk_scale,
                                               s_layout, BLOCK_N, CAUSAL, FMA_SCALE)  # fmt: skip
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(v_ready.index(slot), phase)
            _turn_wait(turn, 2 * j + 1, INDEX, PINGPONG)
            acc_tok = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
            _turn_pass(turn, INDEX, CONSUMERS, PINGPONG)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
            mbarrier.arrive(v_empty.index(slot))

    # rows that saw no key: output 0 and lse = +inf (the backward's exp(s - lse) is then 0)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
    if FMA_SCALE:
        m_log2 = m_i * qk_scale
    else:
        m_log2 = m_i
    lse = gl.where(empty, float("inf"), (m_log2 + gl.log2(l_safe)) * LN2)

    # the Q tile is dead once the last S wgmma has completed: stage the output there for TMA
    q_tile.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], q_tile.reshape([1, 1, BLOCK_M, HEAD_DIM]))

    offs = row0 + gl.arange(0, BLOCK_M, layout=row_s)
    lse_ptrs = Lse + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + offs.to(gl.int64) * stride_lm
    gl.store(lse_ptrs, lse, mask=offs < seqlen_q)
    tma.store_wait(0)


@gluon.jit
def _attn_fwd_kernel(
    q_desc, k_desc, v_desc, o_desc, Lse,
    stride_lb, stride_lh, stride_lm,
    nheads, group, seqlen_q, seqlen_k, qk_scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, CONSUMER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
    PINGPONG: gl.constexpr, FMA_SCALE: gl.constexpr,
):  # fmt: skip
    ROWS: gl.constexpr = BLOCK_M * CONSUMERS
    bh = gl.program_id(0)
    b = bh // nheads
    h = bh % nheads
    kv_h = h // group
    # the slowest grid axis counts query tiles from the end: under causal masking the last
    # tiles see the most keys, so they start first
    m0 = (gl.num_programs(1) - 1 - gl.program_id(1)) * ROWS

    # keys [0, hi) are visible to some row of this program; tiles before n_unmasked are
    # visible to every row and inside the key range
    hi = seqlen_k
    full = seqlen_k // BLOCK_N
    if CAUSAL:
        shift = seqlen_k - seqlen_q
        hi = gl.minimum(seqlen_k, gl.maximum(m0 + ROWS + shift, 0))
        full = gl.minimum(full, gl.maximum(m0 + shift + 1, 0) // BLOCK_N)
    n_tiles = gl.cdiv(hi, BLOCK_N)
    n_unmasked = gl.minimum(full, n_tiles)

    dtype: gl.constexpr = q_desc.dtype
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, HEAD_DIM], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # each consumer partition arrives once per slot use
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(i), count=1)

    if CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                             o_desc, Lse, stride_lb, stride_lh, stride_lm,
                             b, h, m0, n_tiles, n_unmasked, seqlen_q, seqlen_k, qk_scale,
                             0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, CONSUMER_WARPS,
                             CONSUMERS, PINGPONG, FMA_SCALE)),
                (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                             o_desc, Lse, stride_lb, stride_lh, stride_lm,
                             b, h, m0, n_tiles, n_unmasked, seqlen_q, seqlen_k, qk_scale,
                             1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, CONSUMER_WARPS,
                             CONSUMERS, PINGPONG, FMA_SCALE)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                             v_empty, b, h, kv_h, m0, n_tiles, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS)),
            ],
            [CONSUMER_WARPS, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.static_assert(CONSUMERS == 3, "2 or 3 consumer partitions")
        gl.warp_specialize(
            [
                (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                             o_desc, Lse, stride_lb, stride_lh, stride_lm,
                             b, h, m0, n_tiles, n_unmasked, seqlen_q, seqlen_k, qk_scale,
                             0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, CONSUMER_WARPS,
                             CONSUMERS, PINGPONG, FMA_SCALE)),
                (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                             o_desc, Lse, stride_lb, stride_lh, stride_lm,
                             b, h, m0, n_tiles, n_unmasked, seqlen_q, seqlen_k, qk_scale,
                             1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, CONSUMER_WARPS,
                             CONSUMERS, PINGPONG, FMA_SCALE)),
                (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                             o_desc, Lse, stride_lb, stride_lh, stride_lm,
                             b, h, m0, n_tiles, n_unmasked, seqlen_q, seqlen_k, qk_scale,
                             2, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, CONSUMER_WARPS,
                             CONSUMERS, PINGPONG, FMA_SCALE)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                             v_empty, b, h, kv_h, m0, n_tiles, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS)),
            ],
            [CONSUMER_WARPS, CONSUMER_WARPS, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

_TMA_ALIGN_BYTES = 16


def _tma_compatible(t: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and 16-byte multiples for every stride
    but the innermost, which must be 1."""
    if t.stride(-1) != 1 or t.data_ptr() % _TMA_ALIGN_BYTES:
        return False
    return all((s * t.element_size()) % _TMA_ALIGN_BYTES == 0 for s in t.stride()[:-1])


def _on_hopper(t: torch.Tensor) -> bool:
    """The kernel is built for sm_90a: H100/H200 (compute capability 9.0) only."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device) == (9, 0)


def supports(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, dropout=0.0,
             varlen=False, softmax_scale=None) -> bool:  # fmt: skip
    """True when :func:`hopper_attention_forward` covers this call; everything else keeps the
    Triton kernels. Covered: dense (not varlen) q (B, Sq, H, D) and k/v (B, Sk, Hk, D) on an
    sm_90 GPU, float16 or bfloat16 (all three the same), D in (64, 128), H a multiple of Hk,
    causal or not, no sliding window (``window`` (-1, -1), or (-1, 0) with ``causal``), no
    softcap, ALiBi or dropout, a positive softmax scale (None: the default 1/sqrt(D)), and strides
    a TMA descriptor accepts (innermost 1, the others and the base 16-byte aligned)."""
    if varlen or alibi is not None or dropout > 0.0 or softcap > 0.0:
        return False
    if softmax_scale is not None and not softmax_scale > 0:
        return False
    left, right = window
    if left >= 0 or not (right < 0 or (causal and right == 0)):
        return False
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if not (q.device == k.device == v.device) or not _on_hopper(q):
        return False
    batch, seqlen_q, nheads, head_dim = q.shape
    if head_dim not in HEAD_DIMS or k.shape[3] != head_dim or v.shape != k.shape:
        return False
    if k.shape[0] != batch or k.shape[2] == 0 or nheads % k.shape[2]:
        return False
    # the grid's query-tile axis is limited to 65535 programs (128 rows each)
    if triton.cdiv(seqlen_q, 128) > 65535 or k.shape[1] >= 2**31:
        return False
    return all(_tma_compatible(t) for t in (q, k, v))


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """(B, S, H, D) tensor seen as (B, H, S, D) with its own strides; one tile = rows x D."""
    batch, seqlen, heads, head_dim = t.shape
    block = [1, 1, rows, head_dim]
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t.dtype])
    return TensorDescriptor(
        t, [batch, heads, seqlen, head_dim], [t.stride(0), t.stride(2), t.stride(1), 1], block, layout
    )


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def launch_args(q, k, v, out, lse, *, softmax_scale, causal, variant):
    """(grid, positional args, keyword args) of one launch; shared by the launcher and the
    CPU compile check, so both build the same kernel."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    var = VARIANTS[variant]
    if head_dim not in var.head_dims:
        raise ValueError(f"variant {variant} is built for head dims {var.head_dims}, not {head_dim}")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    grid = (batch * nheads, triton.cdiv(seqlen_q, var.rows))
    args = (
        _descriptor(q, var.block_m), _descriptor(k, var.block_n), _descriptor(v, var.block_n),
        _descriptor(out, var.block_m), lse,
        lse.stride(0), lse.stride(1), lse.stride(2),
        nheads, nheads // nheads_k, seqlen_q, seqlen_k, float(softmax_scale) * LOG2E,
    )  # fmt: skip
    kwargs = dict(
        BLOCK_M=var.block_m, BLOCK_N=var.block_n, HEAD_DIM=head_dim, STAGES=var.stages,
        CONSUMERS=var.consumers, CONSUMER_WARPS=var.consumer_warps, CONSUMER_REGS=var.consumer_regs,
        PRODUCER_REGS=PRODUCER_REGS, CAUSAL=bool(causal), OVERLAP=var.overlap, PINGPONG=var.pingpong,
        FMA_SCALE=var.fma_scale,
        num_warps=var.consumer_warps,
    )  # fmt: skip
    return grid, args, kwargs


def hopper_attention_forward(q, k, v, out, lse, *, softmax_scale, causal, variant=None) -> None:
    """Forward attention on Hopper. Layouts as ``hf_flash.kernels.flash_fwd.flash_attn_forward``
    (dense): q/out (B, Sq, H, D), k/v (B, Sk, Hk, D), lse (B, H, Sq) float32 natural-log
    log-sum-exp. Only calls for which :func:`supports` is true (checked by the caller); out must
    be TMA-compatible like q. ``variant`` names an entry of ``VARIANTS`` (default: ``DEFAULT``
    for the head dim and causality)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    if out.shape != q.shape or out.dtype != q.dtype or not _tma_compatible(out):
        raise ValueError("out must have q's shape and dtype and TMA-compatible strides")
    if lse.shape != (batch, nheads, seqlen_q) or lse.dtype != torch.float32:
        raise ValueError("lse must be float32 (batch, nheads, seqlen_q)")
    if q.numel() == 0:
        return
    if k.shape[1] == 0:
        out.zero_()
        lse.fill_(float("inf"))
        return
    variant = variant or DEFAULT[(head_dim, bool(causal))]
    grid, args, kwargs = launch_args(q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal, variant=variant)
    with torch.cuda.device(q.device):
        _attn_fwd_kernel[grid](*args, **kwargs)


def flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal) -> float:
    """Forward FLOPs as the benchmarks count them: 4 B H Sq Sk D, halved when causal."""
    f = 4.0 * batch * nheads * seqlen_q * seqlen_k * head_dim
    return f * 0.5 if causal else f


__all__ = ["hopper_attention_forward", "supports", "VARIANTS", "DEFAULT", "launch_args", "flops"]
