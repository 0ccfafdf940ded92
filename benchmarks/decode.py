"""Decode attention (one query token per sequence): microseconds and GB/s of KV read.

Run on a GPU from the repository root::

    PYTHONPATH=. python benchmarks/decode.py --out OUTDIR [--quick] [--eager]
    PYTHONPATH=. python benchmarks/decode.py --sweep --quick --out OUTDIR   # tune the kernel

Shape: bf16, Hq=32, Hkv=8, head_dim 128, B in {1, 16, 64}, context L in {4K, 32K, 128K}
(``--quick``: B in {1, 16}, L in {4K, 32K}). One KV buffer per point, in transformers' cache
layout (B, Hkv, L, D); every provider reads the same memory:

  hf_flash         ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=L)`` on the
                   transposed view (B, L, Hkv, D) of the buffer (no copy), causal.
  hf_flash_append  the same call as a generate step does it: appends one new token at row
                   L - 1 with rotary on q and k (Llama "rotate half"), then attends over L.
  sdpa_gqa         ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)``, no mask.
  hf_sdpa          transformers' own ``sdpa_attention_forward`` of the installed release with
                   the 4-D boolean padding mask a static cache produces (what "sdpa" runs during
                   generate with padding or a static cache; older releases repeat K/V).
  repeat_kv_sdpa   ``repeat_kv`` then masked SDPA, spelled out (what transformers' sdpa path
                   does under torch.compile, i.e. with the static cache).
  read_only        not attention, a reference: one Triton launch that reads the K and V
                   buffers once (16 KB per program, summed, one float written per program),
                   i.e. what merely streaming the cache costs on this GPU under the same timing.

GB/s = KV bytes read / time, KV bytes = 2 * B * L * Hkv * D * 2 (K and V, bf16), the same
count for every provider (the repeat_kv path really moves ~4x more). Timing: every provider is
captured in a CUDA graph and the graph replay is timed (``harness.bench_ms``: CUDA events,
L2 flushed, median / p20 / p80), so Python launch overhead, which the generate path also
removes with CUDA graphs, does not hide the kernel time; ``--eager`` times plain calls instead.
Each point is timed twice, with the two L2 flushes of ``harness.bench_ms``: ``us``/``GB_s``
after Triton's zeroing flush (the peers' numbers in the issue were taken this way; the call also
pays up to ~10 us of write-back of the dirty L2 lines the flush leaves) and
``us_read_flush``/``GB_s_read_flush`` after a reading flush (clean L2, as after the weight GEMVs
of a decode step).
Points whose buffers do not fit in free GPU memory are recorded as skipped. Rows also record
``max_abs_diff_vs_sdpa`` (output against ``sdpa_gqa`` on the untouched cache, a spot check) and
hf_flash's ``num_splits``; ``hf_flash_append`` writes row L - 1 of the cache, so it runs last.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import base_parser, bench_ms, print_table, write_results  # noqa: E402

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
# hf_flash_append writes the cache (row L - 1), so it runs last
PROVIDERS = ("hf_flash", "sdpa_gqa", "hf_sdpa", "repeat_kv_sdpa", "read_only", "hf_flash_append")


def grid(quick: bool, batches=None, contexts=None):
    batches = batches or ((1, 16) if quick else (1, 16, 64))
    contexts = contexts or ((4096, 32768) if quick else (4096, 32768, 131072))
    return [(b, L) for b in batches for L in contexts]


def kv_bytes(batch: int, ctx: int) -> int:
    return 2 * batch * ctx * HKV * D * torch.finfo(DTYPE).bits // 8


def _rope(ctx: int, device):
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
    ang = torch.outer(torch.arange(ctx, device=device, dtype=torch.float32), inv)
    return ang.cos().to(DTYPE), ang.sin().to(DTYPE)


def build(provider: str, batch: int, ctx: int, kb: torch.Tensor, vb: torch.Tensor, q: torch.Tensor):
    """A zero-argument callable for one provider; kb/vb are (B, Hkv, L, D), q (B, 1, Hq, D)."""
    from hf_flash import flash_attn_with_kvcache

    dev = q.device
    if provider == "hf_flash":
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        kc, vc = kb.transpose(1, 2), vb.transpose(1, 2)
        return lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
    if provider == "hf_flash_append":
        lens = torch.full((batch,), ctx - 1, dtype=torch.int32, device=dev)
        kc, vc = kb.transpose(1, 2), vb.transpose(1, 2)
        k_new = torch.randn(batch, 1, HKV, D, device=dev, dtype=DTYPE)
        v_new = torch.randn_like(k_new)
        cos, sin = _rope(ctx, dev)
        return lambda: flash_attn_with_kvcache(
            q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
            causal=True, rotary_interleaved=False,
        )  # fmt: skip
    if provider == "read_only":  # a reference, not attention: one launch that reads the same bytes
        return _read_only(kb, vb)
    qs = q.transpose(1, 2)  # (B, Hq, 1, D)
    if provider == "sdpa_gqa":
        return lambda: F.scaled_dot_product_attention(qs, kb, vb, enable_gqa=True)
    mask = torch.ones(batch, 1, 1, ctx, dtype=torch.bool, device=dev)
    if provider == "hf_sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        module = types.SimpleNamespace(
            num_key_value_groups=HQ // HKV, is_causal=True, training=False
        )
        return lambda: sdpa_attention_forward(module, qs, kb, vb, mask, scaling=D**-0.5)[0]
    if provider == "repeat_kv_sdpa":
        from transformers.integrations.sdpa_attention import repeat_kv

        def run():
            k = repeat_kv(kb, HQ // HKV)
            v = repeat_kv(vb, HQ // HKV)
            return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask)

        return run
    raise ValueError(f"unknown provider {provider!r}; known: {PROVIDERS}")


_READ_BLOCK = 8192  # bf16 elements per program of the read-only reference


@triton.jit
def _read_kernel(K, V, Partial, n_blocks, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = (pid % n_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if pid < n_blocks:
        x = tl.load(K + offs)
    else:
        x = tl.load(V + offs)
    tl.store(Partial + pid, tl.sum(x.to(tl.float32), 0))


def _read_only(kb: torch.Tensor, vb: torch.Tensor):
    assert kb.is_contiguous() and vb.is_contiguous() and kb.numel() % _READ_BLOCK == 0
    n_blocks = kb.numel() // _READ_BLOCK
    partial = torch.empty(2 * n_blocks, dtype=torch.float32, device=kb.device)
    return lambda: _read_kernel[(2 * n_blocks,)](kb, vb, partial, n_blocks, BLOCK=_READ_BLOCK)


def extra_bytes(provider: str, batch: int, ctx: int) -> int:
    """Temporary memory a provider allocates per call (the repeat_kv copies)."""
    if provider in ("repeat_kv_sdpa", "hf_sdpa"):
        return 2 * kv_bytes(batch, ctx) * (HQ // HKV)
    return 0


def timed(fn, eager: bool, flush: str = "zero") -> dict:
    """bench_ms of fn itself (eager) or of the replay of a CUDA graph that captured it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # compile kernels, settle allocator pools outside any capture
            fn()
    torch.cuda.current_stream().wait_stream(s)
    if eager:
        return bench_ms(fn, flush=flush)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    res = bench_ms(graph.replay, flush=flush)
    del graph
    return res


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def run_point(batch: int, ctx: int, providers, eager: bool, results: list) -> None:
    dev = torch.device("cuda")
    free, _ = torch.cuda.mem_get_info()
    if kv_bytes(batch, ctx) * 1.1 > free:
        for p in providers:
            results.append(dict(batch=batch, context=ctx, provider=p, skipped="KV does not fit"))
        return
    torch.manual_seed(0)
    kb = torch.randn(batch, HKV, ctx, D, device=dev, dtype=DTYPE)
    vb = torch.randn_like(kb)
    q = torch.randn(batch, 1, HQ, D, device=dev, dtype=DTYPE)
    baseline = F.scaled_dot_product_attention(q.transpose(1, 2), kb, vb, enable_gqa=True)
    baseline = baseline.transpose(1, 2).float()
    for p in providers:
        row = dict(batch=batch, context=ctx, provider=p, mode="eager" if eager else "cuda_graph")
        free, _ = torch.cuda.mem_get_info()
        if extra_bytes(p, batch, ctx) * 1.1 > free:
            row["skipped"] = f"needs {extra_bytes(p, batch, ctx) / 2**30:.1f} GiB of temporaries"
            results.append(row)
            continue
        try:
            fn = build(p, batch, ctx, kb, vb, q)
            out = fn()
            if p in ("sdpa_gqa", "repeat_kv_sdpa"):
                out = out.transpose(1, 2)  # (B, Hq, 1, D) -> (B, 1, Hq, D), as the others
            # the attention providers that read the untouched cache (not the appending one, not
            # the read-only reference) are spot-checked against sdpa_gqa
            if p not in ("hf_flash_append", "read_only"):
                row["max_abs_diff_vs_sdpa"] = (out.float() - baseline).abs().max().item()
            res = timed(fn, eager)
            row.update(res)
            row["us"] = res["ms"] * 1e3
            row["GB_s"] = kv_bytes(batch, ctx) / (res["ms"] * 1e-3) / 1e9
            read = timed(fn, eager, flush="read")
            row["us_read_flush"] = read["ms"] * 1e3
            row["GB_s_read_flush"] = kv_bytes(batch, ctx) / (read["ms"] * 1e-3) / 1e9
            if p.startswith("hf_flash"):
                from hf_flash.kernels import decode

                row["num_splits"] = decode.choose_num_splits(
                    batch * HKV, ctx, decode.decode_config(D, DTYPE, dev)["BLOCK_N"], dev
                )
        except torch.cuda.OutOfMemoryError as e:
            row["skipped"] = _error(e)
        except Exception as e:  # recorded, the grid goes on
            row["error"] = _error(e)
        results.append(row)
        torch.cuda.empty_cache()
    del kb, vb
    torch.cuda.empty_cache()


SWEEP = [
    {"BLOCK_N": bn, "num_warps": w, "num_stages": s}
    for bn in (32, 64, 128)
    for w in (4,)
    for s in (2, 3, 4)
    if not (bn == 128 and s == 4)  # 128 x 128 bf16 K and V tiles x 4 stages exceed smem
] + [
    {"BLOCK_N": 64, "num_warps": 8, "num_stages": 4},
    {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
]


def sweep(points, results: list) -> None:
    """hf_flash only: every launch config x split factor, to pick decode_config's entries."""
    from hf_flash import flash_attn_with_kvcache
    from hf_flash.kernels import configs, decode

    dev = torch.device("cuda")
    for batch, ctx in points:
        torch.manual_seed(0)
        kb = torch.randn(batch, HKV, ctx, D, device=dev, dtype=DTYPE)
        vb = torch.randn_like(kb)
        q = torch.randn(batch, 1, HQ, D, device=dev, dtype=DTYPE)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        kc, vc = kb.transpose(1, 2), vb.transpose(1, 2)
        for cfg in SWEEP:
            auto = decode.choose_num_splits(batch * HKV, ctx, cfg["BLOCK_N"], dev)
            for splits in sorted({1, max(1, auto // 2), auto, min(2 * auto, decode.MAX_SPLITS)}):
                row = dict(batch=batch, context=ctx, provider="hf_flash", num_splits=splits,
                           auto_splits=auto, **cfg)  # fmt: skip
                try:
                    with configs.override(decode=cfg):
                        fn = lambda: flash_attn_with_kvcache(  # noqa: E731
                            q, kc, vc, cache_seqlens=lens, causal=True, num_splits=splits
                        )
                        res = timed(fn, eager=False)
                        read = timed(fn, eager=False, flush="read")
                    row.update(res, us=res["ms"] * 1e3,
                               GB_s=kv_bytes(batch, ctx) / (res["ms"] * 1e-3) / 1e9,
                               us_read_flush=read["ms"] * 1e3,
                               GB_s_read_flush=kv_bytes(batch, ctx) / (read["ms"] * 1e-3) / 1e9,
                               )  # fmt: skip
                except Exception as e:
                    row["error"] = _error(e)
                results.append(row)
        del kb, vb
        torch.cuda.empty_cache()


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="time eager calls, no CUDA graph")
    parser.add_argument("--sweep", action="store_true", help="sweep hf_flash launch configs")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes instead of the grid's")
    parser.add_argument("--contexts", type=int, nargs="+",
                        help="context lengths instead of the grid's")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode.py needs a CUDA GPU")
    points = grid(args.quick, args.batches, args.contexts)
    results: list = []
    if args.sweep:
        sweep(points, results)
        cols = ["batch", "context", "BLOCK_N", "num_warps", "num_stages", "num_splits", "us",
                "GB_s", "GB_s_read_flush"]  # fmt: skip
        print_table(results, cols)
        best = {}
        for r in results:
            key = (r["batch"], r["context"])
            if "GB_s" in r and r["GB_s"] > best.get(key, {}).get("GB_s", 0):
                best[key] = r
        print("best per point:")
        print_table(list(best.values()), cols + ["auto_splits"])
        path = write_results("decode_sweep", results, args.out, quick=args.quick)
    else:
        providers = [p for p in args.providers.split(",") if p]
        for batch, ctx in points:
            run_point(batch, ctx, providers, args.eager, results)
            print_table([r for r in results if r["batch"] == batch and r["context"] == ctx],
                        ["batch", "context", "provider", "us", "GB_s", "us_read_flush",
                         "GB_s_read_flush", "num_splits", "skipped", "error"])  # fmt: skip
            sys.stdout.flush()
            # rewritten after every point, so a run cut short still leaves its rows
            path = write_results(
                "decode", results, args.out, quick=args.quick, eager=args.eager,
                shape=dict(hq=HQ, hkv=HKV, head_dim=D, dtype=str(DTYPE)),
            )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
