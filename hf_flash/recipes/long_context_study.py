"""Small-scale PI / NTK / YaRN study: does context extension (with and without a short LoRA
fine-tune) keep a model working beyond its training length?

A small Llama (byte tokenizer) is pretrained from scratch at context ``L0`` on a synthetic
corpus of pass-key retrieval prompts (hf_flash.eval's format, so the model learns the very task
it is evaluated on) and long pass-key documents. It is then extended to ``4 x L0`` with each
method through ``hf_flash.extend_context`` and evaluated as is, and again after a short LoRA
fine-tune at the new length run by the recipe itself (``hf_flash.recipes.lora_long_context``). Reported
for every variant (the unscaled model included): pass-key accuracy over a depth x length grid
(PNG heatmaps) and perplexity versus context length on held-out documents (one PNG plot), plus
``study.json`` and a Markdown table ``study.md``.

The comparison means something only if the unscaled model retrieves the key at lengths <= L0.
With byte tokens that is an induction skill (match the multi-byte cue "pass key is ", copy the
five digits after it), which a small model learns abruptly and only once copying is a large
enough share of its training signal. A first H100 run (16 rows x 512 tokens, 1500 steps, the
prompts cut at row boundaries) learned everything else and retrieved nothing, at 256 and 512
tokens too. Small CPU runs (2 layers, L0 = 384) showed the same at up to 12M tokens of ordinary
prompts, while with 85% pass-key drills (``hf_flash.eval.passkey_drill``: the prompt's own
sentences for several keys, no filler) the local copy was perfect within 500 steps. Hence two
phases: mostly drills for the first 30% of pretraining (the copy skill forms), then mostly whole
prompts of every length up to ``L0`` (it is carried across the filler), never cut by a row
boundary (a cut prompt asks for a key it cannot see). On the CPU, a 2-layer model of 0.14M
parameters trained that way (L0 = 384, 16 rows x 2500 steps, 15M tokens) retrieved 100% of the
keys at 192 tokens and 95% at 384 (the misses: key at depth 0), 92%/92% already at step 2000;
with 70% or 50% drills throughout it had copied nothing by step 1000/1500. Many rows per step:
on the H100 a step of this model was launch-bound, so 8x the tokens of the first run should cost
little more per step. A pass-key probe at L0/2 and L0 is logged during pretraining and kept in
``study.json``.

    hf-flash-study --out results/study --quick   # ~4 min on one H100
    hf-flash-study --out results/study           # ~7 min on one H100
    hf-flash-study                               # smoke test, any machine (~1-2 min on a CPU)

(``python -m hf_flash.recipes.long_context_study`` is the same command; from a checkout,
``python -m recipes.long_context_study`` too.)

Pretraining stops at ``pretrain_steps`` or after ``pretrain_s`` seconds (180 s quick, 330 s
full; ``--pretrain-seconds`` overrides), whichever comes first; evaluation and the three
fine-tunes take about 1 min (quick) and 2 min (full) more.

``--model smollm2`` runs the same comparison on real weights instead, with no pretraining:
SmolLM2-135M-Instruct (``hf_flash.pretrained``; trained at 8K tokens) extended 8K -> 32K and
evaluated up to 64K. Pass-key prompts use the same format; perplexity is measured on Jane Austen's
*Persuasion* (``hf_flash.eval.corpus_path``), and each method is fine-tuned by the recipe for a
few dozen LoRA steps of language modelling at 32K on *Northanger Abbey*: windows of the novel,
never a pass-key prompt, so any retrieval after the fine-tune is not trained on the task (the PI
paper's setting: its models fine-tuned on PG-19 books)::

    hf-flash-study --model smollm2 --out results/study-smollm2  # ~6 min

GPU only (hf_flash attention, bf16 autocast).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from .data import PackedRows

METHODS = ("pi", "ntk", "yarn")

# pretrain_steps x rows_per_step rows of l0 tokens, or pretrain_s seconds if that ends first;
# corpus_rows fresh rows, repeated in a new order beyond that
SETTINGS = {
    # quick: ~5M parameters, L0 = 512 -> 2048
    True: dict(hidden=256, layers=6, heads=8, kv_heads=4, inter=768, l0=512, factor=4,
               pretrain_steps=2500, rows_per_step=128, pretrain_s=180, corpus_rows=80_000, lr=2e-3,
               warmup=200, probe_every=250, drill_share=(0.85, 0.35), drill_phase=0.3, ft_steps=80, trials=3),
    # full: ~25M parameters, L0 = 1024 -> 4096 (evaluated up to 8x)
    False: dict(hidden=512, layers=8, heads=8, kv_heads=4, inter=1536, l0=1024, factor=4,
                pretrain_steps=3000, rows_per_step=64, pretrain_s=330, corpus_rows=50_000, lr=1e-3,
                warmup=200, probe_every=250, drill_share=(0.85, 0.35), drill_phase=0.3, ft_steps=200, trials=5),
    # smoke: plumbing check only (CPU, --attn sdpa); learns nothing
    "smoke": dict(hidden=64, layers=1, heads=2, kv_heads=1, inter=128, l0=384, factor=2,
                  pretrain_steps=3, rows_per_step=2, pretrain_s=60, corpus_rows=64, lr=1e-3,
                  warmup=2, probe_every=2, drill_share=(0.85, 0.35), drill_phase=0.3, ft_steps=2, trials=1),
}
# real weights (--model smollm2): no pretraining; evaluated at `lengths`, fine-tuned at l0 x factor
PRETRAINED = dict(l0=8192, factor=4, lengths=[2048, 8192, 16384, 32768, 65536],
                  depths=[0.0, 0.25, 0.5, 0.75, 1.0], trials=2, ppl_windows=2, ft_steps=30,
                  ft_micro_batch=1, ft_lr=5e-4, ft_warmup=5, ft_lora_r=16,
                  ft_checkpointing=True)  # fmt: skip
DEVICE = "cuda"
ATTN = "hf_flash"


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def passkey_document(tokenizer, length: int, rng: random.Random) -> list[int]:
    """An evaluation prompt (hf_flash.eval's format, random key and depth) + its answer + EOS:
    exactly ``length`` tokens."""
    from hf_flash.eval import build_passkey_prompt

    key = f"{rng.randint(0, 99999):05d}"
    tail = len(tokenizer.encode(" " + key)) + 1  # the answer and EOS
    prompt, answer = build_passkey_prompt(tokenizer, length - tail, rng.random(), key)
    return prompt + answer + [tokenizer.eos_token_id]


def passkey_rows(tokenizer, l0: int, n_rows: int, seed: int) -> PackedRows:
    """Rows of exactly ``l0`` tokens filled with whole pass-key documents.

    No document is cut by a row boundary: a cut prompt would teach the model to guess a key it
    cannot see. A row holds several short prompts (each a retrieval example) or, one time in
    five, one prompt of the full length, so the key is also seen at every distance up to ``l0``.
    """
    from hf_flash.eval import passkey_drill

    # a one-key drill is the shortest prompt plus its answer; + EOS, + 8 filler tokens
    shortest = len(passkey_drill(tokenizer, ["00000"])) + 1 + 8
    if l0 < shortest:
        raise ValueError(f"l0={l0} cannot hold a pass-key prompt (>= {shortest} tokens)")
    rng = random.Random(seed)
    ids = torch.empty(n_rows, l0, dtype=torch.int32)
    pos = torch.empty(n_rows, l0, dtype=torch.int32)
    for r in range(n_rows):
        row, left = [], l0
        while left:
            if left < 2 * shortest or rng.random() < 0.2:
                n = left
            else:
                n = rng.randint(shortest, left - shortest)
            row.append(passkey_document(tokenizer, n, rng))
            left -= n
        ids[r] = torch.tensor([t for doc in row for t in doc], dtype=torch.int32)
        pos[r] = torch.tensor([i for doc in row for i in range(len(doc))], dtype=torch.int32)
    return PackedRows(ids, pos, n_rows, 0)


def drill_rows(tokenizer, l0: int, n_rows: int, seed: int) -> PackedRows:
    """Rows of ``hf_flash.eval.passkey_drill`` documents (2 to 8 keys each, no filler)."""
    from hf_flash.eval import passkey_drill

    from .data import pack_documents

    rng = random.Random(seed)
    docs, n_tokens = [], 0
    while n_tokens < (n_rows + 1) * l0:
        keys = [f"{rng.randint(0, 99999):05d}" for _ in range(rng.randint(2, 8))]
        docs.append(passkey_drill(tokenizer, keys) + [tokenizer.eos_token_id])
        n_tokens += len(docs[-1])
    rows = pack_documents(docs, l0)
    return PackedRows(rows.input_ids[:n_rows], rows.position_ids[:n_rows], len(docs), 0)


def pretraining_rows(tokenizer, l0: int, n_rows: int, seed: int, drill_share: float) -> PackedRows:
    """The pretraining corpus, shuffled by the batch sampler: pass-key drills (``drill_share``;
    retrieval at short range, densely), rows of whole pass-key prompts (retrieval at every
    distance up to ``l0``) and long pass-key documents (15%, the perplexity evaluation's text)."""
    from .data import pack_documents, synthetic_documents, tokenize_documents

    n_docs = max(1, n_rows * 15 // 100)
    n_drills = int(n_rows * drill_share)
    parts = [passkey_rows(tokenizer, l0, n_rows - n_docs - n_drills, seed)]
    if n_drills:
        parts.append(drill_rows(tokenizer, l0, n_drills, seed + 2))
    texts = synthetic_documents(2 * n_docs + 8, seed + 1, l0 // 4, 2 * l0)  # ~2 documents per row
    docs = pack_documents(tokenize_documents(texts, tokenizer), l0)
    parts.append(PackedRows(docs.input_ids[:n_docs], docs.position_ids[:n_docs], 0, 0))
    return PackedRows(torch.cat([p.input_ids for p in parts]), torch.cat([p.position_ids for p in parts]),
                      sum(p.num_documents for p in parts), 0)


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


def pretrain(s: dict, out: Path, seed: int) -> tuple[Path, list]:
    """Pretrain from scratch; returns the saved model's folder and the retrieval probes.

    The learning rate warms up, then follows a cosine to 10% over ``pretrain_steps`` steps or
    ``pretrain_s`` seconds, whichever ends first, so the study keeps its time budget on a slower
    GPU. Rows come from a corpus with ``drill_share[0]`` drills until ``drill_phase`` of that
    schedule, then from one with ``drill_share[1]``. Every ``probe_every`` steps a small pass-key grid at L0/2 and L0 is logged: retrieval
    is learned abruptly (an induction-head phase change), and the probe shows when.
    """
    import hf_flash  # noqa: F401  (registers attn_implementation="hf_flash")
    from hf_flash.eval import passkey_grid
    from transformers import AutoModelForCausalLM, LlamaConfig

    from .data import ByteTokenizer, PackedBatches

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
    steps, l0 = s["pretrain_steps"], s["l0"]
    # fresh rows for up to `corpus_rows`, then further epochs in a new order
    # two phases: mostly drills until the copy skill forms, then mostly whole prompts, which
    # carry it to every distance up to l0
    n_rows = min(steps * s["rows_per_step"], s["corpus_rows"]) // 2
    phases = [PackedBatches(pretraining_rows(tok, l0, n_rows, seed + k, share), s["rows_per_step"], 0, 1,
                            seed + k, flash_kwargs=True)
              for k, share in enumerate(s["drill_share"])]
    rows = phases[0].rows
    log(f"pretrain: {n_params / 1e6:.1f}M parameters, 2 x {rows.num_rows} rows of {l0} tokens, "
        f"{steps} steps x {s['rows_per_step']} rows or {s['pretrain_s']} s")
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    probes = []

    def probe(step: int, loss: float) -> None:
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
            grid = passkey_grid(model, tok, [l0 // 2, l0], [0.0, 0.5, 1.0], trials=2, seed=99)
        acc = [round(sum(row) / len(row), 2) for row in grid.accuracy]
        probes.append({"step": step, "loss": round(loss, 4), "passkey": acc})
        log(f"pretrain step {step}: pass key @{l0 // 2}, @{l0}: {acc}")

    model.train()
    t0 = time.time()
    n_done, last_loss = 0, float("nan")
    for i in range(steps):
        done = max(i / steps, (time.time() - t0) / s["pretrain_s"])
        if done >= 1.0:
            log(f"pretrain: time budget reached after {i} steps")
            break
        for group in opt.param_groups:
            group["lr"] = s["lr"] * min(1.0, (i + 1) / s["warmup"]) * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))
        b = phases[done >= s["drill_phase"]].get(i, DEVICE)
        labels = b.pop("labels")
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
            logits = model(**b).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        n_done, last_loss = i + 1, loss.item()
        if i % 100 == 0:
            log(f"pretrain step {i}: loss {last_loss:.3f} ({time.time() - t0:.0f}s)")
        if n_done % s["probe_every"] == 0:
            probe(n_done, last_loss)
    if not probes or probes[-1]["step"] != n_done:
        probe(n_done, last_loss)
    base = out / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    return base, probes


def load_for_eval(path: Path, method: str | None, target: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_flash

    config = AutoConfig.from_pretrained(path)
    if method is not None:
        hf_flash.extend_context(config, target, method=method)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(path, config=config, attn_implementation=ATTN,
                                                dtype=dtype).to(DEVICE).eval()


def evaluate(model, name: str, s: dict, lengths: list, ppl_file: Path, out: Path, tok=None) -> dict:
    from hf_flash.eval import format_grid, passkey_grid, perplexity_vs_length, save_heatmap

    from .data import ByteTokenizer

    tok = tok or ByteTokenizer()
    depths = s.get("depths", [0.0, 0.25, 0.5, 0.75, 1.0])
    grid = passkey_grid(model, tok, lengths=lengths, depths=depths, trials=s["trials"], seed=1)
    save_heatmap(grid, out / f"passkey-{name}.png", title=f"pass key: {name}")
    ppl = perplexity_vs_length(model, tok, ppl_file, lengths, max_windows=s.get("ppl_windows", 4))
    log(f"{name}:\n{format_grid(grid)}\n{ppl.format()}")
    return {"passkey": grid.to_dict(), "perplexity": ppl.to_dict()}


def finetune(s: dict, base: Path, method: str, target: int, out: Path, seed: int,
             data: Path | None = None) -> Path:
    """LoRA fine-tune of ``base`` at ``target`` tokens with ``method``, by the recipe itself;
    returns the merged model's folder. ``data``: a .jsonl of texts (default: pass-key prompts
    at the new length, for the from-scratch model)."""
    from .config import load_config
    from .data import ByteTokenizer
    from .lora_long_context import train

    if data is None:
        data = out / "ft-data.jsonl"
        if not data.exists():
            texts = passkey_texts(ByteTokenizer(), target, n=s["ft_steps"] * 4 + 64, seed=seed + 7)
            data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    run = out / f"ft-{method}"
    cfg = load_config([
        "--model", str(base), "--data", str(data), "--seq_len", str(target), "--rope_method", method,
        "--attn_implementation", ATTN, "--dtype", "bfloat16" if DEVICE == "cuda" else "float32",
        "--mixed_precision", "bf16" if DEVICE == "cuda" else "no",
        "--gradient_checkpointing", str(s.get("ft_checkpointing", False)).lower(),
        "--lora_r", str(s.get("ft_lora_r", 16)), "--lora_alpha", str(2 * s.get("ft_lora_r", 16)),
        "--micro_batch_size", str(s.get("ft_micro_batch", 4)), "--max_steps", str(s["ft_steps"]),
        "--learning_rate", str(s.get("ft_lr", 1e-3)), "--warmup_steps", str(min(s.get("ft_warmup", 10), s["ft_steps"])),
        "--output_dir", str(run), "--save_merged", "true",
        "--progress", "false", "--log_every", "10", "--seed", str(seed),
    ])
    train(cfg)
    return run / "merged"


def prose_windows(tokenizer, n: int, length: int, seed: int) -> list[str]:
    """``n`` windows of *Northanger Abbey* of about ``length`` tokens (BOS and EOS included, so
    each packs into one recipe row), at random offsets; the novel (~100K tokens) is shorter than
    n x length, so windows overlap."""
    from hf_flash.eval import corpus_path, read_text

    ids = tokenizer.encode(read_text(corpus_path("northanger-abbey")), add_special_tokens=False)
    body = length - 2
    if len(ids) < body:
        raise ValueError(f"the fine-tuning text has {len(ids)} tokens, fewer than one window of {body}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(ids) - body + 1)
        out.append(tokenizer.decode(ids[start : start + body]))
    return out


def compare_variants(base: Path, s: dict, lengths: list, ppl_file: Path, out: Path, seed: int,
                     header: str, record: dict, tok=None, ft_data: Path | None = None,
                     ylabel: str = "perplexity (held-out pass-key documents)") -> None:
    """The study's comparison: ``base`` unscaled, then each of METHODS as is and after its LoRA
    fine-tune at ``l0 x factor``, evaluated at ``lengths``. ``study.md``, ``study.json`` (with
    ``record``, updated with the timings and results) and the perplexity plot are rewritten after
    every variant, so a run stopped part-way keeps its finished rows."""
    target = s["l0"] * s["factor"]
    t0, timings, results = time.time(), {}, {}
    record.update(settings=s, lengths=lengths, seconds=timings, results=results)

    def timed(name, fn, *a, **k):
        start = time.time()
        r = fn(*a, **k)
        timings[name] = round(time.time() - start, 1)
        return r

    def save() -> str:
        md = table(results, lengths)
        (out / "study.md").write_text(f"{header}; settings {json.dumps(s)}.\n\n{md}\n")
        (out / "study.json").write_text(json.dumps(record, indent=1))
        plot_perplexity(results, out / "perplexity.png", ylabel=ylabel)
        return md

    def run_eval(name, path, method):
        return timed(f"eval {name}", evaluate, load_for_eval(path, method, target), name, s, lengths,
                     ppl_file, out, tok=tok)  # fmt: skip

    results["none"] = run_eval("none", base, None)
    save()
    for method in METHODS:
        results[method] = run_eval(method, base, method)
        merged = timed(f"finetune {method}", finetune, s, base, method, target, out, seed, data=ft_data)
        results[f"{method}+ft"] = run_eval(f"{method}+ft", merged, None)
        save()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    md = save()
    log(f"done in {time.time() - t0:.0f}s ({timings})\n{md}")


def run_pretrained(out: Path, seed: int, ft_steps: int | None = None) -> None:
    """The study on SmolLM2-135M-Instruct (module doc): no pretraining, real text."""
    from transformers import AutoTokenizer

    from hf_flash import pretrained
    from hf_flash.eval import corpus_path

    s = dict(PRETRAINED)
    if ft_steps is not None:
        s["ft_steps"] = ft_steps
    l0, target, lengths = s["l0"], s["l0"] * s["factor"], s["lengths"]
    base = pretrained.smollm2_folder()
    tok = AutoTokenizer.from_pretrained(base)
    ppl_file = corpus_path("persuasion")
    data = out / "ft-data.jsonl"
    # the recipe adds BOS/EOS (tokenize_documents); re-encoding decoded text can shift a token or two
    texts = prose_windows(tok, s["ft_steps"] * s["ft_micro_batch"] + 8, target - 8, seed + 7)
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    compare_variants(
        base, s, lengths, ppl_file, out, seed, record={"model": "SmolLM2-135M-Instruct"}, tok=tok,
        header=f"SmolLM2-135M-Instruct (trained at {l0} tokens), extended to {target} ({s['factor']}x)",
        ft_data=data, ylabel="perplexity (Persuasion)",
    )  # fmt: skip


def plot_perplexity(results: dict, path: Path, ylabel: str = "perplexity (held-out pass-key documents)") -> None:
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
    ax.set_ylabel(ylabel)
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
    """The ``hf-flash-study`` command. With no arguments: the smoke settings (a 1-layer model, a
    few steps; sdpa attention on a machine without CUDA) into runs/hf-flash-study-smoke."""
    argv = list(sys.argv[1:] if argv is None else argv)
    import importlib.util

    from .lora_long_context import missing_recipe_packages

    missing = missing_recipe_packages() + (["matplotlib"] if importlib.util.find_spec("matplotlib") is None else [])
    if missing and not ({"-h", "--help"} & set(argv)):
        raise SystemExit(f"hf-flash-study: error: the study needs hf_flash's [recipes] extra (missing: "
                         f"{', '.join(missing)}): pip install 'hf-flash[recipes]'")
    if not argv:
        argv = ["--smoke", "--out", "runs/hf-flash-study-smoke"]
        if not torch.cuda.is_available():
            argv += ["--attn", "sdpa"]
        print(f"hf-flash-study: no arguments given, running the embedded smoke test ({' '.join(argv)}): "
              "a 1-layer model pretrained for 3 steps, extended 2x with PI, NTK and YaRN, 2 LoRA steps "
              "each; checks the plumbing, learns nothing. The study itself needs a CUDA GPU: see --help.",
              flush=True)
    parser = argparse.ArgumentParser(
        prog="hf-flash-study",
        description=__doc__.split("\n\n")[0] + " With no arguments: the smoke settings (any machine, "
        "about a minute) into runs/hf-flash-study-smoke.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for plots, tables and models")
    parser.add_argument("--quick", action="store_true", help="smaller model and shorter runs (~4 min)")
    parser.add_argument("--pretrain-seconds", type=float, default=None,
                        help="wall-clock cap on pretraining (default: the settings' pretrain_s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, models and keys")
    parser.add_argument("--smoke", action="store_true", help="a few steps of a 1-layer model: plumbing check (CPU)")
    parser.add_argument("--attn", default="hf_flash", help="attention implementation (default hf_flash)")
    parser.add_argument("--model", choices=["scratch", "smollm2"], default="scratch",
                        help="scratch: pretrain a small model here (default); smollm2: real "
                        "weights, SmolLM2-135M-Instruct 8K -> 32K (hf_flash.pretrained)")  # fmt: skip
    parser.add_argument("--ft-steps", type=int, default=None,
                        help="LoRA steps of each fine-tune (default: the settings')")
    args = parser.parse_args(argv)
    global DEVICE, ATTN
    ATTN = args.attn
    if args.model == "smollm2":
        if not torch.cuda.is_available():
            raise SystemExit("the study needs a CUDA GPU (32K-64K tokens on a 135M model)")
        args.out.mkdir(parents=True, exist_ok=True)
        return run_pretrained(args.out, args.seed, args.ft_steps)
    if not torch.cuda.is_available():
        if not args.smoke:
            raise SystemExit("the study needs a CUDA GPU (pretraining from scratch); --smoke runs on the CPU")
        DEVICE = "cpu"
    s = dict(SETTINGS["smoke" if args.smoke else args.quick])
    if args.ft_steps is not None:
        s["ft_steps"] = args.ft_steps
    if args.pretrain_seconds is not None:
        s["pretrain_s"] = args.pretrain_seconds
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    l0, target = s["l0"], s["l0"] * s["factor"]
    lengths = [l0 // 2, l0, 2 * l0, target] if s["factor"] > 2 else [l0, target]
    if not args.quick and not args.smoke:
        lengths.append(2 * target)

    from .data import synthetic_documents

    ppl_file = out / "heldout.txt"
    ppl_file.write_text("".join(synthetic_documents(16 if args.smoke else 64, args.seed + 1000, target, 3 * target)))

    start = time.time()
    base, probes = pretrain(s, out, args.seed)
    compare_variants(
        base, s, lengths, ppl_file, out, args.seed,
        record={"pretrain_seconds": round(time.time() - start, 1), "pretrain_probes": probes},
        header=f"Pretrained at {l0} tokens, extended to {target} ({s['factor']}x); "
        f"{'quick' if args.quick else 'full'}",
    )  # fmt: skip


if __name__ == "__main__":
    main()
