"""What is alive on the GPU at the peak of one LoRA training step, grouped by where it was allocated.

Builds a random-weight model shape (benchmarks/e2e_finetune.py's shapes), LoRA r=16 on every
projection, bf16 autocast, applies ``hf_flash.training.enable`` with the given plan, runs one
short warm-up step, then records the CUDA caching allocator's history over one step of
``--tokens`` tokens. Replaying the history finds the peak of allocated bytes; the blocks alive
then are grouped by the innermost frame in hf_flash / transformers / peft / torch.nn code.
Prints the groups (GiB, count, bytes per token) beside the planner's prediction.

    python benchmarks/diagnostics/memory_peak.py --shape llama-8b --tokens 16384 \\
        --checkpointing offload --tiled-mlp 8192 --out OUT
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.e2e_finetune import COMMON, SHAPES  # noqa: E402

KEYS = ("hf_flash/", "transformers/", "peft/", "torch/nn/", "torch/utils/checkpoint", "torch/autograd")


def _where(frames) -> str:
    """The innermost frame in hf_flash, transformers or peft (else in torch.nn/checkpoint/autograd)."""
    for keys in (KEYS[:3], KEYS[3:]):
        for f in frames:
            name = f.get("filename", "")
            if any(k in name for k in keys) and "memory_peak.py" not in name:
                short = name.split("site-packages/")[-1]
                return f"{short}:{f.get('line')} {f.get('name')}"
    return "(other: " + " < ".join(f"{f.get('name')}" for f in frames[:3]) + ")"


def build(shape_name: str, seq_len: int):
    import hf_flash  # noqa: F401  (registers attn_implementation="hf_flash")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = {**COMMON, **SHAPES[shape_name]}
    cfg.pop("model_type", None), cfg.pop("architectures", None)
    config = LlamaConfig(**cfg)
    factor = max(1.0, seq_len / config.max_position_embeddings)
    if factor > 1:
        hf_flash.extend_context(config, seq_len, method="yarn")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="hf_flash")
    model.config.use_cache = False
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, task_type="CAUSAL_LM"))


def step(model, tokens: int) -> None:
    ids = torch.randint(0, 32000, (1, tokens), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def peak_groups(snapshot) -> tuple[int, dict]:
    live: dict = {}
    cur = peak = 0
    peak_live: dict = {}
    for trace in snapshot["device_traces"]:
        for e in trace:
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
                cur += e["size"]
                if cur > peak:
                    peak, peak_live = cur, dict(live)
            elif e["action"] in ("free_requested",) and e["addr"] in live:
                cur -= live.pop(e["addr"])[0]
    groups: dict = collections.defaultdict(lambda: [0, 0])
    for size, where in peak_live.values():
        groups[where][0] += size
        groups[where][1] += 1
    return peak, groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--checkpointing", default="offload")
    p.add_argument("--tiled-mlp", default="auto")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import hf_flash.training

    model = build(args.shape, args.tokens)
    tiled = args.tiled_mlp if args.tiled_mlp == "auto" else (False if args.tiled_mlp == "0" else int(args.tiled_mlp))
    plan = hf_flash.training.enable(model, seq_len=args.tokens, checkpointing=args.checkpointing,
                                    chunked_loss=True, tiled_mlp=tiled, autocast=True)  # fmt: skip
    step(model, 2048)  # compile and autotune outside the recording
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    try:
        step(model, args.tokens)
    except torch.cuda.OutOfMemoryError as e:  # what was alive when it ran out is the answer
        print("OUT OF MEMORY:", " ".join(str(e).split())[:400])
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, groups = peak_groups(snap)
    measured = torch.cuda.max_memory_allocated()
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    print(f"shape {args.shape}, {args.tokens} tokens, plan: {plan.name}; predicted {plan.device_gib:.2f} GiB, "
          f"max_memory_allocated {measured / 2**30:.2f} GiB (before the step {base / 2**30:.2f} GiB); "
          f"replayed peak of the step's allocations {peak / 2**30:.2f} GiB")  # fmt: skip
    out = []
    for where, (size, count) in rows[:40]:
        print(f"{size / 2**30:8.3f} GiB {count:6d}x {size / args.tokens:10.0f} B/token  {where}")
        out.append({"where": where, "gib": size / 2**30, "count": count, "bytes_per_token": size / args.tokens})
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"memory_peak-{args.shape}-{args.tokens}-{args.checkpointing}.json").write_text(json.dumps({
            "plan": plan.name, "predicted_gib": plan.device_gib, "max_allocated_gib": measured / 2**30,
            "before_gib": base / 2**30, "step_peak_gib": peak / 2**30, "groups": out}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
