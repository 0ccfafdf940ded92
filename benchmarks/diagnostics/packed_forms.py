"""Packed (varlen) attention through the public function with the kernels of each pass chosen:
which forward and backward forms a head dim's packed calls should take.

    PYTHONPATH=. python benchmarks/diagnostics/packed_forms.py OUT.json --head-dim 64 \\
        --forms triton/triton triton/kv2x64-m64-s2 ws3x4-pp-s3/triton [--rounds 5]

A form is ``FORWARD/BACKWARD``: ``triton`` for the Triton kernel of that pass, or a Gluon variant
name (``attention_fwd.VARIANTS`` / ``attention_bwd.VARIANTS``; it must have a packed build). A
backward variant that leaves dQ to a kernel of its own takes ``+DQ``: ``+triton`` for the Triton
dQ kernel or ``+<name>`` for a Gluon one (``attention_dq.VARIANTS``); without it, the library's
choice (``attention_dq.VARLEN_DEFAULT``). The inputs are benchmarks/attention.py's packed rows
(``packed_inputs``: 12 documents of random lengths, seed 0, in 16K tokens; Hq=32, Hkv=8, bf16;
causal unless ``--non-causal``) and so is the timing (``time_passes``: forward without grad,
backward on a kept graph, forward + backward; ``--rounds`` rounds, the forms taking turns, the
median round). While a form runs, the dispatch tables the public path reads are set for this head
dim (``attention_fwd.VARLEN_DISPATCH_HEAD_DIMS`` and ``VARLEN_DEFAULT`` for the forward,
``attention_bwd.VARLEN_DEFAULT`` for the backward, ``attention_dq.pinned`` for a named dQ
kernel) and restored after; the rows record the paths
and variants the call reported (``interface.attention_paths`` / ``attention_variants``), so a form
that did not take effect shows. Each form's output and gradients are compared with the first
form's (max |difference|: a spot check that the timed call computes the same thing; the tests do
the real checking). TFLOP/s with attention.py's ``packed_flops``.
``--profile N`` adds each form's kernels and their device time per forward + backward call.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks import attention as bench  # noqa: E402

TRITON = "triton"


@contextlib.contextmanager
def packed_form(head_dim: int, causal: bool, fwd: str, bwd: str):
    """Within the block, packed calls of ``head_dim`` run forward ``fwd`` and backward ``bwd``
    (``"triton"`` or a Gluon variant, the latter with ``+DQ`` for its dQ kernel: ``+triton`` or
    a Gluon dQ variant)."""
    from hf_flash.kernels import configs
    from hf_flash.kernels.hopper import attention_bwd, attention_dq, attention_fwd

    key = (head_dim, causal)
    bwd, _, dq = bwd.partition("+")
    saved = (attention_fwd.VARLEN_DISPATCH_HEAD_DIMS, attention_fwd.VARLEN_DEFAULT.get(key),
             attention_bwd.VARLEN_DEFAULT.get(key))  # fmt: skip
    for name, table in ((fwd, attention_fwd.VARIANTS), (bwd, attention_bwd.VARIANTS)):
        if name != TRITON and name not in table:
            raise ValueError(f"unknown variant {name!r}; known: {', '.join(table)}")
    if fwd != TRITON and not attention_fwd.varlen_builds(fwd, causal):
        raise ValueError(f"forward variant {fwd} has no packed form for causal={causal}")
    if bwd != TRITON and not attention_bwd.varlen_builds(bwd):
        raise ValueError(f"backward variant {bwd} has no packed form")
    dims = tuple(d for d in attention_fwd.VARLEN_DISPATCH_HEAD_DIMS if d != head_dim)
    try:
        if fwd != TRITON:
            attention_fwd.VARLEN_DISPATCH_HEAD_DIMS = dims + (head_dim,)
            attention_fwd.VARLEN_DEFAULT[key] = fwd
        else:
            attention_fwd.VARLEN_DISPATCH_HEAD_DIMS = dims
        if bwd != TRITON:
            attention_bwd.VARLEN_DEFAULT[key] = bwd
        else:
            attention_bwd.VARLEN_DEFAULT.pop(key, None)
        pin = attention_dq.pinned(head_dim, dq) if dq else contextlib.nullcontext()
        with pin, configs.use_hopper_varlen(True), configs.use_hopper_backward(True):
            yield
    finally:
        attention_fwd.VARLEN_DISPATCH_HEAD_DIMS = saved[0]
        for table, value in ((attention_fwd.VARLEN_DEFAULT, saved[1]), (attention_bwd.VARLEN_DEFAULT, saved[2])):
            if value is None:
                table.pop(key, None)
            else:
                table[key] = value


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--forms", nargs="+", required=True, help="FORWARD/BACKWARD, each 'triton' or a variant")
    ap.add_argument("--non-causal", action="store_true", help="the documents without causal masking")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-calls", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also run N forward+backward calls of each form under the PyTorch profiler and report "
                         "each kernel's device time per call")  # fmt: skip
    args = ap.parse_args(argv)
    forms = []
    for f in args.forms:
        fwd, sep, bwd = f.partition("/")
        if not sep or not fwd or not bwd:
            raise SystemExit(f"a form is FORWARD/BACKWARD, got {f!r}")
        forms.append((fwd, bwd))

    from hf_flash.interface import attention_paths, attention_variants, varlen_attention

    d = args.head_dim
    lens = bench.packed_lengths()
    q, k, v, dout, cu, max_len = bench.packed_inputs(lens, d)
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    causal = not args.non_causal
    flops = bench.packed_flops(lens, d, causal)

    def attn():
        return varlen_attention(*leaves, cu, cu, max_len, max_len, causal=causal, check_cu_seqlens=False)

    timing = {"warmup_ms": 10.0, "rep_ms": 40.0, "min_calls": args.min_calls}
    info, first = {}, None
    for fwd, bwd in forms:
        name = f"{fwd}/{bwd}"
        with packed_form(d, causal, fwd, bwd):
            paths = attention_paths(*leaves, causal=causal, varlen=True)
            variants = attention_variants(*leaves, causal=causal, varlen=True)
            out = attn()
            grads = torch.autograd.grad(out, leaves, dout)
        res = [out.detach().float(), *(g.float() for g in grads)]
        if first is None:
            first = res
        diff = [float((a - b).abs().max()) for a, b in zip(res, first)]
        info[name] = {"paths": paths, "variants": variants, "max_abs_diff_vs_first": diff}
        print(name, info[name], flush=True)
    times = {f"{fwd}/{bwd}": {} for fwd, bwd in forms}
    for r in range(args.rounds):
        for fwd, bwd in forms if r % 2 == 0 else forms[::-1]:
            with packed_form(d, causal, fwd, bwd):
                res = bench.time_passes(attn, leaves, dout, ("fwd", "bwd", "fwd+bwd"), timing)
            for p, x in res.items():
                times[f"{fwd}/{bwd}"].setdefault(p, []).append(x)
    rows = []
    base = f"{forms[0][0]}/{forms[0][1]}"
    for p in ("fwd", "bwd", "fwd+bwd"):
        for name in times:
            res = bench.median_round(times[name][p])
            row = {"head_dim": d, "causal": causal, "form": name, "pass": p, **info[name], **res}
            if "ms" in res:
                row["tflops"] = flops * bench.PASS_FACTOR[p] / (res["ms"] * 1e-3) / 1e12
                b = bench.median_round(times[base][p])
                row["vs_first"] = b["ms"] / res["ms"] if "ms" in b else None
                row["vs_first_paired"] = bench.paired_ratio(res, b)
            rows.append(row)
            shown = (f"{row['tflops']:6.1f} TFLOP/s  x{row['vs_first']:.3f} (paired {row['vs_first_paired']})"
                     if "ms" in res else str(res))  # fmt: skip
            print(f"d{d} {'causal' if causal else 'full'} {p:8s} {name:40s} {shown}", flush=True)
    profiles = {}
    for fwd, bwd in forms if args.profile else ():
        name = f"{fwd}/{bwd}"
        with packed_form(d, causal, fwd, bwd):
            profiles[name] = kernel_times(lambda: torch.autograd.grad(attn(), leaves, dout), args.profile)
        print(f"{name}: device us per forward+backward call, by kernel", flush=True)
        for kernel, us in profiles[name].items():
            print(f"  {us:9.1f}  {kernel}", flush=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "doc_lengths": lens, "rounds": args.rounds}  # fmt: skip
    Path(args.out).write_text(json.dumps({"env": env, "rows": rows, "kernel_us_per_call": profiles}, indent=1))


def kernel_times(fn, calls: int) -> dict:
    """{kernel name (first 90 characters): device microseconds per call} over ``calls`` calls of
    ``fn`` under the PyTorch profiler (after one call outside it), largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            key = e.name[:90]
            totals[key] = totals.get(key, 0.0) + e.time_range.elapsed_us() / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":
    main()
