"""One launch of the Gluon forward kernel at one benchmark point, as a target for Nsight Compute.

    PYTHONPATH=. python benchmarks/diagnostics/hopper_fwd_ncu.py VARIANT [--seqlen 16384] [--full]
        [--head-dim 128] [--time]

Builds the inputs of benchmarks/hopper_attention.py (bf16, Hq=32, Hkv=8, batch 16K // S) and
launches the Gluon forward ``VARIANT`` twice (the first launch compiles it): profile the second
with ``ncu -k regex:_attn_fwd_kernel --launch-skip 1 --launch-count 1``
(benchmarks/hopper_bwd_ncu_device_run.sh with HOPPER_NCU_TARGET=fwd). ``--time`` also prints the
kernel's median time (do_bench) and TFLOP/s. GPU: yes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks.hopper_attention import NHEADS_KV, NHEADS_Q, TOKENS, flops  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--full", action="store_true", help="non-causal (default: causal)")
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args(argv)
    from hf_flash.kernels.hopper import attention_fwd as hk

    s, d, causal = args.seqlen, args.head_dim, not args.full
    batch = max(1, TOKENS // s)
    g = torch.Generator(device="cuda").manual_seed(s + d)

    def mk(h):
        return torch.randn(batch, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = mk(NHEADS_Q), mk(NHEADS_KV), mk(NHEADS_KV)
    out = torch.empty_like(q)
    lse = torch.empty(batch, NHEADS_Q, s, device="cuda", dtype=torch.float32)

    def run():
        hk.hopper_attention_forward(q, k, v, out, lse, softmax_scale=d**-0.5, causal=causal, variant=args.variant)

    for _ in range(2):
        run()
        torch.cuda.synchronize()
    if args.time:
        import triton.testing

        ms = triton.testing.do_bench(run, warmup=50, rep=300, quantiles=[0.5])
        tf = flops(batch, s, d, causal) / (ms * 1e-3) / 1e12
        print(f"{args.variant} d{d} {'causal' if causal else 'full'} S={s} B={batch}: {ms:.3f} ms, {tf:.0f} TFLOP/s",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
