"""Build every Gluon attention variant (forward and backward) for sm_90a on a machine without a GPU.

    python -m hf_flash.kernels.hopper.compile_check [--json PATH]

Gluon kernels do not run in Triton's CPU interpreter, so CI checks them by compiling: the launch
arguments are built exactly as the launcher builds them (from CPU tensors, which is enough for
Triton's argument specialisation and for the TMA descriptors' host-side checks), the kernel is
lowered to PTX for sm_90a, and the ptxas bundled with Triton assembles it with ``-v``. The
check works with TRITON_INTERPRET set too (it changes only how ``triton.jit`` functions are
defined; Gluon kernels are always compiled). The report holds registers per thread (the entry register budget; warp-specialised partitions then
move registers with ``setmaxnreg``), spill bytes, shared memory and whether the PTX has the
instructions the design relies on (wgmma, TMA copies, setmaxnreg).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

from . import attention_bwd, attention_dq, attention_fwd

SHARED_PER_SM = 227 * 1024
REGISTERS_PER_SM = 65536
TARGET = GPUTarget("cuda", 90, 32)
# the sequence length of the dummy launch only decides integer-argument specialisation
SEQLEN = 4096


def ptxas_path() -> str:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not path.is_file():
        raise FileNotFoundError(f"no ptxas in the Triton installation ({path})")
    return str(path)


def _unwritten_schedule(tokens: int, batch: int, rows: int) -> torch.Tensor:
    """A packed launch's work items as the kernel sees them when compiling: an int32 (N, 2)
    tensor (the schedule kernel itself needs a device or the interpreter; its values do not
    change what is compiled)."""
    return torch.empty((attention_fwd.schedule_slots(tokens, batch, rows), 2), dtype=torch.int32)


def compile_sm90(kernel, args, kwargs):
    """Compile a Gluon kernel for sm_90a as ``kernel[grid](*args, **kwargs)`` would, without a
    GPU: the JIT's own binder computes the signature and specialisation for the target."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    src = GluonASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__)


def _ptxas_report(ptx: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        return subprocess.run(
            [ptxas_path(), "-arch=sm_90a", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip


BWD_PREFIX = "bwd:"
VARLEN_PREFIX = "varlen:"
BWD_VARLEN_PREFIX = "bwd-varlen:"
DQ_PREFIX = "dq:"
DQ_VARLEN_PREFIX = "dq-varlen:"


# the masks a spec's optional fifth element names: a sliding window on both sides (one side when
# causal), a softcap, or both (the forms the window and softcap builds of the kernels compile)
FEATURES = {
    "": {},
    "window": {"window": (256, 256)},
    "softcap": {"softcap": 30.0},
    "window-softcap": {"window": (256, 256), "softcap": 30.0},
}


def _masks(features: str, causal: bool) -> dict:
    opts = dict(FEATURES[features])
    if "window" in opts and causal:
        opts["window"] = (opts["window"][0], 0)
    return opts


def compile_variant(variant: str, head_dim: int, causal: bool, dtype=torch.bfloat16, features: str = ""):
    """Compile one variant for sm_90a as its launcher would launch it: (the compiled kernel, its
    variant record, rows per program, keys per block). ``variant`` names an entry of
    ``attention_fwd.VARIANTS`` (its packed form behind ``"varlen:"``), or of
    ``attention_bwd.VARIANTS`` behind ``"bwd:"`` (its packed form behind ``"bwd-varlen:"``), or of
    ``attention_dq.VARIANTS`` behind ``"dq:"`` (packed: ``"dq-varlen:"``);
    ``features`` a key of ``FEATURES`` (the masks compiled in)."""
    masks = _masks(features, causal)
    batch, nheads, nheads_k = 2, 8, 2
    q = torch.empty(batch, SEQLEN, nheads, head_dim, dtype=dtype)
    k = torch.empty(batch, SEQLEN, nheads_k, head_dim, dtype=dtype)
    v = torch.empty_like(k)
    out = torch.empty_like(q)
    lse = torch.empty(batch, nheads, SEQLEN, dtype=torch.float32)
    if variant.startswith((DQ_PREFIX, DQ_VARLEN_PREFIX)):
        var = attention_dq.VARIANTS[variant.split(":", 1)[1]]
        if variant.startswith(DQ_VARLEN_PREFIX):
            # the batch's sequences packed: (B * S, H, D), lse/delta (H, B * S)
            cu = torch.arange(0, (batch + 1) * SEQLEN, SEQLEN, dtype=torch.int32)
            qp = q.flatten(0, 1)
            lse_p = lse.transpose(0, 1).reshape(nheads, batch * SEQLEN)
            _, args, kwargs = attention_dq.launch_args(
                qp, k.flatten(0, 1), v.flatten(0, 1), out.flatten(0, 1), lse_p, torch.empty_like(lse_p),
                torch.empty_like(qp), softmax_scale=head_dim**-0.5, causal=causal, variant=var.name,
                cu_seqlens_q=cu, cu_seqlens_k=cu, sched=_unwritten_schedule(qp.shape[0], batch, var.rows), **masks,
            )  # fmt: skip
        else:
            _, args, kwargs = attention_dq.launch_args(
                q, k, v, out, lse, torch.empty_like(lse), torch.empty_like(q), softmax_scale=head_dim**-0.5,
                causal=causal, variant=var.name, **masks,
            )  # fmt: skip
        compiled = compile_sm90(attention_dq._attn_dq_kernel, args, kwargs)
        rows, block_n = var.rows, var.block_n
    elif variant.startswith(BWD_VARLEN_PREFIX):
        var = attention_bwd.VARIANTS[variant[len(BWD_VARLEN_PREFIX):]]
        # the batch's sequences packed: (B * S, H, D), lse/delta (H, B * S)
        cu = torch.arange(0, (batch + 1) * SEQLEN, SEQLEN, dtype=torch.int32)
        qp, kp = q.flatten(0, 1), k.flatten(0, 1)
        lse_p = lse.transpose(0, 1).reshape(nheads, batch * SEQLEN)
        _, args, kwargs = attention_bwd.launch_args(
            qp, kp, v.flatten(0, 1), out.flatten(0, 1), lse_p, torch.empty_like(lse_p), torch.empty_like(kp),
            torch.empty_like(kp), attention_bwd.dq_accum_for(qp, var.name) if var.dq_atomic else None,
            torch.zeros(attention_bwd.dq_sem_count(qp, var.name, cu), dtype=torch.int32),
            softmax_scale=head_dim**-0.5, causal=causal, variant=var.name, cu_seqlens_q=cu, cu_seqlens_k=cu,
            sched=_unwritten_schedule(kp.shape[0], batch, var.keys), **masks,
        )  # fmt: skip
        compiled = compile_sm90(attention_bwd.kernel_for(var.name), args, kwargs)
        rows, block_n = var.keys, var.block_m
    elif variant.startswith(BWD_PREFIX):
        var = attention_bwd.VARIANTS[variant[len(BWD_PREFIX):]]
        stats = torch.empty(attention_bwd.stats_numel(batch, nheads, SEQLEN, var.block_m)) if var.stats_smem else None
        tail = None
        if var.tail_split and not causal and not masks:
            # the pieced form (the whole-unit one is the variant without tail_split): the last
            # unit in two pieces
            n_units = batch * nheads_k * -(-SEQLEN // var.keys)
            tail = (n_units - 1, 2, *attention_bwd.tail_buffers(1, 2, var.keys, head_dim, "cpu"))
        _, args, kwargs = attention_bwd.launch_args(
            q, k, v, out, lse, torch.empty_like(lse), torch.empty_like(k), torch.empty_like(k),
            attention_bwd.dq_accum_for(q, var.name) if var.dq_atomic else None,
            torch.zeros(attention_bwd.dq_sem_count(q, var.name), dtype=torch.int32), stats,
            softmax_scale=head_dim**-0.5, causal=causal, variant=var.name, tail=tail, **masks,
        )  # fmt: skip
        compiled = compile_sm90(attention_bwd.kernel_for(var.name), args, kwargs)
        rows, block_n = var.keys, var.block_m
    elif variant.startswith(VARLEN_PREFIX):
        var = attention_fwd.VARIANTS[variant[len(VARLEN_PREFIX):]]
        # the batch's sequences packed: (B * S, H, D), lse (H, B * S)
        cu = torch.arange(0, (batch + 1) * SEQLEN, SEQLEN, dtype=torch.int32)
        _, args, kwargs = attention_fwd.launch_args(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), out.flatten(0, 1),
            lse.transpose(0, 1).reshape(nheads, batch * SEQLEN), softmax_scale=head_dim**-0.5, causal=causal,
            variant=var.name, cu_seqlens_q=cu, cu_seqlens_k=cu,
            sched=_unwritten_schedule(batch * SEQLEN, batch, var.rows), **masks,
        )  # fmt: skip
        compiled = compile_sm90(attention_fwd._attn_fwd_kernel, args, kwargs)
        rows, block_n = var.rows, var.block_n
    else:
        var = attention_fwd.VARIANTS[variant]
        _, args, kwargs = attention_fwd.launch_args(
            q, k, v, out, lse, softmax_scale=head_dim**-0.5, causal=causal, variant=variant, **masks
        )
        compiled = compile_sm90(attention_fwd._attn_fwd_kernel, args, kwargs)
        rows, block_n = var.rows, var.block_n
    return compiled, var, rows, block_n


def check_variant(variant: str, head_dim: int, causal: bool, dtype=torch.bfloat16, features: str = "") -> dict:
    """Compile one variant (:func:`compile_variant`) and return its resource report."""
    compiled, var, rows, block_n = compile_variant(variant, head_dim, causal, dtype, features)
    ptx = compiled.asm["ptx"]
    report = _ptxas_report(ptx)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spill_stores = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    spill_loads = int(re.search(r"(\d+) bytes spill loads", report).group(1))
    stack = int(re.search(r"(\d+) bytes stack frame", report).group(1))
    shared = int(compiled.metadata.shared)
    setmaxnreg = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
    return {
        "variant": variant, "head_dim": head_dim, "causal": causal, "dtype": str(dtype).replace("torch.", ""),
        "features": features,
        "rows_per_program": rows, "block_n": block_n, "stages": var.stages,
        "warps": int(compiled.metadata.num_warps), "registers": registers,
        "spill_store_bytes": spill_stores, "spill_load_bytes": spill_loads, "stack_bytes": stack,
        "shared_bytes": shared, "programs_per_sm_by_shared": SHARED_PER_SM // max(shared, 1),
        "setmaxnreg": setmaxnreg,
        # ptxas's C7514: non-wgmma code reads a running product's accumulator registers, so it
        # waits for every wgmma right after issuing it (no overlap anywhere in the kernel)
        "wgmma_serialized": "C7514" in report,
        "wgmma": ptx.count("wgmma.mma_async"), "tma_loads": ptx.count("cp.async.bulk.tensor"),
        "tma_reduces": len(re.findall(r"cp\.reduce\.async\.bulk\.tensor\S*\.add", ptx)),
        "tma_stores": len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)),
    }  # fmt: skip


def _check_spec(spec):
    variant, head_dim, causal, dtype_name, *features = spec
    return check_variant(variant, head_dim, causal, getattr(torch, dtype_name), *features)


def check_many(specs, processes: int = 2) -> list[dict]:
    """Compile (variant, head_dim, causal, dtype name[, features]) specs in fresh processes.

    Fresh (spawned) processes with TRITON_INTERPRET=0, because Gluon's own helper functions
    (``gl.sum``, ``gl.cdiv``...) are ``triton.jit`` functions: a process that imported Gluon with
    the interpreter on (as the CPU test suite does) cannot compile Gluon kernels."""
    import concurrent.futures
    import multiprocessing
    import os

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as pool:
            return list(pool.map(_check_spec, specs))
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _head_dims(name):
    if name.startswith((DQ_PREFIX, DQ_VARLEN_PREFIX)):
        return attention_dq.VARIANTS[name.split(":", 1)[1]].head_dims
    if name.startswith(BWD_VARLEN_PREFIX):
        return attention_bwd.VARIANTS[name[len(BWD_VARLEN_PREFIX):]].head_dims
    if name.startswith(BWD_PREFIX):
        return attention_bwd.VARIANTS[name[len(BWD_PREFIX):]].head_dims
    return attention_fwd.VARIANTS[name.removeprefix(VARLEN_PREFIX)].head_dims


def varlen_variants():
    """The packed (varlen) form of every forward variant that has one (the non-persistent ones;
    ``attention_fwd.varlen_builds`` says for which causality)."""
    return [VARLEN_PREFIX + name for name, var in attention_fwd.VARIANTS.items() if not var.persistent]


def bwd_varlen_variants():
    """The packed (varlen) form of the backward variants packed calls run
    (``attention_bwd.VARLEN_DEFAULT`` and ``VARLEN_NONDETERMINISTIC``) and of the ordered fused
    one (dqwld)."""
    names = [*attention_bwd.VARLEN_DEFAULT.values(), *attention_bwd.VARLEN_NONDETERMINISTIC.values(),
             "kv2x64-m64-s2-dqwld"]  # fmt: skip
    return [BWD_VARLEN_PREFIX + name for name in dict.fromkeys(names)]


def all_variants():
    """Every forward variant, its packed form as ``"varlen:<name>"``, then every backward (dK/dV)
    variant as ``"bwd:<name>"`` and the packed backward as ``"bwd-varlen:<name>"``, then every dQ
    variant, dense (``"dq:<name>"``) and, where it has a packed build, packed
    (``"dq-varlen:<name>"``)."""
    return [
        *attention_fwd.VARIANTS, *varlen_variants(), *(BWD_PREFIX + name for name in attention_bwd.VARIANTS),
        *bwd_varlen_variants(), *(DQ_PREFIX + name for name in attention_dq.VARIANTS),
        *(DQ_VARLEN_PREFIX + name for name, var in attention_dq.VARIANTS.items() if var.packed),
    ]  # fmt: skip


def all_specs(variants=None, head_dims=attention_fwd.HEAD_DIMS, dtypes=("bfloat16", "float16")):
    return [
        (name, d, causal, dt)
        for name in variants or all_variants()
        for d in head_dims
        if d in _head_dims(name)
        for causal in (False, True)
        if not name.startswith(VARLEN_PREFIX) or attention_fwd.varlen_builds(name[len(VARLEN_PREFIX):], causal)
        for dt in dtypes
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="also write the reports to this file")
    ap.add_argument("--variants", nargs="*", default=None)
    ap.add_argument("--fp16", action="store_true", help="also build float16 (bfloat16 only by default)")
    ap.add_argument("--processes", type=int, default=2)
    args = ap.parse_args(argv)
    dtypes = ("bfloat16", "float16") if args.fp16 else ("bfloat16",)
    rows = check_many(all_specs(args.variants, dtypes=dtypes), processes=args.processes)
    for r in rows:
        print(
            f"{r['variant']:26s} d{r['head_dim']:<4d} {'causal' if r['causal'] else 'full':6s} {r['dtype']:9s} "
            f"regs {r['registers']:3d} spill {r['spill_store_bytes']:4d}/{r['spill_load_bytes']:<4d} "
            f"stack {r['stack_bytes']:4d} smem {r['shared_bytes']:6d} setmaxnreg {r['setmaxnreg']} "
            f"wgmma {r['wgmma']} tma {r['tma_loads']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
