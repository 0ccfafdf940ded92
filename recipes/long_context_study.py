"""Small-scale PI / NTK / YaRN study: does context extension (with and without a short LoRA
fine-tune) keep a model working beyond its training length?

A small Llama (byte tokenizer) is pretrained from scratch at context ``L0`` on a synthetic
corpus of pass-key retrieval prompts (hf_flash.eval's format) and long pass-key documents. It is
then extended to ``4 x L0`` with each method through ``hf_flash.extend_context`` and evaluated
as is, and again after a short LoRA fine-tune at the new length run by the recipe itself
(``recipes.lora_long_context``). Reported for every variant (the unscaled model included):
pass-key accuracy over a depth x length grid (PNG heatmaps) and perplexity versus context length
on held-out documents (one PNG plot), plus ``study.json`` and a Markdown table ``study.md``.

    python -m recipes.long_context_study --out results/study --quick   # ~3 min on one H100
    python -m recipes.long_context_study --out results/study           # ~10 min on one H100

GPU only (hf_flash attention, bf16 autocast).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

METHODS = ("pi", "ntk", "yarn")

SETTINGS = {
    # quick: ~5M parameters, L0 = 512 -> 2048
    True: dict(hidden=256, layers=6, heads=4, kv_heads=2, inter=768, l0=512, factor=4,
               pretrain_steps=1500, rows_per_step=16, lr=2e-3, ft_steps=80, trials=3),
    # full: ~25M parameters, L0 = 1024 -> 4096 (evaluated up to 8x)
    False: dict(hidden=512, layers=8, heads=8, kv_heads=4, inter=1536, l0=1024, factor=4,
                pretrain_steps=4000, rows_per_step=32, lr=1e-3, ft_steps=200, trials=5),
    # smoke: plumbing check only (CPU, --attn sdpa); learns nothing
    "smoke": dict(hidden=64, layers=1, heads=2, kv_heads=1, inter=128, l0=384, factor=2,
                  pretrain_steps=3, rows_per_step=2, lr=1e-3, ft_steps=2, trials=1),
}
DEVICE = "cuda"
ATTN = "hf_flash"


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def pretraining_documents(tokenizer, l0: int, n_prompts: int, n_docs: int, seed: int) -> list[list[int]]:
    """Pass-key prompts + answers of random length <= L0 and depth, and long pass-key documents."""
    from hf_flash.eval import build_passkey_prompt

    from .data import synthetic_documents, tokenize_documents

    rng = random.Random(seed)
    docs = []
    for _ in range(n_prompts):
        length = rng.randint(200, l0 - 8)  # the prompt's fixed parts take ~170 bytes
        prompt, answer = build_passkey_prompt(tokenizer, length, rng.random(), f"{rng.randint(0, 99999):05d}")
        docs.append(prompt + answer + [tokenizer.eos_token_id])
    docs += tokenize_documents(synthetic_documents(n_docs, seed + 1, l0 // 4, 2 * l0), tokenizer)
    rng.shuffle(docs)
    return docs


def passkey_texts(tokenizer, length: int, n: int, seed: int) -> list[str]:
    """Fine-tuning documents at the new length, as text for the recipe's data loader."""
    from hf_flash.eval import build_passkey_prompt

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        n_tok = rng.randint(length // 2, length - 4)
        prompt, answer = build_passkey_prompt(tokenizer, n_tok, rng.random(), f"{rng.randint(0, 99999):05d}")
        out.append(tokenizer.decode(prompt + answer) + ".")
    return out


def pretrain(s: dict, out: Path, seed: int) -> Path:
    import hf_flash  # noqa: F401  (registers attn_implementation="hf_flash")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from .data import ByteTokenizer, PackedBatches, pack_documents

    tok = ByteTokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=s["hidden"], intermediate_size=s["inter"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        max_position_embeddings=s["l0"], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN).to(DEVICE)
    n_params = sum(p.numel() for p in model.parameters())
    tokens_needed = s["pretrain_steps"] * s["rows_per_step"] * s["l0"]
    # pass-key prompts dominate the corpus: retrieval is the skill the study measures
    docs = pretraining_documents(tok, s["l0"], n_prompts=tokens_needed // s["l0"] + 1000,
                                 n_docs=tokens_needed // (s["l0"] * 8) + 200, seed=seed)
    rows = pack_documents(docs, s["l0"])
    batches = PackedBatches(rows, s["rows_per_step"], 0, 1, seed, flash_kwargs=True)
    log(f"pretrain: {n_params / 1e6:.1f}M parameters, {rows.num_rows} rows of {s['l0']} tokens, "
        f"{s['pretrain_steps']} steps x {s['rows_per_step']} rows")
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    warm = 100

    def lr_at(i):
        return min(1.0, (i + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, i / s["pretrain_steps"]))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    t0 = time.time()
    for i in range(s["pretrain_steps"]):
        b = batches.get(i, DEVICE)
        labels = b.pop("labels")
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
            logits = model(**b).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if i % 100 == 0 or i == s["pretrain_steps"] - 1:
            log(f"pretrain step {i}: loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    base = out / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    return base


def load_for_eval(path: Path, method: str | None, target: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_flash

    config = AutoConfig.from_pretrained(path)
    if method is not None:
        hf_flash.extend_context(config, target, method=method)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(path, config=config, attn_implementation=ATTN,
                                                dtype=dtype).to(DEVICE).eval()


def evaluate(model, name: str, s: dict, lengths: list, ppl_file: Path, out: Path) -> dict:
    from hf_flash.eval import format_grid, passkey_grid, perplexity_vs_length, save_heatmap

    from .data import ByteTokenizer

    tok = ByteTokenizer()
    grid = passkey_grid(model, tok, lengths=lengths, depths=[0.0, 0.25, 0.5, 0.75, 1.0], trials=s["trials"], seed=1)
    save_heatmap(grid, out / f"passkey-{name}.png", title=f"pass key: {name}")
    ppl = perplexity_vs_length(model, tok, ppl_file, lengths, max_windows=4)
    log(f"{name}:\n{format_grid(grid)}\n{ppl.format()}")
    return {"passkey": grid.to_dict(), "perplexity": ppl.to_dict()}


def finetune(s: dict, base: Path, method: str, target: int, out: Path, seed: int) -> Path:
    from .config import load_config
    from .data import ByteTokenizer
    from .lora_long_context import train

    data = out / "ft-data.jsonl"
    if not data.exists():
        texts = passkey_texts(ByteTokenizer(), target, n=s["ft_steps"] * 4 + 64, seed=seed + 7)
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    run = out / f"ft-{method}"
    cfg = load_config([
        "--model", str(base), "--data", str(data), "--seq_len", str(target), "--rope_method", method,
        "--attn_implementation", ATTN, "--dtype", "bfloat16" if DEVICE == "cuda" else "float32",
        "--mixed_precision", "bf16" if DEVICE == "cuda" else "no",
        "--gradient_checkpointing", "false", "--lora_r", "16", "--lora_alpha", "32",
        "--micro_batch_size", "4", "--max_steps", str(s["ft_steps"]), "--learning_rate", "1e-3",
        "--warmup_steps", "10", "--output_dir", str(run), "--save_merged", "true",
        "--progress", "false", "--log_every", "10", "--seed", str(seed),
    ])
    train(cfg)
    return run / "merged"


def plot_perplexity(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        p = r["perplexity"]
        ax.plot(p["lengths"], p["perplexity"], marker="o", label=name, linestyle="-" if "+ft" in name else "--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity (held-out pass-key documents)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(results: dict, lengths: list) -> str:
    head = "| variant | " + " | ".join(f"pass key @{L}" for L in lengths) + " | " + " | ".join(f"ppl @{L}" for L in lengths) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(lengths))]
    for name, r in results.items():
        acc = r["passkey"]["accuracy"]  # [length][depth]
        accs = [sum(row) / len(row) for row in acc]
        ppl = r["perplexity"]["perplexity"]
        lines.append(f"| {name} | " + " | ".join(f"{a:.2f}" for a in accs) + " | " + " | ".join(f"{p:.2f}" for p in ppl) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for plots, tables and models")
    parser.add_argument("--quick", action="store_true", help="smaller model and shorter runs (~3 min)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a few steps of a 1-layer model: plumbing check (CPU)")
    parser.add_argument("--attn", default="hf_flash", help="attention implementation (default hf_flash)")
    args = parser.parse_args(argv)
    global DEVICE, ATTN
    ATTN = args.attn
    if not torch.cuda.is_available():
        if not args.smoke:
            raise SystemExit("the study needs a CUDA GPU (pretraining from scratch); --smoke runs on the CPU")
        DEVICE = "cpu"
    s = SETTINGS["smoke" if args.smoke else args.quick]
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    l0, target = s["l0"], s["l0"] * s["factor"]
    lengths = [l0 // 2, l0, 2 * l0, target] if s["factor"] > 2 else [l0, target]
    if s is SETTINGS[False]:
        lengths.append(2 * target)

    from .data import synthetic_documents

    ppl_file = out / "heldout.txt"
    ppl_file.write_text("".join(synthetic_documents(16 if args.smoke else 64, args.seed + 1000, target, 3 * target)))

    t0 = time.time()
    timings = {}
    results = {}

    def save() -> str:
        # after every variant, so a run stopped part-way still leaves its finished rows
        md = table(results, lengths)
        (out / "study.md").write_text(
            f"Pretrained at {l0} tokens, extended to {target} ({s['factor']}x); "
            f"{'quick' if args.quick else 'full'} settings {json.dumps(s)}.\n\n{md}\n"
        )
        (out / "study.json").write_text(json.dumps(
            {"settings": s, "lengths": lengths, "seconds": timings, "results": results}, indent=1))
        return md

    def timed(name, fn, *a):
        start = time.time()
        r = fn(*a)
        timings[name] = round(time.time() - start, 1)
        return r

    base = timed("pretrain", pretrain, s, out, args.seed)
    results["none"] = timed("eval none", evaluate, load_for_eval(base, None, target), "none", s, lengths, ppl_file, out)
    save()
    for method in METHODS:
        results[method] = timed(f"eval {method}", evaluate, load_for_eval(base, method, target), method, s,
                                lengths, ppl_file, out)
        merged = timed(f"finetune {method}", finetune, s, base, method, target, out, args.seed)
        results[f"{method}+ft"] = timed(f"eval {method}+ft", evaluate, load_for_eval(merged, None, target),
                                        f"{method}+ft", s, lengths, ppl_file, out)
        save()
        plot_perplexity(results, out / "perplexity.png")
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    md = save()
    log(f"done in {time.time() - t0:.0f}s ({timings})\n{md}")


if __name__ == "__main__":
    main()
