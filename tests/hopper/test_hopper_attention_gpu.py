"""The Gluon Hopper forward against the float32 oracle, on an sm_90 GPU.

Error rule (``hf_flash.reference.assert_close_to_ref``): the kernel's max error against the
float32 reference is at most 2x the max error of the same reference computed in the input
dtype, plus the rounding of one output element. Outputs are NaN-poisoned before the launch, so
an unwritten element fails; the log-sum-exp is checked too, +inf exactly on rows that see no key.
"""

from __future__ import annotations

import pytest
import torch

from hf_flash.reference import FWD_FACTOR, assert_close_to_ref, attention_ref

pytestmark = pytest.mark.gpu


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (H100/H200)")


def _run(q, k, v, causal, variant=None, scale=None):
    from hf_flash.kernels.hopper import attention_fwd as hk

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    assert hk.supports(q, k, v, causal=causal), "the case under test must be one the kernel covers"
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=torch.float32, device=q.device)
    hk.hopper_attention_forward(q, k, v, out, lse, softmax_scale=scale, causal=causal, variant=variant)
    return out, lse


def _check(q, k, v, causal, variant=None, scale=None):
    out, lse = _run(q, k, v, causal, variant, scale)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=True, return_lse=True)
    ref_lp = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=False)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, q.dtype)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse must be +inf exactly on rows that see no key"
    assert not torch.isnan(lse).any(), "unwritten lse"
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert lse_err <= 1e-3, f"lse: max err {lse_err:.3e}"
    return out, lse


def _qkv(batch, sq, sk, h, hk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    return mk(batch, sq, h, d), mk(batch, sk, hk, d), mk(batch, sk, hk, d)


def _variant_head_dims():
    from hf_flash.kernels.hopper.attention_fwd import VARIANTS

    return [(name, d) for name, var in VARIANTS.items() for d in var.head_dims]


CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k
    pytest.param(2, 128, 128, 4, 4, id="mha-one-tile"),
    pytest.param(2, 1025, 1025, 8, 2, id="gqa-1025"),
    pytest.param(1, 97, 97, 4, 1, id="mqa-97"),
    pytest.param(1, 1, 1, 2, 1, id="s1"),
    pytest.param(1, 1, 300, 4, 2, id="decode-row"),
    pytest.param(1, 200, 777, 4, 2, id="sq<sk"),
    pytest.param(1, 777, 200, 4, 2, id="sq>sk-empty-rows"),
    pytest.param(1, 8191, 8191, 2, 1, id="8191"),
]


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch,sq,sk,h,hk", CASES)
def test_default_variant_matches_reference(batch, sq, sk, h, hk, head_dim, causal, dtype):
    _check(*_qkv(batch, sq, sk, h, hk, head_dim, dtype), causal)


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _variant_head_dims())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_variant_matches_reference(variant, head_dim, causal):
    _check(*_qkv(2, 1025, 1100, 8, 2, head_dim, torch.bfloat16, seed=1), causal, variant=variant)
    _check(*_qkv(1, 300, 97, 4, 4, head_dim, torch.float16, seed=2), causal, variant=variant)


@needs_hopper
def test_causal_rows_without_keys_are_zero():
    q, k, v = _qkv(1, 300, 40, 4, 2, 128, torch.bfloat16)
    out, lse = _check(q, k, v, causal=True)
    empty = 300 - 40  # bottom-right alignment: the first Sq - Sk rows see no key
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isinf(lse[:, :, :empty]).all() and (lse[:, :, :empty] > 0).all()


@needs_hopper
def test_non_contiguous_views_and_scale():
    # (B, H, S, D) storage seen through transposes: the head dim has unit stride, nothing else
    # is contiguous; the kernel must read them in place
    dtype = torch.bfloat16
    qs = torch.randn(2, 8, 515, 128, device="cuda", dtype=dtype)
    ks = torch.randn(2, 2, 600, 128, device="cuda", dtype=dtype)
    vs = torch.randn(2, 2, 600, 128, device="cuda", dtype=dtype)
    q, k, v = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
    assert not q.is_contiguous()
    for causal in (False, True):
        _check(q, k, v, causal, scale=0.05)


@needs_hopper
def test_results_repeat_bitwise():
    q, k, v = _qkv(2, 2048, 2048, 8, 2, 128, torch.bfloat16)
    a, la = _run(q, k, v, True)
    b, lb = _run(q, k, v, True)
    assert torch.equal(a, b) and torch.equal(la, lb)


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _variant_head_dims())
def test_many_items_per_program(variant, head_dim):
    # 4 x 16 heads x 12+ query tiles: persistent programs take several items each, of different
    # lengths, some with rows that see no key (Sq > Sk, causal), so the barrier phases must carry
    # over from item to item
    q, k, v = _qkv(4, 1500, 1100, 16, 4, head_dim, torch.bfloat16, seed=3)
    for causal in (True, False):
        _check(q, k, v, causal, variant=variant)
