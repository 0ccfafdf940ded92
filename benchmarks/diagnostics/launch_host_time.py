"""Host time per Triton launch on the GPU: Triton's ``kernel[grid](...)`` vs hf_flash's cached
launch (hf_flash.kernels.launch), for the decode, combine and rotary kernels (diagnostic).

    PYTHONPATH=. python benchmarks/diagnostics/launch_host_time.py [--calls 200] [--repeats 7]

For each kernel, the arguments of one real call (decode shapes of the 1.2B Llama: B=1, 32/8
heads, head dim 64, bf16, a short cache so the GPU keeps up) are recorded, then the launch is
repeated ``--calls`` times through each path; the time until the loop has queued everything,
divided by the calls, is the host time per launch (best of ``--repeats``; the device is
synchronised between loops, outside the timing). The same for a whole
``flash_attn_with_kvcache`` call and a whole ``apply_rotary_emb`` call, with the fast path off
and on (the public ``flash_attn_with_kvcache`` reads ``cache_seqlens`` on the host to check it,
a device sync per call, so its rows include one; the model's fused decode path skips that
check). The fast path's own counters confirm which path ran.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_flash import apply_rotary_emb, flash_attn_with_kvcache  # noqa: E402
from hf_flash.kernels import decode, launch, rotary  # noqa: E402


def host_us(fn, calls: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return best / calls * 1e6


class _Record:
    """Wraps a CachedLauncher and keeps the arguments of its last call."""

    def __init__(self, launcher):
        self.launcher = launcher
        self.meta = launcher.meta
        self.last = None

    def __call__(self, *args):
        self.last = args
        return self.launcher(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cache", type=int, default=256, help="cache rows (the kernel's work)")
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    import triton

    dev, dtype, d = "cuda", torch.bfloat16, args.head_dim
    torch.manual_seed(0)
    q = torch.randn(1, 1, 32, d, device=dev, dtype=dtype)
    kc = torch.randn(1, args.cache, 8, d, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    kn = torch.randn(1, 1, 8, d, device=dev, dtype=dtype)
    vn = torch.randn_like(kn)
    lens = torch.full((1,), args.cache // 2, dtype=torch.int32, device=dev)
    cos = torch.rand(args.cache, d // 2, device=dev)
    sin = torch.rand(args.cache, d // 2, device=dev)
    x = torch.randn(1, 1, 32, d, device=dev, dtype=dtype)

    def attn(splits):
        def call():
            return flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=lens, causal=True,
                                           num_splits=splits)  # fmt: skip

        return call

    def rope():
        return apply_rotary_emb(x, cos, sin, seqlen_offsets=7)

    recs = {}
    for module, name in ((decode, "_DECODE"), (decode, "_COMBINE"), (rotary, "_ROTARY")):
        recs[name] = _Record(getattr(module, name))
        setattr(module, name, recs[name])
    attn(1)()
    one_split = recs["_DECODE"].last
    attn(4)()
    rope()
    launches = [("decode kernel (1 split)", recs["_DECODE"].launcher, one_split),
                ("decode kernel (4 splits)", recs["_DECODE"].launcher, recs["_DECODE"].last),
                ("combine kernel", recs["_COMBINE"].launcher, recs["_COMBINE"].last),
                ("rotary kernel", recs["_ROTARY"].launcher, recs["_ROTARY"].last)]  # fmt: skip
    print(f"Host us per launch / call (H2D queueing only), triton {triton.__version__}, torch "
          f"{torch.__version__}, {torch.cuda.get_device_name()}; fast path supported: "
          f"{launch._supported()}")  # fmt: skip
    print(f"{'':34} {'triton path':>12} {'cached path':>12} {'args':>5}")
    for label, launcher, call in launches:
        grid, tensors, ints, floats, meta = call
        n_args = len(tensors) + len(ints) + len(floats)
        times = []
        for enabled in (False, True):
            with launch.fast_launch(enabled):
                before = launcher.fast
                times.append(host_us(lambda: launcher(*call), args.calls, args.repeats))
                took_fast = launcher.fast > before
            assert took_fast == (enabled and launch._supported()), (label, enabled)
        print(f"{label:34} {times[0]:12.1f} {times[1]:12.1f} {n_args:5d}")
    for label, fn in (("flash_attn_with_kvcache, 1 split", attn(1)),
                      ("flash_attn_with_kvcache, 4 splits", attn(4)),
                      ("apply_rotary_emb", rope)):  # fmt: skip
        times = []
        for enabled in (False, True):
            with launch.fast_launch(enabled):
                times.append(host_us(fn, args.calls, args.repeats))
        print(f"{label:34} {times[0]:12.1f} {times[1]:12.1f}")


if __name__ == "__main__":
    main()
