"""Sequence parallelism in the LoRA recipe: one GPU at a long context against sp_size GPUs at
sp_size times that context (the same tokens per GPU), tokens/s and peak memory per GPU.

Each point runs the recipe in a fresh process (``accelerate launch`` with the FSDP2 config for
more than one GPU, sequence parallel over all of them) on a randomly initialised shape of
``benchmarks/e2e_finetune.py`` (bf16 weights, LoRA r=16 on all projections, gradient
checkpointing keeping hf_flash's attention outputs, the chunked loss, one document per row).
``--layers`` cuts the shape's depth (every layer is the same work, so tokens/s per GPU and its
ratio between points hardly depend on it; peak memory does, and the rows also give the recipe's
start-up prediction for the full depth). Tokens/s excludes the first step.

    python benchmarks/sp_finetune.py --out DIR --gpus 2 --seq-len 131072 --layers 8
    python benchmarks/sp_finetune.py --out DIR --points one --seq-len 131072   # the one-GPU baseline

Rows: ``gpus``, ``sp_size``, ``seq_len`` (the whole sequence), ``tokens_per_gpu``,
``tok_per_s`` (distinct tokens per second, all GPUs) and ``tok_per_s_per_gpu``, ``peak_gib``
(rank 0; the ranks hold the same shapes), ``ratio_vs_1gpu`` (tokens/s per GPU against the
one-GPU point with the same tokens per GPU), and ``flops_ratio_predicted``: the same ratio if
every GPU ran at the one-GPU point's FLOP/s, from the model's training FLOPs per token
(``train_flops_per_token``: the frozen linear layers' forward, recomputation and input-gradient
GEMMs, 6 x parameters, plus causal attention, 3.5 x the forward's 2 x S x Hq x D per token and
layer, with its forward once more when it is recomputed). Attention grows with the sequence, so
at twice the context a GPU does more work per token and the ratio is below 1 by that much.
With ``--points ...,sp_same`` the GPUs also run the one-GPU context: ``speedup_vs_1gpu_same_context``
(ideally the number of GPUs) shows what the all-to-alls cost.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.e2e_finetune import COMMON, SHAPES, run_recipe, write_data  # noqa: E402
from benchmarks.harness import base_parser, print_table, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def write_shape(root: Path, name: str, layers: int | None) -> Path:
    config = {**COMMON, **SHAPES[name]}
    if layers:
        config["num_hidden_layers"] = layers
    d = root / f"{name}-{config['num_hidden_layers']}l"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    (d / "byte_tokenizer.json").write_text(json.dumps({"type": "ByteTokenizer"}))
    return d


def train_flops_per_token(shape: dict, seq_len: int, keep_attention: bool) -> float:
    """Training FLOPs per token of a LoRA step with checkpointing (module docstring)."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hq, hkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // hq
    linear = layers * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inter) + h * shape["vocab_size"]
    attn_fwd = 2 * seq_len * hq * d * layers  # causal: half of 4 x S x Hq x D
    return 6 * linear + attn_fwd * (3.5 + (0 if keep_attention else 1))


def main() -> None:
    parser = base_parser(__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the sequence-parallel point")
    parser.add_argument("--seq-len", type=int, default=131072, help="context of the one-GPU point")
    parser.add_argument("--steps", type=int, default=3, help="optimiser steps per point (first excluded)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per point")
    parser.add_argument("--points", default="one,sp", help="comma-separated: one (one GPU at --seq-len), "
                        "sp (--gpus GPUs at --gpus x --seq-len), sp_same (--gpus GPUs at --seq-len)")
    args = parser.parse_args()
    points = args.points.split(",")
    if bad := sorted(set(points) - {"one", "sp", "sp_same"}):
        parser.error(f"unknown --points {bad}: choose from one, sp, sp_same")
    if not torch.cuda.is_available():
        sys.exit("benchmarks/sp_finetune.py needs a CUDA GPU")
    if any(p != "one" for p in points) and torch.cuda.device_count() < args.gpus:
        sys.exit(f"--points {args.points} with --gpus {args.gpus}: only {torch.cuda.device_count()} GPU(s) here")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_shape(root, args.shape, args.layers)
        shape = json.loads((model_dir / "config.json").read_text())
        grid = {"one": (1, args.seq_len), "sp": (args.gpus, args.gpus * args.seq_len),
                "sp_same": (args.gpus, args.seq_len)}
        for gpus, seq_len in (grid[p] for p in points):
            data = write_data(root, seq_len, rows=args.steps + 2)
            launcher, extra = None, []
            if gpus > 1:
                launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                            str(REPO / "recipes/configs/accelerate_fsdp.yaml"), "--num_processes", str(gpus)]
                extra = ["--sp_size", str(gpus)]
            r = run_recipe(model_dir, data, seq_len, "hf_flash", args.steps, root / f"run-{gpus}-{seq_len}",
                           args.timeout, launcher, extra=extra, keep_attention=True)
            row = {"part": "sp", "shape": args.shape, "layers": shape["num_hidden_layers"], "seq_len": seq_len,
                   "gpus": gpus, "sp_size": gpus, "tokens_per_gpu": seq_len // gpus, "steps": args.steps, **r,
                   "train_flops_per_token": train_flops_per_token(shape, seq_len, True)}
            if r.get("status") == "ok":
                row["tok_per_s_per_gpu"] = r["tok_per_s"] / gpus
                row["model_tflops_per_gpu"] = row["tok_per_s_per_gpu"] * row["train_flops_per_token"] / 1e12
            rows.append(row)
            print(json.dumps(row), flush=True)
            _compare(rows)
            write_results("sp_finetune", rows, args.out, shape=args.shape, layers=args.layers,
                          steps=args.steps, seq_len=args.seq_len, gpus=args.gpus, points=args.points)  # a killed run keeps its rows
    print_table(rows, ["shape", "layers", "seq_len", "gpus", "sp_size", "tokens_per_gpu", "status", "tok_per_s",
                       "tok_per_s_per_gpu", "peak_gib", "model_tflops_per_gpu", "ratio_vs_1gpu",
                       "flops_ratio_predicted", "speedup_vs_1gpu_same_context"])
    path = write_results("sp_finetune", rows, args.out, shape=args.shape, layers=args.layers, steps=args.steps,
                         seq_len=args.seq_len, gpus=args.gpus, points=args.points)
    print(f"wrote {path}")


def _compare(rows: list) -> None:
    for r in rows:
        one = next((p for p in rows if p["gpus"] == 1 and p["tokens_per_gpu"] == r["tokens_per_gpu"]), None)
        if r["gpus"] > 1 and one is not None:
            r["flops_ratio_predicted"] = one["train_flops_per_token"] / r["train_flops_per_token"]
            if r.get("status") == "ok" and one.get("status") == "ok":
                r["ratio_vs_1gpu"] = r["tok_per_s_per_gpu"] / one["tok_per_s_per_gpu"]
        same = next((p for p in rows if p["gpus"] == 1 and p["seq_len"] == r["seq_len"]), None)
        if r["gpus"] > 1 and same is not None and r.get("status") == same.get("status") == "ok":
            r["speedup_vs_1gpu_same_context"] = r["tok_per_s"] / same["tok_per_s"]


if __name__ == "__main__":
    main()
