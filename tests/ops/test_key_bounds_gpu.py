"""Per-row key ranges (``key_bounds``) on the GPU: bf16/fp16 at real tile sizes, dense and
packed, forward and gradients against the oracle; on an H100/H200 the calls stay on the Triton
kernels (the Gluon ones take no bounds). The CPU tests are in test_key_bounds.py."""

from __future__ import annotations

import pytest
import torch

from hf_flash import flash_attn_func, flash_attn_varlen_func
from hf_flash.interface import attention_paths
from hf_flash.reference import (
    FWD_FACTOR,
    assert_close_to_ref,
    assert_grads_close_to_ref,
    attention_ref,
    attention_varlen_ref,
)
from test_key_bounds import image_bounds

pytestmark = pytest.mark.gpu


def _qkv(batch, s, h, hk, d, dtype):
    def mk(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_()

    return mk(batch, s, h, d), mk(batch, s, hk, d), mk(batch, s, hk, d)


@pytest.mark.parametrize(
    "dtype,d,window,or_window",
    [
        pytest.param(torch.bfloat16, 128, -1, False, id="bf16-d128-causal-blocks"),
        pytest.param(torch.float16, 64, 300, False, id="fp16-d64-window-and-blocks"),
        pytest.param(torch.bfloat16, 128, 200, True, id="bf16-d128-window-or-blocks"),
    ],
)
def test_dense_bounds_match_reference(dtype, d, window, or_window):
    torch.manual_seed(0)
    s = 1025
    q, k, v = _qkv(2, s, 8, 2, d, dtype)
    rows = [[(100, 356), (356, 612), (900, 1025)], [(7, 9), (500, 997)]]
    bounds = torch.stack([image_bounds(s, b, window, 0, "cuda", or_window) for b in rows])
    out = flash_attn_func(q, k, v, key_bounds=bounds)
    ref = attention_ref(q, k, v, key_bounds=bounds)
    ref_lp = attention_ref(q, k, v, key_bounds=bounds, upcast=False)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
    assert_grads_close_to_ref(out, ref, ref_lp, (q, k, v), torch.randn_like(out), dtype)


def test_varlen_bounds_match_reference():
    torch.manual_seed(1)
    dtype, lens = torch.bfloat16, [700, 1, 333]
    q = torch.randn(sum(lens), 8, 128, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens), 4, 128, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens), 4, 128, device="cuda", dtype=dtype, requires_grad=True)
    cu = torch.tensor([0, 700, 701, 1034], dtype=torch.int32, device="cuda")
    bounds = torch.cat([
        image_bounds(700, [(64, 320)], device="cuda"), image_bounds(1, [], device="cuda"),
        image_bounds(333, [(10, 300)], 128, device="cuda"),
    ])  # fmt: skip
    out = flash_attn_varlen_func(q, k, v, cu, cu, 700, 700, key_bounds=bounds)
    ref = attention_varlen_ref(q, k, v, cu, cu, key_bounds=bounds)
    ref_lp = attention_varlen_ref(q, k, v, cu, cu, key_bounds=bounds, upcast=False)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
    assert_grads_close_to_ref(out, ref, ref_lp, (q, k, v), torch.randn_like(out), dtype)


def test_bounds_calls_stay_on_triton():
    """What the Gluon kernels would take (bf16, d128, dense or packed) goes to Triton with key
    bounds, on every GPU."""
    q, k, v = (t.detach() for t in _qkv(1, 256, 8, 2, 128, torch.bfloat16))
    bounds = image_bounds(256, [(16, 80)], device="cuda")[None]
    assert attention_paths(q, k, v, key_bounds=bounds) == {"forward": "triton", "backward": "triton"}
    assert attention_paths(q[0], k[0], v[0], varlen=True, key_bounds=bounds[0]) == {
        "forward": "triton", "backward": "triton",
    }  # fmt: skip
