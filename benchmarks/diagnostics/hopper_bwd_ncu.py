"""One launch of a Gluon attention kernel at one benchmark point, as a target for Nsight Compute.

    PYTHONPATH=. python benchmarks/diagnostics/hopper_bwd_ncu.py VARIANT [--seqlen 16384] [--full]
        [--head-dim 128] [--forward] [--time]

Builds the inputs of benchmarks/hopper_attention_bwd.py (bf16, Hq=32, Hkv=8, batch 16K // S)
and launches the kernel of ``VARIANT`` twice (the first launch compiles it); profile the second:

* the backward (default): the forward and the delta preprocess run once, then the Gluon dK/dV
  kernel, ``ncu -k regex:_attn_bwd_dkdv_kernel --launch-skip 1 --launch-count 1``; ``--time``
  prints its median time (do_bench) and TFLOP/s over the products it runs (4 without dQ, 5 with);
* ``--forward``: the Gluon forward ``VARIANT`` (``-k regex:_attn_fwd_kernel``); ``--time`` over
  the forward's 2 products;
* ``VARIANT`` ``sdpa`` or ``hf_flash``: a whole backward (SDPA with no backend forced, or
  hf_flash.flash_attn_func, its forward once before), so every kernel of it shows with ``ncu
  --launch-count N`` (autograd launches the backward from its own thread, so an NVTX range
  pushed here would not cover it); ``--time`` over 5 products. With ``--forward``, their forward
  alone (cuDNN's kernel: ``-k regex:flash_fprop``); ``--time`` over 2 products.

benchmarks/hopper_bwd_ncu_device_run.sh drives it (HOPPER_NCU_TARGET=fwd: ``--forward``). GPU: yes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks.hopper_attention import NHEADS_KV, NHEADS_Q, TOKENS, flops  # noqa: E402
from benchmarks.hopper_attention_bwd import dkdv_only  # noqa: E402

WHOLE = ("sdpa", "hf_flash")


def _whole_backward(q, k, v, dout, causal, provider):
    """A closure running one whole backward of ``provider`` (its forward once, outside)."""
    import torch.nn.functional as F

    from hf_flash import flash_attn_func

    if provider == "sdpa":
        qh, kh, vh = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True)
        grad = dout.transpose(1, 2).contiguous()
    else:
        qh, kh, vh = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = flash_attn_func(qh, kh, vh, causal=causal)
        grad = dout
    return lambda: torch.autograd.grad(out, (qh, kh, vh), grad, retain_graph=True)


def _whole_forward(q, k, v, causal, provider):
    """A closure running one forward of ``provider`` (SDPA with no backend forced, or
    hf_flash.flash_attn_func), without autograd."""
    import torch.nn.functional as F

    from hf_flash import flash_attn_func

    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # SDPA's (B, H, S, D), as the benchmarks

    @torch.no_grad()
    def run():
        if provider == "sdpa":
            F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True)
        else:
            flash_attn_func(q, k, v, causal=causal)

    return run


def forward_call(q, k, v, causal, variant):
    """A closure launching the Gluon forward ``variant`` into one preallocated output (or, for
    ``WHOLE``'s names, that provider's whole forward)."""
    if variant in WHOLE:
        return _whole_forward(q, k, v, causal, variant)
    from hf_flash.kernels.hopper import attention_fwd as hk

    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    scale = q.shape[-1] ** -0.5

    def run():
        hk.hopper_attention_forward(q, k, v, out, lse, softmax_scale=scale, causal=causal, variant=variant)

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--full", action="store_true", help="non-causal (default: causal)")
    ap.add_argument("--forward", action="store_true", help="the Gluon forward VARIANT instead")
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args(argv)
    from hf_flash.kernels.hopper import attention_bwd as hb

    s, d, causal = args.seqlen, args.head_dim, not args.full
    batch = max(1, TOKENS // s)
    g = torch.Generator(device="cuda").manual_seed(s + d)

    def mk(h):
        return torch.randn(batch, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = mk(NHEADS_Q), mk(NHEADS_KV), mk(NHEADS_KV)
    dout = mk(NHEADS_Q)
    if args.forward:
        run, products = forward_call(q, k, v, causal, args.variant), 2
    elif args.variant in WHOLE:
        run, products = _whole_backward(q, k, v, dout, causal, args.variant), 5
    else:
        run = dkdv_only(q, k, v, dout, causal, args.variant)
        products = 5 if hb.VARIANTS[args.variant].dq_atomic else 4
    for _ in range(2):
        run()
        torch.cuda.synchronize()
    if args.time:
        import triton.testing

        ms = triton.testing.do_bench(run, warmup=50, rep=300, quantiles=[0.5])
        tf = products / 2 * flops(batch, s, d, causal) / (ms * 1e-3) / 1e12
        print(f"{args.variant} d{d} {'causal' if causal else 'full'} S={s} B={batch}: {ms:.3f} ms, "
              f"{tf:.0f} TFLOP/s over {products} products", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
