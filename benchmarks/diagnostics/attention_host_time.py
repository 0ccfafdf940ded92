"""Host time per attention call on the GPU: the public ``flash_attn_func`` (forward alone, and
forward + backward) beside the Gluon forward launched directly and SDPA, on a call small enough
that the GPU keeps up, so the loop measures what the host spends queueing one call (diagnostic).

    PYTHONPATH=. python benchmarks/diagnostics/attention_host_time.py [--seqlen 256] [--profile]

Each row is the best of ``--repeats`` loops of ``--calls`` calls, the time until the loop has
queued everything divided by the calls (the device is synchronised between loops, outside the
timing; triton.testing.do_bench on a short call counts this time where it exceeds the kernel's).
``--profile``: also cProfiles of the public forward and of forward + backward (the backward on
the calling thread), by own and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diagnostics.launch_host_time import host_us  # noqa: E402
from hf_flash import flash_attn_func  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    from hf_flash.kernels.hopper import attention_fwd as hk

    dev, dtype, s, d = "cuda", torch.bfloat16, args.seqlen, args.head_dim
    q = torch.randn(1, s, 32, d, device=dev, dtype=dtype)
    k = torch.randn(1, s, 8, d, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    out = torch.empty_like(q)
    lse = torch.empty(1, 32, s, device=dev, dtype=torch.float32)
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    scale = d**-0.5

    def public_fwd():
        with torch.no_grad():
            return flash_attn_func(q, k, v, causal=True)

    def public_fwd_bwd():
        o = flash_attn_func(qg, kg, vg, causal=True)
        return torch.autograd.grad(o, (qg, kg, vg), dout)

    def kernel(variant):
        def call():
            hk.hopper_attention_forward(q, k, v, out, lse, softmax_scale=scale, causal=True, variant=variant)

        return call

    def sdpa_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)

    default = hk.default_variant(d, True, seqlen_q=s)
    rows = [
        ("flash_attn_func forward (no grad)", public_fwd),
        ("flash_attn_func forward + backward", public_fwd_bwd),
        (f"hopper_attention_forward {default}", kernel(default)),
        ("hopper_attention_forward ws2x4-overlap-fma", kernel("ws2x4-overlap-fma")),
        ("SDPA forward (no grad)", sdpa_fwd),
    ]
    print(f"Host us per call, B=1 S={s} Hq=32 Hkv=8 d={d} causal bf16, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")  # fmt: skip
    for label, fn in rows:
        print(f"{label:48} {host_us(fn, args.calls, args.repeats):8.1f}")
    if args.profile:
        # the backward on this thread (autograd's device threads are invisible to cProfile)
        with torch.autograd.set_multithreading_enabled(False):
            for label, fn in rows[:2]:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                for key in ("tottime", "cumulative"):
                    buf = io.StringIO()
                    pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
                    print(f"== {label}, {args.calls} calls, by {key}\n{buf.getvalue()}")


if __name__ == "__main__":
    main()
