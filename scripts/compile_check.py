"""Compile the attention kernels for a GPU target on a machine without a GPU (Triton's
compiler and ptxas need no device) and report registers, spills and shared memory.

    python scripts/compile_check.py [--arch 90]
"""
import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, ".")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hf_flash.kernels import flash_bwd, flash_fwd  # noqa: E402


def sig_for(fn, dtype, overrides):
    sig = {}
    for name in fn.arg_names:
        if name in overrides:
            sig[name] = overrides[name]
        elif name[0].isupper():
            sig[name] = f"*{dtype}"
        elif name.startswith("stride") or name in ("seqlen_q", "seqlen_k", "max_seqlen_q", "max_seqlen_k", "nheads", "nheads_k", "group", "window_left", "window_right"):
            sig[name] = "i32"
        else:
            sig[name] = "fp32"
    return sig


def compile_one(fn, dtype, constexprs, overrides, arch, warps, stages):
    params = fn.params
    sig = sig_for(fn, dtype, overrides)
    for k in constexprs:
        sig[k] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    md = k.metadata
    return getattr(k, "n_regs", None), getattr(k, "n_spills", None), md.shared


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args()
    flags = dict(MASK_LEFT=False, MASK_RIGHT=True, HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, DOT_FP32=False, PRECISION="tf32", IS_VARLEN=False)
    ptr_ovr = {"Lse": "*fp32", "Delta": "*fp32", "DLse": "*fp32", "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32", "Alibi": "*fp32", "Rng": "*i64"}
    for d, (bm, bn, w, s) in [(128, (128, 128, 8, 2)), (128, (128, 64, 8, 3)), (64, (128, 128, 8, 3)), (256, (64, 64, 4, 2))]:
        ce = dict(flags, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn, REVERSE_M=True)
        print("fwd", d, (bm, bn, w, s), compile_one(flash_fwd._flash_fwd_kernel, "bf16", ce, ptr_ovr, a.arch, w, s), flush=True)
    every = dict(flags, MASK_LEFT=True, HAS_SOFTCAP=True, HAS_ALIBI=True, HAS_DROPOUT=True, IS_VARLEN=True)
    for fn, extra in ((flash_fwd._flash_fwd_kernel, {"REVERSE_M": True}), (flash_bwd._bwd_dkdv_kernel, {}), (flash_bwd._bwd_dq_kernel, {"REVERSE_M": True})):
        ce = dict(every, HEAD_DIM=80, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, **extra)
        print("all-features", fn.__name__, compile_one(fn, "fp16", ce, ptr_ovr, a.arch, 4, 2), flush=True)
    ce = dict(HEAD_DIM=80, BLOCK_D=128, BLOCK_M=64, IS_VARLEN=True, HAS_DLSE=True)
    print("preprocess", compile_one(flash_bwd._bwd_preprocess, "fp16", ce, ptr_ovr, a.arch, 4, 1), flush=True)
    for d, (bm, bn, w, s) in [(128, (32, 128, 8, 2)), (128, (64, 128, 8, 2))]:
        ce = dict(flags, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn)
        print("dkdv", d, (bm, bn, w, s), compile_one(flash_bwd._bwd_dkdv_kernel, "bf16", ce, ptr_ovr, a.arch, w, s), flush=True)
    for d, (bm, bn, w, s) in [(128, (128, 32, 8, 2)), (128, (64, 64, 4, 3))]:
        ce = dict(flags, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn, REVERSE_M=True)
        print("dq", d, (bm, bn, w, s), compile_one(flash_bwd._bwd_dq_kernel, "bf16", ce, ptr_ovr, a.arch, w, s), flush=True)


if __name__ == "__main__":
    main()
