"""Smoke check of one Gluon Hopper backward variant on the GPU: dQ, dK and dV of a GQA call with
ragged lengths (1025 queries, 1100 keys), causal and not, against the fp32 oracle with the error
rule of hf_flash.reference. Prints one line per gradient; exits 0 when every one is within it.

    python benchmarks/diagnostics/hopper_bwd_smoke.py VARIANT [--window LEFT]

``--window LEFT``: with a sliding window, (LEFT, 0) causal and (LEFT, LEFT // 2) not (a wrong
turn in the ordered dQ's counters shows as a hang, which the time limit catches).

The device scripts (benchmarks/hopper_bwd_device_run.sh, hopper_bwd_candidates_device_run.sh) run
it per variant in its own process under a time limit, so a variant that hangs cannot take the
run with it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_flash.kernels import flash_bwd, flash_fwd  # noqa: E402
from hf_flash.kernels.hopper import attention_bwd as hb  # noqa: E402
from hf_flash.reference import GRAD_FACTOR, allowed_error, attention_ref, max_abs_err  # noqa: E402


def main(variant: str, left: int = -1) -> int:
    if variant not in hb.VARIANTS:
        print(f"unknown variant {variant!r}; known: {' '.join(hb.VARIANTS)}", file=sys.stderr)
        return 2
    with hb.pinned(variant):
        return _run(variant, left)


def _run(variant: str, left: int) -> int:
    worst = 0.0
    for d in hb.VARIANTS[variant].head_dims:
        for causal in (False, True):
            q = torch.randn(2, 1025, 8, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(2, 1100, 2, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            dout = torch.randn_like(q)
            window = (left, 0 if causal else (left // 2 if left >= 0 else -1))
            opts = dict(softmax_scale=d**-0.5, causal=causal, window_left=window[0], window_right=window[1],
                        softcap=0.0, alibi_slopes=None, dropout_p=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                        max_seqlen_q=1025, max_seqlen_k=1100, rng_state=None)  # fmt: skip
            out = torch.empty_like(q)
            lse = torch.empty(2, 8, 1025, device="cuda")
            flash_fwd.flash_attn_forward(q, k, v, out, lse, **opts)
            dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
            assert flash_bwd.backward_path(q, k, v, out, dout, dk, dv, varlen=False, **opts) == "hopper"
            flash_bwd.flash_attn_backward(dout, None, q, k, v, out, lse, dq, dk, dv, **opts)
            torch.cuda.synchronize()
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref_opts = dict(causal=causal, window_size=window)
            g = torch.autograd.grad(attention_ref(*leaves, **ref_opts), leaves, dout.float())
            glp = torch.autograd.grad(attention_ref(*leaves, upcast=False, **ref_opts), leaves, dout)
            for name, a, r, lp in zip(("dq", "dk", "dv"), (dq, dk, dv), g, glp):
                err, budget = max_abs_err(a, r), max_abs_err(lp, r)
                print(f"{variant} d{d} causal={causal} window={window} {name}: err {err:.2e} "
                      f"(bf16 reference {budget:.2e})", flush=True)  # fmt: skip
                worst = max(worst, err / allowed_error(budget, GRAD_FACTOR, torch.bfloat16))
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant")
    ap.add_argument("--window", type=int, default=-1, help="left window (default: none)")
    a = ap.parse_args()
    sys.exit(main(a.variant, a.window))
