"""Head dims past 256, up to 512 (issue 18: gemma4's global attention layers use 512): forward,
gradients, packed (varlen) and KV-cache decode against hf_flash.reference with the error rule;
the launch configs that key on the head dim; the Gluon Hopper kernels never take these calls.

CPU cases run the real kernels in Triton's interpreter, kept small (a few tiles); the GPU
cases (``gpu`` marker) run the tiles of kernels/configs.py's wide entries on the hardware."""

from __future__ import annotations

import pytest
import torch

from hf_flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from hf_flash._checks import MAX_HEAD_DIM
from hf_flash.kernels import configs, decode
from hf_flash.reference import (
    FWD_FACTOR,
    assert_close_to_ref,
    assert_grads_close_to_ref,
    attention_varlen_ref,
    kvcache_attention_ref,
)

from test_flash_attn import _check_dense as _dense  # the dense check of the head dims <= 256


def _varlen(device, lens, h, hk, d, dtype, **opts):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens), h, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens), hk, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens), hk, d, device=device, dtype=dtype, requires_grad=True)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), return_attn_probs=True, **opts)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu, cu, return_lse=True, **opts)
    ref_lp = attention_varlen_ref(q, k, v, cu, cu, upcast=False, **opts)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-3 if dtype != torch.float32 else 1e-5)
    assert_grads_close_to_ref(out, ref, ref_lp, (q, k, v), torch.randn_like(out), dtype)


def _kvcache(device, batch, nheads, nheads_k, d, seqlen_cache, lens, seqlen_new, dtype, num_splits=0, **opts):
    q = torch.randn(batch, seqlen_new, nheads, d, device=device, dtype=dtype)
    k_cache = torch.randn(batch, seqlen_cache, nheads_k, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k = torch.randn(batch, seqlen_new, nheads_k, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    kw = dict(opts, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device))
    ref, k_ref, v_ref, ref_lse = kvcache_attention_ref(q, k_cache, v_cache, k, v, return_lse=True, **kw)
    ref_lp, _, _ = kvcache_attention_ref(q, k_cache, v_cache, k, v, upcast=False, **kw)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, num_splits=num_splits, return_softmax_lse=True, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-3 if dtype != torch.float32 else 1e-5)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref), "the append must be exact"


# ---- CPU (interpreter) --------------------------------------------------------------------


def test_max_head_dim_is_512():
    assert MAX_HEAD_DIM == 512
    assert configs.head_dim_block(512) == 512 and configs.head_dim_block(320) == 512


@pytest.mark.parametrize(
    "d,dtype",
    [
        pytest.param(512, torch.float16, id="d512-fp16"),
        pytest.param(512, torch.float32, id="d512-fp32"),
        pytest.param(320, torch.float16, id="d320-fp16-padded"),
    ],
)
def test_dense_gqa_causal_forward_and_gradients(d, dtype, device):
    torch.manual_seed(d)
    # 20 rows: two query / key tiles of the interpreter's 16, the second partial
    _dense(device, 1, 20, 20, 4, 2, d, dtype, causal=True)


def test_varlen_packed(device):
    torch.manual_seed(5)
    _varlen(device, [7, 13], 2, 1, 512, torch.float16, causal=True)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
def test_kvcache_decode(num_splits, device):
    torch.manual_seed(6 + num_splits)
    _kvcache(device, 2, 4, 2, 512, 40, (33, 5), 1, torch.float16, num_splits=num_splits, causal=True)


def test_head_dims_past_512_are_refused(device):
    q = torch.randn(1, 4, 1, 520, device=device)
    with pytest.raises(ValueError, match="head_dim=520 is unsupported; hf_flash supports 1..512"):
        flash_attn_func(q, q, q)
    with pytest.raises(ValueError, match="1..512"):
        flash_attn_with_kvcache(q, q.clone(), q.clone())


def _fake_capability(monkeypatch, cap):
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "_capability", lambda device: cap)


# kernels/configs.py's shared-memory arithmetic for the wide entries, checked against each
# generation's budget: stages x streamed tiles + kept tiles, x BLOCK_D x element bytes.
_SMEM = {(9, 0): 227 * 1024, (8, 0): 164 * 1024, (8, 9): 99 * 1024, (7, 5): 64 * 1024}


@pytest.mark.parametrize("cap", list(_SMEM), ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_wide_configs_fit_shared_memory(cap, dtype, monkeypatch):
    _fake_capability(monkeypatch, cap)
    dev = torch.device("cuda", 0)
    size = 2 if dtype != torch.float32 else 4
    d = 512
    if dtype == torch.float32 and cap == (8, 9) or dtype == torch.float32 and cap == (7, 5):
        budget = 164 * 1024  # float32 at d512 wants an A100 or a Hopper GPU (configs.py)
    else:
        budget = _SMEM[cap]
    f = configs.fwd_config(d, dtype, dev)
    fwd = (f["num_stages"] * 2 * f["BLOCK_N"] + f["BLOCK_M"]) * d * size
    dkdv, dq = configs.bwd_configs(d, dtype, dev)
    bwd_dkdv = (dkdv["num_stages"] * 2 * dkdv["BLOCK_M"] + 2 * dkdv["BLOCK_N"]) * d * size
    bwd_dq = (dq["num_stages"] * 2 * dq["BLOCK_N"] + 2 * dq["BLOCK_M"]) * d * size
    c = decode.decode_config(d, dtype, dev)
    dec = (c["num_stages"] * 2 * c["BLOCK_N"] + 32) * d * size  # query tile <= 32 rows
    for name, used in (("fwd", fwd), ("bwd_dkdv", bwd_dkdv), ("bwd_dq", bwd_dq), ("decode", dec)):
        assert used <= budget, f"{name}: {used / 1024:.0f} KB > {budget / 1024:.0f} KB"
    # fp32 accumulators at most 128 registers per thread
    assert f["BLOCK_M"] * d / (32 * f["num_warps"]) <= 128
    assert 2 * dkdv["BLOCK_N"] * d / (32 * dkdv["num_warps"]) <= 128
    assert dq["BLOCK_M"] * d / (32 * dq["num_warps"]) <= 128


def test_configs_up_to_256_unchanged(monkeypatch):
    _fake_capability(monkeypatch, (9, 0))
    dev = torch.device("cuda", 0)
    fwd = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    assert configs.fwd_config(256, torch.bfloat16, dev) == fwd
    # the d129-256 backward tiles from their own sweep (benchmarks/attention.py --sweep-configs
    # --head-dims 256), not from the d512 rule
    dkdv = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    dq = {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    assert configs.bwd_configs(256, torch.bfloat16, dev) == (dkdv, dq)
    assert decode.decode_config(256, torch.bfloat16, dev) == {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}


def test_decode_query_tile_is_at_most_32_rows_past_256(monkeypatch):
    flags = (True, False, False, False, False, 0, False, False, False, False, False, False, False)
    dev = torch.device("cpu")
    assert decode._Plan(512, torch.float16, dev, 72, flags).m_tiles == 3  # 72 rows, tiles of 32
    assert decode._Plan(256, torch.float16, dev, 72, flags).m_tiles == 2  # tiles of 64


_PATH_OPTS = dict(causal=True, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None,
                  dropout_p=0.0, softmax_scale=None)  # fmt: skip


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_hopper_kernels_never_take_head_dim_512(varlen, monkeypatch):
    """The Gluon Hopper kernels cover head dims up to 256: with the device test stubbed to an
    H100, d128 and d256 calls choose them and d512 / d320 calls the Triton kernels, forward and
    backward."""
    pytest.importorskip("triton.experimental.gluon")
    from hf_flash.kernels import flash_bwd, flash_fwd
    from hf_flash.kernels.hopper import attention_fwd as hf

    monkeypatch.setattr(hf, "_on_hopper", lambda t: True)  # the backward's coverage test too
    monkeypatch.setattr(configs, "hopper_enabled", lambda device: True)
    monkeypatch.setattr(configs, "_HOPPER_VARLEN", True)

    def tensors(d):
        if varlen:
            q, k = torch.empty(300, 8, d, dtype=torch.bfloat16), torch.empty(300, 2, d, dtype=torch.bfloat16)
        else:
            q, k = torch.empty(2, 64, 8, d, dtype=torch.bfloat16), torch.empty(2, 64, 2, d, dtype=torch.bfloat16)
        return q, k, torch.empty_like(k)

    for d, want in ((128, "hopper"), (256, "hopper"), (512, "triton"), (320, "triton")):
        q, k, v = tensors(d)
        assert flash_fwd.forward_path(q, k, v, None, varlen=varlen, **_PATH_OPTS) == want, d
        got = flash_bwd.backward_path(q, k, v, None, None, None, None, varlen=varlen, **_PATH_OPTS)
        assert got == want, d


# ---- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "d,dtype",
    [
        pytest.param(512, torch.bfloat16, id="d512-bf16"),
        pytest.param(512, torch.float16, id="d512-fp16"),
        pytest.param(512, torch.float32, id="d512-fp32"),
        pytest.param(384, torch.bfloat16, id="d384-bf16-padded"),
    ],
)
def test_gpu_dense(d, dtype, device):
    torch.manual_seed(31)
    _dense(device, 2, 300, 300, 8, 2, d, dtype, causal=True)
    _dense(device, 1, 129, 257, 4, 1, d, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_dense_window_softcap(dtype, device):
    torch.manual_seed(32)
    _dense(device, 1, 200, 200, 4, 2, 512, dtype, causal=True, window_size=(64, 0), softcap=30.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_varlen(dtype, device):
    torch.manual_seed(33)
    _varlen(device, [100, 1, 257, 64], 8, 2, 512, dtype, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_splits", [0, 1], ids=["auto-split", "one-split"])
def test_gpu_kvcache(num_splits, dtype, device):
    torch.manual_seed(34)
    # 8 query heads per K/V head x 4 new tokens = 32 stacked rows; then one row per group
    _kvcache(device, 2, 8, 1, 512, 1030, (1000, 77), 4, dtype, num_splits=num_splits, causal=True)
    _kvcache(device, 3, 16, 2, 512, 2048, (2000, 1, 513), 1, dtype, num_splits=num_splits)
