"""FlashAttention backward for Hopper (sm_90a) in Gluon: the dK/dV (and dQ) kernel, after FlashAttention-3.

A program owns ``Variant.keys`` keys (``CONSUMERS * BLOCK_N``; split-D: ``BLOCK_N``) of one
(batch, K/V head) and walks every query head of the GQA group (K/V are never expanded) and, for
each, the query tiles that can see its keys:

* a producer partition (one warp) loads the program's K and V tiles once (TMA, one mbarrier),
  then streams the Q and dO tiles of each step into a ``STAGES``-deep shared-memory ring
  (``q_ready`` / ``do_ready``; the consumers hand each slot back through ``q_empty`` /
  ``do_empty``), so the loads of later steps run under the math of earlier ones;
* consumer warpgroups own ``BLOCK_N`` (64) keys each and work in the transposed frame, keys along
  the wgmma M axis, so every product has its accumulator in registers and both register operands
  are already in place (no shared-memory round trip):

      S^T  = K Q^T                     (K and Q from shared memory)
      P^T  = exp2(S^T * scale * log2(e) - lse * log2(e))   (lse: the forward's natural-log LSE)
      dP^T = V dO^T                    (V and dO from shared memory)
      dS^T = P^T * (dP^T - delta)      (delta = rowsum(dO * O) - dlse, from the preprocess)
      dV  += P^T dO                    (P^T from registers, dO from shared memory)
      dK  += dS^T Q                    (dS^T from registers, Q from shared memory)

  all as asynchronous wgmma: S^T and dP^T are issued back to back and P^T is computed while
  dP^T runs; dS^T is computed while the dV product runs. Registers move from the producer (24)
  to the consumers through ``setmaxnreg``.

dQ: the ``dq_atomic`` variants also compute ``dQ_part = dS K`` per step (dS^T staged in shared
memory, read transposed) and add it, scaled, into a float32 (B, H, Sq, D) accumulator with a TMA
reduce-add (``cp.reduce.async.bulk.tensor.add``); the launcher then casts it into dq: 5 products
for the 5 counted. ``dq_shared`` (FA3's form) puts both consumers' dS in one product, each
consumer adding half of dQ's columns over all 128 keys (half the reduce traffic of one tile per
consumer); ``dq_lag`` runs that product one step late, so the consumers need not move in
lockstep; ``dq_writer`` hands each consumer's dQ tile to a one-warp writer partition through
double-buffered shared-memory slots. ``dq_ordered`` (``kv2x64-m64-s2-dqwld``) makes
the result bitwise deterministic: one int32 counter per (batch, head, query tile); the writer
adds into a tile only when its counter equals the program's key-block index (ascending: a
program waits only on programs launched before it) and counts itself once its additions have
completed (``cp.async.bulk.wait_group``, a step later, so the wait runs under the next step).
In dense calls the first block in a tile's order stores its tile instead of adding it, so the
accumulator is not zero-filled first.
``dq_frag`` (``kv2x64-m64-s2-dqwldf``) stores each dQ tile in the wgmma fragment's own order
(conflict-free shared stores) into a flat accumulator added by 1-D bulk reduces; a small Triton
kernel then writes dq in its layout. ``dq_parity`` (``kv2x64-m64-s2-dqwldfp``) splits the
writer into two warps taking alternate steps. The dense d128 defaults add to that lse/delta
from shared memory (``stats_smem``), read while the S^T and dP^T products run (``stats_early``)
and a bound on how far a block runs ahead of the next (``lead_bound``) non-causal
(``-dqwldfpsbrr``); P's exponentials pinned under dP^T (``exp_per_branch``) and the dS/dQ
hand-on deferred (``defer_ds``, ``defer_dq``) and each program's query tiles walked from the last
down, the group's heads inside each tile (``tiles_down``) causal (``-dqwldfpsxa-dn``). By query
count (``SEQLEN_VARIANTS``, calls without a window), d128 from 512 queries: non-causal calls run
key block first with the last wave in pieces and queue each step's dQ product behind its dK
product (``dq_early``); causal calls run key blocks first in chunks of two head groups. The d64
default (``kv2x64-m128-s2-dqwlds``, 128 query rows per step) walks its tiles down causal too
(``-dqwlds-dn``); d64 non-causal calls of 512-2K and from 24K run key block first. Without dQ in
the kernel (``kv2x64-m64-s2``, the split-D forms), :func:`hf_flash.kernels.flash_bwd.flash_attn_backward`
runs a dQ kernel beside this one: the Gluon one (:mod:`.attention_dq`) where it covers the call,
else the Triton one (either recomputes S and dP: 7 products for the 5 counted).

Split-D (``Variant.split_d``, :func:`_attn_bwd_split_d_kernel`; the d256 default, where dK and dV
of 64 keys in the transposed frame would take 256 registers per thread): the program's BLOCK_N
keys are shared by the two consumers, queries along the M axis. Each computes S and dP for half
of the keys, writes P^T and dS^T into its rows of two shared tiles and, once both halves are
there, adds P^T dO and dS^T Q into half of dV's and dK's columns over all the keys. dQ comes from
the Triton kernel, or (``dq_atomic``, d128, measured only) from dS K with unordered reduce-adds.
It also takes the softcap (the tanh tile kept over the dP product for dS's 1 - tanh^2
factor). The other dQ variants add in whatever
order the reduces land (``NONDETERMINISTIC`` / ``VARLEN_NONDETERMINISTIC`` pick one where it
measured faster, once deterministic gradients are not required).

Masking: causal attention and sliding windows are bottom-right aligned (query row i sits at key
position ``i + seqlen_k - seqlen_q`` and sees keys ``pos - window_left <= j <= pos +
window_right``, each side only when bounded; :func:`attention_fwd.mask_args`). Query tiles that
see none of the program's keys are skipped, tiles that see all of them run without a mask. With
a left bound the key blocks that add into a query tile of dQ start at :func:`_first_key_block`,
and the ordered dQ counts turns from there. The softcap only in the split-D form (d256;
:func:`supports`). Rows past the end of
the queries need no mask: TMA zero-fills Q and dO there and their lse is read as +inf, so P = 0
and dS = 0. Keys past the end of the sequence (zero-filled K/V rows, whose dK/dV rows the TMA
store clips) are masked in the one key tile that has them, so they add nothing to dQ. Rows that saw no key in the forward (lse +inf) get P = 0.

Packed (varlen) calls (``VARLEN``; cu_seqlens; ``VARLEN_DEFAULT``: d64 and d128 kv2x64-m64-s2
with the Gluon dQ kernel beside it (:mod:`.attention_dq`), which measured faster than the ordered
fused forms there; d256 split-D with the Triton dQ kernel): q/dout
(Tq, H, D), k/v (Tk, Hk, D) are one batch entry (1, H, T, D) of the descriptors, and
a program takes one entry of :func:`attention_fwd.varlen_schedule` built over the key blocks
(document, key block; document -1: an empty item, nothing written) for one K/V head; each
document is bottom-right aligned on its own. Tiles that cross a document's end hold the next
document's rows, not zeros: the query tile that crosses q_len and every tile of a key block that
crosses k_len are masked explicitly (P = 0, so dS = 0); such a key block's dK/dV go out with a
row-masked store, not TMA. The dQ accumulator is (H, Tq, D) float32 (a reduce-add of a tile that
crosses the end adds exactly 0 to the next document's rows), and the ordered counters are per
(head, document, query tile): slot ``cu_seqlens_q[d] // 64 + d + i`` of Tq // 64 + batch per head.

Programs are numbered with the (batch, K/V head) pair fastest and the key tile slowest, so under
causal masking the key tiles that see the most queries start first (packed: the K/V head fastest,
the documents' key blocks in order). Addressing goes through TMA
descriptors with the tensors' own strides (int64); lse/delta are read at an int64 (batch, head)
offset plus int32 row offsets (their rows are unit-stride). The ``stats_smem`` variants (dense
only; the d64 defaults ``kv2x64-m128-s2-dqwlds`` / ``-dn``, 128 query rows per step) read them
from shared memory instead: the backward preprocess (``flash_bwd.backward_preprocess``) lays out
each (batch, head, query tile) as a [lse * log2 e | delta] row pair (+inf / 0 past the end), the
producer loads the step's pair with its Q tile, and the consumers read it where they use it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

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

from triton._C.libtriton import ir as _ir
from triton.experimental.gluon.language._core import builtin as _builtin

from .. import configs
from ..flash_bwd import stats_numel  # the buffer's layout is the preprocess's (re-exported)
from ..launch import CachedLauncher, LaunchPlan, PlanCache, tma_descriptor
from .attention_fwd import (
    LOG2E, MAX_SEQLEN, _descriptor, _mma_layout, _per_tile, _tanh, mask_args, schedule_entry, schedule_slots,
    seqlen_variant, tensors_key, tma_compatible, varlen_schedule,
)

PRODUCER_REGS = 24
LOG2E_C = gl.constexpr(LOG2E)
HEAD_DIMS = (64, 128, 256)


@_builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``cp.reduce.async.bulk.tensor ... .add``: add a shared-memory tile into global memory
    through a TMA descriptor (completes like a TMA store: ``tma.store_wait``). Triton 3.6's
    Gluon builds the op (``ttng.async_tma_reduce``) but has no Python wrapper for it yet."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@dataclass(frozen=True)
class Variant:
    """One compiled form of the dK/dV kernel; a program owns ``keys`` keys."""

    name: str
    block_m: int  # query rows per step (the N of S^T = K Q^T)
    block_n: int  # keys per consumer partition (one warpgroup: 64); split-D: keys per program
    stages: int  # Q/dO ring depth
    consumers: int  # consumer partitions
    consumer_regs: int
    head_dims: tuple = (64, 128)
    # dQ in this kernel: dQ_part = dS K per step, added into a float32 accumulator by TMA
    # reduce-add (the order of the additions varies: not bitwise deterministic). Without it the
    # Triton dQ kernel recomputes S and dP (7 products instead of 5) but is deterministic.
    dq_atomic: bool = False
    # dq_atomic with both consumers' dS in one dQ product (FA3): each consumer computes D / 2
    # columns of dQ over all the program's keys, so one tile per 2 x 64 keys is added (half the
    # reduce traffic); the consumers meet at two mbarriers per step. d128 only (the K tiles are
    # read in 64-column halves).
    dq_shared: bool = False
    # dq_shared with the dQ product of step j issued in step j + 1 (after that step's dK/dV
    # products), so a consumer never waits for the other's dS of the step it is in: the two can
    # drift apart by up to a step and hide each other's elementwise work, as without dQ
    dq_lag: bool = False
    # dq_shared with a dQ writer partition (FA3): each consumer stores its dQ tile into a
    # double-buffered shared-memory slot and goes on; a one-warp partition issues the TMA
    # reduce-add, waits for it and hands the slot back
    dq_writer: bool = False
    # dq_writer with the additions into each (batch, head, query tile) of dQ made in a fixed
    # order of the key blocks (FA3's semaphore per query tile; the writer waits for its turn):
    # the float32 sums, and so dQ, repeat bitwise. Ascending key blocks, causal too: a block
    # waits only on programs launched before it (never one not yet started), and only at the
    # start of a wave, where the blocks of one (batch, K/V head) start together (FA3 orders causal
    # descending with a shortest-first launch: measured 0.6x here, the concurrent programs then
    # sit far apart in the sequence and Q/dO/dQ stop hitting L2). Dense calls: the first key
    # block in a tile's order stores its tile instead of adding it, so the accumulator needs no
    # zero fill (:func:`dq_accum_for`; H200, session 35: the fill was 58 us per d128 call of 16K
    # tokens, 1-2% of a 4K backward)
    dq_ordered: bool = False
    # dq_writer with the dQ tiles in the wgmma accumulator's fragment order (FA3's dQaccum): a
    # consumer stores its 64 x 64 fp32 tile with 16-byte shared stores, four registers per thread
    # contiguous and the threads of a warp side by side (no swizzle, no bank conflicts), and the
    # writer adds the 16 KB tile into a flat float32 accumulator, one (batch, head, query tile,
    # consumer) tile after another, with one TMA reduce of a 16 x 256 box; :func:`_dq_frag_to_bshd` then writes dQ
    # in (B, S, H, D) (the cast copy the other dQ variants run anyway)
    dq_frag: bool = False
    # the order of a program's steps: query tiles from the last down, the heads of the group
    # inside each tile (instead of head by head, tiles upwards). With ordered dQ additions
    # (ascending key blocks) a causal key block then trails the block below it and ends before
    # it (it has fewer tiles, all at the top); head by head it catches up at every head boundary
    # and waits, so the concurrent blocks of a head group all end with the longest one
    tiles_down: bool = False
    # dense programs numbered by chunks of ``key_fastest`` (batch, K/V head) pairs, a chunk's
    # programs before the next chunk's, the key block slower than the pair inside a chunk (0: the
    # pair fastest over all of them): the ~132 programs in flight then belong to a few head
    # groups and share their Q/dO tiles and dQ lines in L2 (the forward's non-causal items,
    # numbered so, read 13x fewer DRAM bytes: .notes/hopper.md session 32), but a group's ordered
    # turns chain up to 132 / key_fastest programs at the launch (the turn model, non-causal
    # 4K-16K: 0.93-0.96 of the work busy at 1, 0.96-0.97 at 4, against 0.97). Not with split_d
    key_fastest: int = 0
    # dq_ordered: the writer reads the next step's counter right after issuing this step's
    # reduces, so the read's latency runs under the wait for the TMA and the release
    poll_ahead: bool = False
    # dq_writer with two writer warps, one per step parity (the slots of that parity): each has
    # two steps' time for its turn, reduce, read and release, and (dq_ordered) counts a block in
    # a tile as soon as its additions have completed instead of a step later
    dq_parity: bool = False
    # the step's lse (times log2 e) and delta reach the consumers through shared memory (FA3):
    # the producer loads them with the step's Q tile, one TMA copy of a [2, block_m] tile from a
    # per-query-tile buffer the backward preprocess fills with delta (past the end lse is +inf and
    # delta 0, so the consumers mask nothing), and the consumers read them when they use them:
    # no global-load latency under the delta product, no lse vector live across the S^T product.
    # Dense calls only (the buffer is laid out per (batch, head, query tile))
    stats_smem: bool = False
    # the split-D form, for head dims the transposed frame cannot hold (256: dK and dV of 64 keys
    # would be 256 registers per thread): the program's block_n keys are shared by the consumers,
    # queries along the wgmma M axis; consumer c computes S and dP for keys [c, c + 1) * block_n /
    # 2 and, after both have put P^T and dS^T in shared memory, dK and dV for columns [c, c + 1) *
    # D / 2 of all the keys (:func:`_split_d_consumer`); dQ by the Triton kernel beside it, or with
    # dq_atomic (+ dq_shared) inside, unordered
    split_d: bool = False
    # P^T's exponentials written in each arm of the step's mask branch (masked / not masked)
    # instead of once after it: then ptxas keeps all of them under the dP^T product in every
    # build (with one exp2 after the branch it moves the wait for dP^T above them in one
    # consumer's code path of the non-causal builds and in most of the stats_smem builds:
    # benchmarks/diagnostics/wgmma_wait_order.py). At 128 query rows (d64) it spills more
    exp_per_branch: bool = False
    # dq_ordered, dense calls without a mask: the producer holds its program back while the
    # program with the next key block of the same (batch, K/V head) is close behind (it has added
    # into the query tile of 3 * LEAD_BOUND steps before) but has not yet added into the tile of
    # LEAD_BOUND steps before (FA3 has no such bound). The ordered turns keep a block from passing
    # the one below it, but nothing keeps the one below from running ahead: where the blocks of a
    # head group drift apart, the Q/dO tiles and the dQ accumulator lines they share fall out of
    # L2 between them (ncu, non-causal 8K: L2 read hits 22% with lse/delta from shared memory
    # against 74% without). 0: no bound
    lead_bound: int = 0
    # stats_smem with the step's lse and delta read from shared memory right after the S^T and
    # dP^T products are issued, while they run (instead of lse after the S^T wait and delta
    # under the dV product). 32 registers live across the products, but the reads no longer wait
    # where their values are needed: after the S^T wait they queue behind the products' operand
    # reads in the shared-memory pipe (ncu, dqwldfpsb non-causal 8K: the first use of lse waits
    # on its load in 3.8% of all stall samples, FADDs on short scoreboard 8.6%)
    stats_early: bool = False
    # dq_lag + dq_writer: a consumer's dS (defer_ds) and dQ (defer_dq) tiles are stored without
    # waiting for the stores to complete, and handed on (fence + mbarrier arrive) a phase later:
    # dS after the dV and dK waits (its dQ product runs a step later anyway), dQ once the next
    # step's S^T and dP^T products are issued (its writer has two steps per slot). After the
    # store the fence waits for the stores to drain behind the products' operand reads: ncu,
    # dqwldfpsb non-causal 8K, 6.4% of all stall samples at the fences, 2.0% in each consumer at
    # the one that holds the next step's products back. Deferring dQ's costs dqwldfpsbrr 36-40
    # bytes of spills (CPU compile); dS's costs none
    defer_ds: bool = False
    defer_dq: bool = False
    # dense calls without a mask: the units of the last, partial wave (n_units mod SMs of them) run
    # as pieces, each a range of the unit's steps (:func:`tail_plan`), so the idle SMs of that wave
    # share its work. Pieces are numbered unit by unit after the whole units: a piece waits only
    # on pieces launched before it (the previous key block's, same steps), so the ordered dQ
    # turns hold. A piece stores its dK/dV partial (float32) in a workspace and
    # :func:`_tail_sum` adds a unit's partials in piece order (deterministic) and stores dK/dV.
    # A piece's loops count its own steps from 0 for the barriers' phases (they start fresh in
    # every program). Not with split_d
    tail_split: bool = False
    # dq_lag + dq_writer: the dQ product of step j - 1 issued right behind step j's dK product
    # and waited for after the dV and dK waits, so the warpgroup's wgmma queue holds dV, dK and
    # dQ back to back (without it the queue drains at the dK wait and the dQ product is issued
    # and waited for at once, nothing of this warpgroup in flight under it). The dQ accumulator
    # (32 registers) is live across the dV and dK waits
    dq_early: bool = False

    def __post_init__(self):
        if self.stats_early and not self.stats_smem:
            raise ValueError(f"variant {self.name}: stats_early needs stats_smem")
        if (self.defer_ds or self.defer_dq) and not (self.dq_lag and self.dq_writer):
            raise ValueError(f"variant {self.name}: defer_ds / defer_dq need dq_lag and dq_writer")
        if self.dq_early and not (self.dq_lag and self.dq_writer):
            raise ValueError(f"variant {self.name}: dq_early needs dq_lag and dq_writer")
        if self.key_fastest and self.split_d:
            raise ValueError(f"variant {self.name}: key_fastest has no split_d form")
        if self.tail_split and self.split_d:
            raise ValueError(f"variant {self.name}: tail_split has no split_d form")

    @property
    def defer_arrive(self) -> int:
        """The deferred hand-ons as the kernel's DEFER_ARRIVE bits: 1 dS, 2 dQ."""
        return int(self.defer_ds) | 2 * int(self.defer_dq)

    @property
    def keys(self) -> int:
        return self.block_n if self.split_d else self.block_n * self.consumers

    @property
    def stats_rows(self) -> int:
        """Query rows per tile of the statistics buffer the variant reads (its ``block_m``;
        0 for the variants that read lse/delta from global memory)."""
        return self.block_m if self.stats_smem else 0


# Every variant the package compiles and tests (CPU compile report, H100 timings in
# .notes/hopper-bwd.md). dqa (one dQ tile per consumer) is the reference point of the dQ
# variants: twice dqs's reduce traffic, slower everywhere; dqs/dqsl (no writer partition) and
# s2 (+ Triton dQ) are the earlier choices, kept as measured references. dqwldf (fragment-order
# dQ, the dense default since session 19) measured 0.99-1.08x dqwld (geometric mean 1.036, 3 rounds);
# a writer warp per consumer (dqw2ld, dqw2ldf) measured 0.97x / 0.99x on average and was dropped
# (.notes/hopper-bwd.md). 128 query rows per step (d64) spills ~1 KB per thread at 240
# registers; a 3-stage Q/dO ring measured no faster than 2. dqwld-dnp (tiles_down + poll_ahead)
# is the fastest ordered fused form on packed causal calls (292 TFLOP/s against dqwld's 210,
# session 20) but below s2 (315) there; on dense calls the same walk measured 0.78-1.02x dqwldf
# (the concurrent key blocks spread over the query tiles and lose L2 reuse), so it was not kept
# for them. Calls without a window run through the window builds' mask form (per-row bounds
# through an opaque move; spills 20/28 bytes causal against 108/140) measured 0.92-1.10x dqwldf,
# geometric mean 1.014 (session 21, 2 rounds): not kept.
VARIANTS = {
    v.name: v
    for v in (
        Variant("kv2x64-m64-s2", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240),
        Variant("kv2x64-m64-s2-dqa", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True),
        Variant("kv2x64-m64-s2-dqs", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqsl", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqwl", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqwld", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqwldf", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, dq_frag=True,
                head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqwldfp", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, dq_frag=True,
                dq_parity=True, head_dims=(128,)),
        # lse/delta through shared memory (session 27: dqwldfps is the d128 causal DEFAULT; dqwldfs
        # 1.009x dqwldf, dqwlfs 0.64-0.73x dqwlf non-causal: not dispatched)
        Variant("kv2x64-m64-s2-dqwldfs", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, dq_frag=True,
                stats_smem=True, head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqwldfps", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, dq_frag=True,
                dq_parity=True, stats_smem=True, head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqwlfs", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_frag=True, stats_smem=True,
                head_dims=(128,)),
        # the exponentials in each arm of the mask branch (exp_per_branch): all 32 under dP^T in
        # both consumers' code paths, mask or not, and fewer spills (CPU compile, session 28);
        # dqwldfpsx is the d128 causal DEFAULT, the others lost 6-8% non-causal (H200, call 3)
        Variant("kv2x64-m64-s2-dqwldfpx", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, dq_frag=True,
                dq_parity=True, exp_per_branch=True, head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqwldfpsx", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, dq_frag=True,
                dq_parity=True, stats_smem=True, exp_per_branch=True, head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqwlfx", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_frag=True, exp_per_branch=True,
                head_dims=(128,)),
        # dqwldfps with the producer's lead bound on unmasked dense calls (session 29). Its first
        # form waited on any running follower: 0.48-0.78x non-causal at a bound of 8 steps,
        # 0.23-0.67x at 32 (a block then waits for the next key block's program that starts a
        # wave later, hundreds of steps behind). Now only a follower already close behind is
        # waited for: 0.93-1.05x dqwldfps non-causal (H200, session 30 call 1; L2 read hits 46%
        # against 22%)
        Variant("kv2x64-m64-s2-dqwldfpsb", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, dq_frag=True,
                dq_parity=True, stats_smem=True, lead_bound=16, head_dims=(128,)),
        # lse and delta read under the S^T and dP^T products (stats_early): the non-causal d128
        # DEFAULT. H200, session 30 call 2: lse alone read early measured 1.02-1.05x dqwldfpsb
        # non-causal, both 1.04-1.13x; causal either 0.99-1.03x dqwldfpsx (not kept)
        Variant("kv2x64-m64-s2-dqwldfpsbrr", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, dq_frag=True,
                dq_parity=True, stats_smem=True, lead_bound=16, stats_early=True, head_dims=(128,)),
        # the same numbered key block fastest (key_fastest=1) and by chunks of four head groups
        # (4). H200, session 32 calls 5 and 7, non-causal 4K-32K, 3 rounds: kf 0.99-1.05x
        # dqwldfpsbrr (geometric means 1.012, 1.018), its DRAM bytes / 5 at 8K; kf4 1.01-1.04x at
        # 4K-16K, 0.90x at 32K
        Variant("kv2x64-m64-s2-dqwldfpsbrr-kf", block_m=64, block_n=64, stages=2, consumers=2,
                consumer_regs=240, dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True,
                dq_ordered=True, dq_frag=True, dq_parity=True, stats_smem=True, lead_bound=16,
                stats_early=True, key_fastest=1, head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqwldfpsbrr-kf4", block_m=64, block_n=64, stages=2, consumers=2,
                consumer_regs=240, dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True,
                dq_ordered=True, dq_frag=True, dq_parity=True, stats_smem=True, lead_bound=16,
                stats_early=True, key_fastest=4, head_dims=(128,)),
        # kf with the partial last wave in pieces (tail_split). H200, session 39 calls 1-2 (4 and
        # 5 rounds), non-causal: kf-ts 0.98-1.06x kf at 2K-32K (geometric means 1.014, 1.010);
        # the same pieces in dqwldfpsbrr's order measured 0.91-0.93x dqwldfpsbrr at every length
        # (dropped; the loss exceeded what the whole tail takes at 32K, not explained), in chunks
        # of two head groups (key_fastest=2) 0.99 / 0.98 / 0.98x kf-ts at 8K / 16K / 32K (call 6,
        # dropped). ncu at 32K (call 5): kf-ts keeps the SMs active 98.7% of the cycles against
        # dqwldfpsbrr's 96.2% in the same elapsed cycles, and runs 5% faster at a 5% higher clock
        # with 2.5x fewer DRAM bytes
        Variant("kv2x64-m64-s2-dqwldfpsbrr-kf-ts", block_m=64, block_n=64, stages=2, consumers=2,
                consumer_regs=240, dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True,
                dq_ordered=True, dq_frag=True, dq_parity=True, stats_smem=True, lead_bound=16,
                stats_early=True, key_fastest=1, tail_split=True, head_dims=(128,)),
        # the dQ product queued behind dK (dq_early). H200, session 41 (5 rounds): on kf-ts
        # 1.002-1.037x at non-causal 2K-32K (SEQLEN_VARIANTS); on dqwldfpsbrr 0.995 / 0.865x at
        # 1K / 2K (spills 68/80 bytes against 16/16); on the causal dn form 1.025 / 1.043 /
        # 0.996x at 2K / 4K / 8K (dispatched there in session 41, until kf2 outran it: 1.00-1.10x
        # over two runs, session 42), on its kf2 form 1.014 / 1.006x at 16K / 32K and level at
        # 512-8K.
        # Without the deferred hand-ons (dqwldfpsx-dn-e) 0.98 / 0.99x xa-dn causal at 4K / 16K; on
        # the d64 default (128 query rows) 0.90 / 0.85x at non-causal 4K / 16K: neither kept
        Variant("kv2x64-m64-s2-dqwldfpsbrr-kf-ts-e", block_m=64, block_n=64, stages=2, consumers=2,
                consumer_regs=240, dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True,
                dq_ordered=True, dq_frag=True, dq_parity=True, stats_smem=True, lead_bound=16,
                stats_early=True, key_fastest=1, tail_split=True, dq_early=True, head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqwldfpsxa-dn-e", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, dq_frag=True,
                dq_parity=True, stats_smem=True, exp_per_branch=True, defer_ds=True, defer_dq=True,
                tiles_down=True, dq_early=True, head_dims=(128,)),
        # dS and dQ tiles handed on a phase after their stores (defer_ds, defer_dq): the causal d128
        # default of session 30 (below: its tiles-down walk). H200, session 30 calls 3-4: causal
        # 1.00-1.03x dqwldfpsx; non-causal it lifts dqwldfpsx 12-19% but costs dqwldfpsbrr 6-17%
        # (spills 56/64 bytes) and, on the builds that do not spill (with the bound, with lse read
        # early, with both), 0.87-1.02x it
        Variant("kv2x64-m64-s2-dqwldfpsxa", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, dq_frag=True,
                dq_parity=True, stats_smem=True, exp_per_branch=True, defer_ds=True, defer_dq=True,
                head_dims=(128,)),
        # the same with the query tiles walked from the last down, heads inside (tiles_down): the
        # causal d128 DEFAULT. The step-count model of the ordered turns (dq_turns_model.py) gives it a
        # 0.99 busy share against 0.89-0.94 for the upward walk. H200, session 31 call 2 (3
        # rounds): 1.052/1.026/1.041/1.008x dqwldfpsxa causal (L2 held with the stats form; on
        # the global-statistics form in session 20 the walk lost L2 reuse, 0.78-1.02x)
        Variant("kv2x64-m64-s2-dqwldfpsxa-dn", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, dq_frag=True,
                dq_parity=True, stats_smem=True, exp_per_branch=True, defer_ds=True, defer_dq=True,
                tiles_down=True, head_dims=(128,)),
        # the same numbered in chunks of two / four head groups, key block fastest inside a chunk
        # (key_fastest): the turn model (dq_turns_model.py --key-fastest) keeps 0.995 / 0.997 of
        # the work busy at causal 32K (the default order 0.997), 0.983 / 0.992 at 16K
        Variant("kv2x64-m64-s2-dqwldfpsxa-dn-kf2", block_m=64, block_n=64, stages=2, consumers=2,
                consumer_regs=240, dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True,
                dq_frag=True, dq_parity=True, stats_smem=True, exp_per_branch=True, defer_ds=True, defer_dq=True,
                tiles_down=True, key_fastest=2, head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqwldfpsxa-dn-kf4", block_m=64, block_n=64, stages=2, consumers=2,
                consumer_regs=240, dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True,
                dq_frag=True, dq_parity=True, stats_smem=True, exp_per_branch=True, defer_ds=True, defer_dq=True,
                tiles_down=True, key_fastest=4, head_dims=(128,)),
        # head dim 64 with FA3's 128 query rows per step and the ordered dQ inside: the per-column
        # lse/delta vectors of a 128-wide tile are what spilled that shape (420-1144 bytes, CPU
        # compile, session 24); through shared memory it builds with 12/16 bytes non-causal and
        # 60/72 causal (session 26). The dense d64 DEFAULT (1.21-1.39x the Triton backward)
        Variant("kv2x64-m128-s2-dqwlds", block_m=128, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, stats_smem=True,
                head_dims=(64,)),
        # candidates for the d64 non-causal backward (0.97-1.08x cuDNN at 4K-32K, H200, session
        # 35), two of the d128 non-causal forms' pieces on the d64 shape: the producer's lead
        # bound (b) and the key block fastest (kf); CPU build 12-24 / 20-92 bytes spilled (the
        # base 16-76). Session 36 (H200, 3 rounds, against dqwlds at 4K-32K): b 1.046 / 0.967 /
        # 0.987 / 1.023x (no default); kf 1.012 / 0.993 / 0.979 / 1.077x, 5 rounds 1.018x at 16K,
        # 1.029x at 24K, 1.044x at 32K: SEQLEN_VARIANTS from 24K. (lse/delta read under the
        # products, d128's stats_early, spills 748-832 bytes at 128 query rows: not built)
        Variant("kv2x64-m128-s2-dqwldsb", block_m=128, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, stats_smem=True,
                lead_bound=16, head_dims=(64,)),
        Variant("kv2x64-m128-s2-dqwlds-kf", block_m=128, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, stats_smem=True,
                key_fastest=1, head_dims=(64,)),
        # dqwlds with the query tiles walked from the last down, heads inside (tiles_down): the
        # causal d64 DEFAULT. The turn model (dq_turns_model.py at 128 query rows per step) keeps
        # 0.909 / 0.886 / 0.942 of dqwlds's causal work busy at 4K / 16K / 32K, 0.987 / 0.993 /
        # 0.997 walked down. H200, session 51 call 3 (5 rounds): backward 240 / 341 / 385 / 418 /
        # 443 / 447 TFLOP/s against 239 / 332 / 380 / 402 / 414 / 444 at 1K-32K (1.004-1.070x,
        # geometric mean 1.032 over 4K-32K; the rule fixed before the run: >= 1.01 there, no point
        # of 1K-32K below 0.98). In chunks of two / four head groups, key block fastest (kf2 /
        # kf4): kf4 0.92x dn at 2K, 0.998-1.018x at 4K-32K, kf2 below it at 2K-4K (calls 1-3;
        # rule >= 1.02x dn at every point of a range): not kept
        Variant("kv2x64-m128-s2-dqwlds-dn", block_m=128, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True, stats_smem=True,
                tiles_down=True, head_dims=(64,)),
        # the same with unordered dQ additions: 1.036x dqwlds in geometric mean but 0.95x at
        # non-causal 32K (session 27), under the rule NONDETERMINISTIC entries meet; not dispatched
        Variant("kv2x64-m128-s2-dqwls", block_m=128, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, stats_smem=True, head_dims=(64,)),
        Variant("kv2x64-m64-s2-dqwlf", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_frag=True, head_dims=(128,)),
        Variant("kv2x64-m64-s2-dqwld-dnp", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, dq_ordered=True,
                tiles_down=True, poll_ahead=True, head_dims=(128,)),
        # head dim 256: 64 keys per program split between the consumers (DEFAULT, VARLEN_DEFAULT).
        # Not built at d128: there it compiles with the softcap and no spills, but soft-capped d128
        # backward ran at 0.87-0.91x the Triton dK/dV kernel + Gluon dQ (271-297 against 297-333
        # TFLOP/s, H200, cap 50, 4K / 16K; session 50 call 1): both consumers redo S, P and dS
        Variant("kv64-m64-s2-splitd", block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240,
                split_d=True, head_dims=(256,)),
        # d128 with 128 keys (S/dP at N=64; spills 72 bytes causal, 444 soft-capped causal): its
        # dK/dV alone 473-543 TFLOP/s on 4 products (H100, session 23 call 10), above dqwldf's
        # kernel, but with the Triton dQ beside it 347-390 against dqwldf's 375-487: not
        # dispatched; a dQ inside it is the lead (.notes/hopper-bwd.md)
        Variant("kv128-m64-s2-splitd", block_m=64, block_n=128, stages=2, consumers=2, consumer_regs=240,
                split_d=True, head_dims=(128,)),
        # the same with dQ inside (each consumer half of dQ's columns over the 128 keys, unordered
        # TMA reduce-adds: not deterministic). H100 (session 23 call 11, one round): its kernel
        # alone 359/445 TFLOP/s causal and 425/495 non-causal at 4K/16K, level with dqwl's
        # (368/427, 401/492): not dispatched
        Variant("kv128-m64-s2-splitd-dqa", block_m=64, block_n=128, stages=2, consumers=2, consumer_regs=240,
                split_d=True, dq_atomic=True, dq_shared=True, head_dims=(128,)),
    )
}  # fmt: skip
# DEFAULT maps (head dim, causal) to the variant the backward runs (deterministic: no variant
# with unordered dQ additions); head dims without an entry keep the Triton backward.
# H100, 2026-11-24 (.notes/hopper-bwd.md, session 16 call 4, 2 rounds): d128 dqwld (fused dQ,
# ordered) against kv2x64-m64-s2 (Gluon dK/dV + Triton dQ, the default before): causal
# 369/400/417/447 TFLOP/s against 370/383/411/412 at 4K/8K/16K/32K (1.00-1.08x), non-causal
# 381/453/471/446 against 373/390/379/389 (1.02-1.24x). At d64 s2 was level with the Triton
# backward (-4%..+10%, session 15); d64 gained its own shape in session 27 (below).
# Session 19 call 2 (3 rounds): dqwldf (fragment-order dQ, 1-D bulk reduce) against dqwld,
# backward 1.016/1.081/1.066/1.062 causal and 1.048/1.029/0.994/0.998 non-causal at 4K-32K
# (geometric mean 1.036, worst 0.994; the rule fixed before the run: >= 1.02, none below 0.98).
# Session 23 call 1 (2 rounds): d256 split-D (dK/dV) + the Triton dQ against the Triton backward,
# backward 338/348/370 TFLOP/s causal and 324/317/315 non-causal at 4K/8K/16K against
# 210/228/230 and 217/219/220 (1.44-1.61x; the rule fixed before the run: faster at every point).
# Session 25 call 1 (3 rounds): dqwldfp (two dQ writers by step parity) against dqwldf, backward
# 1.019/1.026/1.001/0.991 causal and 1.169/1.035/1.009/1.069 non-causal at 4K-32K (geometric mean
# 1.039, worst 0.991: the rule fixed before the run, >= 1.03 and none below 0.98, was met), and
# 1.01-1.14x on MHA / small-batch shapes; but with dqwldfp as DEFAULT the activation-offload GPU
# test (tests/training, the prefetch copies overlapping compute) failed three times in a row and
# passed with dqwldf on the same machine (calls 6-9); session 27 call 1 found that test
# host-bound at its 8K shape (kernels busy 41 of 182-208 ms of the profiled step, the same with
# either variant), so a faster backward left the copies fewer kernels to run under; at 32K
# tokens (the test's shape since) 7/8 prefetches overlap compute with dqwldf and dqwldfps alike.
# Session 27 call 5 (3 rounds), the confirming run of call 2's dqwldfps (dqwldfp's two writers
# with lse/delta from shared memory) against dqwldf, causal: 418/457/469/464 TFLOP/s against
# 374/425/453/460 at 4K-32K (1.118/1.075/1.035/1.009x, geometric mean 1.058; the rule fixed before
# the run: >= 1.03 and none below 0.98). Non-causal it loses (0.79-0.93x: the stats forms lose
# non-causal, most at 4K), so non-causal takes dqwldfp, whose s25 rule was met.
# Session 27 call 3 (3 rounds): d64 dqwlds (128 query rows, lse/delta from shared memory, ordered
# dQ) against the Triton backward, 363/401/431/441 TFLOP/s causal and 399/451/454/460 non-causal
# at 4K-32K against 288/311/343/357 and 330/346/327/352 (1.21-1.39x, geometric mean 1.28; the rule
# fixed before the run: >= the Triton backward at every point, >= 1.05x in geometric mean).
# Session 28 call 3 (an H200, 2 rounds): dqwldfpsx (dqwldfps with P's exponentials in each arm
# of the mask branch) against dqwldfps, causal: 439/471/493/499 TFLOP/s against 424/469/476/479
# (1.035/1.004/1.036/1.042x, geometric mean 1.029; the rule fixed before the run: >= 1.02 and
# none below 0.98). Non-causal every exp_per_branch form lost 6-8% (dqwldfpx 0.91-0.95x dqwldfp).
# Session 30 call 2 (an H200, 3 rounds): dqwldfpsbrr (the stats form with the producer's lead
# bound and lse/delta read under the S^T and dP^T products) against dqwldfp, non-causal:
# 483/508/516/518 TFLOP/s against 451/470/496/489 (1.071/1.081/1.040/1.059x, geometric mean
# 1.063; the rule fixed before the run: >= 1.02 and none below 0.98). Causal the early reads
# measured 1.010x dqwldfpsx in geometric mean (rule: >= 1.01, not met by 0.0003).
# Session 30 call 3 (an H200, 3 rounds): dqwldfpsxa (dqwldfpsx with the dS/dQ hand-on deferred)
# against dqwldfpsx, causal: 441/474/488/501 TFLOP/s against 441/466/483/487 (1.000/1.017/1.010/
# 1.029x, geometric mean 1.014; the rule fixed before the run: >= 1.01 and none below 0.98).
# Non-causal the deferral cost dqwldfpsbrr 6-17% (with it, brr's spills rose to 56/64 bytes).
# Session 31 call 2 (an H200, 3 rounds): dqwldfpsxa-dn (the same, tiles walked downwards) against
# dqwldfpsxa, causal: 447/475/510/507 TFLOP/s against 425/463/490/503 (1.052/1.026/1.041/1.008x,
# geometric mean 1.032; the rule fixed before the run: >= 1.01 and none below 0.98). dS deferred
# alone on dqwldfpsbrr measured 0.967-0.996x it non-causal (dropped).
DEFAULT = {
    (64, False): "kv2x64-m128-s2-dqwlds", (64, True): "kv2x64-m128-s2-dqwlds-dn",
    (128, False): "kv2x64-m64-s2-dqwldfpsbrr", (128, True): "kv2x64-m64-s2-dqwldfpsxa-dn",
    (256, False): "kv64-m64-s2-splitd", (256, True): "kv64-m64-s2-splitd",
}  # fmt: skip
# Dense calls of (head dim, causal) without a window whose query count lies in a range of
# SEQLEN_VARIANTS[key] = ((lo, hi, variant), ...) (inclusive; as the forward's table,
# :func:`attention_fwd.seqlen_variant`) run that variant instead of DEFAULT: the forms with the
# key block fastest in the program numbering (key_fastest), so the ~132 programs in flight
# stream the Q and dO of a few (batch, head group) pairs instead of every pair's (up to 256 MB,
# over the 50 MB L2). H200, 3-5 rounds:
# - d128 non-causal 2K and longer, kf with the last wave in pieces (kf-ts; session 39 call 2, 5
#   rounds): backward 487 / 508 / 511 / 519 / 524 TFLOP/s at 2K / 4K / 8K / 16K / 32K against the
#   defaults of then (kf at 2K-4K: 482 / 499; dqwldfpsbrr above: 499 / 516 / 502), 1.010 / 1.018 /
#   1.024 / 1.006 / 1.044x (the rule fixed before the run: geometric mean >= 1.01, no point below
#   0.99). kf alone had taken 2K-4K since session 33 (1.078 / 1.041x dqwldfpsbrr); at 8K-32K it
#   measured 0.99-1.03x in four runs. Since session 41 with the dQ product queued behind dK
#   (kf-ts-e, Variant.dq_early; calls 1-2, 5 rounds each): 515 / 539 / 539 / 542 and 510 / 549 /
#   549 / 553 TFLOP/s against kf-ts's 514 / 521 / 528 / 526 (4K-32K) and 499 / 530 / 537 / 537
#   (2K, 8K-32K): 1.002-1.037x, geometric means 1.022 / 1.028 (the rule fixed before call 2:
#   geometric mean of both >= 1.01, no point of call 2 below 0.99). Below 2K (call 6, 5 rounds)
#   kf-ts-e ran 388 / 455 TFLOP/s against dqwldfpsbrr's 326 / 347 at 512 / 1K (1.19 / 1.31x;
#   rule >= 1.02x at every measured length): the range starts at 512 (shorter calls not measured).
# - d128 causal 512 and longer, dqwldfpsxa-dn in chunks of two head groups, key block fastest
#   inside a chunk (kf2). Session 33 call 7 (3 rounds): 522 / 510 against dqwldfpsxa-dn's 490 /
#   494 at 16K / 32K (1.065 / 1.032x; rule >= 1.02 at both); chunks of four 0.98 / 1.03x. Shorter
#   calls were left on the turn model's cost for the chunks (1-12%, dq_turns_model.py
#   --key-fastest) until session 42 measured them (calls 1-2, 5 rounds): 272 / 348 / 412 and 260 /
#   339 / 409 / 462 / 493 TFLOP/s at 512 / 1K / 2K (/ 4K / 8K) against the dispatch of then (dn
#   under 2K: 219 / 296; dn with the dQ product queued behind dK, xa-dn-e, at 2K-8K: 375, and 388
#   / 435 / 475), 1.04-1.24x (rule: >= 1.02x at every length the range covers); a second run at
#   4K / 8K / 12K (call 7) read 0.998 / 1.014 / 1.020x xa-dn-e (its rule, below 0.99 anywhere
#   sends that part back, not triggered). xa-dn-e had
#   taken 2K-16K in session 41 (1.025 / 1.043 / 0.996x dn at 2K / 4K / 8K); kf2 with the queued
#   dQ product (kf2-e) ran level with kf2 (0.996-1.004x at 512-8K, 1.014 / 1.006x at 16K / 32K in
#   session 41): not kept. Below 512 not measured: DEFAULT.
# - d64 non-causal, dqwlds-kf (rule >= 1.02x dqwlds over the range, no point below 0.99):
#   - 512-2K (session 42 calls 1-2, 5 rounds): 283 / 347 / 384 and 267 / 347 / 381 TFLOP/s
#     against 259 / 291 / 366 and 213 / 288 / 360 (1.05-1.25x); 3K 1.031x and 4K 0.985x (call 2
#     only) keep DEFAULT. At 512-2K d64 causal calls lost with it (0.57-0.92x).
#   - 24K and longer (session 36 calls 1-2): 470 / 476 TFLOP/s against 450 / 442 at 32K (5 / 3
#     rounds, 1.044 / 1.077x), 467 against 454 at 24K (1.029x); 16K 0.979 / 1.018x keeps DEFAULT.
# Calls outside a range or with a window were not measured and keep DEFAULT.
SEQLEN_VARIANTS = {
    (128, False): ((512, MAX_SEQLEN, "kv2x64-m64-s2-dqwldfpsbrr-kf-ts-e"),),
    (128, True): ((512, MAX_SEQLEN, "kv2x64-m64-s2-dqwldfpsxa-dn-kf2"),),
    (64, False): ((512, 2048, "kv2x64-m128-s2-dqwlds-kf"), (24576, MAX_SEQLEN, "kv2x64-m128-s2-dqwlds-kf")),
}
# (head dim, causal) -> the variant run when deterministic gradients are not required
# (configs.use_deterministic(False), HF_FLASH_DETERMINISTIC=0), where it measured faster than
# DEFAULT (H100, session 16 calls 3-4): d128 non-causal dqwl (unordered) 437-441 TFLOP/s at 4K
# against dqwld's 378-381 (+15%; level at 8K-32K); session 25 call 1 (3 rounds): dqwlf (unordered,
# fragment order) 1.067/0.996/1.033/1.074x dqwl at 4K-32K non-causal (465/480/507/506 TFLOP/s).
# Causal has none: dqwlf measured 1.02-1.07x dqwldf there (1.02 at 32K; the rule asked for >= 1.03x
# at every point), dqwl 0.78-0.94x (its programs drift apart at 32K). Session 30 call 3 (an H200,
# 3 rounds): the deterministic default dqwldfpsbrr outran dqwlf non-causal (dqwlf 0.947-0.971x,
# geometric mean 0.959; the rule fixed before the run removed the entry below 1.03x): dense calls
# have no entry now, unordered dQ is no faster than the ordered default anywhere measured.
# Session 31 call 2: the causal default's form with unordered dQ additions (dqwlfpsxa) ran
# 0.996/1.019/1.000/1.024x the tiles-down default (rule: >= 1.03 at every point; dropped).
NONDETERMINISTIC: dict = {}
# Packed (varlen, cu_seqlens) calls: (head dim, causal) -> variant, deterministic. Head dims
# without an entry keep the Triton backward (d64: the dense default reads lse/delta from the
# preprocess's per-query-tile buffer, which has no packed layout; the 64-row forms gained
# nothing). H100,
# 2026-11-24 (.notes/hopper-bwd.md, session 19 call 2; 12 documents in 16K tokens, Hq=32, Hkv=8,
# bf16; backward alone, 3 rounds): causal, the ordered fused dQ (dqwld) ran 208 TFLOP/s against
# the Triton backward's 263 (its per-tile ordering waits dominate on short documents; unordered
# dqwl 287), while s2 (Gluon dK/dV + the Triton dQ kernel, deterministic) ran 307 (1.17x);
# non-causal dqwld 372 against 308 (1.21x), s2 348. Call 3 with these defaults: causal 313 against
# 263 (1.19x), non-causal 373 against 312 (1.19x); fwd+bwd behind the Triton forward 334 against 290.
# d64 (H200, session 47, benchmarks/diagnostics/packed_forms.py, the same 12 documents, 5 rounds):
# s2 (Gluon dK/dV, Triton dQ) 268-270 TFLOP/s causal against the Triton backward's 222 (1.217x),
# non-causal 293 against 257 (1.137x); forward+backward 1.162x / 1.108x. (The 128-row dense d64
# default reads lse/delta through a per-query-tile buffer that has no packed layout.)
# Session 48 (H200, the same 12 documents, 5 rounds paired): with the Gluon dQ kernel beside it
# (attention_dq, in place of the Triton one) s2 ran 1.054x the ordered fused dqwld backward at d128
# non-causal (418.6 against 397.5 TFLOP/s; forward + backward 1.047x): s2 takes that key too.
VARLEN_DEFAULT = {
    (64, False): "kv2x64-m64-s2", (64, True): "kv2x64-m64-s2",
    (128, False): "kv2x64-m64-s2", (128, True): "kv2x64-m64-s2",
    (256, False): "kv64-m64-s2-splitd", (256, True): "kv64-m64-s2-splitd",
}  # fmt: skip
# The two parity writers (dq_parity) on the packed form of dqwld measured 380 against 375 TFLOP/s
# non-causal and 218 against 213 causal (session 25 call 5, 3 rounds): under the 1.03x the rule
# asked for, not kept (on short documents the turn waits bind, not the writer).
# packed calls when deterministic gradients are not required: non-causal dqwl 406 TFLOP/s (1.09x
# dqwld); causal keeps s2 (dqwl 287 < 307). Session 48: dqwl 1.106x dqwld against s2 with the
# Gluon dQ's 1.054x (backward; 439 against 419 TFLOP/s), so it stays. d64 had s2 with dQ added by
# atomics inside (dqa, session 47: 1.06x s2 with the Triton dQ); with the Gluon dQ kernel s2 leads
# it (dqa 0.981x causal, 0.995x non-causal, session 48): no entry, the deterministic form is
# the faster one
VARLEN_NONDETERMINISTIC = {(128, False): "kv2x64-m64-s2-dqwl"}


def varlen_builds(variant: str) -> bool:
    """True when ``variant`` has a packed (varlen) form: every variant but the fragment-order dQ
    ones and those with lse/delta in shared memory (their flat accumulator, or statistics
    buffer, is laid out per (batch, head, query tile))."""
    var = VARIANTS[variant]
    return not (var.dq_frag or var.stats_smem)


@contextlib.contextmanager
def pinned(variant: str, head_dims=None):
    """Within the block, dense calls of ``head_dims`` (default: the variant's) run ``variant`` at
    every query length, causal or not: DEFAULT names it and their SEQLEN_VARIANTS ranges are
    set aside; both are restored on exit. For benchmarks and diagnostics that time one variant
    through the public functions."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown backward variant {variant!r}; known: {', '.join(VARIANTS)}")
    keys = [(d, c) for d in (head_dims or VARIANTS[variant].head_dims) for c in (False, True)]
    saved = {k: DEFAULT.get(k) for k in keys}
    ranges = {k: SEQLEN_VARIANTS.pop(k) for k in keys if k in SEQLEN_VARIANTS}
    DEFAULT.update(dict.fromkeys(keys, variant))
    configs.dispatch_changed()
    try:
        yield
    finally:
        for k, name in saved.items():
            if name is None:
                DEFAULT.pop(k, None)
            else:
                DEFAULT[k] = name
        SEQLEN_VARIANTS.update(ranges)
        configs.dispatch_changed()


def covered_head_dims(varlen: bool = False) -> set:
    """The head dims the Gluon backward covers (those ``DEFAULT``, or ``VARLEN_DEFAULT`` for
    packed calls, names a variant for)."""
    return {d for d, _ in (VARLEN_DEFAULT if varlen else DEFAULT)}


def variant_for(head_dim: int, causal: bool, varlen: bool = False, seqlen_q: int = 0, window=(-1, -1)) -> str:
    """The variant :func:`hopper_attention_backward` runs by default for this call (``seqlen_q``:
    the dense call's query length, 0 when not known; ``window`` (left, right) as the backward's:
    ``SEQLEN_VARIANTS`` serves calls without a window, the ones it was measured on)."""
    key = (head_dim, bool(causal))
    if varlen:
        if not configs.deterministic() and key in VARLEN_NONDETERMINISTIC:
            return VARLEN_NONDETERMINISTIC[key]
        return VARLEN_DEFAULT[key]
    if not configs.deterministic() and key in NONDETERMINISTIC:
        return NONDETERMINISTIC[key]
    masks = mask_args(causal, window)
    if masks["MASK_LEFT"] or masks["RIGHT_WINDOW"]:
        return DEFAULT[key]
    return seqlen_variant(SEQLEN_VARIANTS, head_dim, causal, seqlen_q) or DEFAULT[key]


# DQ_FRAG: the flat float32 dQ tile (64 query rows x 64 columns) is 16 x 256 floats, the box of
# one TMA reduce (a rank-2 view of the accumulator, 1 KB rows, no swizzle: shared memory and
# global memory in the same linear order). A 4 x 256 x 4 box (16-byte rows) measured 8x the L2
# reduce requests (one per box row) and 0.6x the speed (session 17, call 2).
DQ_FRAG_BOX = (16, 256)
# offset bit k of a fragment-order dQ tile -> the (row, col) it adds (_dq_frag_layout)
DQ_FRAG_BASES = ((0, 1), (8, 0), (0, 2), (0, 4), (1, 0), (2, 0), (4, 0), (16, 0), (32, 0), (0, 8), (0, 16), (0, 32))


@gluon.constexpr_function
def _dq_frag_layout(block_m, dq_n):
    """The shared layout of a dQ tile in fragment order: element (row, col) of the consumer's
    wgmma accumulator (m64 x n64, 4 warps) at offset ``((col >> 3) << 9) | (warp << 7) |
    (lane << 2) | (row8 << 1) | (col & 1)`` with lane = ((row & 7) << 2) | ((col >> 1) & 3), warp =
    row >> 4, row8 = (row >> 3) & 1: each thread's registers 4j..4j+3 are contiguous and the
    threads of a warp sit side by side, so the tile goes out in 16-byte stores without bank
    conflicts. Offset bit k maps to the (row, col) of basis k; :func:`_dq_frag_to_bshd` inverts it."""
    assert block_m == 64 and dq_n == 64, "fragment order is written for 64 x 64 dQ tiles"
    return gl.SharedLinearLayout(offset_bases=[list(basis) for basis in DQ_FRAG_BASES])


@gluon.jit
def _steps(pid, n_bhk, nheads_k, group, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
           KEYS: gl.constexpr, BLOCK_M: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
           VARLEN: gl.constexpr, KEY_FASTEST: gl.constexpr):  # fmt: skip
    """The program's work: (b, kv_h, doc, n0, n_m, m_lo, m_hi, m_full, m_full_hi, q_off, k_off,
    q_len, k_len). Keys [n0, n0 + KEYS) of a sequence of k_len keys and q_len queries (n_m query
    tiles) that starts at row q_off (k_off) of batch entry b; query tiles [m_lo, m_hi) of every
    head of the group can see some of those keys, tiles [m_full, m_full_hi) all of them (as far
    as the window goes: the key tail is masked apart).

    Query row i sits at key position ``i + k_len - q_len`` and sees key j iff ``pos -
    window_left <= j`` (MASK_LEFT) and ``j <= pos + window_right`` (MASK_RIGHT; causal is
    window_right 0).

    Dense: (batch, K/V head) fastest, the key tile slowest (q_off = k_off = 0); KEY_FASTEST = g >
    0: the (batch, K/V head) pairs in chunks of g, each chunk's programs before the next's, key
    tile slower than the pair inside a chunk (the programs in flight share g groups' Q/dO).
    Varlen: the K/V head fastest over the entries of ``Sched`` (int32 pairs (document, key tile),
    from :func:`attention_fwd.varlen_schedule` over cu_seqlens_k; document -1: an empty item, no
    keys and no queries, so the program loads one K/V tile and writes nothing); b = 0 (the
    packed tensors are one batch entry)."""
    if VARLEN:
        kv_h = pid % nheads_k
        doc, tile, q_off, k_off, q_len, k_len = schedule_entry(Sched, pid // nheads_k, CuSeqQ, CuSeqK)
        n0 = tile * KEYS
        b = 0
    else:
        if KEY_FASTEST > 0:
            # chunks of KEY_FASTEST (batch, K/V head) pairs (the last may hold fewer), inside a
            # chunk the key block slower and the pair faster
            n_kb = gl.cdiv(seqlen_k, KEYS)
            chunk = pid // (KEY_FASTEST * n_kb)
            width = gl.minimum(n_bhk - chunk * KEY_FASTEST, KEY_FASTEST)
            r = pid - chunk * (KEY_FASTEST * n_kb)
            bhk = chunk * KEY_FASTEST + r % width
            n0 = (r // width) * KEYS
        else:
            bhk = pid % n_bhk
            n0 = (pid // n_bhk) * KEYS
        b = bhk // nheads_k
        kv_h = bhk % nheads_k
        doc = 0
        q_off = 0
        k_off = 0
        q_len = seqlen_q
        k_len = seqlen_k
    n_m = gl.cdiv(q_len, BLOCK_M)
    shift = k_len - q_len  # bottom-right alignment: row i sits at key position i + shift
    m_lo = 0
    m_full = 0
    m_hi = n_m
    m_full_hi = n_m
    if MASK_RIGHT:
        # row i sees key j iff j <= i + shift + right  <=>  i >= j - shift - right
        m_lo = gl.minimum(gl.maximum(n0 - shift - window_right, 0) // BLOCK_M, n_m)
        m_full = gl.cdiv(gl.maximum(n0 + KEYS - 1 - shift - window_right, 0), BLOCK_M)
    if MASK_LEFT:
        # row i sees key j iff j >= i + shift - left  <=>  i <= j - shift + left
        m_hi = gl.minimum(gl.cdiv(gl.maximum(n0 + KEYS - shift + window_left, 0), BLOCK_M), n_m)
        m_full_hi = gl.maximum(n0 - shift + window_left + 1, 0) // BLOCK_M
        m_lo = gl.minimum(m_lo, m_hi)
    return b, kv_h, doc, n0, n_m, m_lo, m_hi, m_full, m_full_hi, q_off, k_off, q_len, k_len


@gluon.jit
def _first_key_block(mt, shift, window_left, KEYS: gl.constexpr, BLOCK_M: gl.constexpr, MASK_LEFT: gl.constexpr):
    """The lowest key block (of KEYS keys) whose query tiles (:func:`_steps`) include tile mt:
    the blocks that add into a query tile are consecutive from this one (0 without a left
    window bound), so the ordered dQ counts turns from it."""
    if MASK_LEFT:
        first = gl.maximum(mt * BLOCK_M + shift - window_left, 0) // KEYS
    else:
        first = 0
    return first


@gluon.jit
def _step_tile(it, kv_h, group, m_hi, m_lo, TILES_DOWN: gl.constexpr):
    """(query head, query tile) of step ``it`` of a program whose query tiles are [m_lo, m_hi):
    TILES_DOWN, the tiles from the last down with the group's heads inside each tile; otherwise
    head by head, the tiles upwards. The producer, the consumers and the dQ writer walk the same."""
    if TILES_DOWN:
        h = kv_h * group + it % group
        mt = m_hi - 1 - it // group
    else:
        per_head = m_hi - m_lo
        h = kv_h * group + it // per_head
        mt = m_lo + it % per_head
    return h, mt


@gluon.jit
def _unit(n_whole, pieces, TAIL: gl.constexpr):
    """(unit, piece) of this program: programs below ``n_whole`` run unit pid whole (piece -1);
    TAIL, the others piece (pid - n_whole) % pieces of unit n_whole + (pid - n_whole) // pieces."""
    pid = gl.program_id(0)
    unit = pid
    piece = pid * 0 - 1
    if TAIL:
        if pid >= n_whole:
            unit = n_whole + (pid - n_whole) // pieces
            piece = (pid - n_whole) % pieces
    return unit, piece


@gluon.jit
def _piece_steps(piece, pieces, n_steps, TAIL: gl.constexpr):
    """Steps [lo, hi) of piece ``piece`` of a unit of ``n_steps`` steps (all of them for piece
    -1): the piece-th of ``pieces`` near-equal ranges. The loops count a program's own steps
    from 0 for the rings' phases (its barriers are fresh) and use lo + that for the tiles."""
    lo = n_steps * 0
    hi = n_steps
    if TAIL:
        if piece >= 0:
            lo = piece * n_steps // pieces
            hi = (piece + 1) * n_steps // pieces
    return lo, hi


@gluon.jit
def _producer(
    q_desc, k_desc, v_desc, do_desc, stats_desc, q_smem, do_smem, k_smem, v_smem, stats_smem,
    kv_bar, q_ready, do_ready, q_empty, do_empty,
    n_bhk, nheads_k, group, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left, window_right,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
    TILES_DOWN: gl.constexpr, KEY_FASTEST: gl.constexpr, STATS_SMEM: gl.constexpr, Sem,
    LEAD_BOUND: gl.constexpr, n_whole, pieces, PartMap, TAIL: gl.constexpr,
):  # fmt: skip
    unit, piece = _unit(n_whole, pieces, TAIL)
    b, kv_h, doc, n0, n_m, m_lo, m_hi, m_full, m_full_hi, q_off, k_off, q_len, k_len = _steps(
        unit, n_bhk, nheads_k, group, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
        window_right, BLOCK_N * CONSUMERS, BLOCK_M, MASK_LEFT, MASK_RIGHT, VARLEN, KEY_FASTEST,
    )  # fmt: skip
    # LEAD_BOUND (dense, unmasked: every key block of a head group walks the same steps): the
    # count the next key block of this (batch, K/V head) leaves in a tile once it has added there
    # (no left bound: the turns start at block 0)
    LEAD: gl.constexpr = LEAD_BOUND if not (MASK_LEFT or MASK_RIGHT or VARLEN) else 0
    FAR: gl.constexpr = 3 * LEAD
    if LEAD > 0:
        lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        need = n0 // (BLOCK_N * CONSUMERS) + 2
        if TAIL:
            # a piece is not held back (the bound's arithmetic counts from a unit's first step):
            # a count no follower reaches
            need = gl.where(piece < 0, need, 1 << 30)
    # varlen: key rows past the document's end (and query rows past it, below) are the next
    # document's; the consumers mask them and never store them
    mbarrier.expect(kv_bar, CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for c in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(
            k_desc, [b, kv_h, k_off + n0 + c * BLOCK_N, 0], kv_bar, k_smem.index(c).reshape([1, 1, BLOCK_N, HEAD_DIM])
        )
        tma.async_copy_global_to_shared(
            v_desc, [b, kv_h, k_off + n0 + c * BLOCK_N, 0], kv_bar, v_smem.index(c).reshape([1, 1, BLOCK_N, HEAD_DIM])
        )
    per_head = m_hi - m_lo
    lo, hi = _piece_steps(piece, pieces, group * per_head, TAIL)
    if TAIL:
        if piece == 0:
            # where the tail unit's dK/dV rows go (:func:`_tail_sum`): (b, kv_h, n0)
            lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
            where = gl.where(lane == 0, b, gl.where(lane == 1, kv_h, n0))
            gl.store(PartMap + (unit - n_whole) * 3 + lane, where, mask=lane < 3)
    for j in range(0, hi - lo):
        it = lo + j  # the unit's step; j counts this program's (its barriers start at phase 0)
        h, mt = _step_tile(it, kv_h, group, m_hi, m_lo, TILES_DOWN)
        m0 = mt * BLOCK_M
        slot = j % STAGES
        # a fresh barrier counts as having completed the phase before 0: the first pass through
        # the ring does not wait
        phase = ((j // STAGES) & 1) ^ 1
        if LEAD > 0:
            if it >= FAR:
                # the follower (the program of the next key block) close behind (it has added
                # into the tile of step it - FAR) but not within LEAD steps: wait until it is. A
                # follower further back (not launched yet, or launched a wave later) is not waited
                # for, nor a program without one (no count reaches `need`). The wait is only on
                # additions of steps this program has loaded already: no cycle
                h_f, mt_f = _step_tile(it - FAR, kv_h, group, m_hi, m_lo, TILES_DOWN)
                far = gl.max(_load_relaxed(_dq_counter(Sem, b, h_f, mt_f, nheads_k * group, n_m, 0, 0, lane,
                                                       False)), axis=0)  # fmt: skip
                if far >= need:
                    h_b, mt_b = _step_tile(it - LEAD, kv_h, group, m_hi, m_lo, TILES_DOWN)
                    counter = _dq_counter(Sem, b, h_b, mt_b, nheads_k * group, n_m, 0, 0, lane, False)
                    seen = gl.max(_load_relaxed(counter), axis=0)
                    while seen < need:
                        # a pause between reads: the writers poll and reduce into these lines
                        seen = gl.max(_load_relaxed(_pause(counter)), axis=0)
        mbarrier.wait(q_empty.index(slot), phase)
        if STATS_SMEM:
            # the step's lse and delta ride on the Q tile's barrier and slot: tile (b, h, mt) of
            # the statistics buffer, rows 2 * tile (lse) and 2 * tile + 1 (delta)
            mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + stats_desc.block_type.nbytes)
            tile = (b * (nheads_k * group) + h) * n_m + mt
            tma.async_copy_global_to_shared(stats_desc, [2 * tile, 0], q_ready.index(slot), stats_smem.index(slot))
        else:
            mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [b, h, q_off + m0, 0], q_ready.index(slot), q_smem.index(slot).reshape([1, 1, BLOCK_M, HEAD_DIM])
        )
        mbarrier.wait(do_empty.index(slot), phase)
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            do_desc, [b, h, q_off + m0, 0], do_ready.index(slot),
            do_smem.index(slot).reshape([1, 1, BLOCK_M, HEAD_DIM]),
        )  # fmt: skip


@gluon.jit
def _hand_on(bar):
    """Make this partition's shared-memory stores so far visible to the async proxy (the wgmma
    and TMA reads of the other partitions) and arrive on ``bar``."""
    fence_async_shared()
    mbarrier.arrive(bar)


@gluon.jit
def _dq_out(j, dq, b, h, q_row, dq_smem, dq_full, dq_empty, dq_desc,
            INDEX: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, DQ_N: gl.constexpr,
            DQ_WRITER: gl.constexpr, DQ_FRAG: gl.constexpr, DEFER_DQ: gl.constexpr = False):  # fmt: skip
    """This consumer's (scaled) dQ tile of step ``j`` (query rows from ``q_row`` of head h):
    DQ_WRITER hands it to the writer partition
    through slot (j % 2, INDEX) and goes on; otherwise it is staged and added by TMA reduce here.
    DQ_FRAG: the slot holds the tile in fragment order (:func:`_dq_frag_layout`). DEFER_DQ: the slot
    is stored only; the caller fences and hands it on later (:func:`_hand_on`)."""
    if DQ_WRITER:
        slot = (j % 2) * CONSUMERS + INDEX
        mbarrier.wait(dq_empty.index(slot), ((j // 2) & 1) ^ 1)  # the writer is done with step j - 2
        if DQ_FRAG:
            dq_smem.index(slot)._reinterpret(gl.float32, [BLOCK_M, DQ_N], _dq_frag_layout(BLOCK_M, DQ_N)).store(dq)
        else:
            dq_smem.index(slot).store(dq)
        if not DEFER_DQ:
            _hand_on(dq_full.index(slot))
    else:
        dq_tile = dq_smem.index(INDEX)
        # the previous reduce must have read the staging tile before it is rewritten
        tma.store_wait(0)
        dq_tile.store(dq)
        fence_async_shared()
        _tma_reduce_add(dq_desc, [b, h, q_row, INDEX * DQ_N], dq_tile.reshape([1, 1, BLOCK_M, DQ_N]))


@gluon.jit
def _dq_issue(j, ds_smem, k_smem, ds_ready, dq_zero, INDEX: gl.constexpr, CONSUMERS: gl.constexpr,
              DQ_N: gl.constexpr):  # fmt: skip
    """Issue (asynchronously, one wgmma group per consumer's dS tile) this consumer's DQ_N columns
    of dQ for step ``j``: the sum over the consumers c of dS_c K_c[:, columns], once every
    consumer's dS of the step is stored (its tiles in buffer j % 2)."""
    par = j % 2
    mbarrier.wait(ds_ready.index(par), (j // 2) & 1)
    dq_tok = warpgroup_mma(ds_smem.index(par * CONSUMERS).permute((1, 0)),
                           k_smem.index(0).slice(INDEX * DQ_N, DQ_N, dim=1), dq_zero, use_acc=False,
                           is_async=True)  # fmt: skip
    for c in gl.static_range(1, CONSUMERS):
        dq_tok = warpgroup_mma(ds_smem.index(par * CONSUMERS + c).permute((1, 0)),
                               k_smem.index(c).slice(INDEX * DQ_N, DQ_N, dim=1), dq_tok, is_async=True)
    return dq_tok


@gluon.jit
def _dq_shared_step(j, h, q_row, b, ds_smem, k_smem, dq_smem, ds_ready, ds_free, dq_full, dq_empty, dq_desc, dq_zero,
                    sm_scale, INDEX: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr,
                    DQ_N: gl.constexpr, DQ_WRITER: gl.constexpr, DQ_FRAG: gl.constexpr,
                    DEFER_DQ: gl.constexpr = False):  # fmt: skip
    """dQ[rows q_row.. of head h, this consumer's DQ_N columns] += sum over the consumers c of
    dS_c K_c[:, columns], for step ``j`` (its dS tiles in buffer j % 2), added by TMA reduce."""
    par = j % 2
    dq_tok = _dq_issue(j, ds_smem, k_smem, ds_ready, dq_zero, INDEX, CONSUMERS, DQ_N)
    dq = warpgroup_mma_wait(0, deps=(dq_tok,))
    mbarrier.arrive(ds_free.index(par))
    _dq_out(j, dq * sm_scale, b, h, q_row, dq_smem, dq_full, dq_empty, dq_desc, INDEX, CONSUMERS, BLOCK_M, DQ_N,
            DQ_WRITER, DQ_FRAG, DEFER_DQ)  # fmt: skip


@gluon.jit
def _masked_tiles(m_full, m_full_hi, n_m, q_len, key_tail, BLOCK_M: gl.constexpr, MASK_LEFT: gl.constexpr,
                  MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr, VARLEN: gl.constexpr):  # fmt: skip
    """Which query tiles of a consumer's steps need a mask: (m_unmasked_lo, m_unmasked_hi,
    m_mask, m_tail), the values its build reads (the others 0). Windows: the tiles outside
    [m_unmasked_lo, m_unmasked_hi), i.e. all of them when the consumer's keys cross the
    sequence's end (``key_tail``), else those below m_full (the right edge) or from m_full_hi on
    (the left edge) and, varlen, the one that crosses the query rows' end (the next document's
    rows, masked explicitly). Packed without a window: [m_lo, m_mask) and [m_tail, n_m), those
    that cross the causal diagonal (all when the keys cross the document's end) and the one that
    crosses the query rows' end."""
    m_unmasked_lo = 0
    m_unmasked_hi = 0
    m_mask = 0
    m_tail = 0
    if MASK_LEFT or RIGHT_WINDOW:
        m_unmasked_lo = m_full
        m_unmasked_hi = m_full_hi
        if VARLEN:
            m_unmasked_hi = gl.minimum(m_unmasked_hi, q_len // BLOCK_M)
        m_unmasked_hi = gl.where(key_tail, 0, m_unmasked_hi)
    elif VARLEN:
        m_tail = q_len // BLOCK_M
        if MASK_RIGHT:
            m_mask = gl.where(key_tail, n_m, m_full)
        else:
            m_mask = gl.where(key_tail, n_m, 0)
    return m_unmasked_lo, m_unmasked_hi, m_mask, m_tail


@gluon.jit
def _visible(keys, key_pos, rows, k_len, q_len, window_left, window_right, MASK_LEFT: gl.constexpr,
             MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr, VARLEN: gl.constexpr):  # fmt: skip
    """Which (key, query row) entries of a masked step's [keys, rows] tile are visible: ``keys``
    are the key positions shifted into the query frame (key j is visible to row i iff
    j - shift <= i), ``key_pos`` the unshifted ones. Keys past the sequence's end
    (``key_pos >= k_len``, i.e. ``keys >= q_len``) never are, nor (varlen) the rows of the next
    document that a query tile crossing the document's end holds."""
    if MASK_LEFT or RIGHT_WINDOW:
        vis = gl.expand_dims(keys < q_len, 1)
        # the row bounds through an opaque move in dense builds (as the forward's: otherwise a
        # loop-invariant tile of differences may be hoisted and spilled); packed builds, whose
        # document bounds are loaded values, spilled more with it (s2 causal 112/180 bytes
        # against 88/148, CPU compile)
        right = rows + window_right
        left = rows - window_left
        if not VARLEN:
            right = _per_tile(right)
            left = _per_tile(left)
        if MASK_RIGHT:
            vis = vis & (gl.expand_dims(keys, 1) <= gl.expand_dims(right, 0))
        if MASK_LEFT:
            vis = vis & (gl.expand_dims(keys, 1) >= gl.expand_dims(left, 0))
        if VARLEN:
            vis = vis & gl.expand_dims(rows < q_len, 0)
    elif VARLEN:
        if MASK_RIGHT:  # keys <= rows < q_len keeps the keys inside the document too
            vis = (gl.expand_dims(keys, 1) <= gl.expand_dims(rows, 0)) & gl.expand_dims(rows < q_len, 0)
        else:
            vis = gl.expand_dims(keys < q_len, 1) & gl.expand_dims(rows < q_len, 0)
    elif MASK_RIGHT:  # causal
        vis = (gl.expand_dims(keys, 1) <= gl.expand_dims(rows, 0)) & gl.expand_dims(key_pos < k_len, 1)
    else:
        vis = gl.expand_dims(key_pos < k_len, 1)
    return vis


@gluon.jit
def _consumer(
    q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, stats_smem, kv_bar, q_ready, do_ready, q_empty, do_empty,
    ds_ready, ds_free, dq_full, dq_empty, dk_desc, dv_desc, dq_desc, Lse, Delta, stride_lb, stride_lh, stride_lm,
    n_bhk, nheads_k, group, seqlen_q, seqlen_k, window_left, window_right, qk_scale, sm_scale,
    Sched, CuSeqQ, CuSeqK, DK, DV, stride_dkm, stride_dkh, stride_dvm, stride_dvh,
    INDEX: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, CONSUMERS: gl.constexpr, NUM_WARPS: gl.constexpr, MASK_LEFT: gl.constexpr,
    MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr, DQ_ATOMIC: gl.constexpr, DQ_SHARED: gl.constexpr,
    DQ_LAG: gl.constexpr, DQ_WRITER: gl.constexpr,
    DQ_FRAG: gl.constexpr, VARLEN: gl.constexpr, TILES_DOWN: gl.constexpr, KEY_FASTEST: gl.constexpr,
    STATS_SMEM: gl.constexpr,
    EXP_PER_BRANCH: gl.constexpr, STATS_EARLY: gl.constexpr, DEFER_ARRIVE: gl.constexpr, DQ_EARLY: gl.constexpr,
    n_whole, pieces, Part, PartMap, TAIL: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = dk_desc.dtype
    st_layout: gl.constexpr = _mma_layout(BLOCK_M, NUM_WARPS)  # [BLOCK_N keys, BLOCK_M queries]
    # STATS_SMEM: a step's [2, BLOCK_M] statistics tile (no swizzle) read as one flat row
    flat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    acc_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)  # [BLOCK_N keys, HEAD_DIM]
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)  # along the queries
    row_layout: gl.constexpr = gl.SliceLayout(1, st_layout)  # along the keys
    unit, piece = _unit(n_whole, pieces, TAIL)
    b, kv_h, doc, n0, n_m, m_lo, m_hi, m_full, m_full_hi, q_off, k_off, q_len, k_len = _steps(
        unit, n_bhk, nheads_k, group, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
        window_right, BLOCK_N * CONSUMERS, BLOCK_M, MASK_LEFT, MASK_RIGHT, VARLEN, KEY_FASTEST,
    )  # fmt: skip
    k_tile = k_smem.index(INDEX)
    v_tile = v_smem.index(INDEX)
    ds_tile = ds_smem.index(INDEX)
    dq_tile = dq_smem.index(INDEX)  # dq_atomic without DQ_SHARED
    # DQ_SHARED: this consumer's dQ columns [INDEX * DQ_N, (INDEX + 1) * DQ_N)
    DQ_N: gl.constexpr = HEAD_DIM // CONSUMERS if DQ_SHARED else HEAD_DIM
    dq_zero = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=_mma_layout(DQ_N, NUM_WARPS))
    key0 = n0 + INDEX * BLOCK_N
    key_pos = key0 + gl.arange(0, BLOCK_N, layout=row_layout)
    # keys shifted into the query frame: key j is visible to row i iff j - shift <= i
    keys = key_pos - (k_len - q_len)
    # the last key tile sticks out of the sequence: its zero-filled keys (varlen: the next
    # document's) would get P = exp(-lse), harmless for dK/dV (rows clipped or not stored) but not
    # for dQ, so they are masked
    key_tail = key0 + BLOCK_N > k_len
    cols = gl.arange(0, BLOCK_M, layout=col_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    m_unmasked_lo, m_unmasked_hi, m_mask, m_tail = _masked_tiles(
        m_full, m_full_hi, n_m, q_len, key_tail, BLOCK_M, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, VARLEN
    )
    if not VARLEN:
        b64 = b.to(gl.int64)

    mbarrier.wait(kv_bar, 0)
    per_head = m_hi - m_lo
    # DQ_LAG: the (head, query tile) of the previous step, whose dQ product is still to run
    prev_h = kv_h * group
    prev_mt = gl.to_tensor(m_lo)
    lo, hi = _piece_steps(piece, pieces, group * per_head, TAIL)
    for j in range(0, hi - lo):
        it = lo + j  # the unit's step; j counts this program's (its barriers start at phase 0)
        h, mt = _step_tile(it, kv_h, group, m_hi, m_lo, TILES_DOWN)
        rows = mt * BLOCK_M + cols
        slot = j % STAGES
        phase = (j // STAGES) & 1
        if STATS_SMEM:
            # lse (times log2 e) and delta of the step's rows, in the slot of its Q tile (read
            # once the S^T and dP^T products have landed: no vector held across them)
            stats = stats_smem.index(slot)._reinterpret(gl.float32, [2 * BLOCK_M], flat_layout)
        else:
            # lse/delta of the step's rows: loaded before the products so the loads run under
            # them; rows past the end read lse = +inf, so their P (and dS) is 0
            # int64 (batch, head) offset, int32 row offsets (the rows are unit-stride, checked
            # on the host): no 64-bit offset vector stays live across the products
            if VARLEN:
                l_base = h.to(gl.int64) * stride_lh + q_off  # lse/delta (H, Tq)
            else:
                l_base = b64 * stride_lb + h.to(gl.int64) * stride_lh
            lse2 = gl.load(Lse + l_base + rows, mask=rows < q_len, other=float("inf")) * LOG2E_C
        q_tile = q_smem.index(slot)
        do_tile = do_smem.index(slot)
        mbarrier.wait(q_ready.index(slot), phase)
        st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        dpt = warpgroup_mma(v_tile, do_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        if STATS_EARLY:
            # the shared loads run under the products (Variant.stats_early)
            lse2 = stats.slice(0, BLOCK_M).load(col_layout)
            delta = stats.slice(BLOCK_M, BLOCK_M).load(col_layout)
        if DEFER_ARRIVE & 2:
            # the dQ tile of step j - 2 (stored at the end of the step before) goes to its writer
            # now that the products of this step are issued (Variant.defer_dq)
            if j >= 2:
                _hand_on(dq_full.index((j % 2) * CONSUMERS + INDEX))
        st = warpgroup_mma_wait(1, deps=(st,))
        if STATS_SMEM and not STATS_EARLY:
            lse2 = stats.slice(0, BLOCK_M).load(col_layout)
        s2 = st * qk_scale
        # the steps whose tile needs a mask (a runtime branch: most steps need none)
        if MASK_LEFT or RIGHT_WINDOW:
            masked = (mt < m_unmasked_lo) | (mt >= m_unmasked_hi)
        elif VARLEN:
            # the query tile that crosses the document's end holds the next document's rows
            masked = (mt < m_mask) | (mt >= m_tail)
        elif MASK_RIGHT:  # causal
            masked = (mt < m_full) | key_tail
        else:
            masked = key_tail
        # EXP_PER_BRANCH: the same exp2 written in both arms, not after the branch, so that ptxas
        # keeps the exponentials under the dP^T product (see Variant.exp_per_branch)
        if masked:
            # P = 0 where not visible, so dS = 0 and those entries add exactly 0 to dK, dV and dQ
            s2 = gl.where(_visible(keys, key_pos, rows, k_len, q_len, window_left, window_right, MASK_LEFT,
                                   MASK_RIGHT, RIGHT_WINDOW, VARLEN), s2, float("-inf"))  # fmt: skip
            if EXP_PER_BRANCH:
                pt = gl.exp2(s2 - gl.expand_dims(lse2, 0))
        elif EXP_PER_BRANCH:
            pt = gl.exp2(s2 - gl.expand_dims(lse2, 0))
        if not EXP_PER_BRANCH:
            pt = gl.exp2(s2 - gl.expand_dims(lse2, 0))
        p_op = gl.convert_layout(pt.to(dtype), op_layout)
        dpt = warpgroup_mma_wait(0, deps=(dpt,))
        dv_tok = warpgroup_mma(p_op, do_tile, dv, is_async=True)
        # delta is read here, under the dV product, to keep it out of the registers before
        if not STATS_SMEM:
            delta = gl.load(Delta + l_base + rows, mask=rows < q_len, other=0.0)
        elif not STATS_EARLY:
            delta = stats.slice(BLOCK_M, BLOCK_M).load(col_layout)
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        ds = dst.to(dtype)
        ds_op = gl.convert_layout(ds, op_layout)
        dk_tok = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
        if DQ_LAG and DQ_EARLY:
            par = j % 2
            if j > 0:
                # the dQ product of step j - 1 queued behind dK (Variant.dq_early): the groups in
                # flight are dV, dK and one per consumer's dS tile
                dq_tok = _dq_issue(j - 1, ds_smem, k_smem, ds_ready, dq_zero, INDEX, CONSUMERS, DQ_N)
                mbarrier.wait(ds_free.index(par), ((j // 2) & 1) ^ 1)  # all dQ products of step j - 2 ran
                ds_smem.index(par * CONSUMERS + INDEX).store(ds)
                if not DEFER_ARRIVE & 1:
                    _hand_on(ds_ready.index(par))
                dv, p_op = warpgroup_mma_wait(CONSUMERS + 1, deps=(dv_tok, p_op))
                mbarrier.arrive(do_empty.index(slot))
                dk, ds_op = warpgroup_mma_wait(CONSUMERS, deps=(dk_tok, ds_op))
                mbarrier.arrive(q_empty.index(slot))
                if DEFER_ARRIVE & 1:
                    _hand_on(ds_ready.index(par))
                dq = warpgroup_mma_wait(0, deps=(dq_tok,))
                mbarrier.arrive(ds_free.index(1 - par))
                _dq_out(j - 1, dq * sm_scale, b, prev_h, q_off + prev_mt * BLOCK_M, dq_smem, dq_full, dq_empty,
                        dq_desc, INDEX, CONSUMERS, BLOCK_M, DQ_N, DQ_WRITER, DQ_FRAG, DEFER_ARRIVE & 2)  # fmt: skip
            else:
                ds_smem.index(INDEX).store(ds)  # step 0: buffer 0, free
                if not DEFER_ARRIVE & 1:
                    _hand_on(ds_ready.index(0))
                dv, p_op = warpgroup_mma_wait(1, deps=(dv_tok, p_op))
                mbarrier.arrive(do_empty.index(slot))
                dk, ds_op = warpgroup_mma_wait(0, deps=(dk_tok, ds_op))
                mbarrier.arrive(q_empty.index(slot))
                if DEFER_ARRIVE & 1:
                    _hand_on(ds_ready.index(0))
            prev_h = h
            prev_mt = mt
        elif DQ_LAG:
            par = j % 2
            mbarrier.wait(ds_free.index(par), ((j // 2) & 1) ^ 1)  # all dQ products of step j - 2 ran
            ds_smem.index(par * CONSUMERS + INDEX).store(ds)
            if not DEFER_ARRIVE & 1:
                _hand_on(ds_ready.index(par))
            dv, p_op = warpgroup_mma_wait(1, deps=(dv_tok, p_op))
            mbarrier.arrive(do_empty.index(slot))
            dk, ds_op = warpgroup_mma_wait(0, deps=(dk_tok, ds_op))
            mbarrier.arrive(q_empty.index(slot))
            if DEFER_ARRIVE & 1:
                # the dS stores have drained under the dV and dK products (Variant.defer_ds)
                _hand_on(ds_ready.index(par))
            if j > 0:
                _dq_shared_step(j - 1, prev_h, q_off + prev_mt * BLOCK_M, b, ds_smem, k_smem, dq_smem, ds_ready,
                                ds_free, dq_full,
                                dq_empty, dq_desc, dq_zero, sm_scale, INDEX, CONSUMERS, BLOCK_M, DQ_N,
                                DQ_WRITER, DQ_FRAG, DEFER_ARRIVE & 2)  # fmt: skip
            prev_h = h
            prev_mt = mt
        elif DQ_SHARED:
            # dS^T of both consumers through shared memory (double-buffered by step parity):
            # dQ[:, cols] = sum over the consumers c of dS_c K_c[:, cols]
            par = j % 2
            dph = (j // 2) & 1
            mbarrier.wait(ds_free.index(par), dph ^ 1)  # both consumers are done with step j - 2
            ds_smem.index(par * CONSUMERS + INDEX).store(ds)
            _hand_on(ds_ready.index(par))
            dv, p_op = warpgroup_mma_wait(1, deps=(dv_tok, p_op))
            mbarrier.arrive(do_empty.index(slot))
            mbarrier.wait(ds_ready.index(par), dph)
            dq_tok = warpgroup_mma(ds_smem.index(par * CONSUMERS).permute((1, 0)),
                                   k_smem.index(0).slice(INDEX * DQ_N, DQ_N, dim=1), dq_zero, use_acc=False,
                                   is_async=True)  # fmt: skip
            for c in gl.static_range(1, CONSUMERS):
                dq_tok = warpgroup_mma(ds_smem.index(par * CONSUMERS + c).permute((1, 0)),
                                       k_smem.index(c).slice(INDEX * DQ_N, DQ_N, dim=1), dq_tok,
                                       is_async=True)  # fmt: skip
            dk, ds_op = warpgroup_mma_wait(1, deps=(dk_tok, ds_op))
            mbarrier.arrive(q_empty.index(slot))
            dq = warpgroup_mma_wait(0, deps=(dq_tok,))
            mbarrier.arrive(ds_free.index(par))
            _dq_out(j, dq * sm_scale, b, h, q_off + mt * BLOCK_M, dq_smem, dq_full, dq_empty, dq_desc, INDEX,
                    CONSUMERS, BLOCK_M,
                    DQ_N, DQ_WRITER, DQ_FRAG)  # fmt: skip
        elif DQ_ATOMIC:
            # dQ_part = dS K: dS^T goes through shared memory to be read transposed
            ds_tile.store(ds)
            fence_async_shared()
            dq_tok = warpgroup_mma(ds_tile.permute((1, 0)), k_tile, dq_zero, use_acc=False, is_async=True)
            dv, p_op = warpgroup_mma_wait(2, deps=(dv_tok, p_op))
            mbarrier.arrive(do_empty.index(slot))
            dk, ds_op = warpgroup_mma_wait(1, deps=(dk_tok, ds_op))
            mbarrier.arrive(q_empty.index(slot))
            dq = warpgroup_mma_wait(0, deps=(dq_tok,))
            # the previous step's reduce must have read the staging tile before it is rewritten
            tma.store_wait(0)
            dq_tile.store(dq * sm_scale)
            fence_async_shared()
            _tma_reduce_add(dq_desc, [b, h, q_off + mt * BLOCK_M, 0], dq_tile.reshape([1, 1, BLOCK_M, HEAD_DIM]))
        else:
            dv, p_op = warpgroup_mma_wait(1, deps=(dv_tok, p_op))
            mbarrier.arrive(do_empty.index(slot))
            dk, ds_op = warpgroup_mma_wait(0, deps=(dk_tok, ds_op))
            mbarrier.arrive(q_empty.index(slot))

    if DQ_LAG:
        if DEFER_ARRIVE & 2:
            # the dQ tile of step hi - 2, stored in the loop's last step
            if hi - lo >= 2:
                _hand_on(dq_full.index(((hi - lo) % 2) * CONSUMERS + INDEX))
        # the last step's dQ tile is handed on at once (no step follows to hide the fence under)
        if hi > lo:
            _dq_shared_step(hi - lo - 1, prev_h, q_off + prev_mt * BLOCK_M, b, ds_smem, k_smem, dq_smem, ds_ready,
                            ds_free, dq_full,
                            dq_empty, dq_desc, dq_zero, sm_scale, INDEX, CONSUMERS, BLOCK_M, DQ_N,
                            DQ_WRITER, DQ_FRAG)  # fmt: skip
    tma.store_wait(0)
    if DQ_SHARED:
        # the other consumers read this K tile in their dQ products: wait until the last step's
        # products of all of them are done before it is overwritten
        if hi > lo:
            mbarrier.wait(ds_free.index((hi - lo - 1) % 2), ((hi - lo - 1) // 2) & 1)
    if TAIL:
        if piece >= 0:
            # a piece: its float32 partial (unscaled) to the workspace, slot (tail unit, piece),
            # dK then dV, KEYS x HEAD_DIM each (the producer of piece 0 says where they go)
            tail = unit - n_whole
            KEYS: gl.constexpr = BLOCK_N * CONSUMERS
            rk = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout)) + INDEX * BLOCK_N
            cd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
            off = gl.expand_dims(rk * HEAD_DIM, 1) + gl.expand_dims(cd, 0)
            base = (tail * pieces + piece).to(gl.int64) * (2 * KEYS * HEAD_DIM)
            gl.store(Part + base + off, dk)
            gl.store(Part + base + KEYS * HEAD_DIM + off, dv)
    dk = dk * sm_scale  # dS is taken w.r.t. the scaled scores
    if VARLEN:
        if key_tail:
            # a key tile that crosses the document's end (or lies past it: the second consumer's
            # of a short last tile, or an empty item): a TMA store would overwrite the next
            # document's dK/dV, so only the rows inside are stored, element-wise. The tiles go
            # through the K/V staging tiles (a register layout conversion would need 16 KB of
            # shared scratch beyond the kernel's 227 KB) and are read back in a layout with 8
            # consecutive elements per thread (16-byte stores)
            out_layout: gl.constexpr = gl.BlockedLayout(
                [1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [NUM_WARPS, 1], [1, 0]
            )
            k_tile.store(dk.to(dtype))
            v_tile.store(dv.to(dtype))
            offs_n = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
            offs_d = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_layout)), 0)
            key_rows = gl.expand_dims((k_off + offs_n).to(gl.int64), 1)
            inside = gl.expand_dims(offs_n < k_len, 1)
            kv_h64 = kv_h.to(gl.int64)
            gl.store(DK + kv_h64 * stride_dkh + key_rows * stride_dkm + offs_d, k_tile.load(out_layout), mask=inside)
            gl.store(DV + kv_h64 * stride_dvh + key_rows * stride_dvm + offs_d, v_tile.load(out_layout), mask=inside)
        else:
            k_tile.store(dk.to(dtype))
            v_tile.store(dv.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(dk_desc, [b, kv_h, k_off + key0, 0],
                                            k_tile.reshape([1, 1, BLOCK_N, HEAD_DIM]))  # fmt: skip
            tma.async_copy_shared_to_global(dv_desc, [b, kv_h, k_off + key0, 0],
                                            v_tile.reshape([1, 1, BLOCK_N, HEAD_DIM]))  # fmt: skip
    elif TAIL:
        if piece < 0:  # a piece's partial went to the workspace above
            _store_dkdv(dk, dv, k_tile, v_tile, dk_desc, dv_desc, b, kv_h, key0, BLOCK_N, HEAD_DIM)
    else:
        _store_dkdv(dk, dv, k_tile, v_tile, dk_desc, dv_desc, b, kv_h, key0, BLOCK_N, HEAD_DIM)
    tma.store_wait(0)


@gluon.jit
def _store_dkdv(dk, dv, k_tile, v_tile, dk_desc, dv_desc, b, kv_h, key0, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr):  # fmt: skip
    """A dense program's dK and dV rows out by TMA, staged in its K and V tiles (no longer read)."""
    dtype: gl.constexpr = dk_desc.dtype
    k_tile.store(dk.to(dtype))
    v_tile.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, kv_h, key0, 0], k_tile.reshape([1, 1, BLOCK_N, HEAD_DIM]))
    tma.async_copy_shared_to_global(dv_desc, [b, kv_h, key0, 0], v_tile.reshape([1, 1, BLOCK_N, HEAD_DIM]))


@gluon.jit
def _warp_sync_fence(x):
    """All lanes of the warp past this point (bar.warp.sync), then a generic/async proxy fence on
    global memory: what the semaphore ordered (in either direction) is ordered for the TMA
    reduces too. ``x``: a per-lane int32 tensor, returned unchanged (the asm needs an operand)."""
    return gl.inline_asm_elementwise(
        "bar.warp.sync 0xffffffff;\n\tfence.proxy.async.global;\n\tmov.b32 $0, $1;",
        "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _load_acquire(ptrs):
    """``ld.acquire.gpu`` of int32 counters, one per lane (a plain load: an atomic would queue in
    L2's atomic units behind the dQ reduce traffic)."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=gl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _load_relaxed(ptrs):
    """``ld.relaxed.gpu`` of int32 values written by other programs, one per lane: no ordering
    and no L1 invalidation (the lead bound only paces the producer; the turns order the data)."""
    return gl.inline_asm_elementwise("ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=gl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _pause(ptrs):
    """``nanosleep`` of ~256 ns, then ``ptrs`` unchanged (a spinning warp's back-off)."""
    return gl.inline_asm_elementwise("nanosleep.u32 256;\n\tmov.b64 $0, $1;", "=l,l", [ptrs], dtype=gl.int64,
                                     is_pure=False, pack=1).to(gl.pointer_type(gl.int32))  # fmt: skip


@gluon.jit
def _release_add_one(ptrs, lane):
    """Lane 0 adds 1 to its counter with release semantics (``red``: no value comes back, so the
    warp does not wait for it). ``lane``: the lane index, returned unchanged."""
    return gl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.eq.s32 p, $2, 0;\n\t@p red.release.gpu.global.add.s32 [$1], 1;"
        "\n\tmov.b32 $0, $2;\n\t}",
        "=r,l,r", [ptrs, lane], dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _bulk_wait(x, PENDING: gl.constexpr):
    """``cp.async.bulk.wait_group PENDING`` (0, 1 or 2): all but the PENDING most recent bulk groups
    this thread committed have completed, their global writes included (``tma.store_wait`` emits
    the ``.read`` form, which waits only until their shared-memory source has been read); then
    :func:`_warp_sync_fence`, since one lane issued them and another releases the semaphore."""
    gl.static_assert((PENDING == 0) or (PENDING == 1) or (PENDING == 2), "0, 1 or 2 pending bulk groups")
    if PENDING == 0:
        x = gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tmov.b32 $0, $1;", "=r,r", [x],
                                      dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
    elif PENDING == 1:
        x = gl.inline_asm_elementwise("cp.async.bulk.wait_group 1;\n\tmov.b32 $0, $1;", "=r,r", [x],
                                      dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
    else:
        x = gl.inline_asm_elementwise("cp.async.bulk.wait_group 2;\n\tmov.b32 $0, $1;", "=r,r", [x],
                                      dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
    return _warp_sync_fence(x)


@gluon.jit
def _dq_counter(Sem, b, h, mt, nheads, n_m, n_slots_q, sem_tile0, lane, VARLEN: gl.constexpr):
    """The ordered dQ counter of query tile mt of head h (every lane its address): dense, one per
    (batch, head, query tile); varlen, query tile i of document d at ``h * n_slots_q +
    cu_seqlens_q[d] // BLOCK_M + d + i`` (``sem_tile0`` = the document's first slot)."""
    if VARLEN:
        ptr = Sem + ((h.to(gl.int64) * n_slots_q + sem_tile0 + mt) + lane * 0)
    else:
        ptr = Sem + (((b * nheads + h).to(gl.int64) * n_m + mt) + lane * 0)
    return ptr


@gluon.jit
def _dq_writer(
    dq_desc, dq_smem, dq_full, dq_empty, Sem, n_bhk, nheads_k, group, seqlen_q, seqlen_k,
    Sched, CuSeqQ, CuSeqK, n_slots_q, window_left, window_right,
    BLOCK_M: gl.constexpr, KEYS: gl.constexpr, DQ_N: gl.constexpr, CONSUMERS: gl.constexpr,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, DQ_ORDERED: gl.constexpr, DQ_FRAG: gl.constexpr,
    VARLEN: gl.constexpr, TILES_DOWN: gl.constexpr, KEY_FASTEST: gl.constexpr, POLL_AHEAD: gl.constexpr,
    PARITY: gl.constexpr,
    WRITER: gl.constexpr, n_whole, pieces, TAIL: gl.constexpr,
):  # fmt: skip
    """The dQ writer (one warp): per step, wait for every consumer's dQ tile in slot step % 2,
    add them into the float32 accumulator by TMA reduce and hand the slots back once read.
    PARITY: two writers (WRITER 0 and 1), each taking the steps of its parity (the slots of that
    parity), so each has two steps' time for its chain of turn, reduce, read and release, and
    counts a block in a tile as soon as its additions have completed.
    DQ_ORDERED, dense calls: the block whose turn is 0 stores its tile instead of adding it, so
    the accumulator needs no zero fill (the blocks after it add once it has counted).
    DQ_ORDERED: before adding into query tile (b, h, mt), wait until the semaphore of that tile
    counts the key blocks that add before this one (those below it, from
    :func:`_first_key_block` on), and count this one once the additions have completed, not only
    read their source (a step later: the wait for completion runs under the next step).

    Varlen: the counters are per (head, document, query tile), query tile i of document d at
    ``h * n_slots_q + cu_seqlens_q[d] // BLOCK_M + d + i`` (n_slots_q = Tq // BLOCK_M + batch: the
    documents' tiles never share a slot); the key-block index counts within the document.
    TAIL: a piece walks its steps only (:func:`_piece_steps`)."""
    unit, piece = _unit(n_whole, pieces, TAIL)
    b, kv_h, doc, n0, n_m, m_lo, m_hi, m_full, m_full_hi, q_off, k_off, q_len, k_len = _steps(
        unit, n_bhk, nheads_k, group, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
        window_right, KEYS, BLOCK_M, MASK_LEFT, MASK_RIGHT, VARLEN, KEY_FASTEST,
    )  # fmt: skip
    # dense ordered additions: the first turn stores (no zero fill; dq_accum_for); packed calls
    # add into a zeroed accumulator, whose rows outside every sequence must read 0
    STORE_FIRST: gl.constexpr = DQ_ORDERED and not VARLEN
    sem_tile0 = 0
    if VARLEN:
        gl.static_assert(not DQ_FRAG, "packed calls: the (H, Tq, D) accumulator, not fragment order")
        sem_tile0 = (q_off // BLOCK_M + doc).to(gl.int64)
    lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    sem_prev = Sem + (lane * 0).to(gl.int64)  # the previous step's counter (DQ_ORDERED)
    kt = n0 // KEYS
    nheads = nheads_k * group
    per_head = m_hi - m_lo
    lo, hi = _piece_steps(piece, pieces, group * per_head, TAIL)
    # POLL_AHEAD: the value of this step's counter, read during the previous step (the first
    # step reads it where it starts; no turn is -1)
    ahead = lane * 0 - 1
    FIRST: gl.constexpr = WRITER if PARITY else 0
    STRIDE: gl.constexpr = 2 if PARITY else 1
    for j in range(FIRST, hi - lo, STRIDE):
        it = lo + j  # the unit's step; j counts this program's (its barriers start at phase 0)
        h, mt = _step_tile(it, kv_h, group, m_hi, m_lo, TILES_DOWN)
        par = j % 2
        if DQ_ORDERED:
            # one int32 counter per (b, h, query tile), every lane reading it; this block's turn
            # is its key-block index counted from the tile's first block: every block between
            # that one and this one sees the tile too (the rows that see a key of this block see
            # one of each block down to the window's left edge). The counter only grows and
            # reaches the turn only once every block below has counted, so a value read early
            # that equals the turn holds
            turn = kt - _first_key_block(mt, k_len - q_len, window_left, KEYS, BLOCK_M, MASK_LEFT)
            sem = _dq_counter(Sem, b, h, mt, nheads, n_m, n_slots_q, sem_tile0, lane, VARLEN)
            if POLL_AHEAD:
                seen = gl.max(ahead, axis=0)
            else:
                seen = turn - 1
            while seen != turn:
                seen = gl.max(_load_acquire(sem), axis=0)
            lane = _warp_sync_fence(lane)
        for c in gl.static_range(CONSUMERS):
            slot = par * CONSUMERS + c
            mbarrier.wait(dq_full.index(slot), (j // 2) & 1)
            if DQ_FRAG:
                # flat accumulator: tile ((b * H + h) * n_m + mt) * CONSUMERS + c, 16 box rows each
                tile = ((b * nheads + h) * n_m + mt) * CONSUMERS + c
                if STORE_FIRST:
                    if turn == 0:
                        tma.async_copy_shared_to_global(dq_desc, [tile * 16, 0], dq_smem.index(slot))
                    else:
                        _tma_reduce_add(dq_desc, [tile * 16, 0], dq_smem.index(slot))
                else:
                    _tma_reduce_add(dq_desc, [tile * 16, 0], dq_smem.index(slot))
            else:
                src = dq_smem.index(slot).reshape([1, 1, BLOCK_M, DQ_N])
                if STORE_FIRST:
                    if turn == 0:
                        tma.async_copy_shared_to_global(dq_desc, [b, h, q_off + mt * BLOCK_M, c * DQ_N], src)
                    else:
                        _tma_reduce_add(dq_desc, [b, h, q_off + mt * BLOCK_M, c * DQ_N], src)
                else:
                    _tma_reduce_add(dq_desc, [b, h, q_off + mt * BLOCK_M, c * DQ_N], src)
        if DQ_ORDERED:
            if POLL_AHEAD:
                if j + STRIDE < hi - lo:
                    h_next, mt_next = _step_tile(it + STRIDE, kv_h, group, m_hi, m_lo, TILES_DOWN)
                    ahead = _load_acquire(
                        _dq_counter(Sem, b, h_next, mt_next, nheads, n_m, n_slots_q, sem_tile0, lane, VARLEN)
                    )  # fmt: skip
        tma.store_wait(0)  # the slots have been read: the consumers may refill them
        for c in gl.static_range(CONSUMERS):
            mbarrier.arrive(dq_empty.index(par * CONSUMERS + c))
        if DQ_ORDERED:
            if PARITY:
                # the other writer takes the next step: count this block in this step's tile now
                lane = _release_add_one(sem, _bulk_wait(lane, 0))
            else:
                # count this block in the previous step's tile once those additions have
                # completed (all but this step's CONSUMERS bulk groups, one per tile), so their
                # latency runs under this step
                if j > 0:
                    lane = _release_add_one(sem_prev, _bulk_wait(lane, CONSUMERS))
                sem_prev = sem
    if DQ_ORDERED and not PARITY:
        if hi > lo:
            lane = _release_add_one(sem_prev, _bulk_wait(lane, 0))


@gluon.jit
def _attn_bwd_dkdv_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, stats_desc, Lse, Delta, Sem, Sched, CuSeqQ, CuSeqK,
    DK, DV, Part, PartMap,
    stride_lb, stride_lh, stride_lm, n_bhk, nheads_k, group, seqlen_q, seqlen_k,
    stride_dkm, stride_dkh, stride_dvm, stride_dvh, n_slots_q, window_left, window_right, n_whole, pieces,
    qk_scale, sm_scale, softcap_in, softcap_out,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, CONSUMER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr,
    DQ_ATOMIC: gl.constexpr, DQ_SHARED: gl.constexpr,
    DQ_LAG: gl.constexpr, DQ_WRITER: gl.constexpr, DQ_ORDERED: gl.constexpr, DQ_FRAG: gl.constexpr,
    VARLEN: gl.constexpr, TILES_DOWN: gl.constexpr, KEY_FASTEST: gl.constexpr, POLL_AHEAD: gl.constexpr,
    DQ_PARITY: gl.constexpr,
    SOFTCAP: gl.constexpr, STATS_SMEM: gl.constexpr, EXP_PER_BRANCH: gl.constexpr, LEAD_BOUND: gl.constexpr,
    STATS_EARLY: gl.constexpr, DEFER_ARRIVE: gl.constexpr, DQ_EARLY: gl.constexpr, TAIL: gl.constexpr,
):  # fmt: skip
    gl.static_assert(not SOFTCAP, "the softcap is the split-D form's only (supports())")
    dtype: gl.constexpr = q_desc.dtype
    if not RIGHT_WINDOW:
        window_right = 0  # no right window or causal: a literal, as in the builds without windows
    if not MASK_LEFT:
        window_left = 0
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_N, HEAD_DIM], kv_layout)
    if STATS_SMEM:
        gl.static_assert(not VARLEN, "lse/delta through shared memory: dense calls only")
        # one [lse, delta] row pair per slot of the Q/dO ring (1 KB at 2 stages)
        stats_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 2, BLOCK_M], stats_desc.layout)
    else:
        stats_smem = q_smem  # unused
    if DQ_ATOMIC:
        DQ_N: gl.constexpr = HEAD_DIM // CONSUMERS if DQ_SHARED else HEAD_DIM
        DS_BUFS: gl.constexpr = 2 * CONSUMERS if DQ_SHARED else CONSUMERS
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_N], gl.float32)
        ds_smem = gl.allocate_shared_memory(dtype, [DS_BUFS, BLOCK_N, BLOCK_M], ds_layout)
        # DQ_WRITER: two slots per consumer (by step parity), so a consumer hands over step j
        # while the writer still adds step j - 1
        DQ_BUFS: gl.constexpr = 2 * CONSUMERS if DQ_WRITER else CONSUMERS
        if DQ_FRAG:
            gl.static_assert(DQ_WRITER, "fragment-order dQ goes through the writer partition")
            gl.static_assert(BLOCK_M * DQ_N == 16 * 256, "one 16 x 256 box per dQ tile")
            frag_box: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
            dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, 16, 256], frag_box)
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, BLOCK_M, DQ_N], dq_layout)
    else:
        ds_smem = k_smem  # unused
        dq_smem = k_smem
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2 * CONSUMERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2 * CONSUMERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        # every consumer partition hands each slot back once per use
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
        mbarrier.init(do_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        # DQ_SHARED: every consumer arrives once per step on each
        mbarrier.init(ds_ready.index(i), count=CONSUMERS)
        mbarrier.init(ds_free.index(i), count=CONSUMERS)
    for i in gl.static_range(2 * CONSUMERS):
        # DQ_WRITER: slot (parity, consumer): that consumer fills it, the writer empties it
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)

    gl.static_assert(CONSUMERS == 2, "two consumer partitions")
    gl.static_assert(DQ_WRITER or not DQ_PARITY, "two dQ writers need the writer form")
    gl.static_assert(DQ_ORDERED or LEAD_BOUND == 0, "the lead bound reads the ordered dQ counters")
    gl.static_assert(not (TAIL and VARLEN), "tail pieces: dense calls only")
    # (Gluon takes the partitions as a literal list: the forms differ by the dQ writers)
    if DQ_PARITY:
        gl.warp_specialize(
            [
                (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, stats_smem, kv_bar, q_ready,
                             do_ready, q_empty, do_empty, ds_ready, ds_free, dq_full, dq_empty, dk_desc, dv_desc,
                             dq_desc, Lse, Delta,
                             stride_lb, stride_lh, stride_lm,
                             n_bhk, nheads_k, group, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
                             sm_scale, Sched, CuSeqQ, CuSeqK, DK, DV, stride_dkm, stride_dkh, stride_dvm,
                             stride_dvh, 0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS, CONSUMER_WARPS,
                             MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, DQ_ATOMIC, DQ_SHARED, DQ_LAG, DQ_WRITER,
                             DQ_FRAG, VARLEN, TILES_DOWN, KEY_FASTEST, STATS_SMEM, EXP_PER_BRANCH, STATS_EARLY,
                             DEFER_ARRIVE, DQ_EARLY, n_whole, pieces, Part, PartMap, TAIL)),
                (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, stats_smem, kv_bar, q_ready,
                             do_ready, q_empty, do_empty, ds_ready, ds_free, dq_full, dq_empty, dk_desc, dv_desc,
                             dq_desc, Lse, Delta,
                             stride_lb, stride_lh, stride_lm,
                             n_bhk, nheads_k, group, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
                             sm_scale, Sched, CuSeqQ, CuSeqK, DK, DV, stride_dkm, stride_dkh, stride_dvm,
                             stride_dvh, 1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS, CONSUMER_WARPS,
                             MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, DQ_ATOMIC, DQ_SHARED, DQ_LAG, DQ_WRITER,
                             DQ_FRAG, VARLEN, TILES_DOWN, KEY_FASTEST, STATS_SMEM, EXP_PER_BRANCH, STATS_EARLY,
                             DEFER_ARRIVE, DQ_EARLY, n_whole, pieces, Part, PartMap, TAIL)),
                (_producer, (q_desc, k_desc, v_desc, do_desc, stats_desc, q_smem, do_smem, k_smem, v_smem,
                             stats_smem, kv_bar, q_ready, do_ready, q_empty, do_empty,
                             n_bhk, nheads_k, group, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
                             window_right, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS, MASK_LEFT, MASK_RIGHT,
                             VARLEN, TILES_DOWN, KEY_FASTEST, STATS_SMEM, Sem, LEAD_BOUND, n_whole, pieces,
                             PartMap, TAIL)),
                (_dq_writer, (dq_desc, dq_smem, dq_full, dq_empty, Sem, n_bhk, nheads_k, group, seqlen_q,
                               seqlen_k, Sched, CuSeqQ, CuSeqK, n_slots_q, window_left, window_right, BLOCK_M,
                               BLOCK_N * CONSUMERS, HEAD_DIM // CONSUMERS, CONSUMERS, MASK_LEFT, MASK_RIGHT,
                               DQ_ORDERED, DQ_FRAG, VARLEN, TILES_DOWN, KEY_FASTEST, POLL_AHEAD, DQ_PARITY, 0,
                               n_whole, pieces, TAIL)),
                # the second writer: the odd steps
                (_dq_writer, (dq_desc, dq_smem, dq_full, dq_empty, Sem, n_bhk, nheads_k, group, seqlen_q,
                               seqlen_k, Sched, CuSeqQ, CuSeqK, n_slots_q, window_left, window_right, BLOCK_M,
                               BLOCK_N * CONSUMERS, HEAD_DIM // CONSUMERS, CONSUMERS, MASK_LEFT, MASK_RIGHT,
                               DQ_ORDERED, DQ_FRAG, VARLEN, TILES_DOWN, KEY_FASTEST, POLL_AHEAD, DQ_PARITY, 1,
                               n_whole, pieces, TAIL)),
            ],
            [CONSUMER_WARPS, 1, 1, 1],
            [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    elif DQ_WRITER:
        gl.warp_specialize(
            [
                (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, stats_smem, kv_bar, q_ready,
                             do_ready, q_empty, do_empty, ds_ready, ds_free, dq_full, dq_empty, dk_desc, dv_desc,
                             dq_desc, Lse, Delta,
                             stride_lb, stride_lh, stride_lm,
                             n_bhk, nheads_k, group, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
                             sm_scale, Sched, CuSeqQ, CuSeqK, DK, DV, stride_dkm, stride_dkh, stride_dvm,
                             stride_dvh, 0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS, CONSUMER_WARPS,
                             MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, DQ_ATOMIC, DQ_SHARED, DQ_LAG, DQ_WRITER,
                             DQ_FRAG, VARLEN, TILES_DOWN, KEY_FASTEST, STATS_SMEM, EXP_PER_BRANCH, STATS_EARLY,
                             DEFER_ARRIVE, DQ_EARLY, n_whole, pieces, Part, PartMap, TAIL)),
                (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, stats_smem, kv_bar, q_ready,
                             do_ready, q_empty, do_empty, ds_ready, ds_free, dq_full, dq_empty, dk_desc, dv_desc,
                             dq_desc, Lse, Delta,
                             stride_lb, stride_lh, stride_lm,
                             n_bhk, nheads_k, group, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
                             sm_scale, Sched, CuSeqQ, CuSeqK, DK, DV, stride_dkm, stride_dkh, stride_dvm,
                             stride_dvh, 1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS, CONSUMER_WARPS,
                             MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, DQ_ATOMIC, DQ_SHARED, DQ_LAG, DQ_WRITER,
                             DQ_FRAG, VARLEN, TILES_DOWN, KEY_FASTEST, STATS_SMEM, EXP_PER_BRANCH, STATS_EARLY,
                             DEFER_ARRIVE, DQ_EARLY, n_whole, pieces, Part, PartMap, TAIL)),
                (_producer, (q_desc, k_desc, v_desc, do_desc, stats_desc, q_smem, do_smem, k_smem, v_smem,
                             stats_smem, kv_bar, q_ready, do_ready, q_empty, do_empty,
                             n_bhk, nheads_k, group, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
                             window_right, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS, MASK_LEFT, MASK_RIGHT,
                             VARLEN, TILES_DOWN, KEY_FASTEST, STATS_SMEM, Sem, LEAD_BOUND, n_whole, pieces,
                             PartMap, TAIL)),
                (_dq_writer, (dq_desc, dq_smem, dq_full, dq_empty, Sem, n_bhk, nheads_k, group, seqlen_q,
                               seqlen_k, Sched, CuSeqQ, CuSeqK, n_slots_q, window_left, window_right, BLOCK_M,
                               BLOCK_N * CONSUMERS, HEAD_DIM // CONSUMERS, CONSUMERS, MASK_LEFT, MASK_RIGHT,
                               DQ_ORDERED, DQ_FRAG, VARLEN, TILES_DOWN, KEY_FASTEST, POLL_AHEAD, DQ_PARITY, 0,
                               n_whole, pieces, TAIL)),
            ],
            [CONSUMER_WARPS, 1, 1],
            [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, stats_smem, kv_bar, q_ready,
                             do_ready, q_empty, do_empty, ds_ready, ds_free, dq_full, dq_empty, dk_desc, dv_desc,
                             dq_desc, Lse, Delta,
                             stride_lb, stride_lh, stride_lm,
                             n_bhk, nheads_k, group, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
                             sm_scale, Sched, CuSeqQ, CuSeqK, DK, DV, stride_dkm, stride_dkh, stride_dvm,
                             stride_dvh, 0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS, CONSUMER_WARPS,
                             MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, DQ_ATOMIC, DQ_SHARED, DQ_LAG, DQ_WRITER,
                             DQ_FRAG, VARLEN, TILES_DOWN, KEY_FASTEST, STATS_SMEM, EXP_PER_BRANCH, STATS_EARLY,
                             DEFER_ARRIVE, DQ_EARLY, n_whole, pieces, Part, PartMap, TAIL)),
                (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, stats_smem, kv_bar, q_ready,
                             do_ready, q_empty, do_empty, ds_ready, ds_free, dq_full, dq_empty, dk_desc, dv_desc,
                             dq_desc, Lse, Delta,
                             stride_lb, stride_lh, stride_lm,
                             n_bhk, nheads_k, group, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
                             sm_scale, Sched, CuSeqQ, CuSeqK, DK, DV, stride_dkm, stride_dkh, stride_dvm,
                             stride_dvh, 1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS, CONSUMER_WARPS,
                             MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, DQ_ATOMIC, DQ_SHARED, DQ_LAG, DQ_WRITER,
                             DQ_FRAG, VARLEN, TILES_DOWN, KEY_FASTEST, STATS_SMEM, EXP_PER_BRANCH, STATS_EARLY,
                             DEFER_ARRIVE, DQ_EARLY, n_whole, pieces, Part, PartMap, TAIL)),
                (_producer, (q_desc, k_desc, v_desc, do_desc, stats_desc, q_smem, do_smem, k_smem, v_smem,
                             stats_smem, kv_bar, q_ready, do_ready, q_empty, do_empty,
                             n_bhk, nheads_k, group, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
                             window_right, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CONSUMERS, MASK_LEFT, MASK_RIGHT,
                             VARLEN, TILES_DOWN, KEY_FASTEST, STATS_SMEM, Sem, LEAD_BOUND, n_whole, pieces,
                             PartMap, TAIL)),
            ],
            [CONSUMER_WARPS, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


@gluon.jit
def _split_d_consumer(
    q_smem, do_smem, k_smem, v_smem, pt_smem, dst_smem, dq_smem, kv_bar, q_ready, do_ready, q_empty, do_empty,
    ds_ready, ds_free, dk_desc, dv_desc, dq_desc, Lse, Delta, stride_lb, stride_lh, stride_lm,
    n_bhk, nheads_k, group, seqlen_q, seqlen_k, window_left, window_right, qk_scale, sm_scale, softcap_in,
    softcap_out, Sched, CuSeqQ, CuSeqK, DK, DV, stride_dkm, stride_dkh, stride_dvm, stride_dvh,
    INDEX: gl.constexpr, BLOCK_M: gl.constexpr, KEYS: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
    RIGHT_WINDOW: gl.constexpr, VARLEN: gl.constexpr, SOFTCAP: gl.constexpr, DQ_ATOMIC: gl.constexpr,
):  # fmt: skip
    """One consumer of the split-D backward (``Variant.split_d``): per step (a 64-row query tile
    of one head), S = Q K_c^T and dP = dO V_c^T for its half of the program's keys (queries along
    M, so lse and delta are per row), P and dS, their transposes into rows [c, c + 1) * KEYS / 2
    of the step's shared P^T / dS^T tiles; once both consumers' halves are there, dV[:, cols_c]
    += P^T dO[:, cols_c] and dK[:, cols_c] += dS^T Q[:, cols_c] over all KEYS keys. Masks as
    :func:`_consumer`'s, in the [queries, keys] frame. SOFTCAP: the scores are ``softcap_out *
    tanh(s * softcap_in)`` (as the forward's) and dS takes the factor ``1 - tanh^2``; the tanh
    tile (16 registers per thread) stays live over the dP product. DQ_ATOMIC: dQ[:, cols_c] = dS
    K[:, cols_c] over all KEYS keys (dS read transposed from the shared dS^T tile), added into the
    float32 accumulator by TMA reduce in whatever order the programs reach it."""
    dtype: gl.constexpr = dk_desc.dtype
    HALF_N: gl.constexpr = KEYS // 2
    HALF_D: gl.constexpr = HEAD_DIM // 2
    s_layout: gl.constexpr = _mma_layout(HALF_N, NUM_WARPS)  # [BLOCK_M queries, HALF_N keys]
    acc_layout: gl.constexpr = _mma_layout(HALF_D, NUM_WARPS)  # [KEYS keys, HALF_D columns]
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # along the queries
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # along the keys
    b, kv_h, doc, n0, n_m, m_lo, m_hi, m_full, m_full_hi, q_off, k_off, q_len, k_len = _steps(
        gl.program_id(0), n_bhk, nheads_k, group, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
        window_right, KEYS, BLOCK_M, MASK_LEFT, MASK_RIGHT, VARLEN, False,
    )  # fmt: skip
    k_half = k_smem.index(0).slice(INDEX * HALF_N, HALF_N, dim=0)  # [HALF_N keys, HEAD_DIM]
    v_half = v_smem.index(0).slice(INDEX * HALF_N, HALF_N, dim=0)
    key_pos = n0 + INDEX * HALF_N + gl.arange(0, HALF_N, layout=col_layout)
    keys = key_pos - (k_len - q_len)  # in the query frame: key j is visible to row i iff j - shift <= i
    # this consumer's keys cross the sequence's (varlen: the document's) end
    key_tail = n0 + (INDEX + 1) * HALF_N > k_len
    m_unmasked_lo, m_unmasked_hi, m_mask, m_tail = _masked_tiles(
        m_full, m_full_hi, n_m, q_len, key_tail, BLOCK_M, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, VARLEN
    )
    s_zero = gl.zeros([BLOCK_M, HALF_N], gl.float32, layout=s_layout)
    if DQ_ATOMIC:
        dq_zero = gl.zeros([BLOCK_M, HALF_D], gl.float32, layout=_mma_layout(HALF_D, NUM_WARPS))
    dk = gl.zeros([KEYS, HALF_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([KEYS, HALF_D], gl.float32, layout=acc_layout)
    if not VARLEN:
        b64 = b.to(gl.int64)

    mbarrier.wait(kv_bar, 0)
    per_head = m_hi - m_lo
    for it in range(group * per_head):
        h, mt = _step_tile(it, kv_h, group, m_hi, m_lo, False)
        rows = mt * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
        slot = it % STAGES
        phase = (it // STAGES) & 1
        if VARLEN:
            l_base = h.to(gl.int64) * stride_lh + q_off  # lse/delta (H, Tq)
        else:
            l_base = b64 * stride_lb + h.to(gl.int64) * stride_lh
        # rows past the end read lse = +inf, so their P (and dS) is 0
        lse2 = gl.load(Lse + l_base + rows, mask=rows < q_len, other=float("inf")) * LOG2E_C
        q_tile = q_smem.index(slot)
        do_tile = do_smem.index(slot)
        mbarrier.wait(q_ready.index(slot), phase)
        s = warpgroup_mma(q_tile, k_half.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        dp = warpgroup_mma(do_tile, v_half.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        if SOFTCAP:
            t = _tanh(s * softcap_in)
            s2 = t * softcap_out
        else:
            s2 = s * qk_scale
        if MASK_LEFT or RIGHT_WINDOW:
            if (mt < m_unmasked_lo) | (mt >= m_unmasked_hi):
                # keys past the end (keys >= q_len) and, varlen, the next document's rows (P = 0,
                # so they add exactly 0 to dK and dV)
                vis = gl.expand_dims(keys < q_len, 0)
                if MASK_RIGHT:
                    vis = vis & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows + window_right, 1))
                if MASK_LEFT:
                    vis = vis & (gl.expand_dims(keys, 0) >= gl.expand_dims(rows - window_left, 1))
                if VARLEN:
                    vis = vis & gl.expand_dims(rows < q_len, 1)
                s2 = gl.where(vis, s2, float("-inf"))
        elif VARLEN:
            if (mt < m_mask) | (mt >= m_tail):
                if MASK_RIGHT:  # keys <= rows < q_len covers the keys past the document's end
                    vis = (gl.expand_dims(keys, 0) <= gl.expand_dims(rows, 1)) & gl.expand_dims(rows < q_len, 1)
                else:
                    vis = gl.expand_dims(keys < q_len, 0) & gl.expand_dims(rows < q_len, 1)
                s2 = gl.where(vis, s2, float("-inf"))
        elif MASK_RIGHT:  # causal
            if (mt < m_full) | key_tail:
                vis = (gl.expand_dims(keys, 0) <= gl.expand_dims(rows, 1)) & gl.expand_dims(key_pos < k_len, 0)
                s2 = gl.where(vis, s2, float("-inf"))
        else:
            if key_tail:
                s2 = gl.where(gl.expand_dims(key_pos < k_len, 0), s2, float("-inf"))
        p = gl.exp2(s2 - gl.expand_dims(lse2, 1))
        delta = gl.load(Delta + l_base + rows, mask=rows < q_len, other=0.0)
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds = p * (dp - gl.expand_dims(delta, 1))
        if SOFTCAP:
            ds = ds * (1.0 - t * t)  # d(cap * tanh(x / cap)) / dx
        # the step's P^T / dS^T tiles (double-buffered by step parity): both consumers' products
        # of step it - 2 have read this buffer
        par = it % 2
        dph = (it // 2) & 1
        mbarrier.wait(ds_free.index(par), dph ^ 1)
        pt_smem.index(par).slice(INDEX * HALF_N, HALF_N, dim=0).store(gl.permute(p.to(dtype), (1, 0)))
        dst_smem.index(par).slice(INDEX * HALF_N, HALF_N, dim=0).store(gl.permute(ds.to(dtype), (1, 0)))
        _hand_on(ds_ready.index(par))
        mbarrier.wait(ds_ready.index(par), dph)  # the other consumer's half is in too
        dv_tok = warpgroup_mma(pt_smem.index(par), do_tile.slice(INDEX * HALF_D, HALF_D, dim=1), dv, is_async=True)
        dk_tok = warpgroup_mma(dst_smem.index(par), q_tile.slice(INDEX * HALF_D, HALF_D, dim=1), dk, is_async=True)
        if DQ_ATOMIC:
            k_cols = k_smem.index(0).slice(INDEX * HALF_D, HALF_D, dim=1)  # [KEYS, HALF_D]
            dq_tok = warpgroup_mma(dst_smem.index(par).permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)
            dv = warpgroup_mma_wait(2, deps=(dv_tok,))
            mbarrier.arrive(do_empty.index(slot))
            dk = warpgroup_mma_wait(1, deps=(dk_tok,))
            mbarrier.arrive(q_empty.index(slot))
            dq = warpgroup_mma_wait(0, deps=(dq_tok,))
            mbarrier.arrive(ds_free.index(par))
            _dq_out(it, dq * sm_scale, b, h, q_off + mt * BLOCK_M, dq_smem, None, None, dq_desc, INDEX, 2, BLOCK_M,
                    HALF_D, False, False)  # fmt: skip
        else:
            dv = warpgroup_mma_wait(1, deps=(dv_tok,))
            mbarrier.arrive(do_empty.index(slot))
            dk = warpgroup_mma_wait(0, deps=(dk_tok,))
            mbarrier.arrive(q_empty.index(slot))
            mbarrier.arrive(ds_free.index(par))

    if DQ_ATOMIC:
        tma.store_wait(0)  # the last dQ reduce has read its staging tile
    # Q and dO tiles INDEX stage this consumer's dK and dV columns (KEYS x HALF_D each); every tile
    # of the rings is free once both consumers' last products are done (no more loads come)
    gl.static_assert(STAGES >= 2 and KEYS * HALF_D <= BLOCK_M * HEAD_DIM, "dK/dV staged in Q/dO tiles")
    n_steps = group * per_head
    if n_steps > 0:
        mbarrier.wait(ds_free.index((n_steps - 1) % 2), ((n_steps - 1) // 2) & 1)
    out_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, HALF_D], dtype)
    dk_stage = q_smem.index(INDEX)._reinterpret(dtype, [KEYS, HALF_D], out_layout)
    dv_stage = do_smem.index(INDEX)._reinterpret(dtype, [KEYS, HALF_D], out_layout)
    dk_stage.store((dk * sm_scale).to(dtype))  # dS is taken w.r.t. the scaled scores
    dv_stage.store(dv.to(dtype))
    if VARLEN:
        if n0 + KEYS > k_len:
            # the key tile crosses the document's end (or is an empty item): a TMA store would
            # overwrite the next document's dK/dV, so the rows inside are stored element-wise,
            # read back from the staging tiles with 8 consecutive elements per thread (16-byte
            # stores)
            st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HALF_D, HALF_D // 8], [NUM_WARPS, 1],
                                                       [1, 0])  # fmt: skip
            offs_n = n0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout))
            offs_d = INDEX * HALF_D + gl.expand_dims(gl.arange(0, HALF_D, layout=gl.SliceLayout(0, st_layout)), 0)
            key_rows = gl.expand_dims((k_off + offs_n).to(gl.int64), 1)
            inside = gl.expand_dims(offs_n < k_len, 1)
            kv_h64 = kv_h.to(gl.int64)
            gl.store(DK + kv_h64 * stride_dkh + key_rows * stride_dkm + offs_d, dk_stage.load(st_layout),
                     mask=inside)  # fmt: skip
            gl.store(DV + kv_h64 * stride_dvh + key_rows * stride_dvm + offs_d, dv_stage.load(st_layout),
                     mask=inside)  # fmt: skip
        else:
            _split_d_store(dk_stage, dv_stage, dk_desc, dv_desc, b, kv_h, k_off + n0, INDEX * HALF_D, KEYS, HALF_D)
    else:
        _split_d_store(dk_stage, dv_stage, dk_desc, dv_desc, b, kv_h, n0, INDEX * HALF_D, KEYS, HALF_D)


@gluon.jit
def _split_d_store(dk_stage, dv_stage, dk_desc, dv_desc, b, kv_h, row, col, KEYS: gl.constexpr,
                   HALF_D: gl.constexpr):  # fmt: skip
    """TMA stores of a split-D consumer's staged dK and dV columns [col, col + HALF_D) of keys
    [row, row + KEYS) (clipped at the tensor's end)."""
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, kv_h, row, col], dk_stage.reshape([1, 1, KEYS, HALF_D]))
    tma.async_copy_shared_to_global(dv_desc, [b, kv_h, row, col], dv_stage.reshape([1, 1, KEYS, HALF_D]))
    tma.store_wait(0)


@gluon.jit
def _attn_bwd_split_d_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, stats_desc, Lse, Delta, Sem, Sched, CuSeqQ, CuSeqK,
    DK, DV, Part, PartMap,
    stride_lb, stride_lh, stride_lm, n_bhk, nheads_k, group, seqlen_q, seqlen_k,
    stride_dkm, stride_dkh, stride_dvm, stride_dvh, n_slots_q, window_left, window_right, n_whole, pieces,
    qk_scale, sm_scale, softcap_in, softcap_out,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, CONSUMER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, RIGHT_WINDOW: gl.constexpr,
    DQ_ATOMIC: gl.constexpr, DQ_SHARED: gl.constexpr,
    DQ_LAG: gl.constexpr, DQ_WRITER: gl.constexpr, DQ_ORDERED: gl.constexpr, DQ_FRAG: gl.constexpr,
    VARLEN: gl.constexpr, TILES_DOWN: gl.constexpr, KEY_FASTEST: gl.constexpr, POLL_AHEAD: gl.constexpr,
    DQ_PARITY: gl.constexpr,
    SOFTCAP: gl.constexpr, STATS_SMEM: gl.constexpr, EXP_PER_BRANCH: gl.constexpr, LEAD_BOUND: gl.constexpr,
    STATS_EARLY: gl.constexpr, DEFER_ARRIVE: gl.constexpr, DQ_EARLY: gl.constexpr, TAIL: gl.constexpr,
):  # fmt: skip
    """The split-D dK/dV kernel (``Variant.split_d``): the arguments of :func:`_attn_bwd_dkdv_kernel`
    (one launch_args serves both); dense or packed, causal or not, windows, softcap; dQ only with
    DQ_ATOMIC (unordered reduce-adds). A program owns BLOCK_N keys; dk_desc / dv_desc (and
    dq_desc) have HEAD_DIM / 2-column boxes (each consumer stores its columns)."""
    gl.static_assert(CONSUMERS == 2, "two consumer partitions")
    gl.static_assert(not (DQ_LAG or DQ_WRITER or DQ_ORDERED or DQ_FRAG), "dQ, if any, by unordered TMA reduces")
    gl.static_assert(not STATS_SMEM, "the split-D consumers read lse/delta per row from global memory")
    gl.static_assert(not EXP_PER_BRANCH, "exp_per_branch is a transposed-frame (non-split-D) form")
    gl.static_assert(not TAIL, "tail pieces: the transposed-frame form only")
    gl.static_assert(LEAD_BOUND == 0, "lead_bound: the transposed-frame ordered forms only")
    gl.static_assert(not STATS_EARLY, "stats_early: a stats_smem form")
    gl.static_assert(DEFER_ARRIVE == 0, "defer_ds / defer_dq: the dq_lag writer forms")
    gl.static_assert(not DQ_EARLY, "dq_early: the dq_lag writer forms")
    if not RIGHT_WINDOW:
        window_right = 0  # no right window or causal: a literal, as in the builds without windows
    if not MASK_LEFT:
        window_left = 0
    dtype: gl.constexpr = q_desc.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], kv_layout)
    pt_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], pt_layout)
    dst_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], pt_layout)
    if DQ_ATOMIC:  # each consumer's float32 dQ columns, staged for the reduce
        dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM // 2], gl.float32)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2], dq_layout)
    else:
        dq_smem = pt_smem  # not read
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
        mbarrier.init(do_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=CONSUMERS)
        mbarrier.init(ds_free.index(i), count=CONSUMERS)
    gl.warp_specialize(
        [
            (_split_d_consumer, (q_smem, do_smem, k_smem, v_smem, pt_smem, dst_smem, dq_smem, kv_bar, q_ready,
                                 do_ready, q_empty, do_empty, ds_ready, ds_free, dk_desc, dv_desc, dq_desc, Lse,
                                 Delta, stride_lb,
                                 stride_lh, stride_lm, n_bhk, nheads_k, group, seqlen_q, seqlen_k, window_left,
                                 window_right, qk_scale, sm_scale, softcap_in, softcap_out, Sched, CuSeqQ, CuSeqK,
                                 DK, DV, stride_dkm, stride_dkh, stride_dvm, stride_dvh, 0, BLOCK_M, BLOCK_N,
                                 HEAD_DIM, STAGES, CONSUMER_WARPS, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, VARLEN,
                                 SOFTCAP, DQ_ATOMIC)),
            (_split_d_consumer, (q_smem, do_smem, k_smem, v_smem, pt_smem, dst_smem, dq_smem, kv_bar, q_ready,
                                 do_ready, q_empty, do_empty, ds_ready, ds_free, dk_desc, dv_desc, dq_desc, Lse,
                                 Delta, stride_lb,
                                 stride_lh, stride_lm, n_bhk, nheads_k, group, seqlen_q, seqlen_k, window_left,
                                 window_right, qk_scale, sm_scale, softcap_in, softcap_out, Sched, CuSeqQ, CuSeqK,
                                 DK, DV, stride_dkm, stride_dkh, stride_dvm, stride_dvh, 1, BLOCK_M, BLOCK_N,
                                 HEAD_DIM, STAGES, CONSUMER_WARPS, MASK_LEFT, MASK_RIGHT, RIGHT_WINDOW, VARLEN,
                                 SOFTCAP, DQ_ATOMIC)),
            # the producer loads the program's one K/V tile of BLOCK_N keys (CONSUMERS=1 there)
            (_producer, (q_desc, k_desc, v_desc, do_desc, stats_desc, q_smem, do_smem, k_smem, v_smem, q_smem,
                         kv_bar, q_ready, do_ready, q_empty, do_empty,
                         n_bhk, nheads_k, group, seqlen_q, seqlen_k, Sched, CuSeqQ, CuSeqK, window_left,
                         window_right, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, 1, MASK_LEFT, MASK_RIGHT,
                         VARLEN, TILES_DOWN, KEY_FASTEST, False, Sem, 0, n_whole, pieces, PartMap,
                         False)),
        ],
        [CONSUMER_WARPS, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


def supports(q, k, v, out, dout, dk, dv, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
             dropout=0.0, varlen=False, softmax_scale=None) -> bool:  # fmt: skip
    """True when :func:`hopper_attention_backward` covers this call: the calls the Gluon
    forward covers (:func:`hopper.attention_fwd.supports`: dense or packed (``varlen``: q (Tq, H,
    D), k/v (Tk, Hk, D)) fp16/bf16, causal or not, any sliding window, no ALiBi or dropout, on
    sm_90) for which ``DEFAULT`` (packed: ``VARLEN_DEFAULT``) names a variant (d64 dense, d128,
    d256), with out, dout, dk and dv shaped like q / k and addressable by TMA too. Soft-capped
    calls only where that variant is a split-D one (d256): at d128 the tanh derivative, kept
    over the dP product or recovered from P, spills 230-830 bytes per thread (causal), so the
    Triton dK/dV kernel runs them, beside the Gluon dQ kernel (``flash_bwd.gluon_dq_variant``;
    the d64 ones beside the Triton dQ)."""
    from .attention_fwd import supports as fwd_supports

    if not fwd_supports(q, k, v, causal=causal, window=window, softcap=softcap, alibi=alibi,
                        dropout=dropout, varlen=varlen, softmax_scale=softmax_scale):  # fmt: skip
        return False
    if (q.shape[-1], bool(causal)) not in (VARLEN_DEFAULT if varlen else DEFAULT):
        return False
    if softcap > 0.0 and not VARIANTS[variant_for(q.shape[-1], causal, varlen)].split_d:
        return False
    if not all(isinstance(t, torch.Tensor) for t in (out, dout, dk, dv)):
        return False
    key = (tensors_key(q, k, out, dout, dk, dv), bool(varlen))
    return _COVERED.get(key, lambda: _geometry_covered(q, k, out, dout, dk, dv, varlen))


# supports()' answers for the gradients' geometry (attention_fwd.tensors_key), once per geometry
_COVERED = PlanCache()


def _geometry_covered(q, k, out, dout, dk, dv, varlen: bool) -> bool:
    for t, like in ((out, q), (dout, q), (dk, k), (dv, k)):
        if t.shape != like.shape or t.dtype != like.dtype:
            return False
        if t.device != like.device or not tma_compatible(t):
            return False
    if varlen:
        # programs (K/V heads x schedule entries: key tiles + one per sequence, bounded here by
        # one per token) and the dQ counters (H x (Tq / 64 + sequences)) are counted in int32
        tokens_q, tokens_k = q.shape[0], k.shape[0]
        return (tokens_k + 1) * k.shape[1] < 2**31 and (2 * tokens_q + 1) * q.shape[1] < 2**31
    # programs (key tiles x batch x K/V heads) are counted in int32
    return configs.cdiv(k.shape[1], 64) * k.shape[0] * k.shape[2] < 2**31


def _descriptor_frag(t: torch.Tensor) -> TensorDescriptor:
    """The flat float32 fragment-order dQ accumulator as (tiles * 16, 256), one 16 x 256 box (16 KB,
    1 KB rows, no swizzle) per (batch, head, query tile, consumer) tile."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    box = list(DQ_FRAG_BOX)
    return tma_descriptor(t, [t.numel() // box[1], box[1]], [box[1], 1], box, layout)


def dq_accum_for(q: torch.Tensor, variant: str, device=None) -> torch.Tensor:
    """A float32 dQ accumulator for a ``dq_atomic`` variant: (B, Sq, H, D) over (B, H, Sq, D)
    storage (a query tile of one head is one block), packed q (Tq, H, D): (Tq, H, D) over (H, Tq,
    D); or for ``dq_frag`` the flat fragment-order tiles, B * H * cdiv(Sq, block_m) * consumers of
    block_m * D / consumers floats. Zeroed, except for dense calls of a ``dq_ordered`` variant,
    whose first write of each tile is a store."""
    var = VARIANTS[variant]
    device = q.device if device is None else device
    if var.dq_ordered and q.dim() == 4:
        b, s, h, d = q.shape
        if var.dq_frag:
            return torch.empty(b * h * configs.cdiv(s, var.block_m) * var.block_m * d, device=device,
                               dtype=torch.float32)  # fmt: skip
        return torch.empty(b, h, s, d, device=device, dtype=torch.float32).transpose(1, 2)
    if q.dim() == 3:
        if var.dq_frag:
            raise ValueError(f"variant {variant} has no packed (varlen) form")
        t, h, d = q.shape
        return torch.zeros(h, t, d, device=device, dtype=torch.float32).transpose(0, 1)
    b, s, h, d = q.shape
    if var.dq_frag:
        return torch.zeros(b * h * configs.cdiv(s, var.block_m) * var.block_m * d, device=device, dtype=torch.float32)
    return torch.zeros(b, h, s, d, device=device, dtype=torch.float32).transpose(1, 2)


@triton.jit
def _dq_frag_to_bshd(Acc, DQ, stride_db, stride_ds, stride_dh, stride_dd, seqlen, nheads, n_m,
                     BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, DQ_N: tl.constexpr):  # fmt: skip
    """dQ (B, S, H, D) from the fragment-order accumulator: program = query tile (b * H + h) *
    n_m + mt; column block c = col // DQ_N is consumer c's tile; the offset inverts
    :func:`_dq_frag_layout`."""
    pid = tl.program_id(0)
    mt = pid % n_m
    bh = pid // n_m
    h = bh % nheads
    b = bh // nheads
    r = tl.arange(0, BLOCK_M)[:, None]
    col = tl.arange(0, HEAD_DIM)[None, :]
    cc = col % DQ_N
    off = ((cc & 1) | (((r >> 3) & 1) << 1) | (((cc >> 1) & 3) << 2) | ((r & 7) << 4) | (((r >> 4) & 3) << 7)
           | (((cc >> 3) & 7) << 9))  # fmt: skip
    x = tl.load(Acc + pid.to(tl.int64) * (BLOCK_M * HEAD_DIM) + (col // DQ_N) * (BLOCK_M * DQ_N) + off)
    rows = mt * BLOCK_M + r
    ptrs = (DQ + b.to(tl.int64) * stride_db + rows.to(tl.int64) * stride_ds + h.to(tl.int64) * stride_dh
            + col * stride_dd)  # fmt: skip
    tl.store(ptrs, x.to(DQ.dtype.element_ty), mask=rows < seqlen)


_DQ_FRAG_TO_BSHD = CachedLauncher(_dq_frag_to_bshd)
_DQ_FRAG_META: dict = {}


def dq_frag_to_bshd(dq_accum: torch.Tensor, dq: torch.Tensor, block_m: int = 64, consumers: int = 2) -> None:
    """Write dq (B, S, H, D) from a flat fragment-order accumulator (:func:`dq_accum_for` of a
    ``dq_frag`` variant; already scaled), cast to dq's dtype."""
    b, s, h, d = dq.shape
    n_m = configs.cdiv(s, block_m)
    meta = _DQ_FRAG_META.get((block_m, d, consumers))
    if meta is None:
        meta = _DQ_FRAG_META[(block_m, d, consumers)] = _DQ_FRAG_TO_BSHD.meta(
            BLOCK_M=block_m, HEAD_DIM=d, DQ_N=d // consumers, num_warps=8)
    _DQ_FRAG_TO_BSHD((b * h * n_m,), (dq_accum, dq), (*dq.stride(), s, h, n_m), (), meta)


def dq_sem_count(q: torch.Tensor, variant: str, cu_seqlens_q=None) -> int:
    """How many int32 dQ counters a ``dq_ordered`` variant needs: one per (batch, head, query
    tile), packed calls one per (head, slot) with Tq // block_m + batch slots per head (query tile
    i of sequence d at slot cu_seqlens_q[d] // block_m + d + i)."""
    var = VARIANTS[variant]
    if cu_seqlens_q is not None:
        return q.shape[1] * schedule_slots(q.shape[0], cu_seqlens_q.numel() - 1, var.block_m)
    return q.shape[0] * q.shape[2] * configs.cdiv(q.shape[1], var.block_m)


def sem_from_preprocess(q: torch.Tensor, variant: str, varlen: bool) -> torch.Tensor | None:
    """The ``dq_sem`` counters of a dense call of a ``dq_ordered`` variant whose statistics tiles
    are its query tiles (``stats_rows == block_m``: one counter per statistics tile), unfilled:
    ``flash_bwd.backward_preprocess(..., stats_m=stats_rows, dq_sem=...)`` zeroes them in the
    same launch, which saves the backward a fill launch (~8 us of host time on an H200 host).
    None for other calls (:func:`hopper_attention_backward` then makes zeroed ones)."""
    var = VARIANTS[variant]
    if varlen or not var.dq_ordered or var.stats_rows != var.block_m:
        return None
    return torch.empty(dq_sem_count(q, variant), device=q.device, dtype=torch.int32)


def _descriptor_stats(stats: torch.Tensor, block_m: int) -> TensorDescriptor:
    """The statistics buffer as (tiles * 2, block_m) float32, one [2, block_m] box (no swizzle)
    per (batch, head, query tile)."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return tma_descriptor(stats, [stats.numel() // block_m, block_m], [block_m, 1], [2, block_m], layout)


# Packed calls' program order: "document" (the schedule's: document by document, key blocks in
# order) or "longest" (documents by their q_len * k_len, most first; key blocks still in order
# within each, as the ordered dQ needs)
VARLEN_ORDERS = ("document", "longest")
VARLEN_ORDER = "document"


def _longest_documents_first(sched, cu_seqlens_q, cu_seqlens_k):
    """The schedule's entries reordered by their document's q_len * k_len, most first (a stable
    sort: each document's key blocks stay in ascending order); empty entries last."""
    doc = sched[:, 0].long()
    d = doc.clamp(min=0)
    work = (cu_seqlens_q[d + 1] - cu_seqlens_q[d]).long() * (cu_seqlens_k[d + 1] - cu_seqlens_k[d]).long()
    work = torch.where(doc >= 0, work, -1)
    return sched[torch.argsort(work, descending=True, stable=True)]


def varlen_key_schedule(cu_seqlens_q, cu_seqlens_k, tokens_k, variant, causal, order=None):
    """The packed backward's programs: (document, key tile of the variant's keys) pairs over
    cu_seqlens_k (``attention_fwd.varlen_schedule``, document order, so a document's key blocks
    start in ascending order, as the ordered dQ needs); ``order="longest"`` reorders them by
    document size (``VARLEN_ORDERS``; default ``VARLEN_ORDER``)."""
    var = VARIANTS[variant]
    order = order or VARLEN_ORDER
    if order not in VARLEN_ORDERS:
        raise ValueError(f"order must be one of {VARLEN_ORDERS}, got {order!r}")
    sched = varlen_schedule(cu_seqlens_k, cu_seqlens_q, tokens_k, rows=var.keys, block_n=var.block_m,
                            causal=causal, order="document")  # fmt: skip
    if order == "longest":
        sched = _longest_documents_first(sched, cu_seqlens_q, cu_seqlens_k)
    return sched


def launch_args(q, k, v, dout, lse, delta, dk, dv, dq_accum=None, dq_sem=None, stats=None, *, softmax_scale, causal,
                variant, cu_seqlens_q=None, cu_seqlens_k=None, sched=None, window=(-1, -1),
                softcap=0.0, tail=None):  # fmt: skip
    """(grid, positional args, keyword args) of one launch; shared by the launcher and the CPU
    compile check, so both build the same kernel. ``dq_accum``: the float32 (B, Sq, H, D)
    accumulator the ``dq_atomic`` variants add dQ into (:func:`dq_accum_for`: zeroed, except for
    dense calls of ``dq_ordered`` variants, which store first);
    ``dq_sem``: the zeroed int32 counters of the ``dq_ordered`` variants (:func:`dq_sem_count`);
    ``stats``: the ``stats_smem`` variants' statistics buffer (``flash_bwd.backward_preprocess``;
    its contents do not matter to the compile check, only its size, :func:`stats_numel`).
    Packed (varlen) calls pass cu_seqlens: q/dout (Tq, H, D), k/v/dk/dv (Tk, Hk, D), lse/delta
    (H, Tq); programs = entries of ``sched`` (:func:`varlen_key_schedule`; the compile check passes
    an unwritten tensor of ``attention_fwd.schedule_slots`` entries) x K/V heads. ``window`` as in
    :func:`attention_fwd.mask_args`; ``softcap`` > 0 only for the split-D variant
    (:func:`supports`). ``tail``: a ``tail_split`` variant's pieces, ``(n_whole, pieces, part,
    part_map)`` (:func:`tail_plan`, :func:`tail_buffers`), or None for whole units only."""
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together")
    nheads, head_dim = q.shape[-2:]
    nheads_k = k.shape[-2]
    var = VARIANTS[variant]
    if head_dim not in var.head_dims:
        raise ValueError(f"variant {variant} is built for head dims {var.head_dims}, not {head_dim}")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    if lse.stride() != delta.stride() or lse.stride(-1) != 1:
        raise ValueError("lse and delta must share strides, unit along the rows")
    masks = mask_args(causal, window, softcap, softmax_scale)
    if masks["SOFTCAP"] and not var.split_d:
        raise ValueError(f"variant {variant} has no softcap form (only the split-D variants have one)")
    if varlen and not varlen_builds(variant):
        raise ValueError(f"variant {variant} has no packed (varlen) form")
    if var.dq_frag:
        batch, seqlen_q = q.shape[:2]
        want = batch * nheads * configs.cdiv(seqlen_q, var.block_m) * var.block_m * head_dim
        if dq_accum is None or dq_accum.dim() != 1 or dq_accum.numel() != want or dq_accum.dtype != torch.float32:
            raise ValueError(f"variant {variant} needs a flat float32 dq_accum of {want} (dq_accum_for)")
        dq_desc = _descriptor_frag(dq_accum)
    elif var.dq_atomic:
        if dq_accum is None or dq_accum.shape != q.shape or dq_accum.dtype != torch.float32:
            raise ValueError(f"variant {variant} needs a float32 dq_accum shaped like q")
        dq_desc = _descriptor(dq_accum, var.block_m, head_dim // var.consumers if var.dq_shared else head_dim)
    if var.dq_ordered:
        want = dq_sem_count(q, variant, cu_seqlens_q)
        if dq_sem is None or dq_sem.numel() < want:
            raise ValueError(f"variant {variant} needs a zeroed int32 dq_sem of {want} counters (dq_sem_count)")
    if not var.dq_atomic:
        dq_desc = _descriptor(dk, var.block_n)  # not read: the kernel is built without dQ
    q_desc = _descriptor(q, var.block_m)
    if var.stats_smem:
        if varlen:
            raise ValueError(f"variant {variant} has no packed (varlen) form")
        want = stats_numel(q.shape[0], nheads, q.shape[1], var.block_m)
        if stats is None or stats.dim() != 1 or stats.numel() != want or stats.dtype != torch.float32:
            raise ValueError(f"variant {variant} needs a flat float32 stats buffer of {want} (backward_preprocess)")
        if want // var.block_m >= 2**31:
            raise ValueError("too many query tiles for the statistics buffer's int32 TMA row coordinate")
        stats_desc = _descriptor_stats(stats, var.block_m)
    else:
        stats_desc = q_desc  # not read: the kernel is built without the statistics tiles
    if varlen:
        if sched is None:
            raise ValueError("packed (varlen) launches need their programs (sched=varlen_key_schedule(...))")
        n_bhk, seqlen_q, seqlen_k = nheads_k, 0, 0
        grid = (sched.shape[0] * nheads_k,)
        if grid[0] >= 2**31:
            raise ValueError("too many programs for one launch (schedule entries x K/V heads >= 2**31)")
        stride_lb, stride_lh, stride_lm = 0, lse.stride(0), lse.stride(1)
        slots = schedule_slots(q.shape[0], cu_seqlens_q.numel() - 1, var.block_m)
        dk_strides = (dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1))
    else:
        batch, seqlen_q = q.shape[:2]
        seqlen_k = k.shape[1]
        sched = cu_seqlens_q = cu_seqlens_k = None
        n_bhk = batch * nheads_k
        grid = (n_bhk * configs.cdiv(seqlen_k, var.keys),)
        stride_lb, stride_lh, stride_lm = lse.stride(0), lse.stride(1), lse.stride(2)
        slots = 0
        dk_strides = (0, 0, 0, 0)  # dense dK/dV go out through TMA only
    n_units = grid[0]
    part = part_map = None
    n_whole, pieces = n_units, 0
    if tail is not None:
        n_whole, pieces, part, part_map = tail
        if not var.tail_split:
            raise ValueError(f"variant {variant} has no tail pieces (tail_split)")
        if varlen or masks["MASK_LEFT"] or masks["MASK_RIGHT"]:
            raise ValueError("tail pieces are for dense calls without a causal mask or window")
        if not (0 <= n_whole < n_units and pieces >= 2):
            raise ValueError(f"tail: n_whole must be in [0, {n_units}) and pieces >= 2, got {n_whole}, {pieces}")
        want = tail_numel(n_units - n_whole, pieces, var.keys, head_dim)
        if part is None or part.dtype != torch.float32 or part.numel() < want[0]:
            raise ValueError(f"tail: part must be float32 with >= {want[0]} elements (tail_buffers)")
        if part_map is None or part_map.dtype != torch.int32 or part_map.numel() < want[1]:
            raise ValueError(f"tail: part_map must be int32 with >= {want[1]} elements (tail_buffers)")
        grid = (n_whole + (n_units - n_whole) * pieces,)
    # the cached launcher's order (hf_flash.kernels.launch): descriptors and pointers, integers,
    # floats, then the constexprs
    # split_d: each consumer stores its half of dK's and dV's columns
    out_cols = head_dim // 2 if var.split_d else head_dim
    args = (
        q_desc, _descriptor(k, var.block_n), _descriptor(v, var.block_n),
        _descriptor(dout, var.block_m), _descriptor(dk, var.block_n, out_cols), _descriptor(dv, var.block_n, out_cols),
        dq_desc, stats_desc,
        lse, delta, dq_sem if var.dq_ordered else lse, sched, cu_seqlens_q, cu_seqlens_k,
        dk if varlen else None, dv if varlen else None, part, part_map,
        stride_lb, stride_lh, stride_lm, n_bhk, nheads_k, nheads // nheads_k, seqlen_q, seqlen_k,
        *dk_strides, slots, masks["window_left"], masks["window_right"], n_whole, pieces,
        float(softmax_scale) * LOG2E, float(softmax_scale), masks["softcap_in"], masks["softcap_out"],
    )  # fmt: skip
    kwargs = dict(
        BLOCK_M=var.block_m, BLOCK_N=var.block_n, HEAD_DIM=head_dim, STAGES=var.stages,
        CONSUMERS=var.consumers, CONSUMER_WARPS=4, CONSUMER_REGS=var.consumer_regs,
        PRODUCER_REGS=PRODUCER_REGS, MASK_LEFT=masks["MASK_LEFT"], MASK_RIGHT=masks["MASK_RIGHT"],
        RIGHT_WINDOW=masks["RIGHT_WINDOW"], DQ_ATOMIC=var.dq_atomic,
        DQ_SHARED=var.dq_shared, DQ_LAG=var.dq_lag, DQ_WRITER=var.dq_writer, DQ_ORDERED=var.dq_ordered,
        DQ_FRAG=var.dq_frag, VARLEN=varlen, TILES_DOWN=var.tiles_down, KEY_FASTEST=var.key_fastest,
        POLL_AHEAD=var.poll_ahead,
        DQ_PARITY=var.dq_parity, STATS_SMEM=var.stats_smem, EXP_PER_BRANCH=var.exp_per_branch,
        LEAD_BOUND=var.lead_bound, STATS_EARLY=var.stats_early, DEFER_ARRIVE=var.defer_arrive,
        DQ_EARLY=var.dq_early,
        SOFTCAP=masks["SOFTCAP"], TAIL=pieces > 0, num_warps=4,
    )  # fmt: skip
    return grid, args, kwargs


@functools.lru_cache(maxsize=4096)
def tail_plan(n_units: int, steps: int, sms: int, max_pieces: int = 8, min_saving: float = 0.01):
    """(n_whole, pieces) for a ``tail_split`` launch of ``n_units`` equal units of ``steps`` steps
    on ``sms`` SMs (one program each): the last ``n_units % sms`` units (the partial wave) run as
    ``pieces`` pieces each (:func:`_piece_steps`), the smallest count in 2..max_pieces that
    minimises the tail's span (rounds of pieces over the SMs times the longest piece, in units),
    kept if it shortens the launch by at least ``min_saving`` of its waves; (n_units, 0) when no
    split does."""
    tail = n_units % sms
    if tail == 0 or steps < 8:
        return n_units, 0
    waves = -(-n_units // sms)
    best_span, best = 1.0, 0
    for k in range(2, max_pieces + 1):
        if steps // k < 4:
            break
        ends = [(i * steps // k) // 4 * 4 for i in range(k)] + [steps]
        longest = max(b - a for a, b in zip(ends, ends[1:])) / steps
        span = -(-tail * k // sms) * longest
        if span < best_span - 1e-9:
            best_span, best = span, k
    if not best or (1.0 - best_span) / waves < min_saving:
        return n_units, 0
    return n_units - tail, best


def tail_numel(n_tail: int, pieces: int, keys: int, head_dim: int) -> tuple:
    """Elements of the tail pieces' workspace (float32: a dK and a dV partial of ``keys`` x
    ``head_dim`` per piece) and of its map (int32: (b, kv_h, first key) per tail unit)."""
    return n_tail * pieces * 2 * keys * head_dim, n_tail * 3


def tail_buffers(n_tail: int, pieces: int, keys: int, head_dim: int, device) -> tuple:
    """The tail pieces' (part, part_map) buffers (:func:`tail_numel`); every element is written
    by the pieces before :func:`tail_sum` reads it."""
    n_part, n_map = tail_numel(n_tail, pieces, keys, head_dim)
    return (torch.empty(n_part, device=device, dtype=torch.float32),
            torch.empty(n_map, device=device, dtype=torch.int32))  # fmt: skip


@triton.jit
def _tail_sum(Part, PartMap, DK, DV, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, seqlen_k,
              pieces, sm_scale, KEYS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """dK (axis 1 = 0, times sm_scale) or dV (1) of rows [ROWS * axis 2, + ROWS) of tail unit
    ``axis 0``: its pieces' partials added in piece order, stored where the unit's map says (rows
    past seqlen_k dropped)."""
    t = tl.program_id(0)
    which = tl.program_id(1)
    r = tl.program_id(2) * ROWS + tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, HEAD_DIM)[None, :]
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for p in range(pieces):
        base = ((t * pieces + p) * 2 + which).to(tl.int64) * (KEYS * HEAD_DIM)
        acc += tl.load(Part + base + r * HEAD_DIM + c)
    b = tl.load(PartMap + t * 3).to(tl.int64)
    kv_h = tl.load(PartMap + t * 3 + 1).to(tl.int64)
    rows = tl.load(PartMap + t * 3 + 2) + r
    inside = rows < seqlen_k
    if which == 0:
        ptrs = DK + b * stride_kb + rows.to(tl.int64) * stride_ks + kv_h * stride_kh + c
        tl.store(ptrs, (acc * sm_scale).to(DK.dtype.element_ty), mask=inside)
    else:
        ptrs = DV + b * stride_vb + rows.to(tl.int64) * stride_vs + kv_h * stride_vh + c
        tl.store(ptrs, acc.to(DV.dtype.element_ty), mask=inside)


_TAIL_SUM = CachedLauncher(_tail_sum)
_TAIL_ROWS = 32


def tail_sum(tail, dk: torch.Tensor, dv: torch.Tensor, softmax_scale: float, keys: int) -> None:
    """dK and dV of the tail units of a pieced launch (``tail`` as :func:`launch_args` took it):
    each unit's partials added in piece order, dK scaled, cast to dk's dtype. Dense dk/dv (B,
    Sk, Hk, D) with unit stride along D."""
    n_whole, pieces, part, part_map = tail
    n_tail = part_map.numel() // 3
    head_dim = dk.shape[-1]
    meta = _TAIL_SUM.meta_for(KEYS=keys, HEAD_DIM=head_dim, ROWS=_TAIL_ROWS, num_warps=4)
    _TAIL_SUM((n_tail, 2, keys // _TAIL_ROWS), (part, part_map, dk, dv),
              (*dk.stride()[:3], *dv.stride()[:3], dk.shape[1], pieces), (float(softmax_scale),), meta)  # fmt: skip


def _tail_for(q, k, variant: str, causal: bool, window):
    """The ``tail`` of a dense launch (:func:`launch_args`): a ``tail_split`` variant on a call
    without a mask gets its pieces (:func:`tail_plan` on q's GPU) and their buffers; None when
    the variant has none, the call is masked or no split shortens the launch."""
    var = VARIANTS[variant]
    if not var.tail_split:
        return None
    masks = mask_args(causal, window)
    if masks["MASK_LEFT"] or masks["MASK_RIGHT"]:
        return None
    n_units = q.shape[0] * k.shape[2] * configs.cdiv(k.shape[1], var.keys)
    steps = q.shape[2] // k.shape[2] * configs.cdiv(q.shape[1], var.block_m)
    n_whole, pieces = tail_plan(n_units, steps, configs.sm_count(q.device, 132))
    if not pieces:
        return None
    return (n_whole, pieces, *tail_buffers(n_units - n_whole, pieces, var.keys, q.shape[-1], q.device))


def hopper_attention_backward(q, k, v, dout, lse, delta, dq, dk, dv, *, softmax_scale, causal,
                              variant=None, cu_seqlens_q=None, cu_seqlens_k=None, order=None,
                              window=(-1, -1), softcap=0.0, stats=None, dq_sem=None) -> bool:  # fmt: skip
    """dK and dV (and, for the ``dq_atomic`` variants, dQ) on Hopper. Layouts as
    ``hf_flash.kernels.flash_bwd.flash_attn_backward``: dense q/dout/dq (B, Sq, H, D),
    k/v/dk/dv (B, Sk, Hk, D), lse (the forward's natural-log log-sum-exp) and delta
    (rowsum(dO * O) - dlse, from the Triton preprocess) float32 (B, H, Sq) with the same
    strides; packed (cu_seqlens int32 (batch + 1,) given) q/dout/dq (Tq, H, D), k/v/dk/dv (Tk,
    Hk, D), lse/delta (H, Tq). Only calls for which :func:`supports` is true (checked by the
    caller). ``variant`` names an entry of ``VARIANTS`` (default: :func:`variant_for`); ``order``
    the packed calls' program order (``VARLEN_ORDERS``; default ``VARLEN_ORDER``); ``window``
    (left, right) and ``softcap`` as in :func:`attention_fwd.mask_args` (the forward's). Packed
    rows outside every sequence: dK/dV not written, dQ (when written) 0; no host sync reads
    cu_seqlens. A ``stats_smem`` variant (dense calls only: :func:`launch_args` refuses packed
    ones) reads lse and delta from ``stats``, the buffer the backward preprocess writes with them
    (``flash_bwd.backward_preprocess(..., stats_m=variant's block_m)``). Returns whether dq was
    written (else the caller runs a dQ kernel). A ``tail_split`` variant on a dense call without
    a mask runs the launch's partial last wave in pieces (:func:`tail_plan` on this GPU's SM
    count) and then :func:`tail_sum` for those units' dK/dV. ``dq_sem``: a ``dq_ordered``
    variant's counters, zeroed (:func:`sem_from_preprocess`'s, after the preprocess that zeroes
    them); None: new zeroed ones."""
    varlen = cu_seqlens_q is not None
    variant = variant or variant_for(q.shape[-1], causal, varlen, 0 if varlen else q.shape[1], window)
    var = VARIANTS[variant]
    if var.stats_rows and stats is None:  # (launch_args refuses packed calls of these variants)
        raise ValueError(f"variant {variant} reads lse/delta from the statistics buffer the backward "
                         f"preprocess writes: pass stats (flash_bwd.backward_preprocess with "
                         f"stats_m={var.stats_rows})")  # fmt: skip
    if varlen:
        if q.shape[0] == 0 or k.shape[0] == 0 or cu_seqlens_q.numel() < 2:
            dk.zero_()
            dv.zero_()
            dq.zero_()
            return True
    else:
        if k.shape[1] == 0:
            return False
        if q.shape[1] == 0 or q.shape[0] == 0:
            dk.zero_()
            dv.zero_()
            return False
    dq_accum = dq_accum_for(q, variant) if var.dq_atomic else None
    if not var.dq_ordered:
        dq_sem = None
    elif dq_sem is None:
        dq_sem = torch.zeros(dq_sem_count(q, variant, cu_seqlens_q), device=q.device, dtype=torch.int32)
    sched = varlen_key_schedule(cu_seqlens_q, cu_seqlens_k, k.shape[0], variant, causal, order) if varlen else None
    tail = None if varlen else _tail_for(q, k, variant, causal, window)
    # the call's tensors, in the plan's slots
    tensors = (q, k, v, dout, lse, delta, dk, dv, dq_accum, dq_sem, stats, sched, cu_seqlens_q, cu_seqlens_k,
               *((None, None) if tail is None else tail[2:]))  # fmt: skip
    key = (variant, q.shape, q.stride(), k.shape, k.stride(), v.stride(), dout.stride(), dk.stride(), dv.stride(),
           lse.shape, lse.stride(), delta.stride(), None if dq_accum is None else dq_accum.stride(), q.dtype,
           q.get_device(), bool(causal), tuple(window), float(softcap), float(softmax_scale),
           None if sched is None else (sched.shape[0], cu_seqlens_q.numel()), None if tail is None else tail[:2])  # fmt: skip
    plan = _PLANS.get(key, lambda: _plan(tensors, variant, causal, window, softcap, softmax_scale, tail))
    launcher = _BACKWARD_SPLIT_D if var.split_d else _BACKWARD
    with configs.device_guard(q.device):
        launcher.run_plan(plan, tensors)
        if tail is not None:
            tail_sum(tail, dk, dv, softmax_scale, var.keys)
        if var.dq_frag:
            dq_frag_to_bshd(dq_accum, dq, var.block_m, var.consumers)
    if var.dq_atomic and not var.dq_frag:
        dq.copy_(dq_accum)  # already scaled; float32 -> q's dtype
    if var.dq_ordered and not varlen:
        # the query tiles no key block reaches were never written: their rows see no key
        unseen = rows_without_keys(q.shape[1], k.shape[1], causal, window)
        if unseen:
            dq[:, :unseen].zero_()
    return var.dq_atomic


def _plan(tensors, variant, causal, window, softcap, softmax_scale, tail) -> LaunchPlan:
    """The launch plan of a backward call (``tensors`` in :func:`hopper_attention_backward`'s slots)."""
    q, k, v, dout, lse, delta, dk, dv, dq_accum, dq_sem, stats, sched, cu_seqlens_q, cu_seqlens_k = tensors[:14]
    grid, args, kwargs = launch_args(
        q, k, v, dout, lse, delta, dk, dv, dq_accum, dq_sem, stats, softmax_scale=softmax_scale, causal=causal,
        variant=variant, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sched=sched, window=window,
        softcap=softcap, tail=tail,
    )  # fmt: skip
    switches = ("MASK_LEFT", "MASK_RIGHT", "RIGHT_WINDOW", "SOFTCAP", "TAIL")
    key = (variant, q.shape[-1], sched is not None, *(kwargs[f] for f in switches))
    meta = _LAUNCH_META.get(key)
    if meta is None:
        meta = _LAUNCH_META[key] = (_BACKWARD_SPLIT_D if VARIANTS[variant].split_d else _BACKWARD).meta(**kwargs)
    # launch_args' order: 8 descriptors and 10 pointers, 17 integers, 4 floats
    return LaunchPlan.capture(grid, args[:18], args[18:35], args[35:], meta, tensors)


def rows_without_keys(seqlen_q: int, seqlen_k: int, causal: bool, window=(-1, -1)) -> int:
    """How many leading query rows of a dense call see no key (bottom-right alignment: row i sits
    at key position i + seqlen_k - seqlen_q). Only a right bound (causal, or a right window) hides
    keys from a whole row, and only from rows whose position plus that bound is below 0; a left
    bound never does (a row's own position is below seqlen_k)."""
    masks = mask_args(causal, window)
    if not masks["MASK_RIGHT"]:
        return 0
    return max(0, min(seqlen_q, seqlen_q - seqlen_k - masks["window_right"]))


_BACKWARD = CachedLauncher(_attn_bwd_dkdv_kernel)
_BACKWARD_SPLIT_D = CachedLauncher(_attn_bwd_split_d_kernel)
_LAUNCH_META: dict = {}
_PLANS = PlanCache()


def kernel_for(variant: str):
    """The Gluon kernel a variant launches (the split-D form has its own)."""
    return _attn_bwd_split_d_kernel if VARIANTS[variant].split_d else _attn_bwd_dkdv_kernel


__all__ = [
    "hopper_attention_backward", "supports", "launch_args", "kernel_for", "dq_accum_for", "dq_sem_count",
    "sem_from_preprocess",
    "tail_plan", "tail_numel", "tail_buffers", "tail_sum",
    "rows_without_keys",
    "dq_frag_to_bshd", "stats_numel",
    "variant_for", "covered_head_dims", "varlen_builds", "VARIANTS", "DEFAULT", "NONDETERMINISTIC", "VARLEN_DEFAULT",
    "VARLEN_NONDETERMINISTIC", "VARLEN_ORDERS",
]
