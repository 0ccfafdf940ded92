"""GPU grid for the attention kernels (run on the H100 by scripts/gpu_suite.sh).

Real tensor-core paths in fp16 and bf16, the head dims transformers models use, sequence
lengths that are not tile multiples, every feature, torch.compile with inductor, CUDA-graph
capture, and one sequence long enough that 32-bit address arithmetic would overflow.
"""

from __future__ import annotations

import pytest
import torch

from hf_flash import flash_attn_func, flash_attn_varlen_func
from hf_flash.interface import _new_rng_state, attention_paths
from hf_flash.kernels import configs
from hf_flash.kernels.flash_common import dropout_keep_mask
from hf_flash.reference import (
    FWD_FACTOR,
    GRAD_FACTOR,
    assert_close_to_ref,
    assert_grads_close_to_ref,
    attention_ref,
    attention_varlen_ref,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


def _qkv(b, sq, sk, h, hk, d, dtype):
    def mk(*shape):
        return torch.randn(*shape, device=DEV, dtype=dtype, requires_grad=True)

    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d)


def _check(q, k, v, dtype, grads=True, **opts):
    out = flash_attn_func(q, k, v, **opts)
    ref = attention_ref(q, k, v, **opts)
    ref_lp = attention_ref(q, k, v, upcast=False, **opts)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
    if grads:
        assert_grads_close_to_ref(out, ref, ref_lp, (q, k, v), torch.randn_like(out), dtype)


ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("seqlen", [1, 97, 1025])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_forward_where_hopper_runs(dtype, d, seqlen, causal):
    """The grid above runs the Gluon forward for these calls on an H100; the Triton forward
    (every other GPU, and HF_FLASH_HOPPER=0) keeps its own coverage."""
    torch.manual_seed(d + seqlen + 1)
    q, k, v = _qkv(2, seqlen, seqlen, 8, 2, d, dtype)
    with configs.use_hopper(False):
        assert attention_paths(q, k, v, causal=causal)["forward"] == "triton"
        _check(q, k, v, dtype, causal=causal)


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon forward is built for sm_90a")
def test_forward_path_choice_on_hopper():
    """Which forward a call takes: the Gluon kernel for what it covers, Triton for the rest."""
    from hf_flash.interface import attention_variants
    from hf_flash.kernels.hopper import attention_dq

    q, k, v = (t.detach() for t in _qkv(1, 256, 256, 8, 2, 128, torch.bfloat16))
    assert attention_paths(q, k, v, causal=True) == {"forward": "hopper", "backward": "hopper"}
    with configs.use_hopper_backward(False):
        assert attention_paths(q, k, v, causal=True) == {"forward": "hopper", "backward": "triton"}
    assert attention_paths(q[..., :64], k[..., :64], v[..., :64])["forward"] == "hopper"
    # sliding windows: Gluon both ways; softcap: the Gluon forward, the Triton dK/dV kernel with the
    # Gluon dQ beside it (d128; d64 the Triton dQ)
    assert attention_paths(q, k, v, window_size=(63, 0), causal=True) == {"forward": "hopper", "backward": "hopper"}
    assert attention_paths(q, k, v, softcap=30.0) == {"forward": "hopper", "backward": "triton"}
    assert attention_variants(q, k, v, softcap=30.0)["dq"] == attention_dq.DEFAULT[128]
    assert attention_variants(q[..., :64], k[..., :64], v[..., :64], softcap=30.0)["dq"] is None
    others = [dict(dropout_p=0.1), dict(alibi_slopes=torch.rand(8, device=DEV)), dict(varlen=True)]
    for opts in others:
        assert attention_paths(q, k, v, **opts) == {"forward": "triton", "backward": "triton"}, opts
    f32 = [t.float() for t in (q, k, v)]
    assert attention_paths(*f32)["forward"] == "triton"
    q80, k80, v80 = (t.detach() for t in _qkv(1, 64, 64, 8, 2, 80, torch.bfloat16))
    assert attention_paths(q80, k80, v80)["forward"] == "triton"
    # head dim 256: the Gluon forward and backward (the split-D form), soft-capped too
    q256, k256, v256 = (t.detach() for t in _qkv(1, 64, 64, 8, 2, 256, torch.bfloat16))
    assert attention_paths(q256, k256, v256, causal=True) == {"forward": "hopper", "backward": "hopper"}
    assert attention_paths(q256, k256, v256, softcap=30.0) == {"forward": "hopper", "backward": "hopper"}
    with configs.use_hopper(False):
        assert attention_paths(q, k, v, causal=True) == {"forward": "triton", "backward": "triton"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 32, 64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("seqlen", [1, 97, 1025])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grid_headdim_seqlen(dtype, d, seqlen, causal):
    torch.manual_seed(d + seqlen)
    _check(*_qkv(2, seqlen, seqlen, 8, 2, d, dtype), dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "sq,sk,h,hk,opts",
    [
        pytest.param(8192, 8192, 4, 1, {"causal": True}, id="8k-mqa-causal"),
        pytest.param(1000, 3000, 8, 2, {"causal": True}, id="sq<sk"),
        pytest.param(3000, 1000, 8, 8, {"causal": True}, id="sq>sk"),
        pytest.param(2048, 2048, 8, 2, {"causal": True, "window_size": (511, 0)}, id="window"),
        pytest.param(1500, 1500, 8, 2, {"window_size": (300, 77)}, id="window-2sided"),
        pytest.param(1025, 1025, 8, 4, {"causal": True, "softcap": 30.0}, id="softcap"),
        pytest.param(1025, 1025, 8, 8, {"alibi": True, "causal": True}, id="alibi"),
        pytest.param(97, 1025, 8, 1, {"causal": True}, id="chunked-prefill"),
    ],
)
# d 64 and 128 run different tile shapes on Hopper (hf_flash.kernels.configs)
@pytest.mark.parametrize("d", [64, 128])
def test_features(dtype, sq, sk, h, hk, opts, d):
    torch.manual_seed(sq)
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(h, device=DEV) * 0.1
    _check(*_qkv(1, sq, sk, h, hk, d, dtype), dtype, **opts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
# on an H100 the causal call's forward runs the Gluon kernel; hopper=False keeps the Triton one covered
@pytest.mark.parametrize("hopper", [True, False], ids=["default", "triton"])
def test_varlen(dtype, d, hopper):
    with configs.use_hopper(hopper):
        _varlen(dtype, d)


def _varlen(dtype, d):
    torch.manual_seed(0)
    lens = [1, 97, 1025, 300, 2048]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(lens), 8, d, device=DEV, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens), 2, d, device=DEV, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens), 2, d, device=DEV, dtype=dtype, requires_grad=True)
    for opts in ({"causal": True}, {"causal": True, "window_size": (255, 0)}):
        out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), **opts)
        ref = attention_varlen_ref(q, k, v, cu, cu, **opts)
        ref_lp = attention_varlen_ref(q, k, v, cu, cu, upcast=False, **opts)
        assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
        assert_grads_close_to_ref(out, ref, ref_lp, (q, k, v), torch.randn_like(out), dtype)


def test_dropout_bf16():
    torch.manual_seed(1)
    p = 0.1
    q, k, v = _qkv(2, 513, 513, 8, 2, 128, torch.bfloat16)
    torch.manual_seed(7)
    out = flash_attn_func(q, k, v, dropout_p=p, causal=True)
    torch.manual_seed(7)
    keep = dropout_keep_mask(_new_rng_state(DEV), 2, 8, 513, 513, p)
    ref = attention_ref(q, k, v, causal=True, dropout_p=p, dropout_keep=keep)
    ref_lp = attention_ref(q, k, v, causal=True, dropout_p=p, dropout_keep=keep, upcast=False)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, torch.bfloat16)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    g_ref = torch.autograd.grad(ref, (q, k, v), dout.float())
    g_lp = torch.autograd.grad(ref_lp, (q, k, v), dout)
    for name, a, r, lp in zip(("dq", "dk", "dv"), g, g_ref, g_lp):
        assert_close_to_ref(name, a, r, lp, GRAD_FACTOR, torch.bfloat16)


def test_fp32_is_ieee_not_tf32():
    torch.manual_seed(2)
    q, k, v = _qkv(1, 300, 300, 4, 2, 64, torch.float32)
    out = flash_attn_func(q, k, v, causal=True)
    ref = attention_ref(q.double(), k.double(), v.double(), causal=True)
    # TF32 would give ~1e-3; IEEE float32 accumulation stays near 1e-6.
    assert (out.double() - ref).abs().max().item() < 2e-5


HOPPER_OR_NOT = [pytest.param(True, id="hopper-allowed"), pytest.param(False, id="triton")]


@pytest.mark.parametrize("hopper", HOPPER_OR_NOT)
def test_compile_inductor_fullgraph(hopper, monkeypatch):
    monkeypatch.setattr(configs, "_HOPPER", hopper)
    torch.manual_seed(3)
    q, k, v = _qkv(2, 257, 257, 8, 2, 128, torch.bfloat16)

    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    out_e = f(q, k, v)
    g_e = torch.autograd.grad(out_e, (q, k, v), dout)
    assert torch.equal(out, out_e)
    assert all(torch.equal(a, b) for a, b in zip(g, g_e))


@pytest.mark.parametrize("hopper", HOPPER_OR_NOT)
def test_cuda_graph_capture(hopper, monkeypatch):
    monkeypatch.setattr(configs, "_HOPPER", hopper)
    torch.manual_seed(4)
    q, k, v = (t.detach() for t in _qkv(1, 300, 300, 8, 2, 128, torch.bfloat16))
    eager = flash_attn_func(q, k, v, causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flash_attn_func(q, k, v, causal=True)  # warm-up / compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True))
    assert not torch.equal(out, eager)


def _packed_qkv(lens, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = (torch.randn(sum(lens), h, 128, device=DEV, dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV, dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("hopper", HOPPER_OR_NOT)
def test_packed_compile_and_cuda_graph_capture(hopper, monkeypatch):
    """Packed d128 calls (the Gluon forward and its schedule kernel on an H100/H200) under
    torch.compile(fullgraph=True) and CUDA-graph capture: the same bits as eager calls."""
    monkeypatch.setattr(configs, "_HOPPER", hopper)
    lens = [1, 97, 0, 1025, 300]
    q, k, v, cu = _packed_qkv(lens, 5)
    ml = max(lens)

    def f(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, ml, ml, causal=True)

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = torch.compile(f, fullgraph=True)(*leaves)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, leaves, dout)
    eager_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_e = f(*eager_leaves)
    g_e = torch.autograd.grad(out_e, eager_leaves, dout)
    assert torch.equal(out, out_e)
    assert all(torch.equal(a, b) for a, b in zip(g, g_e))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f(q, k, v)  # warm-up / compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = f(q, k, v)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, f(q, k, v))
    assert not torch.equal(captured, out_e)


@pytest.mark.usefixtures("exclusive_gpu_memory")
@pytest.mark.parametrize(
    "window,hopper", [(256, True), (256, False), (None, True)], ids=["window", "window-triton", "dense"]
)
def test_past_2_31_elements_int64_addressing(window, hopper):
    """576K tokens x 32 heads x 128 (2.4 x 10^9 elements per q): q's last rows start past
    element 2^31, so any 32-bit offset arithmetic would wrap (ALST met an illegal memory access
    at 555K tokens). The last rows, and the keys they see, are checked against the oracle,
    forward and backward: with a sliding window (short to run; on Hopper the Gluon kernels run
    it, and the Triton ones with them switched off) and dense causal (the path long training
    takes on the GPU: Gluon on Hopper, ~20 s)."""
    torch.manual_seed(5)
    s, h, hk, d, m = 576 * 1024, 32, 8, 128, 16
    w = window or s
    dtype = torch.bfloat16
    q, k, v = _qkv(1, s, s, h, hk, d, dtype)
    assert q[:, -m:].storage_offset() > 2**31
    opts = {"causal": True, "window_size": (w - 1, 0) if window else (-1, -1)}
    with configs.use_hopper(hopper):
        paths = attention_paths(q, k, v, **opts)
        assert paths["forward"] == ("hopper" if hopper and configs.hopper_enabled(q.device) else "triton"), paths
        out = flash_attn_func(q, k, v, **opts)
        dout = torch.zeros_like(out)
        dout[:, -m:] = torch.randn_like(dout[:, -m:])
        g = torch.autograd.grad(out, (q, k, v), dout)
    # only the last rows are compared: drop the rest before the oracle (its dense scores over
    # 576K keys take 1.1 GiB per float32 tensor even for 16 queries)
    out, dout, g = out[:, -m:].clone(), dout[:, -m:].clone(), (g[0][:, -m:].clone(), g[1], g[2])
    qs = q[:, -m:].detach().requires_grad_()
    ks = k[:, -(m + w) :].detach().requires_grad_()
    vs = v[:, -(m + w) :].detach().requires_grad_()
    ref = attention_ref(qs, ks, vs, **opts)
    ref_lp = attention_ref(qs, ks, vs, upcast=False, **opts)
    assert_close_to_ref("out[-m:]", out, ref, ref_lp, FWD_FACTOR, dtype)
    g_ref = torch.autograd.grad(ref, (qs, ks, vs), dout.float())
    del ref
    g_lp = torch.autograd.grad(ref_lp, (qs, ks, vs), dout)
    assert_close_to_ref("dq", g[0], g_ref[0], g_lp[0], GRAD_FACTOR, dtype)
    assert_close_to_ref("dk", g[1][:, -(m + w) :], g_ref[1], g_lp[1], GRAD_FACTOR, dtype)
    assert_close_to_ref("dv", g[2][:, -(m + w) :], g_ref[2], g_lp[2], GRAD_FACTOR, dtype)
    assert (g[1][:, : -(m + w)] == 0).all(), "keys no query with a gradient sees must get 0"


@pytest.mark.usefixtures("exclusive_gpu_memory")
@pytest.mark.parametrize("d", [64, 128])
def test_packed_past_2_31_elements_int64_addressing(d):
    """Packed documents whose last rows start past element 2^31 of q (1.05M tokens x 32 heads at
    head dim 64, 576K at 128), with a sliding window so the call is short: on Hopper the Gluon
    forward and backward run them (attention_paths says which). The last document's last rows
    and the keys they see are checked against the oracle, forward and backward; every other key
    gets a zero gradient."""
    torch.manual_seed(6)
    h, hk, m, w = 32, 8, 16, 256
    s = (2**31 // (h * d)) + 4096
    lens = [3001, s - 3001]
    dtype = torch.bfloat16
    q, k, v = (t[0] for t in _qkv(1, s, s, h, hk, d, dtype))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    assert q[-m:].storage_offset() > 2**31
    cu = torch.tensor([0, lens[0], s], dtype=torch.int32, device=DEV)
    opts = {"causal": True, "window_size": (w - 1, 0)}
    paths = attention_paths(q, k, v, varlen=True, **opts)
    if configs.hopper_enabled(q.device):
        assert paths == {"forward": "hopper", "backward": "hopper"}, paths
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), **opts)
    dout = torch.zeros_like(out)
    dout[-m:] = torch.randn_like(dout[-m:])
    g = torch.autograd.grad(out, (q, k, v), dout)
    out, dout, g = out[-m:].clone(), dout[-m:].clone(), (g[0][-m:].clone(), g[1], g[2])
    # the last document is longer than m + w: its last rows see only its own keys
    qs = q[None, -m:].detach().requires_grad_()
    ks = k[None, -(m + w) :].detach().requires_grad_()
    vs = v[None, -(m + w) :].detach().requires_grad_()
    ref = attention_ref(qs, ks, vs, **opts)
    ref_lp = attention_ref(qs, ks, vs, upcast=False, **opts)
    assert_close_to_ref("out[-m:]", out[None], ref, ref_lp, FWD_FACTOR, dtype)
    g_ref = torch.autograd.grad(ref, (qs, ks, vs), dout[None].float())
    del ref
    g_lp = torch.autograd.grad(ref_lp, (qs, ks, vs), dout[None])
    assert_close_to_ref("dq", g[0][None], g_ref[0], g_lp[0], GRAD_FACTOR, dtype)
    assert_close_to_ref("dk", g[1][None, -(m + w) :], g_ref[1], g_lp[1], GRAD_FACTOR, dtype)
    assert_close_to_ref("dv", g[2][None, -(m + w) :], g_ref[2], g_lp[2], GRAD_FACTOR, dtype)
    for name, grad in (("dk", g[1]), ("dv", g[2])):
        assert (grad[: -(m + w)] == 0).all(), f"{name}: keys no query with a gradient sees must get 0"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensors_on_a_device_that_is_not_current():
    """A model split over GPUs (device_map) runs layers on a device that is not the current one:
    every launcher makes the tensors' device current, forward and backward."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    q, k, v = (torch.randn(1, 256, h, 64, device="cuda:0", dtype=dtype) for h in (8, 2, 2))
    assert torch.cuda.current_device() == 0
    moved = [t.to("cuda:1").requires_grad_() for t in (q, k, v)]
    here = [t.clone().requires_grad_() for t in (q, k, v)]
    out1 = flash_attn_func(*moved, causal=True)
    out0 = flash_attn_func(*here, causal=True)
    assert out1.device == torch.device("cuda:1")
    torch.testing.assert_close(out1.cpu(), out0.cpu(), atol=0, rtol=0)
    g = torch.randn_like(out0)
    g1 = torch.autograd.grad(out1, moved, g.to("cuda:1"))
    g0 = torch.autograd.grad(out0, here, g)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=0, rtol=0)
