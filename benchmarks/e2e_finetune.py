"""End-to-end long-context LoRA fine-tuning: the recipe itself, hf_flash versus sdpa.

Each point runs ``python -m hf_flash.recipes.lora_long_context`` in a fresh process (clean peak-memory
counters; an out-of-memory run cannot poison the next) on a randomly initialised model shape
(``random_init``: config.json only, no weights), bf16 weights, LoRA r=16 on all projections,
gradient checkpointing, the chunked cross-entropy, batch 1, one document per row (so sdpa gets
its fast no-mask path, as in the peers measured in the issue). Tokens/s excludes the first step.

Shapes: the 1.2B Llama of docs/design.md (hidden 2048, 16 layers, 32/8 heads, intermediate 8192,
vocab 128256, original context 8192, extended with YaRN), the 8B Llama-3 shape (hidden 4096,
32 layers, 32/8 heads, intermediate 14336) and, with ``--points`` only, the Mistral-7B v0.3
shape (the 8B's layers, vocab 32768, 32K positions: no RoPE scaling up to 32K, YaRN beyond).

    python benchmarks/e2e_finetune.py --quick          # 1.2B at 16K and 32K, both providers (~3 min)
    python benchmarks/e2e_finetune.py                  # full grid incl. 8B and 128K (~10 min)
    python benchmarks/e2e_finetune.py --fsdp-gpus 2    # adds the FSDP config on 2 GPUs vs 1
    python benchmarks/e2e_finetune.py --quick --keep-attention both   # + hf_flash keeping attention
    python benchmarks/e2e_finetune.py --points llama-1.2b:32768:hf_flash --profile-step 3 --no-loss
                                                       # + device time by kind of step 3

Rows carry ``keep_attention_outputs`` as the recipe reported it. By default every point runs
with ``keep_attention_outputs: false`` (plain checkpointing, what the earlier results measured;
the recipe's own default keeps them with hf_flash). ``--keep-attention on`` runs the hf_flash
points keeping the attention outputs, ``both`` adds such a row after each plain hf_flash row
(``speedup_vs_recompute`` and ``mem_delta_gib_vs_recompute`` compare the two).

It also times the loss alone (chunked with hf_flash's cross-entropy kernel, chunked with the
PyTorch elementwise ops, full logits, and Liger-Kernel's fused linear cross-entropy when
``liger_kernel`` is importable) at 16K tokens x 128K vocabulary (``loss_rows``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import base_parser, bench_ms, print_table, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

SHAPES = {
    "llama-1.2b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8),
    # Mistral-7B v0.3 (32K positions, no sliding window): the recipes' mistral-*.yaml shape
    "mistral-7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                       max_position_embeddings=32768, rope_theta=1000000.0, model_type="mistral",
                       architectures=["MistralForCausalLM"], sliding_window=None),
}
COMMON = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
              tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"],
              rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=257)

# sdpa peers measured on the H100 (issue 6): tokens/s and peak GiB, None where out of memory
SDPA_MEASURED = {("llama-1.2b", 16384): (20200, None), ("llama-1.2b", 32768): (16700, 52.2),
                 ("llama-8b", 16384): (5100, None), ("llama-8b", 32768): (4400, 71.0)}


def write_shape(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**COMMON, **SHAPES[name]}))
    (d / "byte_tokenizer.json").write_text(json.dumps({"type": "ByteTokenizer"}))
    return d


def write_data(root: Path, seq_len: int, rows: int) -> Path:
    """Documents of exactly one row each (byte tokenizer: chars + BOS + EOS)."""
    path = root / f"docs-{seq_len}.jsonl"
    if not path.exists():
        unit = "The quick brown fox jumps over the lazy dog. "
        text = (unit * (seq_len // len(unit) + 1))[: seq_len - 2]
        path.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(rows)))
    return path


KEEP_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}


def rope_method(model_dir: Path, seq_len: int) -> str:
    """YaRN beyond the shape's original context, none within it (as the shipped configs do)."""
    config = json.loads((model_dir / "config.json").read_text())
    return "yarn" if seq_len > config["max_position_embeddings"] else "none"


def run_recipe(model_dir: Path, data: Path, seq_len: int, attn: str, steps: int, out: Path,
               timeout: int, launcher: list | None = None, extra: list | None = None,
               keep_attention: bool | None = False) -> dict:
    """One recipe run in a fresh process; ``keep_attention`` None leaves keep_attention_outputs
    to the recipe (its memory planner decides)."""
    cmd = (launcher or [sys.executable]) + [
        "-m", "hf_flash.recipes.lora_long_context", "--model", str(model_dir), "--random_init", "true",
        "--data", str(data), "--seq_len", str(seq_len), "--rope_method", rope_method(model_dir, seq_len),
        "--attn_implementation", attn, "--max_steps", str(steps), "--warmup_steps", "1",
        "--output_dir", str(out), "--save_adapter", "false", "--progress", "false",
        "--skip_memory_check", "true", "--dtype", "bfloat16", "--mixed_precision", "bf16",
        "--lora_r", "16", "--gradient_checkpointing", "true",
    ] + ([] if keep_attention is None else ["--keep_attention_outputs", "true" if keep_attention else "false"]) + (
        extra or [])
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout>{timeout}s"}
    summary = out / "summary.json"
    if proc.returncode == 0 and summary.is_file():
        s = json.loads(summary.read_text())
        plan = {k: s[k] for k in ("memory_plan", "checkpointing", "tiled_mlp_tokens", "liger", "predicted_peak_gib",
                                  "predicted_host_gib", "peak_host_gib") if k in s}  # fmt: skip
        return {"status": "ok", "keep_attention_outputs": s.get("keep_attention_outputs"),
                "tok_per_s": s["tok_per_s"], "peak_gib": s["peak_mem_gib"], "final_loss": s["final_loss"],
                **plan}
    tail = (proc.stdout + proc.stderr)[-2000:]
    if "OutOfMemoryError" in tail or "out of memory" in tail:
        lines = [line for line in tail.splitlines() if "Tried to allocate" in line or "memory_plan" in line]
        return {"status": "OOM", "detail": " | ".join(lines)[-600:]}
    print(tail, file=sys.stderr)
    return {"status": f"error rc={proc.returncode}"}


def loss_rows(tokens: int, quick: bool) -> list[dict]:
    """fwd+bwd time and peak memory of the LM-head loss alone (hidden 2048, vocab 128256).

    Rows: ``chunked`` (the recipe's loss: per chunk a bf16 matmul, hf_flash's Triton
    cross-entropy kernel, the gradient matmul; default chunk 2048 tokens), ``chunked-torch``
    (the same chunks with the PyTorch elementwise ops and their fp32 copy, chunk 1024: the
    previous implementation), ``full`` (all fp32 logits) and ``liger`` when installed.

    Prediction for ``chunked`` at 16K tokens (not measured yet; previous H100 run: 73.9 ms for
    the torch elementwise path, 56.9 ms for ``full``): logits 16384 x 128256 = 2.10e9;
    matmuls 2 x (2 x 2.10e9 x 2048) = 17.2 TFLOP at ~700 TFLOP/s = 24.6 ms; the kernel moves
    6 bytes per logit (bf16 read twice, written once) = 12.6 GB at ~3 TB/s = 4.2 ms; total
    ~29 ms, extra peak ~0.6 GiB (one 512 MiB chunk of logits plus dh). The same arithmetic
    gives the torch path 24.6 + 23 B x 2.10e9 / 3 TB/s = 40.7 ms, 33 ms under its measured
    73.9 ms: if the kernel also misses its model by that factor (1.8x), ~52 ms.
    """
    from hf_flash.training.loss import chunked_linear_cross_entropy, full_linear_cross_entropy, liger_linear_cross_entropy

    h = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128256, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    y = torch.randint(0, 128256, (tokens,), device="cuda")
    impls = {
        "chunked": lambda: chunked_linear_cross_entropy(h, w, y, impl="triton"),
        "chunked-torch": lambda: chunked_linear_cross_entropy(h, w, y, impl="torch"),
        "full": lambda: full_linear_cross_entropy(h, w, y),
    }
    try:
        impls["liger"] = (lambda f: (lambda: f(h, w, y)))(liger_linear_cross_entropy())
    except ImportError as e:
        print(f"liger: skipped ({e})")
    rows = []
    for name, fn in impls.items():
        def step():
            h.grad = None
            fn().backward()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            t = bench_ms(step, warmup_ms=10, rep_ms=50 if quick else 200)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            rows.append({"part": "loss", "impl": name, "tokens": tokens, **t, "extra_peak_gib": peak})
        except torch.cuda.OutOfMemoryError:
            rows.append({"part": "loss", "impl": name, "tokens": tokens, "ms": None, "status": "OOM"})
    return rows


def main() -> None:
    parser = base_parser(__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps per point")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per point")
    parser.add_argument("--fsdp-gpus", type=int, default=0, help="also run FSDP on this many GPUs")
    parser.add_argument("--points", nargs="+", default=None, metavar="SHAPE:SEQ:ATTN",
                        help="run only these grid points, e.g. llama-8b:65536:hf_flash")
    parser.add_argument("--no-loss", action="store_true", help="skip the loss-alone timing")
    parser.add_argument("--profile-step", type=int, default=0, metavar="N",
                        help="profile step N of every point (the recipe's profile_step; printed, "
                        "and that step is left out of tokens/s)")
    parser.add_argument("--keep-attention", choices=sorted(KEEP_CHOICES), default="off",
                        help="hf_flash points: plain checkpointing (off, the default), attention "
                        "outputs kept (on), or a row of each (both)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/e2e_finetune.py needs a CUDA GPU")

    if args.quick:
        grid = [("llama-1.2b", L, a) for L in (16384, 32768) for a in ("hf_flash", "sdpa")]
    else:
        grid = [("llama-1.2b", L, a) for L in (16384, 32768, 65536, 131072) for a in ("hf_flash", "sdpa")]
        grid += [("llama-8b", 32768, "hf_flash"), ("llama-8b", 32768, "sdpa"), ("llama-8b", 65536, "hf_flash")]
    if args.points:
        known = {f"{sh}:{L}:{a}" for sh in SHAPES for L in (16384, 32768, 65536, 131072) for a in ("hf_flash", "sdpa")}
        bad = [p for p in args.points if p not in known]
        if bad:
            parser.error(f"unknown --points {bad}; use SHAPE:SEQ:ATTN with SHAPE in {sorted(SHAPES)}, "
                         "SEQ in 16384/32768/65536/131072, ATTN hf_flash or sdpa")
        grid = [(sh, int(L), a) for sh, L, a in (p.split(":") for p in args.points)]
    steps = args.steps or (4 if args.quick else 6)

    rows = [] if args.no_loss else loss_rows(16384, args.quick)
    if rows:
        print_table(rows, ["impl", "tokens", "ms", "p20_ms", "p80_ms", "extra_peak_gib"])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        points = [(sh, L, a, keep) for sh, L, a in grid
                  for keep in (KEEP_CHOICES[args.keep_attention] if a == "hf_flash" else (False,))]
        for shape, seq_len, attn, keep in points:
            model_dir = write_shape(root, shape)
            n = steps if seq_len <= 32768 else 3  # a 128K step of the 1.2B shape takes ~20 s
            data = write_data(root, seq_len, rows=n + 2)
            name = f"run-{shape}-{seq_len}-{attn}" + ("-keep" if keep else "")
            extra = ["--profile_step", str(args.profile_step)] if args.profile_step else None
            r = run_recipe(model_dir, data, seq_len, attn, n, root / name, args.timeout, extra=extra,
                           keep_attention=keep)
            profile = root / name / f"profile-step{args.profile_step}.txt"
            if extra and profile.is_file():
                print(f"--- profile of {name}, step {args.profile_step}\n{profile.read_text()}", flush=True)
            peer = SDPA_MEASURED.get((shape, seq_len))
            row = {"part": "e2e", "shape": shape, "seq_len": seq_len, "attn": attn, "gpus": 1, "steps": n,
                   "keep_attention_outputs": keep, **r, "sdpa_issue_tok_per_s": peer[0] if peer else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.fsdp_gpus > 1:
            seq_len = 32768
            model_dir = write_shape(root, "llama-1.2b")
            data = write_data(root, seq_len, rows=(steps + 2) * args.fsdp_gpus)
            launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                        str(REPO / "recipes/configs/accelerate_fsdp.yaml"), "--num_processes", str(args.fsdp_gpus)]
            keep = args.keep_attention == "on"  # "both": plain, to compare with the plain 1-GPU row
            r = run_recipe(model_dir, data, seq_len, "hf_flash", steps, root / "run-fsdp", args.timeout, launcher,
                           keep_attention=keep)
            rows.append({"part": "e2e", "shape": "llama-1.2b", "seq_len": seq_len, "attn": "hf_flash",
                         "gpus": args.fsdp_gpus, "launcher": "accelerate_fsdp.yaml",
                         "keep_attention_outputs": keep, **r})
            print(json.dumps(rows[-1]), flush=True)

    e2e = [r for r in rows if r["part"] == "e2e"]
    for r in e2e:  # speed-up and memory ratio against sdpa in this run
        peer = next((p for p in e2e if p["attn"] == "sdpa" and p["shape"] == r["shape"]
                     and p["seq_len"] == r["seq_len"] and p["gpus"] == 1 and p["status"] == "ok"), None)
        if r["attn"] == "hf_flash" and r["status"] == "ok" and peer and r["gpus"] == 1:
            r["speedup_vs_sdpa"] = r["tok_per_s"] / peer["tok_per_s"]
            r["mem_ratio_vs_sdpa"] = r["peak_gib"] / peer["peak_gib"]
        one = next((p for p in e2e if p["attn"] == r["attn"] and p["shape"] == r["shape"]
                    and p["seq_len"] == r["seq_len"] and p["gpus"] == 1 and p["status"] == "ok"
                    and p["keep_attention_outputs"] == r["keep_attention_outputs"]), None)
        if r["gpus"] > 1 and r["status"] == "ok" and one:
            r["scaling_vs_1gpu"] = r["tok_per_s"] / one["tok_per_s"]
        plain = next((p for p in e2e if p["attn"] == r["attn"] and p["shape"] == r["shape"]
                      and p["seq_len"] == r["seq_len"] and p["gpus"] == r["gpus"] and p["status"] == "ok"
                      and not p["keep_attention_outputs"]), None)
        if r["keep_attention_outputs"] and r["status"] == "ok" and plain:
            r["speedup_vs_recompute"] = r["tok_per_s"] / plain["tok_per_s"]
            r["mem_delta_gib_vs_recompute"] = r["peak_gib"] - plain["peak_gib"]
    print_table(e2e, ["shape", "seq_len", "attn", "keep_attention_outputs", "gpus", "status", "tok_per_s",
                      "peak_gib", "speedup_vs_sdpa", "mem_ratio_vs_sdpa", "speedup_vs_recompute",
                      "mem_delta_gib_vs_recompute", "scaling_vs_1gpu", "sdpa_issue_tok_per_s"])
    path = write_results("e2e_finetune", rows, args.out, quick=args.quick, steps=steps,
                         keep_attention=args.keep_attention, profile_step=args.profile_step)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
