"""FlashAttention forward for Hopper (sm_90a) in Gluon, after FlashAttention-3's recipe.

A work item is ``CONSUMERS * BLOCK_M`` query rows of one (batch, head); a program runs its items
with warp-specialised partitions:

* a producer partition (one warp) issues TMA copies: the item's Q tile(s), then the
  visible K and V tiles into a ``STAGES``-deep shared-memory ring; each copy completes on an
  mbarrier (``k_ready`` / ``v_ready``), and each slot is handed back by the consumers through
  another (``k_empty`` / ``v_empty``), so loads run ahead of the math by up to ``STAGES`` tiles;
* consumer warpgroups own ``BLOCK_M`` query rows each (64 rows per warpgroup of 4 warps: the
  wgmma M) and run S = Q K^T and O += P V as asynchronous wgmma (Q, K and V from shared memory,
  P from registers), with the online softmax in between, in base 2 (``exp2``; the scale is folded
  with log2(e) into one multiplier). Registers move from the producer (24) to the consumers
  (232 each with two consumers, 160-168 with three) through ``setmaxnreg``.

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

Masking: query row i sits at key position ``i + seqlen_k - seqlen_q`` (bottom-right aligned) and
sees keys ``pos - window_left <= j <= pos + window_right`` (each side only when bounded; causal is
``window_right`` 0; :func:`mask_args`). Key tiles that are entirely visible run without a mask;
only tiles that cross a window edge (the causal diagonal) or the end of the keys are masked, and
tiles outside every row's window are never loaded. ``SOFTCAP`` turns the scores into ``cap *
tanh(s * scale / cap)`` before the softmax.

Work items are (batch, head, query tile) triples. Under causal masking (keys bounded on the
right) they are numbered with (batch, head) fastest and the query tile counted from the end, so
the items that see the most keys come first and the tail of the launch holds the short ones; the
items end at the last 64-row block, so when an item's rows do not divide the query count the
partial item is the first rows' (few keys), not the last rows' (every key);
otherwise the query tile runs fastest, so the items in flight share their K/V heads in L2. A
program takes item program_id: one item per program (grid = items), or, for the ``persistent``
variants, one program per SM whose producer loads the next item's Q and K/V while the consumers
finish the previous item (the ring's slots and phases run on across items; the output is staged
in its own shared-memory tile, so its store overlaps the next item's loop). Persistent programs
take their next items either statically (program_id + num_programs, ...) or, ``dynamic``, from
an atomic counter (one per stream, which every launch leaves at 0: :func:`item_counter`): the
producer fetches each and hands it to the consumers through a two-slot shared-memory ring
(``item_ready`` / ``item_empty``), so programs that drew short items take more of them. Dense
calls without a window or softcap take a variant by their query count (``SEQLEN_VARIANTS``): the
dynamic form at 256-8K (d128) and 256-2K causal / 256-1K not (d64), and causal items numbered
head by head (``head_major``, so the items in flight share one or two heads' K/V in L2) past 8K
(d128) and from 32K (d64). The dynamic form's ``carry``
variant (non-causal d128 up to 4K, d64 throughout its ranges) finishes each item one item late:
a consumer issues its next item's first S = Q K^T, then normalises and stores the previous
item's output under that product, so the tensor cores do not idle through every item's epilogue
(Q has two slots per consumer so that the next item's Q is loaded in time).

Head dim 256 uses 64-key K/V tiles and stages the output in the Q tile's shared memory (free
once the item's last S = Q K^T has completed; one-item programs only), since a separate output
tile would not fit beside Q and the K/V ring.

Addressing goes through TMA descriptors over (batch, head, seq, dim) views with the tensors' own
strides (int64 in the descriptor; tile coordinates are int32 per axis), so non-contiguous views
and 1M-token sequences need no copies and cannot overflow. Rows past the end of a sequence are
zero-filled on load and clipped on store by the TMA unit; no coordinate is negative (a causal
item's blocks before row 0 load row 0's block and store nothing). The log-sum-exp is written
with int64 pointer arithmetic.

Rows that see no key (causal with seqlen_q > seqlen_k) get output 0 and log-sum-exp +inf.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl
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

from .. import configs
from ..launch import CachedLauncher, LaunchPlan, PlanCache, tma_descriptor

LOG2E = 1.4426950408889634
LN2 = gl.constexpr(0.6931471805599453)


@dataclass(frozen=True)
class Variant:
    """One compiled form of the kernel; ``rows`` query rows per work item. The producer warp is
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
    persistent: bool = False  # one program per SM looping over work items, not one per item
    # the output staged in the Q tile's shared memory (free once the item's last S = Q K^T has
    # completed) instead of a tile of its own: head dim 256, where Q, a separate output tile and
    # a two-stage K/V ring of 64 keys would need 256 KB
    o_in_q: bool = False
    # persistent programs take their items from an atomic counter in global memory (after the
    # first, program_id): the producer fetches the next item and hands it to the consumers
    # through a two-slot shared-memory ring, so a program that drew short items takes more of
    # them (the static round-robin of ``persistent`` leaves programs of one launch with unequal
    # work under causal masking)
    dynamic: bool = False
    # causal items numbered head by head (the query tiles longest first inside each head) instead
    # of (batch, head) fastest: the items in flight then read one or two heads' K/V prefixes, not
    # every head's (up to 64-128 MB at 16K-32K tokens, over the 50 MB L2), at a cost in balance
    # (a CPU model of one-item programs: 3% at 4K/8K, under 1% at 16K/32K; .notes/hopper.md
    # session 32). Non-causal items are numbered so in every variant
    head_major: bool = False
    # dynamic persistent, overlap: each consumer issues its next item's first S = Q K^T before it
    # finishes the previous item (output normalised, stored; lse written), so that epilogue runs
    # under a wgmma instead of leaving the tensor cores idle at every item boundary; Q has two
    # shared-memory slots per consumer (item n in slot n % 2), so the next item's Q is loaded
    # while the current item's loop runs
    carry: bool = False

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
        # a persistent 3-consumer form spills 64 bytes at 160 registers per consumer (causal)
        Variant("ws2x4-overlap-fma-persist", block_m=64, block_n=128, stages=2, consumers=2, consumer_warps=4,
                overlap=True, fma_scale=True, consumer_regs=232, persistent=True),
        Variant("ws2x4-overlap-fma-dyn", block_m=64, block_n=128, stages=2, consumers=2, consumer_warps=4,
                overlap=True, fma_scale=True, consumer_regs=232, persistent=True, dynamic=True),
        Variant("ws2x4-overlap-fma-dyn-carry", block_m=64, block_n=128, stages=2, consumers=2, consumer_warps=4,
                overlap=True, fma_scale=True, consumer_regs=232, persistent=True, dynamic=True, carry=True),
        # the ping-pong form persistent with the item counter: cuDNN's shape at d64 causal 4K (two
        # consumers of 64 rows, persistent; the forward's weakest bar point). H200, session 35
        # (3 runs, 3-5 rounds): d64 causal 4K 1.018-1.033x ws3x4-pp-s3 (0.97-0.99x SDPA), 3K
        # 1.015, 6K-32K 0.88-0.97; d128 0.93-1.01x -dyn; a three-stage ring lost 0-2%. No default
        Variant("ws2x4-pp-dyn", block_m=64, block_n=128, stages=2, consumers=2, consumer_warps=4, overlap=True,
                pingpong=True, fma_scale=True, consumer_regs=232, persistent=True, dynamic=True),
        # causal items head by head, longest first inside each head (head_major; SEQLEN_VARIANTS
        # runs the one-item and three-consumer forms). The dynamic form gained less (H200, session
        # 33: 1.022 / 0.997 / 1.018 / 1.005x ws2x4-overlap-fma-dyn at 4K-32K) and is no default
        Variant("ws2x4-overlap-fma-hm", block_m=64, block_n=128, stages=2, consumers=2, consumer_warps=4,
                overlap=True, fma_scale=True, consumer_regs=232, head_major=True),
        Variant("ws2x4-overlap-fma-dyn-hm", block_m=64, block_n=128, stages=2, consumers=2, consumer_warps=4,
                overlap=True, fma_scale=True, consumer_regs=232, persistent=True, dynamic=True,
                head_major=True),
        Variant("ws3x4-pp-s3-hm", block_m=64, block_n=128, stages=3, consumers=3, consumer_warps=4, overlap=True,
                pingpong=True, fma_scale=True, consumer_regs=160, head_dims=(64,), head_major=True),
        # head dim 256: the output accumulator alone is 128 registers per thread, so 64-key tiles
        # (S: 32 registers) and the output in Q's tile (smem: Q 64 KB + K/V ring 128 KB)
        Variant("ws2x4-overlap-fma-d256", block_m=64, block_n=64, stages=2, consumers=2, consumer_warps=4,
                overlap=True, fma_scale=True, consumer_regs=232, head_dims=(256,), o_in_q=True),
    )
}  # fmt: skip
DEFAULT = {
    (128, False): "ws2x4-overlap-fma",
    (128, True): "ws2x4-overlap-fma",
    (64, False): "ws3x4-pp-s3",
    (64, True): "ws3x4-pp-s3",
    (256, False): "ws2x4-overlap-fma-d256",
    (256, True): "ws2x4-overlap-fma-d256",
}
# Packed (varlen) calls: the non-persistent variants; three consumers (160 registers each) spill
# 120-176 bytes in the packed non-causal loop (the sequence's offsets and lengths stay live), so
# they take packed causal calls only.
VARLEN_DEFAULT = {
    (128, False): "ws2x4-overlap-fma",
    (128, True): "ws2x4-overlap-fma",
    (64, False): "ws2x4-overlap-fma",
    (64, True): "ws3x4-pp-s3",
    (256, False): "ws2x4-overlap-fma-d256",
    (256, True): "ws2x4-overlap-fma-d256",
}
HEAD_DIMS = (64, 128, 256)
# Dense calls of (head dim, causal) without a window or softcap (the calls these were measured
# on) whose query count lies in a range of SEQLEN_VARIANTS[key] = ((lo, hi, variant), ...)
# (inclusive) run that variant instead of DEFAULT (:func:`seqlen_variant`); other lengths were
# not measured and keep DEFAULT. Measurements: bf16, Hq=32, Hkv=8, batch 16K / S, 3 rounds
# (.notes/hopper.md).
# - Short calls, ws2x4-overlap-fma-dyn: persistent programs fed by an atomic item counter overlap
#   one item's epilogue with the next one's loads, which pays where items are short (H100):
#   - d128, 4K / 8K (session 22 call 6): 542 / 589 TFLOP/s causal against 521 / 583, non-causal
#     574 / 611 against 568 / 586 (1.01-1.04x); 512 / 1K / 2K (session 24 call 8): causal 318 /
#     412 / 481 against 261 / 374 / 460 (1.05-1.22x), non-causal 460 / 502 / 551 against 412 /
#     485 / 527 (1.04-1.12x). At 16K / 32K 1.05 / 0.98x causal and 1.00 / 0.97x non-causal (an
#     H200).
#   - d64 causal, against the three-consumer default (session 24 calls 7-8): 207 / 293 / 359 at
#     512 / 1K / 2K against 147 / 218 / 331 (1.08-1.41x); 4K 0.99x, 8K 0.93x.
#   - d64 non-causal (session 25 call 1): 333 / 396 at 512 / 1K against 287 / 361 (1.16 /
#     1.10x); 2K 0.96x (session 24 call 7).
#   - 256 queries (session 25 call 1): d128 205 / 371 (causal / not) against 157 / 300, d64 121 /
#     254 against 66 / 150 (1.24-1.84x).
# - Short calls, ws2x4-overlap-fma-dyn-carry: the dynamic form with each item's epilogue under the
#   next item's first S = Q K^T (H200, session 45, 5 rounds, against -dyn; 256 queries not
#   measured, where items are shortest and the gain should be largest):
#   - d128 non-causal, two runs: 512 1.055 / 1.055x, 1K 1.030 / 1.022, 2K 1.041 / 1.023, 4K 1.009
#     / 1.014; 8K level (0.983 / 1.001, paired rounds 0.998 / 1.000), so 8K keeps -dyn.
#   - d64 non-causal 512 / 1K 1.092 / 1.027x; d64 causal 512 / 1K / 2K 1.015 / 1.016 / 1.004x.
#   - d128 causal: 0.985-0.993x at 1K-16K (1.022 at 512), so causal d128 keeps -dyn: its two
#     consumers reach an item's end apart (the diagonal tile), so the epilogue was partly hidden.
# - Long causal calls, the head-major forms (head_major), which keep the K/V of one or two heads
#   in L2 where that of every head exceeds it (H200, session 33):
#   - d128 past 8K: 1.043 / 1.057 / 1.048 / 1.052x ws2x4-overlap-fma at 4K-32K (64-128 MB of K/V
#     at 16K tokens per batch).
#   - d64 from 32K: 1.047x and 1.068x ws3x4-pp-s3 at 32K in two runs, 1.037x at 64K; level at
#     4K-8K and 0.95-1.00x at 16K, where the K/V of all heads (32 MB) fits the 50 MB L2.
MAX_SEQLEN = 2**31 - 1
SEQLEN_VARIANTS = {
    (128, False): ((256, 4096, "ws2x4-overlap-fma-dyn-carry"), (4097, 8192, "ws2x4-overlap-fma-dyn")),
    (128, True): ((256, 8192, "ws2x4-overlap-fma-dyn"), (8193, MAX_SEQLEN, "ws2x4-overlap-fma-hm")),
    (64, False): ((256, 1024, "ws2x4-overlap-fma-dyn-carry"),),
    (64, True): ((256, 2048, "ws2x4-overlap-fma-dyn-carry"), (32768, MAX_SEQLEN, "ws3x4-pp-s3-hm")),
}
# Calls with a left window bound run this variant where their default has three consumers: at
# 160 registers each, the left-edge mask spills 128-296 bytes per thread (CPU compile, sm_90a);
# two consumers spill nothing with any mask or the softcap.
LEFT_WINDOW_FALLBACK = "ws2x4-overlap-fma"
# Packed calls hf_flash dispatches here (flash_fwd.forward_path): head dims 64, 128 and 256. d64,
# 12 documents in 16K tokens, Hq=32, Hkv=8, bf16 (H200, session 47, 5 rounds, two runs causal;
# benchmarks/diagnostics/packed_forms.py): causal ws3x4-pp-s3 351-354 TFLOP/s against the Triton
# varlen forward's 327-328 (1.074-1.077x), non-causal ws2x4-overlap-fma 392 against 375 (1.045x);
# forward+backward 1.015x / 1.009x, the forward's share of the pair (on the H100 of session 19 the
# d64 packed kernel of that time had measured 0.53 ms against Triton's 0.48). d256, the same
# documents, causal: 579 TFLOP/s against the Triton varlen forward's 247 (session 22).
VARLEN_DISPATCH_HEAD_DIMS = (64, 128, 256)
# Soft-capped calls hf_flash dispatches here: head dim 128. At d64 the kernel's tanh (an exp2
# and a reciprocal per score on top of the softmax's exp2) made it slower than the Triton forward
# (H100, causal, cap 50, S = 8K-32K: 185-205 TFLOP/s against 220-237; d128 388-406 against
# 323-356; .notes/hopper.md, session 21), so d64 soft-capped calls stay on Triton. d256, causal,
# cap 50, S = 4K-16K: 496-532 against 251-266 (session 22).
SOFTCAP_DISPATCH_HEAD_DIMS = (128, 256)
PRODUCER_REGS = 24


def default_variant(head_dim: int, causal: bool, varlen: bool = False, window=(-1, -1), seqlen_q: int = 0,
                    softcap: float = 0.0) -> str:  # fmt: skip
    """The variant :func:`hopper_attention_forward` runs for a call when none is named."""
    name = (VARLEN_DEFAULT if varlen else DEFAULT)[(head_dim, bool(causal))]
    masks = mask_args(causal, window, softcap)
    if VARIANTS[name].consumers > 2 and masks["MASK_LEFT"]:
        return LEFT_WINDOW_FALLBACK
    if varlen:
        return name
    if masks["MASK_LEFT"] or masks["RIGHT_WINDOW"] or masks["SOFTCAP"]:
        return name
    return seqlen_variant(SEQLEN_VARIANTS, head_dim, causal, seqlen_q) or name


def seqlen_variant(table: dict, head_dim: int, causal: bool, seqlen_q: int):
    """The variant of the range in ``table[(head_dim, causal)]`` (``((lo, hi, variant), ...)``,
    inclusive) that holds ``seqlen_q``, or None. Shared with the backward's table."""
    for lo, hi, variant in table.get((head_dim, bool(causal)), ()):
        if lo <= seqlen_q <= hi:
            return variant
    return None


def varlen_builds(variant: str, causal: bool) -> bool:
    """True when ``variant`` has a packed (varlen) form for this causality (see VARLEN_DEFAULT)."""
    var = VARIANTS[variant]
    return not var.persistent and (var.consumers == 2 or causal)


@gluon.constexpr_function
def _mma_layout(n, num_warps):
    # wgmma: m16 x n x k16 instructions, warps stacked along M (each warpgroup owns 64 rows)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def schedule_entry(Sched, index, CuSeqQ, CuSeqK):
    """Entry ``index`` of a :func:`varlen_schedule`: (doc, tile, q_off, k_off, q_len, k_len), the
    sequence's rows starting at q_off (k_off) of the packed tensors; an empty entry (sequence -1)
    reads as sequence 0 with no queries and no keys."""
    entry = Sched + 2 * index
    doc = gl.load(entry)
    tile = gl.load(entry + 1)
    valid = doc >= 0
    doc = gl.maximum(doc, 0)
    q_off = gl.load(CuSeqQ + doc)
    k_off = gl.load(CuSeqK + doc)
    q_len = gl.where(valid, gl.load(CuSeqQ + doc + 1) - q_off, 0)
    k_len = gl.where(valid, gl.load(CuSeqK + doc + 1) - k_off, 0)
    return doc, tile, q_off, k_off, q_len, k_len


@gluon.jit
def _work_item(t, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
               ROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr,
               MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr, HEAD_MAJOR: gl.constexpr):  # fmt: skip
    """Decode work item ``t``. Returns (b, h, kv_h, m0, lo, n_tiles, q_off, k_off, q_len,
    k_len): the item's query rows are [m0, m0 + ROWS) of a sequence of q_len queries and k_len
    keys that starts at row q_off (k_off) of the batch entry b; key tiles [lo, n_tiles) are
    visible to some row of the item (each consumer's share and the tiles its rows see whole:
    :func:`_own_tiles`).

    Query row i sits at key position ``i + k_len - q_len`` (bottom-right alignment) and sees key
    j iff ``pos - window_left <= j`` (MASK_LEFT) and ``j <= pos + window_right`` (MASK_RIGHT;
    causal is window_right 0).

    Dense, keys bounded on the right (causal): (batch, head) runs fastest and query tiles are
    counted from the end, so the items that see the most keys come first; they end at the last
    BLOCK_M-row block, so m0 is negative (a multiple of BLOCK_M) for the first item when ROWS
    does not divide the block count: a consumer's rows are then all before row 0 or none are.
    Dense otherwise (every item sees as many keys, bar a left window's first tiles): the query
    tile runs fastest, so the items running at one time share one or two K/V heads, which stay
    in L2 (with (batch, head) fastest, 132 items in flight read every head's K/V: 64-128 MB at
    16K-32K tokens, over the 50 MB L2). Varlen: the head runs fastest over the entries of
    ``Sched`` (int32 pairs (sequence, query tile), built by :func:`varlen_schedule`; sequence
    -1: an empty item, no rows and no keys)."""
    if VARLEN:
        h = t % nheads
        _, tile, q_off, k_off, q_len, k_len = schedule_entry(Sched, t // nheads, CuSeqQ, CuSeqK)
        m0 = tile * ROWS
        b = 0  # packed tensors: one batch entry in the descriptors
    else:
        if MASK_RIGHT:
            # items aligned to the last BLOCK_M-row block: when ROWS (CONSUMERS blocks) does not
            # divide the query count, the first item, whose rows see the fewest keys, is the
            # partial one (its blocks before row 0 are computed from row 0's Q and never
            # stored), not the last, whose rows see every key
            if HEAD_MAJOR:
                bh = t // n_m
                from_end = t % n_m
            else:
                bh = t % n_bh
                from_end = t // n_bh
            m0 = (gl.cdiv(seqlen_q, BLOCK_M) - (from_end + 1) * (ROWS // BLOCK_M)) * BLOCK_M
        else:
            bh = t // n_m
            m0 = (t % n_m) * ROWS
        b = bh // nheads
        h = bh % nheads
        q_off = 0
        k_off = 0
        q_len = seqlen_q
        k_len = seqlen_k
    first = m0 + (k_len - q_len)  # key position of the item's first row
    last = first + ROWS - 1
    hi = k_len
    if MASK_RIGHT:
        hi = gl.minimum(k_len, gl.maximum(last + window_right + 1, 0))
    n_tiles = gl.cdiv(hi, BLOCK_N)
    lo = 0
    if MASK_LEFT:
        lo = gl.minimum(gl.maximum(first - window_left, 0) // BLOCK_N, n_tiles)
    return b, h, h // group, m0, lo, n_tiles, q_off, k_off, q_len, k_len


@gluon.jit
def _producer_item(
    t, it, n_done, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem,
    q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
    nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
    HEAD_MAJOR: gl.constexpr, Q_SLOTS: gl.constexpr,
):  # fmt: skip
    """Loads of one work item; ``it`` counts the K/V tiles loaded so far (ring slot and phase),
    ``n_done`` the items started (its Q goes to slot n_done % Q_SLOTS). Returns the new ``it``."""
    b, h, kv_h, m0, lo, n_tiles, q_off, k_off, q_len, k_len = _work_item(
        t, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
        BLOCK_M * CONSUMERS, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN, HEAD_MAJOR,
    )  # fmt: skip
    # varlen: rows past the sequence's end read the next sequence's (or zeros past the tensor's
    # end); the consumers mask those keys and never store those rows. A causal item's blocks
    # before row 0 (m0 < 0) load row 0's block: no TMA coordinate is negative
    # a slot's Q tiles are free once every consumer's last S = Q K^T of the item that used the
    # slot before has completed (the previous item's with one slot, the one before it with two);
    # a fresh barrier counts as having completed the phase before 0, so the first wait on each
    # slot (and the first pass through the K/V ring) does not block
    qs = n_done % Q_SLOTS
    mbarrier.wait(q_empty.index(qs), ((n_done // Q_SLOTS) & 1) ^ 1)
    mbarrier.expect(q_bar.index(qs), CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(
            q_desc, [b, h, q_off + gl.maximum(m0 + c * BLOCK_M, 0), 0], q_bar.index(qs),
            q_smem.index(qs * CONSUMERS + c).reshape([1, 1, BLOCK_M, HEAD_DIM]),
        )
    return _load_kv_tiles(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, kv_h, k_off, lo,
                         n_tiles, it, BLOCK_N, HEAD_DIM, STAGES)  # fmt: skip


@gluon.jit
def _load_kv_tiles(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, kv_h, k_off, lo, n_tiles, it,
                  BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Producer: K/V tiles [lo, n_tiles) of K/V head ``kv_h`` (keys from row ``k_off``) into the
    ``STAGES``-deep ring, each slot once the consumers have released it (``k_empty`` /
    ``v_empty``) and announced on ``k_ready`` / ``v_ready``; ``it`` counts the tiles loaded so far
    (ring slot and phase). Returns the new ``it``."""
    for j in range(lo, n_tiles):
        slot = it % STAGES
        phase = ((it // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [b, kv_h, k_off + j * BLOCK_N, 0], k_ready.index(slot),
            k_smem.index(slot).reshape([1, 1, BLOCK_N, HEAD_DIM]),
        )  # fmt: skip
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            v_desc, [b, kv_h, k_off + j * BLOCK_N, 0], v_ready.index(slot),
            v_smem.index(slot).reshape([1, 1, BLOCK_N, HEAD_DIM]),
        )  # fmt: skip
        it += 1
    return it


@gluon.jit
def _next_item(Counter, n_programs, n_items):
    """A dynamic persistent program's next work item (producer warp): lane 0 adds 1 to the
    launch's counter and the value it read, plus the grid size (the first items are the
    program ids), goes to every lane.

    A launch fetches exactly ``n_items`` times (one fetch per item past the first n_programs,
    then one per program that comes back past the end), so the fetch that reads n_items - 1 is
    its last: that lane puts the counter back to 0, and the next launch on the stream, which
    starts after this one ends, finds it zeroed (:func:`item_counter`)."""
    lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=lane_layout)
    first = lane == 0
    ptrs = Counter + lane * 0
    got = gl.atomic_add(ptrs, gl.full([32], 1, gl.int32, lane_layout), mask=first, sem="relaxed")
    gl.atomic_xchg(ptrs, gl.zeros([32], gl.int32, lane_layout), mask=first & (got == n_items - 1), sem="relaxed")
    return gl.max(gl.where(first, got, 0), axis=0) + n_programs


@gluon.jit
def _publish_item(t, n, item_smem, item_ready, item_empty):
    """Hand item ``t`` (the ``n``-th of this program) to the consumers through slot n % 2."""
    lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    slot = n % 2
    mbarrier.wait(item_empty.index(slot), ((n // 2) & 1) ^ 1)
    item_smem.index(slot).store(gl.zeros([32], gl.int32, lane_layout) + t)
    mbarrier.arrive(item_ready.index(slot))


@gluon.jit
def _item_in_slot(n, item_smem, NUM_WARPS: gl.constexpr):
    """The item the producer put in the ``n``-th item's slot of the ring."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    return gl.max(item_smem.index(n % 2).load(layout), axis=0)


@gluon.jit
def _read_item(n, item_smem, item_ready, item_empty, NUM_WARPS: gl.constexpr, RELEASE: gl.constexpr = True):
    """The ``n``-th item of this program, as the producer handed it over (consumers); its slot
    is handed back unless not RELEASE (then :func:`_item_in_slot` reads it again until the
    consumer arrives on its ``item_empty`` itself)."""
    slot = n % 2
    mbarrier.wait(item_ready.index(slot), (n // 2) & 1)
    t = _item_in_slot(n, item_smem, NUM_WARPS)
    if RELEASE:
        mbarrier.arrive(item_empty.index(slot))
    return t


@gluon.jit
def _producer(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem,
    q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
    nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
    Counter, item_smem, item_ready, item_empty,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, PERSISTENT: gl.constexpr,
    VARLEN: gl.constexpr, DYNAMIC: gl.constexpr, HEAD_MAJOR: gl.constexpr, Q_SLOTS: gl.constexpr,
):  # fmt: skip
    if PERSISTENT:
        # items program_id, then (DYNAMIC) whatever the counter hands out or (static) every
        # num_programs-th, until one past the last; DYNAMIC hands each to the consumers, that
        # last one too, so they stop
        it = 0
        n_done = 0
        t = gl.program_id(0)
        while t < n_bh * n_m:
            if DYNAMIC:
                _publish_item(t, n_done, item_smem, item_ready, item_empty)
            it = _producer_item(
                t, it, n_done, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem,
                q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, nheads, group, n_bh, n_m, seqlen_q, seqlen_k,
                Sched, CuSeqQ, CuSeqK, window_left, window_right, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS,
                MASK_LEFT, MASK_RIGHT, VARLEN, HEAD_MAJOR, Q_SLOTS,
            )  # fmt: skip
            n_done += 1
            if DYNAMIC:
                t = _next_item(Counter, gl.num_programs(0), n_bh * n_m)
            else:
                t += gl.num_programs(0)
        if DYNAMIC:
            _publish_item(t, n_done, item_smem, item_ready, item_empty)
    else:
        zero = gl.to_tensor(0)
        _producer_item(
            gl.program_id(0), zero, zero, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem,
            q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, nheads, group, n_bh, n_m, seqlen_q, seqlen_k,
            Sched, CuSeqQ, CuSeqK, window_left, window_right, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS,
            MASK_LEFT, MASK_RIGHT, VARLEN, HEAD_MAJOR, Q_SLOTS,
        )  # fmt: skip


@gluon.jit
def _tanh(x):
    # 1 - 2 / (exp2(2x log2(e)) + 1), as flash_common.tanh (the Triton kernels'), so both
    # paths soft-cap alike: exact limits (+-1) where exp2 overflows or underflows, no NaN
    return 1.0 - 2.0 / (gl.exp2(x * 2.8853900817779268) + 1.0)


@gluon.jit
def _per_tile(x):
    """``x`` unchanged, through a register move the compiler cannot see through or move out of
    a loop (an int32 tensor of any layout)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _mask_scores(s, rows, j, full_lo, full_hi, seqlen_k, window_left, window_right, s_layout: gl.constexpr,
                 BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                 RIGHT_WINDOW: gl.constexpr):  # fmt: skip
    """Key tile ``j``'s scores ``s`` with the keys a row does not see set to -inf (tiles inside
    [full_lo, full_hi) are returned as they are): row r at key position ``rows[r]`` sees keys
    ``rows[r] - window_left <= key <= rows[r] + window_right`` (each bound with its MASK_ switch)
    below ``seqlen_k``."""
    masked = j >= full_hi
    if MASK_LEFT:
        masked = masked | (j < full_lo)
    if masked:
        if MASK_LEFT or RIGHT_WINDOW:
            # window edges: columns relative to the tile against per-row bounds relative to the
            # tile, the bounds made opaque (:func:`_per_tile`); otherwise the compiler may rewrite
            # a comparison as (bound - column) against the tile offset and hoist that whole tile of
            # differences out of the loop (64 registers per thread, spilled)
            key0 = j * BLOCK_N
            cols = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
            vis = cols < seqlen_k - key0
            if MASK_RIGHT:
                vis = vis & (cols <= gl.expand_dims(_per_tile(rows + (window_right - key0)), 1))
            if MASK_LEFT:
                vis = vis & (cols >= gl.expand_dims(_per_tile(rows - (window_left + key0)), 1))
        else:
            # no window: the key range's end and the causal diagonal
            cols = gl.expand_dims(j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
            vis = cols < seqlen_k
            if MASK_RIGHT:
                vis = vis & (cols <= gl.expand_dims(rows, 1))
        s = gl.where(vis, s, float("-inf"))
    return s


@gluon.jit
def _softmax_step(s, m_i, l_i, rows, j, full_lo, full_hi, seqlen_k, window_left, window_right, qk_scale,
                  softcap_in, softcap_out, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                  MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr,
                  FMA_SCALE: gl.constexpr, SOFTCAP: gl.constexpr):  # fmt: skip
    """Transform and mask tile ``j``'s scores and update the running max and sum; returns
    (p, alpha, m, l).

    ``qk_scale`` is softmax_scale * log2(e). With FMA_SCALE the running max stays in the raw
    score domain and ``s * scale - m * scale`` is one fused multiply-add per score (the scale is
    positive, so the max commutes with it); otherwise the scores are scaled first. SOFTCAP
    replaces the scale by ``softcap_out * tanh(s * softcap_in)`` (softcap_in = softmax_scale /
    cap, softcap_out = cap * log2(e)), FMA_SCALE or not. ``m`` is in the domain of the scores it
    came from; the epilogue converts it. Tiles outside [full_lo, full_hi) are masked as
    :func:`_mask_scores` says."""
    if SOFTCAP:
        s = _tanh(s * softcap_in) * softcap_out
    elif not FMA_SCALE:
        s = s * qk_scale
    s = _mask_scores(s, rows, j, full_lo, full_hi, seqlen_k, window_left, window_right, s_layout, BLOCK_N,
                     MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW)  # fmt: skip
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # rows that have seen no key yet keep m = -inf; subtract 0 instead to avoid inf - inf
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    if FMA_SCALE and not SOFTCAP:
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
def _own_tiles(row0, lo, n_tiles, q_len, k_len, window_left, window_right,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """One consumer's part of its item's key tiles [lo, n_tiles) (:func:`_work_item` counts the
    item's), from its own rows [row0, row0 + BLOCK_M): (own, full_lo, full_hi), tiles [lo, own)
    holding every key one of its rows sees (at least one: rows that see none compute a masked
    tile, as a whole item would) and [full_lo, full_hi) those every one of its rows sees whole,
    inside the key range (the others need the mask). Under causal masking a consumer's rows end
    up to ROWS - BLOCK_M rows before the item's, so it may need one tile fewer."""
    first = row0 + (k_len - q_len)  # key position of the consumer's first row
    last = first + BLOCK_M - 1
    own = n_tiles
    full_hi = k_len // BLOCK_N
    if MASK_RIGHT:
        own = gl.cdiv(gl.minimum(k_len, gl.maximum(last + window_right + 1, 0)), BLOCK_N)
        own = gl.minimum(gl.maximum(own, lo + 1), n_tiles)
        full_hi = gl.minimum(full_hi, gl.maximum(first + window_right + 1, 0) // BLOCK_N)
    full_lo = 0
    if MASK_LEFT:
        full_lo = gl.cdiv(gl.maximum(last - window_left, 0), BLOCK_N)
    return own, full_lo, gl.minimum(full_hi, own)


@gluon.jit
def _pass_tiles(j0, n_tiles, it, tk, k_ready, v_ready, k_empty, v_empty, turn, INDEX: gl.constexpr,
                STAGES: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, TURNS: gl.constexpr):
    """Key tiles [j0, n_tiles) of the item that this consumer's rows never see: wait for each as
    the computing consumers do, take its TURNS ping-pong turns and release it, so the ring's
    arrival counts and the turn order stay those of a consumer that computed them. Returns the
    new (it, tk)."""
    for _ in range(j0, n_tiles):
        slot = it % STAGES
        phase = (it // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        for _t in gl.static_range(TURNS):
            _turn_wait(turn, tk, INDEX, PINGPONG)
            _turn_pass(turn, INDEX, CONSUMERS, PINGPONG)
            tk += 1
        mbarrier.arrive(k_empty.index(slot))
        mbarrier.wait(v_ready.index(slot), phase)
        mbarrier.arrive(v_empty.index(slot))
        it += 1
    return it, tk


@gluon.jit
def _store_tile(out, o_tile, o_desc, b, h, row, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    """TMA store of a BLOCK_M x HEAD_DIM output tile through its shared staging tile; rows past
    the tensor's end are clipped by the TMA unit."""
    # the previous item's output store must have read the staging tile before it is rewritten;
    # waiting here (not right after issuing it) lets that store run under this item's loop
    tma.store_wait(0)
    o_tile.store(out)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row, 0], o_tile.reshape([1, 1, BLOCK_M, HEAD_DIM]))


@gluon.jit
def _store_rows(out, o_tile, o_desc, Out, stride_om, stride_oh, b, h, row0, q_off, q_len, BLOCK_M: gl.constexpr,
               HEAD_DIM: gl.constexpr, NUM_WARPS: gl.constexpr, VARLEN: gl.constexpr):  # fmt: skip
    """Store a consumer's ``BLOCK_M`` rows ``out`` (in ``o_desc``'s dtype) from its first row
    ``row0`` of the sequence at ``q_off``: through ``o_tile`` and a TMA store, except (VARLEN) a
    tile that crosses the sequence's end, stored element-wise with its rows past q_len left
    alone; dense rows before row 0 (row0 < 0: a causal item's block before the first) are not
    stored."""
    if VARLEN:
        if row0 + BLOCK_M > q_len:
            # a tile that crosses the sequence's end: a TMA store would write the next
            # sequence's rows, so only the rows inside are stored, element-wise (one such tile
            # per sequence and head), from a layout with 8 consecutive elements per thread
            # (16-byte stores; the wgmma layout's pairs would need a pointer per pair)
            st_layout: gl.constexpr = gl.BlockedLayout(
                [1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [NUM_WARPS, 1], [1, 0]
            )
            offs_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
            offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, st_layout))
            o_ptrs = (
                Out + h.to(gl.int64) * stride_oh + gl.expand_dims((q_off + offs_m).to(gl.int64) * stride_om, 1)
                + gl.expand_dims(offs_d, 0)
            )  # fmt: skip
            gl.store(o_ptrs, gl.convert_layout(out, st_layout), mask=gl.expand_dims(offs_m < q_len, 1))
        else:
            _store_tile(out, o_tile, o_desc, b, h, q_off + row0, BLOCK_M, HEAD_DIM)
    elif row0 >= 0:
        _store_tile(out, o_tile, o_desc, b, h, row0, BLOCK_M, HEAD_DIM)


@gluon.jit
def _issue_first(q_tile, k_smem, k_ready, turn, it, tk, s_zero, INDEX: gl.constexpr, STAGES: gl.constexpr,
                 CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):  # fmt: skip
    """OVERLAP: issue an item's first S = Q K^T (K/V tile ``it``) without waiting for it; returns
    (the running wgmma's result, the new tk)."""
    slot = it % STAGES
    mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
    _turn_wait(turn, tk, INDEX, PINGPONG)
    s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _turn_pass(turn, INDEX, CONSUMERS, PINGPONG)
    return s, tk + 1


@gluon.jit
def _overlap_rest(
    s, q_tile, k_smem, v_smem, q_free, k_ready, v_ready, k_empty, v_empty, turn, it, tk, rows, lo, own, full_lo,
    full_hi, k_len, window_left, window_right, qk_scale, softcap_in, softcap_out, s_zero,
    INDEX: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr, NUM_WARPS: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr,
    FMA_SCALE: gl.constexpr, dtype: gl.constexpr,
):  # fmt: skip
    """OVERLAP: the rest of an item's key tiles [lo, own) once its first S = Q K^T (``s``, K/V
    tile ``it``) is issued: that product's softmax, then each next S issued with the previous
    tile's P V and its softmax computed under that product, then the last P V. Arrives on
    ``q_free`` once the item's last S has completed. Returns (acc, m, l, it, tk): the
    unnormalised output, the row max and sum, the counters past the item's last own tile."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, NUM_WARPS)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(it % STAGES))
    p, alpha, m_i, l_i = _softmax_step(
        s, m_i, l_i, rows, lo, full_lo, full_hi, k_len, window_left, window_right, qk_scale, softcap_in,
        softcap_out, s_layout, BLOCK_N, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, FMA_SCALE, SOFTCAP,
    )  # fmt: skip
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    for j in range(lo + 1, own):
        prev = it % STAGES
        it += 1
        slot = it % STAGES
        mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
        _turn_wait(turn, tk, INDEX, PINGPONG)
        s_tok = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)  # fmt: skip
        acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        _turn_pass(turn, INDEX, CONSUMERS, PINGPONG)
        tk += 1
        # S_j is done once at most one group (the P V product) is still running
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(slot))
        p, alpha, m_i, l_i = _softmax_step(
            s, m_i, l_i, rows, j, full_lo, full_hi, k_len, window_left, window_right, qk_scale, softcap_in,
            softcap_out, s_layout, BLOCK_N, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, FMA_SCALE, SOFTCAP,
        )  # fmt: skip
        # p_op is a register operand of the running wgmma: keep it alive until the wait
        acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
        mbarrier.arrive(v_empty.index(prev))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    # every S = Q K^T of this item has completed: the producer may load a next Q into this slot
    mbarrier.arrive(q_free)
    last = it % STAGES
    mbarrier.wait(v_ready.index(last), (it // STAGES) & 1)
    _turn_wait(turn, tk, INDEX, PINGPONG)
    acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    _turn_pass(turn, INDEX, CONSUMERS, PINGPONG)
    tk += 1
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
    mbarrier.arrive(v_empty.index(last))
    return acc, m_i, l_i, it + 1, tk


@gluon.jit
def _epilogue(
    acc, m_i, l_i, o_tile, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm, b, h, row0,
    q_off, q_len, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    NUM_WARPS: gl.constexpr, FMA_SCALE: gl.constexpr, SOFTCAP: gl.constexpr, VARLEN: gl.constexpr,
):  # fmt: skip
    """Normalise a consumer's ``BLOCK_M`` rows from ``row0`` (of the sequence at q_off) and
    store them with their log-sum-exp; rows past q_len (or before row 0) are not written."""
    dtype: gl.constexpr = o_desc.dtype
    row_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BLOCK_N, NUM_WARPS))
    row_o: gl.constexpr = gl.SliceLayout(1, _mma_layout(HEAD_DIM, NUM_WARPS))
    # rows that saw no key: output 0 and lse = +inf (the backward's exp(s - lse) is then 0)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
    if FMA_SCALE and not SOFTCAP:
        m_log2 = m_i * qk_scale
    else:
        m_log2 = m_i
    lse = gl.where(empty, float("inf"), (m_log2 + gl.log2(l_safe)) * LN2)

    _store_rows(out.to(dtype), o_tile, o_desc, Out, stride_om, stride_oh, b, h, row0, q_off, q_len, BLOCK_M, HEAD_DIM,
               NUM_WARPS, VARLEN)  # fmt: skip
    offs = row0 + gl.arange(0, BLOCK_M, layout=row_s)
    lse_ptrs = Lse + h.to(gl.int64) * stride_lh + (q_off + offs).to(gl.int64) * stride_lm
    if not VARLEN:
        lse_ptrs += b.to(gl.int64) * stride_lb
    gl.store(lse_ptrs, lse, mask=(offs >= 0) & (offs < q_len))


@gluon.jit
def _consumer_rows(
    t, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
    INDEX: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr,
    CONSUMERS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
    HEAD_MAJOR: gl.constexpr,
):  # fmt: skip
    """Item ``t`` as consumer INDEX sees it: (b, h, row0, lo, n_tiles, q_off, q_len, k_len, own,
    full_lo, full_hi, rows) - its first row (< 0: a causal item's block before row 0, never
    stored), the item's key tiles, its own share of them (:func:`_own_tiles`) and its rows' key
    positions, bottom-right aligned."""
    row_s: gl.constexpr = gl.SliceLayout(1, _mma_layout(BLOCK_N, NUM_WARPS))
    b, h, kv_h, m0, lo, n_tiles, q_off, k_off, q_len, k_len = _work_item(
        t, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
        BLOCK_M * CONSUMERS, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN, HEAD_MAJOR,
    )  # fmt: skip
    row0 = m0 + INDEX * BLOCK_M
    own, full_lo, full_hi = _own_tiles(
        row0, lo, n_tiles, q_len, k_len, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT,
    )  # fmt: skip
    rows = row0 + gl.arange(0, BLOCK_M, layout=row_s) + (k_len - q_len)
    return b, h, row0, lo, n_tiles, q_off, q_len, k_len, own, full_lo, full_hi, rows


@gluon.jit
def _consumer_item(
    t, it, tk, n_done, q_tile, o_tile, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
    o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm,
    nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
    qk_scale, softcap_in, softcap_out,
    INDEX: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr, OVERLAP: gl.constexpr, NUM_WARPS: gl.constexpr, CONSUMERS: gl.constexpr,
    PINGPONG: gl.constexpr, FMA_SCALE: gl.constexpr, VARLEN: gl.constexpr, HEAD_MAJOR: gl.constexpr,
):  # fmt: skip
    """One work item of one consumer partition. ``it`` (K/V tiles consumed so far), ``tk``
    (ping-pong turns taken) and ``n_done`` (items done) carry the barrier phases from item to
    item; returns the new (it, tk)."""
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, NUM_WARPS)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    b, h, row0, lo, n_tiles, q_off, q_len, k_len, own, full_lo, full_hi, rows = _consumer_rows(
        t, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right, INDEX,
        BLOCK_M, BLOCK_N, NUM_WARPS, CONSUMERS, MASK_LEFT, MASK_RIGHT, VARLEN, HEAD_MAJOR,
    )  # fmt: skip
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)

    mbarrier.wait(q_bar.index(0), n_done & 1)
    if OVERLAP:
        if n_tiles > lo:
            s, tk = _issue_first(q_tile, k_smem, k_ready, turn, it, tk, s_zero, INDEX, STAGES, CONSUMERS, PINGPONG)
            acc, m_i, l_i, it, tk = _overlap_rest(
                s, q_tile, k_smem, v_smem, q_empty.index(0), k_ready, v_ready, k_empty, v_empty, turn, it, tk,
                rows, lo, own, full_lo, full_hi, k_len, window_left, window_right, qk_scale, softcap_in,
                softcap_out, s_zero, INDEX, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, MASK_LEFT, MASK_RIGHT,
                RIGHT_WINDOW, SOFTCAP, NUM_WARPS, CONSUMERS, PINGPONG, FMA_SCALE, dtype,
            )  # fmt: skip
        else:
            mbarrier.arrive(q_empty.index(0))
    else:
        for j in range(lo, own):
            slot = it % STAGES
            phase = (it // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            _turn_wait(turn, tk, INDEX, PINGPONG)
            s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            _turn_pass(turn, INDEX, CONSUMERS, PINGPONG)
            s = warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(k_empty.index(slot))
            p, alpha, m_i, l_i = _softmax_step(
                s, m_i, l_i, rows, j, full_lo, full_hi, k_len, window_left, window_right, qk_scale, softcap_in,
                softcap_out, s_layout, BLOCK_N, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, FMA_SCALE, SOFTCAP,
            )  # fmt: skip
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(v_ready.index(slot), phase)
            _turn_wait(turn, tk + 1, INDEX, PINGPONG)
            acc_tok = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
            _turn_pass(turn, INDEX, CONSUMERS, PINGPONG)
            tk += 2
            acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
            mbarrier.arrive(v_empty.index(slot))
            it += 1
        mbarrier.arrive(q_empty.index(0))

    _epilogue(
        acc, m_i, l_i, o_tile, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm, b, h, row0,
        q_off, q_len, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_WARPS, FMA_SCALE, SOFTCAP, VARLEN,
    )  # fmt: skip
    # the item's key tiles past every key these rows see (causal): taken part in, not computed
    return _pass_tiles(own, n_tiles, it, tk, k_ready, v_ready, k_empty, v_empty, turn, INDEX, STAGES, CONSUMERS,
                       PINGPONG, 1 if OVERLAP else 2)  # fmt: skip


@gluon.jit
def _item_epilogue(
    n, acc, m_i, l_i, o_tile, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm,
    item_smem, item_empty, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
    INDEX: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, NUM_WARPS: gl.constexpr, CONSUMERS: gl.constexpr,
    FMA_SCALE: gl.constexpr, SOFTCAP: gl.constexpr, HEAD_MAJOR: gl.constexpr,
):  # fmt: skip
    """CARRY: the epilogue of this program's ``n``-th item, one item later. The item is read
    again from its slot of the item ring, which the consumer hands back only now (a register
    carrying it through the key loop made the d128 causal build spill), and its rows decoded
    again."""
    t = _item_in_slot(n, item_smem, NUM_WARPS)
    mbarrier.arrive(item_empty.index(n % 2))
    b, h, row0, lo, n_tiles, q_off, q_len, k_len, own, full_lo, full_hi, rows = _consumer_rows(
        t, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, None, None, None, window_left, window_right, INDEX,
        BLOCK_M, BLOCK_N, NUM_WARPS, CONSUMERS, MASK_LEFT, MASK_RIGHT, False, HEAD_MAJOR,
    )  # fmt: skip
    _epilogue(
        acc, m_i, l_i, o_tile, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm, b, h, row0,
        q_off, q_len, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_WARPS, FMA_SCALE, SOFTCAP, False,
    )  # fmt: skip


@gluon.jit
def _consumer_carry(
    q_smem, o_tile, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
    o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm,
    nheads, group, n_bh, n_m, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_in, softcap_out,
    item_smem, item_ready, item_empty,
    INDEX: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr, NUM_WARPS: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr,
    FMA_SCALE: gl.constexpr, HEAD_MAJOR: gl.constexpr,
):  # fmt: skip
    """A dynamic persistent consumer (OVERLAP, dense) that finishes each item one item late:
    item n's first S = Q K^T (Q in slot n % 2) is issued, then item n - 1's epilogue runs under
    it (its output, row max and sum carried in registers), then item n's tiles as in
    :func:`_overlap_rest`. An item without key tiles has no product to hide the epilogue under."""
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, NUM_WARPS)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    it = 0  # K/V tiles consumed so far (ring slot and phase), as in the producer
    tk = 0  # ping-pong turns taken so far
    n = 0  # items started
    # each item's slot of the item ring is handed back after its epilogue (_item_epilogue)
    t = _read_item(0, item_smem, item_ready, item_empty, NUM_WARPS, False)
    # the previous item's unnormalised output, row max and sum
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    while t < n_bh * n_m:
        b, h, row0, lo, n_tiles, q_off, q_len, k_len, own, full_lo, full_hi, rows = _consumer_rows(
            t, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, None, None, None, window_left, window_right, INDEX,
            BLOCK_M, BLOCK_N, NUM_WARPS, CONSUMERS, MASK_LEFT, MASK_RIGHT, False, HEAD_MAJOR,
        )  # fmt: skip
        qs = n % 2
        q_tile = q_smem.index(qs * CONSUMERS + INDEX)
        mbarrier.wait(q_bar.index(qs), (n // 2) & 1)
        if n_tiles > lo:
            s, tk = _issue_first(q_tile, k_smem, k_ready, turn, it, tk, s_zero, INDEX, STAGES, CONSUMERS, PINGPONG)
            if n > 0:
                _item_epilogue(
                    n - 1, acc, m_i, l_i, o_tile, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh,
                    stride_lm, item_smem, item_empty, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, window_left,
                    window_right, qk_scale, INDEX, BLOCK_M, BLOCK_N, HEAD_DIM, MASK_LEFT, MASK_RIGHT, NUM_WARPS,
                    CONSUMERS, FMA_SCALE, SOFTCAP, HEAD_MAJOR,
                )  # fmt: skip
            acc, m_i, l_i, it, tk = _overlap_rest(
                s, q_tile, k_smem, v_smem, q_empty.index(qs), k_ready, v_ready, k_empty, v_empty, turn, it, tk,
                rows, lo, own, full_lo, full_hi, k_len, window_left, window_right, qk_scale, softcap_in,
                softcap_out, s_zero, INDEX, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, MASK_LEFT, MASK_RIGHT,
                RIGHT_WINDOW, SOFTCAP, NUM_WARPS, CONSUMERS, PINGPONG, FMA_SCALE, dtype,
            )  # fmt: skip
        else:
            # the same epilogue as in the branch above, which must run it after issuing the first
            # product (a running wgmma's result cannot leave an if to be waited for after it)
            if n > 0:
                _item_epilogue(
                    n - 1, acc, m_i, l_i, o_tile, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh,
                    stride_lm, item_smem, item_empty, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, window_left,
                    window_right, qk_scale, INDEX, BLOCK_M, BLOCK_N, HEAD_DIM, MASK_LEFT, MASK_RIGHT, NUM_WARPS,
                    CONSUMERS, FMA_SCALE, SOFTCAP, HEAD_MAJOR,
                )  # fmt: skip
            mbarrier.arrive(q_empty.index(qs))
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        # the item's key tiles past every key these rows see (causal): taken part in, not computed
        it, tk = _pass_tiles(own, n_tiles, it, tk, k_ready, v_ready, k_empty, v_empty, turn, INDEX, STAGES,
                             CONSUMERS, PINGPONG, 1)  # fmt: skip
        n += 1
        t = _read_item(n, item_smem, item_ready, item_empty, NUM_WARPS, False)
    if n > 0:
        _item_epilogue(
            n - 1, acc, m_i, l_i, o_tile, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm,
            item_smem, item_empty, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
            INDEX, BLOCK_M, BLOCK_N, HEAD_DIM, MASK_LEFT, MASK_RIGHT, NUM_WARPS, CONSUMERS, FMA_SCALE, SOFTCAP,
            HEAD_MAJOR,
        )  # fmt: skip


@gluon.jit
def _consumer(
    q_smem, o_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
    o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm,
    nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
    qk_scale, softcap_in, softcap_out,
    INDEX: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr, OVERLAP: gl.constexpr, NUM_WARPS: gl.constexpr, CONSUMERS: gl.constexpr,
    PINGPONG: gl.constexpr, FMA_SCALE: gl.constexpr, PERSISTENT: gl.constexpr, VARLEN: gl.constexpr,
    item_smem, item_ready, item_empty, DYNAMIC: gl.constexpr, HEAD_MAJOR: gl.constexpr, CARRY: gl.constexpr,
):  # fmt: skip
    o_tile = o_smem.index(INDEX)
    if CARRY:
        _consumer_carry(
            q_smem, o_tile, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
            o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm,
            nheads, group, n_bh, n_m, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_in,
            softcap_out, item_smem, item_ready, item_empty, INDEX, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
            MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, NUM_WARPS, CONSUMERS, PINGPONG, FMA_SCALE, HEAD_MAJOR,
        )  # fmt: skip
    elif PERSISTENT:
        q_tile = q_smem.index(INDEX)
        it = 0  # K/V tiles consumed so far (ring slot and phase), as in the producer
        tk = 0  # ping-pong turns taken so far
        n_done = 0
        # items program_id, then (DYNAMIC) those the producer hands over or (static) every
        # num_programs-th
        if DYNAMIC:
            t = _read_item(0, item_smem, item_ready, item_empty, NUM_WARPS)
        else:
            t = gl.program_id(0)
        while t < n_bh * n_m:
            it, tk = _consumer_item(
                t, it, tk, n_done, q_tile, o_tile, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty,
                v_empty, turn, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm,
                nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
                qk_scale, softcap_in, softcap_out, INDEX, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, MASK_LEFT,
                MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, OVERLAP, NUM_WARPS, CONSUMERS, PINGPONG, FMA_SCALE, VARLEN,
                HEAD_MAJOR,
            )  # fmt: skip
            n_done += 1
            if DYNAMIC:
                t = _read_item(n_done, item_smem, item_ready, item_empty, NUM_WARPS)
            else:
                t += gl.num_programs(0)
    else:
        # one item per program: the phases start at 0 and nothing is carried
        zero = gl.to_tensor(0)  # a runtime value: the counters are loop-carried inside the item
        _consumer_item(
            gl.program_id(0), zero, zero, zero, q_smem.index(INDEX), o_tile, k_smem, v_smem, q_bar, q_empty,
            k_ready, v_ready, k_empty, v_empty, turn, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh,
            stride_lm, nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
            window_right, qk_scale, softcap_in, softcap_out, INDEX, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, MASK_LEFT,
            MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, OVERLAP, NUM_WARPS, CONSUMERS, PINGPONG, FMA_SCALE, VARLEN,
            HEAD_MAJOR,
        )  # fmt: skip
    tma.store_wait(0)


@gluon.jit
def _attn_fwd_kernel(
    q_desc, k_desc, v_desc, o_desc, Out, Lse, Sched, CuSeqQ, CuSeqK, Counter,
    stride_om, stride_oh, stride_lb, stride_lh, stride_lm,
    nheads, group, n_bh, n_m, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_in, softcap_out,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, CONSUMER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, FMA_SCALE: gl.constexpr,
    PERSISTENT: gl.constexpr, VARLEN: gl.constexpr, O_IN_Q: gl.constexpr, DYNAMIC: gl.constexpr,
    HEAD_MAJOR: gl.constexpr, CARRY: gl.constexpr,
):  # fmt: skip
    # work items: n_bh (batch, head) pairs x n_m query tiles of CONSUMERS * BLOCK_M rows; a
    # program takes item program_id (PERSISTENT: then program_id + num_programs, ..., or DYNAMIC:
    # the items an atomic counter hands out)
    if not RIGHT_WINDOW:
        # no right window, or causal (0): a literal, so those builds carry no window register
        # (the three-consumer packed causal builds spill otherwise)
        window_right = 0
    if not MASK_LEFT:
        window_left = 0

    dtype: gl.constexpr = q_desc.dtype
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    if CARRY:
        gl.static_assert(DYNAMIC and OVERLAP and not PINGPONG and not VARLEN and not O_IN_Q,
                         "the carried form is a dense dynamic persistent overlap form")
    # CARRY: a Q tile per consumer for each of two items (item n in slot n % 2)
    Q_SLOTS: gl.constexpr = 2 if CARRY else 1
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS * Q_SLOTS, BLOCK_M, HEAD_DIM], tile_layout)
    if O_IN_Q:
        # one item per program: a consumer's Q tile is not read again once its last S = Q K^T
        # has completed, before the output is stored
        gl.static_assert(not PERSISTENT, "the output reuses Q's tile in one-item programs only")
        o_smem = q_smem
    else:
        o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, HEAD_DIM], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    # DYNAMIC: the items the producer hands to the consumers (two slots of 32 copies each)
    item_smem = gl.allocate_shared_memory(gl.int32, [2, 32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_SLOTS):
        mbarrier.init(q_bar.index(i), count=1)
        # each consumer partition arrives once per item (q_empty) and once per slot use
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(i), count=1)
    if DYNAMIC:
        for i in gl.static_range(2):
            mbarrier.init(item_ready.index(i), count=1)
            mbarrier.init(item_empty.index(i), count=CONSUMERS)

    if CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_consumer, (q_smem, o_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                             turn, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm,
                             nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
                             window_right, qk_scale, softcap_in, softcap_out, 0, BLOCK_M, BLOCK_N, HEAD_DIM,
                             STAGES, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, OVERLAP, CONSUMER_WARPS,
                             CONSUMERS, PINGPONG, FMA_SCALE, PERSISTENT, VARLEN, item_smem, item_ready,
                             item_empty, DYNAMIC, HEAD_MAJOR, CARRY)),
                (_consumer, (q_smem, o_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                             turn, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm,
                             nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
                             window_right, qk_scale, softcap_in, softcap_out, 1, BLOCK_M, BLOCK_N, HEAD_DIM,
                             STAGES, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, OVERLAP, CONSUMER_WARPS,
                             CONSUMERS, PINGPONG, FMA_SCALE, PERSISTENT, VARLEN, item_smem, item_ready,
                             item_empty, DYNAMIC, HEAD_MAJOR, CARRY)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                             k_empty, v_empty, nheads, group, n_bh, n_m, seqlen_q, seqlen_k,
                             Sched, CuSeqQ, CuSeqK, window_left, window_right, Counter, item_smem, item_ready,
                             item_empty, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS, MASK_LEFT, MASK_RIGHT,
                             PERSISTENT, VARLEN, DYNAMIC, HEAD_MAJOR, Q_SLOTS)),
            ],
            [CONSUMER_WARPS, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.static_assert(CONSUMERS == 3, "2 or 3 consumer partitions")
        gl.warp_specialize(
            [
                (_consumer, (q_smem, o_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                             turn, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm,
                             nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
                             window_right, qk_scale, softcap_in, softcap_out, 0, BLOCK_M, BLOCK_N, HEAD_DIM,
                             STAGES, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, OVERLAP, CONSUMER_WARPS,
                             CONSUMERS, PINGPONG, FMA_SCALE, PERSISTENT, VARLEN, item_smem, item_ready,
                             item_empty, DYNAMIC, HEAD_MAJOR, CARRY)),
                (_consumer, (q_smem, o_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                             turn, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm,
                             nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
                             window_right, qk_scale, softcap_in, softcap_out, 1, BLOCK_M, BLOCK_N, HEAD_DIM,
                             STAGES, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, OVERLAP, CONSUMER_WARPS,
                             CONSUMERS, PINGPONG, FMA_SCALE, PERSISTENT, VARLEN, item_smem, item_ready,
                             item_empty, DYNAMIC, HEAD_MAJOR, CARRY)),
                (_consumer, (q_smem, o_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                             turn, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh, stride_lm,
                             nheads, group, n_bh, n_m, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
                             window_right, qk_scale, softcap_in, softcap_out, 2, BLOCK_M, BLOCK_N, HEAD_DIM,
                             STAGES, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, SOFTCAP, OVERLAP, CONSUMER_WARPS,
                             CONSUMERS, PINGPONG, FMA_SCALE, PERSISTENT, VARLEN, item_smem, item_ready,
                             item_empty, DYNAMIC, HEAD_MAJOR, CARRY)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                             k_empty, v_empty, nheads, group, n_bh, n_m, seqlen_q, seqlen_k,
                             Sched, CuSeqQ, CuSeqK, window_left, window_right, Counter, item_smem, item_ready,
                             item_empty, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS, MASK_LEFT, MASK_RIGHT,
                             PERSISTENT, VARLEN, DYNAMIC, HEAD_MAJOR, Q_SLOTS)),
            ],
            [CONSUMER_WARPS, CONSUMER_WARPS, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

_TMA_ALIGN_BYTES = 16


def tma_compatible(t: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and 16-byte multiples for every stride
    but the innermost, which must be 1."""
    strides = t.stride()
    if strides[-1] != 1 or t.data_ptr() % _TMA_ALIGN_BYTES:
        return False
    size = t.element_size()
    for s in strides[:-1]:  # a loop, not all(genexpr): this runs several times per call
        if (s * size) % _TMA_ALIGN_BYTES:
            return False
    return True


def _on_hopper(t: torch.Tensor) -> bool:
    """The kernel is built for sm_90a: H100/H200 (compute capability 9.0) only."""
    return t.is_cuda and configs._capability(t.device) == (9, 0)


# A window side at least this wide is no bound at all (no sequence the kernels take is this long);
# smaller ones stay int32 in the kernels' position arithmetic
_UNBOUNDED = 1 << 30


def mask_args(causal, window=(-1, -1), softcap=0.0, softmax_scale=1.0) -> Mapping:
    """The masking and score-transform arguments of a launch, shared by the forward and backward
    launchers: ``window_left`` / ``window_right`` (ints; -1 or a side at least ``_UNBOUNDED``
    wide: no bound on that side; causal is ``window_right`` 0) as the runtime values (0 for an
    unbounded side) and the MASK_LEFT / MASK_RIGHT switches (RIGHT_WINDOW: a right bound past
    the diagonal, window_right > 0; without it the kernels compile window_right as 0), and the
    softcap (``cap * tanh(s * scale / cap)``, 0: none) as SOFTCAP with ``softcap_in`` = scale /
    cap and ``softcap_out`` = cap * log2(e).

    The mapping is read-only and shared between calls with the same arguments (a launch asks for
    it several times)."""
    return _mask_args(bool(causal), int(window[0]), int(window[1]), float(softcap), float(softmax_scale))


@functools.lru_cache(maxsize=1024)
def _mask_args(causal: bool, left: int, right: int, cap: float, softmax_scale: float) -> Mapping:
    if causal:
        if right > 0:
            raise ValueError(f"causal attention has window_right 0 (or -1), got {right}")
        right = 0
    left = -1 if left < 0 or left >= _UNBOUNDED else left
    right = -1 if right < 0 or right >= _UNBOUNDED else right
    return MappingProxyType(dict(
        window_left=max(left, 0), window_right=max(right, 0), MASK_LEFT=left >= 0, MASK_RIGHT=right >= 0,
        RIGHT_WINDOW=right > 0,
        SOFTCAP=cap > 0.0, softcap_in=softmax_scale / cap if cap > 0.0 else 0.0,
        softcap_out=cap * LOG2E if cap > 0.0 else 0.0,
    ))  # fmt: skip


def supports(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, dropout=0.0,
             varlen=False, softmax_scale=None) -> bool:  # fmt: skip
    """True when :func:`hopper_attention_forward` covers this call; everything else keeps the
    Triton kernels. Covered: dense q (B, Sq, H, D) and k/v (B, Sk, Hk, D), or packed (``varlen``)
    q (Tq, H, D) and k/v (Tk, Hk, D), on an sm_90 GPU, float16 or bfloat16 (all three the same),
    D in (64, 128, 256), H a multiple of Hk, causal or not, any sliding window ``(left, right)`` (-1:
    no bound on that side; causal calls have right 0 or -1), softcap or not, no ALiBi or
    dropout, a positive softmax scale (None: the default 1/sqrt(D)), and strides a TMA
    descriptor accepts (innermost 1, the others and the base 16-byte aligned)."""
    if alibi is not None or dropout > 0.0 or softcap < 0.0:
        return False
    if softmax_scale is not None and not softmax_scale > 0:
        return False
    if causal and window[1] > 0:
        return False
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not _on_hopper(q):
        return False
    windowed = max(window) >= 0
    key = (tensors_key(q, k, v), bool(varlen), windowed)
    return _COVERED.get(key, lambda: _geometry_covered(q, k, v, varlen, windowed))


def tensors_key(*tensors) -> tuple:
    """What :func:`tma_compatible` and the shape checks of :func:`supports` read from tensors:
    each one's shape, strides, dtype and device index, and whether every data pointer is 16-byte
    aligned (a key for results that depend on nothing else of theirs)."""
    key = []
    ptrs = 0
    for t in tensors:
        key += (t.shape, t.stride(), t.dtype, t.get_device())
        ptrs |= t.data_ptr()
    key.append(ptrs % _TMA_ALIGN_BYTES == 0)
    return tuple(key)


# supports()' answers for the tensor geometry (tensors_key) of dense/packed calls, with or without
# a window: the shape and layout checks run once per geometry
_COVERED = PlanCache()


def _geometry_covered(q, k, v, varlen: bool, windowed: bool) -> bool:
    dims = 3 if varlen else 4
    if q.dim() != dims or k.dim() != dims or v.dim() != dims:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if not (q.device == k.device == v.device):
        return False
    nheads, head_dim = q.shape[-2:]
    nheads_k = k.shape[-2]
    if head_dim not in HEAD_DIMS or k.shape[-1] != head_dim or v.shape != k.shape:
        return False
    if nheads_k == 0 or nheads % nheads_k:
        return False
    if varlen:
        # programs: heads x schedule entries, at most tokens / 64 + one per (non-empty) sequence;
        # TMA row coordinates are int32
        tokens_q, tokens_k = q.shape[0], k.shape[0]
        if (tokens_q + configs.cdiv(tokens_q, 64)) * nheads >= 2**31 or max(tokens_q, tokens_k) >= 2**31 - 256:
            return False
    else:
        batch, seqlen_q = q.shape[:2]
        if k.shape[0] != batch:
            return False
        # work items (batch x head x 64-row query tiles, an upper bound) are counted in int32
        if batch * nheads * configs.cdiv(seqlen_q, 64) >= 2**31 or k.shape[1] >= 2**31:
            return False
    if windowed and max(q.shape[-3], k.shape[-3]) >= _UNBOUNDED:
        return False  # key positions plus a window side must stay int32
    return all(tma_compatible(t) for t in (q, k, v))


def _descriptor(t: torch.Tensor, rows: int, cols: int = None) -> TensorDescriptor:
    """(B, S, H, D) tensor seen as (B, H, S, D) with its own strides; one tile = rows x cols
    (default: x D). A packed (T, H, D) tensor is one batch entry (1, H, T, D)."""
    if t.dim() == 3:
        # the batch stride of a one-entry axis is never stepped; any 16-byte multiple will do
        shape = [1, t.shape[1], t.shape[0], t.shape[2]]
        strides = [max(t.shape[0], 1) * t.stride(0), t.stride(1), t.stride(0), 1]
    else:
        batch, seqlen, heads, head_dim = t.shape
        shape = [batch, heads, seqlen, head_dim]
        strides = [t.stride(0), t.stride(2), t.stride(1), 1]
    block = [1, 1, rows, cols or t.shape[-1]]
    return tma_descriptor(t, shape, strides, block, shared_layout(tuple(block), t.dtype))


@functools.lru_cache(maxsize=None)
def shared_layout(block: tuple, dtype: torch.dtype):
    """The swizzled shared-memory layout of a TMA tile (built once per tile shape and dtype:
    ``get_default_for`` costs several microseconds of host time per descriptor)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}
ORDERS = ("longest", "document")


@triton.jit
def _document_schedule_kernel(CuSeq, Sched, n_slots, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Program d writes sequence d's slots of :func:`varlen_schedule` (document order): slots
    [cu[d] // ROWS + d, cu[d + 1] // ROWS + d + 1) hold its tiles in order, then (-1, 0); the
    last program also fills the slots past every sequence. Writes stay inside [0, n_slots)."""
    d = tl.program_id(0)
    start = tl.load(CuSeq + d)
    end = tl.load(CuSeq + d + 1)
    first = start // ROWS + d
    last = tl.where(d == tl.num_programs(0) - 1, n_slots, end // ROWS + d + 1)
    n_tiles = tl.cdiv(end - start, ROWS)
    for s0 in range(first, last, BLOCK):
        slot = s0 + tl.arange(0, BLOCK)
        tile = slot - first
        valid = tile < n_tiles
        inside = (slot < last) & (slot >= 0) & (slot < n_slots)
        entry = Sched + 2 * slot.to(tl.int64)
        tl.store(entry, tl.where(valid, d, -1), mask=inside)
        tl.store(entry + 1, tl.where(valid, tile, 0), mask=inside)


_SCHEDULE = CachedLauncher(_document_schedule_kernel)
_SCHEDULE_BLOCK = 128
_SCHEDULE_META: dict = {}


def schedule_slots(tokens: int, batch: int, rows: int) -> int:
    """Entries of a document-order :func:`varlen_schedule` over ``tokens`` packed rows in
    ``batch`` sequences: tokens // rows + batch (sequence d gets cu[d + 1] // rows - cu[d] // rows
    + 1 >= cdiv(length, rows) slots)."""
    return tokens // rows + batch


def varlen_schedule(cu_seqlens_q, cu_seqlens_k, tokens_q, *, rows, block_n, causal, order="document"):
    """The work items of a packed call, built on the device with no host sync: an int32
    (N, 2) tensor of (sequence, query tile of ``rows`` rows); entries (-1, 0) are empty items.

    ``order="document"`` (the default): one launch of a small kernel; tile i of sequence d sits
    at entry ``cu_seqlens_q[d] // rows + d + i`` (so a kernel can find an item's entry, or
    index per-tile state by it, without a search), the rest of a sequence's range and the
    entries past the last sequence are empty; N = :func:`schedule_slots`. ``"longest"``: by the
    number of key tiles the item loads, most first (causal: the last tiles of the longest
    sequences), ties in sequence order, empty entries last (torch ops; N = cdiv(tokens_q, rows)
    + min(batch, tokens_q)). Longest first measured slower on the H100 (12 documents in 16K
    tokens, d128: 0.79 ms against 0.69 ms, best of 3 rounds) and costs ~15 launches of host
    time, so it is kept for comparison only."""
    device = cu_seqlens_q.device
    batch = cu_seqlens_q.numel() - 1
    if order == "document":
        n = schedule_slots(tokens_q, batch, rows)
        sched = torch.empty((n, 2), dtype=torch.int32, device=device)
        if batch > 0 and n > 0:
            meta = _SCHEDULE_META.get(rows)
            if meta is None:
                meta = _SCHEDULE_META[rows] = _SCHEDULE.meta(ROWS=rows, BLOCK=_SCHEDULE_BLOCK, num_warps=4)
            _SCHEDULE((batch,), (cu_seqlens_q, sched), (n,), (), meta)
        return sched
    if order != "longest":
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    n = min(configs.cdiv(tokens_q, rows) + min(batch, tokens_q), batch * configs.cdiv(max(tokens_q, 1), rows))
    len_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    len_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    tiles = (len_q + rows - 1) // rows
    ends = torch.cumsum(tiles, 0)
    slot = torch.arange(n, device=device)
    doc = torch.searchsorted(ends, slot, right=True).clamp_(max=max(batch - 1, 0))
    tile = slot - (ends[doc] - tiles[doc])
    valid = slot < ends[-1]
    lq, lk = len_q[doc], len_k[doc]
    hi = torch.minimum(lk, (tile * rows + rows + lk - lq).clamp_(min=0)) if causal else lk
    work = torch.where(valid, (hi + block_n - 1) // block_n, -1)
    perm = torch.argsort(work, descending=True, stable=True)
    doc, tile, valid = doc[perm], tile[perm], valid[perm]
    return torch.stack((torch.where(valid, doc, -1), torch.where(valid, tile, 0)), 1).to(torch.int32)


def launch_args(q, k, v, out, lse, *, softmax_scale, causal, variant, cu_seqlens_q=None, cu_seqlens_k=None,
                sched=None, window=(-1, -1), softcap=0.0, counter=None):  # fmt: skip
    """(grid, positional args, keyword args) of one launch; shared by the launcher and the
    CPU compile check, so both build the same kernel. ``window`` and ``softcap`` as in
    :func:`mask_args`. Packed (varlen) calls pass cu_seqlens and
    their work items ``sched`` (:func:`varlen_schedule`; the compile check passes an unwritten
    tensor of :func:`schedule_slots` entries: only its dtype matters for compiling). ``counter``:
    a dynamic variant's item counter (:func:`item_counter`; None: a new one)."""
    var = VARIANTS[variant]
    varlen = cu_seqlens_q is not None
    nheads, head_dim = q.shape[-2:]
    nheads_k = k.shape[-2]
    if head_dim not in var.head_dims:
        raise ValueError(f"variant {variant} is built for head dims {var.head_dims}, not {head_dim}")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    masks = mask_args(causal, window, softcap, softmax_scale)
    if varlen:
        if not varlen_builds(variant, causal):
            raise ValueError(
                f"variant {variant} has no packed (varlen) form for causal={bool(causal)}: "
                "persistent variants and three consumers without causal masking are dense-only"
            )
        if sched is None:
            raise ValueError("packed (varlen) launches need their work items (sched=varlen_schedule(...))")
        seqlen_q = seqlen_k = 0  # per sequence, from cu_seqlens
        n_bh, n_m = nheads, 0
        grid = (sched.shape[0] * nheads,)
        stride_om, stride_oh = out.stride(0), out.stride(1)
        stride_lb, stride_lh, stride_lm = 0, lse.stride(0), lse.stride(1)
    else:
        batch, seqlen_q = q.shape[:2]
        seqlen_k = k.shape[1]
        sched = cu_seqlens_q = cu_seqlens_k = None
        n_bh, n_m = batch * nheads, configs.cdiv(seqlen_q, var.rows)
        # a CPU compile check sizes the persistent grid for an H100 SXM's 132 SMs
        grid = (min(n_bh * n_m, configs.sm_count(q.device, 132)) if var.persistent else n_bh * n_m,)
        stride_om, stride_oh = out.stride(1), out.stride(2)
        stride_lb, stride_lh, stride_lm = lse.stride(0), lse.stride(1), lse.stride(2)
    args = (
        _descriptor(q, var.block_m), _descriptor(k, var.block_n), _descriptor(v, var.block_n),
        _descriptor(out, var.block_m), out, lse, sched, cu_seqlens_q, cu_seqlens_k,
        # dynamic persistent launches: the item counter
        (item_counter(q.device) if counter is None else counter) if var.dynamic else None,
        stride_om, stride_oh, stride_lb, stride_lh, stride_lm,
        nheads, nheads // nheads_k, n_bh, n_m, seqlen_q, seqlen_k, masks["window_left"], masks["window_right"],
        float(softmax_scale) * LOG2E, masks["softcap_in"], masks["softcap_out"],
    )  # fmt: skip
    kwargs = dict(
        BLOCK_M=var.block_m, BLOCK_N=var.block_n, HEAD_DIM=head_dim, STAGES=var.stages,
        CONSUMERS=var.consumers, CONSUMER_WARPS=var.consumer_warps, CONSUMER_REGS=var.consumer_regs,
        PRODUCER_REGS=PRODUCER_REGS, MASK_LEFT=masks["MASK_LEFT"], MASK_RIGHT=masks["MASK_RIGHT"],
        RIGHT_WINDOW=masks["RIGHT_WINDOW"], SOFTCAP=masks["SOFTCAP"], OVERLAP=var.overlap, PINGPONG=var.pingpong,
        FMA_SCALE=var.fma_scale, PERSISTENT=var.persistent, VARLEN=varlen, O_IN_Q=var.o_in_q,
        DYNAMIC=var.dynamic, HEAD_MAJOR=var.head_major, CARRY=var.carry,
        num_warps=var.consumer_warps,
    )  # fmt: skip
    return grid, args, kwargs


def hopper_attention_forward(q, k, v, out, lse, *, softmax_scale, causal, variant=None, cu_seqlens_q=None,
                             cu_seqlens_k=None, order="document", window=(-1, -1), softcap=0.0) -> None:  # fmt: skip
    """Forward attention on Hopper. Layouts as ``hf_flash.kernels.flash_fwd.flash_attn_forward``:
    dense q/out (B, Sq, H, D), k/v (B, Sk, Hk, D), lse (B, H, Sq); packed (cu_seqlens given)
    q/out (Tq, H, D), k/v (Tk, Hk, D), lse (H, Tq), cu_seqlens int32 (batch + 1,) on q's device.
    lse is the float32 natural-log log-sum-exp. ``window`` (left, right) and ``softcap`` as in
    :func:`mask_args` (causal: right 0 or -1). Only calls for which :func:`supports` is true
    (checked by the caller); out must be TMA-compatible like q. ``variant`` names an entry of
    ``VARIANTS`` (default: :func:`default_variant`); ``order`` is the packed
    calls' item order (:func:`varlen_schedule`). Packed rows outside every sequence are not
    written; no host sync reads cu_seqlens."""
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together")
    if out.shape != q.shape or out.dtype != q.dtype or not tma_compatible(out):
        raise ValueError("out must have q's shape and dtype and TMA-compatible strides")
    if varlen:
        nheads, tokens_q = q.shape[1], q.shape[0]
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device:
                raise ValueError(f"{name} must be int32 (batch + 1,) on {q.device}, got {cu.dtype} {tuple(cu.shape)}")
        if cu_seqlens_k.numel() != cu_seqlens_q.numel():
            raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1)")
        if lse.shape != (nheads, tokens_q) or lse.dtype != torch.float32:
            raise ValueError("lse must be float32 (nheads, total_q) for packed calls")
        if q.numel() == 0 or cu_seqlens_q.numel() < 2:
            return
        if k.shape[0] == 0:  # no keys in any sequence
            out.zero_()
            lse.fill_(float("inf"))
            return
    else:
        batch, seqlen_q, nheads, head_dim = q.shape
        if lse.shape != (batch, nheads, seqlen_q) or lse.dtype != torch.float32:
            raise ValueError("lse must be float32 (batch, nheads, seqlen_q)")
        if q.numel() == 0:
            return
        if k.shape[1] == 0:
            out.zero_()
            lse.fill_(float("inf"))
            return
    head_dim = q.shape[-1]
    if variant is None:
        variant = default_variant(head_dim, causal, varlen, window, 0 if varlen else q.shape[1], softcap)
    var = VARIANTS[variant]
    sched = None
    if varlen:
        sched = varlen_schedule(
            cu_seqlens_q, cu_seqlens_k, tokens_q, rows=var.rows, block_n=var.block_n, causal=causal, order=order
        )
    key = (variant, q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), lse.stride(), q.dtype,
           q.get_device(), bool(causal), tuple(window), float(softcap), float(softmax_scale),
           None if sched is None else sched.shape[0])  # fmt: skip
    with configs.device_guard(q.device):
        # the call's tensors, in the plan's slots (the counter is the launch stream's)
        counter = item_counter(q.device) if var.dynamic else None
        tensors = (q, k, v, out, lse, sched, cu_seqlens_q, cu_seqlens_k, counter)
        plan = _PLANS.get(key, lambda: _plan(tensors, variant, causal, window, softcap, softmax_scale))
        _FORWARD.run_plan(plan, tensors)


def item_counter(device) -> torch.Tensor:
    """A dynamic variant's work-item counter (one int32), zero when the launch starts; called with
    ``device`` current. Every launch leaves its counter at 0 (:func:`_next_item`), so outside
    CUDA-graph capture it is the one kept for the device's current stream: launches on one stream
    run one after another, and launches on different streams never share one. That saves the
    ``torch.zeros(1)`` of a fill launch per call (8 us of host time on an H200 host, this lookup
    1 us). Under capture (and off CUDA) it is a new zeroed one, which the graph keeps (its replays
    leave it at 0 too)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    counter = _COUNTERS.get(key)
    if counter is None:
        counter = _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", index))
    return counter


# item_counter's counters by (device index, raw stream handle)
_COUNTERS: dict = {}


def _plan(tensors, variant, causal, window, softcap, softmax_scale) -> LaunchPlan:
    """The launch plan of a forward call (``tensors`` in :func:`hopper_attention_forward`'s slots)."""
    q, k, v, out, lse, sched, cu_seqlens_q, cu_seqlens_k, counter = tensors
    grid, args, kwargs = launch_args(
        q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal, variant=variant,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sched=sched, window=window, softcap=softcap,
        counter=counter,
    )  # fmt: skip
    key = (variant, q.shape[-1], sched is not None,
           *(kwargs[f] for f in ("MASK_LEFT", "MASK_RIGHT", "RIGHT_WINDOW", "SOFTCAP")))  # fmt: skip
    meta = _LAUNCH_META.get(key)
    if meta is None:
        meta = _LAUNCH_META[key] = _FORWARD.meta(**kwargs)
    # launch_args' order: 4 descriptors and 6 pointers, 13 integers, 3 floats
    return LaunchPlan.capture(grid, args[:10], args[10:23], args[23:], meta, tensors)


_FORWARD = CachedLauncher(_attn_fwd_kernel)
_LAUNCH_META: dict = {}
_PLANS = PlanCache()


__all__ = [
    "hopper_attention_forward", "supports", "mask_args", "default_variant",
    "tma_compatible", "varlen_schedule", "varlen_builds", "VARIANTS",
    "DEFAULT", "VARLEN_DEFAULT", "VARLEN_DISPATCH_HEAD_DIMS", "SOFTCAP_DISPATCH_HEAD_DIMS", "launch_args",
]
