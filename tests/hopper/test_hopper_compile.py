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
# the variants dense calls take by their length, non-causal (causal: every variant above)
SPECS += sorted({(name, d, False, "bfloat16") for (d, causal), ranges in hk.SEQLEN_VARIANTS.items() if not causal
                 for _, _, name in ranges})  # fmt: skip
# packed (varlen): every variant with a packed form, bfloat16; the packed defaults in float16
SPECS += [
    (compile_check.VARLEN_PREFIX + name, d, causal, "bfloat16")
    for name, var in hk.VARIANTS.items() for d in var.head_dims for causal in (False, True)
    if hk.varlen_builds(name, causal)
]  # fmt: skip
SPECS += [(compile_check.VARLEN_PREFIX + name, d, causal, "float16") for (d, causal), name in hk.VARLEN_DEFAULT.items()]
# sliding windows and softcap: the variants windowed / soft-capped calls run (default_variant),
# dense and packed, bfloat16
SPECS += [
    (prefix + hk.default_variant(d, causal, bool(prefix), (256, 0 if causal else 256)), d, causal, "bfloat16", feat)
    for prefix in ("", compile_check.VARLEN_PREFIX) for d in hk.HEAD_DIMS for causal in (False, True)
    for feat in ("window", "softcap", "window-softcap")
]  # fmt: skip


@pytest.fixture(scope="module")
def reports():
    return dict(zip(SPECS, compile_check.check_many(SPECS)))


@pytest.mark.parametrize("spec", SPECS, ids=["-".join(map(str, s)) for s in SPECS])
def test_variant_builds_for_sm90a(reports, spec):
    r = reports[spec]
    variant, head_dim, causal, dtype, *features = spec
    var = hk.VARIANTS[variant.removeprefix(compile_check.VARLEN_PREFIX)]
    assert (r["variant"], r["head_dim"], r["causal"], r["dtype"], r["features"]) == (*spec[:4], "".join(features))
    assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0 and r["stack_bytes"] == 0, r
    assert r["shared_bytes"] <= SHARED_LIMIT, r
    assert not r["wgmma_serialized"], r
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
    for (d, causal), name in hk.VARLEN_DEFAULT.items():
        assert d in hk.VARIANTS[name].head_dims and hk.varlen_builds(name, causal)
    assert set(hk.VARLEN_DEFAULT) == set(hk.DEFAULT)


def test_default_variant_and_mask_args():
    # a left window bound: three consumers spill, two run it
    assert hk.VARIANTS[hk.default_variant(64, True)].consumers == 3
    assert hk.default_variant(64, True, window=(128, 0)) == hk.LEFT_WINDOW_FALLBACK
    assert hk.default_variant(64, False, window=(-1, 5)) == hk.DEFAULT[(64, False)]
    assert hk.default_variant(128, True, window=(128, 0)) == hk.DEFAULT[(128, True)]
    # dense calls without a window or softcap whose length lies in a range of SEQLEN_VARIANTS:
    # that range's variant; just outside every range, unknown length (0) or packed: DEFAULT
    assert set(hk.SEQLEN_VARIANTS) == {(128, False), (128, True), (64, True), (64, False)}
    for (d, causal), ranges in hk.SEQLEN_VARIANTS.items():
        inside = lambda s: any(lo <= s <= hi for lo, hi, _ in ranges)  # noqa: E731
        for lo, hi, name in ranges:
            assert d in hk.VARIANTS[name].head_dims
            assert hk.default_variant(d, causal, seqlen_q=lo) == hk.default_variant(d, causal, seqlen_q=hi) == name
            for s in (lo - 1, hi + 1):
                if not inside(s):
                    assert hk.default_variant(d, causal, seqlen_q=s) == hk.DEFAULT[(d, causal)]
            assert hk.default_variant(d, causal, True, seqlen_q=lo) == hk.VARLEN_DEFAULT[(d, causal)]
            assert hk.default_variant(d, causal, seqlen_q=lo, softcap=30.0) == hk.DEFAULT[(d, causal)]
            # the short ranges (256 up to at most 8K queries) run the dynamic persistent form,
            # the long (causal) ones head-major
            var = hk.VARIANTS[name]
            assert (var.dynamic and hi <= 8192) or (var.head_major and causal and hi == hk.MAX_SEQLEN)
        assert min(lo for lo, _, _ in ranges) == 256
        assert hk.default_variant(d, causal, seqlen_q=0) == hk.DEFAULT[(d, causal)]  # length not given
    # each item finished one item late (carry): where it measured faster, not d128 causal nor
    # d128 non-causal past 4K
    assert hk.VARIANTS[hk.default_variant(128, False, seqlen_q=4096)].carry
    assert not hk.VARIANTS[hk.default_variant(128, False, seqlen_q=4097)].carry
    assert hk.VARIANTS[hk.default_variant(128, False, seqlen_q=4097)].dynamic
    assert not any(hk.VARIANTS[hk.default_variant(128, True, seqlen_q=s)].carry for s in (256, 4096, 8192))
    assert hk.VARIANTS[hk.default_variant(64, True, seqlen_q=2048)].carry
    assert hk.default_variant(64, False, seqlen_q=2048) == hk.DEFAULT[(64, False)]  # 0.96x at 2K
    assert hk.default_variant(64, True, seqlen_q=4096) == hk.DEFAULT[(64, True)]
    assert hk.default_variant(128, True, window=(128, 0), seqlen_q=65536) == hk.DEFAULT[(128, True)]
    assert hk.default_variant(64, True, window=(128, 0), seqlen_q=65536) == hk.LEFT_WINDOW_FALLBACK
    assert hk.default_variant(64, True, window=(128, 0), seqlen_q=1024) == hk.LEFT_WINDOW_FALLBACK
    assert hk.default_variant(128, True, window=(128, 0), seqlen_q=4096) == hk.DEFAULT[(128, True)]
    assert hk.default_variant(128, False, seqlen_q=4096, softcap=30.0) == hk.DEFAULT[(128, False)]
    short = hk.SEQLEN_VARIANTS[(128, True)][0][2]
    assert hk.default_variant(128, True, window=(-1, 0), seqlen_q=4096) == short
    assert hk.VARIANTS[short].dynamic and 128 in hk.VARIANTS[short].head_dims
    assert hk.VARIANTS[hk.LEFT_WINDOW_FALLBACK].consumers == 2
    m = hk.mask_args(True, (100, -1), 0.0, 0.125)
    assert (m["MASK_LEFT"], m["MASK_RIGHT"], m["window_left"], m["window_right"], m["SOFTCAP"]) == (
        True, True, 100, 0, False
    )  # fmt: skip
    m = hk.mask_args(False, (-1, 7), 50.0, 0.125)
    assert (m["MASK_LEFT"], m["MASK_RIGHT"], m["window_right"], m["SOFTCAP"]) == (False, True, 7, True)
    assert m["softcap_in"] == pytest.approx(0.125 / 50.0)
    assert m["softcap_out"] == pytest.approx(50.0 * 1.4426950408889634)
    # a side as wide as any sequence the kernel takes is no bound (and stays out of int32 overflow)
    m = hk.mask_args(False, (2**40, 2**31 - 1))
    assert not m["MASK_LEFT"] and not m["MASK_RIGHT"]
    with pytest.raises(ValueError, match="window_right 0"):
        hk.mask_args(True, (-1, 3))


def test_packed_forms():
    # persistent variants and three consumers without causal masking have no packed form
    assert not hk.varlen_builds("ws2x4-overlap-fma-persist", True)
    assert not hk.varlen_builds("ws3x4-pp-s3", False) and hk.varlen_builds("ws3x4-pp-s3", True)
    assert hk.varlen_builds("ws2x4-overlap-fma", False)
    q, k = _t(64, 8, 64), _t(64, 2, 64)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    lse = torch.empty(8, 64)
    with pytest.raises(ValueError, match="no packed"):
        hk.launch_args(q, k, k, torch.empty_like(q), lse, softmax_scale=0.1, causal=False, variant="ws3x4-pp-s3",
                       cu_seqlens_q=cu, cu_seqlens_k=cu)  # fmt: skip
    # a packed launch without its work items would read whatever memory the schedule holds
    with pytest.raises(ValueError, match="sched="):
        hk.launch_args(q, k, k, torch.empty_like(q), lse, softmax_scale=0.1, causal=False,
                       variant="ws2x4-overlap-fma", cu_seqlens_q=cu, cu_seqlens_k=cu)  # fmt: skip


# ---- varlen_schedule(): the packed calls' work items, built on the device (no host sync) ----


def _items(sched):
    return [tuple(e) for e in sched.tolist()]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


LENS_Q = [0, 1, 300, 128, 0, 1025, 129]
LENS_K = [5, 0, 100, 128, 0, 2000, 129]


@pytest.mark.parametrize("rows", [64, 128, 192])
def test_document_schedule_slots(rows):
    # the schedule kernel (run here by Triton's interpreter): tile i of sequence d at entry
    # cu[d] // rows + d + i, every other entry empty, rows past the last sequence in no item
    cu_q = _cu(LENS_Q)
    tokens = sum(LENS_Q) + 50
    sched = hk.varlen_schedule(cu_q, _cu(LENS_K), tokens, rows=rows, block_n=128, causal=True)
    assert sched.dtype == torch.int32 and sched.shape == (hk.schedule_slots(tokens, len(LENS_Q), rows), 2)
    assert sched.shape[0] == tokens // rows + len(LENS_Q)
    expected = {int(cu_q[d]) // rows + d + t: (d, t) for d, n in enumerate(LENS_Q) for t in range(-(-n // rows))}
    for slot, entry in enumerate(_items(sched)):
        assert entry == expected.get(slot, (-1, 0)), slot


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("order", hk.ORDERS)
def test_varlen_schedule_covers_every_tile_once(causal, order):
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    tokens = sum(LENS_Q) + 50  # rows past the last sequence are in no item
    sched = hk.varlen_schedule(cu_q, cu_k, tokens, rows=128, block_n=128, causal=causal, order=order)
    assert sched.dtype == torch.int32 and sched.shape[1] == 2
    entries = _items(sched)
    items = [e for e in entries if e[0] >= 0]
    expected = [(b, t) for b, n in enumerate(LENS_Q) for t in range(-(-n // 128))]
    assert sorted(items) == expected
    assert all(e == (-1, 0) for e in entries if e[0] < 0)
    if order == "document":
        assert items == expected
    else:
        # an upper bound on the items: tokens / rows + one per non-empty sequence; empties last
        assert sched.shape[0] == -(-tokens // 128) + len(LENS_Q)
        assert entries[: len(items)] == items, "empty entries last"

        def work(b, t):
            hi = LENS_K[b]
            if causal:
                hi = min(hi, max(t * 128 + 128 + LENS_K[b] - LENS_Q[b], 0))
            return -(-hi // 128)

        works = [work(*e) for e in items]
        assert works == sorted(works, reverse=True), "longest first"
        # ties keep the sequence order
        assert all(items[i] < items[i + 1] for i in range(len(items) - 1) if works[i] == works[i + 1])


@pytest.mark.parametrize("order", hk.ORDERS)
def test_varlen_schedule_empty_batch_entries(order):
    cu = torch.tensor([0, 0, 0], dtype=torch.int32)
    sched = hk.varlen_schedule(cu, cu, 10, rows=128, block_n=128, causal=True, order=order)
    assert (sched[:, 0] == -1).all()


def test_document_schedule_stays_in_bounds():
    # cu_seqlens past the tensor's rows (unchecked input): entries are written only inside it
    cu = torch.tensor([0, 100, 900], dtype=torch.int32)
    sched = hk.varlen_schedule(cu, cu, 200, rows=64, block_n=128, causal=False)
    assert sched.shape == (200 // 64 + 2, 2)
    assert _items(sched)[:2] == [(0, 0), (0, 1)]


# ---- supports(): the dispatch rule, checked on CPU tensors with the device test stubbed ----


@pytest.fixture
def on_hopper(monkeypatch):
    monkeypatch.setattr(hk, "_on_hopper", lambda t: True)


def _t(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype)


def _qkv(d=128, dtype=torch.bfloat16, h=8, hk_=2, sq=64, sk=64):
    return _t(2, sq, h, d, dtype=dtype), _t(2, sk, hk_, d, dtype=dtype), _t(2, sk, hk_, d, dtype=dtype)


def test_supports_covered_calls(on_hopper):
    for d in (64, 128, 256):
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
    # sliding windows (either side, causal or not) and softcap
    q, k, v = _qkv()
    for kw in (dict(causal=True, window=(16, 0)), dict(causal=False, window=(16, 4)),
               dict(causal=False, window=(-1, 4)), dict(causal=False, window=(7, -1)),
               dict(causal=True, softcap=30.0), dict(causal=False, window=(16, 16), softcap=50.0)):  # fmt: skip
        assert hk.supports(q, k, v, **kw), kw


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(dict(varlen=True), id="varlen"),
        pytest.param(dict(causal=True, window=(16, 4)), id="causal-right-window"),
        pytest.param(dict(softcap=-1.0), id="negative-softcap"),
        pytest.param(dict(alibi=torch.zeros(8)), id="alibi"),
        pytest.param(dict(dropout=0.1), id="dropout"),
    ],
)
def test_supports_rejects_features(on_hopper, change):
    q, k, v = _qkv()
    assert not hk.supports(q, k, v, **{"causal": False, **change})


def test_supports_window_zero_right_without_causal(on_hopper):
    # (-1, 0) without causal is a right window of 0 keys: the same mask, covered as a window
    q, k, v = _qkv()
    assert hk.supports(q, k, v, causal=False, window=(-1, 0))


@pytest.mark.parametrize("d", [32, 80, 96, 192, 512])
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


def test_supports_packed_calls(on_hopper):
    for d in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            q, k = _t(300, 8, d, dtype=dtype), _t(200, 2, d, dtype=dtype)
            assert hk.supports(q, k, k, causal=True, varlen=True)
            assert hk.supports(q, k, k, causal=False, varlen=True)
    q, k = _t(300, 8, 128), _t(200, 2, 128)
    # packed tensors need varlen, dense ones must not have it
    assert not hk.supports(q, k, k, causal=True)
    assert not hk.supports(*_qkv(), causal=True, varlen=True)
    for change in (dict(window=(16, 0)), dict(softcap=30.0)):
        assert hk.supports(q, k, k, causal=True, varlen=True, **change), change
    for change in (dict(alibi=torch.zeros(8)), dict(dropout=0.1)):
        assert not hk.supports(q, k, k, causal=True, varlen=True, **change), change
    assert not hk.supports(_t(300, 8, 80), _t(200, 2, 80), _t(200, 2, 80), causal=True, varlen=True)
    assert not hk.supports(q, _t(200, 3, 128), _t(200, 3, 128), causal=True, varlen=True)
    # a token stride that is not a 16-byte multiple
    odd = _t(300, 8 * 128 + 1)[:, :1024].view(300, 8, 128)
    assert not hk.supports(odd, k, k, causal=True, varlen=True)
    # views of a packed (T, 3, H, D) projection are addressable in place
    qkv = _t(300, 3, 8, 128)
    assert hk.supports(qkv[:, 0], qkv[:, 1], qkv[:, 2], causal=True, varlen=True)


def test_forward_path_packed(on_hopper, monkeypatch):
    from hf_flash.kernels import configs, flash_fwd

    monkeypatch.setattr(configs, "hopper_enabled", lambda device: True)
    q, k = _t(300, 8, 128), _t(200, 2, 128)
    opts = dict(varlen=True, causal=True, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, softmax_scale=None)  # fmt: skip
    # on by default; HF_FLASH_HOPPER_VARLEN=0 switches it off
    assert flash_fwd.forward_path(q, k, k, None, **opts) == "hopper"
    with configs.use_hopper_varlen(False):
        assert flash_fwd.forward_path(q, k, k, None, **opts) == "triton"
    monkeypatch.setattr(configs, "_HOPPER_VARLEN", True)
    # d64 packed calls run the Gluon forward too (VARLEN_DISPATCH_HEAD_DIMS)
    q64, k64 = _t(300, 8, 64), _t(200, 2, 64)
    assert hk.supports(q64, k64, k64, causal=True, varlen=True)
    assert flash_fwd.forward_path(q64, k64, k64, None, **opts) == "hopper"
    with monkeypatch.context() as m:
        m.setattr(hk, "VARLEN_DISPATCH_HEAD_DIMS", (128, 256))
        assert flash_fwd.forward_path(q64, k64, k64, None, **opts) == "triton"
    assert flash_fwd.forward_path(q, k, k, None, **{**opts, "window_left": 63}) == "hopper"
    assert flash_fwd.forward_path(q, k, k, None, **{**opts, "softcap": 30.0}) == "hopper"
    # soft-capped calls at d64: covered, but the Triton forward measured faster there
    assert hk.supports(q64, k64, k64, causal=True, varlen=True, softcap=30.0)
    assert flash_fwd.forward_path(q64, k64, k64, None, **{**opts, "varlen": True, "softcap": 30.0}) == "triton"
    q64d, k64d, _ = _qkv(64)
    dense64 = {**opts, "varlen": False}
    assert flash_fwd.forward_path(q64d, k64d, k64d, None, **dense64) == "hopper"
    assert flash_fwd.forward_path(q64d, k64d, k64d, None, **{**dense64, "softcap": 30.0}) == "triton"
    assert flash_fwd.forward_path(q64d, k64d, k64d, None, **{**dense64, "window_left": 63}) == "hopper"
    assert flash_fwd.forward_path(q, k, k, None, **{**opts, "alibi_slopes": torch.zeros(8)}) == "triton"
    assert flash_fwd.forward_path(q, k, k, None, **opts, sinks=torch.zeros(8)) == "triton"
    # d256 packed and soft-capped: the Gluon forward (2.3x the Triton varlen forward)
    q256, k256 = _t(300, 8, 256), _t(200, 2, 256)
    assert flash_fwd.forward_path(q256, k256, k256, None, **opts) == "hopper"
    assert flash_fwd.forward_path(q256, k256, k256, None, **{**opts, "softcap": 30.0}) == "hopper"
    monkeypatch.setattr(configs, "hopper_enabled", lambda device: False)
    assert flash_fwd.forward_path(q, k, k, None, **opts) == "triton"


def test_supports_needs_an_sm90_cuda_tensor():
    # no monkeypatch: CPU tensors are never covered
    assert not hk.supports(*_qkv(), causal=True)
