"""CPU checks of the Gluon dQ kernel (``hopper/attention_dq.py``): every variant builds for sm_90a
with Triton's ptxas, within its spill bounds, with the products and stores the design says; and the
dispatch rule (``attention_dq.variant_for`` / ``covers`` and ``flash_bwd.flash_attn_backward``'s
choice beside a dK/dV-only backward variant) says exactly which calls it takes."""

from __future__ import annotations

import pytest
import torch

from hf_flash.kernels.hopper import attention_bwd as hb
from hf_flash.kernels.hopper import attention_dq as hdq
from hf_flash.kernels.hopper import compile_check

SHARED_LIMIT = 227 * 1024
# spill bounds (bytes per thread, stores and loads; none elsewhere). CPU compile, session 48: a
# window's per-row key bounds on top of three consumers of 160 registers (d64) spill 16 / 20 bytes
# stored, 40 / 64 loaded, causal / not, in the packed build, and on the d256 dQ accumulator's 128
# registers 104 / 148 in the dense s3 build; the packed d256 s2 build 8 without a window
SPILL_BYTES = {(64, True, "window"): 80, (256, False, "window"): 176, (256, True, ""): 16, (256, True, "window"): 16}
# session 49: the softcap's tanh, kept from S to dS, adds nothing at d128 and d256 alone; with a
# window at d256 (Gemma 2's local layers) 168 bytes stored and 212 loaded, causal and not
SPILL_BYTES[(256, False, "window-softcap")] = 240

# every variant dense causal in bfloat16 and packed non-causal in float16 (where it has a packed
# build); the defaults with a window, dense and packed
SPECS = [(compile_check.DQ_PREFIX + name, d, True, "bfloat16") for name, var in hdq.VARIANTS.items()
         for d in var.head_dims]  # fmt: skip
SPECS += [(compile_check.DQ_VARLEN_PREFIX + name, d, False, "float16") for name, var in hdq.VARIANTS.items()
          if var.packed for d in var.head_dims]  # fmt: skip
SPECS += [(prefix + name, d, causal, "bfloat16", "window")
          for prefix, table in ((compile_check.DQ_PREFIX, hdq.DEFAULT), (compile_check.DQ_VARLEN_PREFIX, hdq.VARLEN_DEFAULT))
          for d, name in table.items() for causal in (True, False)]  # fmt: skip
# the soft-capped calls' builds (SOFTCAP_HEAD_DIMS), with and without a window
SPECS += [(prefix + name, d, causal, "bfloat16", features)
          for prefix, table in ((compile_check.DQ_PREFIX, hdq.DEFAULT), (compile_check.DQ_VARLEN_PREFIX, hdq.VARLEN_DEFAULT))
          for d, name in table.items() if d in hdq.SOFTCAP_HEAD_DIMS
          for causal in (True, False) for features in ("softcap", "window-softcap")]  # fmt: skip


@pytest.fixture(scope="module")
def reports():
    return dict(zip(SPECS, compile_check.check_many(SPECS)))


@pytest.mark.parametrize("spec", SPECS, ids=["-".join(map(str, s)) for s in SPECS])
def test_dq_variant_builds_for_sm90a(reports, spec):
    r = reports[spec]
    var = hdq.VARIANTS[spec[0].split(":", 1)[1]]
    head_dim = spec[1]
    bound = SPILL_BYTES.get((head_dim, spec[0].startswith(compile_check.DQ_VARLEN_PREFIX), "".join(spec[4:])), 0)
    assert r["spill_store_bytes"] <= bound and r["spill_load_bytes"] <= bound, r
    assert r["shared_bytes"] <= SHARED_LIMIT, r
    assert not r["wgmma_serialized"], r
    # per consumer: S = Q K^T and dP = dO V^T of D / 16 k-steps each and dQ += dS K of BLOCK_N / 16,
    # each twice in the code (the first key tile's S and dP before the loop, the last tile's dQ
    # product after it)
    assert r["wgmma"] == 2 * (2 * head_dim // 16 + var.block_n // 16) * var.consumers, r
    assert r["tma_stores"] == var.consumers, r  # each consumer's dQ tile, once
    assert r["tma_reduces"] == 0, r
    assert hdq.PRODUCER_REGS in r["setmaxnreg"] and var.consumer_regs in r["setmaxnreg"], r


def test_defaults_name_variants_for_their_head_dim():
    for table, packed in ((hdq.DEFAULT, False), (hdq.VARLEN_DEFAULT, True)):
        for d, name in table.items():
            var = hdq.VARIANTS[name]
            assert d in var.head_dims and (var.packed or not packed), (d, name)
    assert set(hdq.VARLEN_DEFAULT) <= set(hdq.DEFAULT)


def test_variant_for_and_covers():
    q = torch.empty(2, 64, 8, 128, dtype=torch.bfloat16)
    dq = torch.empty_like(q)
    assert hdq.variant_for(128) == hdq.DEFAULT[128] and hdq.covers(q, q, dq)
    # soft-capped calls: SOFTCAP_HEAD_DIMS only
    assert hdq.variant_for(128, softcap=30.0) == hdq.DEFAULT[128] and hdq.covers(q, q, dq, softcap=30.0)
    assert hdq.variant_for(256, softcap=30.0) == hdq.DEFAULT[256]
    assert 64 not in hdq.SOFTCAP_HEAD_DIMS and hdq.variant_for(64, softcap=30.0) is None
    q64 = q[..., :64].contiguous()
    assert hdq.covers(q64, q64, q64) and not hdq.covers(q64, q64, q64, softcap=30.0)
    assert hdq.variant_for(96) is None and not hdq.covers(*[q[..., :96].contiguous()] * 3)
    assert hdq.variant_for(256) == hdq.DEFAULT[256] and hdq.variant_for(256, varlen=True) is None
    packed = q.flatten(0, 1)
    assert hdq.covers(packed, packed, torch.empty_like(packed), varlen=True)
    assert not hdq.covers(q, q, dq.half())  # another dtype
    assert not hdq.covers(q, q, dq[:, :32])  # another shape
    unaligned = torch.empty(2, 64, 8, 129, dtype=torch.bfloat16)[..., :128]  # rows TMA cannot address
    assert not hdq.covers(q, q, unaligned) and not hdq.covers(q, unaligned, dq)  # as dq or as dout


def test_uncovered_calls_are_refused_before_any_launch():
    """hopper_attention_dq names what it has no variant for (head dim, softcap) and what it
    covers, before anything is launched."""
    q = torch.empty(1, 64, 4, 64, dtype=torch.bfloat16)
    k = torch.empty(1, 64, 2, 64, dtype=torch.bfloat16)
    lse = torch.empty(1, 4, 64)
    args = (q, k, k, q, lse, torch.empty_like(lse), torch.empty_like(q))
    with pytest.raises(ValueError, match=r"head dim 64 with a softcap \(covered: \[128, 256\]\)"):
        hdq.hopper_attention_dq(*args, softmax_scale=0.1, causal=True, softcap=30.0)
    q96, k96 = q.new_empty(1, 64, 4, 96), k.new_empty(1, 64, 2, 96)
    with pytest.raises(ValueError, match=r"head dim 96 \(covered: \[64, 128, 256\]\)"):
        hdq.hopper_attention_dq(q96, k96, k96, q96, lse, torch.empty_like(lse), torch.empty_like(q96),
                                softmax_scale=0.1, causal=True)  # fmt: skip


def test_pinned_sets_both_tables_and_restores_them():
    before = (dict(hdq.DEFAULT), dict(hdq.VARLEN_DEFAULT))
    with hdq.pinned(128, "triton"):
        assert hdq.variant_for(128) is None and hdq.variant_for(128, varlen=True) is None
    with pytest.raises(RuntimeError):
        with hdq.pinned(64, "dq2x64-n64-s3"):
            assert hdq.variant_for(64) == hdq.variant_for(64, varlen=True) == "dq2x64-n64-s3"
            raise RuntimeError("inside the block")
    assert (dict(hdq.DEFAULT), dict(hdq.VARLEN_DEFAULT)) == before
    for name, d in (("dq9", 128), ("dq3x64-n64-s3", 128)):  # unknown; built for another head dim
        with pytest.raises(ValueError, match="unknown dQ variant"):
            with hdq.pinned(d, name):
                pass
    assert (dict(hdq.DEFAULT), dict(hdq.VARLEN_DEFAULT)) == before


def test_launch_args_refuse_what_a_variant_does_not_build():
    q = torch.empty(256, 8, 256, dtype=torch.bfloat16)
    k = torch.empty(256, 2, 256, dtype=torch.bfloat16)
    lse = torch.empty(8, 256)
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    sched = torch.empty(8, 2, dtype=torch.int32)
    args = (q, k, k, q, lse, torch.empty_like(lse), torch.empty_like(q))
    with pytest.raises(ValueError, match="no packed"):
        hdq.launch_args(*args, softmax_scale=0.1, causal=True, variant="dq2x64-n32-s3", cu_seqlens_q=cu,
                        cu_seqlens_k=cu, sched=sched)  # fmt: skip
    with pytest.raises(ValueError, match="head dims"):
        hdq.launch_args(*args, softmax_scale=0.1, causal=True, variant="dq2x64-n64-s3", cu_seqlens_q=cu,
                        cu_seqlens_k=cu, sched=sched)  # fmt: skip
    with pytest.raises(ValueError, match="laid out like lse"):
        hdq.launch_args(q, k, k, q, lse, torch.empty(256, 8).t(), torch.empty_like(q), softmax_scale=0.1,
                        causal=True, variant="dq2x64-n32-s2", cu_seqlens_q=cu, cu_seqlens_k=cu, sched=sched)  # fmt: skip


def test_dq_kernel_takes_the_calls_a_dkdv_only_variant_leaves(monkeypatch):
    """flash_attn_backward beside a dK/dV-only Gluon variant: the Gluon dQ kernel where ``covers``
    says so, the Triton dQ kernel otherwise (the launches stubbed: no GPU here)."""
    from hf_flash.kernels import flash_bwd

    calls = _stub_backward(monkeypatch, path="hopper")
    monkeypatch.setattr(hb, "variant_for", lambda d, *a, **kw: "kv64-m64-s2-splitd" if d == 256 else "kv2x64-m64-s2")

    assert _backward(flash_bwd, calls, 128) == ["gluon"] and _backward(flash_bwd, calls, 64) == ["gluon"]
    assert _backward(flash_bwd, calls, 256) == ["gluon"] and _backward(flash_bwd, calls, 256, softcap=30.0) == ["gluon"]
    assert _backward(flash_bwd, calls, 64, softcap=30.0) == ["triton-dq"]
    with hdq.pinned(128, "triton"):
        assert _backward(flash_bwd, calls, 128) == ["triton-dq"]


def test_dq_kernel_beside_the_triton_dkdv_kernel(monkeypatch):
    """Soft-capped d128 calls (their Gluon dK/dV spills; ``attention_bwd.supports``) run the
    Triton dK/dV kernel and the Gluon dQ kernel, where the Gluon forward covers the call and the
    Hopper backward is on; d64 ones, calls with ALiBi, sinks or key bounds, and calls with the
    Hopper backward switched off run both Triton kernels."""
    from hf_flash.kernels import flash_bwd
    from hf_flash.kernels import configs
    from hf_flash.kernels.hopper import attention_fwd

    calls = _stub_backward(monkeypatch, path="triton")
    monkeypatch.setattr(configs, "hopper_enabled", lambda device: True)  # an sm_90 device
    monkeypatch.setattr(attention_fwd, "supports", lambda *a, alibi=None, dropout=0.0, **kw: alibi is None and dropout == 0)

    assert _backward(flash_bwd, calls, 128, softcap=30.0) == ["triton-dkdv", "gluon"]
    assert _backward(flash_bwd, calls, 64, softcap=30.0) == ["triton-dkdv", "triton-dq"]
    assert _backward(flash_bwd, calls, 128, softcap=30.0, alibi_slopes=torch.ones(4)) == ["triton-dkdv", "triton-dq"]
    with configs.use_hopper_backward(False):
        assert _backward(flash_bwd, calls, 128, softcap=30.0) == ["triton-dkdv", "triton-dq"]
    q = torch.empty(1, 64, 4, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 64, 2, 128, dtype=torch.bfloat16)
    common = dict(backward_variant=None, varlen=False, causal=True, window_left=-1, window_right=0, softcap=30.0,
                  dropout_p=0.0, softmax_scale=0.1)  # fmt: skip
    assert flash_bwd.gluon_dq_variant(q, k, k, None, None, **common) == hdq.DEFAULT[128]
    assert flash_bwd.gluon_dq_variant(q, k, k, None, None, sinks=torch.ones(4), **common) is None
    assert flash_bwd.gluon_dq_variant(q, k, k, None, None, key_bounds=torch.ones(1), **common) is None


def _stub_backward(monkeypatch, path):
    """Stub flash_attn_backward's launches (no GPU here); returns the list each launch appends its
    name to."""
    from hf_flash.kernels import flash_bwd

    calls = []
    monkeypatch.setattr(flash_bwd, "backward_path", lambda *a, **kw: path)
    monkeypatch.setattr(flash_bwd, "backward_preprocess", lambda *a, **kw: (torch.empty(0), None))
    monkeypatch.setattr(hb, "hopper_attention_backward", lambda *a, **kw: False)  # dQ left to a kernel
    monkeypatch.setattr(hb, "sem_from_preprocess", lambda *a, **kw: None)
    monkeypatch.setattr(hdq, "hopper_attention_dq", lambda *a, **kw: calls.append("gluon"))
    monkeypatch.setattr(flash_bwd, "_DQ", lambda *a, **kw: calls.append("triton-dq"))
    monkeypatch.setattr(flash_bwd._DQ, "meta_for", lambda **kw: None, raising=False)
    monkeypatch.setattr(flash_bwd, "_DKDV", lambda *a, **kw: calls.append("triton-dkdv"))
    monkeypatch.setattr(flash_bwd._DKDV, "meta_for", lambda **kw: None, raising=False)
    return calls


def _backward(flash_bwd, calls, d, softcap=0.0, alibi_slopes=None):
    """The launches of one stubbed causal backward call at head dim ``d``."""
    q = torch.randn(1, 64, 4, d, dtype=torch.bfloat16)
    k = torch.randn(1, 64, 2, d, dtype=torch.bfloat16)
    lse = torch.empty(1, 4, 64)
    flash_bwd.flash_attn_backward(
        q, None, q, k, k, q, lse, torch.empty_like(q), torch.empty_like(k), torch.empty_like(k),
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=64, max_seqlen_k=64, softmax_scale=0.1,
        causal=True, window_left=-1, window_right=0, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=0.0,
        rng_state=None,
    )  # fmt: skip
    launched = list(calls)
    calls.clear()
    return launched
