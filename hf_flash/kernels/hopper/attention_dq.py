"""dQ of the FlashAttention backward for Hopper (sm_90a) in Gluon: the query-tile kernel that runs
beside the backward variants that compute dK/dV only (``attention_bwd``'s ``kv2x64-m64-s2`` and
the split-D forms) and, for soft-capped d128 calls, beside the Triton dK/dV kernel, in place of
the Triton dQ kernel (``flash_bwd.gluon_dq_variant`` says where).

A program owns ``CONSUMERS * BLOCK_M`` query rows of one (batch, head): the forward's work items
(:func:`attention_fwd._work_item`: the same causal and window ranges of key tiles, dense or
packed through :func:`attention_fwd.varlen_schedule`), and walks the key tiles those rows see:

* a producer partition (one warp) loads the program's Q and dO tiles once and streams the K and V
  tiles through a ``STAGES``-deep shared-memory ring (:func:`attention_fwd._load_kv_tiles`);
* each consumer warpgroup owns ``BLOCK_M`` rows and, per key tile j, computes

      S  = Q K_j^T,  dP = dO V_j^T        (asynchronous wgmma, issued back to back)
      P  = exp2(S * scale * log2(e) - lse * log2(e))
      dS = P * (dP - delta)               (delta = rowsum(dO * O) - dlse, from the preprocess)
      dQ += dS K_j                        (dS from registers, K_j from shared memory)

  with tile j-1's dQ product issued after S_j and dP_j, so it runs while dS_j is computed. V_j's
  slot goes back to the producer once dP_j has completed, K_j's once dQ_j has.

dQ is scaled by the softmax scale once, at the end, and stored in q's dtype through the Q tile's
shared memory (free by then) and a TMA store; a packed tile that crosses its sequence's end is
stored element-wise (:func:`attention_fwd._store_rows`). Each row of dQ is summed by one
warpgroup in key order: deterministic. Masking as the forward's (bottom-right causal, sliding
windows; :func:`attention_fwd.mask_args`); rows that see no key (lse +inf) and rows outside the
sequence (their lse read as +inf) get P = 0, so dQ = 0 there. ``SOFTCAP``: the scores are the
forward's ``cap * tanh(S * scale / cap)``, masked after the tanh, and dS takes the factor
``1 - tanh^2`` (the tanh kept from S to dS: 16-32 more registers per thread). Head dims 64, 128
and 256 (``VARIANTS``). ``DEFAULT`` (packed calls: ``VARLEN_DEFAULT``) names the variant hf_flash
runs per head dim, soft-capped calls only at ``SOFTCAP_HEAD_DIMS``; the other calls keep the
Triton dQ kernel.

With the dK/dV kernel beside it the backward computes 7 products for the 5 counted (S and dP
twice); the fused variants that add dQ inside the dK/dV kernel compute 5 but wait on each other
to add in a fixed order, which costs more than the 2 products on packed calls (short documents:
few key blocks per query tile, each waiting its turn).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .. import configs
from ..launch import CachedLauncher, LaunchPlan, PlanCache
from .attention_fwd import (
    LOG2E, _consumer_rows, _descriptor, _load_kv_tiles, _mask_scores, _mma_layout, _pass_tiles, _store_rows,
    _tanh, _work_item, mask_args, tensors_key, tma_compatible, varlen_schedule,
)

PRODUCER_REGS = 24
LOG2E_C = gl.constexpr(LOG2E)


@dataclass(frozen=True)
class Variant:
    """One compiled form of the dQ kernel: ``consumers`` warpgroups of ``block_m`` query rows
    each, ``block_n`` keys per K/V tile, a ``stages``-deep K/V ring; ``consumer_regs`` registers
    per consumer thread (the producer warp keeps ``PRODUCER_REGS``). ``packed``: whether it
    builds for packed calls (their element-wise store of a tile that crosses a sequence's end
    takes a layout conversion through shared memory, 32 KB at d256)."""

    name: str
    block_m: int
    block_n: int
    stages: int
    consumers: int = 2
    consumer_regs: int = 240
    head_dims: tuple = (64, 128)
    packed: bool = True

    @property
    def rows(self) -> int:
        return self.consumers * self.block_m


# H200, session 48 (benchmarks/diagnostics/packed_forms.py: 12 documents in 16K tokens, Hq=32,
# Hkv=8, bf16, 5 rounds paired; the dK/dV kernel kv2x64-m64-s2 beside each):
# - d128 causal: the Triton dQ kernel 1052 us per call, dq2x64-n64-s3 737 (656 TFLOP/s by its 3
#   products), -s2 949 (the K slot is held until the dQ product completes: two stages leave the
#   next load exposed), -s4 level with s3 (0.993x backward); backward 338 -> 387 TFLOP/s (1.146x),
#   forward + backward 1.115x.
# - d64 causal: Triton 570 us, dq2x64-n64-s3 515, dq2x64-n128-s2 593, dq3x64-n64-s3 454 (532
#   TFLOP/s; 160 registers per consumer, no spills), -s4 level (1.008x); backward 1.082x, forward
#   + backward 1.062x. Non-causal: backward 1.057x, forward + backward 1.044x (s4 1.064 / 1.048).
# - d256 (beside the split-D dK/dV form), hopper_attention_bwd.py, 3 rounds: dense dq2x64-n32-s3
#   367 / 387 TFLOP/s backward causal at 4K / 16K and 362 / 382 non-causal against the Triton dQ's
#   340 / 361 and 331 / 321 (1.07-1.19x); s2 326-345 (below Triton). Packed causal s2 1.018x (s3
#   has no packed build at d256): not dispatched.
VARIANTS = {
    v.name: v
    for v in (
        Variant("dq2x64-n64-s3", block_m=64, block_n=64, stages=3),
        Variant("dq3x64-n64-s3", block_m=64, block_n=64, stages=3, consumers=3, consumer_regs=160, head_dims=(64,)),
        Variant("dq2x64-n32-s2", block_m=64, block_n=32, stages=2, head_dims=(256,)),
        Variant("dq2x64-n32-s3", block_m=64, block_n=32, stages=3, head_dims=(256,), packed=False),
    )
}  # fmt: skip
# head dim -> the variant hf_flash runs where the backward variant leaves dQ to a kernel of its
# own (dense calls; packed calls: VARLEN_DEFAULT); head dims without an entry keep the Triton dQ
DEFAULT = {64: "dq3x64-n64-s3", 128: "dq2x64-n64-s3", 256: "dq2x64-n32-s3"}
VARLEN_DEFAULT = {64: "dq3x64-n64-s3", 128: "dq2x64-n64-s3"}
# head dims whose soft-capped calls take the tables' variant (the tanh and its derivative on each
# score; the others keep the Triton dQ)
SOFTCAP_HEAD_DIMS = (128, 256)


def variant_for(head_dim: int, softcap: float = 0.0, varlen: bool = False) -> str | None:
    """The dQ variant hf_flash runs for a call of ``head_dim`` whose dK/dV kernel leaves dQ to a
    kernel of its own (None: the Triton dQ kernel: head dims without an entry in ``DEFAULT``,
    packed calls ``VARLEN_DEFAULT``, and soft-capped calls outside ``SOFTCAP_HEAD_DIMS``)."""
    if softcap > 0.0 and head_dim not in SOFTCAP_HEAD_DIMS:
        return None
    return (VARLEN_DEFAULT if varlen else DEFAULT).get(head_dim)


@contextlib.contextmanager
def pinned(head_dim: int, dq: str):
    """Within the block, calls of ``head_dim`` (dense and packed) that leave dQ to a kernel of its
    own take ``dq``: a name in ``VARIANTS``, or ``"triton"`` for the Triton dQ kernel; the tables
    are restored on exit. For benchmarks and diagnostics that time one dQ form through the public
    functions."""
    if dq != "triton" and (dq not in VARIANTS or head_dim not in VARIANTS[dq].head_dims):
        known = ", ".join(n for n, v in VARIANTS.items() if head_dim in v.head_dims)
        raise ValueError(f"unknown dQ variant {dq!r} for head dim {head_dim}; known: triton, {known}")
    saved = [table.get(head_dim) for table in (DEFAULT, VARLEN_DEFAULT)]
    for table in (DEFAULT, VARLEN_DEFAULT):
        if dq == "triton":
            table.pop(head_dim, None)
        else:
            table[head_dim] = dq
    configs.dispatch_changed()
    try:
        yield
    finally:
        for table, name in zip((DEFAULT, VARLEN_DEFAULT), saved):
            if name is None:
                table.pop(head_dim, None)
            else:
                table[head_dim] = name
        configs.dispatch_changed()


def covers(q, dout, dq, *, softcap: float = 0.0, varlen: bool = False) -> bool:
    """True when :func:`hopper_attention_dq` takes the dQ of a backward call whose q/k/v the Gluon
    kernels cover (``attention_fwd.supports``: fp16/bf16 on sm_90, no ALiBi or dropout, TMA-
    addressable; checked by the caller, ``flash_bwd.gluon_dq_variant``): :func:`variant_for`
    names a variant, and ``dout`` and ``dq`` are shaped like q and addressable by TMA."""
    if variant_for(q.shape[-1], softcap, varlen) is None:
        return False
    return all(t.shape == q.shape and t.dtype == q.dtype and t.device == q.device and tma_compatible(t)
               for t in (dout, dq))  # fmt: skip


@gluon.jit
def _ds(s, dp, lse2, delta, rows, j, full_lo, full_hi, k_len, window_left, window_right, qk_scale, softcap_in,
        softcap_out, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr,
        MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr, SOFTCAP: gl.constexpr):  # fmt: skip
    """dS of key tile ``j`` from its scores and dP: P = exp2(S * qk_scale - lse2) with the keys a
    row does not see masked, times dP - delta. SOFTCAP: the scores are ``softcap_out * tanh(S *
    softcap_in)`` (the forward's, :func:`attention_fwd._softmax_step`), masked after the tanh, and
    dS takes the tanh's derivative ``1 - tanh^2`` (the softmax scale is dQ's, applied at the end)."""
    if SOFTCAP:
        t = _tanh(s * softcap_in)
        s2 = _mask_scores(t * softcap_out, rows, j, full_lo, full_hi, k_len, window_left, window_right, s_layout,
                          BLOCK_N, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW)  # fmt: skip
        p = gl.exp2(s2 - gl.expand_dims(lse2, 1))
        ds = p * (dp - gl.expand_dims(delta, 1)) * (1.0 - t * t)
    else:
        s = _mask_scores(s, rows, j, full_lo, full_hi, k_len, window_left, window_right, s_layout, BLOCK_N,
                         MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW)  # fmt: skip
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        ds = p * (dp - gl.expand_dims(delta, 1))
    return ds


@gluon.jit
def _dq_tiles(
    q_tile, do_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, dq, it, lse2, delta, rows, lo, own,
    full_lo, full_hi, k_len, window_left, window_right, qk_scale, softcap_in, softcap_out,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
    NUM_WARPS: gl.constexpr, dtype: gl.constexpr,
):  # fmt: skip
    """dQ of one consumer's rows over key tiles [lo, own) (at least one), ring tile ``it`` first:
    each tile's S and dP issued, then the previous tile's dQ product, which runs while this tile's
    dS is computed. Returns (dq, the ring counter past the last tile)."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, NUM_WARPS)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_mma_layout(HEAD_DIM, NUM_WARPS),
                                                  k_width=2)  # fmt: skip
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    slot = it % STAGES
    phase = (it // STAGES) & 1
    mbarrier.wait(k_ready.index(slot), phase)
    s_tok = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(slot), phase)
    dp_tok = warpgroup_mma(do_tile, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s, dp = warpgroup_mma_wait(0, deps=(s_tok, dp_tok))
    mbarrier.arrive(v_empty.index(slot))
    ds = _ds(s, dp, lse2, delta, rows, lo, full_lo, full_hi, k_len, window_left, window_right, qk_scale, softcap_in,
             softcap_out, s_layout, BLOCK_N, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP)  # fmt: skip
    ds_op = gl.convert_layout(ds.to(dtype), ds_layout)
    for j in range(lo + 1, own):
        prev = it % STAGES
        it += 1
        slot = it % STAGES
        phase = (it // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        s_tok = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(slot), phase)
        dp_tok = warpgroup_mma(do_tile, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dq_tok = warpgroup_mma(ds_op, k_smem.index(prev), dq, is_async=True)
        # S_j and dP_j are done once at most one group (tile j-1's dQ product) is still running
        s, dp = warpgroup_mma_wait(1, deps=(s_tok, dp_tok))
        mbarrier.arrive(v_empty.index(slot))
        ds = _ds(s, dp, lse2, delta, rows, j, full_lo, full_hi, k_len, window_left, window_right, qk_scale,
                 softcap_in, softcap_out, s_layout, BLOCK_N, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP)  # fmt: skip
        # ds_op is a register operand of the running wgmma: kept alive until the wait
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
        mbarrier.arrive(k_empty.index(prev))
        ds_op = gl.convert_layout(ds.to(dtype), ds_layout)
    last = it % STAGES
    dq_tok = warpgroup_mma(ds_op, k_smem.index(last), dq, is_async=True)
    dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
    mbarrier.arrive(k_empty.index(last))
    return dq, it + 1


@gluon.jit
def _dq_consumer(
    q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
    dq_desc, DQ, stride_dqm, stride_dqh, Lse, Delta, stride_lb, stride_lh, stride_lm,
    nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
    qk_scale, softmax_scale, softcap_in, softcap_out,
    INDEX: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr, NUM_WARPS: gl.constexpr, CONSUMERS: gl.constexpr, VARLEN: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = dq_desc.dtype
    row_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BLOCK_N, NUM_WARPS))
    b, h, row0, lo, n_tiles, q_off, q_len, k_len, own, full_lo, full_hi, rows = _consumer_rows(
        gl.program_id(0), nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
        window_right, INDEX, BLOCK_M, BLOCK_N, NUM_WARPS, CONSUMERS, MASK_LEFT, MASK_RIGHT, VARLEN, False,
    )  # fmt: skip
    # the rows' statistics; rows outside the sequence (before row 0 of a causal item's partial
    # block, past q_len) read lse = +inf, so their P and dS are 0
    offs = row0 + gl.arange(0, BLOCK_M, layout=row_s)
    stats_off = h.to(gl.int64) * stride_lh + (q_off + offs).to(gl.int64) * stride_lm
    if not VARLEN:
        stats_off += b.to(gl.int64) * stride_lb
    inside = (offs >= 0) & (offs < q_len)
    lse2 = gl.load(Lse + stats_off, mask=inside, other=float("inf")) * LOG2E_C
    delta = gl.load(Delta + stats_off, mask=inside, other=0.0)
    q_tile = q_smem.index(INDEX)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=_mma_layout(HEAD_DIM, NUM_WARPS))
    it = gl.to_tensor(0)  # K/V tiles consumed (ring slot and phase), as in the producer
    mbarrier.wait(q_bar.index(0), 0)
    if own > lo:
        dq, it = _dq_tiles(
            q_tile, do_smem.index(INDEX), k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, dq, it, lse2, delta,
            rows, lo, own, full_lo, full_hi, k_len, window_left, window_right, qk_scale, softcap_in, softcap_out,
            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, NUM_WARPS, dtype,
        )  # fmt: skip
    # every S = Q K^T has completed: the Q tile stages the output
    _store_rows((dq * softmax_scale).to(dtype), q_tile, dq_desc, DQ, stride_dqm, stride_dqh, b, h, row0, q_off,
               q_len, BLOCK_M, HEAD_DIM, NUM_WARPS, VARLEN)  # fmt: skip
    # the item's key tiles past every key these rows see (causal): taken part in, not computed
    # (no ping-pong turns here: the turn barrier argument is never read, q_bar stands in for it)
    _pass_tiles(own, n_tiles, it, 0, k_ready, v_ready, k_empty, v_empty, q_bar, INDEX, STAGES, CONSUMERS, False, 0)
    tma.store_wait(0)


@gluon.jit
def _dq_producer(
    q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
    nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
):  # fmt: skip
    b, h, kv_h, m0, lo, n_tiles, q_off, k_off, q_len, k_len = _work_item(
        gl.program_id(0), nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
        window_right, BLOCK_M * CONSUMERS, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN, False,
    )  # fmt: skip
    # as the forward: packed rows past the sequence's end read the next sequence's (never stored);
    # a causal item's blocks before row 0 read row 0's
    mbarrier.expect(q_bar.index(0), 2 * CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        row = q_off + gl.maximum(m0 + c * BLOCK_M, 0)
        tma.async_copy_global_to_shared(
            q_desc, [b, h, row, 0], q_bar.index(0), q_smem.index(c).reshape([1, 1, BLOCK_M, HEAD_DIM])
        )
        tma.async_copy_global_to_shared(
            do_desc, [b, h, row, 0], q_bar.index(0), do_smem.index(c).reshape([1, 1, BLOCK_M, HEAD_DIM])
        )
    _load_kv_tiles(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, kv_h, k_off, lo, n_tiles,
                  gl.to_tensor(0), BLOCK_N, HEAD_DIM, STAGES)  # fmt: skip


@gluon.jit
def _attn_dq_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, DQ, Lse, Delta, Sched, CuSeqQ, CuSeqK,
    stride_dqm, stride_dqh, stride_lb, stride_lh, stride_lm,
    nheads, group, n_bh, n_m, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softmax_scale,
    softcap_in, softcap_out,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, CONSUMER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr, VARLEN: gl.constexpr,
):  # fmt: skip
    # one work item per program: n_bh (batch, head) pairs x n_m query tiles of CONSUMERS * BLOCK_M
    # rows (packed: the schedule's entries x heads)
    if not RIGHT_WINDOW:
        window_right = 0
    if not MASK_LEFT:
        window_left = 0
    dtype: gl.constexpr = q_desc.dtype
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, HEAD_DIM], tile_layout)
    do_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, HEAD_DIM], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    # (the partitions' argument lists are spelled out: a Gluon kernel cannot hold a function in a
    # tuple or unpack one into a call)
    if CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, dq_desc, DQ,
                                stride_dqm, stride_dqh, Lse, Delta, stride_lb, stride_lh, stride_lm, nheads, group,
                                n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
                                qk_scale, softmax_scale, softcap_in, softcap_out, 0, BLOCK_M, BLOCK_N, HEAD_DIM,
                                STAGES, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, CONSUMER_WARPS, CONSUMERS,
                                VARLEN)),
                (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, dq_desc, DQ,
                                stride_dqm, stride_dqh, Lse, Delta, stride_lb, stride_lh, stride_lm, nheads, group,
                                n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
                                qk_scale, softmax_scale, softcap_in, softcap_out, 1, BLOCK_M, BLOCK_N, HEAD_DIM,
                                STAGES, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, CONSUMER_WARPS, CONSUMERS,
                                VARLEN)),
                (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready,
                                v_ready, k_empty, v_empty, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched,
                                CuSeqQ, CuSeqK, window_left, window_right, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                                CONSUMERS, MASK_LEFT, MASK_RIGHT, VARLEN)),
            ],
            [CONSUMER_WARPS, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.static_assert(CONSUMERS == 3, "2 or 3 consumer partitions")
        gl.warp_specialize(
            [
                (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, dq_desc, DQ,
                                stride_dqm, stride_dqh, Lse, Delta, stride_lb, stride_lh, stride_lm, nheads, group,
                                n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
                                qk_scale, softmax_scale, softcap_in, softcap_out, 0, BLOCK_M, BLOCK_N, HEAD_DIM,
                                STAGES, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, CONSUMER_WARPS, CONSUMERS,
                                VARLEN)),
                (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, dq_desc, DQ,
                                stride_dqm, stride_dqh, Lse, Delta, stride_lb, stride_lh, stride_lm, nheads, group,
                                n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
                                qk_scale, softmax_scale, softcap_in, softcap_out, 1, BLOCK_M, BLOCK_N, HEAD_DIM,
                                STAGES, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, CONSUMER_WARPS, CONSUMERS,
                                VARLEN)),
                (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, dq_desc, DQ,
                                stride_dqm, stride_dqh, Lse, Delta, stride_lb, stride_lh, stride_lm, nheads, group,
                                n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
                                qk_scale, softmax_scale, softcap_in, softcap_out, 2, BLOCK_M, BLOCK_N, HEAD_DIM,
                                STAGES, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, CONSUMER_WARPS, CONSUMERS,
                                VARLEN)),
                (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready,
                                v_ready, k_empty, v_empty, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched,
                                CuSeqQ, CuSeqK, window_left, window_right, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                                CONSUMERS, MASK_LEFT, MASK_RIGHT, VARLEN)),
            ],
            [CONSUMER_WARPS, CONSUMER_WARPS, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def launch_args(q, k, v, dout, lse, delta, dq, *, softmax_scale, causal, variant, cu_seqlens_q=None,
                cu_seqlens_k=None, sched=None, window=(-1, -1), softcap=0.0):  # fmt: skip
    """(grid, positional args, keyword args) of one launch; shared by the launcher and the CPU
    compile check, so both build the same kernel. Layouts as :func:`hopper_attention_dq`;
    packed calls pass their work items ``sched`` (:func:`attention_fwd.varlen_schedule` with the
    variant's rows)."""
    var = VARIANTS[variant]
    varlen = cu_seqlens_q is not None
    nheads, head_dim = q.shape[-2:]
    if head_dim not in var.head_dims:
        raise ValueError(f"dQ variant {variant} is built for head dims {var.head_dims}, not {head_dim}")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    if delta.stride() != lse.stride():
        raise ValueError(f"delta must be laid out like lse (strides {lse.stride()}), got {delta.stride()}")
    masks = mask_args(causal, window, softcap, softmax_scale)
    if varlen:
        if not var.packed:
            raise ValueError(f"dQ variant {variant} has no packed (varlen) build")
        if sched is None:
            raise ValueError("packed (varlen) launches need their work items (sched=varlen_schedule(...))")
        seqlen_q = seqlen_k = 0  # per sequence, from cu_seqlens
        n_bh, n_m = nheads, 0
        grid = (sched.shape[0] * nheads,)
        stride_dqm, stride_dqh = dq.stride(0), dq.stride(1)
        stride_lb, stride_lh, stride_lm = 0, lse.stride(0), lse.stride(1)
    else:
        batch, seqlen_q = q.shape[:2]
        seqlen_k = k.shape[1]
        sched = cu_seqlens_q = cu_seqlens_k = None
        n_bh, n_m = batch * nheads, configs.cdiv(seqlen_q, var.rows)
        grid = (n_bh * n_m,)
        stride_dqm, stride_dqh = dq.stride(1), dq.stride(2)
        stride_lb, stride_lh, stride_lm = lse.stride(0), lse.stride(1), lse.stride(2)
    args = (
        _descriptor(q, var.block_m), _descriptor(k, var.block_n), _descriptor(v, var.block_n),
        _descriptor(dout, var.block_m), _descriptor(dq, var.block_m), dq, lse, delta, sched, cu_seqlens_q,
        cu_seqlens_k, stride_dqm, stride_dqh, stride_lb, stride_lh, stride_lm,
        nheads, nheads // k.shape[-2], n_bh, n_m, seqlen_q, seqlen_k, masks["window_left"], masks["window_right"],
        float(softmax_scale) * LOG2E, float(softmax_scale), masks["softcap_in"], masks["softcap_out"],
    )  # fmt: skip
    kwargs = dict(
        BLOCK_M=var.block_m, BLOCK_N=var.block_n, HEAD_DIM=head_dim, STAGES=var.stages, CONSUMERS=var.consumers,
        CONSUMER_WARPS=4, CONSUMER_REGS=var.consumer_regs, PRODUCER_REGS=PRODUCER_REGS,
        MASK_LEFT=masks["MASK_LEFT"], MASK_RIGHT=masks["MASK_RIGHT"], RIGHT_WINDOW=masks["RIGHT_WINDOW"],
        SOFTCAP=masks["SOFTCAP"], VARLEN=varlen, num_warps=4,
    )  # fmt: skip
    return grid, args, kwargs


def hopper_attention_dq(q, k, v, dout, lse, delta, dq, *, softmax_scale, causal, variant=None, cu_seqlens_q=None,
                        cu_seqlens_k=None, window=(-1, -1), softcap=0.0) -> None:  # fmt: skip
    """dQ on Hopper, beside a dK/dV kernel that leaves it out (the Gluon ``kv2x64-m64-s2`` and
    split-D forms; soft-capped calls at d128, the Triton one). Layouts as
    ``hf_flash.kernels.flash_bwd.flash_attn_backward``: dense q/dout/dq (B, Sq, H, D), k/v (B, Sk,
    Hk, D), lse (the forward's natural-log log-sum-exp) and delta float32 (B, H, Sq) with the same
    strides; packed (cu_seqlens int32 (batch + 1,) given) q/dout/dq (Tq, H, D), k/v (Tk, Hk, D),
    lse/delta (H, Tq). For calls :func:`covers` accepts, checked by the caller. ``variant`` names
    an entry of ``VARIANTS`` (default: :func:`variant_for`). ``softcap`` as the forward's
    (:func:`attention_fwd.mask_args`). Packed rows outside every sequence are not written; no host
    sync reads cu_seqlens."""
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together")
    if q.numel() == 0:
        return
    if k.shape[-3] == 0:  # no keys (packed: in any sequence)
        dq.zero_()
        return
    head_dim = q.shape[-1]
    variant = variant or variant_for(head_dim, softcap, varlen)
    if variant is None:
        table = VARLEN_DEFAULT if varlen else DEFAULT
        heads = sorted(d for d in table if softcap <= 0.0 or d in SOFTCAP_HEAD_DIMS)
        raise ValueError(f"no Gluon dQ variant for head dim {head_dim}{' with a softcap' if softcap > 0.0 else ''} "
                         f"(covered: {heads})")  # fmt: skip
    var = VARIANTS[variant]
    sched = None
    if varlen:
        sched = varlen_schedule(cu_seqlens_q, cu_seqlens_k, q.shape[0], rows=var.rows, block_n=var.block_n,
                                causal=causal)  # fmt: skip
    key = (variant, tensors_key(q, k, v, dout, dq), lse.shape, lse.stride(), delta.stride(), bool(causal),
           tuple(window), float(softcap), float(softmax_scale), None if sched is None else sched.shape[0])  # fmt: skip
    tensors = (q, k, v, dout, lse, delta, dq, sched, cu_seqlens_q, cu_seqlens_k)
    with configs.device_guard(q.device):
        plan = _PLANS.get(key, lambda: _plan(tensors, variant, causal, window, softcap, softmax_scale))
        _DQ.run_plan(plan, tensors)


def _plan(tensors, variant, causal, window, softcap, softmax_scale) -> LaunchPlan:
    q, k, v, dout, lse, delta, dq, sched, cu_seqlens_q, cu_seqlens_k = tensors
    grid, args, kwargs = launch_args(
        q, k, v, dout, lse, delta, dq, softmax_scale=softmax_scale, causal=causal, variant=variant,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sched=sched, window=window, softcap=softcap,
    )  # fmt: skip
    switches = ("MASK_LEFT", "MASK_RIGHT", "RIGHT_WINDOW", "SOFTCAP")
    key = (variant, q.shape[-1], sched is not None, *(kwargs[f] for f in switches))
    meta = _LAUNCH_META.get(key)
    if meta is None:
        meta = _LAUNCH_META[key] = _DQ.meta(**kwargs)
    # launch_args' order: 5 descriptors and 6 pointers, 13 integers, 4 floats
    return LaunchPlan.capture(grid, args[:11], args[11:24], args[24:], meta, tensors)


_DQ = CachedLauncher(_attn_dq_kernel)
_LAUNCH_META: dict = {}
_PLANS = PlanCache()

__all__ = [
    "hopper_attention_dq", "covers", "variant_for", "pinned", "launch_args", "VARIANTS", "DEFAULT", "VARLEN_DEFAULT",
    "SOFTCAP_HEAD_DIMS",
]
