"""Attention kernels against the oracle: forward, backward, every feature, bad input.

On a machine without a GPU these run the real Triton kernels through Triton's interpreter, on
small shapes that still span several tiles (the interpreter uses 16 x 16 tiles). The GPU grid is
in test_flash_attn_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_flash import flash_attn_func, flash_attn_varlen_func
from hf_flash.interface import _new_rng_state
from hf_flash.kernels import flash_bwd, flash_fwd
from hf_flash.kernels.flash_common import dropout_keep_mask
from hf_flash.reference import (
    FWD_FACTOR,
    GRAD_FACTOR,
    assert_close_to_ref,
    assert_grads_close_to_ref,
    attention_ref,
    attention_varlen_ref,
    poisoned_like,
)


def _qkv(device, batch, sq, sk, h, hk, d, dtype, requires_grad=True):
    def mk(*shape):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(requires_grad)

    return mk(batch, sq, h, d), mk(batch, sk, hk, d), mk(batch, sk, hk, d)


def test_error_rule_floor_is_one_rounding_at_the_elements_magnitude():
    """The rule's floor is one rounding of each element: one bf16 ulp off a reference of
    magnitude ~5.7 passes even when the low-precision oracle's error is 0 (a sum such as the sink
    gradient near a rounding boundary), two ulps there fail, and at unit scale the floor stays
    8e-3."""
    ref = torch.tensor([-5.6875, 0.5], dtype=torch.bfloat16)
    one_ulp = torch.tensor([-5.65625, 0.5], dtype=torch.bfloat16)
    assert_close_to_ref("x", one_ulp, ref, ref, GRAD_FACTOR, torch.bfloat16)
    with pytest.raises(AssertionError, match="x: max err 6.250e-02"):
        two_ulps = torch.tensor([-5.625, 0.5], dtype=torch.bfloat16)
        assert_close_to_ref("x", two_ulps, ref, ref, GRAD_FACTOR, torch.bfloat16)
    with pytest.raises(AssertionError, match="floor 8.0e-03"):  # 0.5 + 1/64: above unit floor
        assert_close_to_ref("x", torch.tensor([-5.6875, 0.515625]), ref, ref, GRAD_FACTOR,
                            torch.bfloat16)  # fmt: skip
    with pytest.raises(AssertionError):  # NaN never passes
        assert_close_to_ref("x", torch.tensor([float("nan"), 0.5]), ref, ref, GRAD_FACTOR,
                            torch.bfloat16)  # fmt: skip


def _check_dense(device, batch, sq, sk, h, hk, d, dtype, grads=True, **opts):
    q, k, v = _qkv(device, batch, sq, sk, h, hk, d, dtype, requires_grad=grads)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, upcast=True, **opts)
    ref_lp = attention_ref(q, k, v, upcast=False, **opts)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse must be +inf exactly for empty rows"
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-3 if dtype != torch.float32 else 1e-5)
    if not grads:
        return
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    g_ref = torch.autograd.grad(ref, (q, k, v), dout.float())
    g_lp = torch.autograd.grad(ref_lp, (q, k, v), dout)
    for name, a, r, lp in zip(("dq", "dk", "dv"), g, g_ref, g_lp):
        assert a.shape == r.shape and a.dtype == dtype
        assert_close_to_ref(name, a, r, lp, GRAD_FACTOR, dtype)


CASES = [
    # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, options)
    pytest.param(1, 1, 1, 1, 1, 32, {}, id="s1"),
    pytest.param(2, 33, 33, 2, 2, 32, {}, id="mha-noncausal"),
    pytest.param(2, 47, 47, 4, 2, 64, {"causal": True}, id="gqa-causal"),
    pytest.param(1, 40, 40, 4, 1, 40, {"causal": True}, id="mqa-causal-d40"),
    pytest.param(1, 17, 50, 2, 1, 32, {"causal": True}, id="sq<sk-causal"),
    pytest.param(1, 50, 17, 2, 1, 32, {"causal": True}, id="sq>sk-causal-emptyrows"),
    pytest.param(1, 1, 45, 4, 2, 32, {"causal": True}, id="decode-row"),
    pytest.param(1, 64, 64, 2, 1, 32, {"causal": True, "window_size": (12, 0)}, id="causal-window"),
    pytest.param(1, 48, 48, 2, 2, 32, {"window_size": (9, 20)}, id="window-both"),
    pytest.param(1, 30, 52, 2, 2, 32, {"window_size": (-1, 3)}, id="window-right"),
    pytest.param(1, 40, 40, 2, 2, 32, {"causal": True, "softcap": 1.5}, id="softcap"),
    pytest.param(
        2, 40, 40, 2, 1, 32, {"alibi_slopes": "per-batch", "causal": True}, id="alibi-batch"
    ),
    pytest.param(1, 37, 37, 2, 2, 80, {"softmax_scale": 0.3}, id="d80-scale"),
    pytest.param(1, 20, 20, 2, 1, 96, {"causal": True}, id="d96"),
    pytest.param(1, 18, 18, 1, 1, 256, {"causal": True}, id="d256"),
    pytest.param(1, 21, 21, 1, 1, 59, {}, id="d59-odd"),
]


def _materialise(device, opts, batch, h):
    opts = dict(opts)
    if opts.get("alibi_slopes") == "per-batch":
        opts["alibi_slopes"] = torch.rand(batch, h, device=device, dtype=torch.float32)
    return opts


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("batch,sq,sk,h,hk,d,opts", CASES)
def test_dense_matches_reference(batch, sq, sk, h, hk, d, opts, dtype, device):
    torch.manual_seed(sq * 1000 + sk)
    _check_dense(device, batch, sq, sk, h, hk, d, dtype, **_materialise(device, opts, batch, h))


def test_bf16_load_store_path(device):
    # The interpreter multiplies bf16 tiles in fp32 (its bf16 tl.dot is broken); this still
    # covers bf16 loads, conversions and stores. The GPU suite covers bf16 tensor cores.
    torch.manual_seed(1)
    _check_dense(device, 1, 33, 33, 2, 1, 32, torch.bfloat16, causal=True)


def test_every_output_element_written(device):
    """Launch into NaN-filled buffers: any element the kernels skip stays NaN."""
    torch.manual_seed(2)
    dtype = torch.float16
    # sq > sk leaves empty rows, which must be written as zeros / +inf
    q, k, v = _qkv(device, 2, 37, 21, 4, 2, 40, dtype, requires_grad=False)
    out = poisoned_like(q)
    lse = torch.full((2, 4, 37), float("nan"), device=device)
    kw = dict(
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=37, max_seqlen_k=21,
        softmax_scale=40**-0.5, causal=True, window_left=-1, window_right=0, softcap=0.0,
        alibi_slopes=None, dropout_p=0.0, rng_state=None,
    )  # fmt: skip
    flash_fwd.flash_attn_forward(q, k, v, out, lse, **kw)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:, :16] == 0).all(), "rows with no visible key must be exactly 0"
    assert torch.isinf(lse[:, :, :16]).all()
    dout = torch.randn_like(q)
    dq, dk, dv = poisoned_like(q), poisoned_like(k), poisoned_like(v)
    flash_bwd.flash_attn_backward(dout, None, q, k, v, out, lse, dq, dk, dv, **kw)
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not t.isnan().any(), f"{name} has unwritten (NaN) elements"
    assert (dq[:, :16] == 0).all()


def test_fully_masked_rows_are_zero_and_gradients_finite(device):
    torch.manual_seed(3)
    q, k, v = _qkv(device, 1, 40, 8, 2, 2, 32, torch.float32)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert (out[:, :32] == 0).all() and torch.isinf(lse[..., :32]).all()
    (out.sum() + 0 * lse[torch.isfinite(lse)].sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def _cu(device, lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


@pytest.mark.parametrize(
    "lens_q,lens_k,opts",
    [
        pytest.param([5, 33, 1, 20], [5, 33, 1, 20], {"causal": True}, id="packed-causal"),
        pytest.param([7, 0, 30], [19, 4, 30], {"causal": True}, id="chunked-with-empty"),
        pytest.param([25, 18], [25, 18], {"window_size": (6, 0), "causal": True}, id="window"),
        pytest.param([12, 29], [12, 29], {"softcap": 2.0, "alibi_slopes": True}, id="softcap-alibi"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_varlen_matches_reference(lens_q, lens_k, opts, dtype, device):
    torch.manual_seed(len(lens_q))
    h, hk, d = 4, 2, 32
    opts = dict(opts)
    if opts.get("alibi_slopes"):
        opts["alibi_slopes"] = torch.rand(len(lens_q), h, device=device)
    q = torch.randn(sum(lens_q), h, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, d, device=device, dtype=dtype, requires_grad=True)
    cu_q, cu_k = _cu(device, lens_q), _cu(device, lens_k)
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_attn_probs=True, **opts
    )
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    ref_lp = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, **opts)
    assert lse.shape == (h, sum(lens_q))
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-3)
    assert_grads_close_to_ref(out, ref, ref_lp, (q, k, v), torch.randn_like(out), dtype)


def test_varlen_equals_separate_dense_calls(device):
    """No attention across sequence boundaries: packed == each sequence alone."""
    torch.manual_seed(4)
    lens = [9, 26, 14]
    q = torch.randn(sum(lens), 2, 32, device=device)
    k = torch.randn(sum(lens), 1, 32, device=device)
    v = torch.randn(sum(lens), 1, 32, device=device)
    cu = _cu(device, lens)
    packed = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = flash_attn_func(q[None, s:e], k[None, s:e], v[None, s:e], causal=True)[0]
        assert torch.allclose(packed[s:e], alone, atol=1e-6)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_dropout_mask_is_replayed_by_backward(varlen, device):
    torch.manual_seed(5)
    p, h, hk, d = 0.3, 2, 1, 32
    dtype = torch.float32
    lens = [23, 31]
    if varlen:
        q = torch.randn(sum(lens), h, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(sum(lens), hk, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(sum(lens), hk, d, device=device, dtype=dtype, requires_grad=True)
        cu = _cu(device, lens)
        call = lambda: flash_attn_varlen_func(  # noqa: E731
            q, k, v, cu, cu, max(lens), max(lens), dropout_p=p, causal=True
        )
    else:
        q, k, v = _qkv(device, 2, 31, 31, h, hk, d, dtype)
        call = lambda: flash_attn_func(q, k, v, dropout_p=p, causal=True)  # noqa: E731
    torch.manual_seed(123)
    out = call()
    torch.manual_seed(123)
    assert torch.equal(out, call()), "same seed must give the same dropout mask"
    torch.manual_seed(123)
    rng = _new_rng_state(device)
    keep = dropout_keep_mask(rng, 2, h, 31, 31, p)
    rate = keep.float().mean().item()
    assert abs(rate - (1 - p)) < 0.05, f"keep rate {rate:.3f} far from {1 - p}"
    if varlen:
        masks = [keep[b : b + 1, :, :n, :n] for b, n in enumerate(lens)]
        ref = attention_varlen_ref(q, k, v, cu, cu, causal=True, dropout_p=p, dropout_keep=masks)
    else:
        ref = attention_ref(q, k, v, causal=True, dropout_p=p, dropout_keep=keep)
    assert_close_to_ref("out", out, ref, ref, FWD_FACTOR, dtype)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    g_ref = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, r in zip(("dq", "dk", "dv"), g, g_ref):
        assert_close_to_ref(name, a, r, r, GRAD_FACTOR, dtype)


def test_gradient_through_lse(device):
    torch.manual_seed(6)
    q, k, v = _qkv(device, 1, 29, 29, 2, 1, 32, torch.float32)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    w = torch.randn_like(lse)
    g = torch.autograd.grad(out.square().sum() + (lse * w).sum(), (q, k, v))
    ref, ref_lse = attention_ref(q, k, v, causal=True, return_lse=True)
    g_ref = torch.autograd.grad(ref.square().sum() + (ref_lse * w).sum(), (q, k, v))
    for name, a, r in zip(("dq", "dk", "dv"), g, g_ref):
        assert_close_to_ref(name, a, r, r, GRAD_FACTOR, torch.float32)


def test_backward_is_deterministic(device):
    torch.manual_seed(7)
    q, k, v = _qkv(device, 1, 40, 40, 4, 1, 32, torch.float16)
    out = flash_attn_func(q, k, v, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    g1 = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    g2 = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_non_contiguous_inputs(device):
    """transformers hands (B, H, S, D) tensors transposed to (B, S, H, D): strided views."""
    torch.manual_seed(8)
    qh = torch.randn(2, 4, 35, 32, device=device)
    kh = torch.randn(2, 2, 35, 32, device=device)
    vh = torch.randn(2, 2, 35, 32, device=device)
    q, k, v = (t.transpose(1, 2) for t in (qh, kh, vh))
    out = flash_attn_func(q, k, v, causal=True)
    ref = attention_ref(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert_close_to_ref("out", out, ref, ref, FWD_FACTOR, torch.float32)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    batch=st.integers(1, 2),
    sq=st.integers(1, 40),
    sk=st.integers(1, 40),
    hk=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    d=st.sampled_from([16, 24, 32, 48]),
    causal=st.booleans(),
    left=st.sampled_from([-1, 0, 5]),
    right=st.sampled_from([-1, 0, 7]),
    softcap=st.sampled_from([0.0, 3.0]),
)
def test_random_shapes_and_options(
    batch, sq, sk, hk, group, d, causal, left, right, softcap, device
):
    torch.manual_seed(sq * 41 + sk)
    _check_dense(
        device, batch, sq, sk, hk * group, hk, d, torch.float32,
        causal=causal, window_size=(left, right), softcap=softcap,
    )  # fmt: skip


def test_compile_fullgraph_forward_and_backward(device):
    torch.manual_seed(9)
    q, k, v = _qkv(device, 1, 24, 24, 2, 1, 32, torch.float32)

    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=True).sum()

    # aot_eager traces through the custom ops' fake functions and autograd formula exactly like
    # inductor does, without compiling C++ on CPU.
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    g = torch.autograd.grad(loss, (q, k, v))
    loss_e = f(q, k, v)
    g_e = torch.autograd.grad(loss_e, (q, k, v))
    assert torch.equal(loss, loss_e)
    assert all(torch.equal(a, b) for a, b in zip(g, g_e))


# ------------------------------------------------------------------------------------------
# Bad input: clear errors before any launch
# ------------------------------------------------------------------------------------------


def _good(device):
    return _qkv(device, 1, 8, 8, 4, 2, 32, torch.float16, requires_grad=False)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda q, k, v: (q.float(), k, v), TypeError, "share one dtype"),
        (lambda q, k, v: (q.to(torch.int32), k, v), TypeError, "supports float16"),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "multiple of nheads_k"),
        (lambda q, k, v: (q, k, v[:, :, :1]), ValueError, "heads but v has"),
        (lambda q, k, v: (q[..., :16], k, v), ValueError, "head dims differ"),
        (lambda q, k, v: (q[0], k, v), ValueError, "must be 4-D"),
        (lambda q, k, v: (q.expand(2, -1, -1, -1), k, v), ValueError, "batch sizes differ"),
        (lambda q, k, v: (q, k, v[:, :5]), ValueError, "seqlen"),
    ],
    ids=["dtype-mismatch", "int-dtype", "heads-not-divisible", "kv-heads", "headdim",
         "rank", "batch", "kv-seqlen"],  # fmt: skip
)
def test_bad_inputs_raise(mutate, exc, match, device):
    q, k, v = mutate(*_good(device))
    with pytest.raises(exc, match=match):
        flash_attn_func(q, k, v)


def test_bad_options_raise(device):
    q, k, v = _good(device)
    for bad in ((-1,), (4, 0, 1), (2.0, 0), (True, 0), torch.tensor([1.5, 0.0])):
        with pytest.raises(ValueError, match="window_size"):
            flash_attn_func(q, k, v, window_size=bad)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_func(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="alibi_slopes has shape"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(3, device=device))
    with pytest.raises(TypeError, match="alibi_slopes must be float32"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(4, device=device, dtype=torch.float16))
    big = torch.randn(1, 4, 1, 520, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim=520"):
        flash_attn_func(big, big, big)


def test_bad_cu_seqlens_raise(device):
    q = torch.randn(10, 2, 32, device=device, dtype=torch.float16)
    good = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    cases = [
        (good.long(), "int32"),
        (torch.tensor([1, 4, 10], dtype=torch.int32, device=device), "start at 0"),
        (torch.tensor([0, 6, 4, 10], dtype=torch.int32, device=device), "non-decreasing"),
        (torch.tensor([0, 4, 9], dtype=torch.int32, device=device), "number of packed tokens"),
    ]
    for cu, match in cases:
        with pytest.raises(ValueError, match=match):
            flash_attn_varlen_func(q, q, q, cu, good, 6, 6)
    with pytest.raises(ValueError, match="max_seqlen"):
        flash_attn_varlen_func(q, q, q, good, good, 5, 6)
    # paged k/v (block_table): the page-table checks come first, before any shape complaint
    with pytest.raises(ValueError, match="paged caches of one shape"):
        flash_attn_varlen_func(q, q, q, good, good, 6, 6, block_table=good)
    pages = torch.zeros(2, 4, q.shape[1], q.shape[2], device=device, dtype=q.dtype)
    with pytest.raises(ValueError, match="expected \\(2, max_pages"):
        flash_attn_varlen_func(q, pages, pages, good, good, 6, 6, block_table=good)
    with pytest.raises(ValueError, match="holds 1 pages of 4 = 4"):
        table = torch.zeros(2, 1, dtype=torch.int32, device=device)
        flash_attn_varlen_func(q, pages, pages, good, good, 6, 6, block_table=table)
    with pytest.raises(ValueError, match="outside the 2 pages"):
        table = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32, device=device)
        flash_attn_varlen_func(q, pages, pages, good, good, 6, 6, block_table=table)
    with pytest.raises(ValueError, match="gradients through paged K/V"):
        table = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32, device=device)
        flash_attn_varlen_func(q, pages.requires_grad_(), pages, good, good, 6, 6, block_table=table)


@pytest.mark.parametrize("page_size", [4, 16])
def test_varlen_paged_kv_equals_contiguous(device, page_size):
    """flash_attn_varlen_func with block_table (flash-attn's paged varlen) gives exactly the
    output of the same keys passed contiguously: pages scattered in a shuffled order, uneven
    lengths, an empty sequence, GQA, causal bottom-right and a window."""
    torch.manual_seed(3)
    hq, hk, d = 4, 2, 32
    lens_q, lens_k = [5, 0, 9], [13, 0, 21]
    cu_q = torch.tensor([0, 5, 5, 14], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 13, 13, 34], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), hq, d, device=device, dtype=torch.float16)
    k = torch.randn(sum(lens_k), hk, d, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    max_pages = -(-max(lens_k) // page_size) + 1  # one spare page per row
    num_pages = len(lens_k) * max_pages + 3
    perm = torch.randperm(num_pages).tolist()
    k_pages = torch.randn(num_pages, page_size, hk, d, device=device, dtype=q.dtype)  # junk
    v_pages = torch.randn_like(k_pages)
    table = torch.zeros(len(lens_k), max_pages, dtype=torch.int32)
    start = 0
    for b, n in enumerate(lens_k):
        for j in range(max_pages):
            table[b, j] = perm.pop()
        for t in range(n):
            page, row = table[b, t // page_size], t % page_size
            k_pages[page, row], v_pages[page, row] = k[start + t], v[start + t]
        start += n
    table = table.to(device)
    for kw in (dict(causal=True), dict(causal=False, window_size=(6, 2))):
        want = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 21, **kw)
        got = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 9, 21, block_table=table, **kw)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-specific message")
def test_cpu_tensors_without_interpreter_raise(monkeypatch, device):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _good(device)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        flash_attn_func(q, k, v)


def test_default_scale_is_inverse_sqrt_headdim(device):
    torch.manual_seed(10)
    q, k, v = _qkv(device, 1, 12, 12, 1, 1, 32, torch.float32, requires_grad=False)
    a = flash_attn_func(q, k, v)
    b = flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(32))
    assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_forms_equal_the_unpacked_calls(causal, device):
    """flash-attn's qkv-/kv-packed functions read q, k, v in place from the packed tensor and
    give the packed tensor the unpacked calls' gradients (the same kernels, bit for bit); the
    unpacked calls are held to the oracle by the tests above."""
    from hf_flash import (
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func,
    )

    torch.manual_seed(11)
    b, s, h, hk, d = 2, 37, 4, 2, 16
    qkv = torch.randn(b, s, 3, h, d, device=device, requires_grad=True)
    g = torch.randn(b, s, h, d, device=device)
    out = flash_attn_qkvpacked_func(qkv, causal=causal, window_size=(5, 3))
    (dqkv,) = torch.autograd.grad(out, qkv, g)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    ref = flash_attn_func(q, k, v, causal=causal, window_size=(5, 3))
    assert torch.equal(out, ref)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(ref, (q, k, v), g), dim=2))

    q = torch.randn(b, s - 5, h, d, device=device, requires_grad=True)
    kv = torch.randn(b, s, 2, hk, d, device=device, requires_grad=True)
    out, lse, _ = flash_attn_kvpacked_func(q, kv, causal=causal, return_attn_probs=True)
    dq, dkv = torch.autograd.grad(out, (q, kv), g[:, : s - 5])
    q2 = q.detach().clone().requires_grad_()
    k2, v2 = (t.detach().clone().requires_grad_() for t in kv.unbind(2))
    ref, ref_lse, _ = flash_attn_func(q2, k2, v2, causal=causal, return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    rq, rk, rv = torch.autograd.grad(ref, (q2, k2, v2), g[:, : s - 5])
    assert torch.equal(dq, rq) and torch.equal(dkv, torch.stack((rk, rv), dim=2))

    cu = torch.tensor([0, 9, 9, 30], dtype=torch.int32, device=device)
    qkv = torch.randn(30, 3, h, d, device=device, requires_grad=True)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 21, causal=causal)
    q, k, v = qkv.unbind(1)
    assert torch.equal(out, flash_attn_varlen_func(q, k, v, cu, cu, 21, 21, causal=causal))
    cu_k = torch.tensor([0, 12, 15, 40], dtype=torch.int32, device=device)
    kv = torch.randn(40, 2, hk, d, device=device)
    out = flash_attn_varlen_kvpacked_func(q.detach(), kv, cu, cu_k, 21, 25, causal=causal)
    ref = flash_attn_varlen_func(q.detach(), *kv.unbind(1), cu, cu_k, 21, 25, causal=causal)
    assert torch.equal(out, ref)


def test_packed_forms_reject_bad_layouts(device):
    from hf_flash import flash_attn_kvpacked_func, flash_attn_qkvpacked_func

    qkv = torch.randn(1, 8, 3, 2, 16, device=device)
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seqlen, 3, nheads, headdim\)"):
        flash_attn_qkvpacked_func(qkv[:, :, :2])
    with pytest.raises(ValueError, match=r"kv must be \(batch, seqlen_k, 2, nheads_k, headdim\)"):
        flash_attn_kvpacked_func(qkv[:, :, 0], qkv)
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        flash_attn_qkvpacked_func(qkv.tolist())


def test_window_size_as_flash_attn_reads_it(device):
    """Any negative bound is unbounded, and the window may come as a two-element integer tensor
    (flash-attn accepts both); the result equals the call with the plain pair."""
    q, k, v = _good(device)
    for causal in (False, True):
        plain = flash_attn_func(q, k, v, causal=causal, window_size=(-1, -1))
        assert torch.equal(flash_attn_func(q, k, v, causal=causal, window_size=(-7, -2)), plain)
        windowed = flash_attn_func(q, k, v, causal=causal, window_size=(3, 1))
        as_tensor = flash_attn_func(q, k, v, causal=causal, window_size=torch.tensor([3, 1]))
        assert torch.equal(as_tensor, windowed)
        left_only = flash_attn_func(q, k, v, causal=causal, window_size=(3, -5))
        assert torch.equal(left_only, flash_attn_func(q, k, v, causal=causal, window_size=(3, -1)))


@pytest.mark.parametrize("shared_positions", [False, True], ids=["per-row", "shared"])
def test_dense_rows_with_packed_position_ids_equal_varlen(shared_positions, device):
    """dense_attention with position_ids that restart inside rows runs the varlen kernels on the
    flattened tokens: out, lse (in the dense (B, H, S) layout) and the gradients of q/k/v, with
    the lse gradient too, equal flash_attn_varlen_func's on the same boundaries, per-row ALiBi
    slopes following their sequences; rows without restarts stay dense."""
    from hf_flash.interface import dense_attention

    b, s, h, hk, d = 2, 12, 4, 2, 16
    q, k, v = _qkv(device, b, s, s, h, hk, d, torch.float32)
    rows = [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]]
    pos = torch.tensor(rows[:1] if shared_positions else rows, device=device)
    slopes = torch.rand(b, h, device=device, dtype=torch.float32)
    out, lse, _ = dense_attention(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True,
                                  position_ids=pos)  # fmt: skip
    (out.square().sum() + lse.sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v)]

    starts = [r * s + i for r, row in enumerate(rows[:1] * b if shared_positions else rows)
              for i, p in enumerate(row) if p == 0]  # fmt: skip
    cu = torch.tensor(starts + [b * s], device=device, dtype=torch.int32)
    doc_rows = [a // s for a in starts]
    flat = [t.detach().reshape(b * s, *t.shape[2:]).requires_grad_() for t in (q, k, v)]
    lens = [e - a for a, e in zip(starts, starts[1:] + [b * s])]
    ref_out, ref_lse, _ = flash_attn_varlen_func(
        *flat, cu, cu, max(lens), max(lens), causal=True, alibi_slopes=slopes[doc_rows],
        return_attn_probs=True,
    )  # fmt: skip
    (ref_out.square().sum() + ref_lse.sum()).backward()
    assert torch.equal(out.detach(), ref_out.detach().view(b, s, h, d))
    assert torch.equal(lse.detach(), ref_lse.detach().view(h, b, s).transpose(0, 1))
    for g, f in zip(grads, flat):
        assert torch.equal(g, f.grad.view(g.shape))

    plain = torch.arange(s, device=device)[None]
    dense = dense_attention(q, k, v, causal=True, position_ids=plain)
    assert torch.equal(dense, flash_attn_func(q, k, v, causal=True))


SINK_CASES = [
    pytest.param(2, 33, 33, 4, 2, 32, {"causal": True}, id="gqa-causal"),
    pytest.param(1, 40, 40, 2, 2, 32, {}, id="noncausal"),
    pytest.param(1, 50, 17, 2, 1, 32, {"causal": True}, id="sq>sk-rows-without-keys"),
    pytest.param(1, 64, 64, 2, 1, 32, {"causal": True, "window_size": (12, 0)}, id="window"),
    pytest.param(1, 40, 40, 2, 2, 32, {"causal": True, "softcap": 1.5}, id="softcap"),
]


@pytest.mark.parametrize("dtype", [
    torch.float16, torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu),
], ids=["fp16", "fp32", "bf16"])  # fmt: skip
@pytest.mark.parametrize("batch, sq, sk, h, hk, d, opts", SINK_CASES)
def test_learnable_sink(batch, sq, sk, h, hk, d, opts, dtype, device):
    """Learnable sinks (gpt-oss): out, lse and the gradients of q, k, v and the sink logits
    against the oracle's extra softmax column, with the error rule; a row that sees no key puts
    all its weight on the sink (output 0, lse = the sink's logit)."""
    q, k, v = _qkv(device, batch, sq, sk, h, hk, d, dtype)
    sinks = (torch.randn(h, device=device, dtype=dtype) * 2).requires_grad_()
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, learnable_sink=sinks, **opts)
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, upcast=True, sinks=sinks, **opts)
    ref_lp, lp_lse = attention_ref(q, k, v, upcast=False, return_lse=True, sinks=sinks, **opts)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
    assert torch.isfinite(lse).all()
    assert torch.allclose(lse, ref_lse, atol=1e-3 if dtype != torch.float32 else 1e-5)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    inputs = (q, k, v, sinks)
    g = torch.autograd.grad((out, lse), inputs, (dout, dlse))
    g_ref = torch.autograd.grad((ref, ref_lse), inputs, (dout.float(), dlse))
    g_lp = torch.autograd.grad((ref_lp, lp_lse), inputs, (dout, dlse))
    for name, a, r, lp in zip(("dq", "dk", "dv", "dsinks"), g, g_ref, g_lp):
        assert a.shape == r.shape and a.dtype == dtype
        assert_close_to_ref(name, a, r, lp, GRAD_FACTOR, dtype)


def test_learnable_sink_varlen_and_packed_rows(device):
    """The varlen call and dense rows with restarting position_ids take the sinks too: each
    sequence equals its own dense call with the same sinks (out, lse, every gradient)."""
    from hf_flash.interface import dense_attention

    h, hk, d, lens = 4, 2, 32, [7, 12, 5]
    total = sum(lens)
    q, k, v = (t[0] for t in _qkv(device, 1, total, total, h, hk, d, torch.float32, False))
    sinks = torch.randn(h, device=device)
    cu = torch.tensor([0, 7, 19, 24], device=device, dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])[None].to(device)

    def grads_of(fn, *xs):
        xs = [x.clone().requires_grad_() for x in xs]
        out, lse = fn(*xs)
        (out.square().sum() + lse.sum()).backward()
        return [out.detach(), lse.detach()] + [x.grad for x in xs]

    def varlen(q, k, v, s):
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True,
                                             learnable_sink=s, return_attn_probs=True)  # fmt: skip
        return out, lse

    def packed(q, k, v, s):
        out, lse, _ = dense_attention(q[None], k[None], v[None], causal=True, learnable_sink=s,
                                      return_attn_probs=True, position_ids=pos)  # fmt: skip
        return out[0], lse[0]

    def alone(q, k, v, s):
        outs, lses = [], []
        for a, b in zip(cu.tolist(), cu.tolist()[1:]):
            o, l, _ = flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], causal=True,
                                      learnable_sink=s, return_attn_probs=True)  # fmt: skip
            outs.append(o[0])
            lses.append(l[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    want = grads_of(alone, q, k, v, sinks)
    for name, fn in (("varlen", varlen), ("packed rows", packed)):
        got = grads_of(fn, q, k, v, sinks)
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{name} {what}")


def test_learnable_sink_errors(device):
    q, k, v = _qkv(device, 1, 8, 8, 4, 2, 16, torch.float32, False)
    with pytest.raises(ValueError, match=r"learnable_sink has shape \(2,\); expected \(4,\)"):
        flash_attn_func(q, k, v, learnable_sink=torch.zeros(2, device=device))
    with pytest.raises(TypeError, match="learnable_sink must be a floating-point tensor"):
        flash_attn_func(q, k, v, learnable_sink=torch.zeros(4, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="learnable_sink with dropout_p > 0 is not supported"):
        flash_attn_func(q, k, v, dropout_p=0.1, learnable_sink=torch.zeros(4, device=device))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_dropout_encoded_probabilities(varlen, device):
    """return_attn_probs=True with dropout returns flash-attn's S_dmask: the probabilities, sized
    up to multiples of 128, negated where the kernel's dropout removed them. Rebuilding the output
    from it (kept entries / (1 - p)) @ V gives the kernel's output within the error rule, and the
    sign pattern is the kernels' keep mask; without dropout the third value is None."""
    p, h, hk, d = 0.3, 2, 1, 16
    if varlen:
        lens = [9, 14]
        cu = torch.tensor([0, 9, 23], device=device, dtype=torch.int32)
        q, k, v = (t[0] for t in _qkv(device, 1, 23, 23, h, hk, d, torch.float32, False))
        torch.manual_seed(5)
        out, _, s = flash_attn_varlen_func(q, k, v, cu, cu, 14, 14, dropout_p=p, causal=True,
                                           return_attn_probs=True)  # fmt: skip
        assert s.shape == (2, h, 128, 128)
        pieces = [(s[b : b + 1, :, :n, :n], v[None, a : a + n], out[a : a + n]) for b, (a, n) in
                  enumerate(zip([0, 9], lens))]  # fmt: skip
    else:
        q, k, v = _qkv(device, 2, 20, 20, h, hk, d, torch.float32, False)
        torch.manual_seed(5)
        out, _, s = flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
        assert s.shape == (2, h, 128, 128)
        assert torch.count_nonzero(s[:, :, 20:]) == 0 and torch.count_nonzero(s[:, :, :, 20:]) == 0
        pieces = [(s[:, :, :20, :20], v, out)]
    torch.manual_seed(5)
    rng = _new_rng_state(device)
    batch, max_len = (2, 14) if varlen else (2, 20)
    keep = dropout_keep_mask(rng, batch, h, max_len, max_len, p)
    for b, (sb, vb, ob) in enumerate(pieces):
        n = sb.shape[-1]
        visible = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        kb = keep[b : b + 1] if varlen else keep
        assert torch.equal((sb > 0) & visible, kb[..., :n, :n] & visible), "sign = keep mask"
        assert torch.count_nonzero(sb[..., ~visible]) == 0
        kept = sb.clamp(min=0) / (1 - p)
        rebuilt = torch.einsum("bhij,bjhd->bihd", kept, vb.repeat_interleave(h // hk, dim=2))
        torch.testing.assert_close(rebuilt.reshape(ob.shape), ob, rtol=1e-4, atol=1e-5)
    q, k, v = _qkv(device, 1, 8, 8, h, hk, d, torch.float32, False)
    assert flash_attn_func(q, k, v, return_attn_probs=True)[2] is None


@pytest.mark.gpu  # on a CPU every call is Triton anyway: the check means something on sm_90
def test_attention_paths_send_sink_calls_to_triton(device):
    """Calls with learnable sinks run the Triton kernels on every GPU (the Gluon kernels take
    no sinks); attention_paths says so without launching anything."""
    from hf_flash.interface import attention_paths

    q, k, v = _qkv(device, 1, 64, 64, 4, 2, 128, torch.float16, False)
    sinks = torch.zeros(4, device=device)
    assert attention_paths(q, k, v, causal=True, learnable_sink=sinks) == {
        "forward": "triton", "backward": "triton",
    }  # fmt: skip
