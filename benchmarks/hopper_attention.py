"""Forward attention on Hopper: the Gluon kernel beside hf_flash's Triton kernel and SDPA.

    PYTHONPATH=. python benchmarks/hopper_attention.py OUT.json [--variants ...] [--seqlens ...]

One run, same GPU, same inputs: for bf16, Hq=32, Hkv=8, head dims 128 and 64, causal and not,
S = 4K, 8K, 16K, 32K (batch 16K // S, at least 1, so every point has 16K-32K tokens), it times

  hopper:<variant>  hf_flash.kernels.hopper (Gluon), each variant named on the command line
  hf_flash          hf_flash.flash_attn_func (the Triton kernels today)
  sdpa              F.scaled_dot_product_attention(..., enable_gqa=True), no backend forced
                    (cuDNN on an H100)
  sdpa_flash        the same under sdpa_kernel(FLASH_ATTENTION)

with triton.testing.do_bench (CUDA events, 256 MB L2 flush between calls, warm-up, median of
the repetitions), ``--rounds`` times per provider with the providers taking turns, and reports
the median of the rounds (the mean for an even count). TFLOP/s = 4 B Hq S^2 D / time, halved when causal. Each row records the ratio
to ``sdpa`` and, for the Gluon kernel, its max |difference| to sdpa's output (a spot check that
the timed kernel computes attention; the tests do the real checking). SDPA and hf_flash's
kernels take their native layouts: (B, H, S, D) and (B, S, H, D).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NHEADS_Q, NHEADS_KV = 32, 8
TOKENS = 16384


def env_info() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": props.name,
        "sm_count": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
    }  # fmt: skip


def bench(fn, warmup_ms=20, rep_ms=100) -> dict:
    import triton.testing

    med, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return {"ms": med, "p20_ms": p20, "p80_ms": p80}


def flops(batch, seqlen, head_dim, causal) -> float:
    f = 4.0 * batch * NHEADS_Q * seqlen * seqlen * head_dim
    return f / 2 if causal else f


def providers(q, k, v, causal, variants):
    """name -> zero-argument callable returning the output in (B, S, H, D)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_flash import flash_attn_func
    from hf_flash.kernels.hopper import attention_fwd as hk

    scale = q.shape[-1] ** -0.5
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # SDPA's (B, H, S, D)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    fns = {}
    for name in variants:
        if q.shape[-1] not in hk.VARIANTS[name].head_dims:
            continue
        def run(name=name):
            hk.hopper_attention_forward(q, k, v, out, lse, softmax_scale=scale, causal=causal, variant=name)
            return out

        fns[f"hopper:{name}"] = run
    fns["hf_flash"] = lambda: flash_attn_func(q, k, v, causal=causal)

    def sdpa():
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True).transpose(1, 2)

    def sdpa_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa()

    fns["sdpa"] = sdpa
    fns["sdpa_flash"] = sdpa_flash
    return fns


def run_point(head_dim, causal, seqlen, variants, rounds=1) -> list[dict]:
    batch = max(1, TOKENS // seqlen)
    g = torch.Generator(device="cuda").manual_seed(seqlen + head_dim)
    q = torch.randn(batch, seqlen, NHEADS_Q, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, seqlen, NHEADS_KV, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, seqlen, NHEADS_KV, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    fns = providers(q, k, v, causal, variants)
    ref = None
    rows = {}
    with torch.no_grad():
        try:
            ref = fns["sdpa"]().float()
        except Exception as e:  # recorded, not hidden: the row says why it has no reference
            ref_error = f"{type(e).__name__}: {e}"
        for name, fn in fns.items():
            row = {"provider": name, "head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch,
                   "nheads_q": NHEADS_Q, "nheads_kv": NHEADS_KV, "dtype": "bfloat16", "round_ms": []}  # fmt: skip
            try:
                res = fn()
                torch.cuda.synchronize()
                if name.startswith("hopper:"):
                    row["max_abs_diff_vs_sdpa"] = (
                        (res.float() - ref).abs().max().item() if ref is not None else ref_error
                    )
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc()
            rows[name] = row
        # providers take turns, in alternating order, so a drift of the GPU's clock over the
        # point's seconds falls on all of them alike; each round is one do_bench median
        names = [n for n in fns if "error" not in rows[n]]
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                t = bench(fns[name])
                rows[name]["round_ms"].append(t["ms"])
                if r == 0:
                    rows[name].update(p20_ms=t["p20_ms"], p80_ms=t["p80_ms"])
    for name in names:
        row = rows[name]
        row["ms"] = float(torch.tensor(row["round_ms"]).median().item()) if rounds % 2 else sum(row["round_ms"]) / rounds
        row["tflops"] = flops(batch, seqlen, head_dim, causal) / (row["ms"] * 1e-3) / 1e12
    base = rows.get("sdpa") if "tflops" in rows.get("sdpa", {}) else None
    for row in rows.values():
        if base is not None and "tflops" in row:
            row["vs_sdpa"] = row["tflops"] / base["tflops"]
    return list(rows.values())


def main(argv=None) -> None:
    from hf_flash.kernels.hopper.attention_fwd import VARIANTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--seqlens", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[128, 64])
    ap.add_argument("--rounds", type=int, default=3, help="timings per provider and point (median)")
    ap.add_argument("--masks", nargs="+", choices=["causal", "full"], default=["causal", "full"])
    args = ap.parse_args(argv)
    meta = env_info()
    print(json.dumps(meta), flush=True)
    rows = []
    for d in args.head_dims:
        for causal in [m == "causal" for m in args.masks]:
            for s in args.seqlens:
                point = run_point(d, causal, s, args.variants, args.rounds)
                rows += point
                cells = "  ".join(
                    f"{r['provider']}={r['tflops']:.0f}" if "tflops" in r else f"{r['provider']}=ERR" for r in point
                )
                print(f"d{d} {'causal' if causal else 'full  '} S={s:5d} B={point[0]['batch']}  {cells}", flush=True)
                Path(args.out).write_text(json.dumps({"env": meta, "rows": rows}, indent=1))
    # the summary: best Gluon variant per point against sdpa
    print("\nhead_dim causal seqlen | best hopper (TFLOP/s, variant) | hf_flash | sdpa | sdpa_flash | best/sdpa")
    points = sorted({(r["head_dim"], r["causal"], r["seqlen"]) for r in rows}, key=lambda p: (-p[0], not p[1], p[2]))
    for p in points:
        pr = {r["provider"]: r for r in rows if (r["head_dim"], r["causal"], r["seqlen"]) == p}
        hop = [r for n, r in pr.items() if n.startswith("hopper:") and "tflops" in r]
        best = max(hop, key=lambda r: r["tflops"]) if hop else None

        def tf(n):
            return f"{pr[n]['tflops']:.0f}" if n in pr and "tflops" in pr[n] else "-"

        ratio = f"{best['vs_sdpa']:.2f}" if best and "vs_sdpa" in best else "-"
        bname = f"{best['tflops']:.0f} {best['provider'][7:]}" if best else "-"
        print(f"d{p[0]} {'causal' if p[1] else 'full':6s} {p[2]:6d} | {bname:24s} | {tf('hf_flash'):>4s} | "
              f"{tf('sdpa'):>4s} | {tf('sdpa_flash'):>4s} | {ratio}")  # fmt: skip


if __name__ == "__main__":
    main()
