"""Registers, spills and shared memory of the attention kernels' Hopper builds, on any machine.

    PYTHONPATH=. python benchmarks/diagnostics/kernel_registers.py [--head-dims 64 128] [--json OUT]
    PYTHONPATH=. python benchmarks/diagnostics/kernel_registers.py --all-features

Compiles the forward, dK/dV and dQ kernels with the tiles ``hf_flash.kernels.configs`` picks for
an H100 (sm_90a), dense and packed (varlen), bf16, causal, and runs the ptxas that ships with
Triton with ``-v``. ``--all-features`` instead builds every feature at once (left window, softcap,
ALiBi, dropout, packed) at a padded head dim (80 in a 128-wide block), fp16, plus the backward
preprocess kernel: the builds no benchmark shape exercises, checked to compile for sm_90a. No GPU is needed, so a change that costs occupancy shows up before a device
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
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

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


def compile_kernel(kernel, cfg: dict, head_dim: int, varlen: bool, dtype: str = "bf16",
                   features: dict | None = None) -> dict:
    """Build ``kernel`` for sm_90a as the launchers would (bf16, causal unless ``features``
    overrides a constexpr) and read ptxas' report."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    flags = dict(
        HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg.get("BLOCK_N"),
        IS_VARLEN=varlen, MASK_LEFT=False, MASK_RIGHT=True, HAS_SOFTCAP=False, HAS_ALIBI=False,
        HAS_DROPOUT=False, REVERSE_M=True, DOT_FP32=False, PRECISION="tf32", HAS_DLSE=False,
        HAS_SINKS=False, ROW_BOUNDS=False, STATS_M=0,
    )
    flags.update(features or {})
    pointer_types = {"Lse": "*fp32", "Delta": "*fp32", "DLse": "*fp32", "Alibi": "*fp32",
                     "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32", "Rng": "*i64", "Sinks": "*fp32",
                     "KeyBounds": "*i32", "QueryRuns": "*i32", "Stats": "*fp32"}
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in flags:
            signature[name], constants[(i,)] = "constexpr", flags[name]
        elif name[0].isupper():  # tensors
            signature[name] = pointer_types.get(name, f"*{dtype}")
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
    per_warp = -(-registers * 32 // 256) * 256  # allocated per warp in units of 256
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


def report_all_features() -> list[dict]:
    """Every feature on in one build (what ``--all-features`` prints): a compile check of the
    flag combinations the tuned shapes never build, with the tiles configs picks for them."""
    import torch

    from hf_flash.kernels import configs
    from hf_flash.kernels.flash_bwd import _bwd_dkdv_kernel, _bwd_dq_kernel, _bwd_preprocess
    from hf_flash.kernels.flash_fwd import _flash_fwd_kernel

    head_dim, hopper = 80, torch.device("cuda", 0)
    every = dict(BLOCK_D=configs.head_dim_block(head_dim), MASK_LEFT=True, HAS_SOFTCAP=True,
                 HAS_ALIBI=True, HAS_DROPOUT=True, HAS_DLSE=True, HAS_SINKS=True)
    configs_capability = configs._capability
    configs._capability = lambda device: (9, 0)
    try:
        fwd = configs.fwd_config(head_dim, torch.float16, hopper)
        dkdv, dq = configs.bwd_configs(head_dim, torch.float16, hopper)
        # the launcher's fixed tile (flash_bwd.py: BLOCK_M 64, Triton's default warps and stages)
        preprocess = {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3}
        rows = []
        for name, kernel, cfg in (("fwd", _flash_fwd_kernel, fwd), ("bwd_dkdv", _bwd_dkdv_kernel, dkdv),
                                  ("bwd_dq", _bwd_dq_kernel, dq), ("bwd_preprocess", _bwd_preprocess, preprocess)):
            row = {"kernel": name, "head_dim": head_dim, "varlen": True, "features": "all", "config": cfg,
                   **compile_kernel(kernel, cfg, head_dim, True, "fp16", every)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        return rows
    finally:
        configs._capability = configs_capability


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--all-features", action="store_true",
                    help="instead: every feature in one build (head dim 80, fp16, packed)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("set TRITON_INTERPRET=0: the interpreter does not build kernels")
    rows = report_all_features() if args.all_features else report(args.head_dims)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
