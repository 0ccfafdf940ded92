"""End-to-end LoRA training throughput: hf_flash vs sdpa, flex_attention and eager in transformers.

Model: a randomly initialised Llama with the 1.2B shape (hidden 2048, 16 layers, 32/8 heads,
head_dim 64, MLP 8192, vocab 128256) and the same shape as Mistral with sliding window 4096;
``--families gemma2 gemma3`` add head dim 256 (hidden 2048, 16 layers, 8/4 heads, MLP 8192, vocab
128256) as Gemma 2 (window 4096 on every other layer, attention softcap 50, final logit softcap
30) and Gemma 3 (window 1024 on five layers of six, no softcap; query-key norms);
bfloat16; peft LoRA r=16 on every projection; gradient checkpointing (non-reentrant); AdamW on
the LoRA weights. One step = forward + backward + optimizer step.

Workloads: one sequence of S = 4K, 16K, 32K, 64K tokens (batch 1); a padded batch (8 sequences of
random lengths up to 4K, right-padded, 2-D attention mask); the same 8 sequences packed into one
row by ``DataCollatorWithFlattening`` (position_ids restarts plus cu_seq_lens kwargs).
Providers are transformers' attention implementations: hf_flash, sdpa, flex_attention
(transformers' own FlexAttention path: its compiled kernel with the block mask transformers builds
from the padding mask or the packed position_ids) and eager. transformers' sdpa path refuses the
softcap, so gemma2 has no sdpa rows.
Tokens/s counts real (unpadded) tokens. With use_cache off (as here) hf_flash runs the padded
batch padding-free (hf_flash.integration.unpad_patch; ``--unpad-off-row`` adds a row without
it); sdpa and eager compute the pad tokens. Peak memory is torch.cuda.max_memory_allocated over
the measured steps. Out-of-memory is recorded, not fatal. eager materialises S x S scores per head,
so it only runs the 4K and batch workloads unless --eager-all.

After the timed steps one more step runs under torch.profiler (``--no-profile`` skips it): each
row records that step's device time and the attention kernels' share of it (``attention_share``,
from ``hf_flash.recipes.profiling.attention_share``), so a kernel gain can be read through the rest of the
step.

Every row says whether the attention outputs were kept through checkpointing (``keep_attention``,
``hf_flash.gradient_checkpointing_kwargs()``: the attention forward runs once per layer instead of
twice). By default no row keeps them (plain checkpointing, as the earlier results measured);
``--keep-attention on`` measures hf_flash with them kept, ``both`` adds a kept row after each
plain hf_flash row (``vs_recompute``: its tokens/s over the plain row's).

    python benchmarks/e2e_train.py --quick          # ~3 min on an H100
    python benchmarks/e2e_train.py                  # full grid, ~10 min
    python benchmarks/e2e_train.py --quick --keep-attention both --providers hf_flash sdpa
    python benchmarks/e2e_train.py --families llama --workloads S=16K S=32K   # some rows again
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before hf_flash's kernels are defined

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import base_parser, print_table, write_results  # noqa: E402
from hf_flash.checkpointing import enable_activation_checkpointing  # noqa: E402

SHAPE = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
WINDOW = 4096
# Gemma 2/3 at the same size with head dim 256 (half the heads): (config class, extra keys)
GEMMA_SHAPE = dict(SHAPE, num_attention_heads=8, num_key_value_heads=4, head_dim=256)
del GEMMA_SHAPE["rope_theta"]  # Gemma configs keep their own per-layer-type rope parameters
GEMMA = {
    "gemma2": ("Gemma2Config", dict(sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=1024)),
}
# --smoke: the same code path on a tiny model (CPU through Triton's interpreter, or any GPU)
SMOKE_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=512,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
SMOKE_WINDOW = 16
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROVIDERS = ["hf_flash", "sdpa", "flex_attention", "eager"]
KEEP_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}


def set_unpad(model, on: bool) -> None:
    """hf_flash rows: the unpad patch (hf_flash.integration.unpad_patch) on or off."""
    from hf_flash.integration import unpad_patch

    base = model.base_model.model
    if on:
        unpad_patch.patch_model(base)
    else:
        unpad_patch.revert_model(base)


def set_checkpointing(model, keep_attention: bool) -> None:
    """Non-reentrant checkpointing of every decoder layer, keeping hf_flash's attention outputs or
    recomputing them."""
    import hf_flash

    kwargs = hf_flash.gradient_checkpointing_kwargs(keep_attention=keep_attention)
    enable_activation_checkpointing(model.base_model.model, kwargs)


def build(family: str, smoke: bool):
    """LoRA-wrapped, checkpointed model (random weights, built directly on the device)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    shape, window = (SMOKE_SHAPE, SMOKE_WINDOW) if smoke else (SHAPE, WINDOW)
    if family == "llama":
        config = transformers.LlamaConfig(**shape)
    elif family == "mistral":
        config = transformers.MistralConfig(**shape, sliding_window=window)
    elif family in GEMMA:
        cls, extra = GEMMA[family]
        if smoke:  # the tiny shape, with its own window
            extra = dict(extra, sliding_window=window)
        config = getattr(transformers, cls)(**(shape if smoke else GEMMA_SHAPE), **extra)
    else:
        raise ValueError(f"unknown family {family!r}: llama, mistral, {', '.join(GEMMA)}")
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"  # gemma2 refuses sdpa
    torch.manual_seed(0)
    # the CPU interpreter is wrong for bf16 dot products (docs/design.md): smoke runs there in fp32
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    enable_activation_checkpointing(model, {"use_reentrant": False})
    model.config.use_cache = False
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    model = get_peft_model(model, lora)
    model.train()
    return model


def workloads(quick: bool, smoke: bool, family: str) -> list[tuple[str, str, int]]:
    """(name, kind, length): kind "single" is one sequence of `length` tokens; "padded" and
    "packed" are 8 sequences of random lengths up to `length`."""
    if smoke:
        return [("S=64", "single", 64), ("padded 8x<=48", "padded", 48), ("packed 8x<=48", "packed", 48)]
    batches = [("padded 8x<=4K", "padded", 4096), ("packed 8x<=4K", "packed", 4096)]
    if quick:
        if family != "llama":
            return [("S=32K", "single", 32768)]
        return [("S=4K", "single", 4096)] + batches
    singles = [(f"S={n // 1024}K", "single", n) for n in (4096, 16384, 32768, 65536)]
    return singles + batches


def make_batch(kind: str, length: int, vocab: int) -> tuple[dict, int]:
    """Model kwargs on the device and the number of real tokens."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(0)
    if kind == "single":
        ids = torch.randint(3, vocab, (1, length), generator=g).to(DEVICE)
        return {"input_ids": ids, "labels": ids}, length
    lengths = torch.randint(length // 16, length + 1, (8,), generator=g).tolist()
    seqs = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    if kind == "padded":
        width = max(lengths)
        ids = torch.zeros(8, width, dtype=torch.long)
        mask = torch.zeros(8, width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    else:
        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        batch = collator([{"input_ids": s.tolist()} for s in seqs])
    batch = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch, sum(lengths)


def _step(model, optimizer, batch: dict) -> None:
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(model, optimizer, batch: dict, warmup: int, steps: int) -> dict:
    def step():
        _step(model, optimizer, batch)

    for _ in range(warmup):
        step()
    _sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - start)
    times.sort()
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None
    return {"step_s": times[len(times) // 2], "peak_gib": peak}


def profile_step(model, optimizer, batch: dict) -> dict:
    """One more step under torch.profiler: its device time and the attention kernels' share."""
    from torch.profiler import ProfilerActivity, profile

    from hf_flash.recipes.profiling import attention_share

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(model, optimizer, batch)
        _sync()
    return attention_share(prof)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["llama", "mistral"])
    parser.add_argument("--providers", nargs="+", default=PROVIDERS, choices=PROVIDERS)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per cell (median)")
    parser.add_argument("--workloads", nargs="+", metavar="NAME",
                        help="only the workloads whose name contains one of these, e.g. S=32K "
                        "padded (a rerun of some rows)")  # fmt: skip
    parser.add_argument("--eager-all", action="store_true", help="also run eager beyond 4K")
    parser.add_argument("--markdown", action="store_true", help="print a BENCHMARKS.md table")
    parser.add_argument("--keep-attention", choices=sorted(KEEP_CHOICES), default="off",
                        help="hf_flash rows: plain checkpointing (off, the default), attention "
                        "outputs kept (on), or a row of each (both)")  # fmt: skip
    parser.add_argument("--unpad-off-row", action="store_true",
                        help="padded workloads: add an hf_flash row with the unpad patch off "
                        "(attention-only unpadding), to separate the two effects")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the profiled step that measures the attention share")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model and lengths: checks the script itself (runs on CPU)")  # fmt: skip
    args = parser.parse_args(argv)
    if DEVICE == "cpu" and not args.smoke:
        parser.error("this benchmark needs a CUDA GPU (--smoke runs a tiny version on the CPU)")
    import hf_flash

    hf_flash.register()
    providers = [p for p in args.providers if not (args.quick and p == "eager")]
    # 3 measured steps even when quick: the short rows are host-bound, and a 2-step "median" is
    # the slower of two (0.57x-1.33x spread of the dense 4K row over five 2-step runs)
    steps, warmup = (3, 1) if args.quick else (args.steps, 1)
    rows = []

    def save():  # after every row, so a run cut short (device time limit) keeps what it measured
        _add_ratios(rows)
        name = "e2e_train-smoke" if args.smoke else "e2e_train"
        return write_results(
            name, rows, args.out, quick=args.quick, smoke=args.smoke, shape=SHAPE, window=WINDOW,
            lora_r=16, steps=steps, warmup=warmup, keep_attention=args.keep_attention,
            gemma={f: GEMMA[f] for f in args.families if f in GEMMA} or None,
            gemma_shape=GEMMA_SHAPE if any(f in GEMMA for f in args.families) else None,
        )  # fmt: skip

    for family in args.families:
        model = build(family, args.smoke)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        vocab = (SMOKE_SHAPE if args.smoke else SHAPE)["vocab_size"]
        for workload, kind, max_len in workloads(args.quick, args.smoke, family):
            if args.workloads and not any(w in workload for w in args.workloads):
                continue
            batch, tokens = make_batch(kind, max_len, vocab)
            variants = [(p, keep, p == "hf_flash") for p in providers
                        for keep in (KEEP_CHOICES[args.keep_attention] if p == "hf_flash" else (False,))]
            if args.unpad_off_row and kind == "padded" and "hf_flash" in providers:
                variants.append(("hf_flash", False, False))
            for provider, keep, unpad in variants:
                row = {"model": family, "workload": workload, "provider": provider,
                       "keep_attention": keep, "tokens": tokens}  # fmt: skip
                if provider == "hf_flash":
                    row["unpad"] = unpad
                skip = None
                if provider == "eager" and kind == "single" and max_len > 4096 and not args.eager_all:
                    skip = "skipped (S x S scores)"
                if provider == "flex_attention" and DEVICE == "cpu":
                    skip = "skipped (FlexAttention has no CPU backward)"
                if provider == "sdpa" and family == "gemma2":
                    skip = "skipped (transformers' sdpa path has no softcap)"
                if skip:
                    row["status"] = skip
                    rows.append(row)
                    continue
                model.base_model.model.set_attn_implementation(provider)
                if provider == "hf_flash":
                    set_unpad(model, unpad)
                set_checkpointing(model, keep)
                try:
                    row.update(measure(model, optimizer, batch, warmup, steps))
                    row["tok_per_s"] = tokens / row["step_s"]
                    if DEVICE == "cuda" and not args.no_profile:
                        row.update(profile_step(model, optimizer, batch))
                    row["status"] = "ok"
                except torch.cuda.OutOfMemoryError:
                    row["status"] = "oom"
                optimizer.zero_grad(set_to_none=True)
                gc.collect()
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                save()
                label = provider + ("+keep" if keep else "") + ("" if unpad or provider != "hf_flash" else "-nounpad")
                share = row.get("attention_share")
                print(f"{family:8s} {workload:14s} {label:14s} {row['status']:4s} "
                      f"{row.get('tok_per_s') or 0:9.0f} tok/s {row.get('peak_gib') or 0:6.1f} GiB"
                      + (f" attention {share:.0%}" if share is not None else ""), flush=True)  # fmt: skip
            del batch
        del model, optimizer
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    path = save()
    cols = ["model", "workload", "provider", "keep_attention", "unpad", "status", "tok_per_s", "peak_gib",
            "attention_share", "vs_sdpa", "vs_flex", "vs_recompute"]  # fmt: skip
    print_table(rows, cols)
    if args.markdown:
        _print_markdown(rows)
    print(f"results: {path}")
    return 0


def _add_ratios(rows: list[dict]) -> None:
    sdpa = {(r["model"], r["workload"]): r.get("tok_per_s") for r in rows if r["provider"] == "sdpa"}
    flex = {(r["model"], r["workload"]): r.get("tok_per_s") for r in rows
            if r["provider"] == "flex_attention"}  # fmt: skip
    plain = {(r["model"], r["workload"]): r.get("tok_per_s") for r in rows
             if r["provider"] == "hf_flash" and not r["keep_attention"] and r.get("unpad", True)}  # fmt: skip
    for r in rows:
        base = sdpa.get((r["model"], r["workload"]))
        if r.get("tok_per_s") and base:
            r["vs_sdpa"] = r["tok_per_s"] / base
        base = flex.get((r["model"], r["workload"]))
        if r.get("tok_per_s") and base:
            r["vs_flex"] = r["tok_per_s"] / base
        base = plain.get((r["model"], r["workload"]))
        if r.get("tok_per_s") and base and r["keep_attention"]:
            r["vs_recompute"] = r["tok_per_s"] / base


def _print_markdown(rows: list[dict]) -> None:
    print("\n| model | workload | provider | attention kept | tokens/s | peak GiB | attention share "
          "| vs sdpa | vs flex_attention |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tok = f"{r['tok_per_s']:.0f}" if r.get("tok_per_s") else r["status"]
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        ratio = f"{r['vs_sdpa']:.2f}x" if r.get("vs_sdpa") else "-"
        vs_flex = f"{r['vs_flex']:.2f}x" if r.get("vs_flex") else "-"
        share = f"{r['attention_share']:.0%}" if r.get("attention_share") is not None else "-"
        kept = "yes" if r["keep_attention"] else "no"
        print(f"| {r['model']} | {r['workload']} | {r['provider']} | {kept} | {tok} | {peak} | {share} "
              f"| {ratio} | {vs_flex} |")


if __name__ == "__main__":
    sys.exit(main())
