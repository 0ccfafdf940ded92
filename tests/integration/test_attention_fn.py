"""hf_flash's transformers attention function and mask function, without a model.

The oracle here is written from transformers' semantics, independently of the five-segment
varlen trick the attention function uses: row ``b``'s query ``i`` sits at key position
``M - Sq + i``; key ``j`` is visible iff ``j < M``, ``mask[b, j]``, and (causal) ``j <= pos``,
(window ``w``) ``pos - j < w``. Only real (unpadded) query rows are compared.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_flash.integration.attention import hf_flash_attention_forward, hf_flash_mask
from hf_flash.integration.masks import has_holes
from hf_flash.reference import FWD_FACTOR, GRAD_FACTOR, assert_close_to_ref


class _Attn(torch.nn.Module):
    def __init__(self, causal=True, dtype=torch.float32):
        super().__init__()
        self.is_causal = causal
        self.q_proj = torch.nn.Linear(4, 4, dtype=dtype)


def _oracle(q, k, v, mask, *, causal, window=None, scale=None, softcap=0.0, upcast=True):
    """q (B, Hq, Sq, D), k/v (B, Hkv, Skv, D), mask (B, M) or None -> (B, Sq, Hq, D)."""
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    b, hq, sq, d = q.shape
    skv = k.shape[2]
    group = hq // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    m = skv if mask is None else mask.shape[1]
    keep = torch.ones(b, skv, dtype=torch.bool, device=q.device)
    keep[:, m:] = False
    if mask is not None:
        keep[:, :m] = mask.bool()
    pos = torch.arange(sq, device=q.device).view(-1, 1) + (m - sq)
    j = torch.arange(skv, device=q.device).view(1, -1)
    vis = keep.view(b, 1, 1, skv).expand(b, 1, sq, skv).clone()
    if causal:
        vis &= (j <= pos).view(1, 1, sq, skv)
    if window is not None:
        vis &= ((pos - j) < window).view(1, 1, sq, skv)
        if not causal:
            vis &= ((j - pos) < window).view(1, 1, sq, skv)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * (scale if scale is not None else d**-0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhij,bhjd->bihd", p, v)


def _query_rows(device, mask, sq, b):
    """(B, Sq) bool: query rows at real tokens."""
    if mask is None:
        return torch.ones(b, sq, dtype=torch.bool, device=device)
    return mask.bool()[:, mask.shape[1] - sq :]


def _mask(device, b, m, pads):
    """pads: per row (left, right) padding counts."""
    mask = torch.ones(b, m, dtype=torch.bool, device=device)
    for r, (left, right) in enumerate(pads):
        mask[r, :left] = False
        if right:
            mask[r, m - right :] = False
    return mask


CASES = [
    # id, B, Hq, Hkv, Sq, Skv, M, pads, options
    ("prefill-left-right", 3, 4, 2, 37, 37, 37, [(5, 0), (0, 9), (0, 0)], {}),
    ("decode-left", 2, 4, 2, 1, 40, 40, [(7, 0), (0, 0)], {}),
    ("chunk-left", 2, 4, 1, 5, 30, 30, [(3, 0), (11, 0)], {}),
    ("static-decode", 2, 4, 2, 1, 48, 20, [(4, 0), (0, 0)], {}),
    ("static-prefill", 2, 4, 2, 12, 32, 12, [(2, 0), (0, 0)], {}),
    ("static-chunk", 1, 2, 2, 6, 64, 27, [(0, 0)], {}),
    ("window-left", 2, 4, 2, 33, 33, 33, [(6, 0), (0, 0)], {"window": 8}),
    ("window-decode", 2, 4, 2, 1, 40, 40, [(9, 0), (0, 0)], {"window": 8}),
    ("noncausal-pad", 2, 4, 4, 21, 21, 21, [(0, 6), (3, 0)], {"causal": False}),
    ("softcap-scale", 2, 4, 2, 19, 19, 19, [(4, 0), (0, 2)], {"softcap": 5.0, "scale": 0.2}),
    ("all-pad-row", 2, 2, 1, 9, 9, 9, [(9, 0), (0, 0)], {}),
    ("dense-causal", 2, 4, 2, 23, 23, None, None, {}),
    ("dense-decode", 2, 4, 2, 3, 29, None, None, {}),
    ("dense-noncausal", 1, 4, 2, 17, 17, None, None, {"causal": False}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "b,hq,hkv,sq,skv,m,pads,opts", [pytest.param(*c[1:], id=c[0]) for c in CASES]
)
def test_matches_masked_oracle(b, hq, hkv, sq, skv, m, pads, opts, dtype, device):
    torch.manual_seed(0)
    causal = opts.get("causal", True)
    d = 16
    q = torch.randn(b, hq, sq, d, device=device, dtype=dtype) * 2
    k = torch.randn(b, hkv, skv, d, device=device, dtype=dtype) * 2
    v = torch.randn(b, hkv, skv, d, device=device, dtype=dtype)
    if m is not None and m < skv:
        k[:, :, m:] = 0  # a static cache's unused slots are zeros
        v[:, :, m:] = 0
    mask = None if m is None else _mask(device, b, m, pads)
    module = _Attn(causal, dtype)
    out, weights = hf_flash_attention_forward(
        module, q, k, v, mask, scaling=opts.get("scale"), sliding_window=opts.get("window"),
        softcap=opts.get("softcap"),
    )  # fmt: skip
    assert weights is None and out.shape == (b, sq, hq, d) and out.dtype == dtype
    kw = dict(causal=causal, window=opts.get("window"), scale=opts.get("scale"),
              softcap=opts.get("softcap", 0.0))  # fmt: skip
    ref = _oracle(q, k, v, mask, **kw)
    ref_lp = _oracle(q, k, v, mask, upcast=False, **kw)
    rows = _query_rows(device, mask, sq, b)
    assert_close_to_ref("out", out[rows], ref[rows], ref_lp[rows], FWD_FACTOR, dtype)
    if not causal:
        return
    # pad query rows get exact zeros (flash-attn's unpad/pad convention), never NaN
    assert torch.all(out[~rows] == 0)


@pytest.mark.parametrize("holes", [False, True], ids=["left-right", "inside-rows"])
def test_padded_gradients(device, holes):
    """Gradients through a left/right-padded mask (cut into blocks) and through padding inside
    rows (hf_flash_mask marks it; the attention gathers each row's valid tokens)."""
    torch.manual_seed(6 if holes else 1)
    b, hq, hkv, s, d = 2, 4, 2, 23 if holes else 29, 16
    q, k, v = (torch.randn(b, h, s, d, device=device, requires_grad=True) for h in (hq, hkv, hkv))
    if holes:
        user = _holey_mask(device, b, s, [[0, 5, 6, 17], [11]])
        mask = hf_flash_mask(b, s, s, attention_mask=user)
    else:
        user = mask = _mask(device, b, s, [(6, 0), (0, 5)])
    out, _ = hf_flash_attention_forward(_Attn(), q, k, v, mask)
    rows = _query_rows(device, user, s, b)
    dout = torch.randn_like(out) * rows[..., None, None]
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = _oracle(q, k, v, user, causal=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    lp = _oracle(q, k, v, user, causal=True, upcast=False)
    lp_grads = torch.autograd.grad(lp, (q, k, v), dout)
    for name, g, r, l in zip(("dq", "dk", "dv"), grads, ref_grads, lp_grads):
        assert torch.isfinite(g).all(), name
        assert_close_to_ref(name, g, r, l, GRAD_FACTOR, torch.float32)


def _separate_oracle(q, k, v, lengths):
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(_oracle(q[:, :, sl], k[:, :, sl], v[:, :, sl], None, causal=True))
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("source", ["position_ids", "cu_seq_lens"])
def test_packed_sequences(source, device):
    torch.manual_seed(2)
    lengths = [5, 17, 1, 9]
    total = sum(lengths)
    q = torch.randn(1, 4, total, 16, device=device)
    k = torch.randn(1, 2, total, 16, device=device)
    v = torch.randn(1, 2, total, 16, device=device)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).view(1, -1).to(device)
    kwargs = {"position_ids": position_ids}
    if source == "cu_seq_lens":
        cu = torch.tensor([0, 5, 22, 23, 32], dtype=torch.int32, device=device)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=17, max_length_k=17)
        kwargs["position_ids"] = torch.arange(total, device=device).view(1, -1)  # ignored
    out, _ = hf_flash_attention_forward(_Attn(), q, k, v, None, **kwargs)
    ref = _separate_oracle(q, k, v, lengths)
    lp = ref.float()
    assert_close_to_ref("packed", out, ref, lp, FWD_FACTOR, torch.float32)


def test_packed_position_ids_under_inference_mode(device):
    """Inference tensors have no version counter: the packed-boundary cache must not need one."""
    torch.manual_seed(2)
    lengths = [5, 17, 1, 9]
    with torch.inference_mode():
        q = torch.randn(1, 4, sum(lengths), 16, device=device)
        k = torch.randn(1, 2, sum(lengths), 16, device=device)
        v = torch.randn(1, 2, sum(lengths), 16, device=device)
        position_ids = torch.cat([torch.arange(n) for n in lengths]).view(1, -1).to(device)
        out, _ = hf_flash_attention_forward(_Attn(), q, k, v, None, position_ids=position_ids)
        ref = _separate_oracle(q, k, v, lengths)
    assert_close_to_ref("packed (inference mode)", out, ref, ref.float(), FWD_FACTOR, torch.float32)


def test_packing_found_by_the_mask_reaches_the_attention(device):
    """transformers folds packed sequences (from position_ids) into the mask function; models
    that do not pass position_ids to their layers (CTRL) still get them apart: the mask
    function returns each token's position within its sequence, which the attention function
    takes as position_ids. A window or plain causality separates nothing."""
    from transformers.masking_utils import (
        and_masks, causal_mask_function, find_packed_sequence_indices,
        packed_sequence_mask_function, sliding_window_overlay,
    )  # fmt: skip

    lengths = [5, 17, 1, 9]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).view(1, -1).to(device)
    packed = and_masks(  # as create_causal_mask combines them (5.17; later releases also remap)
        causal_mask_function, packed_sequence_mask_function(find_packed_sequence_indices(position_ids))
    )
    positions = hf_flash_mask(1, 32, 32, mask_function=packed, device=device)
    assert positions.dtype == torch.int64 and torch.equal(positions, position_ids)
    window = and_masks(sliding_window_overlay(4), causal_mask_function)
    assert hf_flash_mask(1, 32, 32, mask_function=window, device=device) is None
    assert hf_flash_mask(1, 32, 32, mask_function=causal_mask_function, device=device) is None
    torch.manual_seed(2)
    q = torch.randn(1, 4, 32, 16, device=device)
    k = torch.randn(1, 2, 32, 16, device=device)
    v = torch.randn(1, 2, 32, 16, device=device)
    out, _ = hf_flash_attention_forward(_Attn(), q, k, v, positions)  # no position_ids keyword
    ref = _separate_oracle(q, k, v, lengths)
    assert_close_to_ref("packed via the mask", out, ref, ref.float(), FWD_FACTOR, torch.float32)


def test_plain_position_ids_take_the_dense_path(device):
    q = torch.randn(2, 2, 12, 16, device=device)
    k = torch.randn(2, 2, 12, 16, device=device)
    pos = torch.arange(3, 15, device=device).view(1, -1)  # offset, but no restart
    out, _ = hf_flash_attention_forward(_Attn(), q, k, k, None, position_ids=pos)
    ref = _oracle(q, k, k, None, causal=True)
    assert_close_to_ref("dense", out, ref, ref.float(), FWD_FACTOR, torch.float32)


def test_fp32_inputs_run_in_the_module_half_dtype(device):
    """peft keeps layer norms in fp32 and hands over fp32 q/k/v: cast to the projections' dtype."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 10, 16, device=device) for _ in range(3))
    out, _ = hf_flash_attention_forward(_Attn(dtype=torch.float16), q, k, v, None)
    assert out.dtype == torch.float16
    ref = _oracle(q, k, v, None, causal=True)
    lp = _oracle(q.half(), k.half(), v.half(), None, causal=True, upcast=False)
    assert_close_to_ref("cast", out, ref, lp, FWD_FACTOR, torch.float16)
    out32, _ = hf_flash_attention_forward(_Attn(dtype=torch.float32), q, k, v, None)
    assert out32.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"output_attentions": True}, "output_attentions"),
        ({"cache": object()}, "PagedAttentionCache"),
        ({"sliding_window": 0}, "sliding_window"),
    ],
    ids=["output_attentions", "unknown-paged-cache", "bad-window"],
)
def test_unsupported_requests_raise(kwargs, match, device):
    q = torch.randn(1, 2, 4, 16, device=device)
    with pytest.raises(ValueError, match=match):
        hf_flash_attention_forward(_Attn(), q, q, q, None, **kwargs)


def test_four_d_mask_is_refused(device):
    q = torch.randn(1, 2, 4, 16, device=device)
    with pytest.raises(ValueError, match="2-D"):
        hf_flash_attention_forward(_Attn(), q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))


# ------------------------------------------------------------------------------------------
# mask function
# ------------------------------------------------------------------------------------------


def test_mask_none_without_padding_and_sliced_for_sliding_layers():
    full = torch.ones(2, 10, dtype=torch.bool)
    assert hf_flash_mask(2, 10, 10, attention_mask=full) is None
    padded = full.clone()
    padded[0, :3] = False
    got = hf_flash_mask(2, 10, 10, attention_mask=padded)
    assert torch.equal(got, padded)
    # a sliding layer's cache keeps the last kv_length keys: the mask is cut the same way
    got = hf_flash_mask(2, 1, 6, q_offset=9, kv_offset=4, attention_mask=padded)
    assert got is None  # the padding fell out of the window
    padded[1, 6] = False  # a hole inside a row: marked, so the attention gathers the tokens
    got = hf_flash_mask(2, 10, 10, attention_mask=padded)
    assert torch.equal(got, padded) and has_holes(got) and not has_holes(padded)


def test_mask_for_static_cache_without_user_mask():
    # static layers report their fill level as a tensor; the buffer holds kv_length slots
    got = hf_flash_mask(3, 2, 16, q_offset=torch.tensor(5), kv_offset=0, device="cpu")
    assert got.shape == (3, 7) and bool(got.all())
    assert hf_flash_mask(3, 2, 7, q_offset=5) is None  # dynamic cache: everything is valid


def test_static_decode_mask_has_the_cache_length(device):
    """One-token steps on a static layer get a (batch, kv_length) mask whatever the fill level,
    so a compiled decode step sees one input shape; the attention result is unchanged."""
    torch.manual_seed(7)
    user = torch.ones(2, 9, dtype=torch.bool)
    user[0, :4] = False  # left padding
    got = hf_flash_mask(2, 1, 16, q_offset=torch.tensor(8), attention_mask=user)
    assert got.shape == (2, 16)
    assert torch.equal(got[:, :9], user) and not got[:, 9:].any()
    no_user = hf_flash_mask(2, 1, 16, q_offset=torch.tensor(8), device="cpu")
    assert no_user.shape == (2, 16) and no_user[:, :9].all() and not no_user[:, 9:].any()
    # prefill (several queries) and dynamic caches (int offsets) keep the natural length
    assert hf_flash_mask(2, 3, 16, q_offset=torch.tensor(6), attention_mask=user).shape == (2, 9)
    assert hf_flash_mask(2, 1, 16, q_offset=8, attention_mask=user).shape == (2, 9)

    q = torch.randn(2, 4, 1, 16, dtype=torch.float32, device=device)
    k = torch.zeros(2, 2, 16, 16, dtype=torch.float32, device=device)
    v = torch.zeros_like(k)
    k[:, :, :9], v[:, :, :9] = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    module = _Attn(True, torch.float32)
    fixed, _ = hf_flash_attention_forward(module, q, k, v, got.to(device))
    natural, _ = hf_flash_attention_forward(module, q, k, v, user.to(device))
    assert torch.equal(fixed, natural)
    ref = _oracle(q, k, v, user.to(device), causal=True)
    assert torch.allclose(fixed, ref.to(fixed.dtype), atol=2e-5), (fixed - ref).abs().max()
    # the varlen path (taken e.g. with attention dropout) places the single query the same way
    from hf_flash.integration.attention import _padded_attention

    opts = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0)
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    varlen_fixed = _padded_attention(*bshd, got.to(device), True, opts)
    varlen_natural = _padded_attention(*bshd, user.to(device), True, opts)
    assert torch.allclose(varlen_fixed, ref.to(fixed.dtype), atol=2e-5)
    assert torch.equal(varlen_fixed, varlen_natural)


def test_static_decode_mask_is_never_none():
    """A static layer's one-token step gets a (batch, kv_length) mask even when every slot is
    valid (the step that fills the cache): None there would give a compiled decode step a second
    kind of input on its last step, hence a recompile and a second CUDA graph."""
    full = torch.ones(2, 16, dtype=torch.int64)
    got = hf_flash_mask(2, 1, 16, q_offset=torch.tensor(15), attention_mask=full)
    assert got is not None and got.shape == (2, 16) and bool(got.all())
    no_user = hf_flash_mask(2, 1, 16, q_offset=torch.tensor(15), device="cpu")
    assert no_user is not None and no_user.shape == (2, 16) and bool(no_user.all())
    # the same full mask elsewhere still means "no padding"
    assert hf_flash_mask(2, 1, 16, q_offset=15, attention_mask=full) is None
    assert hf_flash_mask(2, 4, 16, q_offset=torch.tensor(12), attention_mask=full) is None
    assert hf_flash_mask(2, 4, 16, q_offset=torch.tensor(12), device="cpu") is None


def test_static_decode_step_mask_with_a_hole_raises():
    """generate() continuing a right-padded prompt appends a 1 after the padding. With a static
    cache the step may be compiled, which cannot gather tokens: refused. With a dynamic cache the
    mask is marked and gathered (test_padding_inside_rows_matches_oracle, "decode")."""
    user = torch.ones(2, 7, dtype=torch.bool)
    user[1, 4:6] = False
    with pytest.raises(ValueError, match="padding inside a sequence"):
        hf_flash_mask(2, 1, 16, q_offset=torch.tensor(6), attention_mask=user)
    assert has_holes(hf_flash_mask(2, 1, 7, q_offset=6, attention_mask=user))


# ------------------------------------------------------------------------------------------
# padding inside a row (a 0 between two 1s): gathered, as flash_attention_2 unpads
# ------------------------------------------------------------------------------------------

HOLES = [
    # id, B, Hq, Hkv, Sq, Skv, invalid key positions per row, causal
    ("prefill", 3, 4, 2, 29, 29, [[3, 4, 10], [0, 1, 15], []], True),
    ("chunk", 2, 4, 1, 5, 30, [[2, 7, 27], [0, 12, 13]], True),
    ("decode", 2, 4, 2, 1, 24, [[5, 6, 7], [0, 20]], True),
    ("noncausal", 2, 4, 4, 21, 21, [[0, 9], [4, 5, 20]], False),
]


def _holey_mask(device, b, m, holes):
    mask = torch.ones(b, m, dtype=torch.bool, device=device)
    for r, cols in enumerate(holes):
        mask[r, cols] = False
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "b,hq,hkv,sq,skv,holes,causal", [pytest.param(*c[1:], id=c[0]) for c in HOLES]
)
def test_padding_inside_rows_matches_oracle(b, hq, hkv, sq, skv, holes, causal, dtype, device):
    """transformers' random test masks (and generate continuing a right-padded prompt) put
    padding inside rows: the valid tokens are gathered, so every real query sees exactly the
    valid keys at or before it (eager's result); padded query rows are zero (causal)."""
    torch.manual_seed(5)
    d = 16
    q = torch.randn(b, hq, sq, d, device=device, dtype=dtype) * 2
    k = torch.randn(b, hkv, skv, d, device=device, dtype=dtype) * 2
    v = torch.randn(b, hkv, skv, d, device=device, dtype=dtype)
    user = _holey_mask(device, b, skv, holes)
    mask = hf_flash_mask(b, sq, skv, q_offset=skv - sq, attention_mask=user)
    assert has_holes(mask)
    module = _Attn(causal, dtype)
    out, _ = hf_flash_attention_forward(module, q, k, v, mask)
    assert out.shape == (b, sq, hq, d) and out.dtype == dtype
    ref = _oracle(q, k, v, user, causal=causal)
    ref_lp = _oracle(q, k, v, user, causal=causal, upcast=False)
    rows = _query_rows(device, user, sq, b)
    if not causal:  # every query row is kept (a pure key-padding mask, as eager)
        rows = torch.ones_like(rows)
    assert_close_to_ref("out", out[rows], ref[rows], ref_lp[rows], FWD_FACTOR, dtype)
    assert torch.all(out[~rows] == 0)


# ------------------------------------------------------------------------------------------
# per-forward-pass cache of the decode path's key bounds
# ------------------------------------------------------------------------------------------


def _decode_inputs(device, seed, b=2, skv=24):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, 16, generator=g).to(device)
               for h, s in ((4, 1), (2, skv), (2, skv)))  # fmt: skip
    return q, k, v


def _assert_decode_matches_oracle(device, q, k, v, mask):
    out, _ = hf_flash_attention_forward(_Attn(), q, k, v, mask)
    ref = _oracle(q, k, v, mask, causal=True).to(out.dtype)
    rows = _query_rows(device, mask, 1, q.shape[0])
    assert torch.allclose(out[rows], ref[rows], atol=2e-5), (out[rows] - ref[rows]).abs().max()


def test_decode_key_bounds_follow_in_place_mask_changes(device):
    """The decode path computes a mask's row bounds once per mask tensor (every layer of a
    forward pass gets the same one). The same tensor modified in place, directly or through its
    base, must not reuse them."""
    q, k, v = _decode_inputs(device, 0)
    mask = _mask(device, 2, 24, [(5, 0), (0, 0)])
    for _ in range(2):  # the second call is served from the cache
        _assert_decode_matches_oracle(device, q, k, v, mask)
    mask[0, :5] = True
    mask[1, :9] = False
    _assert_decode_matches_oracle(device, q, k, v, mask)
    view = mask[:, 4:]  # a view shares its base's version counter
    _assert_decode_matches_oracle(device, q, k[:, :, 4:], v[:, :, 4:], view)
    mask[0, :11] = False
    _assert_decode_matches_oracle(device, q, k[:, :, 4:], v[:, :, 4:], view)
    _assert_decode_matches_oracle(device, q, k, v, mask.clone())  # another tensor, same values


def test_decode_key_bounds_from_the_mask_function_are_reused_safely(device):
    """hf_flash_mask reads each row's bounds for its padding check and leaves them for the
    decode layers of the same pass, keyed on the mask it returns (a bool copy of the user's):
    changing that mask in place afterwards must invalidate them."""
    q, k, v = _decode_inputs(device, 1)
    user = _mask(device, 2, 24, [(3, 0), (0, 0)]).long()  # generate's dtype
    got = hf_flash_mask(2, 1, 24, q_offset=23, attention_mask=user)
    assert got is not None and got.dtype == torch.bool
    _assert_decode_matches_oracle(device, q, k, v, got)
    got[1, :6] = False
    _assert_decode_matches_oracle(device, q, k, v, got)


def test_decode_key_bounds_under_inference_mode(device):
    """Inference tensors have no version counter: their bounds are never cached, and in-place
    changes are still seen."""
    with torch.inference_mode():
        q, k, v = _decode_inputs(device, 2)
        mask = _mask(device, 2, 24, [(5, 0), (0, 0)])
        _assert_decode_matches_oracle(device, q, k, v, mask)
        mask[1, :7] = False
        _assert_decode_matches_oracle(device, q, k, v, mask)
        got = hf_flash_mask(2, 1, 24, q_offset=23, attention_mask=mask)
        _assert_decode_matches_oracle(device, q, k, v, got)


def test_custom_mask_functions_are_refused():
    with pytest.raises(ValueError, match="custom mask function"):
        hf_flash_mask(1, 4, 4, use_vmap=True)


def test_oracle_sanity():
    """The oracle itself: a left-padded row equals the same tokens run unpadded."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(1, 8, dtype=torch.bool)
    mask[0, :3] = False
    padded = _oracle(q, k, v, mask, causal=True)[:, 3:]
    alone = _oracle(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], None, causal=True)
    assert math.isclose(float((padded - alone).abs().max()), 0.0, abs_tol=1e-12)


def test_cached_key_bounds_die_with_their_mask(device):
    """The decode path's per-mask bounds are freed when the mask is (not at the next store):
    device tensors outliving their forward pass shift the allocator's pattern between generate
    calls (see hf_flash._runtime.TensorKeyedCache)."""
    import gc
    import weakref

    from hf_flash.integration import masks

    q, k, v = _decode_inputs(device, 3)
    mask = _mask(device, 2, 24, [(5, 0), (0, 0)])
    _assert_decode_matches_oracle(device, q, k, v, mask)
    blocks = masks.KEY_BLOCKS.get(mask)
    assert blocks is not None, "the bounds were not cached: the test checks nothing"
    start = weakref.ref(blocks[0])
    entries = len(masks.KEY_BLOCKS)
    del blocks, mask
    gc.collect()
    assert len(masks.KEY_BLOCKS) == entries - 1
    assert start() is None


def test_cached_packed_boundaries_die_with_their_position_ids(device):
    import gc

    from hf_flash import _packing

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]], device=device)
    found = _packing.packed_boundaries(pos, 1, 8)
    assert found is not None and _packing.BOUNDARIES.holds(pos)
    assert found[0].tolist() == [0, 3, 5, 8] and found[1] == 3
    assert _packing.packed_boundaries(pos, 1, 8) is found  # the second layer reads no boundary
    del pos, found
    gc.collect()
    assert len(_packing.BOUNDARIES) == 0


def test_mask_pieces_that_cannot_separate_sequences_are_not_evaluated():
    """hf_flash_mask evaluates a mask function (one host read) only when it may hide a token's
    predecessor: not for transformers' causal or windowed (>= 2) masks, yes for packed
    sequences, a window of one, and any function transformers did not build."""
    import torch
    from transformers import masking_utils as m

    from hf_flash.integration.masks import _may_separate

    assert not _may_separate(m.causal_mask_function)
    assert not _may_separate(m.sliding_window_causal_mask_function(8))
    assert _may_separate(m.and_masks(m.causal_mask_function, m.sliding_window_overlay(1)))
    packed = m.packed_sequence_mask_function(torch.tensor([[0, 0, 1, 1]]))
    assert _may_separate(m.and_masks(m.sliding_window_causal_mask_function(8), packed))
    assert _may_separate(lambda b, h, q, kv: q >= kv)
