"""flash_attn_with_kvcache against kvcache_attention_ref: append, rotary, splits, paging, bad input.

Without a GPU the split-KV kernel runs through Triton's interpreter (16-key tiles), so the
shapes below are small but cross several tiles and splits. The GPU grid is at the end
(``-m gpu``).
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_flash import flash_attn_with_kvcache
from hf_flash.kernels import decode
from hf_flash.reference import (
    FWD_FACTOR,
    assert_close_to_ref,
    attention_ref,
    kvcache_attention_ref,
    max_abs_err,
    poisoned_like,
)


def _rotary(device, rows, rotary_dim, dtype=torch.float32):
    angle = torch.rand(rows, rotary_dim // 2, device=device) * 2 * math.pi
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _paged(device, k_cache, v_cache, page_size):
    """Scatter dense caches (B, S, Hk, D) into shuffled pages; returns (k_pages, v_pages,
    block_table) with two spare pages that no row uses."""
    batch, seqlen = k_cache.shape[:2]
    per_seq = seqlen // page_size
    num_pages = batch * per_seq + 2
    perm = torch.randperm(num_pages, device=device)[: batch * per_seq]
    table = perm.view(batch, per_seq).to(torch.int32)
    kp = torch.randn(num_pages, page_size, *k_cache.shape[2:], device=device, dtype=k_cache.dtype)
    vp = torch.randn_like(kp)
    kp[perm] = k_cache.reshape(-1, page_size, *k_cache.shape[2:])
    vp[perm] = v_cache.reshape(-1, page_size, *v_cache.shape[2:])
    return kp, vp, table


def _check(
    device, batch=2, seqlen_q=1, nheads=4, nheads_k=2, d=32, seqlen_cache=70, seqlen_new=1,
    lens=(40, 23), dtype=torch.float16, rotary_dim=0, interleaved=False, paged=0,
    batch_idx=False, leftpad=None, num_splits=0, int_seqlens=False, per_token_rotary=0, **opts,
):  # fmt: skip
    q = torch.randn(batch, seqlen_q, nheads, d, device=device, dtype=dtype)
    batch_cache = batch + 2 if batch_idx else batch
    k_cache = torch.randn(batch_cache, seqlen_cache, nheads_k, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k = v = None
    if seqlen_new:
        k = torch.randn(batch, seqlen_new, nheads_k, d, device=device, dtype=dtype)
        v = torch.randn_like(k)
    kw = dict(opts)
    if lens is not None:
        kw["cache_seqlens"] = (
            lens[0] if int_seqlens else torch.tensor(lens, dtype=torch.int32, device=device)
        )
    if rotary_dim:
        kw["rotary_cos"], kw["rotary_sin"] = _rotary(device, seqlen_cache, rotary_dim)
        kw["rotary_interleaved"] = interleaved
    if per_token_rotary:
        # (rows, seqlen_new, rotary_dim / 2) views with a padded last axis, as transformers'
        # cos[..., :half] slices are
        rows = batch if per_token_rotary == "batch" else 1
        cos, sin = _rotary(device, rows * seqlen_new, 2 * rotary_dim, dtype)
        kw["rotary_cos"] = cos.view(rows, seqlen_new, rotary_dim)[..., : rotary_dim // 2]
        kw["rotary_sin"] = sin.view(rows, seqlen_new, rotary_dim)[..., : rotary_dim // 2]
        kw["rotary_interleaved"] = interleaved
    if batch_idx:
        kw["cache_batch_idx"] = torch.randperm(batch_cache, device=device)[:batch].to(torch.int32)
    if leftpad is not None:
        kw["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device=device)
    if paged:
        k_cache, v_cache, kw["block_table"] = _paged(device, k_cache, v_cache, paged)

    ref, k_ref, v_ref, ref_lse = kvcache_attention_ref(
        q, k_cache, v_cache, k, v, return_lse=True, **kw
    )
    ref_lp, _, _ = kvcache_attention_ref(q, k_cache, v_cache, k, v, upcast=False, **kw)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, k, v, num_splits=num_splits, return_softmax_lse=True, **kw
    )
    assert out.shape == q.shape and out.dtype == dtype
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, dtype)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "lse must be +inf exactly for rows with no key"
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-3 if dtype != torch.float32 else 1e-5)
    # the append: values bit-exact; rotated keys may differ from the reference's by one rounding
    # of the cache dtype (the kernel may fuse the rotation's multiply-adds)
    assert torch.equal(vc, v_ref), "v_cache after the append differs from the reference"
    k_diff = (kc.float() - k_ref.float()).abs()
    k_tol = 0.0
    if rotary_dim or per_token_rotary:
        k_tol = torch.finfo(dtype).eps * k_ref.float().abs() + 1e-6
    assert (k_diff <= k_tol).all(), f"k_cache after the append: max diff {k_diff.max():.3e}"
    return out


CASES = [
    pytest.param({}, id="decode-gqa"),
    pytest.param({"causal": True, "rotary_dim": 32}, id="decode-rotary-half"),
    pytest.param({"causal": True, "rotary_dim": 16, "interleaved": True}, id="rotary-interleaved-partial"),
    pytest.param({"rotary_dim": 32, "seqlen_q": 3, "seqlen_new": 3}, id="rotary-noncausal-q-same-pos"),
    pytest.param({"seqlen_new": 0, "lens": (70, 5)}, id="no-append"),
    pytest.param({"seqlen_new": 0, "lens": None}, id="whole-cache"),
    pytest.param({"int_seqlens": True, "lens": (33,), "causal": True}, id="int-seqlens"),
    pytest.param({"seqlen_q": 5, "seqlen_new": 5, "causal": True, "lens": (30, 64)}, id="chunk-causal"),
    pytest.param({"seqlen_q": 2, "seqlen_new": 6, "causal": True, "window_size": (3, 0)}, id="window-unseen-new"),
    pytest.param({"seqlen_q": 3, "seqlen_new": 2, "window_size": (20, 4), "lens": (60, 17)}, id="window-both"),
    pytest.param({"leftpad": (12, 0), "causal": True, "rotary_dim": 32, "lens": (41, 23)}, id="leftpad"),
    pytest.param({"batch_idx": True, "causal": True}, id="cache-batch-idx"),
    pytest.param({"paged": 16, "seqlen_cache": 64, "causal": True, "rotary_dim": 32}, id="paged16"),
    pytest.param({"paged": 32, "seqlen_cache": 96, "seqlen_q": 2, "seqlen_new": 2, "causal": True,
                  "leftpad": (5, 0), "lens": (50, 31)}, id="paged32-leftpad"),  # fmt: skip
    pytest.param({"leftpad": (7, 2), "seqlen_q": 2, "seqlen_new": 2, "causal": True,
                  "rotary_dim": 32, "per_token_rotary": "batch"}, id="per-token-rotary"),
    pytest.param({"rotary_dim": 16, "per_token_rotary": "shared", "interleaved": True},
                 id="per-token-rotary-shared-partial"),
    pytest.param({"softcap": 2.0, "causal": True}, id="softcap"),
    pytest.param({"alibi_slopes": "per-batch", "causal": True, "seqlen_q": 2, "seqlen_new": 2}, id="alibi"),
    pytest.param({"nheads_k": 1, "nheads": 8, "seqlen_q": 9, "seqlen_new": 9, "causal": True,
                  "lens": (40, 3)}, id="mqa-two-row-tiles"),  # 72 rows: two M tiles of 64
    pytest.param({"nheads_k": 3, "nheads": 3, "d": 80, "rotary_dim": 64}, id="mha-d80"),
    pytest.param({"d": 59, "nheads": 2, "nheads_k": 1, "lens": (9, 1)}, id="d59-short"),
    pytest.param({"num_splits": 1, "causal": True, "lens": (68, 3)}, id="one-split"),
    pytest.param({"num_splits": 7, "causal": True, "lens": (68, 0), "rotary_dim": 32}, id="many-splits-empty-cache"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("opts", CASES)
def test_matches_reference(opts, dtype, device):
    torch.manual_seed(len(str(opts)))
    opts = dict(opts)
    if opts.get("alibi_slopes") == "per-batch":
        opts["alibi_slopes"] = torch.rand(2, opts.get("nheads", 4), device=device)
    _check(device, dtype=dtype, **opts)


def test_bf16_load_store_path(device):
    # bf16 operands are multiplied in fp32 under the interpreter; loads, the append and stores
    # are still bf16. No rotary here: the interpreter truncates fp32 -> bf16 casts instead of
    # rounding them. The GPU tests cover bf16 tensor cores and bf16 rotary.
    torch.manual_seed(11)
    _check(device, dtype=torch.bfloat16, causal=True, seqlen_q=2, seqlen_new=2, num_splits=3)


def test_queries_without_keys_are_zero(device):
    """seqlen_q > visible keys (causal): leading queries see nothing -> 0 and +inf."""
    torch.manual_seed(12)
    out = _check(device, seqlen_q=6, seqlen_new=0, lens=(3, 0), causal=True, num_splits=2)
    assert (out[0, :3] == 0).all() and (out[1] == 0).all()


def test_every_output_element_written(device):
    torch.manual_seed(13)
    dtype = torch.float16
    q = torch.randn(2, 3, 4, 40, device=device, dtype=dtype)
    kc = torch.randn(2, 50, 2, 40, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    lens = torch.tensor([2, 45], dtype=torch.int32, device=device)
    for splits in (1, 4):
        out = poisoned_like(q)
        lse = torch.full((2, 4, 3), float("nan"), device=device)
        decode.flash_decode(
            q, kc, vc, None, None, out, lse, cache_seqlens=lens, cache_batch_idx=None,
            cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
            rotary_interleaved=False, rotary_q_per_row=True, softmax_scale=0.2,
            window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None, num_splits=splits,
        )  # fmt: skip
        assert not out.isnan().any() and not lse.isnan().any(), f"unwritten with {splits} splits"
        assert (out[0, 0] == 0).all() and torch.isinf(lse[0, :, 0]).all()


def test_decode_steps_equal_full_attention(device):
    """Prefill a cache, then append token by token: every step equals causal attention over
    the whole sequence so far (the cache written by step t is what step t + 1 reads)."""
    torch.manual_seed(14)
    from hf_flash.reference import attention_ref

    b, h, hk, d, n, steps = 1, 4, 2, 32, 20, 4
    dtype = torch.float32
    q = torch.randn(b, n + steps, h, d, device=device, dtype=dtype)
    k = torch.randn(b, n + steps, hk, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    kc = torch.zeros(b, 40, hk, d, device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc[:, :n], vc[:, :n] = k[:, :n], v[:, :n]
    lens = torch.full((b,), n, dtype=torch.int32, device=device)
    full = attention_ref(q, k, v, causal=True)
    for t in range(n, n + steps):
        out = flash_attn_with_kvcache(
            q[:, t : t + 1], kc, vc, k[:, t : t + 1], v[:, t : t + 1], cache_seqlens=lens,
            causal=True, num_splits=2,
        )  # fmt: skip
        lens += 1
        assert max_abs_err(out, full[:, t : t + 1]) < 1e-5
    assert torch.equal(kc[:, : n + steps], k) and torch.equal(vc[:, : n + steps], v)


def test_transposed_cache_buffers_are_updated_in_place(device):
    """transformers' caches are (B, Hk, S, D); their transposed views go in without a copy."""
    torch.manual_seed(15)
    buf_k = torch.randn(2, 2, 48, 32, device=device, dtype=torch.float16)
    buf_v = torch.randn_like(buf_k)
    kc, vc = buf_k.transpose(1, 2), buf_v.transpose(1, 2)
    q = torch.randn(2, 1, 4, 32, device=device, dtype=torch.float16)
    k = torch.randn(2, 1, 2, 32, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    lens = torch.tensor([10, 30], dtype=torch.int32, device=device)
    ref, k_ref, v_ref = kvcache_attention_ref(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    assert torch.equal(buf_k.transpose(1, 2), k_ref) and torch.equal(buf_v.transpose(1, 2), v_ref)
    assert max_abs_err(out, ref) < 2e-3


def test_cache_capacity_is_never_exceeded(device):
    """Past the cache's rows (possible only when validation is skipped, e.g. during CUDA-graph
    capture) the kernel drops the append and reads nothing: no out-of-bounds memory access."""
    torch.manual_seed(17)
    backing = torch.randn(2, 40, 2, 16, device=device)
    kc, vc = backing[:, :32].clone(), backing[:, :32].clone()
    guard_k = backing[:, 32:].clone()
    q = torch.randn(2, 1, 2, 16, device=device)
    k = torch.randn(2, 2, 2, 16, device=device)
    out, lse = torch.empty_like(q), torch.empty(2, 2, 1, device=device)
    lens = torch.tensor([31, 5], dtype=torch.int32, device=device)  # row 0: 31 + 2 > 32
    kc_big = backing.clone()
    kc_view = kc_big[:, :32]
    decode.flash_decode(
        q, kc_view, vc, k, k, out, lse, cache_seqlens=lens, cache_batch_idx=None,
        cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
        rotary_interleaved=False, rotary_q_per_row=True, softmax_scale=0.25,
        window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None, num_splits=2,
    )  # fmt: skip
    assert torch.equal(kc_big[:, 32:], guard_k), "wrote past the cache"
    assert torch.equal(kc_view[0, 31], k[0, 0]) and torch.equal(kc_view[1, 5:7], k[1])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("opts", [
    pytest.param({"causal": True}, id="causal"),
    pytest.param({"causal": True, "window_size": (5, 5), "softcap": 3.0}, id="window-softcap"),
    pytest.param({"causal": False}, id="noncausal"),
])  # fmt: skip
def test_attend_kv_over_key_blocks(opts, device):
    """attend_kv (the integration's DynamicCache decode path): row b sees keys
    [start_b, end_b) of non-contiguous (B, Hk, S, D)-transposed k/v, queries aligned at end_b."""
    from hf_flash.decode import attend_kv
    from hf_flash.reference import attention_ref

    torch.manual_seed(18)
    dtype = torch.float16
    q = torch.randn(3, 2, 4, 32, device=device, dtype=dtype)
    kb = torch.randn(3, 2, 45, 32, device=device, dtype=dtype)
    vb = torch.randn_like(kb)
    k, v = kb.transpose(1, 2), vb.transpose(1, 2)
    start = torch.tensor([0, 7, 20], dtype=torch.int32, device=device)
    end = torch.tensor([45, 45, 33], dtype=torch.int32, device=device)
    out = attend_kv(q, k, v, key_start=start, key_end=end, **opts)
    for b, (s0, e0) in enumerate(zip(start.tolist(), end.tolist())):
        args = (q[b : b + 1], k[b : b + 1, s0:e0], v[b : b + 1, s0:e0])
        ref = attention_ref(*args, **opts)
        lp = attention_ref(*args, upcast=False, **opts)
        assert_close_to_ref(f"row {b}", out[b : b + 1], ref, lp, FWD_FACTOR, dtype)


def _attend_inputs(device, seqlen=45, dtype=torch.float16):
    torch.manual_seed(19)
    q = torch.randn(2, 1, 4, 32, device=device, dtype=dtype)
    kb = torch.randn(2, 2, seqlen, 32, device=device, dtype=dtype)
    return q, kb.transpose(1, 2), torch.randn_like(kb).transpose(1, 2)


def test_attend_kv_default_key_end_follows_seqlen_k(device):
    """Without key_end every key is attended. The (batch,) tensor of seqlen_k is reused while
    batch, seqlen_k and device repeat (the layers of one decode step); a k of another length,
    as the next step's, must not get the old one."""
    from hf_flash.decode import attend_kv
    from hf_flash.reference import attention_ref

    q, k, v = _attend_inputs(device, 60)
    for n in (40, 40, 25, 57, 40):
        out = attend_kv(q, k[:, :n], v[:, :n], causal=True)
        ref = attention_ref(q, k[:, :n], v[:, :n], causal=True)
        lp = attention_ref(q, k[:, :n], v[:, :n], causal=True, upcast=False)
        assert_close_to_ref(f"seqlen_k={n}", out, ref, lp, FWD_FACTOR, q.dtype)


def test_attend_kv_remembered_checks_still_reject_bad_inputs(monkeypatch, device):
    """attend_kv checks a combination of shapes, dtypes, devices and options once, then only
    looks it up. Inputs that differ from a remembered combination must still be refused."""
    from hf_flash.decode import attend_kv

    q, k, v = _attend_inputs(device)
    end = torch.full((2,), 45, dtype=torch.int32, device=device)
    for _ in range(2):
        attend_kv(q, k, v, key_end=end)  # remembered
    with pytest.raises(ValueError, match="one shape"):
        attend_kv(q, k, v[:, :-1], key_end=end)  # seqlen_k is not part of the remembered key
    with pytest.raises(ValueError, match="int32"):
        attend_kv(q, k, v, key_end=end.long())
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        attend_kv(q, k, v, key_end=end[:1])
    with pytest.raises(TypeError, match="one dtype"):
        attend_kv(q, k.float(), v, key_end=end)
    with pytest.raises(ValueError, match="window_size"):
        attend_kv(q, k, v, key_end=end, window_size=(3, 0, 1))
    with pytest.raises(ValueError, match="multiple"):
        attend_kv(q[:, :, :3], k, v, key_end=end)
    if device == "cpu":  # CPU tensors are refused once the interpreter is off
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            attend_kv(q, k, v, key_end=end)


def test_one_split_launches_no_combine(monkeypatch, device):
    """num_splits=1: the decode kernel writes the output itself; no combine launch. Several
    splits: one combine launch. Both equal the reference (the "one-split" case above too)."""
    launches = []
    real = decode._COMBINE.kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(decode._COMBINE, "kernel", Spy())
    _check(device, num_splits=1, causal=True, lens=(68, 3), seqlen_cache=80)
    assert launches == []
    _check(device, num_splits=3, causal=True, lens=(68, 3), seqlen_cache=80)
    assert len(launches) == 1


def test_cached_launch_plan_follows_config_override(monkeypatch, device):
    """Launch parameters are derived once per combination of shapes and flags; a
    ``configs.override`` (the benchmark sweep) must still take effect, and a flag that
    changes (softcap here) must give another plan."""
    from hf_flash.kernels import configs

    seen = []
    real = decode._DECODE.kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs)
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(decode._DECODE, "kernel", Spy())
    _check(device, causal=True)
    with configs.override(decode={"BLOCK_N": 32}):
        _check(device, causal=True)
    _check(device, causal=True, softcap=2.0)
    default = decode.decode_config(32, torch.float16, torch.device(device))["BLOCK_N"]
    assert default != 32
    assert [kw["BLOCK_N"] for kw in seen] == [default, 32, default]
    assert [kw["HAS_SOFTCAP"] for kw in seen] == [False, False, True]


def test_host_integer_helpers_match_triton():
    import triton

    from hf_flash.kernels import configs

    for n in range(0, 300):
        assert configs.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 16, 64, 97):
            assert configs.cdiv(n, d) == triton.cdiv(n, d), (n, d)


@pytest.mark.parametrize("opts", [
    pytest.param({"causal": True}, id="causal"),
    pytest.param({"causal": True, "window_size": (10, 0), "softcap": 3.0}, id="window-softcap"),
])  # fmt: skip
def test_append_attend_paged_skips_padding_rows(opts, device):
    """append_attend_paged (continuous batching's decode step): real rows append and attend as
    flash_attn_with_kvcache does; a padding row (seqlens_k 0, page-table row -1) writes and
    reads nothing and outputs 0."""
    from hf_flash.decode import append_attend_paged

    torch.manual_seed(19)
    dtype = torch.float16
    dense = torch.randn(3, 48, 2, 32, device=device, dtype=dtype)
    k_pages, v_pages, table = _paged(device, dense, torch.randn_like(dense), 16)
    table[1] = -1  # row 1 pads the batch
    # keys per row after the append: row 2's new key fills its last page exactly
    seqlens_k = torch.tensor([20, 0, 48], dtype=torch.int32, device=device)
    q = torch.randn(3, 1, 4, 32, device=device, dtype=dtype)
    k = torch.randn(3, 1, 2, 32, device=device, dtype=dtype)
    v = torch.randn_like(k)
    kc, vc = k_pages.clone(), v_pages.clone()
    out = append_attend_paged(q, kc, vc, k, v, table, seqlens_k, **opts)
    assert torch.equal(out[1], torch.zeros_like(out[1])), "the padding row must output 0"

    real = torch.tensor([0, 2], device=device)
    kw = dict(cache_seqlens=seqlens_k[real] - 1, block_table=table[real], **opts)
    args = (q[real], k_pages, v_pages, k[real], v[real])
    ref, k_ref, v_ref = kvcache_attention_ref(*args, **kw)
    lp, _, _ = kvcache_attention_ref(*args, upcast=False, **kw)
    assert_close_to_ref("real rows", out[real], ref, lp, FWD_FACTOR, dtype)
    # the pages after the call are exactly the real rows' appends: the padding row wrote nothing
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)


def test_split_heuristic():
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    slots = decode.PROGRAMS_PER_SM * decode.sm_count(dev)
    # one sequence, 8 K/V heads, long cache: splits fill most of one wave of programs
    s = decode.choose_num_splits(8, 1 << 20, 64, dev)
    assert 0.9 * slots <= 8 * s <= slots or s == decode.MAX_SPLITS
    assert decode.choose_num_splits(8, 64, 64, dev) == 1  # one tile: nothing to split
    assert decode.choose_num_splits(8, 4 * 64, 64, dev) <= 2  # >= 2 tiles per split
    assert decode.choose_num_splits(slots, 1 << 20, 64, dev) == 1  # grid already full
    # wave quantisation: never pick a split count whose last wave is mostly empty
    for programs in (3, 5, slots // 2 + 1):
        s = decode.choose_num_splits(programs, 1 << 20, 64, dev)
        total = programs * s
        assert total / (-(-total // slots) * slots) >= 0.5


def test_compile_fullgraph_mutates_cache(device):
    torch.manual_seed(16)
    kc = torch.zeros(1, 32, 1, 16, device=device)
    vc = torch.zeros_like(kc)
    lens = torch.tensor([4], dtype=torch.int32, device=device)

    def step(q, k, v, kc, vc, lens):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    q = torch.randn(1, 1, 2, 16, device=device)
    k = torch.randn(1, 1, 1, 16, device=device)
    v = torch.randn(1, 1, 1, 16, device=device)
    out = compiled(q, k, v, kc, vc, lens)
    assert torch.equal(kc[0, 4], k[0, 0]) and torch.equal(vc[0, 4], v[0, 0])
    ref, _, _ = kvcache_attention_ref(
        q, torch.zeros_like(kc), torch.zeros_like(vc), k, v, cache_seqlens=lens, causal=True
    )
    assert max_abs_err(out, 2 * ref) < 1e-5


def _args(device, **over):
    q = torch.randn(2, 1, 4, 32, device=device, dtype=torch.float16)
    kc = torch.randn(2, 64, 2, 32, device=device, dtype=torch.float16)
    a = dict(
        q=q, k_cache=kc, v_cache=kc.clone(), k=torch.randn(2, 1, 2, 32, device=device, dtype=q.dtype),
        v=torch.randn(2, 1, 2, 32, device=device, dtype=q.dtype),
        cache_seqlens=torch.tensor([3, 5], dtype=torch.int32, device=device),
    )  # fmt: skip
    a.update(over)
    return a


def _pages(device, n=4, size=16):
    return torch.randn(n, size, 2, 32, device=device, dtype=torch.float16)


BAD = [
    pytest.param(
        lambda dev: _args(dev, cache_seqlens=torch.tensor([3, 64], dtype=torch.int32, device=dev)),
        ValueError, "does not fit", id="cache-too-short",
    ),
    pytest.param(
        lambda dev: _args(dev, cache_seqlens=64), ValueError, "does not fit", id="int-too-long"
    ),
    pytest.param(
        lambda dev: _args(dev, cache_seqlens=torch.tensor([3, 5], device=dev)), ValueError, "int32",
        id="seqlens-int64",
    ),
    pytest.param(
        lambda dev: _args(dev, cache_seqlens=None), ValueError, "cache_seqlens", id="append-no-lens"
    ),
    pytest.param(lambda dev: _args(dev, v=None), ValueError, "both k and v", id="k-without-v"),
    pytest.param(
        lambda dev: _args(dev, k=torch.randn(2, 1, 2, 32, device=dev)), TypeError, "dtype",
        id="k-dtype",
    ),
    pytest.param(
        lambda dev: _args(dev, v_cache=torch.randn(2, 64, 2, 32, device=dev)), TypeError,
        "one dtype", id="cache-dtype",
    ),
    pytest.param(
        lambda dev: _args(dev, k_cache=torch.randn(2, 64, 3, 32, device=dev, dtype=torch.float16),
                               v_cache=torch.randn(2, 64, 3, 32, device=dev, dtype=torch.float16)),
        ValueError, "multiple", id="heads",
    ),  # fmt: skip
    pytest.param(
        lambda dev: _args(dev, k_cache=torch.randn(3, 64, 2, 32, device=dev, dtype=torch.float16),
                               v_cache=torch.randn(3, 64, 2, 32, device=dev, dtype=torch.float16)),
        ValueError, "cache_batch_idx", id="cache-batch",
    ),  # fmt: skip
    pytest.param(
        lambda dev: _args(dev, cache_leftpad=torch.tensor([4, 0], dtype=torch.int32, device=dev)),
        ValueError, "cache_leftpad", id="leftpad-past-seqlens",
    ),
    pytest.param(
        lambda dev: _args(dev, cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32, device=dev)),
        ValueError, "cache_batch_idx", id="batch-idx-range",
    ),
    pytest.param(
        lambda dev: _args(dev, k_cache=_pages(dev), v_cache=_pages(dev),
                               block_table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32,
                                                        device=dev),
                               cache_seqlens=torch.tensor([3, 20], dtype=torch.int32, device=dev)),
        ValueError, "block_table", id="page-out-of-range",
    ),  # fmt: skip
    pytest.param(
        lambda dev: _args(dev, k_cache=_pages(dev, size=24), v_cache=_pages(dev, size=24),
                               block_table=torch.zeros(2, 2, dtype=torch.int32, device=dev)),
        ValueError, "multiple of 16", id="page-size",
    ),  # fmt: skip
    pytest.param(
        lambda dev: _args(dev, rotary_cos=torch.ones(64, 16, device=dev), rotary_sin=None),
        ValueError, "rotary_sin", id="cos-without-sin",
    ),
    pytest.param(
        lambda dev: _args(dev, rotary_cos=torch.ones(32, 16, device=dev),
                               rotary_sin=torch.ones(32, 16, device=dev)),
        ValueError, "cover every cache row", id="rotary-too-short",
    ),  # fmt: skip
    pytest.param(
        lambda dev: _args(dev, rotary_cos=torch.ones(64, 20, device=dev),
                               rotary_sin=torch.ones(64, 20, device=dev)),
        ValueError, "rotary_dim", id="rotary-too-wide",
    ),  # fmt: skip
    pytest.param(
        lambda dev: _args(dev, k=None, v=None, rotary_cos=torch.ones(64, 16, device=dev),
                               rotary_sin=torch.ones(64, 16, device=dev)),
        ValueError, "new k only", id="rotary-without-k",
    ),  # fmt: skip
    pytest.param(lambda dev: _args(dev, num_splits=-1), ValueError, "num_splits", id="num-splits"),
    pytest.param(
        lambda dev: _args(dev, rotary_cos=torch.ones(2, 3, 16, device=dev),
                               rotary_sin=torch.ones(2, 3, 16, device=dev)),
        ValueError, "per-token", id="per-token-rotary-shape",
    ),  # fmt: skip
    pytest.param(
        lambda dev: _args(dev, window_size=(2.5, 0)), ValueError, "window_size", id="window"
    ),
    pytest.param(
        lambda dev: _args(dev, q=torch.randn(2, 4, 32, device=dev, dtype=torch.float16)),
        ValueError, "4-D", id="q-3d",
    ),
]


@pytest.mark.parametrize("make,exc,match", BAD)
def test_bad_input_raises_before_launch(make, exc, match, device):
    args = make(device)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before[0]), "the cache changed although the call failed"


# --------------------------------------------------------------------------------------------
# GPU: bf16 tensor cores, long caches, every split count, CUDA-graph capture
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "opts",
    [
        pytest.param({"batch": 1, "seqlen_cache": 8192, "lens": (8000,), "nheads": 32,
                      "nheads_k": 8, "d": 128, "causal": True, "rotary_dim": 128}, id="b1-8k-llama"),
        pytest.param({"batch": 3, "seqlen_cache": 2048, "lens": (2000, 1, 777), "nheads": 32,
                      "nheads_k": 8, "d": 128, "causal": True, "paged": 256}, id="paged256"),
        pytest.param({"batch": 2, "seqlen_cache": 1024, "lens": (1000, 511), "seqlen_q": 4,
                      "seqlen_new": 4, "causal": True, "window_size": (300, 0), "d": 64,
                      "leftpad": (100, 3)}, id="spec-window-leftpad"),
        pytest.param({"batch": 2, "seqlen_cache": 1030, "lens": (1000, 0), "d": 256,
                      "nheads": 8, "nheads_k": 8, "softcap": 30.0, "causal": True}, id="d256"),
        pytest.param({"batch": 2, "lens": (1000, 77), "seqlen_cache": 1030, "d": 96,
                      "rotary_dim": 64, "interleaved": True, "num_splits": 17}, id="d96-17splits"),
    ],
)  # fmt: skip
def test_gpu_matches_reference(opts, dtype, device):
    torch.manual_seed(21)
    _check(device, dtype=dtype, **opts)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    torch.manual_seed(22)
    dtype = torch.bfloat16
    kc = torch.randn(2, 4096, 8, 128, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=dtype)
    k = torch.randn(2, 1, 8, 128, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    lens = torch.tensor([100, 3000], dtype=torch.int32, device="cuda")
    k0, v0 = kc.clone(), vc.clone()
    ref, _, _ = kvcache_attention_ref(q, k0, v0, k, v, cache_seqlens=lens, causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up compiles the kernels outside the capture
        flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=lens, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    kc.copy_(k0)
    vc.copy_(v0)
    graph.replay()
    torch.cuda.synchronize()
    lp, _, _ = kvcache_attention_ref(q, k0, v0, k, v, cache_seqlens=lens, causal=True, upcast=False)
    assert_close_to_ref("graph out", out, ref, lp, FWD_FACTOR, dtype)
    lens.add_(1)  # the graph reads the new lengths from the device
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kc[1, 3001], k[1, 0])
    # the second replay also attends over the token the first replay appended
    k1, v1 = k0.clone(), v0.clone()
    for b, pos in enumerate((100, 3000)):
        k1[b, pos], v1[b, pos] = k[b, 0], v[b, 0]
    ref2, _, _ = kvcache_attention_ref(q, k1, v1, k, v, cache_seqlens=lens, causal=True)
    lp2, _, _ = kvcache_attention_ref(q, k1, v1, k, v, cache_seqlens=lens, causal=True, upcast=False)
    assert_close_to_ref("graph out, second replay", out, ref2, lp2, FWD_FACTOR, dtype)


def test_hopper_plan_uses_three_stages_only_for_one_wave(monkeypatch):
    """bf16, head dim 128 (the H100 config): 4 pipeline stages, which keep one program per SM,
    unless the whole grid fits in one wave, where 3 were faster; a sweep's forced stage count
    applies to both."""
    from hf_flash.kernels import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    flags = (False,) * 4 + (False, 0, False, False, False, False, True, False, False)
    monkeypatch.setattr(decode, "_PLANS", {})
    plan = decode._Plan(128, torch.bfloat16, torch.device("cpu"), 4, flags)
    stages = {key: meta.kwargs["num_stages"] for key, meta in plan.meta.items()}
    assert stages == {(False, False): 4, (True, False): 4, (False, True): 3, (True, True): 3}
    assert all(m.kwargs["NUM_STAGES"] == m.kwargs["num_stages"] for m in plan.meta.values())
    with configs.override(decode={"num_stages": 2}):
        forced = decode._Plan(128, torch.bfloat16, torch.device("cpu"), 4, flags)
    assert {m.kwargs["num_stages"] for m in forced.meta.values()} == {2}


@pytest.mark.parametrize("num_splits", [
    1, 3, pytest.param(0, marks=pytest.mark.gpu),
], ids=["one-split", "three-splits", "chosen-splits"])  # fmt: skip
def test_learnable_sink_in_decode(num_splits, device):
    """flash_attn_with_kvcache and attend_kv with learnable sinks: appended tokens, causal,
    GQA, a row whose queries see no key (left padding past its keys) against the oracle's extra
    softmax column, out and lse, with the error rule; one split or several (combine)."""
    from hf_flash.decode import attend_kv

    torch.manual_seed(0)
    b, cache, h, hk, d, sq = 2, 40, 4, 2, 32, 3
    dtype = torch.float16
    q = torch.randn(b, sq, h, d, device=device, dtype=dtype)
    k_cache = torch.randn(b, cache, hk, d, device=device, dtype=dtype)
    v_cache = torch.randn(b, cache, hk, d, device=device, dtype=dtype)
    k_new = torch.randn(b, sq, hk, d, device=device, dtype=dtype)
    v_new = torch.randn(b, sq, hk, d, device=device, dtype=dtype)
    sinks = torch.randn(h, device=device) * 2
    lens = torch.tensor([20, 33], device=device, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True,
        num_splits=num_splits, return_softmax_lse=True, learnable_sink=sinks,
    )  # fmt: skip
    for row, n in enumerate(lens.tolist()):
        keys, vals = k_cache[row : row + 1, : n + sq], v_cache[row : row + 1, : n + sq]
        ref, ref_lse = attention_ref(q[row : row + 1], keys, vals, causal=True, sinks=sinks,
                                     return_lse=True)  # fmt: skip
        ref_lp = attention_ref(q[row : row + 1], keys, vals, causal=True, sinks=sinks, upcast=False)
        assert_close_to_ref(f"out row {row}", out[row : row + 1], ref, ref_lp, FWD_FACTOR, dtype)
        torch.testing.assert_close(lse[row : row + 1], ref_lse, rtol=0, atol=1e-3)
        got = attend_kv(q[row : row + 1], keys, vals, causal=True, learnable_sink=sinks)
        assert_close_to_ref(f"attend_kv row {row}", got, ref, ref_lp, FWD_FACTOR, dtype)

    # a query that sees no key puts all its weight on the sink: output 0, lse = the sink
    start = torch.tensor([30], device=device, dtype=torch.int32)
    end = torch.tensor([30], device=device, dtype=torch.int32)
    from hf_flash.decode import decode_attention

    o, l = decode_attention(q[:1, :1], k_cache[:1], v_cache[:1], key_end=end, key_start=start,
                            softmax_scale=d**-0.5, causal=True, sinks=sinks)  # fmt: skip
    assert torch.equal(o, torch.zeros_like(o))
    torch.testing.assert_close(l[0, :, 0], sinks, rtol=0, atol=0)
    with pytest.raises(ValueError, match="learnable_sink has shape"):
        flash_attn_with_kvcache(q, k_cache, v_cache, learnable_sink=sinks[:2])
