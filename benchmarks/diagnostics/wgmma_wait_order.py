"""Where ptxas puts the backward consumers' dP^T wait against the P exponentials (no GPU needed).

    PYTHONPATH=. python benchmarks/diagnostics/wgmma_wait_order.py \\
        [--variants kv2x64-m64-s2-dqwldfp kv2x64-m64-s2-dqwldfps] [--head-dim 128] [--json OUT]

The Gluon backward's consumer issues S^T = K Q^T and dP^T = V dO^T back to back, waits for S^T
alone (``warpgroup_mma_wait(1)``), computes P^T = exp2(S^T * scale - lse) and only then waits for
dP^T (``warpgroup_mma_wait(0)``), so the exponentials run under the dP^T product. The PTX keeps
that order, but ptxas schedules the SASS freely: it may move the wait for all products
(``WARPGROUP.DEPBAR.LE gsb0, 0x0``) above the ``MUFU.EX2`` instructions, and then P is computed
after dP^T has landed, not under it. This compiles each variant for sm_90a (as
``hf_flash.kernels.hopper.compile_check`` does), disassembles the cubin with Triton's nvdisasm
and, for each S^T/dP^T product pair in the SASS (one per consumer code path), counts the
exponentials placed between the S^T wait and the wait for all (under dP^T) and after it.

Found with it (Triton 3.6's ptxas): with one exp2 after the step's mask branch, d128 causal
builds without ``stats_smem`` keep all 32 exponentials per thread under dP^T; non-causal builds
keep them in one consumer's code path and none in the other's (dqwldfp: 1 and 0); every
``stats_smem`` build keeps 1-9. Tying P to the wait (``deps=(dpt, p_op)``) or reading lse before
the S^T wait changed nothing or made it worse. The ``exp_per_branch`` variants (an exp2 in each
arm of the branch) keep all of them under dP^T in both paths; both arms lie between the two
waits, so they count 64 (32 per arm). Timed on an H200, that order gains causal (the stats form)
and loses 6-8% non-causal; this tool shows the SASS, the timings live in .notes/hopper-bwd.md.
It also counts the shared loads (LDS) issued between a pair's first k-step and its S^T wait: 0 in
the ``stats_smem`` builds that read lse after that wait, 16 (lse and delta, LDS.64 each) in the
``stats_early`` ones, whose loads then complete under the products.

Set TRITON_INTERPRET=0 (the tests' interpreter mode replaces Triton's kernels with Python objects).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from hf_flash.kernels.hopper import attention_bwd, compile_check  # noqa: E402

DEFAULT_VARIANTS = (
    "kv2x64-m64-s2-dqwldf", "kv2x64-m64-s2-dqwldfp", "kv2x64-m64-s2-dqwldfps", "kv2x64-m64-s2-dqwldfpsx",
    "kv2x64-m64-s2-dqwlf", "kv2x64-m64-s2-dqwldfpsbrr", "kv2x64-m64-s2-dqwldfpsxa", "kv2x64-m64-s2-dqwldfpsxa-dn",
)
_EVENTS = (
    ("ex2", re.compile(r"\bMUFU\.EX2\b")),
    ("wait1", re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b")),
    ("wait0", re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b")),
    # S^T and dP^T: the products with A from shared memory, not transposed (dV and dK take P^T and
    # dS^T from registers; dQ reads dS^T transposed)
    ("pair_end", re.compile(r"HGMMA\.64x\d+x16\.F32\.\w+ R\d+, gdesc\[UR\d+\](?!\.tnsp)[^;]*\bgsb0\b")),
    # the first k-step of a product with A from shared memory (zero accumulator)
    ("start", re.compile(r"HGMMA\.64x\d+x16\.F32\.\w+ R\d+, gdesc\[UR\d+\](?!\.tnsp), RZ, !UPT")),
    # shared loads into registers (the stats_smem forms' lse/delta; not LDSM)
    ("lds", re.compile(r"\bLDS(\.[A-Z0-9]+)* R")),
)


def sass(cubin: bytes) -> str:
    nvdisasm = Path(compile_check.ptxas_path()).with_name("nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True, text=True, check=True).stdout


def exp_placement(text: str) -> list[dict]:
    """Per S^T/dP^T product pair: shared loads issued between the pair's first k-step and its
    S^T wait (``lds_under_st``: in flight while the products run), exponentials between its S^T wait and
    its wait for all (``under_dp``) and between that wait and the next product pair (``after``)."""
    events = []
    for line in text.splitlines():
        for name, pattern in _EVENTS:
            if pattern.search(line):
                events.append(name)
                break
    pairs, i = [], 0
    while i < len(events):
        # a pair ends with the second product's gsb0 and is followed by its wait for S^T
        # (shared loads may sit between the two)
        k = i + 1
        while events[i] == "pair_end" and k < len(events) and events[k] == "lds":
            k += 1
        if events[i] == "pair_end" and k < len(events) and events[k] == "wait1":
            # the shared loads issued since the pair's first product started
            starts, b = 0, i - 1
            while b >= 0 and starts < 2:
                starts += events[b] == "start"
                b -= 1
            lds = events[b + 1:k].count("lds")
            under, after, j = 0, 0, k + 1
            while j < len(events) and events[j] != "wait0":
                under += events[j] == "ex2"
                j += 1
            j += 1
            while j < len(events) and events[j] != "pair_end":
                after += events[j] == "ex2"
                j += 1
            pairs.append({"lds_under_st": lds, "under_dp": under, "after": after})
            i = j
        else:
            i += 1
    return pairs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", type=Path, help="write the records here")
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants if v not in attention_bwd.VARIANTS or attention_bwd.VARIANTS[v].split_d]
    if unknown:
        ap.error(f"not transposed-frame backward variants: {unknown}; choose from "
                 f"{[n for n, v in attention_bwd.VARIANTS.items() if not v.split_d]}")  # fmt: skip
    records = []
    for name in args.variants:
        if args.head_dim not in attention_bwd.VARIANTS[name].head_dims:
            ap.error(f"{name} is built for head dims {attention_bwd.VARIANTS[name].head_dims}, not {args.head_dim}")
        for causal in (False, True):
            compiled, *_ = compile_check.compile_variant("bwd:" + name, args.head_dim, causal, torch.bfloat16)
            pairs = exp_placement(sass(compiled.asm["cubin"]))
            records.append({"variant": name, "head_dim": args.head_dim, "causal": causal, "pairs": pairs})
            shown = ", ".join(f"{p['under_dp']} under dP^T / {p['after']} after (shared loads before the S^T "
                              f"wait: {p['lds_under_st']})" for p in pairs)
            print(f"{name:28s} {'causal' if causal else 'full  '} exponentials per code path: {shown}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
