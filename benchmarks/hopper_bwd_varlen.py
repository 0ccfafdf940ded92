"""The packed (varlen) backward alone: Gluon (each variant with a packed form) against Triton.

    python benchmarks/hopper_bwd_varlen.py [--rounds 3] [--out DIR] [--variants NAME[@ORDER] ...]

12 documents of random lengths (benchmarks/attention.py's ``packed_lengths``) in 16K tokens,
Hq=32, Hkv=8, d128, bf16, causal and not. Times ``flash_attn_backward`` (the preprocess, the
dK/dV(/dQ) kernel, the dQ kernel or cast) with ``triton.testing.do_bench`` (median), providers
taking turns over the rounds; reports the median of the rounds in TFLOP/s (bwd = 2.5 x the
packed forward's 4 * Hq * D * sum(L_i^2) (/ 2 causal)), the host time of one call with the device
idle, and each Gluon variant's max |difference| from the Triton gradients.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.attention import packed_lengths  # noqa: E402
from hf_flash.kernels import configs, flash_bwd, flash_fwd  # noqa: E402
from hf_flash.kernels.hopper import attention_bwd as hb  # noqa: E402

HQ, HKV, D = 32, 8, 128
# variant or variant@order (attention_bwd.VARLEN_ORDERS)
VARIANTS = ("kv2x64-m64-s2-dqwld", "kv2x64-m64-s2-dqwld@longest", "kv2x64-m64-s2-dqwl", "kv2x64-m64-s2")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), help="variant or variant@order")
    args = ap.parse_args(argv)
    lens = packed_lengths()
    tokens = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(tokens, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    rows = []
    for causal in (True, False):
        opts = dict(softmax_scale=D**-0.5, causal=causal, window_left=-1, window_right=0 if causal else -1,
                    softcap=0.0, alibi_slopes=None, dropout_p=0.0)  # fmt: skip
        seq = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
        out = torch.empty_like(q)
        lse = torch.empty(HQ, tokens, device="cuda")
        flash_fwd.flash_attn_forward(q, k, v, out, lse, rng_state=None, **seq, **opts)
        flops = 2.5 * 4.0 * HQ * D * sum(n * n for n in lens) / (2 if causal else 1)
        grads = {}

        def provider(name):
            @contextlib.contextmanager
            def ctx():
                if name == "triton":
                    with configs.use_hopper_backward(False):
                        yield
                    return
                saved, saved_order = dict(hb.VARLEN_DEFAULT), hb.VARLEN_ORDER
                variant, _, order = name.partition("@")
                hb.VARLEN_DEFAULT[(D, causal)] = variant
                hb.VARLEN_ORDER = order or "document"
                try:
                    yield
                finally:
                    hb.VARLEN_DEFAULT.clear()
                    hb.VARLEN_DEFAULT.update(saved)
                    hb.VARLEN_ORDER = saved_order

            bufs = tuple(torch.empty_like(t) for t in (q, k, v))

            def fn():
                flash_bwd.flash_attn_backward(dout, None, q, k, v, out, lse, *bufs, rng_state=None, **seq, **opts)

            return ctx, fn, bufs

        names = ("triton", *args.variants)
        made = {n: provider(n) for n in names}
        times = {n: [] for n in names}
        host = {}
        for n, (ctx, fn, bufs) in made.items():
            with ctx():
                path = flash_bwd.backward_path(q, k, v, out, dout, *bufs[1:], varlen=True, **opts)
                assert path == ("triton" if n == "triton" else "hopper"), (n, path)
                fn()
                torch.cuda.synchronize()
                grads[n] = tuple(b.clone() for b in bufs)
                hs = []
                for _ in range(20):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    fn()
                    hs.append((time.perf_counter() - t) * 1e3)
                torch.cuda.synchronize()
                host[n] = sorted(hs)[10]
        for _ in range(args.rounds):
            for n, (ctx, fn, _) in made.items():
                with ctx():
                    times[n].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        # the default variant's Gluon kernel alone (launch arguments built once; counters re-zeroed
        # per call; the accumulator keeps adding): what the preprocess, the memset and the cast (or,
        # for a variant without dQ, the Triton dQ kernel too) cost around it
        name = hb.VARLEN_DEFAULT[(D, causal)]
        delta = torch.zeros_like(lse)
        acc = hb.dq_accum_for(q, name)
        sem = torch.zeros(hb.dq_sem_count(q, name, cu), device="cuda", dtype=torch.int32)
        kbufs = tuple(torch.empty_like(t) for t in (k, v))
        sched = hb.varlen_key_schedule(cu, cu, k.shape[0], name, causal)
        grid, kargs, kkw = hb.launch_args(q, k, v, dout, lse, delta, *kbufs, acc, sem, softmax_scale=D**-0.5,
                                          causal=causal, variant=name, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          sched=sched)  # fmt: skip

        def kernel_only():
            sem.zero_()
            hb._attn_bwd_dkdv_kernel[grid](*kargs, **kkw)

        kernel_only()
        names = (*names, "kernel-only")
        times["kernel-only"] = [triton.testing.do_bench(kernel_only, warmup=25, rep=100, return_mode="median")
                                for _ in range(args.rounds)]  # fmt: skip
        host["kernel-only"] = 0.0
        grads["kernel-only"] = grads["triton"]
        for n in names:
            ms = sorted(times[n])[len(times[n]) // 2]
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads[n], grads["triton"]))
            rows.append(dict(causal=causal, provider=n, ms=ms, rounds_ms=times[n], tflops=flops / ms * 1e-9,
                             host_ms=host[n], max_diff_vs_triton=diff, doc_lengths=lens))  # fmt: skip
    print(f"\npacked backward alone: 12 documents in {tokens} tokens, bf16, Hq={HQ}, Hkv={HKV}, d{D} "
          f"(median of {args.rounds} rounds; do_bench median)")
    print(f"{'mask':7s} {'provider':22s} {'ms':>7s} {'TFLOP/s':>8s} {'vs tri':>7s} {'host ms':>8s} {'diff':>9s} rounds")
    for r in rows:
        base = next(x for x in rows if x["causal"] == r["causal"] and x["provider"] == "triton")
        print(f"{'causal' if r['causal'] else 'full':7s} {r['provider']:22s} {r['ms']:7.3f} {r['tflops']:8.1f} "
              f"{base['ms'] / r['ms']:7.2f} {r['host_ms']:8.2f} {r['max_diff_vs_triton']:9.2e} "
              f"{[round(x, 3) for x in r['rounds_ms']]}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "hopper_bwd_varlen.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
