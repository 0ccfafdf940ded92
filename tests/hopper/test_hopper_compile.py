"""CPU checks of the Gluon Hopper forward: every variant builds for sm_90a with Triton's ptxas,
with no spills and the instructions the design relies on; and ``supports`` says exactly which
calls the kernel covers."""

from __future__ import annotations

import pytest
import torch

from hf_flash.kernels.hopper import attention_fwd as hk
from hf_flash.kernels.hopper import compile_check

SHARED_LIMIT = 227 * 1024


# Every variant, causal (the branch with the most code), bfloat16; the defaults non-causal in
# bfloat16 and causal in float16. Compiled once, in two fresh processes (see check_many).
SPECS = [(name, d, True, "bfloat16") for name, var in hk.VARIANTS.items() for d in var.head_dims]
SPECS += [(name, d, causal, "bfloat16") for (d, causal), name in hk.DEFAULT.items() if not causal]
SPECS += [(name, d, causal, "float16") for (d, causal), name in hk.DEFAULT.items() if causal]


@pytest.fixture(scope="module")
def reports():
    return dict(zip(SPECS, compile_check.check_many(SPECS)))


@pytest.mark.parametrize("spec", SPECS, ids=["-".join(map(str, s)) for s in SPECS])
def test_variant_builds_for_sm90a(reports, spec):
    r = reports[spec]
    variant, head_dim, causal, dtype = spec
    var = hk.VARIANTS[variant]
    assert (r["variant"], r["head_dim"], r["causal"], r["dtype"]) == spec
    assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0 and r["stack_bytes"] == 0, r
    assert r["shared_bytes"] <= SHARED_LIMIT, r
    # S = Q K^T has D/16 k-steps, P V has BLOCK_N/16, per consumer partition; the overlapped
    # loop has a peeled copy of each
    per_pass = head_dim // 16 + var.block_n // 16
    assert r["wgmma"] == per_pass * var.consumers * (2 if var.overlap else 1), r
    assert r["tma_loads"] > 0, r
    # registers move from the producer warp to the consumers
    assert hk.PRODUCER_REGS in r["setmaxnreg"] and var.consumer_regs in r["setmaxnreg"], r


def test_defaults_are_variants_for_their_head_dim():
    for (d, causal), name in hk.DEFAULT.items():
        assert d in hk.VARIANTS[name].head_dims
    assert set(hk.DEFAULT) == {(d, c) for d in hk.HEAD_DIMS for c in (False, True)}


# ---- supports(): the dispatch rule, checked on CPU tensors with the device test stubbed ----


@pytest.fixture
def on_hopper(monkeypatch):
    monkeypatch.setattr(hk, "_on_hopper", lambda t: True)


def _t(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype)


def _qkv(d=128, dtype=torch.bfloat16, h=8, hk_=2, sq=64, sk=64):
    return _t(2, sq, h, d, dtype=dtype), _t(2, sk, hk_, d, dtype=dtype), _t(2, sk, hk_, d, dtype=dtype)


def test_supports_covered_calls(on_hopper):
    for d in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = _qkv(d, dtype)
            assert hk.supports(q, k, v, causal=False)
            assert hk.supports(q, k, v, causal=True, window=(-1, 0))
    q, k, v = _qkv(h=8, hk_=1)  # MQA
    assert hk.supports(q, k, v, causal=True)
    q, k, v = _qkv(sq=1, sk=5000)
    assert hk.supports(q, k, v, causal=True)
    # transposed (B, H, S, D) storage: head dim unit stride, other strides 16-byte multiples
    qs, ks = _t(2, 8, 64, 128), _t(2, 2, 64, 128)
    assert hk.supports(qs.transpose(1, 2), ks.transpose(1, 2), ks.transpose(1, 2), causal=False)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(dict(varlen=True), id="varlen"),
        pytest.param(dict(window=(16, 0)), id="window-left"),
        pytest.param(dict(window=(-1, 4)), id="window-right"),
        pytest.param(dict(softcap=30.0), id="softcap"),
        pytest.param(dict(alibi=torch.zeros(8)), id="alibi"),
        pytest.param(dict(dropout=0.1), id="dropout"),
    ],
)
def test_supports_rejects_features(on_hopper, change):
    q, k, v = _qkv()
    assert not hk.supports(q, k, v, **{"causal": False, **change})


def test_supports_window_zero_right_needs_causal(on_hopper):
    q, k, v = _qkv()
    assert not hk.supports(q, k, v, causal=False, window=(-1, 0))


@pytest.mark.parametrize("d", [32, 80, 96, 256])
def test_supports_rejects_other_head_dims(on_hopper, d):
    assert not hk.supports(*_qkv(d), causal=True)


def test_supports_rejects_dtypes_layouts_and_shapes(on_hopper):
    q, k, v = _qkv(dtype=torch.float32)
    assert not hk.supports(q, k, v, causal=False)
    q, k, v = _qkv()
    assert not hk.supports(q, k.half(), v, causal=False)  # mixed dtypes
    assert not hk.supports(q, _t(2, 64, 3, 128), _t(2, 64, 3, 128), causal=False)  # 8 % 3 heads
    assert not hk.supports(q, _t(1, 64, 2, 128), _t(1, 64, 2, 128), causal=False)  # batch mismatch
    assert not hk.supports(q, k, _t(2, 64, 2, 64), causal=False)  # v head dim
    assert not hk.supports(q[0], k[0], v[0], causal=False)  # packed 3-D tensors
    # a stride that is not a 16-byte multiple (129 elements = 258 bytes)
    big = _t(2, 65, 8, 129)[..., :128]
    assert not hk.supports(big, k, v, causal=False)
    # innermost stride not 1
    assert not hk.supports(_t(2, 64, 8, 256)[..., ::2], k, v, causal=False)


def test_supports_needs_an_sm90_cuda_tensor():
    # no monkeypatch: CPU tensors are never covered
    assert not hk.supports(*_qkv(), causal=True)
