"""Launch plans (hf_flash.kernels.launch.LaunchPlan / PlanCache) of the Gluon Hopper launchers,
on the CPU.

A plan keeps what a call signature determines (grid, integers, floats, constexprs, descriptor
geometry) and is found again by a key the launcher builds. These tests run the real launchers
(``hopper_attention_forward`` / ``hopper_attention_backward``) on CPU tensors with the compiled
launch replaced by a recorder, and check every recorded launch against the launcher's own
argument builder (``launch_args``) called fresh for that call: a key that missed something the
arguments depend on would hand a later call a stale plan, and its launch would differ. Calls
follow each other so that consecutive ones differ in one thing at a time. The GPU side (the
same bits with plans on and off) is in tests/ops/test_launch_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from hf_flash.kernels import launch
from hf_flash.kernels.hopper import attention_bwd as hb
from hf_flash.kernels.hopper import attention_fwd as hf

BF16, FP16 = torch.bfloat16, torch.float16


class _Recorder:
    """Stands in for a CachedLauncher: keeps each launch's arguments; ``meta`` is the real one's."""

    def __init__(self, real):
        self.real = real
        self.calls = []

    def meta(self, **kwargs):
        return self.real.meta(**kwargs)

    def __call__(self, grid, pointers, ints, floats, meta):
        self.calls.append((tuple(grid), list(pointers), tuple(ints), tuple(floats), meta))

    def run_plan(self, plan, tensors):
        """As CachedLauncher.run_plan: the launch of the plan's arguments for these tensors."""
        self(plan.grid, plan.pointers(tensors), plan.ints, plan.floats, plan.meta)


def _same_pointer(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, hf.TensorDescriptor):
        return isinstance(b, hf.TensorDescriptor) and a.base is b.base and (
            list(a.shape), list(a.strides), list(a.block_shape), a.layout, a.padding
        ) == (list(b.shape), list(b.strides), list(b.block_shape), b.layout, b.padding)  # fmt: skip
    return a is b


def _assert_launch(recorded, grid, args, n_ptr, n_int, meta_kwargs):
    got_grid, ptrs, ints, floats, meta = recorded
    assert got_grid == tuple(grid)
    assert len(ptrs) == n_ptr and all(_same_pointer(a, b) for a, b in zip(args[:n_ptr], ptrs)), "pointers differ"
    assert ints == tuple(args[n_ptr:n_ptr + n_int])
    assert floats == tuple(args[n_ptr + n_int:])
    assert meta.kwargs == meta_kwargs


def _bshd(b, s, h, d, dtype, heads_total=None):
    """(b, s, h, d); with ``heads_total``, a view of h heads of a wider tensor (other strides)."""
    t = torch.randn(b, s, heads_total or h, d, dtype=dtype)
    return t[:, :, :h] if heads_total else t


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------

FWD_CALLS = [
    # (batch, seqlen_q, seqlen_k, heads, kv heads, head dim, dtype, causal, window, softcap, scale, options)
    (1, 300, 300, 8, 2, 128, BF16, True, (-1, 0), 0.0, 0.1, {}),
    (1, 300, 300, 8, 2, 128, BF16, True, (-1, 0), 0.0, 0.1, {}),  # a repeat: the kept plan
    (1, 200, 200, 8, 2, 128, BF16, True, (-1, 0), 0.0, 0.1, {}),  # length
    (1, 200, 200, 8, 2, 128, BF16, True, (-1, 0), 0.0, 0.2, {}),  # scale
    (2, 200, 200, 8, 2, 128, BF16, True, (-1, 0), 0.0, 0.2, {}),  # batch
    (2, 200, 200, 8, 2, 128, BF16, False, (-1, -1), 0.0, 0.2, {}),  # causality
    (2, 200, 200, 8, 2, 128, BF16, False, (64, 64), 0.0, 0.2, {}),  # window
    (2, 200, 200, 8, 2, 128, BF16, False, (32, 64), 0.0, 0.2, {}),  # window's size
    (2, 200, 200, 8, 2, 128, BF16, True, (64, 0), 0.0, 0.2, {}),  # causal window
    (2, 200, 200, 8, 2, 128, BF16, True, (-1, 0), 30.0, 0.2, {}),  # softcap
    (2, 200, 200, 8, 2, 128, BF16, True, (-1, 0), 20.0, 0.2, {}),  # softcap's value
    (2, 200, 200, 8, 2, 128, FP16, True, (-1, 0), 0.0, 0.2, {}),  # dtype
    (2, 200, 200, 8, 2, 64, FP16, True, (-1, 0), 0.0, 0.2, {}),  # head dim
    (2, 200, 200, 8, 4, 64, FP16, True, (-1, 0), 0.0, 0.2, {}),  # kv heads
    (2, 200, 200, 8, 4, 64, FP16, True, (-1, 0), 0.0, 0.2, {"q_heads_total": 16}),  # q strides
    (2, 200, 200, 8, 4, 64, FP16, True, (-1, 0), 0.0, 0.2, {"k_heads_total": 8}),  # k strides
    (2, 200, 200, 8, 4, 64, FP16, True, (-1, 0), 0.0, 0.2, {"v_heads_total": 8}),  # v strides
    (2, 200, 200, 8, 4, 64, FP16, True, (-1, 0), 0.0, 0.2, {"out_heads_total": 16}),  # out strides
    (2, 200, 200, 8, 4, 64, FP16, True, (-1, 0), 0.0, 0.2, {"lse_rows_total": 256}),  # lse strides
    (2, 100, 200, 8, 4, 64, FP16, True, (-1, 0), 0.0, 0.2, {}),  # seqlen_q != seqlen_k
    (2, 100, 200, 8, 4, 128, BF16, False, (-1, -1), 0.0, 0.2, {"variant": "ws2x4-overlap-fma"}),  # named
    (2, 100, 200, 8, 4, 128, BF16, False, (-1, -1), 0.0, 0.2, {"variant": "ws2x4-overlap-fma-dyn"}),
]


def _fwd_tensors(b, sq, sk, h, hk, d, dtype, opts):
    q = _bshd(b, sq, h, d, dtype, opts.get("q_heads_total"))
    k = _bshd(b, sk, hk, d, dtype, opts.get("k_heads_total"))
    v = _bshd(b, sk, hk, d, dtype, opts.get("v_heads_total"))
    out = _bshd(b, sq, h, d, dtype, opts.get("out_heads_total"))
    rows = opts.get("lse_rows_total")
    lse = torch.empty(b, h, rows or sq)[:, :, :sq]
    return q, k, v, out, lse


@pytest.fixture
def fwd_recorder(monkeypatch):
    rec = _Recorder(hf._FORWARD)
    monkeypatch.setattr(hf, "_FORWARD", rec)
    monkeypatch.setattr(hf, "_PLANS", launch.PlanCache())
    return rec


def test_forward_launches_match_a_fresh_launch_args(fwd_recorder):
    """Each call's launch is what launch_args builds for that call, whatever the plan cache holds;
    a repeated signature reuses its plan."""
    with launch.launch_plans(True):
        for i, (b, sq, sk, h, hk, d, dtype, causal, window, cap, scale, opts) in enumerate(FWD_CALLS):
            q, k, v, out, lse = _fwd_tensors(b, sq, sk, h, hk, d, dtype, opts)
            built = hf._PLANS.built
            hf.hopper_attention_forward(q, k, v, out, lse, softmax_scale=scale, causal=causal, window=window,
                                        softcap=cap, variant=opts.get("variant"))  # fmt: skip
            recorded = fwd_recorder.calls[-1]
            variant = opts.get("variant") or hf.default_variant(d, causal, False, window, sq, cap)
            grid, args, kwargs = hf.launch_args(q, k, v, out, lse, softmax_scale=scale, causal=causal, variant=variant,
                                                window=window, softcap=cap, counter=recorded[1][9])  # fmt: skip
            _assert_launch(recorded, grid, args, 10, 13, kwargs)
            assert hf._PLANS.built == built + (i != 1), "a repeat reuses its plan; anything else builds one"


def test_forward_packed_launches_match_a_fresh_launch_args(fwd_recorder):
    """Packed calls: the schedule's length (tokens and sequences) is part of the signature."""
    cases = [([0, 100, 300], True), ([0, 100, 300], True), ([0, 50, 120, 300], True), ([0, 50, 120, 300], False),
             ([0, 50, 120, 400], False)]  # fmt: skip
    with launch.launch_plans(True):
        for bounds, causal in cases:
            cu = torch.tensor(bounds, dtype=torch.int32)
            t = bounds[-1]
            q, k, v = torch.randn(t, 8, 128, dtype=BF16), torch.randn(t, 2, 128, dtype=BF16), torch.randn(t, 2, 128,
                                                                                                          dtype=BF16)
            out, lse = torch.empty_like(q), torch.empty(8, t)
            hf.hopper_attention_forward(q, k, v, out, lse, softmax_scale=0.1, causal=causal, cu_seqlens_q=cu,
                                        cu_seqlens_k=cu)  # fmt: skip
            recorded = fwd_recorder.calls[-1]
            grid, args, kwargs = hf.launch_args(
                q, k, v, out, lse, softmax_scale=0.1, causal=causal, variant=hf.default_variant(128, causal, True),
                cu_seqlens_q=cu, cu_seqlens_k=cu, sched=recorded[1][6],
            )  # fmt: skip
            _assert_launch(recorded, grid, args, 10, 13, kwargs)


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def bwd_recorder(monkeypatch):
    recs = {name: _Recorder(getattr(hb, name)) for name in ("_BACKWARD", "_BACKWARD_SPLIT_D")}
    for name, rec in recs.items():
        monkeypatch.setattr(hb, name, rec)
    monkeypatch.setattr(hb, "_PLANS", launch.PlanCache())
    # the launches after the main one (their own launchers, no plans) are not under test here
    monkeypatch.setattr(hb, "tail_sum", lambda *a, **k: None)
    monkeypatch.setattr(hb, "dq_frag_to_bshd", lambda *a, **k: None)
    return recs


def _bwd_call(recs, variant, b, sq, sk, h, hk, d, dtype, causal, window, scale, opts, cu=None):
    if cu is None:
        q = _bshd(b, sq, h, d, dtype, opts.get("q_heads_total"))
        k = _bshd(b, sk, hk, d, dtype, opts.get("k_heads_total"))
        v, dout = _bshd(b, sk, hk, d, dtype), _bshd(b, sq, h, d, dtype, opts.get("dout_heads_total"))
        dk = _bshd(b, sk, hk, d, dtype, opts.get("dk_heads_total"))
        lse = torch.empty(b, h, sq)
    else:
        t = cu[-1].item()
        q, dout = torch.randn(t, h, d, dtype=dtype), torch.randn(t, h, d, dtype=dtype)
        k, v, dk = (torch.randn(t, hk, d, dtype=dtype) for _ in range(3))
        lse = torch.empty(h, t)
    dv, dq = torch.empty_like(v), torch.empty_like(q)
    delta = torch.empty_like(lse)
    var = hb.VARIANTS[variant]
    stats = torch.empty(hb.stats_numel(b, h, sq, var.block_m)) if var.stats_smem else None
    built = hb._PLANS.built
    hb.hopper_attention_backward(q, k, v, dout, lse, delta, dq, dk, dv, softmax_scale=scale, causal=causal,
                                 variant=variant, window=window, stats=stats, cu_seqlens_q=cu, cu_seqlens_k=cu)  # fmt: skip
    rec = recs["_BACKWARD_SPLIT_D" if var.split_d else "_BACKWARD"]
    recorded = rec.calls[-1]
    ptrs, ints = recorded[1], recorded[2]
    dq_accum = ptrs[6].base if var.dq_atomic else None
    tail = None if ptrs[16] is None else (ints[-2], ints[-1], ptrs[16], ptrs[17])
    grid, args, kwargs = hb.launch_args(
        q, k, v, dout, lse, delta, dk, dv, dq_accum, ptrs[10] if var.dq_ordered else None, stats,
        softmax_scale=scale, causal=causal, variant=variant, window=window, cu_seqlens_q=cu, cu_seqlens_k=cu,
        sched=ptrs[11], tail=tail,
    )  # fmt: skip
    _assert_launch(recorded, grid, args, 18, 17, kwargs)
    return hb._PLANS.built - built


def _bwd_variants():
    """One variant of each kind of launch: the dense defaults, a split-D one, a tail-split one, an
    atomic-dQ one without fragment order, one with the statistics buffer."""
    names = set(hb.DEFAULT.values())
    for lo, hi, name in (v for ranges in hb.SEQLEN_VARIANTS.values() for v in ranges):
        names.add(name)
    kinds = {}
    for name, var in hb.VARIANTS.items():
        for kind, has in (("split_d", var.split_d), ("tail", var.tail_split), ("stats", var.stats_smem),
                          ("atomic", var.dq_atomic and not var.dq_frag), ("frag", var.dq_frag),
                          ("unordered", not var.dq_ordered)):  # fmt: skip
            if has:
                kinds.setdefault(kind, name)
    return sorted(names | set(kinds.values()))


@pytest.mark.parametrize("variant", _bwd_variants())
def test_backward_launches_match_a_fresh_launch_args(bwd_recorder, variant):
    var = hb.VARIANTS[variant]
    d = var.head_dims[-1] if 128 not in var.head_dims else 128
    with launch.launch_plans(True):
        for causal in (True, False):
            window = (-1, 0) if causal else (-1, -1)
            base = (1, 300, 300, 8, 2, d, BF16, causal, window, 0.1, {})
            steps = [
                base, base, (1, 200, 200, 8, 2, d, BF16, causal, window, 0.1, {}),
                (1, 200, 200, 8, 2, d, BF16, causal, window, 0.2, {}),
                (2, 200, 200, 8, 2, d, FP16, causal, window, 0.2, {}),
                (2, 200, 200, 8, 4, d, FP16, causal, window, 0.2, {}),
                (2, 200, 200, 8, 4, d, FP16, causal, window, 0.2, {"q_heads_total": 16}),
                (2, 200, 200, 8, 4, d, FP16, causal, window, 0.2, {"k_heads_total": 8}),
                (2, 200, 200, 8, 4, d, FP16, causal, window, 0.2, {"dout_heads_total": 16}),
                (2, 200, 200, 8, 4, d, FP16, causal, window, 0.2, {"dk_heads_total": 8}),
                (2, 200, 200, 8, 4, d, FP16, causal, (64, 0) if causal else (64, 64), 0.2, {}),
                (2, 200, 200, 8, 4, d, FP16, causal, (32, 0) if causal else (64, 32), 0.2, {}),
            ]
            for i, step in enumerate(steps):
                built = _bwd_call(bwd_recorder, variant, *step)
                # step 1 repeats step 0; every other step differs from the one before
                assert built == (0 if i == 1 else 1), "a repeat reuses its plan; anything else builds one"


@pytest.mark.parametrize("causal", [True, False])
def test_backward_packed_launches_match_a_fresh_launch_args(bwd_recorder, causal):
    variant = hb.variant_for(128, causal, varlen=True)
    with launch.launch_plans(True):
        for bounds in ([0, 100, 300], [0, 100, 300], [0, 50, 120, 300], [0, 50, 120, 400]):
            cu = torch.tensor(bounds, dtype=torch.int32)
            window = (-1, 0) if causal else (-1, -1)
            _bwd_call(bwd_recorder, variant, 1, 0, 0, 8, 2, 128, BF16, causal, window, 0.1, {}, cu=cu)


def test_plans_off_builds_every_call(fwd_recorder):
    """With plans switched off every call builds its plan (and launches the same arguments)."""
    q, k, v, out, lse = _fwd_tensors(1, 300, 300, 8, 2, 128, BF16, {})
    with launch.launch_plans(False):
        for _ in range(3):
            hf.hopper_attention_forward(q, k, v, out, lse, softmax_scale=0.1, causal=True)
    assert hf._PLANS.built == 3
    first, *rest = fwd_recorder.calls
    for other in rest:
        assert other[0] == first[0] and other[2:4] == first[2:4] and other[4] is first[4]
        assert all(_same_pointer(a, b) for a, b in zip(first[1][:9], other[1][:9]))


def test_capture_refuses_a_pointer_outside_the_call():
    t, other = torch.empty(4), torch.empty(4)
    with pytest.raises(ValueError, match="not one of the call's tensors"):
        launch.LaunchPlan.capture((1,), (t, other), (), (), None, (t,))
