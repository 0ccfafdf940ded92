"""The cached-launch fast path (hf_flash.kernels.launch) on the GPU.

Repeated decode / combine / rotary launches must take the fast path, give the same bits as
Triton's own launch path, and use the compiled kernel Triton itself would pick for the call
(checked on every fast launch against Triton's binder and kernel cache), including when the
specialisation changes (unaligned views, sizes equal to 1 or multiples of 16). Also under
CUDA-graph capture and torch.compile. Numerics against the oracle: tests/ops/test_kvcache.py and
tests/ops/test_rotary.py, whose repeated calls take the fast path on the GPU.
"""

from __future__ import annotations

import pytest
import torch
import triton

from hf_flash import apply_rotary_emb, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from hf_flash.interface import attention_paths
from hf_flash.kernels import decode, launch, rotary

pytestmark = pytest.mark.gpu
DEV = "cuda"

if not launch._supported():
    pytest.skip(f"fast launch path not enabled for triton {triton.__version__}",
                allow_module_level=True)  # fmt: skip


def _triton_choice(kernel, tensors, ints, floats, meta):
    """The CompiledKernel JITFunction.run (Triton 3.6) would launch for these arguments, from
    Triton's own binder and kernel cache (None if it has not compiled one)."""
    from triton.runtime.jit import compute_cache_key

    device = triton.runtime.driver.active.get_current_device()
    kernel_cache, key_cache, _target, _backend, binder = kernel.device_caches[device]
    kwargs = dict(meta.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or triton.knobs.runtime.debug
    kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    _bound, specialization, options = binder(*tensors, *ints, *floats, **kwargs)
    return kernel_cache.get(compute_cache_key(key_cache, specialization, options))


class _Audit:
    """Wraps a CachedLauncher: after every call that took the fast path, checks that the
    compiled kernel it launched is the one Triton would have picked."""

    def __init__(self, launcher):
        self.launcher = launcher
        self.meta = launcher.meta
        self.meta_for = launcher.meta_for
        self.checked = 0
        self.bound = 0  # fast launches of bound plans (CachedLauncher.run_plan)
        used = self.used = []

        class Recording(dict):
            def get(self, key, default=None):
                value = dict.get(self, key, default)
                used.append(value)
                return value

        launcher._exact = Recording(launcher._exact)
        launcher._spec = Recording(launcher._spec)

    def __call__(self, grid, tensors, ints, floats, meta):
        fast = self.launcher.fast
        self.used.clear()
        self.launcher(grid, tensors, ints, floats, meta)
        if self.launcher.fast > fast:
            entry = next(e for e in reversed(self.used) if e is not None)
            compiled = _triton_choice(self.launcher.kernel, tensors, ints, floats, meta)
            assert compiled is not None and entry[1] == compiled.function
            self.checked += 1

    def run_plan(self, plan, tensors):
        """As the launcher's run_plan; a fast launch (bound to its kernel, or through the keys)
        audited like a call."""
        fast = self.launcher.fast
        bound = plan.bound
        self.used.clear()
        self.launcher.run_plan(plan, tensors)
        if self.launcher.fast > fast:
            if self.used:  # through the keys
                function = next(e for e in reversed(self.used) if e is not None)[1]
            else:  # the bound path
                assert bound, "a fast launch without a key lookup must be a bound plan's"
                function = bound.function
                self.bound += 1
            compiled = _triton_choice(self.launcher.kernel, plan.pointers(tensors), plan.ints, plan.floats, plan.meta)
            assert compiled is not None and function == compiled.function
            self.checked += 1


def _audit_launchers(monkeypatch, launchers) -> dict:
    """name -> _Audit for each (module, name) CachedLauncher, swapped in for the test, with
    fresh key tables (so the first call of each kind goes through Triton's own path)."""
    audits = {}
    for module, name in launchers:
        launcher = getattr(module, name)
        monkeypatch.setattr(launcher, "_exact", dict(launcher._exact))
        monkeypatch.setattr(launcher, "_spec", dict(launcher._spec))
        audits[name] = _Audit(launcher)
        monkeypatch.setattr(module, name, audits[name])
    return audits


@pytest.fixture
def audit(monkeypatch):
    return _audit_launchers(monkeypatch, ((decode, "_DECODE"), (decode, "_COMBINE"), (rotary, "_ROTARY")))


def _inputs(batch=2, seqlen_cache=512, nheads=8, nheads_k=2, d=128, dtype=torch.bfloat16,
            unaligned=False, seed=0):  # fmt: skip
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device=DEV, dtype=dtype, generator=g)

    if unaligned:  # views 2 bytes past a 16-byte boundary, odd head strides
        q = rnd(batch, 1, nheads, d + 1)[..., 1:]
        kn = rnd(batch, 1, nheads_k, d + 1)[..., 1:]
        assert q.data_ptr() % 16 and kn.data_ptr() % 16
    else:
        q, kn = rnd(batch, 1, nheads, d), rnd(batch, 1, nheads_k, d)
    kc, vc = rnd(batch, seqlen_cache, nheads_k, d), rnd(batch, seqlen_cache, nheads_k, d)
    vn = rnd(batch, 1, nheads_k, d)
    lens = torch.randint(1, seqlen_cache - 1, (batch,), generator=g, device=DEV).to(torch.int32)
    cos = torch.rand(seqlen_cache, d // 2, device=DEV, generator=g)
    sin = torch.rand(seqlen_cache, d // 2, device=DEV, generator=g)
    return dict(q=q, k_cache=kc, v_cache=vc, k=kn, v=vn, cache_seqlens=lens, rotary_cos=cos,
                rotary_sin=sin)  # fmt: skip


def _decode(inp, **opts):
    """One call on copies of the caches: (out, lse, k_cache, v_cache after the append)."""
    kc, vc = inp["k_cache"].clone(), inp["v_cache"].clone()
    args = {**inp, "k_cache": kc, "v_cache": vc}
    out, lse = flash_attn_with_kvcache(**args, causal=True, return_softmax_lse=True, **opts)
    return out, lse, kc, vc


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


CASES = [
    pytest.param({}, dict(num_splits=1), id="one-split"),
    pytest.param({}, dict(num_splits=4), id="four-splits"),
    pytest.param({}, dict(num_splits=0), id="auto-splits"),
    pytest.param({"batch": 1}, dict(num_splits=0), id="batch1"),
    pytest.param({"batch": 16, "nheads": 32, "nheads_k": 16}, dict(num_splits=0), id="batch16"),
    pytest.param({"unaligned": True}, dict(num_splits=3), id="unaligned"),
    pytest.param({"dtype": torch.float16, "d": 64}, dict(num_splits=2), id="fp16-d64"),
    pytest.param({}, dict(num_splits=2, window_size=(100, 0), softcap=5.0), id="window-softcap"),
]


@pytest.mark.parametrize("shape, opts", CASES)
def test_repeats_take_fast_path_and_match_triton_launch(audit, shape, opts):
    inp = _inputs(**shape)
    with launch.fast_launch(False):
        want = _decode(inp, **opts)
    fast = audit["_DECODE"].launcher.fast
    for _ in range(3):
        got = _decode(inp, **opts)
        assert _equal(got, want)
    # the first call may have been a new specialisation; the later ones are cached
    assert audit["_DECODE"].launcher.fast - fast >= 2
    assert audit["_DECODE"].checked >= 2
    if opts.get("num_splits", 0) > 1:
        assert audit["_COMBINE"].checked >= 2


def test_specialisation_changes_pick_the_right_kernel(audit):
    """Aligned and unaligned views, batch 1 and 16 interleaved: every fast launch uses the
    kernel Triton picks for that call (audited), and outputs equal Triton's own launch."""
    variants = [_inputs(), _inputs(unaligned=True), _inputs(batch=1), _inputs(batch=16)]
    with launch.fast_launch(False):
        want = [_decode(v, num_splits=2) for v in variants]
    for _ in range(2):
        for v, w in zip(variants, want):
            assert _equal(_decode(v, num_splits=2), w)
    assert audit["_DECODE"].checked >= len(variants)
    entries = {e[1] for e in audit["_DECODE"].launcher._spec.values()}
    assert len(entries) >= 2  # several compiled specialisations in use


def test_rotary_repeats_take_fast_path(audit):
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(1, 1, 32, 64, device=DEV, dtype=torch.bfloat16, generator=g)
    cos = torch.rand(4096, 32, device=DEV, generator=g)
    sin = torch.rand(4096, 32, device=DEV, generator=g)
    with launch.fast_launch(False):
        want = [apply_rotary_emb(x, cos, sin, seqlen_offsets=off) for off in (5, 6, 16, 1)]
    for _ in range(2):
        got = [apply_rotary_emb(x, cos, sin, seqlen_offsets=off) for off in (5, 6, 16, 1)]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert audit["_ROTARY"].checked >= 4


def test_cuda_graph_capture_replays_fast_launches(audit):
    inp = _inputs()
    static = {**inp, "k_cache": inp["k_cache"].clone(), "v_cache": inp["v_cache"].clone()}

    def step():
        return flash_attn_with_kvcache(**static, causal=True, num_splits=3)

    with launch.fast_launch(False):
        want = _decode(inp, num_splits=3)[0]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up: compiled and cached before capture
            step()
    torch.cuda.current_stream().wait_stream(s)
    fast = audit["_DECODE"].launcher.fast
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    assert audit["_DECODE"].launcher.fast == fast + 1  # captured through the fast path
    static["k_cache"].copy_(inp["k_cache"])
    static["v_cache"].copy_(inp["v_cache"])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    new = static["cache_seqlens"][0].item()
    assert torch.equal(static["k_cache"][0, new], _decode(inp, num_splits=3)[2][0, new])


def test_compiled_caller_matches_eager(audit):
    inp = _inputs()

    def f(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=rotary_cos,
                                       rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
                                       causal=True, num_splits=2)  # fmt: skip

    compiled = torch.compile(f, fullgraph=True)
    with launch.fast_launch(False):
        want = _decode(inp, num_splits=2)
    for _ in range(3):
        kc, vc = inp["k_cache"].clone(), inp["v_cache"].clone()
        out = compiled(inp["q"], kc, vc, inp["k"], inp["v"], inp["cache_seqlens"],
                       inp["rotary_cos"], inp["rotary_sin"])  # fmt: skip
        assert torch.equal(out, want[0]) and torch.equal(kc, want[2]) and torch.equal(vc, want[3])
    assert audit["_DECODE"].checked >= 2



def _attention_call(tokens: int, d: int, packed: bool, **opts):
    """(q, k, v, call) for the attention fast-path tests: 8 query heads over 2 K/V heads, bf16;
    packed, four documents (1, 299, 1 and tokens - 301 tokens), else two sequences of tokens / 2.
    ``call()`` runs the public function with ``opts`` and its backward on fresh leaves: (out, dq,
    dk, dv)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    shape = (tokens,) if packed else (2, tokens // 2)
    q = torch.randn(*shape, 8, d, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(*shape, 2, d, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    cu = torch.tensor([0, 1, 300, 301, tokens], device=DEV, dtype=torch.int32)

    longest = max(299, tokens - 301)

    def call():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        if packed:
            out = flash_attn_varlen_func(*leaves, cu, cu, longest, longest, **opts)
        else:
            out = flash_attn_func(*leaves, **opts)
        return (out, *torch.autograd.grad(out, leaves, dout))

    return q, k, v, call


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_gluon_kernels_repeat_through_the_fast_path(monkeypatch, packed):
    """The Gluon Hopper forward and backward (TMA descriptor arguments), the packed calls'
    schedule kernel and the backward's dQ cast, through the public functions: repeats launch
    through the cached path, the kernel Triton would pick (audited), and give the bits of
    Triton's own launch path."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are built for sm_90a")
    from hf_flash.kernels.hopper import attention_bwd as hb
    from hf_flash.kernels.hopper import attention_fwd as hf

    audits = _audit_launchers(
        monkeypatch, ((hf, "_FORWARD"), (hf, "_SCHEDULE"), (hb, "_BACKWARD"), (hb, "_DQ_FRAG_TO_BSHD"))
    )
    q, k, v, call = _attention_call(1000, 128, packed, causal=not packed)
    assert attention_paths(q, k, v, causal=not packed, varlen=packed) == {"forward": "hopper", "backward": "hopper"}
    with launch.fast_launch(False):
        want = call()
    for _ in range(3):
        assert _equal(call(), want)
    assert audits["_FORWARD"].checked >= 2 and audits["_BACKWARD"].checked >= 2
    # the Gluon forward and backward launch from plans, bound after their first fast launch
    assert audits["_FORWARD"].bound >= 1 and audits["_BACKWARD"].bound >= 1
    if packed:
        assert audits["_SCHEDULE"].checked >= 2
    else:  # the dense default's fragment-order dQ
        assert audits["_DQ_FRAG_TO_BSHD"].checked >= 2


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gluon_launch_plans_give_the_bits_of_a_fresh_build(monkeypatch, packed, causal):
    """The Gluon forward and backward with their launch plans kept (hf_flash.kernels.launch.
    PlanCache) give the bits of calls that build every plan anew, and repeats build none."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are built for sm_90a")
    from hf_flash.kernels.hopper import attention_bwd as hb
    from hf_flash.kernels.hopper import attention_fwd as hf

    monkeypatch.setattr(hf, "_PLANS", launch.PlanCache())
    monkeypatch.setattr(hb, "_PLANS", launch.PlanCache())
    q, k, v, call = _attention_call(1000, 128, packed, causal=causal)
    assert attention_paths(q, k, v, causal=causal, varlen=packed) == {"forward": "hopper", "backward": "hopper"}
    with launch.launch_plans(False):
        want = call()
    with launch.launch_plans(True):
        built = (hf._PLANS.built, hb._PLANS.built)
        assert _equal(call(), want)
        assert (hf._PLANS.built, hb._PLANS.built) == (built[0] + 1, built[1] + 1)
        for _ in range(2):
            assert _equal(call(), want)
        assert (hf._PLANS.built, hb._PLANS.built) == (built[0] + 1, built[1] + 1)


PLANNED = [
    # (batch, seqlen_q, seqlen_k, heads, kv heads, head dim, flash_attn_func kwargs, planned: the
    # Hopper forward and backward run the call; d256's plan runs the split-D form and the Gluon dQ)
    pytest.param(2, 500, 500, 8, 2, 128, dict(causal=True), True, id="d128-causal"),
    pytest.param(2, 500, 500, 8, 2, 128, dict(causal=False), True, id="d128-full"),
    pytest.param(1, 300, 700, 8, 8, 128, dict(causal=True), True, id="d128-bottom-right"),
    pytest.param(2, 500, 500, 8, 2, 128, dict(window_size=(100, 30)), True, id="d128-window"),
    pytest.param(2, 500, 500, 8, 2, 128, dict(causal=True, softcap=30.0), False, id="d128-softcap"),
    pytest.param(2, 500, 500, 8, 1, 64, dict(causal=True), True, id="d64-mqa"),
    pytest.param(1, 500, 500, 4, 2, 256, dict(causal=False), True, id="d256"),
    pytest.param(1, 500, 500, 4, 2, 256, dict(causal=True, softcap=30.0), True, id="d256-softcap"),
]


@pytest.mark.parametrize("b,sq,sk,h,hk,d,kwargs,planned", PLANNED)
@pytest.mark.parametrize("dout_layout", ["contiguous", "strided"])
def test_call_plans_give_the_bits_of_the_general_path(monkeypatch, b, sq, sk, h, hk, d, kwargs, planned, dout_layout):
    """Repeated plain dense calls run their kept plan (hf_flash.interface._dense_plan: checks and
    dispatch skipped, launchers called directly) and give the bits of the general path (plans
    switched off), forward and backward; a dout laid out unlike the output takes the general
    backward, and soft-capped d128 calls (the Triton dK/dV kernel) take no plan."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are built for sm_90a")
    from hf_flash import interface

    monkeypatch.setattr(interface, "_DENSE_PLANS", launch.PlanCache())
    g = torch.Generator(device=DEV).manual_seed(sq + d)
    q = torch.randn(b, sq, h, d, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, sk, hk, d, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    dout = torch.randn(b, sq, 2 * h, d, device=DEV, dtype=torch.bfloat16, generator=g)
    dout = dout[:, :, :h] if dout_layout == "strided" else dout[:, :, :h].contiguous()

    def call():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = flash_attn_func(*leaves, **kwargs)
        return type(out.grad_fn).__name__, (out, *torch.autograd.grad(out, leaves, dout))

    with launch.launch_plans(False):
        kind, want = call()
        assert kind == "_AttnEagerBackward"
    for _ in range(2):
        kind, got = call()
        assert kind == ("_HopperDenseBackward" if planned else "_AttnEagerBackward")
        assert _equal(got, want)
    with torch.no_grad():
        assert torch.equal(flash_attn_func(q, k, v, **kwargs), want[0])


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_triton_attention_kernels_repeat_through_the_fast_path(monkeypatch, packed):
    """The portable Triton attention kernels (forward, the backward's preprocess, dK/dV and dQ;
    every call off Hopper, and on Hopper with the Gluon kernels switched off), through the public
    functions with a window and the softcap: repeats launch through the cached path, the kernel
    Triton would pick (audited), and give the bits of Triton's own launch path."""
    from hf_flash.kernels import configs, flash_bwd, flash_fwd

    audits = _audit_launchers(
        monkeypatch, ((flash_fwd, "_FORWARD"), (flash_bwd, "_PREPROCESS"), (flash_bwd, "_DKDV"), (flash_bwd, "_DQ"))
    )
    q, k, v, call = _attention_call(700, 64, packed, causal=True, window_size=(100, 0), softcap=20.0)
    with configs.use_hopper(False):
        paths = attention_paths(q, k, v, causal=True, window_size=(100, 0), softcap=20.0, varlen=packed)
        assert paths == {"forward": "triton", "backward": "triton"}
        with launch.fast_launch(False):
            want = call()
        for _ in range(3):
            assert _equal(call(), want)
    for name, audit in audits.items():
        assert audit.checked >= 2, name
