"""The Gluon Hopper backward (dK/dV kernel; Triton preprocess and dQ) against the float32
oracle, on an sm_90 GPU.

Error rule (``hf_flash.reference.assert_close_to_ref``): each gradient's max error against the
float32 reference is at most 3x the max error of the same reference computed in the input dtype,
plus the rounding of one element. Gradient buffers are NaN-poisoned before the launch, so an
unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch

from hf_flash.reference import GRAD_FACTOR, assert_close_to_ref, attention_ref

pytestmark = pytest.mark.gpu


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (H100/H200)")


def _qkv(batch, sq, sk, h, hk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    return mk(batch, sq, h, d), mk(batch, sk, hk, d), mk(batch, sk, hk, d)


def _window_opts(causal, window):
    """The kernels' (window_left, window_right) for a flash-attn window (causal: right 0)."""
    from hf_flash._checks import kernel_window

    left, right = kernel_window(causal, window)
    return dict(causal=causal, window_left=left, window_right=right)


def _backward(q, k, v, dout, causal, scale=None, variant=None, monkeypatch=None, window=(-1, -1), softcap=0.0,
              path="hopper"):  # fmt: skip
    """Forward (the Gluon forward) and the backward through flash_attn_backward with the Gluon
    dK/dV kernel (``variant``: an entry of VARIANTS, else the default; ``path`` "triton": a call
    the Triton dK/dV kernel takes), into NaN-poisoned buffers. Returns (dq, dk, dv)."""
    from hf_flash.kernels import flash_bwd, flash_fwd
    from hf_flash.kernels.hopper import attention_bwd as hb

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    opts = dict(softmax_scale=scale, softcap=softcap, alibi_slopes=None, dropout_p=0.0,
                **_window_opts(causal, window))  # fmt: skip
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    lens = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1])
    flash_fwd.flash_attn_forward(q, k, v, out, lse, rng_state=None, **lens, **opts)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    if variant is not None:
        for masked in (False, True):
            monkeypatch.setitem(hb.DEFAULT, (q.shape[-1], masked), variant)
            # the named variant at every length (no seqlen range takes the call elsewhere)
            if (q.shape[-1], masked) in hb.SEQLEN_VARIANTS:
                monkeypatch.delitem(hb.SEQLEN_VARIANTS, (q.shape[-1], masked))
    assert flash_bwd.backward_path(q, k, v, out, dout, dk, dv, varlen=False, **opts) == path, (
        f"the case under test must be one the {path} dK/dV kernel takes"
    )
    flash_bwd.flash_attn_backward(dout, None, q, k, v, out, lse, dq, dk, dv, rng_state=None, **lens, **opts)
    return dq, dk, dv


def _check(q, k, v, causal, scale=None, variant=None, monkeypatch=None, seed=0, window=(-1, -1), softcap=0.0,
           path="hopper"):  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(seed + 100)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g)
    grads = _backward(q, k, v, dout, causal, scale, variant, monkeypatch, window, softcap, path)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    opts = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap)
    ref = attention_ref(*leaves, upcast=True, **opts)
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    ref_lp = attention_ref(*leaves, upcast=False, **opts)
    lp_grads = torch.autograd.grad(ref_lp, leaves, dout)
    for name, a, r, lp in zip(("dq", "dk", "dv"), grads, ref_grads, lp_grads):
        assert_close_to_ref(name, a, r, lp, GRAD_FACTOR, q.dtype)
    return grads


CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k
    pytest.param(2, 128, 128, 4, 4, id="mha-one-tile"),
    pytest.param(2, 1025, 1025, 8, 2, id="gqa-1025"),
    pytest.param(1, 97, 97, 4, 1, id="mqa-97"),
    pytest.param(1, 1, 1, 2, 1, id="s1"),
    pytest.param(1, 1, 300, 4, 2, id="decode-row"),
    pytest.param(1, 200, 777, 4, 2, id="sq<sk"),
    pytest.param(1, 777, 200, 4, 2, id="sq>sk-empty-rows"),
    pytest.param(1, 512, 512, 32, 8, id="hq32-hkv8"),
    # calls of attention_bwd.SEQLEN_VARIANTS: d128 from 512 (hq32-hkv8, gqa-1025 too), d64 non-causal 512-2K
    pytest.param(1, 2048, 2048, 8, 2, id="gqa-2048"),
]


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch,sq,sk,h,hk", CASES)
def test_default_variant_matches_reference(batch, sq, sk, h, hk, head_dim, causal, dtype, monkeypatch):
    _check(*_qkv(batch, sq, sk, h, hk, head_dim, dtype), causal, monkeypatch=monkeypatch)


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_8191(head_dim, causal, monkeypatch):
    _check(*_qkv(1, 8191, 8191, 2, 1, head_dim, torch.bfloat16, seed=4), causal, monkeypatch=monkeypatch)


def _variant_head_dims():
    from hf_flash.kernels.hopper.attention_bwd import VARIANTS

    return [(name, d) for name, var in VARIANTS.items() for d in var.head_dims]


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _variant_head_dims())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_variant_matches_reference(variant, head_dim, causal, monkeypatch):
    _check(*_qkv(2, 1025, 1100, 8, 2, head_dim, torch.bfloat16, seed=1), causal, variant=variant,
           monkeypatch=monkeypatch)  # fmt: skip
    _check(*_qkv(1, 300, 97, 4, 4, head_dim, torch.float16, seed=2), causal, variant=variant,
           monkeypatch=monkeypatch)  # fmt: skip


@needs_hopper
def test_non_contiguous_views_and_scale():
    dtype = torch.bfloat16
    qs = torch.randn(2, 8, 515, 128, device="cuda", dtype=dtype)
    ks = torch.randn(2, 2, 600, 128, device="cuda", dtype=dtype)
    vs = torch.randn(2, 2, 600, 128, device="cuda", dtype=dtype)
    q, k, v = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
    assert not q.is_contiguous()
    for causal in (False, True):
        _check(q, k, v, causal, scale=0.05)


@needs_hopper
def test_dq_variants_match_on_many_steps(monkeypatch):
    """The dQ-accumulating variants over many steps per program (GQA group of 4 heads, odd
    lengths), so the dS hand-over between the consumers (dq_shared) cycles through its phases."""
    from hf_flash.kernels.hopper.attention_bwd import VARIANTS

    for name, var in VARIANTS.items():
        if var.dq_atomic and 128 in var.head_dims:
            for causal in (False, True):
                _check(*_qkv(2, 1500, 1100, 16, 4, 128, torch.bfloat16, seed=8), causal, variant=name,
                       monkeypatch=monkeypatch)  # fmt: skip


@needs_hopper
def test_results_repeat_bitwise():
    q, k, v = _qkv(2, 2048, 2048, 8, 2, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    a = _backward(q, k, v, dout, True)
    b = _backward(q, k, v, dout, True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _ordered_variants():
    """(variant, head dim) of every dq_ordered variant."""
    from hf_flash.kernels.hopper.attention_bwd import VARIANTS

    return [(name, d) for name, var in VARIANTS.items() if var.dq_ordered for d in var.head_dims]


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _ordered_variants())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ordered_dq_repeats_bitwise(variant, head_dim, causal, monkeypatch):
    """The dq_ordered variants add into each query tile of dQ in a fixed order of the key
    blocks: the gradients repeat bitwise, on a grid of several waves of programs (so programs
    wait on others that started earlier, never on one not yet started) and odd lengths."""
    _repeats_bitwise_and_matches(_qkv(2, 4000, 4100, 16, 4, head_dim, torch.bfloat16, seed=11), causal, variant,
                                 monkeypatch, seed=11)  # fmt: skip


def _repeats_bitwise_and_matches(qkv, causal, variant, monkeypatch, seed):
    """Three backward calls of ``variant`` give bitwise-equal gradients, which match the reference."""
    q, k, v = qkv
    dout = torch.randn_like(q)
    a = _backward(q, k, v, dout, causal, variant=variant, monkeypatch=monkeypatch)
    for _ in range(2):
        b = _backward(q, k, v, dout, causal, variant=variant, monkeypatch=monkeypatch)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    _check(q, k, v, causal, variant=variant, monkeypatch=monkeypatch, seed=seed)


def _tail_variants():
    from hf_flash.kernels.hopper.attention_bwd import VARIANTS

    return [name for name, var in VARIANTS.items() if var.tail_split]


@needs_hopper
@pytest.mark.parametrize("variant", _tail_variants())
def test_tail_pieces_match_and_repeat_bitwise(variant, monkeypatch):
    """A launch of whole-unit waves whose partial last wave runs in pieces (tail_split): the
    pieces wait on the ordered dQ turns of programs launched before them and their dK/dV
    partials are added in piece order, so the gradients match the reference and repeat
    bitwise (odd lengths: a key tail and a query tail in the pieced units)."""
    from hf_flash.kernels.hopper import attention_bwd as hb

    batch, sq, sk, h, hk = 2, 3000, 3100, 16, 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n_whole, pieces = hb.tail_plan(batch * hk * -(-sk // 128), h // hk * -(-sq // 64), sms)
    assert n_whole >= sms and pieces >= 2, (n_whole, pieces)
    _repeats_bitwise_and_matches(_qkv(batch, sq, sk, h, hk, 128, torch.bfloat16, seed=21), False, variant,
                                 monkeypatch, seed=21)  # fmt: skip


def _ordered_defaults():
    """(variant, head dim) of the ordered-dQ variants dense calls run by default."""
    from hf_flash.kernels.hopper.attention_bwd import DEFAULT, SEQLEN_VARIANTS, VARIANTS

    names = {(n, d) for (d, _), n in DEFAULT.items()}
    names |= {(n, d) for (d, _), ranges in SEQLEN_VARIANTS.items() for _, _, n in ranges}
    return sorted((n, d) for n, d in names if VARIANTS[n].dq_ordered)


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _ordered_defaults())
@pytest.mark.parametrize(
    "batch,sq,sk,causal,window",
    [pytest.param(2, 1025, 1100, False, (-1, -1), id="full"),
     pytest.param(1, 777, 200, True, (-1, -1), id="causal-sq>sk-empty-rows"),
     pytest.param(2, 4000, 4100, True, (-1, -1), id="causal-waves"),
     pytest.param(1, 900, 700, True, (130, -1), id="causal-left130-sq>sk"),
     pytest.param(1, 700, 650, False, (64, 200), id="two-sided")],
)  # fmt: skip
def test_ordered_dq_needs_no_zeroed_accumulator(variant, head_dim, batch, sq, sk, causal, window, monkeypatch):
    """Ordered dQ, dense calls: the first key block of each query tile stores its dQ tile, so the
    accumulator may hold anything beforehand. Here it holds NaN: every tile a key block reaches
    must be stored before it is added to, and the rows no key block reaches (causal, more queries
    than keys) must come out 0."""
    from hf_flash.kernels.hopper import attention_bwd as hb

    fresh = hb.dq_accum_for
    poisoned = []

    def nan_accumulator(q, name, device=None):
        acc = fresh(q, name, device)
        poisoned.append(name)
        return acc.fill_(float("nan"))

    monkeypatch.setattr(hb, "dq_accum_for", nan_accumulator)
    dq, _, _ = _check(*_qkv(batch, sq, sk, 8, 2, head_dim, torch.bfloat16, seed=31), causal, variant=variant,
                      monkeypatch=monkeypatch, window=window)  # fmt: skip
    assert poisoned == [variant]
    unseen = hb.rows_without_keys(sq, sk, causal, window)
    assert unseen == (sq - sk if causal and sq > sk else 0)
    assert bool((dq[:, :unseen] == 0).all())


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_public_function_takes_the_hopper_backward(head_dim):
    """flash_attn_func's autograd runs the Gluon dK/dV kernel (attention_paths says so) and its
    gradients, dlse included (return_attn_probs gives the log-sum-exp), match the oracle (d64:
    the default reads lse and delta, dlse folded in, from the packed statistics buffer)."""
    from hf_flash import flash_attn_func
    from hf_flash.interface import attention_paths

    q, k, v = (t.requires_grad_() for t in _qkv(2, 700, 700, 8, 2, head_dim, torch.bfloat16, seed=5))
    assert attention_paths(q, k, v, causal=True)["backward"] == "hopper"
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    w = torch.randn_like(lse)
    dout = torch.randn_like(out)
    g = torch.autograd.grad((out * dout).sum() + (lse * w).sum(), (q, k, v))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    grads = {}
    for upcast in (True, False):
        ref, ref_lse = attention_ref(*leaves, causal=True, upcast=upcast, return_lse=True)
        loss = (ref * dout.to(ref.dtype)).sum() + (ref_lse * w).sum()
        grads[upcast] = torch.autograd.grad(loss, leaves)
    for name, a, r, lp in zip(("dq", "dk", "dv"), g, grads[True], grads[False]):
        assert_close_to_ref(name, a, r, lp, GRAD_FACTOR, torch.bfloat16)


def _captured(step):
    """``step()`` run once on a side stream (a warm-up outside capture), then captured in a CUDA
    graph: (the graph, the outputs its replays write)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


@needs_hopper
def test_cuda_graph_capture_forward_backward():
    from hf_flash import flash_attn_func

    q, k, v = (t.requires_grad_() for t in _qkv(1, 300, 300, 8, 2, 128, torch.bfloat16, seed=6))
    dout = torch.randn_like(q)

    def step():
        out = flash_attn_func(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    eager = step()
    graph, captured = _captured(step)
    with torch.no_grad():
        dout.copy_(torch.randn_like(dout))
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    assert all(torch.equal(a, b) for a, b in zip(captured, fresh))
    assert not torch.equal(captured[1], eager[1])
    # a second replay finds the captured forward's item counter back at 0 (the launch resets it)
    first = [t.clone() for t in captured]
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, first))


@needs_hopper
def test_compile_fullgraph_forward_backward():
    from hf_flash import flash_attn_func
    from hf_flash.interface import attention_paths

    q, k, v = (t.requires_grad_() for t in _qkv(2, 257, 257, 8, 2, 128, torch.bfloat16, seed=7))

    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    assert attention_paths(q, k, v, causal=True)["backward"] == "hopper"
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    g_e = torch.autograd.grad(f(q, k, v), (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(g, g_e))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_g = torch.autograd.grad(attention_ref(*leaves, causal=True), leaves, dout.float())
    lp_g = torch.autograd.grad(attention_ref(*leaves, causal=True, upcast=False), leaves, dout)
    for name, a, r, lp in zip(("dq", "dk", "dv"), g, ref_g, lp_g):
        assert_close_to_ref(name, a, r, lp, GRAD_FACTOR, torch.bfloat16)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nondeterministic_choice_through_the_public_function(causal):
    """With deterministic gradients not required, flash_attn_func's backward runs the variant
    NONDETERMINISTIC lists (an atomic dQ) where there is one, and its gradients match the oracle."""
    from hf_flash import flash_attn_func
    from hf_flash.kernels import configs
    from hf_flash.kernels.hopper import attention_bwd as hb

    q, k, v = (t.requires_grad_() for t in _qkv(2, 1000, 1000, 16, 4, 128, torch.bfloat16, seed=9))
    dout = torch.randn_like(q)
    with configs.use_deterministic(False):
        assert hb.variant_for(128, causal) == hb.NONDETERMINISTIC.get((128, causal), hb.DEFAULT[(128, causal)])
        g = torch.autograd.grad(flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_g = torch.autograd.grad(attention_ref(*leaves, causal=causal), leaves, dout.float())
    lp_g = torch.autograd.grad(attention_ref(*leaves, causal=causal, upcast=False), leaves, dout)
    for name, a, r, lp in zip(("dq", "dk", "dv"), g, ref_g, lp_g):
        assert_close_to_ref(name, a, r, lp, GRAD_FACTOR, torch.bfloat16)



# ---- packed (varlen, cu_seqlens) calls ----


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _packed_qkv(lens_q, lens_k, h, hk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    return mk(sum(lens_q), h, d), mk(sum(lens_k), hk, d), mk(sum(lens_k), hk, d), _cu(lens_q), _cu(lens_k)


def _packed_backward(q, k, v, dout, cu_q, cu_k, causal, scale=None, window=(-1, -1), softcap=0.0, path="hopper"):
    """Packed forward (the library's choice) and flash_attn_backward on the Gluon backward (checked
    through backward_path; ``path`` "triton": a call the Triton dK/dV kernel takes), into
    NaN-poisoned buffers. Returns (dq, dk, dv)."""
    from hf_flash.kernels import flash_bwd, flash_fwd

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    opts = dict(softmax_scale=scale, softcap=softcap, alibi_slopes=None, dropout_p=0.0,
                **_window_opts(causal, window))  # fmt: skip
    lens_q, lens_k = (cu[1:] - cu[:-1] for cu in (cu_q, cu_k))
    lens = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(lens_q.max()), max_seqlen_k=int(lens_k.max()))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], device=q.device, dtype=torch.float32)
    flash_fwd.flash_attn_forward(q, k, v, out, lse, rng_state=None, **lens, **opts)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    assert flash_bwd.backward_path(q, k, v, out, dout, dk, dv, varlen=True, **opts) == path, (
        f"the packed case under test must be one the {path} dK/dV kernel takes"
    )
    flash_bwd.flash_attn_backward(dout, None, q, k, v, out, lse, dq, dk, dv, rng_state=None, **lens, **opts)
    return dq, dk, dv


def _check_packed(lens_q, lens_k, h, hk, causal, dtype, d=128, seed=0, scale=None, window=(-1, -1), softcap=0.0,
                  path="hopper"):  # fmt: skip
    from hf_flash.reference import attention_varlen_ref

    q, k, v, cu_q, cu_k = _packed_qkv(lens_q, lens_k, h, hk, d, dtype, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 100)
    dout = torch.randn(q.shape, device="cuda", dtype=dtype, generator=g)
    grads = _packed_backward(q, k, v, dout, cu_q, cu_k, causal, scale, window, softcap, path)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    opts = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap)
    ref = attention_varlen_ref(*leaves, cu_q, cu_k, upcast=True, **opts)
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    ref_lp = attention_varlen_ref(*leaves, cu_q, cu_k, upcast=False, **opts)
    lp_grads = torch.autograd.grad(ref_lp, leaves, dout)
    for name, a, r, lp in zip(("dq", "dk", "dv"), grads, ref_grads, lp_grads):
        assert_close_to_ref(name, a, r, lp, GRAD_FACTOR, dtype)
    return grads


# odd lengths, one-token and empty documents, documents that end inside a key block of 128 and
# a query tile of 64 (so tiles straddle into the next document), exact multiples
PACKED_LENS = [1, 97, 0, 1025, 300, 64, 128, 129, 2]


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h,hk", [(32, 8), (8, 1)], ids=["gqa-32-8", "mqa-8-1"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_packed_matches_reference(h, hk, causal, dtype, d):
    _check_packed(PACKED_LENS, PACKED_LENS, h, hk, causal, dtype, d=d)


def _packed_variants():
    from hf_flash.kernels.hopper.attention_bwd import VARIANTS, varlen_builds

    return [name for name, var in VARIANTS.items() if 128 in var.head_dims and varlen_builds(name)
            and name in ("kv2x64-m64-s2", "kv2x64-m64-s2-dqwld", "kv2x64-m64-s2-dqwl")]  # fmt: skip


@needs_hopper
@pytest.mark.parametrize("variant", _packed_variants())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_every_variant_matches_reference(variant, causal, monkeypatch):
    """Each packed form packed calls run or may run (VARLEN_DEFAULT, VARLEN_NONDETERMINISTIC, and
    the ordered fused dqwld causal, measured slower there), as the default of its causality."""
    from hf_flash.kernels.hopper import attention_bwd as hb

    monkeypatch.setitem(hb.VARLEN_DEFAULT, (128, causal), variant)
    _check_packed(PACKED_LENS, PACKED_LENS, 8, 2, causal, torch.bfloat16, seed=9)
    _check_packed([50, 200, 1, 0, 300], [120, 200, 77, 64, 97], 4, 1, causal, torch.float16, seed=10)


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_nondeterministic_choice_through_the_public_function(causal, d):
    """With deterministic gradients not required, packed calls run VARLEN_NONDETERMINISTIC's
    variant where there is one; the gradients match the oracle."""
    from hf_flash import flash_attn_varlen_func
    from hf_flash.kernels import configs
    from hf_flash.kernels.hopper import attention_bwd as hb
    from hf_flash.reference import assert_grads_close_to_ref, attention_varlen_ref

    lens = [97, 1025, 1, 300, 0, 640]
    q, k, v, cu, _ = _packed_qkv(lens, lens, 16, 4, d, torch.bfloat16, seed=11)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with configs.use_deterministic(False):
        assert hb.variant_for(d, causal, varlen=True) == hb.VARLEN_NONDETERMINISTIC.get(
            (d, causal), hb.VARLEN_DEFAULT[(d, causal)])
        out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
        ref = attention_varlen_ref(q, k, v, cu, cu, causal=causal)
        ref_lp = attention_varlen_ref(q, k, v, cu, cu, causal=causal, upcast=False)
        assert_grads_close_to_ref(out, ref, ref_lp, (q, k, v), torch.randn_like(out), torch.bfloat16)


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_q_len_differs_from_k_len(causal, d):
    """Documents with q_len != k_len (causal: bottom-right per document): fewer queries than
    keys (chunked prefill), more (rows that see no key), no queries (dK/dV still written: 0) and
    a one-query document."""
    lens_q = [50, 200, 1, 0, 300, 97, 1]
    lens_k = [120, 200, 77, 64, 97, 1025, 1]
    _check_packed(lens_q, lens_k, 8, 2, causal, torch.bfloat16, d=d, seed=3)
    _check_packed(lens_q, lens_k, 4, 1, causal, torch.float16, d=d, seed=4, scale=0.07)


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_many_short_documents(causal, d):
    """Many short documents: most key blocks and query tiles straddle two or more documents, and
    the dQ counters of neighbouring documents sit in neighbouring slots."""
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 150, (60,), generator=g).tolist()
    lens[7] = 0
    lens[20] = 1
    _check_packed(lens, lens, 8, 2, causal, torch.bfloat16, d=d, seed=5)


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_repeats_bitwise(causal, d):
    """The packed backward is bitwise repeatable on a grid of several waves of programs: its
    dK/dV form leaves dQ to the dQ kernel, which sums each row in key order."""
    g = torch.Generator().manual_seed(6)
    cuts = sorted((torch.randperm(8191, generator=g)[:11] + 1).tolist())
    lens = [b - a for a, b in zip([0, *cuts], [*cuts, 8192])]
    q, k, v, cu_q, cu_k = _packed_qkv(lens, lens, 16, 4, d, torch.bfloat16, seed=6)
    dout = torch.randn_like(q)
    a = _packed_backward(q, k, v, dout, cu_q, cu_k, causal)
    for _ in range(2):
        b = _packed_backward(q, k, v, dout, cu_q, cu_k, causal)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    _check_packed(lens, lens, 16, 4, causal, torch.bfloat16, d=d, seed=6)


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_packed_public_function_takes_the_hopper_backward(d):
    """flash_attn_varlen_func's autograd runs the Gluon backward for packed d64 and d128 calls
    (attention_paths says so) and its gradients match the oracle."""
    from hf_flash import flash_attn_varlen_func
    from hf_flash.interface import attention_paths
    from hf_flash.reference import assert_grads_close_to_ref, attention_varlen_ref

    lens = [1, 97, 1025, 0, 300]
    q, k, v, cu, _ = _packed_qkv(lens, lens, 32, 8, d, torch.bfloat16, seed=7)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for causal in (False, True):
        assert attention_paths(q, k, v, causal=causal, varlen=True)["backward"] == "hopper"
        out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
        ref = attention_varlen_ref(q, k, v, cu, cu, causal=causal)
        ref_lp = attention_varlen_ref(q, k, v, cu, cu, causal=causal, upcast=False)
        assert_grads_close_to_ref(out, ref, ref_lp, (q, k, v), torch.randn_like(out), torch.bfloat16)


@needs_hopper
def test_packed_empty_calls_launch_nothing():
    """No tokens at all, or every sequence empty: zero gradients, no launch of the Gluon kernel."""
    from hf_flash.kernels import flash_bwd
    from hf_flash.kernels.hopper import attention_bwd as hb

    calls = []
    launch = hb._attn_bwd_dkdv_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return launch[grid]

    opts = dict(softmax_scale=0.1, causal=True, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None,
                dropout_p=0.0)  # fmt: skip
    try:
        hb._attn_bwd_dkdv_kernel = Spy()
        for tokens in (0, 5):
            q = torch.randn(tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn(tokens, 2, 128, device="cuda", dtype=torch.bfloat16), torch.randn(
                tokens, 2, 128, device="cuda", dtype=torch.bfloat16)
            cu = torch.zeros(3, dtype=torch.int32, device="cuda")  # two empty sequences
            lse = torch.full((8, tokens), float("inf"), device="cuda")
            dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
            flash_bwd.flash_attn_backward(torch.randn_like(q), None, q, k, v, torch.zeros_like(q), lse, dq, dk, dv,
                                          cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=0, max_seqlen_k=0,
                                          rng_state=None, **opts)  # fmt: skip
            assert all(bool((t == 0).all()) for t in (dq, dk, dv))
            hb.hopper_attention_backward(q[:0], k[:0], v[:0], q[:0], lse[:, :0], lse[:, :0], dq[:0], dk[:0], dv[:0],
                                         softmax_scale=0.1, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)  # fmt: skip
    finally:
        hb._attn_bwd_dkdv_kernel = launch
    assert calls == []


# ---- sliding windows ----

# (causal, flash-attn window): causal windows (Mistral, gemma's local layers), the one-key window,
# two-sided, one-sided non-causal, a window wider than the sequence
WINDOWS = [
    pytest.param(True, (100, -1), id="causal-left100"),
    pytest.param(True, (0, -1), id="causal-diagonal-only"),
    pytest.param(False, (37, 50), id="two-sided"),
    pytest.param(False, (-1, 3), id="right-only"),
    pytest.param(False, (200, -1), id="left-only"),
    pytest.param(True, (5000, -1), id="causal-window-past-the-sequence"),
]
WINDOW_SHAPES = [
    pytest.param(2, 1025, 1100, 8, 2, id="sq<sk-gqa"),
    pytest.param(1, 777, 200, 4, 2, id="sq>sk-empty-rows"),
    pytest.param(1, 1, 1, 2, 1, id="s1"),
    pytest.param(1, 512, 512, 32, 8, id="hq32-hkv8"),
]


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("batch,sq,sk,h,hk", WINDOW_SHAPES)
def test_windows_match_reference(batch, sq, sk, h, hk, causal, window, head_dim, monkeypatch):
    dtype = torch.float16 if sq == 777 else torch.bfloat16
    _check(*_qkv(batch, sq, sk, h, hk, head_dim, dtype, seed=21), causal, monkeypatch=monkeypatch, window=window)


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _variant_head_dims())
def test_every_variant_with_a_window(variant, head_dim, monkeypatch):
    _check(*_qkv(2, 1025, 1100, 8, 2, head_dim, torch.bfloat16, seed=22), True, variant=variant,
           monkeypatch=monkeypatch, window=(130, -1))  # fmt: skip
    _check(*_qkv(1, 700, 650, 4, 4, head_dim, torch.float16, seed=23), False, variant=variant,
           monkeypatch=monkeypatch, window=(64, 200))  # fmt: skip


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _ordered_variants())
@pytest.mark.parametrize("causal,window", [pytest.param(True, (300, -1), id="causal-left300"),
                                           pytest.param(False, (500, 200), id="two-sided")])  # fmt: skip
def test_ordered_dq_with_a_window_repeats_bitwise(variant, head_dim, causal, window, monkeypatch):
    """With a left window a query tile's first adding key block is not block 0: the ordered dQ
    counts turns from the tile's first block (``_first_key_block``), bitwise repeatable over
    several waves of programs and equal to the oracle."""
    q, k, v = _qkv(2, 4000, 4100, 16, 4, head_dim, torch.bfloat16, seed=24)
    dout = torch.randn_like(q)
    a = _backward(q, k, v, dout, causal, variant=variant, monkeypatch=monkeypatch, window=window)
    for _ in range(2):
        b = _backward(q, k, v, dout, causal, variant=variant, monkeypatch=monkeypatch, window=window)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    _check(q, k, v, causal, variant=variant, monkeypatch=monkeypatch, seed=24, window=window)


@needs_hopper
@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_packed_windows_match_reference(causal, window, d):
    _check_packed(PACKED_LENS, PACKED_LENS, 8, 2, causal, torch.bfloat16, d=d, seed=25, window=window)
    _check_packed([50, 200, 1, 0, 300], [120, 200, 77, 64, 97], 4, 1, causal, torch.float16, d=d, seed=26,
                  window=window)  # fmt: skip


@needs_hopper
@pytest.mark.parametrize("variant", _packed_variants())
def test_packed_every_variant_with_a_window(variant, monkeypatch):
    from hf_flash.kernels.hopper import attention_bwd as hb

    for causal, window in ((True, (70, -1)), (False, (90, 33))):
        monkeypatch.setitem(hb.VARLEN_DEFAULT, (128, causal), variant)
        _check_packed(PACKED_LENS, PACKED_LENS, 8, 2, causal, torch.bfloat16, seed=27, window=window)


# ---- softcap (head dim 256: the split-D form) ----


@needs_hopper
@pytest.mark.parametrize("causal,window", [pytest.param(False, (-1, -1), id="full"),
                                           pytest.param(True, (-1, -1), id="causal"),
                                           pytest.param(True, (100, -1), id="causal-left100"),
                                           pytest.param(False, (37, 50), id="two-sided")])  # fmt: skip
@pytest.mark.parametrize("batch,sq,sk,h,hk", [pytest.param(2, 1025, 1100, 8, 2, id="sq<sk-gqa"),
                                              pytest.param(1, 777, 200, 4, 2, id="sq>sk-empty-rows"),
                                              pytest.param(1, 1, 1, 2, 1, id="s1")])  # fmt: skip
def test_softcap_at_head_dim_256(batch, sq, sk, h, hk, causal, window):
    # Gemma 2's cap; scores scaled up so the cap bites (tanh far from linear)
    q, k, v = _qkv(batch, sq, sk, h, hk, 256, torch.bfloat16, seed=29)
    _check(q * 4, k, v, causal, seed=29, window=window, softcap=50.0)


@needs_hopper
@pytest.mark.parametrize("causal,window", [pytest.param(True, (-1, -1), id="causal"),
                                           pytest.param(False, (90, 33), id="two-sided")])  # fmt: skip
def test_packed_softcap_at_head_dim_256(causal, window):
    _check_packed(PACKED_LENS, PACKED_LENS, 8, 2, causal, torch.bfloat16, d=256, seed=30, window=window,
                  softcap=30.0)  # fmt: skip


@needs_hopper
def test_windowed_public_function_takes_the_hopper_backward():
    """flash_attn_func with a sliding window runs the Gluon forward and backward (attention_paths
    says so); softcap keeps the Triton dK/dV kernel behind the Gluon forward, with the Gluon dQ
    beside it; gradients match."""
    from hf_flash import flash_attn_func
    from hf_flash.interface import attention_paths, attention_variants
    from hf_flash.kernels.hopper import attention_dq
    from hf_flash.reference import assert_grads_close_to_ref

    q, k, v = (t.requires_grad_() for t in _qkv(2, 1500, 1500, 8, 2, 128, torch.bfloat16, seed=28))
    for opts, backward in ((dict(causal=True, window_size=(256, 0)), "hopper"),
                           (dict(window_size=(100, 100)), "hopper"),
                           (dict(causal=True, window_size=(256, 0), softcap=30.0), "triton")):  # fmt: skip
        assert attention_paths(q, k, v, **opts) == {"forward": "hopper", "backward": backward}, opts
        if backward == "triton":  # the Gluon dQ beside the Triton dK/dV kernel
            assert attention_variants(q, k, v, **opts)["dq"] == attention_dq.DEFAULT[128], opts
        out = flash_attn_func(q, k, v, **opts)
        ref = attention_ref(q, k, v, upcast=True, **opts)
        ref_lp = attention_ref(q, k, v, upcast=False, **opts)
        assert_grads_close_to_ref(out, ref, ref_lp, (q, k, v), torch.randn_like(out), torch.bfloat16)


# ---- the Gluon dQ kernel (attention_dq), beside the dK/dV-only backward variant ----


def _dq_variants(packed=False):
    from hf_flash.kernels.hopper.attention_dq import VARIANTS

    return [(name, d) for name, var in VARIANTS.items() for d in var.head_dims if var.packed or not packed]


def _pin_dq(monkeypatch, head_dim, variant, causal, varlen):
    """Pin the dK/dV-only backward (kv2x64-m64-s2; d256 the split-D form) and the dQ ``variant``
    for the call's key; returns the list the spied dQ launcher appends each launch's variant to."""
    from hf_flash.kernels.hopper import attention_bwd as hb
    from hf_flash.kernels.hopper import attention_dq as hdq

    table = hb.VARLEN_DEFAULT if varlen else hb.DEFAULT
    for masked in (False, True):
        monkeypatch.setitem(table, (head_dim, masked), "kv64-m64-s2-splitd" if head_dim == 256 else "kv2x64-m64-s2")
        if not varlen and (head_dim, masked) in hb.SEQLEN_VARIANTS:
            monkeypatch.delitem(hb.SEQLEN_VARIANTS, (head_dim, masked))
    monkeypatch.setitem(hdq.VARLEN_DEFAULT if varlen else hdq.DEFAULT, head_dim, variant)
    return _spy_dq(monkeypatch)


def _spy_dq(monkeypatch):
    """The list the spied Gluon dQ launcher appends each launch's variant to."""
    from hf_flash.kernels.hopper import attention_dq as hdq

    launches = []
    run = hdq.hopper_attention_dq

    def spy(*args, **kwargs):
        varlen = kwargs.get("cu_seqlens_q") is not None
        launches.append(kwargs.get("variant") or hdq.variant_for(args[0].shape[-1], kwargs.get("softcap", 0.0), varlen))
        return run(*args, **kwargs)

    monkeypatch.setattr(hdq, "hopper_attention_dq", spy)
    return launches


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _dq_variants())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dq_every_variant_matches_reference(variant, head_dim, causal, monkeypatch):
    """Each dQ variant on dense calls: a query length that is no multiple of the tiles, more keys
    than queries, fewer (causal: rows that see no key), MHA, GQA and a window; NaN-poisoned dq."""
    launches = _pin_dq(monkeypatch, head_dim, variant, causal, varlen=False)
    _check(*_qkv(2, 1025, 1100, 8, 2, head_dim, torch.bfloat16, seed=31), causal)
    _check(*_qkv(1, 300, 97, 4, 4, head_dim, torch.float16, seed=32), causal)
    _check(*_qkv(1, 700, 650, 4, 1, head_dim, torch.bfloat16, seed=33), causal, window=(64, -1 if causal else 200))
    assert launches == [variant] * 3


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _dq_variants(packed=True))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dq_every_variant_packed(variant, head_dim, causal, monkeypatch):
    """Each dQ variant on packed calls: empty, one-token and odd documents, tiles that cross a
    document's end, q_len != k_len per document, a window; NaN-poisoned dq."""
    launches = _pin_dq(monkeypatch, head_dim, variant, causal, varlen=True)
    _check_packed(PACKED_LENS, PACKED_LENS, 8, 2, causal, torch.bfloat16, d=head_dim, seed=34)
    _check_packed([50, 200, 1, 0, 300, 97, 1], [120, 200, 77, 64, 97, 1025, 1], 4, 1, causal, torch.float16,
                  d=head_dim, seed=35)  # fmt: skip
    _check_packed(PACKED_LENS, PACKED_LENS, 8, 2, causal, torch.bfloat16, d=head_dim, seed=36, window=(100, -1))
    assert launches == [variant] * 3


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_repeats_bitwise(head_dim, monkeypatch):
    """The dQ kernel sums each row in key order: repeated calls give the same bits."""
    from hf_flash.kernels.hopper import attention_dq as hdq

    launches = _pin_dq(monkeypatch, head_dim, hdq.VARLEN_DEFAULT[head_dim], True, varlen=True)
    g = torch.Generator().manual_seed(37)
    cuts = sorted((torch.randperm(8191, generator=g)[:11] + 1).tolist())
    lens = [b - a for a, b in zip([0, *cuts], [*cuts, 8192])]
    q, k, v, cu_q, cu_k = _packed_qkv(lens, lens, 16, 4, head_dim, torch.bfloat16, seed=37)
    dout = torch.randn_like(q)
    a = _packed_backward(q, k, v, dout, cu_q, cu_k, True)
    b = _packed_backward(q, k, v, dout, cu_q, cu_k, True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len(launches) == 2


SOFTCAP_WINDOWS = [pytest.param(False, (-1, -1), id="full"), pytest.param(True, (-1, -1), id="causal"),
                   pytest.param(True, (100, -1), id="causal-left100"), pytest.param(False, (37, 50), id="two-sided")]


@needs_hopper
@pytest.mark.parametrize("causal,window", SOFTCAP_WINDOWS)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_dq_softcap_matches_reference(head_dim, causal, window, monkeypatch):
    """Soft-capped calls take the Gluon dQ: d128 beside the Triton dK/dV kernel (the Gluon one has
    no softcap there), d256 beside the split-D form; scores scaled up so the cap bites. Rows that
    see no key (sq > sk causal), GQA, MQA; NaN-poisoned dq."""
    from hf_flash.kernels.hopper import attention_dq as hdq

    launches = _spy_dq(monkeypatch)
    path = "hopper" if head_dim == 256 else "triton"
    q, k, v = _qkv(2, 1025, 1100, 8, 2, head_dim, torch.bfloat16, seed=40)
    _check(q * 4, k, v, causal, seed=40, window=window, softcap=50.0, path=path)
    q, k, v = _qkv(1, 777, 200, 4, 1, head_dim, torch.float16, seed=41)
    _check(q * 4, k, v, causal, seed=41, window=window, softcap=30.0, path=path)
    assert launches == [hdq.DEFAULT[head_dim]] * 2


@needs_hopper
@pytest.mark.parametrize("causal,window", SOFTCAP_WINDOWS)
def test_packed_dq_softcap_matches_reference(causal, window, monkeypatch):
    """Packed soft-capped d128 calls: the Triton dK/dV kernel and the Gluon dQ beside it, on empty,
    one-token and odd documents."""
    from hf_flash.kernels.hopper import attention_dq as hdq

    launches = _spy_dq(monkeypatch)
    _check_packed(PACKED_LENS, PACKED_LENS, 8, 2, causal, torch.bfloat16, d=128, seed=42, window=window,
                  softcap=30.0, path="triton")  # fmt: skip
    assert launches == [hdq.VARLEN_DEFAULT[128]]


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_packed_cuda_graph_capture_forward_backward(d):
    """A packed forward + backward (the dK/dV-only form beside the Gluon dQ kernel, and their
    device-built schedules) captured in a CUDA graph: replays with new dO give what eager calls
    give, bitwise, twice."""
    from hf_flash import flash_attn_varlen_func
    from hf_flash.interface import attention_variants

    lens = [1, 97, 0, 1025, 300]
    q, k, v, cu, _ = _packed_qkv(lens, lens, 8, 2, d, torch.bfloat16, seed=38)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert attention_variants(q, k, v, causal=True, varlen=True)["dq"] is not None
    dout = torch.randn_like(q)

    def step():
        out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    eager = step()
    graph, captured = _captured(step)
    for _ in range(2):
        with torch.no_grad():
            dout.copy_(torch.randn_like(dout))
        graph.replay()
        torch.cuda.synchronize()
        fresh = step()
        assert all(torch.equal(a, b) for a, b in zip(captured, fresh))
        assert not torch.equal(captured[0], eager[0])
