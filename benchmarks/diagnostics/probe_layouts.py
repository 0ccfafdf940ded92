"""Does the attention forward's speed depend on how it is called? (diagnostic, H100)

    PYTHONPATH=. python benchmarks/diagnostics/probe_layouts.py [--seqlen 32768] [--d 64]

One causal sequence (Hq=32, Hkv=8, bf16), forward only, timed with the benchmarks' harness:
dense ``flash_attn_func`` versus ``flash_attn_varlen_func`` with one sequence, inputs laid out
(B, S, H, D) contiguous or as the transposed view of (B, H, S, D) that transformers' attention
interface passes, without and with gradients required (the training forward also writes the
log-sum-exp); ``--backward`` adds forward + backward, dense and packed. The recipe's profile at 32K measured the forward at 13.1 ms per layer against
10.0 ms in benchmarks/attention.py: this says which of these differences costs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import bench_ms  # noqa: E402
from hf_flash import flash_attn_func, flash_attn_varlen_func  # noqa: E402


def inputs(s: int, d: int, layout: str, grad: bool):
    shapes = [(1, 32, s, d), (1, 8, s, d), (1, 8, s, d)] if layout == "bhsd" else [
        (1, s, 32, d), (1, s, 8, d), (1, s, 8, d)]
    out = []
    for shape in shapes:
        t = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        out.append(t.transpose(1, 2) if layout == "bhsd" else t)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--backward", action="store_true",
                    help="also time forward + backward, dense and packed, (B, S, H, D) inputs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    s = a.seqlen
    flops = 4 * 32 * s * s * a.d / 2
    cu = torch.tensor([0, s], device="cuda", dtype=torch.int32)
    rows = []
    for layout in ("bshd", "bhsd"):
        for grad in (False, True):
            q, k, v = inputs(s, a.d, layout, grad)
            calls = {
                "dense": lambda: flash_attn_func(q, k, v, causal=True),
                "varlen": lambda: flash_attn_varlen_func(
                    q[0], k[0], v[0], cu, cu, s, s, causal=True),
            }
            for name, fn in calls.items():
                with torch.set_grad_enabled(grad):
                    ms = bench_ms(fn)["ms"]
                row = {"call": name, "layout": layout, "grad": grad, "ms": round(ms, 3),
                       "tflops": round(flops / ms / 1e9, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.backward:
        q, k, v = inputs(s, a.d, "bshd", True)
        do = torch.randn_like(q)

        def dense():
            torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), do)

        def varlen():
            out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, s, s, causal=True)
            torch.autograd.grad(out, (q, k, v), do[0])

        for name, fn in (("dense", dense), ("varlen", varlen)):
            ms = bench_ms(fn)["ms"]
            row = {"call": name, "layout": "bshd", "pass": "fwd+bwd", "ms": round(ms, 3),
                   "tflops": round(3.5 * flops / ms / 1e9, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
