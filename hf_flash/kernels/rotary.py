"""Rotary position embedding (RoPE) in Triton: one launch rotates up to two tensors (q and k).

Each token's head vector is split into ``rotary_dim / 2`` feature pairs ``(x1, x2)`` and every
pair is rotated by its own angle::

    out1 = x1 * cos1 - x2 * sin1          (forward)
    out2 = x2 * cos2 + x1 * sin2

    out1 = x1 * cos1 + x2 * sin2          (CONJUGATE: the transpose, used by the backward pass)
    out2 = x2 * cos2 - x1 * sin1

With one cos/sin value per pair (cos1 == cos2, sin1 == sin2) this is a rotation and CONJUGATE is
its inverse. Transformers' ``apply_rotary_pos_emb`` takes cos/sin of width ``rotary_dim`` whose
halves are normally equal; reading both halves (``COS_HALF_OFFSET = rotary_dim / 2``) makes the
kernel exact for any cos/sin, and the transpose stays the correct gradient.

Pairing: non-interleaved ("rotate half", Llama/Mistral) pairs feature ``i`` with
``i + rotary_dim / 2``; interleaved (GPT-J) pairs ``2i`` with ``2i + 1``. Features past
``rotary_dim`` are copied unless the kernel works in place.

Work split: a tensor is a grid of tokens ``(batch, seqlen)`` by heads, each head a row of
``headdim`` features, with arbitrary strides. A program owns a [BLOCK_T tokens, BLOCK_H heads,
rotary_dim / 2 pairs] tile of one tensor: the first ``cdiv(tokens, BLOCK_TA)`` programs rotate
tensor A (q), the rest tensor B (k). Each token's cos/sin row is loaded once and broadcast over
its heads. The row is found from the token's position: ``position_ids[b, s]`` when given, else
``s + offset (+ seqlen_offsets[b])``; it starts at ``cos + b * stride_cb + position *
stride_cs`` (stride_cb = 0 for a table shared by the batch).

Arithmetic is float32 whatever the storage dtype (float16, bfloat16, float32). Offsets are
int64 so tensors with more than 2**31 elements are addressed correctly.
"""

import functools

import torch
import triton
import triton.language as tl

from . import configs
from .launch import CachedLauncher


@triton.jit
def _rotate_tokens(
    block, hblock, x_ptr, o_ptr,
    stride_xb, stride_xs, stride_xh, stride_ob, stride_os, stride_oh,
    nheads, seqlen, ntokens,
    cos_ptr, sin_ptr, stride_cb, stride_cs, seqlen_ro,
    pos_ptr, stride_pb, stride_ps, offsets_ptr, offset,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, COS_HALF_OFFSET: tl.constexpr,
    TAIL: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_OFFSETS: tl.constexpr, COPY_TAIL: tl.constexpr,
):  # fmt: skip
    """Rotate heads [hblock * BLOCK_H, +BLOCK_H) of tokens [block * BLOCK_T, +BLOCK_T)."""
    tok = tl.cast(block, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)  # [BLOCK_T]
    tok_ok = tok < ntokens
    s = tok % seqlen
    b = tok // seqlen
    if HAS_POS:
        pos = tl.load(pos_ptr + b * stride_pb + s * stride_ps, mask=tok_ok, other=0).to(tl.int64)
    else:
        pos = s + offset
        if HAS_OFFSETS:
            pos += tl.load(offsets_ptr + b, mask=tok_ok, other=0).to(tl.int64)
    # positions outside the table were rejected on the host; the mask keeps reads in bounds
    # when that check is skipped (torch.compile tracing, CUDA-graph capture)
    pos_ok = tok_ok & (pos >= 0) & (pos < seqlen_ro)

    # one cos/sin row per token, broadcast over its heads: [BLOCK_T, 1, BLOCK_HALF]
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cs_ptrs = (b * stride_cb + pos * stride_cs)[:, None, None] + i[None, None, :]
    cs_mask = pos_ok[:, None, None] & i_ok[None, None, :]
    cos1 = tl.load(cos_ptr + cs_ptrs, mask=cs_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs_ptrs, mask=cs_mask, other=0.0).to(tl.float32)
    if COS_HALF_OFFSET == 0:
        cos2 = cos1
        sin2 = sin1
    else:
        cos2 = tl.load(cos_ptr + cs_ptrs + COS_HALF_OFFSET, mask=cs_mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + cs_ptrs + COS_HALF_OFFSET, mask=cs_mask, other=0.0).to(tl.float32)

    h = tl.cast(hblock, tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)  # [BLOCK_H]
    h_ok = h < nheads
    if INTERLEAVED:
        col1 = 2 * i
        col2 = 2 * i + 1
    else:
        col1 = i
        col2 = i + HALF
    x_base = (b * stride_xb + s * stride_xs)[:, None, None] + (h * stride_xh)[None, :, None]
    o_base = (b * stride_ob + s * stride_os)[:, None, None] + (h * stride_oh)[None, :, None]
    row_ok = tok_ok[:, None, None] & h_ok[None, :, None]  # [BLOCK_T, BLOCK_H, 1]
    mask = row_ok & i_ok[None, None, :]
    x1 = tl.load(x_ptr + x_base + col1[None, None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_base + col2[None, None, :], mask=mask, other=0.0).to(tl.float32)
    if CONJUGATE:
        o1 = x1 * cos1 + x2 * sin2
        o2 = x2 * cos2 - x1 * sin1
    else:
        o1 = x1 * cos1 - x2 * sin1
        o2 = x2 * cos2 + x1 * sin2
    tl.store(o_ptr + o_base + col1[None, None, :], o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + o_base + col2[None, None, :], o2.to(o_ptr.dtype.element_ty), mask=mask)

    if COPY_TAIL:
        j = tl.arange(0, BLOCK_TAIL)
        tmask = row_ok & (j < TAIL)[None, None, :]
        tail = tl.load(x_ptr + x_base + 2 * HALF + j[None, None, :], mask=tmask, other=0.0)
        tl.store(o_ptr + o_base + 2 * HALF + j[None, None, :], tail, mask=tmask)


@triton.jit
def _rotary_kernel(
    xa_ptr, oa_ptr, xb_ptr, ob_ptr, cos_ptr, sin_ptr, pos_ptr, offsets_ptr,
    stride_xab, stride_xas, stride_xah, stride_oab, stride_oas, stride_oah, nheads_a, nblocks_a,
    stride_xbb, stride_xbs, stride_xbh, stride_obb, stride_obs, stride_obh, nheads_b,
    seqlen, ntokens,
    stride_cb, stride_cs, seqlen_ro,
    stride_pb, stride_ps, offset,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, COS_HALF_OFFSET: tl.constexpr,
    TAIL: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    BLOCK_TA: tl.constexpr, BLOCK_HA: tl.constexpr, BLOCK_TB: tl.constexpr, BLOCK_HB: tl.constexpr,
    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_OFFSETS: tl.constexpr, COPY_TAIL: tl.constexpr,
):  # fmt: skip
    # axis 0: the first nblocks_a programs own token blocks of tensor A (q), the rest of B (k);
    # axis 1: head blocks (a single one unless heads * head_dim is very large)
    pid = tl.program_id(0)
    hblock = tl.program_id(1)
    if pid < nblocks_a:
        _rotate_tokens(
            pid, hblock, xa_ptr, oa_ptr, stride_xab, stride_xas, stride_xah, stride_oab, stride_oas, stride_oah,
            nheads_a, seqlen, ntokens,
            cos_ptr, sin_ptr, stride_cb, stride_cs, seqlen_ro,
            pos_ptr, stride_pb, stride_ps, offsets_ptr, offset,
            HALF, BLOCK_HALF, COS_HALF_OFFSET, TAIL, BLOCK_TAIL, BLOCK_TA, BLOCK_HA,
            INTERLEAVED, CONJUGATE, HAS_POS, HAS_OFFSETS, COPY_TAIL,
        )  # fmt: skip
    else:
        _rotate_tokens(
            pid - nblocks_a, hblock, xb_ptr, ob_ptr, stride_xbb, stride_xbs, stride_xbh, stride_obb, stride_obs, stride_obh,
            nheads_b, seqlen, ntokens,
            cos_ptr, sin_ptr, stride_cb, stride_cs, seqlen_ro,
            pos_ptr, stride_pb, stride_ps, offsets_ptr, offset,
            HALF, BLOCK_HALF, COS_HALF_OFFSET, TAIL, BLOCK_TAIL, BLOCK_TB, BLOCK_HB,
            INTERLEAVED, CONJUGATE, HAS_POS, HAS_OFFSETS, COPY_TAIL,
        )  # fmt: skip


# one launch per fused RoPE call (q and k together): cached launches, see .launch
_ROTARY = CachedLauncher(_rotary_kernel)


# Elements per program and half (x1 or x2). The broadcast cos/sin rows are held in registers
# at the tile's full shape (four fp32 tiles for transformers' cos/sin), so the tile is kept
# small: 2K elements need ~85 registers per thread at 4 warps (ptxas, sm_90), leaving room
# for several programs per SM to keep loads in flight.
_TILE_ELEMS = 2048
_NUM_WARPS = 4


def _blocks(nheads: int, width: int):
    """(BLOCK_T, BLOCK_H): all heads of a few tokens per program, so each token's cos/sin row
    is loaded once and broadcast over its heads; heads are split only for very wide tokens.
    ``width`` is the widest column block (rotary pairs or the copied tail)."""
    block_h = min(configs.next_power_of_2(nheads), max(1, _TILE_ELEMS // width))
    block_t = max(1, _TILE_ELEMS // (block_h * width))
    return block_t, block_h


@configs.on_input_device
def rotary_forward(
    xs,
    outs,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rotary_dim: int,
    cos_half_offset: int,
    position_ids=None,
    seqlen_offsets=None,
    offset: int = 0,
    interleaved: bool = False,
    conjugate: bool = False,
) -> None:
    """Rotate ``xs[i]`` into ``outs[i]`` (one or two tensors, one launch).

    xs, outs: sequences of 1 or 2 tensors of shape (batch, seqlen, nheads_i, headdim), any strides
        with unit stride on headdim; ``outs[i]`` may be ``xs[i]`` (in place: the tail past
        rotary_dim is then left untouched).
    cos, sin: (batch or 1, seqlen_ro, width), same strides, unit stride on the last axis;
        width >= rotary_dim / 2 and, with ``cos_half_offset > 0``, >= cos_half_offset +
        rotary_dim / 2.
    position_ids: None or (batch, seqlen) integer tensor of rows of the cos/sin table.
    seqlen_offsets: None or (batch,) integer tensor added to ``s + offset`` when position_ids is None.
    """
    xa, oa = xs[0], outs[0]
    two = len(xs) == 2
    xb, ob = (xs[1], outs[1]) if two else (xa, oa)
    batch, seqlen, _, headdim = xa.shape
    ntokens = batch * seqlen
    if ntokens == 0:
        return
    copy_tail = headdim > rotary_dim and any(
        o.data_ptr() != x.data_ptr() for x, o in zip(xs, outs)
    )
    has_pos = position_ids is not None
    has_offsets = seqlen_offsets is not None
    bta, btb, hblocks, meta = _plan(
        xa.shape[2], xb.shape[2] if two else 0, headdim, rotary_dim, int(cos_half_offset),
        copy_tail, bool(interleaved), bool(conjugate), has_pos, has_offsets,
    )  # fmt: skip
    nblocks_a = configs.cdiv(ntokens, bta)
    nblocks_b = configs.cdiv(ntokens, btb) if two else 0
    pos = position_ids if has_pos else cos  # placeholder pointer, never read
    offs = seqlen_offsets if has_offsets else cos
    stride_pb, stride_ps = position_ids.stride()[:2] if has_pos else (0, 0)
    stride_c = cos.stride()
    stride_cb = stride_c[0] if cos.shape[0] > 1 else 0
    _ROTARY(
        (nblocks_a + nblocks_b, hblocks),
        (xa, oa, xb, ob, cos, sin, pos, offs),
        (*xa.stride()[:3], *oa.stride()[:3], xa.shape[2], nblocks_a,
         *xb.stride()[:3], *ob.stride()[:3], xb.shape[2],
         seqlen, ntokens,
         stride_cb, stride_c[1], cos.shape[1],
         stride_pb, stride_ps, int(offset)),
        (),
        meta,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _plan(nheads_a, nheads_b, headdim, rotary_dim, cos_half_offset, copy_tail, interleaved,
          conjugate, has_pos, has_offsets):  # fmt: skip
    """(BLOCK_TA, BLOCK_TB, head blocks, constexprs and options) for one launch shape;
    ``nheads_b`` 0: a single tensor. Memoised: every layer of a decode step repeats one."""
    half = rotary_dim // 2
    block_half = configs.next_power_of_2(half)
    tail = headdim - rotary_dim
    block_tail = configs.next_power_of_2(max(tail, 1))
    width = max(block_half, block_tail if copy_tail else 1)
    bta, bha = _blocks(nheads_a, width)
    btb, bhb = _blocks(nheads_b, width) if nheads_b else (bta, bha)
    hblocks = max(configs.cdiv(nheads_a, bha), configs.cdiv(nheads_b, bhb) if nheads_b else 1)
    meta = _ROTARY.meta(
        HALF=half, BLOCK_HALF=block_half, COS_HALF_OFFSET=cos_half_offset,
        TAIL=tail, BLOCK_TAIL=block_tail,
        BLOCK_TA=bta, BLOCK_HA=bha, BLOCK_TB=btb, BLOCK_HB=bhb,
        INTERLEAVED=interleaved, CONJUGATE=conjugate,
        HAS_POS=has_pos, HAS_OFFSETS=has_offsets, COPY_TAIL=copy_tail,
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    return bta, btb, hblocks, meta
