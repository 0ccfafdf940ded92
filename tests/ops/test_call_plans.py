"""Call plans of the public dense path (``hf_flash.interface._dense_plan``), on the CPU.

A repeated plain dense call on the Gluon Hopper kernels skips the checks and dispatch it passed
before and launches directly. These tests make the CPU look like an H100 to the dispatch, put a
recorder in place of every compiled launch (``CachedLauncher.__call__``), and check that a
sequence of public calls launches exactly what the general path launches for the same calls
(plans switched off): the same kernels, grids, integer and float arguments, constexprs and tensor
geometry. They also check which calls take a plan, that a repeat builds none, and that bad input
still raises before any launch. The GPU side (the same bits) is in tests/ops/test_launch_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from hf_flash import flash_attn_func, interface
from hf_flash.kernels import configs, launch
from hf_flash.kernels.hopper import attention_bwd as hb
from hf_flash.kernels.hopper import attention_dq
from hf_flash.kernels.hopper import attention_fwd as hf
from hf_flash.kernels.launch import CachedLauncher

BF16, FP16 = torch.bfloat16, torch.float16


def _geometry(x):
    if isinstance(x, hf.TensorDescriptor):
        return ("desc", tuple(x.base.shape), x.base.stride(), x.base.dtype, tuple(x.shape), tuple(x.strides),
                tuple(x.block_shape))  # fmt: skip
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.dtype)
    return x


@pytest.fixture
def launches(monkeypatch):
    """The CPU as an sm_90 device for the dispatch; every compiled launch recorded, none run."""
    calls = []

    def record(self, grid, tensors, ints, floats, meta):
        calls.append((self.kernel.fn.__name__, tuple(grid), tuple(_geometry(t) for t in tensors), tuple(ints),
                      tuple(floats), tuple(sorted(meta.kwargs.items()))))  # fmt: skip

    monkeypatch.setattr(CachedLauncher, "__call__", record)
    monkeypatch.setattr(configs, "hopper_enabled", lambda device: True)
    monkeypatch.setattr(configs, "hopper_backward_enabled", lambda device: True)
    monkeypatch.setattr(hf, "_on_hopper", lambda t: True)
    monkeypatch.setattr(interface, "_DENSE_PLANS", launch.PlanCache())
    return calls


CALLS = [
    # (batch, seqlen_q, seqlen_k, heads, kv heads, head dim, dtype, kwargs, q heads of the tensor q is a view of)
    (1, 300, 300, 8, 2, 128, BF16, dict(causal=True), None),
    (1, 300, 300, 8, 2, 128, BF16, dict(causal=True), None),  # a repeat
    (2, 200, 200, 8, 2, 128, BF16, dict(causal=True, softmax_scale=0.2), None),
    (2, 200, 200, 8, 2, 128, BF16, dict(causal=False), None),
    (2, 200, 200, 8, 2, 128, BF16, dict(window_size=(64, 64)), None),
    (2, 200, 200, 8, 2, 128, BF16, dict(causal=True, window_size=(32, 0)), None),
    (2, 200, 200, 8, 2, 128, FP16, dict(causal=True), None),
    (2, 200, 200, 8, 4, 64, FP16, dict(causal=True), None),
    (2, 200, 200, 8, 4, 64, FP16, dict(causal=False), 16),  # q a view with other strides
    (2, 100, 200, 8, 4, 128, BF16, dict(causal=True), None),  # seqlen_q != seqlen_k
    (1, 256, 256, 4, 4, 256, BF16, dict(causal=True), None),  # the split-D backward, the Gluon dQ
    (1, 256, 256, 4, 4, 256, BF16, dict(causal=False, softcap=30.0), None),  # the same, soft-capped
    (1, 256, 256, 4, 2, 128, BF16, dict(causal=True, softcap=30.0), None),  # the Triton dK/dV: no plan
]


def _inputs(b, sq, sk, h, hk, d, dtype, q_heads_total):
    gen = torch.Generator().manual_seed(b * sq + sk + d)
    q = torch.randn(b, sq, q_heads_total or h, d, generator=gen, dtype=dtype)[:, :, :h]
    k, v = (torch.randn(b, sk, hk, d, generator=gen, dtype=dtype) for _ in range(2))
    dout = torch.randn(b, sq, h, d, generator=gen, dtype=dtype)
    return [t.requires_grad_() if t is not dout else t for t in (q, k, v, dout)]


def _fwd_bwd(q, k, v, dout, **kwargs):
    out = flash_attn_func(q, k, v, **kwargs)
    torch.autograd.grad(out, (q, k, v), dout)
    return type(out.grad_fn).__name__


def test_planned_calls_launch_what_the_general_path_launches(launches):
    taken = []
    for b, sq, sk, h, hk, d, dtype, kwargs, q_total in CALLS:
        q, k, v, dout = _inputs(b, sq, sk, h, hk, d, dtype, q_total)
        start = len(launches)
        with launch.launch_plans(False):
            assert _fwd_bwd(q, k, v, dout, **kwargs) == "_AttnEagerBackward"
        general = launches[start:]
        start = len(launches)
        taken.append(_fwd_bwd(q, k, v, dout, **kwargs))
        assert launches[start:] == general, (b, sq, sk, h, hk, d, dtype, kwargs)
        assert general, "nothing was launched"
    assert taken == ["_HopperDenseBackward"] * 12 + ["_AttnEagerBackward"]


def test_a_repeated_signature_builds_no_plan(launches):
    q, k, v, dout = _inputs(1, 300, 300, 8, 2, 128, BF16, None)
    _fwd_bwd(q, k, v, dout, causal=True)
    built = interface._DENSE_PLANS.built
    q2, k2, v2, dout2 = _inputs(1, 300, 300, 8, 2, 128, BF16, None)  # other tensors, one signature
    assert _fwd_bwd(q2, k2, v2, dout2, causal=True) == "_HopperDenseBackward"
    assert interface._DENSE_PLANS.built == built
    _fwd_bwd(q2, k2, v2, dout2, causal=False)
    assert interface._DENSE_PLANS.built == built + 1


@pytest.mark.parametrize("d,kwargs", [(128, dict(causal=True)), (256, dict(causal=True, softcap=30.0))],
                         ids=["d128-fused-dq", "d256-dq-kernel"])  # fmt: skip
def test_repeats_skip_the_checks_and_the_dispatch(launches, monkeypatch, d, kwargs):
    """What a plan keeps is not worked out again: on a repeat, neither the argument checks nor
    the path and variant decisions of either direction run (d256: the dK/dV-only split-D form
    and the Gluon dQ kernel beside it, soft-capped too)."""
    q, k, v, dout = _inputs(2, 200, 200, 8, 2, d, BF16, None)
    _fwd_bwd(q, k, v, dout, **kwargs)
    from hf_flash.kernels import flash_bwd, flash_fwd

    def refuse(*args, **kwargs):
        raise AssertionError("a planned repeat worked out its call again")

    for module, name in ((interface, "_check_dense"), (flash_fwd, "forward_path"), (flash_bwd, "backward_path"),
                         (hf, "default_variant"), (hb, "variant_for"), (hf, "supports"), (hb, "supports"),
                         (flash_bwd, "flash_attn_backward"), (flash_bwd, "gluon_dq_variant"),
                         (attention_dq, "variant_for"), (attention_dq, "covers")):  # fmt: skip
        monkeypatch.setattr(module, name, refuse)
    start = len(launches)
    assert _fwd_bwd(q, k, v, dout, **kwargs) == "_HopperDenseBackward"
    kernels = [call[0] for call in launches[start:]]
    assert ("_attn_dq_kernel" in kernels) == (d == 256), kernels


@pytest.mark.parametrize("d,kwargs,pin", [
    (128, dict(causal=True), lambda: hb.pinned("kv2x64-m64-s2-dqwld", (128,))),
    (256, dict(causal=True), lambda: attention_dq.pinned(256, "triton")),
], ids=["backward-variant", "dq-kernel"])  # fmt: skip
def test_a_pinned_variant_is_not_served_a_plan_built_before_it(launches, d, kwargs, pin):
    """A signature planned under the default tables, then called inside ``pinned`` (the way
    benchmarks time one variant through the public functions): the pinned call launches what the
    general path launches under the pin, not the kept plan's kernels; after the block the
    default's launches again."""
    q, k, v, dout = _inputs(2, 200, 200, 8, 2, d, BF16, None)

    def run(general):
        start = len(launches)
        if general:
            with launch.launch_plans(False):
                _fwd_bwd(q, k, v, dout, **kwargs)
        else:
            assert _fwd_bwd(q, k, v, dout, **kwargs) == "_HopperDenseBackward"
        return launches[start:]

    default = run(general=True)
    assert run(general=False) == default  # planned
    with pin():
        pinned = run(general=True)
        assert pinned != default, "the pin changed nothing: the test cannot tell the plans apart"
        assert run(general=False) == pinned
        assert run(general=False) == pinned
    assert run(general=False) == default


def test_forward_without_grad_and_with_other_dout_layouts(launches):
    q, k, v, dout = _inputs(2, 200, 200, 8, 2, 128, BF16, None)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            start = len(launches)
            with launch.launch_plans(False):
                flash_attn_func(q, k, v, causal=True)
            general = launches[start:]
            start = len(launches)
            out = flash_attn_func(q, k, v, causal=True)
            assert launches[start:] == general
            assert (out.grad_fn is None) != grad
    # a dout laid out unlike out: the general backward decides for it (here: Hopper, other strides)
    wide = torch.randn(2, 200, 16, 128, dtype=BF16)[:, :, :8]
    start = len(launches)
    with launch.launch_plans(False):
        _fwd_bwd(q, k, v, wide, causal=True)
    general = launches[start:]
    start = len(launches)
    assert _fwd_bwd(q, k, v, wide, causal=True) == "_HopperDenseBackward"
    assert launches[start:] == general


def test_calls_outside_the_plans_take_the_general_path(launches):
    q, k, v, dout = _inputs(2, 128, 128, 4, 2, 128, BF16, None)
    general = {
        "return_attn_probs": lambda: flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[0],
        "alibi": lambda: flash_attn_func(q, k, v, causal=True, alibi_slopes=torch.rand(4)),
        "learnable_sink": lambda: flash_attn_func(q, k, v, causal=True, learnable_sink=torch.zeros(4)),
        "window as a tensor": lambda: flash_attn_func(q, k, v, window_size=torch.tensor([8, 8])),
        "causal as an int": lambda: flash_attn_func(q, k, v, causal=1),
        "plans switched off": lambda: _plans_off(lambda: flash_attn_func(q, k, v, causal=True)),
    }
    for name, call in general.items():
        assert type(call().grad_fn).__name__ == "_AttnEagerBackward", name
    # rows holding packed sequences (position_ids restart): the general path's packed kernels
    pos = torch.cat([torch.arange(64), torch.arange(64)])[None]
    out = interface.dense_attention(q, k, v, causal=True, position_ids=pos)
    assert type(out.grad_fn).__name__ == "_AttnEagerBackward"
    # one sequence per row: planned
    out = interface.dense_attention(q, k, v, causal=True, position_ids=torch.arange(128)[None])
    assert type(out.grad_fn).__name__ == "_HopperDenseBackward"


def _plans_off(call):
    with launch.launch_plans(False):
        return call()


def test_bad_input_raises_before_any_launch_on_every_call(launches):
    q, k, v, dout = _inputs(1, 128, 128, 4, 2, 128, BF16, None)
    flash_attn_func(q, k, v, causal=True)  # the signature is planned
    n = len(launches)
    for _ in range(2):  # a failed signature keeps no plan: the second call checks again
        with pytest.raises(TypeError, match="share one dtype"):
            flash_attn_func(q, k.half(), v, causal=True)
        with pytest.raises(ValueError, match="head dims differ"):
            flash_attn_func(q, k[..., :64], v, causal=True)
        with pytest.raises(ValueError, match="softmax_scale"):
            flash_attn_func(q, k, v, causal=True, softmax_scale=float("inf"))
    assert len(launches) == n


def test_traced_calls_take_the_custom_op(launches):
    """Under torch.compile the call plans stay out of the way: the tracer sees the custom op (no
    graph break with fullgraph=True) and no plan is built."""
    q, k, v, dout = _inputs(1, 128, 128, 4, 2, 128, BF16, None)
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True, backend="eager")
    built = interface._DENSE_PLANS.built
    out = compiled(q, k, v)
    torch.autograd.grad(out, (q, k, v), dout)
    assert interface._DENSE_PLANS.built == built
    assert any(name == "_attn_fwd_kernel" for name, *_ in launches)
