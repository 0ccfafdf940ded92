"""CPU checks of the Gluon Hopper backward (dK/dV): every variant builds for sm_90a with
Triton's ptxas, with the instructions the design relies on and bounded spills; and the dispatch
rule (``attention_bwd.supports`` and ``flash_bwd.backward_path``) says exactly which calls it
covers."""

from __future__ import annotations

import pytest
import torch

from hf_flash.kernels import configs, flash_bwd
from hf_flash.kernels.hopper import attention_bwd as hb
from hf_flash.kernels.hopper import attention_fwd as hf
from hf_flash.kernels.hopper import compile_check

SHARED_LIMIT = 227 * 1024
# d128 spills at 240 registers per consumer (dK and dV accumulators alone take 128): the base
# variants a few loop-invariant scalars, the dQ variant more (.notes/hopper-bwd.md). Bounds, so a
# change that spills more fails here; d64 must not spill.
SPILL_BYTES = {64: 0, 128: 160}
SPILL_BYTES_DQ = {64: 0, 128: 384}

# every variant causal in bfloat16 (the branch with the most code); the defaults non-causal in
# float16
SPECS = [("bwd:" + name, d, True, "bfloat16") for name, var in hb.VARIANTS.items() for d in var.head_dims]
SPECS += [("bwd:" + name, d, False, "float16") for (d, causal), name in hb.DEFAULT.items() if not causal]


@pytest.fixture(scope="module")
def reports():
    return dict(zip(SPECS, compile_check.check_many(SPECS)))


@pytest.mark.parametrize("spec", SPECS, ids=["-".join(map(str, s)) for s in SPECS])
def test_bwd_variant_builds_for_sm90a(reports, spec):
    r = reports[spec]
    variant, head_dim, causal, dtype = spec
    var = hb.VARIANTS[variant[len("bwd:"):]]
    assert (r["variant"], r["head_dim"], r["causal"], r["dtype"]) == spec
    bound = (SPILL_BYTES_DQ if var.dq_atomic else SPILL_BYTES)[head_dim]
    assert r["spill_store_bytes"] <= bound and r["spill_load_bytes"] <= bound, r
    assert r["shared_bytes"] <= SHARED_LIMIT, r
    # per consumer: S^T = K Q^T and dP^T = V dO^T have D/16 k-steps each, dV += P^T dO and
    # dK += dS^T Q have BLOCK_M/16 each, dQ = dS K has BLOCK_N/16 (dq_shared: one product per
    # consumer's dS, each on half the columns; dq_lag: the products appear twice, in the loop and
    # after it for the last step)
    dq_steps = (var.block_n // 16) * (var.consumers if var.dq_shared else 1) if var.dq_atomic else 0
    dq_steps *= 2 if var.dq_lag else 1
    assert r["wgmma"] == (2 * head_dim // 16 + 2 * var.block_m // 16 + dq_steps) * var.consumers, r
    assert r["tma_loads"] > 0, r
    # one reduce per consumer (dq_lag: also after the loop); the dQ writer issues each consumer's
    # 64-column float32 tile as its two 128-byte TMA boxes (dq_frag: one 16 x 256 box), in one place
    if var.dq_writer:
        assert r["tma_reduces"] == (1 if var.dq_frag else 2) * var.consumers, r
    else:
        assert r["tma_reduces"] == (var.consumers * (2 if var.dq_lag else 1) if var.dq_atomic else 0), r
    assert hb.PRODUCER_REGS in r["setmaxnreg"] and var.consumer_regs in r["setmaxnreg"], r


def test_bwd_defaults_are_variants_for_their_head_dim():
    assert hb.covered_head_dims() <= set(hb.HEAD_DIMS) and 128 in hb.covered_head_dims()
    for (d, causal), name in hb.DEFAULT.items():
        assert d in hb.VARIANTS[name].head_dims and (d, not causal) in hb.DEFAULT
        var = hb.VARIANTS[name]
        assert not var.dq_atomic or var.dq_ordered, "the default backward must be deterministic"


# ---- the dispatch rule, on CPU tensors with the device tests stubbed ----


@pytest.fixture
def on_hopper(monkeypatch):
    monkeypatch.setattr(hf, "_on_hopper", lambda t: True)
    monkeypatch.setattr(configs, "hopper_enabled", lambda device: True)


def _t(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype)


def _call(d=128, dtype=torch.bfloat16, h=8, hk=2, sq=64, sk=64):
    q, k = _t(2, sq, h, d, dtype=dtype), _t(2, sk, hk, d, dtype=dtype)
    return q, k, torch.empty_like(k), torch.empty_like(q), torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)


_OPTS = dict(varlen=False, causal=False, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
             dropout_p=0.0, softmax_scale=None)  # fmt: skip


def _path(tensors, **change):
    return flash_bwd.backward_path(*tensors, **{**_OPTS, **change})


def test_backward_path_covered_calls(on_hopper):
    for dtype in (torch.bfloat16, torch.float16):
        assert _path(_call(128, dtype)) == "hopper"
        assert _path(_call(128, dtype), causal=True, window_right=0) == "hopper"
    assert _path(_call(h=8, hk=1), causal=True, window_right=0) == "hopper"  # MQA
    assert _path(_call(sq=1, sk=5000)) == "hopper"
    q, k, *_ = _call()
    # out/dout/dk/dv not allocated yet (attention_paths): laid out like q / k
    assert _path((q, k, k, None, None, None, None)) == "hopper"


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(dict(varlen=True), id="varlen"),
        pytest.param(dict(window_left=16, causal=True, window_right=0), id="window-left"),
        pytest.param(dict(window_right=4), id="window-right"),
        pytest.param(dict(softcap=30.0), id="softcap"),
        pytest.param(dict(alibi_slopes=torch.zeros(8)), id="alibi"),
        pytest.param(dict(dropout_p=0.1), id="dropout"),
    ],
)
def test_backward_path_rejects_features(on_hopper, change):
    assert _path(_call(), **change) == "triton"


@pytest.mark.parametrize("d", [32, 64, 80, 96, 256])
def test_backward_path_rejects_other_head_dims(on_hopper, d):
    assert _path(_call(d)) == "triton"


def test_backward_head_dims_follow_default(on_hopper, monkeypatch):
    """A head dim is covered exactly when DEFAULT names a variant for it (d64 has none: no
    measured gain over the Triton backward)."""
    assert _path(_call(64)) == "triton"
    monkeypatch.setitem(hb.DEFAULT, (64, False), "kv2x64-m64-s2")
    monkeypatch.setitem(hb.DEFAULT, (64, True), "kv2x64-m64-s2")
    assert _path(_call(64)) == "hopper"


def test_backward_path_rejects_dtypes_and_layouts(on_hopper):
    assert _path(_call(dtype=torch.float32)) == "triton"
    q, k, v, out, dout, dk, dv = _call()
    # a gradient buffer TMA cannot address: a row stride of 129 elements (258 bytes)
    bad_q = _t(2, 64, 8, 129)[..., :128]
    bad_k = _t(2, 64, 2, 129)[..., :128]
    assert _path((q, k, v, out, bad_q, dk, dv)) == "triton"  # dout
    assert _path((q, k, v, bad_q, dout, dk, dv)) == "triton"  # out
    assert _path((q, k, v, out, dout, bad_k, dv)) == "triton"  # dk
    assert _path((q, k, v, out, dout, dk, bad_k)) == "triton"  # dv
    assert _path((q, k, v, out, dout, dk, dv.half())) == "triton"  # dtype
    assert _path((q, k, v, out, dout, dk[:, :32], dv)) == "triton"  # shape


def test_backward_path_switches(on_hopper, monkeypatch):
    tensors = _call()
    with configs.use_hopper_backward(False):
        assert _path(tensors) == "triton"
    assert _path(tensors) == "hopper"
    monkeypatch.setattr(configs, "hopper_enabled", lambda device: False)
    assert _path(tensors) == "triton"


def test_backward_needs_an_sm90_cuda_tensor():
    # nothing stubbed: CPU tensors are never covered
    assert _path(_call()) == "triton"


def test_variant_choice_is_deterministic_unless_allowed():
    """The default variants add dQ, if at all, in a fixed order; the atomic dQ variants run only
    once deterministic gradients are not required, and only where they are listed."""
    for d in hb.covered_head_dims():
        for causal in (False, True):
            var = hb.VARIANTS[hb.variant_for(d, causal)]
            assert not var.dq_atomic or var.dq_ordered
    with configs.use_deterministic(False):
        for (d, causal), name in hb.NONDETERMINISTIC.items():
            assert hb.variant_for(d, causal) == name and d in hb.VARIANTS[name].head_dims
    assert configs.deterministic()



def test_dq_frag_postprocess_inverts_the_fragment_layout(device):
    """The dq_frag variants store each 64 x 64 dQ tile in fragment order (offset bit k holds the
    (row, col) of DQ_FRAG_BASES[k]); the postprocess must put every element back at its (row,
    col) of dQ (B, S, H, D), clipping the rows past the end (Triton kernel: runs in the
    interpreter on the CPU)."""
    batch, seqlen, heads, head_dim, block_m, consumers = 2, 97, 3, 128, 64, 2
    n_m = configs.cdiv(seqlen, block_m)
    dq_n = head_dim // consumers
    acc = torch.randn(batch * heads * n_m * block_m * head_dim, device=device)
    dq = torch.full((batch, seqlen, heads, head_dim), float("nan"), device=device)
    hb.dq_frag_to_bshd(acc, dq, block_m, consumers)
    off = torch.arange(block_m * dq_n)
    row = sum(((off >> k) & 1) * r for k, (r, _) in enumerate(hb.DQ_FRAG_BASES))
    col = sum(((off >> k) & 1) * c for k, (_, c) in enumerate(hb.DQ_FRAG_BASES))
    assert sorted((row * dq_n + col).tolist()) == list(range(block_m * dq_n))  # a permutation
    want = torch.empty(batch, n_m * block_m, heads, head_dim)
    tiles = acc.cpu().view(batch, heads, n_m, consumers, block_m * dq_n)
    for c in range(consumers):
        tile = torch.empty(batch, heads, n_m, block_m, dq_n)
        tile[..., row, col] = tiles[:, :, :, c]
        want[..., c * dq_n:(c + 1) * dq_n] = tile.permute(0, 2, 3, 1, 4).reshape(batch, n_m * block_m, heads, dq_n)
    assert torch.equal(dq.cpu(), want[:, :seqlen])
