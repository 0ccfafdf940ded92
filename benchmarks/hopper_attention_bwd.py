"""Attention backward on Hopper: the Gluon dK/dV kernel beside hf_flash's Triton backward and SDPA.

    PYTHONPATH=. python benchmarks/hopper_attention_bwd.py OUT.json [--variants ...] [--seqlens ...]

One run, same GPU, same inputs (the shapes of benchmarks/hopper_attention.py: bf16, Hq=32,
Hkv=8, head dims 128 and 64, causal and not, S = 4K, 8K, 16K, 32K with batch 16K // S; with
``--window W`` causal calls see their last W keys, flash-attn's ``window_size=(W - 1, 0)``, and
the FLOP count is that of the visible pairs, as benchmarks/attention.py counts them). For each
provider it times the backward alone (``torch.autograd.grad`` on a kept graph: the delta
preprocess, dK/dV and dQ) and forward + backward:

  hopper:<variant>  flash_attn_func, Gluon forward, Gluon backward kernel ``variant`` (with its
                    own dQ, or + the library's dQ kernel for a dK/dV-only variant; ``<variant>+DQ``
                    names that kernel: ``+triton`` or a Gluon one, ``attention_dq.VARIANTS``)
  hf_flash_tbwd     flash_attn_func, Gluon forward, Triton backward (use_hopper_backward(False));
                    left out with ``--no-triton-backward``
  hf_flash          flash_attn_func as the library runs it by default, nothing pinned (with
                    ``--library-default``; soft-capped d128 calls: the Triton dK/dV kernel and
                    the Gluon dQ, which no ``hopper:`` row can pin)
  sdpa              F.scaled_dot_product_attention(..., enable_gqa=True), no backend forced
                    (cuDNN on an H100); not with ``--softcap`` or ``--window`` (SDPA has
                    neither; benchmarks/attention.py times the windowed peers)

and, per Gluon variant, its kernel alone (``dkdv:<variant>``; TFLOP/s over the products it runs:
4 for dK/dV, 2x the forward's, 5 with dQ). TFLOP/s: forward = 4 B Hq S^2 D (halved when causal),
backward = 2.5x forward, forward + backward = 3.5x forward, as benchmarks/attention.py counts.
Timing: triton.testing.do_bench (CUDA events, L2 flush, median), ``--rounds`` rounds with the
providers taking turns; the median of the rounds. Each Gluon row records its max |difference|
to the Triton backward's gradients (a spot check; the tests do the real checking).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.hopper_attention import NHEADS_KV, NHEADS_Q, TOKENS, bench, env_info, flops  # noqa: E402


def providers(q, k, v, dout, causal, variants, softcap=0.0, triton_backward=True, window=(-1, -1),
              library_default=False):  # fmt: skip
    """name -> (forward, context): forward() returns the output in (B, S, H, D) with a graph to
    (q, k, v); both passes run inside context() (the provider's variant pins and switches)."""
    from hf_flash import flash_attn_func
    from hf_flash.kernels import configs
    from hf_flash.kernels.hopper import attention_bwd as hb
    from hf_flash.kernels.hopper import attention_dq

    fns = {}
    for name in variants:
        base, _, dq = name.partition("+")
        if q.shape[-1] not in hb.VARIANTS[base].head_dims:
            continue

        @contextlib.contextmanager
        def pick(base=base, dq=dq):
            # the named variant at every length, and the named dQ kernel beside it
            with hb.pinned(base, (q.shape[-1],)), (attention_dq.pinned(q.shape[-1], dq) if dq
                                                   else contextlib.nullcontext()):  # fmt: skip
                yield

        fns[f"hopper:{name}"] = (
            lambda: flash_attn_func(q, k, v, causal=causal, softcap=softcap, window_size=window), pick
        )
    if library_default:
        fns["hf_flash"] = (
            lambda: flash_attn_func(q, k, v, causal=causal, softcap=softcap, window_size=window), contextlib.nullcontext
        )
    if triton_backward:
        fns["hf_flash_tbwd"] = (
            lambda: flash_attn_func(q, k, v, causal=causal, softcap=softcap, window_size=window),
            lambda: configs.use_hopper_backward(False),
        )
    if softcap or window != (-1, -1):
        return fns
    qh, kh, vh = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))

    def sdpa():
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True).transpose(1, 2)

    sdpa.leaves = (qh, kh, vh)
    fns["sdpa"] = (sdpa, contextlib.nullcontext)
    return fns


def dkdv_only(q, k, v, dout, causal, variant, softcap=0.0, window=(-1, -1)):
    """A closure timing the Gluon kernel alone (lse, delta and a ``stats_smem`` variant's
    statistics buffer computed once before; for a ``dq_atomic`` variant with its accumulator's
    zeroing and the final dQ copy)."""
    from hf_flash.kernels import flash_bwd, flash_fwd
    from hf_flash.kernels.hopper import attention_bwd as hb

    scale = q.shape[-1] ** -0.5
    q, k, v = (t.detach() for t in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    flash_fwd.flash_attn_forward(
        q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=q.shape[1],
        max_seqlen_k=k.shape[1], softmax_scale=scale, causal=causal, window_left=window[0],
        window_right=0 if causal else window[1], softcap=softcap, alibi_slopes=None, dropout_p=0.0, rng_state=None,
    )  # fmt: skip
    delta, stats = flash_bwd.backward_preprocess(out, dout, None, lse, cu_seqlens_q=None, max_seqlen_q=q.shape[1],
                                                 stats_m=hb.VARIANTS[variant].stats_rows)  # fmt: skip
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def run():
        hb.hopper_attention_backward(q, k, v, dout, lse, delta, dq, dk, dv, softmax_scale=scale, causal=causal,
                                     variant=variant, softcap=softcap, stats=stats,
                                     window=(window[0], 0 if causal else window[1]))  # fmt: skip

    return run


def timed_passes(fwd, ctx, leaves, dout):
    """(backward on a kept graph, forward + backward): the two timed closures of one provider,
    each pass inside the provider's ``ctx()``. The forward runs inside it too: a call plan
    (``interface._dense_plan``) fixes both passes' kernels when the forward runs, so a variant
    pinned around the backward alone would time the plan's."""
    with ctx():
        out = fwd()

    def bwd():
        with ctx():
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    def fb():
        with ctx():
            return torch.autograd.grad(fwd(), leaves, dout)

    return bwd, fb


def run_point(head_dim, causal, seqlen, variants, rounds, softcap=0.0, triton_backward=True,
              window=0, library_default=False) -> list[dict]:  # fmt: skip
    from benchmarks.attention import visible_pairs
    from hf_flash.kernels.hopper import attention_bwd as hb

    window_size = (window - 1, 0) if window else (-1, -1)

    batch = max(1, TOKENS // seqlen)
    g = torch.Generator(device="cuda").manual_seed(seqlen + head_dim)

    def mk(h):
        return torch.randn(batch, seqlen, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = (mk(h).requires_grad_() for h in (NHEADS_Q, NHEADS_KV, NHEADS_KV))
    dout = mk(NHEADS_Q)
    fns = providers(q, k, v, dout, causal, variants, softcap, triton_backward, window_size, library_default)
    f_fwd = flops(batch, seqlen, head_dim, causal)
    if window:
        f_fwd = 4.0 * batch * NHEADS_Q * head_dim * visible_pairs(seqlen, "window", window)
    rows, timers = {}, {}
    ref = None
    for name, (fwd, ctx) in fns.items():
        leaves = getattr(fwd, "leaves", (q, k, v))
        row = {"provider": name, "head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch,
               "nheads_q": NHEADS_Q, "nheads_kv": NHEADS_KV, "dtype": "bfloat16", "softcap": softcap,
               "window": window or None, "round_ms": [], "round_fb_ms": []}  # fmt: skip
        try:
            if name != "sdpa":
                from hf_flash.interface import attention_paths, attention_variants

                with ctx():
                    call = dict(causal=causal, softcap=softcap, window_size=window_size)
                    row["paths"] = attention_paths(q, k, v, **call)
                    row["variants"] = attention_variants(q, k, v, **call)
            bwd, fb = timed_passes(fwd, ctx, leaves, dout)
            grads = bwd()
            torch.cuda.synchronize()
            if name == "hf_flash_tbwd":
                ref = grads
            timers[name] = (bwd, fb, grads)
        except Exception as e:  # recorded, not hidden
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        rows[name] = row
    for name, (_, _, grads) in timers.items():
        if name.startswith("hopper:") and ref is not None:
            rows[name]["max_abs_diff_vs_triton_bwd"] = max((a.float() - b.float()).abs().max().item()
                                                           for a, b in zip(grads, ref))  # fmt: skip
    for name in dict.fromkeys(n.partition("+")[0] for n in variants):
        if any(t.partition("+")[0] == f"hopper:{name}" for t in timers):
            rows[f"dkdv:{name}"] = {"provider": f"dkdv:{name}", "head_dim": head_dim, "causal": causal,
                                    "seqlen": seqlen, "batch": batch, "round_ms": []}  # fmt: skip
            timers[f"dkdv:{name}"] = (dkdv_only(q, k, v, dout, causal, name, softcap, window_size), None, None)
    names = list(timers)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            bwd, fb, _ = timers[name]
            rows[name]["round_ms"].append(bench(bwd)["ms"])
            if fb is not None:
                rows[name]["round_fb_ms"].append(bench(fb)["ms"])

    def mid(xs):
        return float(torch.tensor(xs).median().item()) if len(xs) % 2 else sum(xs) / len(xs)

    for name in names:
        row = rows[name]
        row["bwd_ms"] = mid(row.pop("round_ms"))
        if name.startswith("dkdv:"):
            # the products the kernel runs: 4 (dK, dV) or 5 (with dQ) of the forward's 2
            products = 5 if hb.VARIANTS[name[5:]].dq_atomic else 4
            row["dkdv_tflops"] = products / 2 * f_fwd / (row["bwd_ms"] * 1e-3) / 1e12
            continue
        row["fwd_bwd_ms"] = mid(row.pop("round_fb_ms"))
        row["bwd_tflops"] = 2.5 * f_fwd / (row["bwd_ms"] * 1e-3) / 1e12
        row["fwd_bwd_tflops"] = 3.5 * f_fwd / (row["fwd_bwd_ms"] * 1e-3) / 1e12
    base = rows.get("sdpa", {})
    for row in rows.values():
        if "bwd_tflops" in row and "bwd_tflops" in base:
            row["bwd_vs_sdpa"] = row["bwd_tflops"] / base["bwd_tflops"]
            row["fwd_bwd_vs_sdpa"] = row["fwd_bwd_tflops"] / base["fwd_bwd_tflops"]
    return list(rows.values())


def main(argv=None) -> None:
    from hf_flash.kernels.hopper.attention_bwd import VARIANTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--seqlens", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[128, 64])
    ap.add_argument("--rounds", type=int, default=1, help="timings per provider and point (median)")
    ap.add_argument("--softcap", type=float, default=0.0, help="soft-capped calls (no SDPA row)")
    ap.add_argument("--masks", nargs="+", choices=["causal", "full"], default=["causal", "full"])
    ap.add_argument("--no-triton-backward", action="store_true", help="leave out the hf_flash_tbwd row")
    ap.add_argument("--library-default", action="store_true", help="add the hf_flash row (nothing pinned)")
    ap.add_argument("--window", type=int, default=0,
                    help="causal calls see their last W keys (window_size=(W - 1, 0); no SDPA row)")
    args = ap.parse_args(argv)
    if args.window and args.masks != ["causal"]:
        ap.error("--window is a causal sliding window: use it with --masks causal")
    if args.window < 0:
        ap.error(f"--window must be a positive number of keys, got {args.window}")
    meta = env_info()
    print(json.dumps(meta), flush=True)
    rows = []
    for d in args.head_dims:
        for causal in [m == "causal" for m in args.masks]:
            for s in args.seqlens:
                point = run_point(d, causal, s, args.variants, args.rounds, args.softcap,
                                  not args.no_triton_backward, args.window, args.library_default)  # fmt: skip
                rows += point
                cells = "  ".join(
                    f"{r['provider']}={r.get('bwd_tflops', r.get('dkdv_tflops', 0)):.0f}"
                    + (f"/{r['fwd_bwd_tflops']:.0f}" if "fwd_bwd_tflops" in r else "")
                    if "bwd_ms" in r else f"{r['provider']}=ERR"
                    for r in point
                )  # fmt: skip
                print(f"d{d} {'causal' if causal else 'full  '} S={s:5d} B={point[0]['batch']}  {cells}", flush=True)
                Path(args.out).write_text(json.dumps({"env": meta, "rows": rows}, indent=1))
    print("\nbwd / fwd+bwd TFLOP/s | point | best gluon | hf_flash (triton bwd) | sdpa | best/sdpa (fwd+bwd)")
    points = sorted({(r["head_dim"], r["causal"], r["seqlen"]) for r in rows}, key=lambda p: (-p[0], not p[1], p[2]))
    for p in points:
        pr = {r["provider"]: r for r in rows if (r["head_dim"], r["causal"], r["seqlen"]) == p}
        hop = [r for n, r in pr.items() if n.startswith("hopper:") and "fwd_bwd_tflops" in r]
        best = max(hop, key=lambda r: r["fwd_bwd_tflops"]) if hop else None

        def cell(r):
            return f"{r['bwd_tflops']:.0f}/{r['fwd_bwd_tflops']:.0f}" if r and "fwd_bwd_tflops" in r else "-"

        ratio = f"{best['fwd_bwd_vs_sdpa']:.2f}" if best and "fwd_bwd_vs_sdpa" in best else "-"
        bname = f"{cell(best)} {best['provider'][7:]}" if best else "-"
        print(f"d{p[0]} {'causal' if p[1] else 'full':6s} {p[2]:6d} | {bname:28s} | {cell(pr.get('hf_flash_tbwd')):9s} | "
              f"{cell(pr.get('sdpa')):9s} | {ratio}")  # fmt: skip


if __name__ == "__main__":
    main()
