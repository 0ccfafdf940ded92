"""Where does a forward+backward call spend its time beyond its kernels? For one benchmark shape,
each provider's three passes (as ``benchmarks/attention.py`` times them: forward without
gradients, backward alone on a retained graph, forward with autograd then the backward) run
under the PyTorch profiler, one call at a time with L2 flushed between calls, as do_bench does.

    PYTHONPATH=. python benchmarks/diagnostics/pass_timeline.py [--head-dim 128] [--mask full]
        [--seqlen 4096] [--providers hf_flash sdpa] [--calls 10] [--json OUT]
        [--bwd-variants NAME ...]

Per provider and pass it prints the median of the CUDA-event time of a call, the span from its
first kernel's start to its last kernel's end and the sum of its kernels' times (from the trace;
span minus sum is the device idle inside the call: host gaps, synchronisations), and each
kernel's count and mean time per call; so a
forward+backward slower than its forward and backward timed apart shows whether an extra
kernel, a slower kernel or idle time is the cause. It answers for one run; timings for claims
come from ``benchmarks/attention.py``. Each pass's JSON record also holds its wall-clock span
(``wall``: Unix seconds), to read it against a GPU clock log. ``--bwd-variants`` runs the
hf_flash provider once per named Gluon backward variant (``attention_bwd.pinned``), reported as
``hf_flash[bwd=NAME]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import attention as bench  # noqa: E402


def _passes(attn, leaves, dout):
    """name -> zero-argument callable for one call of that pass (the backward on a graph kept
    from one forward, as attention.time_passes times it)."""
    kept = {}

    def fwd():
        with torch.no_grad():
            return attn()

    def bwd():
        if "out" not in kept:
            kept["out"] = attn()
        return torch.autograd.grad(kept["out"], leaves, dout, retain_graph=True)

    def both():
        return torch.autograd.grad(attn(), leaves, dout)

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": both}, kept


# the L2 flush is a bitwise_not_ of 256 MB, an op no attention call runs: its kernel's name
# (bitwise_not_kernel_cuda's lambda; compared lowercased without underscores) marks where each
# call's kernels begin in the trace
FLUSH_KERNEL = "bitwisenot"


def timeline(fn, calls: int) -> dict:
    """Event-timed calls under the profiler. The device events of the trace, in start order,
    are split at the flush kernels: each segment is one call's kernels (and copies/fills)."""
    flush = torch.zeros(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(3):  # warm-up (compiles, allocator pools)
        fn()
    torch.cuda.synchronize()
    marks = []
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            flush.bitwise_not_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            marks.append((start, end))
        torch.cuda.synchronize()
    spans = [s.elapsed_time(e) for s, e in marks]
    dev = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda ev: ev.time_range.start)  # fmt: skip
    segments: list[list] = []
    for ev in dev:
        if FLUSH_KERNEL in ev.name.lower().replace("_", ""):
            segments.append([])
        elif segments:
            segments[-1].append(ev)
    if len(segments) != calls:
        raise RuntimeError(f"found {len(segments)} flush kernels in the trace for {calls} calls")
    per_name: dict[str, list[float]] = {}
    busy, extent = [], []
    for seg in segments:
        for ev in seg:
            per_name.setdefault(ev.name, []).append(ev.time_range.end - ev.time_range.start)
        busy.append(sum(ev.time_range.end - ev.time_range.start for ev in seg) / 1e3)
        extent.append((max(ev.time_range.end for ev in seg) - min(ev.time_range.start for ev in seg)) / 1e3
                      if seg else 0.0)  # fmt: skip
    return {
        "ms": statistics.median(spans), "spans_ms": spans, "kernel_ms": statistics.median(busy),
        "extent_ms": statistics.median(extent),
        "kernels": {n: {"per_call": len(v) / calls, "mean_us": sum(v) / len(v)} for n, v in
                    sorted(per_name.items(), key=lambda kv: -sum(kv[1]))},
    }  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mask", default="full", choices=["full", "causal"])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--providers", nargs="*", default=["hf_flash", "sdpa"])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--bwd-variants", nargs="+", default=[],
                    help="hf_flash once per named Gluon backward variant (attention_bwd.VARIANTS)")
    args = ap.parse_args(argv)
    from hf_flash.kernels.hopper import attention_bwd

    for name in args.bwd_variants:
        if name not in attention_bwd.VARIANTS:
            ap.error(f"unknown backward variant {name!r}")

    batch = max(1, bench.TOKENS // args.seqlen)
    shape = {"head_dim": args.head_dim, "mask": args.mask, "seqlen": args.seqlen, "batch": batch}
    gen = torch.Generator(device="cuda").manual_seed(0)
    shp = (batch, args.seqlen)
    q = torch.randn(*shp, bench.NHEADS_Q, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(*shp, bench.NHEADS_KV, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(*shp, bench.NHEADS_KV, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(*shp, bench.NHEADS_Q, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    builders = bench.builders("dynamic")
    out = {"shape": shape, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "providers": {}}
    runs = [(name, name, contextlib.nullcontext) for name in args.providers]
    runs += [(f"hf_flash[bwd={bv}]", "hf_flash", lambda bv=bv: attention_bwd.pinned(bv, [args.head_dim]))
             for bv in args.bwd_variants]  # fmt: skip
    for name, provider, pin in runs:
        attn, leaves, dout_p, _, *context = builders[provider](shape, q, k, v, dout)
        res = {}
        with pin(), (context[0] if context else contextlib.nullcontext)():
            fns, kept = _passes(attn, leaves, dout_p)
            for p, fn in fns.items():
                start = time.time()
                res[p] = timeline(fn, args.calls)
                # wall-clock span of the pass (warm-up included), to line up with a clock log
                # such as `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw -lms 20`
                res[p]["wall"] = [start, time.time()]
            kept.clear()
        out["providers"][name] = res
        sep = res["fwd"]["ms"] + res["bwd"]["ms"]
        print(f"\n== {name}  d{args.head_dim} {args.mask} S={args.seqlen} B={batch}: fwd + bwd apart "
              f"{sep:.3f} ms, fwd+bwd {res['fwd+bwd']['ms']:.3f} ms ({res['fwd+bwd']['ms'] / sep:.3f}x)")
        for p, r in res.items():
            print(f"  {p:8s} call {r['ms']:.3f} ms (events)  first kernel to last {r['extent_ms']:.3f}  "
                  f"kernels busy {r['kernel_ms']:.3f}")
            for kname, kk in r["kernels"].items():
                print(f"      {kk['per_call']:4.1f} x {kk['mean_us']:9.1f} us  {kname[:110]}")
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
