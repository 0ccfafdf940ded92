"""The Gluon Hopper forward against the float32 oracle, on an sm_90 GPU.

Error rule (``hf_flash.reference.assert_close_to_ref``): the kernel's max error against the
float32 reference is at most 2x the max error of the same reference computed in the input
dtype, plus the rounding of one output element. Outputs are NaN-poisoned before the launch, so
an unwritten element fails; the log-sum-exp is checked too, +inf exactly on rows that see no key.
"""

from __future__ import annotations

import pytest
import torch

from hf_flash.reference import FWD_FACTOR, assert_close_to_ref, attention_ref, attention_varlen_ref

pytestmark = pytest.mark.gpu


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (H100/H200)")


def _run(q, k, v, causal, variant=None, scale=None, window=(-1, -1), softcap=0.0):
    from hf_flash.kernels.hopper import attention_fwd as hk

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    assert hk.supports(q, k, v, causal=causal, window=window, softcap=softcap), (
        "the case under test must be one the kernel covers"
    )
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=torch.float32, device=q.device)
    hk.hopper_attention_forward(q, k, v, out, lse, softmax_scale=scale, causal=causal, variant=variant,
                                window=window, softcap=softcap)  # fmt: skip
    return out, lse


def _check(q, k, v, causal, variant=None, scale=None, window=(-1, -1), softcap=0.0):
    out, lse = _run(q, k, v, causal, variant, scale, window, softcap)
    opts = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap)
    ref, ref_lse = attention_ref(q, k, v, upcast=True, return_lse=True, **opts)
    ref_lp = attention_ref(q, k, v, upcast=False, **opts)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, q.dtype)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse must be +inf exactly on rows that see no key"
    assert not torch.isnan(lse).any(), "unwritten lse"
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert lse_err <= 1e-3, f"lse: max err {lse_err:.3e}"
    return out, lse


def _qkv(batch, sq, sk, h, hk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    return mk(batch, sq, h, d), mk(batch, sk, hk, d), mk(batch, sk, hk, d)


def _variant_head_dims(names=None, head_dims=None):
    """(variant, head dim) pairs: of ``names`` (default: every variant) at the head dims each
    builds (of ``head_dims`` where given)."""
    from hf_flash.kernels.hopper.attention_fwd import VARIANTS

    return [(name, d) for name in (names or VARIANTS) for d in VARIANTS[name].head_dims
            if head_dims is None or d in head_dims]  # fmt: skip


CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k
    pytest.param(2, 128, 128, 4, 4, id="mha-one-tile"),
    pytest.param(2, 1025, 1025, 8, 2, id="gqa-1025"),
    pytest.param(1, 97, 97, 4, 1, id="mqa-97"),
    pytest.param(1, 1, 1, 2, 1, id="s1"),
    pytest.param(1, 1, 300, 4, 2, id="decode-row"),
    pytest.param(1, 200, 777, 4, 2, id="sq<sk"),
    pytest.param(1, 777, 200, 4, 2, id="sq>sk-empty-rows"),
    pytest.param(1, 8191, 8191, 2, 1, id="8191"),
]


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch,sq,sk,h,hk", CASES)
def test_default_variant_matches_reference(batch, sq, sk, h, hk, head_dim, causal, dtype):
    _check(*_qkv(batch, sq, sk, h, hk, head_dim, dtype), causal)


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _variant_head_dims())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_variant_matches_reference(variant, head_dim, causal):
    _check(*_qkv(2, 1025, 1100, 8, 2, head_dim, torch.bfloat16, seed=1), causal, variant=variant)
    _check(*_qkv(1, 300, 97, 4, 4, head_dim, torch.float16, seed=2), causal, variant=variant)


@needs_hopper
def test_causal_rows_without_keys_are_zero():
    q, k, v = _qkv(1, 300, 40, 4, 2, 128, torch.bfloat16)
    out, lse = _check(q, k, v, causal=True)
    empty = 300 - 40  # bottom-right alignment: the first Sq - Sk rows see no key
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isinf(lse[:, :, :empty]).all() and (lse[:, :, :empty] > 0).all()


@needs_hopper
def test_non_contiguous_views_and_scale():
    # (B, H, S, D) storage seen through transposes: the head dim has unit stride, nothing else
    # is contiguous; the kernel must read them in place
    dtype = torch.bfloat16
    qs = torch.randn(2, 8, 515, 128, device="cuda", dtype=dtype)
    ks = torch.randn(2, 2, 600, 128, device="cuda", dtype=dtype)
    vs = torch.randn(2, 2, 600, 128, device="cuda", dtype=dtype)
    q, k, v = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
    assert not q.is_contiguous()
    for causal in (False, True):
        _check(q, k, v, causal, scale=0.05)


@needs_hopper
def test_results_repeat_bitwise():
    q, k, v = _qkv(2, 2048, 2048, 8, 2, 128, torch.bfloat16)
    a, la = _run(q, k, v, True)
    b, lb = _run(q, k, v, True)
    assert torch.equal(a, b) and torch.equal(la, lb)


DYNAMIC_FORMS = ("ws2x4-overlap-fma-dyn", "ws2x4-overlap-fma-dyn-carry")


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _variant_head_dims(DYNAMIC_FORMS, (64, 128)))
def test_dynamic_schedule_matches_one_item_programs_bitwise(head_dim, variant):
    # the item counter decides only which program computes an item, never how (nor does
    # finishing each item one item late, -carry): every row equals the one-item-per-program
    # launch's bitwise, causal (items of many lengths) and not
    q, k, v = _qkv(3, 1500, 1500, 16, 4, head_dim, torch.bfloat16, seed=5)
    for causal in (False, True):
        dyn = _run(q, k, v, causal, variant=variant)
        one = _run(q, k, v, causal, variant="ws2x4-overlap-fma")
        assert torch.equal(dyn[0], one[0]) and torch.equal(dyn[1], one[1]), causal


@needs_hopper
def test_item_counters_reset_themselves_per_stream():
    # a dynamic launch leaves its stream's counter at 0 for the next launch (no fill per call):
    # launches of different sizes back to back, on the default stream and on a side stream
    # (its own counter), each match the one-item-per-program launch bitwise
    from hf_flash.kernels.hopper import attention_fwd as hk

    dev = torch.device("cuda", torch.cuda.current_device())
    calls = [_qkv(1, 700, 700, 4, 2, 128, torch.bfloat16, seed=11), _qkv(2, 1500, 1500, 8, 2, 128, torch.bfloat16,
                                                                        seed=12)]  # fmt: skip
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            for q, k, v in calls * 2:
                dyn = _run(q, k, v, True, variant="ws2x4-overlap-fma-dyn")
                one = _run(q, k, v, True, variant="ws2x4-overlap-fma")
                assert torch.equal(dyn[0], one[0]) and torch.equal(dyn[1], one[1])
                assert hk.item_counter(dev).item() == 0
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        side_counter = hk.item_counter(dev)
    assert side_counter is not hk.item_counter(dev), "each stream has its own counter"


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _variant_head_dims())
def test_many_items_per_program(variant, head_dim):
    # 4 x 16 heads x 12+ query tiles: persistent programs take several items each, of different
    # lengths, some with rows that see no key (Sq > Sk, causal), so the barrier phases must carry
    # over from item to item
    q, k, v = _qkv(4, 1500, 1100, 16, 4, head_dim, torch.bfloat16, seed=3)
    for causal in (True, False):
        _check(q, k, v, causal, variant=variant)


# ---- packed (varlen) calls: cu_seqlens, per-sequence bottom-right alignment ----


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _packed(lens_q, lens_k, h, hk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    lens_k = lens_q if lens_k is None else lens_k
    return mk(sum(lens_q), h, d), mk(sum(lens_k), hk, d), mk(sum(lens_k), hk, d), _cu(lens_q), _cu(lens_k)


def _run_varlen(q, k, v, cu_q, cu_k, causal, variant=None, order="document", window=(-1, -1), softcap=0.0):
    from hf_flash.kernels.hopper import attention_fwd as hk

    assert hk.supports(q, k, v, causal=causal, varlen=True, window=window, softcap=softcap), (
        "the case under test must be one the kernel covers"
    )
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32, device=q.device)
    hk.hopper_attention_forward(
        q, k, v, out, lse, softmax_scale=q.shape[-1] ** -0.5, causal=causal, variant=variant,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, order=order, window=window, softcap=softcap,
    )  # fmt: skip
    return out, lse


def _check_varlen(q, k, v, cu_q, cu_k, causal, variant=None, order="document", window=(-1, -1), softcap=0.0):
    out, lse = _run_varlen(q, k, v, cu_q, cu_k, causal, variant, order, window, softcap)
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=True, return_lse=True, **opts)
    ref_lp = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, **opts)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, q.dtype)
    finite = torch.isfinite(ref_lse)
    assert not torch.isnan(lse).any(), "unwritten lse"
    assert torch.equal(torch.isfinite(lse), finite), "lse must be +inf exactly on rows that see no key"
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert lse_err <= 1e-3, f"lse: max err {lse_err:.3e}"
    return out, lse


VARLEN_CASES = [
    # lens_q, lens_k (None: the same), nheads, nheads_k
    pytest.param([1, 97, 1025, 8191], None, 4, 2, id="odd-lengths"),
    pytest.param([0, 1, 0, 300, 1, 130, 0], None, 8, 2, id="empty-and-one"),
    pytest.param([50, 300, 1, 129, 0, 5, 700], [200, 100, 64, 129, 17, 0, 650], 8, 1, id="sq!=sk-mqa"),
    pytest.param([128, 256, 64, 192], None, 4, 4, id="tile-multiples"),
]


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens_q,lens_k,h,hk", VARLEN_CASES)
def test_varlen_default_variant_matches_reference(lens_q, lens_k, h, hk, head_dim, causal, dtype):
    _check_varlen(*_packed(lens_q, lens_k, h, hk, head_dim, dtype), causal)


def _varlen_variants():
    from hf_flash.kernels.hopper.attention_fwd import VARIANTS, varlen_builds

    return [
        pytest.param(name, d, causal, id=f"{name}-d{d}-{'causal' if causal else 'full'}")
        for name, var in VARIANTS.items() for d in var.head_dims for causal in (False, True)
        if varlen_builds(name, causal)
    ]  # fmt: skip


@needs_hopper
@pytest.mark.parametrize("variant,head_dim,causal", _varlen_variants())
def test_varlen_every_variant_matches_reference(variant, head_dim, causal):
    lens_q, lens_k = [50, 300, 1, 0, 1025, 5, 700], [200, 100, 64, 17, 1025, 0, 650]
    _check_varlen(*_packed(lens_q, lens_k, 8, 2, head_dim, torch.bfloat16, seed=4), causal, variant=variant)


@needs_hopper
def test_varlen_orders_give_the_same_bits():
    # each item computes its rows alone: the schedule's order cannot change a bit
    args = _packed([3000, 1, 0, 517, 2049, 64], None, 8, 2, 128, torch.bfloat16, seed=5)
    for causal in (False, True):
        a = _run_varlen(*args, causal, order="longest")
        b = _run_varlen(*args, causal, order="document")
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@needs_hopper
def test_varlen_rows_outside_sequences_untouched_and_strided_views():
    # q/k/v as views of one packed (T, 3, H, D) projection (flash-attn's qkvpacked layout: token
    # stride 3 H D); cu_seqlens ending before the last rows: those rows stay as they were
    t, h, d = 1200, 8, 128
    qkv = torch.randn(t, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    cu = _cu([400, 0, 577, 100])  # 1077 of 1200 rows
    for causal in (False, True):
        out, lse = _run_varlen(q, k, v, cu, cu, causal)
        assert torch.isnan(out[1077:]).all() and torch.isnan(lse[:, 1077:]).all()
        _check_varlen(q[:1077], k[:1077], v[:1077], cu, cu, causal)


@needs_hopper
@pytest.mark.parametrize("opt_in", [True, False], ids=["gluon-varlen-default", "switched-off"])
def test_varlen_forward_path_and_gradients_through_the_public_function(opt_in, monkeypatch):
    from hf_flash import flash_attn_varlen_func
    from hf_flash.kernels import configs
    from hf_flash.interface import attention_paths
    from hf_flash.reference import assert_grads_close_to_ref

    monkeypatch.setattr(configs, "_HOPPER_VARLEN", opt_in)
    lens = [1, 97, 1025, 0, 300]
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            q, k, v, cu, _ = _packed(lens, lens, 8, 2, d, dtype, seed=d)
            q, k, v = (t.requires_grad_(True) for t in (q, k, v))
            for causal in (False, True):
                paths = attention_paths(q, k, v, causal=causal, varlen=True)
                # on unless switched off; the packed backward takes the Gluon kernel whichever
                # forward ran
                forward = "hopper" if opt_in else "triton"
                backward = "hopper"
                assert paths == {"forward": forward, "backward": backward}, paths
                out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
                ref = attention_varlen_ref(q, k, v, cu, cu, causal=causal)
                ref_lp = attention_varlen_ref(q, k, v, cu, cu, causal=causal, upcast=False)
                assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
                assert_grads_close_to_ref(out, ref, ref_lp, (q, k, v), torch.randn_like(out), dtype)


@needs_hopper
def test_varlen_calls_the_kernel_does_not_cover_stay_on_triton():
    from hf_flash.interface import attention_paths

    q, k, v, _, _ = _packed([100, 200], None, 8, 2, 128, torch.bfloat16)
    for opts in (dict(dropout_p=0.1), dict(alibi_slopes=torch.rand(8, device="cuda"))):
        assert attention_paths(q, k, v, varlen=True, **opts)["forward"] == "triton", opts
    q80, k80, v80, _, _ = _packed([100, 200], None, 8, 2, 80, torch.bfloat16)
    assert attention_paths(q80, k80, v80, varlen=True, causal=True)["forward"] == "triton"
    assert attention_paths(q.float(), k.float(), v.float(), varlen=True)["forward"] == "triton"


# ---- sliding windows and softcap ----

# (causal, window (left, right), softcap): causal windows (Mistral, gemma's local layers), the
# one-key window, two-sided, one-sided non-causal, windows wider than the sequence, softcap
# (gemma2) alone and with a window
MASKS = [
    pytest.param(True, (100, 0), 0.0, id="causal-left100"),
    pytest.param(True, (0, 0), 0.0, id="causal-diagonal-only"),
    pytest.param(False, (37, 50), 0.0, id="two-sided"),
    pytest.param(False, (-1, 3), 0.0, id="right-only"),
    pytest.param(False, (200, -1), 0.0, id="left-only"),
    pytest.param(True, (5000, 0), 0.0, id="causal-window-past-the-sequence"),
    pytest.param(True, (-1, 0), 30.0, id="causal-softcap"),
    pytest.param(False, (-1, -1), 5.0, id="softcap-5"),
    pytest.param(True, (300, 0), 50.0, id="causal-left300-softcap"),
]
MASK_SHAPES = [
    pytest.param(2, 1025, 1100, 8, 2, id="sq<sk-gqa"),
    pytest.param(1, 777, 200, 4, 2, id="sq>sk-empty-rows"),
    pytest.param(1, 1, 1, 2, 1, id="s1"),
    pytest.param(1, 4096, 4096, 4, 1, id="4096-mqa"),
]


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal,window,softcap", MASKS)
@pytest.mark.parametrize("batch,sq,sk,h,hk", MASK_SHAPES)
def test_windows_and_softcap_match_reference(batch, sq, sk, h, hk, causal, window, softcap, head_dim):
    dtype = torch.float16 if sq == 777 else torch.bfloat16
    _check(*_qkv(batch, sq, sk, h, hk, head_dim, dtype, seed=7), causal, window=window, softcap=softcap)


@needs_hopper
@pytest.mark.parametrize("variant,head_dim", _variant_head_dims())
def test_every_variant_with_a_window_and_softcap(variant, head_dim):
    _check(*_qkv(2, 1025, 1100, 8, 2, head_dim, torch.bfloat16, seed=8), True, variant=variant, window=(130, 0))
    _check(*_qkv(1, 700, 650, 4, 4, head_dim, torch.bfloat16, seed=9), False, variant=variant, window=(64, 200),
           softcap=20.0)  # fmt: skip


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal,window,softcap", MASKS)
def test_varlen_windows_and_softcap_match_reference(causal, window, softcap, head_dim):
    lens_q, lens_k = [50, 300, 1, 0, 1025, 5, 700], [200, 100, 64, 17, 1025, 0, 650]
    _check_varlen(*_packed(lens_q, lens_k, 8, 2, head_dim, torch.bfloat16, seed=10), causal, window=window,
                  softcap=softcap)  # fmt: skip


@needs_hopper
def test_windowed_calls_take_the_gluon_forward_through_the_public_function():
    from hf_flash import flash_attn_func, flash_attn_varlen_func
    from hf_flash.interface import attention_paths

    q, k, v = _qkv(2, 2000, 2000, 8, 2, 128, torch.bfloat16, seed=11)
    for opts in (dict(causal=True, window_size=(256, 0)), dict(window_size=(100, 100)), dict(softcap=30.0),
                 dict(causal=True, window_size=(512, 0), softcap=50.0)):  # fmt: skip
        assert attention_paths(q, k, v, **opts)["forward"] == "hopper", opts
        out = flash_attn_func(q, k, v, **opts)
        ref = attention_ref(q, k, v, upcast=True, **opts)
        ref_lp = attention_ref(q, k, v, upcast=False, **opts)
        assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, q.dtype)
    lens = [1, 97, 1025, 0, 300]
    qp, kp, vp, cu, _ = _packed(lens, lens, 8, 2, 128, torch.bfloat16, seed=12)
    opts = dict(causal=True, window_size=(64, 0))
    assert attention_paths(qp, kp, vp, varlen=True, **opts)["forward"] == "hopper"
    out = flash_attn_varlen_func(qp, kp, vp, cu, cu, max(lens), max(lens), **opts)
    ref = attention_varlen_ref(qp, kp, vp, cu, cu, upcast=True, **opts)
    ref_lp = attention_varlen_ref(qp, kp, vp, cu, cu, upcast=False, **opts)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, qp.dtype)
