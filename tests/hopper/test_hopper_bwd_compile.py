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
# change that spills more fails here; d64 and the split-D d256 form must not spill.
SPILL_BYTES = {64: 0, 128: 160, 256: 0}
SPILL_BYTES_DQ = {64: 0, 128: 384}
# the packed (varlen) form with dQ: its document bounds are loaded values (registers), not kernel
# arguments; dqwld measured 292/468 causal, 100/152 non-causal (.notes/hopper-bwd.md, session 19);
# without dQ (s2) it stays within SPILL_BYTES; d64 with dQ by atomics (dqa, the packed
# non-deterministic choice) spills nothing (session 47)
SPILL_BYTES_VARLEN_DQ = {64: 0, 128: 512}
# lse/delta through shared memory (stats_smem), CPU compile, session 26: d128 dqwldfs 8/8 bytes
# causal and not (dqwldf 108/140 causal); d64 with 128 query rows per step (dqwlds) 60/72 causal
# (420-1144 with the vectors in registers)
SPILL_BYTES_STATS = {64: 96, 128: 32}
# with lse and delta read before the S^T wait (stats_early: 32 registers live across the
# products), CPU compile, session 30: dqwldfpsbrr 20/24 bytes non-causal, 136/160 causal
SPILL_BYTES_STATS_EARLY = {128: 160}
# the same with a two-sided window (non-causal: both mask edges live), session 33: dqwldfpsbrr
# 152/180 bytes, its key-block-fastest form 160/188 (the window specs compiled the packed
# defaults for dense calls until then, so these builds were not checked)
SPILL_BYTES_STATS_EARLY_WINDOW = {128: 192}
# stats_early with the dQ product queued behind dK (dq_early: its accumulator, 32 registers, live
# across the dV and dK waits), session 41: dqwldfpsbrr-kf-ts-e 160/160 bytes non-causal (the
# pieced build), 164 causal (a build no call takes)
SPILL_BYTES_STATS_EARLY_DQ_EARLY = {128: 192}

def _variant(spec_name):
    for prefix in (compile_check.BWD_VARLEN_PREFIX, "bwd:"):
        if spec_name.startswith(prefix):
            return hb.VARIANTS[spec_name[len(prefix):]], prefix == compile_check.BWD_VARLEN_PREFIX
    raise ValueError(spec_name)


# every variant causal in bfloat16 (the branch with the most code); the defaults non-causal in
# float16
SPECS = [("bwd:" + name, d, True, "bfloat16") for name, var in hb.VARIANTS.items() for d in var.head_dims]
SPECS += [("bwd:" + name, d, False, "float16") for (d, causal), name in hb.DEFAULT.items() if not causal]
SPECS += [("bwd:" + name, d, causal, "float16") for (d, causal), ranges in hb.SEQLEN_VARIANTS.items()
          for _, _, name in ranges]  # fmt: skip
# the packed (varlen) forms (compile_check.bwd_varlen_variants): causal bf16, non-causal fp16
SPECS += [(name, d, causal, "bfloat16" if causal else "float16")
          for name in compile_check.bwd_varlen_variants() for d in _variant(name)[0].head_dims
          for causal in (True, False)]  # fmt: skip
# sliding windows (two-sided non-causal, left-bounded causal): the variants windowed calls run,
# dense and packed, bfloat16
SPECS += [(prefix + hb.variant_for(d, causal, prefix == compile_check.BWD_VARLEN_PREFIX), d, causal, "bfloat16",
           "window")
          for prefix in ("bwd:", compile_check.BWD_VARLEN_PREFIX)
          for d in hb.covered_head_dims(prefix == compile_check.BWD_VARLEN_PREFIX)
          for causal in (True, False)]  # fmt: skip
# the tail-pieced forms (tail_split: built with pieces only for dense calls without a mask)
SPECS += [("bwd:" + name, d, False, "float16") for name, var in hb.VARIANTS.items() if var.tail_split
          for d in var.head_dims]  # fmt: skip
SPECS = list(dict.fromkeys(SPECS))  # a default also listed above is compiled once
# the softcap (the split-D d256 form only), with and without a window, dense and packed
SPECS += [(prefix + hb.variant_for(256, causal, prefix == compile_check.BWD_VARLEN_PREFIX), 256, causal,
           "bfloat16", features)
          for prefix in ("bwd:", compile_check.BWD_VARLEN_PREFIX) for causal in (True, False)
          for features in ("softcap", "window-softcap")]  # fmt: skip


@pytest.fixture(scope="module")
def reports():
    return dict(zip(SPECS, compile_check.check_many(SPECS)))


@pytest.mark.parametrize("spec", SPECS, ids=["-".join(map(str, s)) for s in SPECS])
def test_bwd_variant_builds_for_sm90a(reports, spec):
    r = reports[spec]
    variant, head_dim, causal, dtype, *features = spec
    var, varlen = _variant(variant)
    assert (r["variant"], r["head_dim"], r["causal"], r["dtype"], r["features"]) == (*spec[:4], "".join(features))
    if var.dq_atomic:
        bound = (SPILL_BYTES_VARLEN_DQ if varlen else SPILL_BYTES_DQ)[head_dim]
    else:
        bound = SPILL_BYTES[head_dim]
    if var.stats_smem:
        bound = SPILL_BYTES_STATS[head_dim]  # no lse/delta vectors or their addresses in registers
        if var.stats_early:
            bound = SPILL_BYTES_STATS_EARLY[head_dim]
            if "window" in features and not causal:
                bound = SPILL_BYTES_STATS_EARLY_WINDOW[head_dim]
            elif var.dq_early:
                bound = SPILL_BYTES_STATS_EARLY_DQ_EARLY[head_dim]
    assert r["spill_store_bytes"] <= bound and r["spill_load_bytes"] <= bound, r
    assert r["shared_bytes"] <= SHARED_LIMIT, r
    assert not r["wgmma_serialized"], r
    # per consumer: S^T = K Q^T and dP^T = V dO^T have D/16 k-steps each, dV += P^T dO and
    # dK += dS^T Q have BLOCK_M/16 each, dQ = dS K has BLOCK_N/16 (dq_shared: one product per
    # consumer's dS, each on half the columns; dq_lag: the products appear twice, in the loop and
    # after it for the last step)
    dq_steps = (var.block_n // 16) * (var.consumers if var.dq_shared and not var.split_d else 1) if var.dq_atomic else 0
    dq_steps *= 2 if var.dq_lag else 1
    dq_steps *= var.block_m // 64 if not var.split_d else 1  # dQ's M is the step's rows: m64 instructions
    # (dV and dK of M = BLOCK_N keys: one wgmma per 64 rows and k-step; split-D: all the program's
    # keys, each consumer half of the columns)
    dkdv_steps = 2 * (var.block_n // 64) * var.block_m // 16
    assert r["wgmma"] == (2 * head_dim // 16 + dkdv_steps + dq_steps) * var.consumers, r
    assert r["tma_loads"] > 0, r
    # one reduce per consumer (dq_lag: also after the loop); the dQ writer issues each consumer's
    # float32 tile of D / 2 columns as its 128-byte TMA boxes (two at d128, one at d64; dq_frag:
    # one 16 x 256 box), in one place per writer (dq_parity: two writer partitions)
    if var.dq_writer:
        writers = 2 if var.dq_parity else 1
        boxes = 1 if var.dq_frag else head_dim // var.consumers * 4 // 128
        assert r["tma_reduces"] == boxes * var.consumers * writers, r
    else:
        assert r["tma_reduces"] == (var.consumers * (2 if var.dq_lag else 1) if var.dq_atomic else 0), r
    assert hb.PRODUCER_REGS in r["setmaxnreg"] and var.consumer_regs in r["setmaxnreg"], r


def test_ordered_dense_builds_store_each_writer_tile_once_more(reports):
    # ordered dQ in dense calls: beside each of the writer's reduce-adds, a TMA store of the same
    # tile (the first key block's turn: no zero fill); the other dense builds store dK and dV only
    checked = 0
    for spec, r in reports.items():
        var, varlen = _variant(spec[0])
        if varlen or var.split_d or not var.dq_writer:
            continue
        dkdv = 2 * var.consumers
        assert r["tma_stores"] == dkdv + (r["tma_reduces"] if var.dq_ordered else 0), r
        checked += var.dq_ordered
    assert checked >= 10


def test_bwd_defaults_are_variants_for_their_head_dim():
    assert hb.covered_head_dims() <= set(hb.HEAD_DIMS) and 128 in hb.covered_head_dims()
    for (d, causal), name in hb.DEFAULT.items():
        assert d in hb.VARIANTS[name].head_dims and (d, not causal) in hb.DEFAULT
        var = hb.VARIANTS[name]
        assert not var.dq_atomic or var.dq_ordered, "the default backward must be deterministic"
    assert hb.covered_head_dims(varlen=True) == {64, 128, 256}
    for (d, causal), name in hb.VARLEN_DEFAULT.items():
        var = hb.VARIANTS[name]
        assert d in var.head_dims and (d, not causal) in hb.VARLEN_DEFAULT and hb.varlen_builds(name)
        assert not var.dq_atomic or var.dq_ordered, "the packed backward must be deterministic"
        assert hb.variant_for(d, causal, varlen=True) == name
        with configs.use_deterministic(False):
            assert hb.variant_for(d, causal, varlen=True) == hb.VARLEN_NONDETERMINISTIC.get((d, causal), name)
    for (d, causal), name in hb.VARLEN_NONDETERMINISTIC.items():
        assert hb.varlen_builds(name) and d in hb.VARIANTS[name].head_dims
    assert not any(hb.varlen_builds(n) for n, v in hb.VARIANTS.items() if v.dq_frag)


def test_seqlen_ranges_are_ordered_and_disjoint():
    for key, ranges in hb.SEQLEN_VARIANTS.items():
        bounds = [(lo, hi) for lo, hi, _ in ranges]
        assert all(lo <= hi for lo, hi in bounds), key
        assert all(prev_hi < lo for (_, prev_hi), (lo, _) in zip(bounds, bounds[1:])), key


def test_dense_calls_in_a_seqlen_range_take_its_variant():
    # SEQLEN_VARIANTS: dense calls inside the range take the listed (deterministic) variant; outside
    # it, with the length unknown (0), or packed, the default
    for (d, causal), (lo, hi, name) in ((key, r) for key, ranges in hb.SEQLEN_VARIANTS.items() for r in ranges):
        var = hb.VARIANTS[name]
        assert d in var.head_dims and (not var.dq_atomic or var.dq_ordered)
        assert hb.variant_for(d, causal, seqlen_q=lo) == hb.variant_for(d, causal, seqlen_q=hi) == name
        # just outside the range: the next range's variant where one starts there, else DEFAULT
        for s in (lo - 1, hi + 1, 0):
            nxt = [n for a, b, n in hb.SEQLEN_VARIANTS[(d, causal)] if a <= s <= b and (a, b) != (lo, hi)]
            assert hb.variant_for(d, causal, seqlen_q=s) == (nxt[0] if nxt else hb.DEFAULT[(d, causal)])
        # windowed calls were not measured: the default (causal: the diagonal alone is no window)
        assert hb.variant_for(d, causal, seqlen_q=lo, window=(128, 0 if causal else 128)) == hb.DEFAULT[(d, causal)]
        assert hb.variant_for(d, causal, seqlen_q=lo, window=(-1, 0 if causal else -1)) == name
        if not causal:
            assert hb.variant_for(d, causal, seqlen_q=lo, window=(-1, 5)) == hb.DEFAULT[(d, causal)]
        if (d, causal) in hb.VARLEN_DEFAULT:
            assert hb.variant_for(d, causal, varlen=True) == hb.VARLEN_DEFAULT[(d, causal)]


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
    # sliding windows, causal or not, either side
    assert _path(_call(), window_left=16, causal=True, window_right=0) == "hopper"
    assert _path(_call(), window_left=16, window_right=4) == "hopper"
    assert _path(_call(), window_right=4) == "hopper"
    assert _path(_call(), window_left=5) == "hopper"
    q, k, *_ = _call()
    # out/dout/dk/dv not allocated yet (attention_paths): laid out like q / k
    assert _path((q, k, k, None, None, None, None)) == "hopper"


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(dict(varlen=True), id="varlen"),
        pytest.param(dict(softcap=30.0), id="softcap"),
        pytest.param(dict(window_left=16, softcap=30.0), id="window-softcap"),
        pytest.param(dict(alibi_slopes=torch.zeros(8)), id="alibi"),
        pytest.param(dict(dropout_p=0.1), id="dropout"),
    ],
)
def test_backward_path_rejects_features(on_hopper, change):
    assert _path(_call(), **change) == "triton"


@pytest.mark.parametrize("d", [32, 80, 96, 192, 512])
def test_backward_path_rejects_other_head_dims(on_hopper, d):
    assert _path(_call(d)) == "triton"


def test_backward_path_head_dim_256(on_hopper):
    """d256 (Gemma 2/3) runs the split-D form: dense and packed, causal or not, with windows and
    the softcap (Gemma 2); a soft-capped d128 call keeps the Triton backward."""
    assert hb.variant_for(256, True) == hb.variant_for(256, False, varlen=True) == "kv64-m64-s2-splitd"
    assert _path(_call(256)) == "hopper"
    assert _path(_call(256), causal=True, window_right=0) == "hopper"
    assert _path(_call(256), window_left=16, causal=True, window_right=0) == "hopper"
    assert _path(_call(256), window_left=16, window_right=4) == "hopper"
    assert _path(_packed(d=256), varlen=True, causal=True, window_right=0) == "hopper"
    assert _path(_call(256), softcap=30.0) == "hopper"
    assert _path(_call(256), softcap=30.0, window_left=16, causal=True, window_right=0) == "hopper"
    assert _path(_packed(d=256), varlen=True, softcap=30.0) == "hopper"
    assert _path(_call(128), softcap=30.0) == "triton"


def test_backward_head_dims_follow_default(on_hopper, monkeypatch):
    """A head dim is covered exactly when DEFAULT (packed: VARLEN_DEFAULT) names a variant for
    it: dense d64 runs the 128-row form with lse/delta in shared memory (causal: its tiles walked
    down), packed d64 the 64-row dK/dV form with the Gluon dQ kernel beside it (deterministic,
    and the faster form without the guarantee too); soft-capped d64 calls keep the Triton
    backward."""
    from hf_flash.kernels.hopper import attention_dq as hdq

    assert hb.variant_for(64, False) == "kv2x64-m128-s2-dqwlds"
    assert hb.variant_for(64, True) == "kv2x64-m128-s2-dqwlds-dn"  # the same, tiles walked down
    assert hb.variant_for(64, False, varlen=True) == hb.variant_for(64, True, varlen=True) == "kv2x64-m64-s2"
    assert hdq.variant_for(64, varlen=True) == hdq.VARLEN_DEFAULT[64]
    with configs.use_deterministic(False):
        assert hb.variant_for(64, True, varlen=True) == "kv2x64-m64-s2"
    assert _path(_call(64)) == "hopper"
    assert _path(_call(64), causal=True, window_right=0) == "hopper"
    assert _path(_call(64), window_left=16, window_right=4) == "hopper"
    assert _path(_packed(d=64), varlen=True, causal=True, window_right=0) == "hopper"
    assert _path(_packed(d=64), varlen=True) == "hopper"
    assert _path(_call(64), softcap=30.0) == "triton"
    assert _path(_packed(d=64), varlen=True, causal=True, window_right=0, softcap=30.0) == "triton"
    monkeypatch.delitem(hb.DEFAULT, (64, False))
    monkeypatch.delitem(hb.DEFAULT, (64, True))
    assert _path(_call(64)) == "triton"
    monkeypatch.delitem(hb.VARLEN_DEFAULT, (64, True))
    assert _path(_packed(d=64), varlen=True, causal=True, window_right=0) == "triton"


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


def _packed(d=128, dtype=torch.bfloat16, h=8, hk=2, tq=300, tk=300):
    q, k = _t(tq, h, d, dtype=dtype), _t(tk, hk, d, dtype=dtype)
    return q, k, torch.empty_like(k), torch.empty_like(q), torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)


def test_backward_path_packed_calls(on_hopper):
    """Packed (varlen) calls at head dims 64, 128 and 256 take the Gluon backward, causal or not,
    GQA/MQA, fp16/bf16, whether or not the packed Gluon forward is switched on."""
    for dtype in (torch.bfloat16, torch.float16):
        assert _path(_packed(dtype=dtype), varlen=True) == "hopper"
        assert _path(_packed(dtype=dtype), varlen=True, causal=True, window_right=0) == "hopper"
    assert _path(_packed(h=32, hk=8, tq=100, tk=5000), varlen=True, causal=True, window_right=0) == "hopper"
    assert _path(_packed(h=8, hk=1), varlen=True) == "hopper"  # MQA
    assert _path(_packed(), varlen=True, window_left=16, causal=True, window_right=0) == "hopper"
    assert _path(_packed(), varlen=True, window_left=16, window_right=4) == "hopper"
    for enabled in (False, True):
        with configs.use_hopper_varlen(enabled):
            assert _path(_packed(), varlen=True) == "hopper"
    q, k, *_ = _packed()
    assert _path((q, k, k, None, None, None, None), varlen=True) == "hopper"
    assert _path(_packed(256), varlen=True) == "hopper"
    assert _path(_packed(64), varlen=True) == "hopper"
    for d in (80, 192):
        assert _path(_packed(d), varlen=True) == "triton"
    assert _path(_packed(dtype=torch.float32), varlen=True) == "triton"
    # dense tensors called as packed, and packed as dense, are not covered
    assert _path(_call(), varlen=True) == "triton"
    assert _path(_packed()) == "triton"
    with configs.use_hopper_backward(False):
        assert _path(_packed(), varlen=True) == "triton"


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(dict(softcap=30.0), id="softcap"),
        pytest.param(dict(alibi_slopes=torch.zeros(8)), id="alibi"),
        pytest.param(dict(dropout_p=0.1), id="dropout"),
        pytest.param(dict(sinks=torch.zeros(8)), id="sinks"),
    ],
)
def test_backward_path_packed_rejects_features(on_hopper, change):
    assert _path(_packed(), **{"varlen": True, **change}) == "triton"


def test_packed_launch_args_and_counters():
    """The packed launch: one program per (schedule entry, K/V head), one dQ counter per (head,
    query-tile slot) with Tq // 64 + batch slots per head (no host sync reads cu_seqlens)."""
    name = "kv2x64-m64-s2-dqwld"  # the ordered fused form (its packed build)
    lens = [1, 0, 97, 1025, 300]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens, h, hk = sum(lens), 8, 2
    q, k, v, out, dout, dk, dv = _packed(h=h, hk=hk, tq=tokens, tk=tokens)
    lse = torch.empty(h, tokens)
    assert hb.dq_sem_count(q, name, cu) == h * (tokens // 64 + len(lens))
    sched = hb.varlen_key_schedule(cu, cu, tokens, name, causal=True)
    assert torch.equal(sched, hf.varlen_schedule(cu, cu, tokens, rows=hb.VARIANTS[name].keys, block_n=64, causal=True))
    grid, args, kwargs = hb.launch_args(
        q, k, v, dout, lse, torch.empty_like(lse), dk, dv, hb.dq_accum_for(q, name),
        torch.zeros(hb.dq_sem_count(q, name, cu), dtype=torch.int32), softmax_scale=0.1, causal=True,
        variant=name, cu_seqlens_q=cu, cu_seqlens_k=cu, sched=sched,
    )  # fmt: skip
    assert grid == (sched.shape[0] * hk,) and kwargs["VARLEN"] is True
    assert args[11] is sched
    # every key tile of every non-empty sequence is one entry
    tiles = sorted(tuple(e) for e in sched.tolist() if e[0] >= 0)
    assert tiles == [(d, i) for d, n in enumerate(lens) for i in range(-(-n // 128))]
    assert hb.dq_accum_for(q, name).shape == q.shape
    with pytest.raises(ValueError, match="dq_sem"):
        hb.launch_args(q, k, v, dout, lse, torch.empty_like(lse), dk, dv, hb.dq_accum_for(q, name),
                       torch.zeros(h * (tokens // 64)), softmax_scale=0.1, causal=True, variant=name,
                       cu_seqlens_q=cu, cu_seqlens_k=cu)  # fmt: skip
    with pytest.raises(ValueError, match="sched="):  # the programs must be given
        hb.launch_args(q, k, v, dout, lse, torch.empty_like(lse), dk, dv, hb.dq_accum_for(q, name),
                       torch.zeros(hb.dq_sem_count(q, name, cu), dtype=torch.int32), softmax_scale=0.1,
                       causal=True, variant=name, cu_seqlens_q=cu, cu_seqlens_k=cu)  # fmt: skip
    frag = next(n for n, v in hb.VARIANTS.items() if v.dq_frag)
    with pytest.raises(ValueError, match="packed"):
        hb.dq_accum_for(q, frag)


def test_packed_dq_counter_slots_never_collide():
    """Query tile i of sequence d at slot cu[d] // 64 + d + i: distinct for every (d, i) and
    below Tq // 64 + batch, whatever the lengths (empty and one-token sequences included)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        lens = torch.randint(0, 400, (n,), generator=g)
        lens[torch.rand(n, generator=g) < 0.2] = 0
        lens[torch.rand(n, generator=g) < 0.2] = 1
        cu = [0, *lens.cumsum(0).tolist()]
        slots = [cu[d] // 64 + d + i for d in range(n) for i in range(-(-int(lens[d]) // 64))]
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < cu[-1] // 64 + n for s in slots)


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


@pytest.mark.parametrize("seqlen,stats_m", [(97, 64), (97, 128), (50, 128), (256, 128)])
@pytest.mark.parametrize("with_dlse", [False, True], ids=["", "dlse"])
def test_preprocess_lays_out_lse_and_delta_per_query_tile(device, seqlen, stats_m, with_dlse):
    """The stats_smem variants read a step's lse (times log2 e) and delta as one row pair of
    stats_m floats per (batch, head, query tile), in that order, with lse +inf (P = 0) and delta 0
    past the sequence's end, tiles the preprocess's row blocks do not reach included (50 rows in a
    128-row tile): backward_preprocess writes exactly that beside delta (Triton kernel: runs in the
    interpreter on the CPU)."""
    batch, heads, head_dim = 2, 3, 64
    n_m = configs.cdiv(seqlen, stats_m)
    g = torch.Generator().manual_seed(seqlen + stats_m)
    # out / dout as (B, S, H, D) views of (B, H, S, D) tensors, as the transformers layout gives
    out, dout = (torch.randn(batch, heads, seqlen, head_dim, generator=g).to(torch.bfloat16).to(device).transpose(1, 2)
                 for _ in range(2))  # fmt: skip
    lse = (torch.randn(batch, heads, seqlen, generator=g) * 4).to(device)
    dlse = torch.randn(batch, heads, seqlen, generator=g).to(device) if with_dlse else None
    # the ordered-dQ counters, one per tile, handed over dirty: the launch zeroes them
    sem = torch.full((batch * heads * n_m,), 7, dtype=torch.int32, device=device)
    delta, stats = flash_bwd.backward_preprocess(out, dout, dlse, lse, cu_seqlens_q=None, max_seqlen_q=seqlen,
                                                 stats_m=stats_m, dq_sem=sem)  # fmt: skip
    assert torch.equal(sem.cpu(), torch.zeros(batch * heads * n_m, dtype=torch.int32))
    want_delta = (out.float() * dout.float()).sum(-1).transpose(1, 2).cpu()
    if with_dlse:
        want_delta -= dlse.cpu()
    torch.testing.assert_close(delta.cpu(), want_delta, rtol=1e-5, atol=1e-5)
    assert stats.shape == (hb.stats_numel(batch, heads, seqlen, stats_m),) == (batch * heads * n_m * 2 * stats_m,)
    got = stats.cpu().view(batch, heads, n_m, 2, stats_m)
    want_lse = torch.full((batch, heads, n_m * stats_m), float("inf"))
    want_lse[..., :seqlen] = lse.cpu() * hb.LOG2E
    want_tile_delta = torch.zeros(batch, heads, n_m * stats_m)
    want_tile_delta[..., :seqlen] = delta.cpu()
    torch.testing.assert_close(got[:, :, :, 0].reshape(batch, heads, -1), want_lse, rtol=1e-6, atol=0)
    assert torch.equal(got[:, :, :, 1].reshape(batch, heads, -1), want_tile_delta)
    none_delta, none_stats = flash_bwd.backward_preprocess(out, dout, dlse, lse, cu_seqlens_q=None,
                                                           max_seqlen_q=seqlen)  # fmt: skip
    assert none_stats is None and torch.equal(none_delta, delta)


def test_preprocess_refuses_a_statistics_buffer_it_cannot_lay_out():
    """Packed calls, lse with strided rows and tiles that are not whole 64-row blocks are refused
    before any launch, with what was wrong."""
    out = torch.empty(1, 97, 2, 64, dtype=torch.bfloat16)
    lse = torch.empty(1, 2, 97)
    with pytest.raises(ValueError, match="dense call"):
        flash_bwd.backward_preprocess(out, out, None, torch.empty(1, 97, 2).transpose(1, 2), cu_seqlens_q=None,
                                      max_seqlen_q=97, stats_m=64)  # fmt: skip
    with pytest.raises(ValueError, match="stats_m=96"):
        flash_bwd.backward_preprocess(out, out, None, lse, cu_seqlens_q=None, max_seqlen_q=97, stats_m=96)
    with pytest.raises(ValueError, match="varlen=True"):
        cu = torch.tensor([0, 97], dtype=torch.int32)
        flash_bwd.backward_preprocess(out[0], out[0], None, lse[0], cu_seqlens_q=cu, max_seqlen_q=97, stats_m=64)
    # counters to zero: one int32 per statistics tile (2 heads x 2 tiles of 64 rows), with stats_m
    for sem, stats_m in ((torch.zeros(3, dtype=torch.int32), 64), (torch.zeros(4), 64),
                         (torch.zeros(4, dtype=torch.int32), 0)):  # fmt: skip
        with pytest.raises(ValueError, match="dq_sem must be"):
            flash_bwd.backward_preprocess(out, out, None, lse, cu_seqlens_q=None, max_seqlen_q=97, stats_m=stats_m,
                                          dq_sem=sem)  # fmt: skip


def _stats_call(name, sq, sk):
    """A dense call's tensors (:func:`_call`) with the lse, dQ counters and statistics buffer a
    stats_smem variant ``name`` launches with."""
    q, k, v, out, dout, dk, dv = _call(sq=sq, sk=sk)
    lse = torch.empty(2, 8, sq)
    sem = torch.zeros(hb.dq_sem_count(q, name), dtype=torch.int32)
    stats = torch.empty(hb.stats_numel(2, 8, sq, hb.VARIANTS[name].block_m))
    return q, k, v, dout, dk, dv, lse, sem, stats


def test_stats_variant_launch_needs_its_buffer():
    """A stats_smem variant's launch takes the statistics buffer of the call's size, dense calls
    only; its descriptor is the eighth descriptor (the others pass q's in that place)."""
    name = next(n for n, v in hb.VARIANTS.items() if v.stats_smem)
    var = hb.VARIANTS[name]
    q, k, v, dout, dk, dv, lse, sem, stats = _stats_call(name, 97, 97)
    grid, args, kwargs = hb.launch_args(q, k, v, dout, lse, torch.empty_like(lse), dk, dv, hb.dq_accum_for(q, name),
                                        sem, stats, softmax_scale=0.1, causal=True, variant=name)  # fmt: skip
    assert kwargs["STATS_SMEM"] is True and args[7].base is stats and args[7].block_shape == [2, var.block_m]
    for wrong in (None, torch.empty(stats.numel() - 1), stats.double()):
        with pytest.raises(ValueError, match="stats buffer"):
            hb.launch_args(q, k, v, dout, lse, torch.empty_like(lse), dk, dv, hb.dq_accum_for(q, name), sem, wrong,
                           softmax_scale=0.1, causal=True, variant=name)  # fmt: skip
    with pytest.raises(ValueError, match="pass stats"):  # before anything is allocated or launched
        hb.hopper_attention_backward(q, k, v, dout, lse, torch.empty_like(lse), torch.empty_like(q), dk, dv,
                                     softmax_scale=0.1, causal=True, variant=name)  # fmt: skip
    assert not hb.varlen_builds(name)
    # a variant that reads lse/delta from global memory passes q's descriptor in that place
    other = "kv2x64-m64-s2-dqwldfp"
    assert var.stats_rows == var.block_m and not hb.VARIANTS[other].stats_smem and hb.VARIANTS[other].stats_rows == 0
    _, args, kwargs = hb.launch_args(q, k, v, dout, lse, torch.empty_like(lse), dk, dv, hb.dq_accum_for(q, other),
                                     sem, softmax_scale=0.1, causal=True, variant=other)  # fmt: skip
    assert kwargs["STATS_SMEM"] is False and args[7] is args[0]


def test_packed_longest_order_keeps_key_blocks_ascending():
    """The "longest" packed order puts the documents with the most work first and keeps each
    document's key blocks in ascending order (the ordered dQ waits only on programs launched
    before it); empty entries go last."""
    lens = [349, 258, 3417, 0, 1107, 2420, 1, 2330]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    sched = hf.varlen_schedule(cu, cu, sum(lens), rows=128, block_n=64, causal=True)
    got = hb._longest_documents_first(sched, cu, cu).tolist()
    assert sorted(map(tuple, got)) == sorted(map(tuple, sched.tolist()))
    docs = [d for d, _ in got if d >= 0]
    assert list(dict.fromkeys(docs)) == sorted({d for d in docs}, key=lambda d: -lens[d] ** 2)
    for d in set(docs):
        assert [t for e, t in got if e == d] == list(range(-(-lens[d] // 128)))
    first_empty = next(i for i, (d, _) in enumerate(got) if d < 0)
    assert all(d < 0 for d, _ in got[first_empty:])


def test_variant_refuses_forms_it_has_no_code_for():
    """stats_early needs the statistics in shared memory, the deferred hand-ons the dQ writer's
    lagged form; the kernel's DEFER_ARRIVE bits say which hand-ons are deferred."""
    base = dict(block_m=64, block_n=64, stages=2, consumers=2, consumer_regs=240)
    with pytest.raises(ValueError, match="stats_early needs stats_smem"):
        hb.Variant("x", stats_early=True, **base)
    for flag in ("defer_ds", "defer_dq"):
        with pytest.raises(ValueError, match="need dq_lag and dq_writer"):
            hb.Variant("x", dq_atomic=True, dq_shared=True, **{flag: True}, **base)
    with pytest.raises(ValueError, match="tail_split has no split_d form"):
        hb.Variant("x", split_d=True, tail_split=True, **base)
    writer = dict(dq_atomic=True, dq_shared=True, dq_lag=True, dq_writer=True, **base)
    assert [hb.Variant("x", defer_ds=ds, defer_dq=dq, **writer).defer_arrive
            for ds, dq in ((False, False), (True, False), (False, True), (True, True))] == [0, 1, 2, 3]


def test_pinned_names_one_variant_at_every_length_and_restores():
    name = next(n for n, v in hb.VARIANTS.items() if 128 in v.head_dims and n not in hb.DEFAULT.values())
    default, ranges = dict(hb.DEFAULT), dict(hb.SEQLEN_VARIANTS)
    with hb.pinned(name, (128,)):
        for causal in (False, True):
            for s in (0, 2048, 4096, 16384, 65536):
                assert hb.variant_for(128, causal, seqlen_q=s) == name
        assert hb.variant_for(64, True, seqlen_q=4096) == default[(64, True)]  # other head dims untouched
    assert hb.DEFAULT == default and hb.SEQLEN_VARIANTS == ranges
    with pytest.raises(ValueError, match="unknown backward variant"):
        with hb.pinned("no-such-variant"):
            pass


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, -1)), (False, (3, 2)),
                                           (False, (-1, 4)), (False, (6, -1)), (True, (0, -1))])  # fmt: skip
def test_rows_without_keys_counts_the_rows_that_see_none(causal, window):
    # brute force over small shapes: row i at key position i + sk - sq sees key j iff j is within
    # the window (causal: right bound 0)
    left, right = window
    right = 0 if causal else right
    for sq in range(0, 12):
        for sk in range(1, 12):
            blind = 0
            for i in range(sq):
                pos = i + sk - sq
                sees = any((left < 0 or j >= pos - left) and (right < 0 or j <= pos + right) for j in range(sk))
                assert sees or blind == i, "rows without keys form a prefix"
                blind += not sees
            assert hb.rows_without_keys(sq, sk, causal, window) == blind, (sq, sk)


def test_tail_plan_splits_the_partial_wave():
    """The last n_units % SMs units run in pieces when that shortens the launch by >= 1%: the
    smallest piece count whose rounds of pieces (times the longest piece) end soonest."""
    # the bar's d128 non-causal shapes on 132 SMs: 1,024 units (16K tokens) = 7 waves + 100;
    # five pieces of a unit: 500 pieces in 4 rounds of 1/5 = 0.8 of a wave instead of 1
    for steps in (256, 512, 1024):
        assert hb.tail_plan(1024, steps, 132) == (924, 5)
    # 32K: 2,048 units = 15 waves + 68; seven pieces: 476 in 4 rounds of 1/7
    assert hb.tail_plan(2048, 2048, 132) == (1980, 7)
    # fewer units than SMs: all of them in pieces (36 x 3 = 108 programs)
    assert hb.tail_plan(36, 68, 132) == (0, 3)
    # whole waves, a tail no split shortens (112 of 114 SMs busy), too few steps: whole units
    assert hb.tail_plan(264, 256, 132) == (264, 0)
    assert hb.tail_plan(1024, 256, 114) == (1024, 0)
    assert hb.tail_plan(4, 5, 132) == (4, 0)
    # the pieces' steps cover a unit once, in order
    for steps, pieces in ((256, 5), (68, 3), (2048, 7), (9, 2)):
        ends = [p * steps // pieces for p in range(pieces + 1)]
        assert ends[0] == 0 and ends[-1] == steps and all(a < b for a, b in zip(ends, ends[1:]))


def test_tail_launch_checks_its_pieces():
    """A pieced launch: the grid holds the whole units and every piece; refused for variants
    without tail_split, masked calls and short buffers, before anything is launched."""
    name = next(n for n, v in hb.VARIANTS.items() if v.tail_split)
    var = hb.VARIANTS[name]
    assert var.stats_smem
    q, k, v, dout, dk, dv, lse, sem, stats = _stats_call(name, 1025, 1100)
    n_units = 2 * 2 * 9
    tail = (n_units - 4, 3, *hb.tail_buffers(4, 3, var.keys, 128, "cpu"))
    assert tail[2].numel() == 4 * 3 * 2 * var.keys * 128 and tail[3].numel() == 12

    def launch(variant=name, tail=tail, causal=False, **kw):
        return hb.launch_args(q, k, v, dout, lse, torch.empty_like(lse), dk, dv, hb.dq_accum_for(q, variant), sem,
                              stats, softmax_scale=0.1, causal=causal, variant=variant, tail=tail, **kw)  # fmt: skip

    grid, args, kwargs = launch()
    assert grid == (n_units - 4 + 4 * 3,) and kwargs["TAIL"] is True
    # pointers 16-17: the workspace and its map; integers 33-34: whole units, pieces per tail unit
    assert args[16] is tail[2] and args[17] is tail[3] and args[33:35] == (n_units - 4, 3)
    assert launch(tail=None)[2]["TAIL"] is False and launch(tail=None)[0] == (n_units,)
    other = "kv2x64-m64-s2-dqwldfpsbrr"
    assert not hb.VARIANTS[other].tail_split
    with pytest.raises(ValueError, match="no tail pieces"):
        launch(variant=other)
    with pytest.raises(ValueError, match="without a causal mask or window"):
        launch(causal=True)
    with pytest.raises(ValueError, match="without a causal mask or window"):
        launch(window=(64, 64))
    with pytest.raises(ValueError, match="n_whole"):
        launch(tail=(n_units, 3, *tail[2:]))
    with pytest.raises(ValueError, match="part must be float32"):
        launch(tail=(*tail[:2], tail[2][:-1], tail[3]))
    with pytest.raises(ValueError, match="part_map must be int32"):
        launch(tail=(*tail[:3], tail[3].float()))


def test_tail_sum_adds_the_pieces_in_order(device):
    """The pieces' partials of each tail unit added in piece order (bitwise as a sequential
    float32 sum), dK scaled, stored at the unit's (b, kv_h, first key), rows past the keys
    dropped, nothing else written (Triton kernel: the interpreter on the CPU; float32 gradients,
    so the comparison is exact)."""
    batch, seqlen_k, heads_k, head_dim, keys, pieces = 2, 300, 3, 64, 128, 3
    units = [(1, 2, 256), (0, 0, 0), (1, 1, 128)]  # (b, kv_h, n0); the first crosses the end
    g = torch.Generator().manual_seed(0)
    part = torch.randn(len(units) * pieces * 2 * keys * head_dim, generator=g)
    part_map = torch.tensor(units, dtype=torch.int32).flatten()
    dk = torch.full((batch, seqlen_k, heads_k, head_dim), float("nan"))
    dv = torch.full_like(dk, float("nan"))
    hb.tail_sum((0, pieces, part.to(device), part_map.to(device)), dk := dk.to(device), dv := dv.to(device), 0.125,
                keys)  # fmt: skip
    parts = part.view(len(units), pieces, 2, keys, head_dim)
    for t, (b, h, n0) in enumerate(units):
        total = parts[t, 0]
        for p in range(1, pieces):
            total = total + parts[t, p]
        rows = min(keys, seqlen_k - n0)
        assert torch.equal(dk[b, n0:n0 + rows, h].cpu(), total[0, :rows] * 0.125)
        assert torch.equal(dv[b, n0:n0 + rows, h].cpu(), total[1, :rows])
    written = torch.zeros(batch, seqlen_k, heads_k, dtype=torch.bool)
    for b, h, n0 in units:
        written[b, n0:n0 + keys, h] = True
    assert dk.isnan().all(-1).cpu().equal(~written) and dv.isnan().all(-1).cpu().equal(~written)


def test_tail_for_plans_pieces_only_for_unmasked_dense_calls():
    """The backward's launcher asks _tail_for for a launch's pieces: the plan of tail_plan for the
    call's units and steps (132 SMs off the GPU) with buffers of its size; none for a variant
    without tail_split, a causal or windowed call, or a launch no split shortens."""
    name = next(n for n, v in hb.VARIANTS.items() if v.tail_split)
    var = hb.VARIANTS[name]
    q, k = _t(2, 3000, 16, 128), _t(2, 3100, 4, 128)
    n_units, steps = 2 * 4 * 25, 4 * 47
    n_whole, pieces, part, part_map = hb._tail_for(q, k, name, False, (-1, -1))
    assert (n_whole, pieces) == hb.tail_plan(n_units, steps, 132) == (132, 7)
    assert (part.numel(), part_map.numel()) == hb.tail_numel(n_units - n_whole, pieces, var.keys, 128)
    assert hb._tail_for(q, k, "kv2x64-m64-s2-dqwldfpsbrr", False, (-1, -1)) is None
    assert hb._tail_for(q, k, name, True, (-1, -1)) is None
    assert hb._tail_for(q, k, name, False, (256, 256)) is None
    q2, k2 = _t(2, 4096, 32, 128), _t(2, 4224, 8, 128)  # 2 x 8 x 33 = 264 units: two whole waves
    assert hb._tail_for(q2, k2, name, False, (-1, -1)) is None


def test_preprocess_zeroes_the_counters_of_dense_stats_variants():
    """sem_from_preprocess hands out unfilled dQ counters exactly where the preprocess can zero
    them (dense calls of a dq_ordered variant whose statistics tiles are its query tiles: every
    default), and None elsewhere (the backward then makes zeroed ones)."""
    q = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16)
    used = {hb.variant_for(128, causal, False, s) for causal in (False, True) for s in (256, 4096, 65536)}
    for name, var in hb.VARIANTS.items():
        if 128 not in var.head_dims or var.split_d:
            continue
        sem = hb.sem_from_preprocess(q, name, False)
        if var.dq_ordered and var.stats_rows == var.block_m:
            assert sem.dtype == torch.int32 and sem.numel() == hb.dq_sem_count(q, name)
            assert sem.numel() == hb.stats_numel(2, 4, 300, var.stats_rows) // (2 * var.stats_rows)
        else:
            assert sem is None, name
        assert hb.sem_from_preprocess(q, name, True) is None
    assert all(hb.sem_from_preprocess(q, name, False) is not None for name in used)
