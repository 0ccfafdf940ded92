"""How long a context one GPU trains: the LoRA recipe with its memory planner, per model shape.

For each shape (the random-weight 1.2B and 8B Llama shapes of docs/design.md, bf16 weights, LoRA
r=16 on every projection, batch 1, YaRN) and each length, the recipe runs in a fresh process with
``memory_plan: auto`` and reports tokens/s, the peak device memory against the plan's prediction,
the peak host memory, and the plan it chose. A length is skipped once a shorter or equal one of the same shape failed.

Beside the runs it measures, in the same process and call, the rates the step is made of:
hf_flash's attention forward and forward+backward (causal, the shape's heads, 64K tokens) and a bf16
GEMM of the MLP's size. From them it predicts each step's time (attention and GEMM FLOPs only,
counting the recomputation and the tiled MLP's extra forward) and reports measured/predicted.

    python benchmarks/long_context_search.py --points llama-8b:131072,llama-8b:262144 --out OUT
    python benchmarks/long_context_search.py --points llama-1.2b:524288 --steps 1 --out OUT

Steps: ``--steps`` optimiser steps per point (default 2; tokens/s leaves the first out unless
there is only one, in which case it includes the first step's compilation and autotuning, and
the row says ``first_step_included``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.e2e_finetune import SHAPES, COMMON, run_recipe, write_data, write_shape  # noqa: E402
from benchmarks.harness import write_results  # noqa: E402


def _time_ms(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def kernel_rates(shape: dict, tokens: int = 65536) -> dict:
    """TFLOP/s of hf_flash's causal attention (forward; forward+backward) at ``tokens`` tokens with
    the shape's heads, and of a bf16 GEMM (8192 x hidden @ hidden x intermediate)."""
    from hf_flash import flash_attn_func

    h, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    q = torch.randn(1, tokens, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, tokens, kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    flops_fwd = 2 * tokens * tokens * heads * d  # causal: half of 4 S^2 H d
    fwd_ms = _time_ms(lambda: flash_attn_func(q, k, v, causal=True))
    g = torch.randn(1, tokens, heads, d, device="cuda", dtype=torch.bfloat16)
    both_ms = _time_ms(lambda: flash_attn_func(q, k, v, causal=True).backward(g))
    a = torch.randn(8192, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(h, shape["intermediate_size"], device="cuda", dtype=torch.bfloat16)
    gemm_ms = _time_ms(lambda: a @ w, reps=10)
    return {
        "attn_fwd_tflops": flops_fwd / fwd_ms / 1e9,
        "attn_fwd_bwd_tflops": 3.5 * flops_fwd / both_ms / 1e9,  # backward = 2.5 forwards
        "gemm_tflops": 2 * 8192 * h * shape["intermediate_size"] / gemm_ms / 1e9,
        "rate_tokens": tokens,
    }


def predicted_step_s(shape: dict, tokens: int, checkpointing: str, tiled: bool, rates: dict) -> float:
    """Attention and GEMM time of one step at the measured rates. Attention: forward + backward,
    plus the recomputed forward unless the outputs are kept. GEMMs (frozen weights: the backward
    computes input gradients only): forward, recomputation and backward; the tiled MLP runs its
    forward once more; the LM head forward and backward once."""
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    vocab = shape.get("vocab_size", COMMON["vocab_size"])
    fwd = 2 * tokens * tokens * heads * d
    recompute = 0 if checkpointing in ("none", "keep_attention") else 1
    # the fwd+bwd rate covers forward and backward together: backward time = both - forward
    attn_s = layers * (fwd * recompute / (rates["attn_fwd_tflops"] * 1e12)
                       + 3.5 * fwd / (rates["attn_fwd_bwd_tflops"] * 1e12))  # fmt: skip
    attn_proj = 2 * tokens * (2 * h * h + 2 * h * kv * d)
    mlp = 2 * tokens * 3 * h * i
    passes = 2 + (1 if checkpointing != "none" else 0)  # forward, backward (dX), recomputation
    gemm = layers * (attn_proj * passes + mlp * (passes + (1 if tiled else 0))) + 2 * 2 * tokens * h * vocab
    return attn_s + gemm / (rates["gemm_tflops"] * 1e12)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", required=True, help="shape:tokens,... e.g. llama-8b:262144")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=int, default=560, help="seconds per point")
    p.add_argument("--fixed", action="store_true", help="also run memory_plan fixed (today's recipe) per point")
    p.add_argument("--liger", choices=("auto", "true", "false", "both"), default="auto",
                   help="the recipe's liger_norm_mlp (Liger-Kernel's RMSNorm and SwiGLU; auto: where "
                        "installed); both: each point with and without, side by side")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    points = []
    for item in args.points.split(","):
        name, tokens = item.split(":")
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r}; choose from {sorted(SHAPES)}")
        points.append((name, int(tokens)))
    rates = {name: kernel_rates({**COMMON, **SHAPES[name]}) for name in dict.fromkeys(n for n, _ in points)}
    print(json.dumps(rates, indent=1), flush=True)
    rows, failed = [], {}  # shape -> the shortest length that failed
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, tokens in points:
            if tokens >= failed.get(name, float("inf")):
                rows.append({"shape": name, "tokens": tokens, "status": "skipped (a length <= this failed)"})
                continue
            model_dir = write_shape(root, name)
            data = write_data(root, tokens, rows=args.steps + 1)
            ligers = ["true", "false"] if args.liger == "both" else [args.liger]
            runs = [("auto", lg) for lg in ligers] + ([("fixed", "false")] if args.fixed else [])
            for plan, liger in runs:
                t0 = time.time()
                extra = ["--memory_plan", plan] + ([] if liger == "auto" or plan == "fixed" else ["--liger_norm_mlp", liger])
                res = run_recipe(model_dir, data, tokens, "hf_flash", args.steps,
                                 root / f"{name}-{tokens}-{plan}-{liger}", args.timeout, keep_attention=None,
                                 extra=extra)  # fmt: skip
                row = {"shape": name, "tokens": tokens, "memory_plan_mode": plan, **res,
                       "first_step_included": args.steps == 1, "wall_s": round(time.time() - t0, 1)}  # fmt: skip
                if res.get("status") == "ok" and plan == "auto":
                    shape = {**COMMON, **SHAPES[name]}
                    pred = predicted_step_s(shape, tokens, res["checkpointing"], bool(res["tiled_mlp_tokens"]),
                                            rates[name])  # fmt: skip
                    row.update(predicted_tok_per_s=tokens / pred,
                               measured_over_predicted=res["tok_per_s"] / (tokens / pred))  # fmt: skip
                elif res.get("status") != "ok" and plan == "auto":
                    failed[name] = min(tokens, failed.get(name, tokens))
                rows.append(row)
                print(json.dumps(row), flush=True)
                # after every row: a call that runs out of time keeps what it measured
                write_results("long_context_search", rows, args.out, rates=rates, steps=args.steps)


if __name__ == "__main__":
    main()
