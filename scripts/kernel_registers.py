"""Registers, spills and shared memory of the attention kernels' Hopper builds, on any machine.

    python scripts/kernel_registers.py [--head-dims 64 128] [--json]

Compiles the forward, dK/dV and dQ kernels with the tiles ``hf_flash.kernels.configs`` picks for
an H100 (sm_90a), dense and packed (varlen), bf16, causal, and runs the ptxas that ships with
Triton with ``-v``. No GPU is needed, so a change that costs occupancy shows up before a device
run. Programs per SM are bounded by registers (65,536 per SM, allocated per warp in units of 256)
and by shared memory (227 KB per SM on an H100).

Found with it: the packed forward at head dim 64 took 143 registers per thread (the dense one
124), so one 8-warp program ran per SM instead of two and it was 1.3x slower than the dense
forward at S = 32K; the config now caps packed launches at 128 (``packed_maxnreg``).

Set TRITON_INTERPRET=0 (the tests' interpreter mode replaces the kernels with Python objects).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 227 * 1024
SEQLEN = 32768  # for the dense launch's integer arguments (divisibility specialisation)


def _ptxas() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not path.is_file():
        raise SystemExit(f"no ptxas in the Triton installation ({path})")
    return str(path)


def _int_value(name: str, varlen: bool, head_dim: int) -> int:
    """The value a launch passes for an integer argument (only its divisibility matters)."""
    if name.startswith("stride") and name.endswith("b"):
        return 0 if varlen else SEQLEN * 32 * head_dim
    if name in ("seqlen_q", "seqlen_k"):
        return 0 if varlen else SEQLEN
    return {"window_left": -1, "window_right": 0, "stride_ab": 0, "group": 4, "nheads": 32,
            "nheads_k": 8}.get(name, 8 * head_dim)


def compile_kernel(kernel, cfg: dict, head_dim: int, varlen: bool) -> dict:
    """Build ``kernel`` for sm_90a as the launchers would (bf16, causal) and read ptxas' report."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    flags = dict(
        HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        IS_VARLEN=varlen, MASK_LEFT=False, MASK_RIGHT=True, HAS_SOFTCAP=False, HAS_ALIBI=False,
        HAS_DROPOUT=False, REVERSE_M=True, DOT_FP32=False, PRECISION="tf32",
    )
    pointer_types = {"Lse": "*fp32", "Delta": "*fp32", "Alibi": "*fp32", "CuSeqlensQ": "*i32",
                     "CuSeqlensK": "*i32", "Rng": "*i64"}
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in flags:
            signature[name], constants[(i,)] = "constexpr", flags[name]
        elif name[0].isupper():  # tensors
            signature[name] = pointer_types.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "softcap", "dropout_p"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            value = _int_value(name, varlen, head_dim)
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    from hf_flash.kernels.configs import launch_options

    options = launch_options(cfg, varlen)
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
        target=GPUTarget("cuda", 90, 32), options=options,
    )
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run(
            [_ptxas(), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    shared = int(compiled.metadata.shared)
    per_warp = -(-registers * 32 // 256) * 256
    return {
        "registers": registers, "spill_bytes": spills, "shared_bytes": shared,
        "programs_per_sm_by_registers": REGISTERS_PER_SM // (per_warp * cfg["num_warps"]),
        "programs_per_sm_by_shared": SHARED_PER_SM // max(shared, 1),
    }


def report(head_dims) -> list[dict]:
    import torch

    from hf_flash.kernels import configs
    from hf_flash.kernels.flash_bwd import _bwd_dkdv_kernel, _bwd_dq_kernel
    from hf_flash.kernels.flash_fwd import _flash_fwd_kernel

    hopper = torch.device("cuda", 0)
    configs_capability = configs._capability
    configs._capability = lambda device: (9, 0)  # pick the H100 entries without a GPU
    try:
        rows = []
        for d in head_dims:
            fwd = configs.fwd_config(d, torch.bfloat16, hopper)
            dkdv, dq = configs.bwd_configs(d, torch.bfloat16, hopper)
            for name, kernel, cfg in (("fwd", _flash_fwd_kernel, fwd), ("bwd_dkdv", _bwd_dkdv_kernel, dkdv),
                                      ("bwd_dq", _bwd_dq_kernel, dq)):
                for varlen in (False, True):
                    row = {"kernel": name, "head_dim": d, "varlen": varlen, "config": cfg,
                           **compile_kernel(kernel, cfg, d, varlen)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        return rows
    finally:
        configs._capability = configs_capability


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("set TRITON_INTERPRET=0: the interpreter does not build kernels")
    rows = report(args.head_dims)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
