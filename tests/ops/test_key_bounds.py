"""Per-row key ranges (``key_bounds``): forward and gradients against the oracle, the tile
skipping, bad input, and the path choice (never the Gluon Hopper kernels).

The ranges of gemma3's vision-to-text masks are built here the way the integration builds them
(causal, or sliding-window causal, OR the image block that holds the row); shapes span several
16 x 16 interpreter tiles so that masked, unmasked and skipped tiles all occur.
"""

from __future__ import annotations

import pytest
import torch

from hf_flash import flash_attn_func, flash_attn_varlen_func
from hf_flash.reference import (
    FWD_FACTOR,
    assert_close_to_ref,
    assert_grads_close_to_ref,
    attention_ref,
    attention_varlen_ref,
)


def image_bounds(seqlen: int, blocks, window: int = -1, shift: int = 0, device="cpu", or_window=False):
    """int32 (seqlen, 2) ranges of causal (or window-causal: ``i - window < j <= i``) attention
    AND-ed with the window but OR-ed with each row's image block ``[start, end)`` (gemma3's
    local layers: window AND (causal OR block)); ``or_window``: (window causal) OR block instead.
    Query i sits at key position ``i + shift``."""
    pos = torch.arange(seqlen, device=device) + shift
    lo = torch.zeros_like(pos) if window < 0 else (pos - window + 1).clamp(min=0)
    hi = pos + 1
    for start, end in blocks:
        inside = (pos >= start) & (pos < end)
        hi = torch.where(inside, torch.maximum(hi, torch.full_like(hi, end)), hi)
        if or_window:
            lo = torch.where(inside, torch.minimum(lo, torch.full_like(lo, start)), lo)
    return torch.stack([lo, hi], dim=-1).to(torch.int32)


def _qkv(device, batch, sq, sk, h, hk, d, dtype):
    def mk(*shape):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()

    return mk(batch, sq, h, d), mk(batch, sk, hk, d), mk(batch, sk, hk, d)


def _check(device, q, k, v, bounds, dtype, grads=True, **opts):
    out, lse, _ = flash_attn_func(q, k, v, key_bounds=bounds, return_attn_probs=True, **opts)
    ref, ref_lse = attention_ref(q, k, v, key_bounds=bounds, return_lse=True, **opts)
    ref_lp = attention_ref(q, k, v, key_bounds=bounds, upcast=False, **opts)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse must be +inf exactly for empty rows"
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-3)
    if grads:
        assert_grads_close_to_ref(out, ref, ref_lp, (q, k, v), torch.randn_like(out), dtype)


CASES = [
    # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, per-batch (blocks, window, or_window))
    pytest.param(2, 70, 70, 4, 2, 32, [([(9, 41)], -1, False), ([(3, 5), (50, 70)], -1, False)],
                 id="gqa-causal-blocks"),
    pytest.param(1, 75, 75, 2, 1, 40, [([(16, 48), (48, 53)], 20, False)], id="window-and-blocks"),
    pytest.param(1, 66, 66, 2, 2, 32, [([(20, 60)], 12, True)], id="window-or-blocks"),
    pytest.param(2, 33, 80, 2, 1, 32, [([(50, 66)], -1, False), ([], 9, False)], id="sq<sk"),
    pytest.param(1, 1, 40, 4, 4, 32, [([(30, 40)], -1, False)], id="one-query"),
]


@pytest.mark.parametrize("batch,sq,sk,h,hk,d,rows", CASES)
def test_image_block_bounds_match_reference(batch, sq, sk, h, hk, d, rows, device):
    dtype = torch.float16  # float32 runs in the varlen test (one kernel code path for both)
    torch.manual_seed(sq + sk)
    q, k, v = _qkv(device, batch, sq, sk, h, hk, d, dtype)
    bounds = torch.stack([
        image_bounds(sq, blocks, window, sk - sq, device, or_window) for blocks, window, or_window in rows
    ])  # fmt: skip
    _check(device, q, k, v, bounds, dtype)


def test_arbitrary_bounds_and_empty_rows(device):
    """Ranges that are not causal-like (ends that go down, empty and out-of-range rows): the
    visited tiles cover them and nothing outside a row's range leaks in."""
    torch.manual_seed(7)
    batch, s, dtype = 2, 57, torch.float16
    q, k, v = _qkv(device, batch, s, s, 2, 1, 32, dtype)
    lo = torch.randint(-5, s, (batch, s), device=device)
    hi = lo + torch.randint(-3, 40, (batch, s), device=device)
    hi[0, 10:14] = lo[0, 10:14]  # empty rows
    hi[1, 20] = s + 30  # past the keys: clamped
    _check(device, q, k, v, torch.stack([lo, hi], -1).to(torch.int32), dtype)


def test_full_and_causal_bounds_equal_the_plain_calls(device):
    """Bounds that say "everything" / "causal" give the plain calls' results (unmasked tiles
    and diagonal tiles run as the plain kernels run them)."""
    torch.manual_seed(3)
    q, k, v = (t.detach() for t in _qkv(device, 2, 64, 64, 2, 2, 32, torch.float32))
    full = torch.tensor([0, 64], dtype=torch.int32, device=device).expand(2, 64, 2)
    assert torch.allclose(flash_attn_func(q, k, v, key_bounds=full), flash_attn_func(q, k, v), atol=1e-6)
    causal = image_bounds(64, [], device=device).expand(2, 64, 2)
    assert torch.allclose(
        flash_attn_func(q, k, v, key_bounds=causal), flash_attn_func(q, k, v, causal=True), atol=1e-6
    )


def test_varlen_bounds_match_reference(device):
    dtype = torch.float32
    torch.manual_seed(5)
    lens_q, lens_k = [40, 1, 35], [40, 20, 50]
    h, hk, d = 4, 2, 32
    q = torch.randn(sum(lens_q), h, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, d, device=device, dtype=dtype, requires_grad=True)
    cu_q = torch.tensor([0, 40, 41, 76], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 40, 60, 110], dtype=torch.int32, device=device)
    bounds = torch.cat([
        image_bounds(40, [(5, 30)], device=device),
        image_bounds(1, [], 7, 19, device),
        image_bounds(35, [(20, 45)], 10, 15, device),
    ])  # fmt: skip
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 50, key_bounds=bounds)
    ref = attention_varlen_ref(q, k, v, cu_q, cu_k, key_bounds=bounds)
    ref_lp = attention_varlen_ref(q, k, v, cu_q, cu_k, key_bounds=bounds, upcast=False)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
    assert_grads_close_to_ref(out, ref, ref_lp, (q, k, v), torch.randn_like(out), dtype)


def test_bad_bounds_raise(device):
    q, k, v = (t.detach() for t in _qkv(device, 2, 8, 8, 2, 1, 16, torch.float16))
    good = image_bounds(8, [(2, 5)], device=device).expand(2, 8, 2)
    cases = [
        (dict(key_bounds=good.long()), ValueError, "int32 tensor of shape \\(2, 8, 2\\)"),
        (dict(key_bounds=good[:1]), ValueError, "shape \\(2, 8, 2\\)"),
        (dict(key_bounds=good[..., :1]), ValueError, "shape"),
        (dict(key_bounds=[[0, 1]]), TypeError, "must be a torch.Tensor"),
        (dict(key_bounds=good, causal=True), ValueError, "replaces the causal"),
        (dict(key_bounds=good, window_size=(4, 0)), ValueError, "replaces the causal"),
        (dict(key_bounds=good, dropout_p=0.1, return_attn_probs=True), ValueError, "return_attn_probs"),
    ]
    for kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            flash_attn_func(q, k, v, **kwargs)
    if device == "cpu":
        with pytest.raises(ValueError, match="key_bounds is on"):
            flash_attn_func(q, k, v, key_bounds=good.to("meta"))
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="shape \\(8, 2\\)"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, key_bounds=good)


def test_calls_with_bounds_never_take_the_hopper_kernels(monkeypatch, device):
    """The path choice (attention_paths = flash_fwd.forward_path / flash_bwd.backward_path): with
    the Gluon kernels available and willing, a call with key bounds still runs Triton."""
    from hf_flash.interface import attention_paths
    from hf_flash.kernels import configs
    from hf_flash.kernels.hopper import attention_bwd, attention_fwd

    monkeypatch.setattr(configs, "hopper_enabled", lambda device: True)
    monkeypatch.setattr(configs, "hopper_backward_enabled", lambda device: True)
    monkeypatch.setattr(attention_fwd, "supports", lambda *a, **kw: True)
    monkeypatch.setattr(attention_bwd, "supports", lambda *a, **kw: True)
    q, k, v = (t.detach() for t in _qkv(device, 1, 64, 64, 2, 2, 128, torch.float16))
    bounds = image_bounds(64, [(8, 40)], device=device)[None]
    assert attention_paths(q, k, v) == {"forward": "hopper", "backward": "hopper"}
    assert attention_paths(q, k, v, key_bounds=bounds) == {"forward": "triton", "backward": "triton"}


def test_backward_pre_pass_gives_each_key_tile_its_query_rows(device):
    """The dK/dV kernel's query rows per key tile: every row that sees a key of the tile lies in
    [first, end), and with causal-like ranges (ends never decreasing) nothing else does; the
    rows that see the whole tile, [full_first, full_end), only when they are contiguous."""
    from hf_flash.kernels.flash_bwd import _bwd_bounds_pre_pass

    s, block_n = 70, 16
    bounds = torch.stack([
        image_bounds(s, [(9, 41)], device=device),
        image_bounds(s, [(20, 60)], 12, 0, device, or_window=True),
    ])  # fmt: skip
    bounds[1, 30, 1] = 0  # an empty row among full ones: not contiguous any more
    tiles = -(-s // block_n)
    runs = torch.full((2, tiles, 4), -7, dtype=torch.int32, device=device)
    _bwd_bounds_pre_pass[(tiles, 2)](
        bounds, runs, None, None, bounds.stride(0), bounds.stride(1), runs.stride(0), s, s,
        BLOCK_M=32, BLOCK_N=block_n, IS_VARLEN=False,
    )  # fmt: skip
    lo, hi = bounds[..., 0].long(), bounds[..., 1].long()
    rows = torch.arange(s, device=device)
    for b in range(2):
        for t in range(tiles):
            n0, n1 = t * block_n, min(t * block_n + block_n, s)
            sees = rows[(lo[b] < n1) & (hi[b] > n0) & (lo[b] < hi[b])]
            full = rows[(lo[b] <= n0) & (hi[b] >= n0 + block_n)]
            want = [int(sees.min()), int(sees.max()) + 1] if sees.numel() else [0, 0]
            contiguous = full.numel() and int(full.max() - full.min()) + 1 == full.numel()
            want += [int(full.min()), int(full.max()) + 1] if contiguous else [0, 0]
            assert runs[b, t].tolist() == want, (b, t)
