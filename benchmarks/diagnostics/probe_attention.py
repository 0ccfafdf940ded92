"""Quick kernel-config probe (H100): TFLOP/s of hf_flash fwd / bwd under candidate configs,
beside SDPA flash and cuDNN, for bf16 B*S=16K, Hq=32, Hkv=8, causal. Prints one line per run.

    PYTHONPATH=. python benchmarks/diagnostics/probe_attention.py [--seqlens 4096 16384] [--d 128]
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import bench_ms  # noqa: E402
from hf_flash import flash_attn_func  # noqa: E402
from hf_flash.kernels import configs  # noqa: E402

FWD = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)]
DKDV = [(32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 3)]
DQ = [(128, 32, 8, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3)]


def cfg(t):
    return {"BLOCK_M": t[0], "BLOCK_N": t[1], "num_warps": t[2], "num_stages": t[3]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for s in a.seqlens:
        b = max(1, 16384 // s)
        q = torch.randn(b, s, 32, a.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, s, 8, a.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, s, 8, a.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        fl = 4 * b * 32 * s * s * a.d * 0.5
        tf = lambda ms, mult=1.0: fl * mult / ms / 1e9  # noqa: E731
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_default", None)):
            try:
                kk, vv = (kt.repeat_interleave(4, 1), vt.repeat_interleave(4, 1)) if be == SDPBackend.FLASH_ATTENTION else (kt, vt)
                def f():
                    if be is None:
                        return F.scaled_dot_product_attention(qt, kk, vv, is_causal=True, enable_gqa=True)
                    with sdpa_kernel(be):
                        return F.scaled_dot_product_attention(qt, kk, vv, is_causal=True, enable_gqa=be != SDPBackend.FLASH_ATTENTION)
                o = f()
                do = torch.randn_like(o)
                r = {"s": s, "prov": name, "fwd": tf(bench_ms(f)["ms"]),
                     "fwdbwd": tf(bench_ms(lambda: torch.autograd.grad(f(), (q, k, v), do))["ms"], 3.5)}
            except Exception as e:  # noqa: BLE001
                r = {"s": s, "prov": name, "error": str(e)[:100]}
            print(json.dumps(r), flush=True)
            rows.append(r)
        for c in FWD:
            try:
                with configs.override(fwd=cfg(c)):
                    ms = bench_ms(lambda: flash_attn_func(q, k, v, causal=True))["ms"]
                r = {"s": s, "prov": "hf_flash", "fwd_cfg": c, "fwd": tf(ms)}
            except Exception as e:  # noqa: BLE001
                r = {"s": s, "fwd_cfg": c, "error": str(e)[:200]}
            print(json.dumps(r), flush=True)
            rows.append(r)
        o = flash_attn_func(q, k, v, causal=True)
        do = torch.randn_like(o)
        for c1 in DKDV:
            for c2 in DQ[:1] if c1 != DKDV[0] else DQ:
                try:
                    with configs.override(bwd_dkdv=cfg(c1), bwd_dq=cfg(c2)):
                        ms = bench_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))["ms"]
                    r = {"s": s, "prov": "hf_flash", "dkdv_cfg": c1, "dq_cfg": c2, "bwd": tf(ms, 2.5)}
                except Exception as e:  # noqa: BLE001
                    r = {"s": s, "dkdv_cfg": c1, "dq_cfg": c2, "error": str(e)[:200]}
                print(json.dumps(r), flush=True)
                rows.append(r)
        del q, k, v, o, do
        torch.cuda.empty_cache()
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
