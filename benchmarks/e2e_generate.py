"""End-to-end greedy generation: milliseconds per decode step, hf_flash beside sdpa.

Run on a GPU from the repository root::

    PYTHONPATH=. python benchmarks/e2e_generate.py --out OUTDIR [--quick] [--no-compile]

Model: a randomly initialised Llama of 1.2B parameters (hidden 2048, 16 layers, 32 query / 8
key-value heads of dim 64, MLP 8192, vocab 128256, Llama-3 RoPE), bf16, built directly on the
GPU. Points: B=1 with 4K and 32K prompts, B=16 with 4K prompts (``--quick``: B=1, 4K only);
``--new-tokens`` (128) greedy tokens each.

Rows: attn in {hf_flash, sdpa} x cache in {dynamic, static}. One model serves every row
(``set_attn_implementation`` switches; hf_flash's patches follow the switch). With the static
cache, generate compiles the decode step (transformers' automatic ``torch.compile``, CUDA
graphs) unless ``--no-compile``. hf_flash runs the fused decode of
``hf_flash.integration.decode_patch`` with both caches (the DynamicCache's layers then append
into spare slots of their buffers). A static cache object of fixed size is reused (reset
between runs) so compiled graphs are reused too. Each compiled static row starts from a clean
compiler state (``torch._dynamo.reset()``), as in a process that runs one attention
implementation: otherwise every row's compiled step piles up in one frame's cache, where each
call's guard checks walk past the other rows' entries and the recompile limit is reached.

ms/step = (time of a run with N new tokens - time of a run with 1 new token) / (N - 1): the
prefill and generate's set-up cancel out. Each run is timed with ``torch.cuda.synchronize`` and
``time.perf_counter`` after one warm-up run (compilation, autotuning, graph capture); the best
of ``--repeats`` is kept. ``tokens_match_sdpa`` is the fraction of generated tokens equal to
sdpa's on the same cache type (bf16 greedy runs may diverge after a near tie; the tests hold the
numerical bar).
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import base_parser, print_table, write_results  # noqa: E402

VOCAB = 128256
DEVICE = "cuda"  # a module constant so a CPU smoke run can swap it


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=VOCAB,
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=128001, pad_token_id=128004,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM._from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def points(quick: bool):
    return [(1, 4096)] if quick else [(1, 4096), (1, 32768), (16, 4096)]


def _generate(model, ids, n_new, cache_impl, cache, compile_static):
    kw = dict(
        max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=128004,
        attention_mask=torch.ones_like(ids),
    )  # fmt: skip
    if cache_impl == "static":
        cache.reset()
        kw["past_key_values"] = cache
        kw["disable_compile"] = not compile_static
    _sync()
    t0 = time.perf_counter()
    out = model.generate(ids, **kw)
    _sync()
    return time.perf_counter() - t0, out[:, ids.shape[1] :]


def run(model, batch, prompt, attn, cache_impl, n_new, repeats, compile_static):
    from transformers import StaticCache

    model.set_attn_implementation(attn)
    g = torch.Generator(device=DEVICE).manual_seed(batch * 100003 + prompt)
    ids = torch.randint(0, min(128000, model.config.vocab_size), (batch, prompt), device=DEVICE,
                        generator=g)
    cache = None
    if cache_impl == "static":
        cache = StaticCache(config=model.config, max_cache_len=prompt + n_new + 8)
        if compile_static:
            torch._dynamo.reset()
    with torch.no_grad():
        _generate(model, ids, 4, cache_impl, cache, compile_static)  # warm-up / compile
        gen = lambda n: _generate(model, ids, n, cache_impl, cache, compile_static)  # noqa: E731
        t_one = min(gen(1)[0] for _ in range(repeats))
        runs = [gen(n_new) for _ in range(repeats)]
    t_all = min(t for t, _ in runs)
    ms = (t_all - t_one) / (n_new - 1) * 1e3
    row = dict(
        batch=batch, prompt=prompt, attn=attn, cache=cache_impl, new_tokens=n_new,
        ms_per_step=ms, tokens_per_s=batch * 1e3 / ms, prefill_plus_setup_ms=t_one * 1e3,
        compiled=cache_impl == "static" and compile_static,
    )  # fmt: skip
    del cache
    return row, runs[0][1]


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="static cache without compile")
    parser.add_argument("--attn", default="hf_flash,sdpa")
    parser.add_argument("--caches", default="static,dynamic")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/e2e_generate.py needs a CUDA GPU")
    import hf_flash

    hf_flash.register()
    model = build_model()
    rows = []
    for batch, prompt in points(args.quick):
        for cache_impl in args.caches.split(","):
            tokens = {}
            for attn in args.attn.split(","):
                try:
                    row, toks = run(model, batch, prompt, attn, cache_impl, args.new_tokens,
                                    args.repeats, not args.no_compile)  # fmt: skip
                    tokens[attn] = toks
                except Exception as e:  # recorded, the grid goes on
                    row = dict(batch=batch, prompt=prompt, attn=attn, cache=cache_impl,
                               error=f"{type(e).__name__}: {str(e)[:300]}")  # fmt: skip
                rows.append(row)
                gc.collect()
                torch.cuda.empty_cache()
            if "sdpa" in tokens:
                for r in rows[-len(tokens):]:
                    if r.get("attn") in tokens and "error" not in r:
                        same = (tokens[r["attn"]] == tokens["sdpa"]).float().mean().item()
                        r["tokens_match_sdpa"] = same
            print_table(rows[-len(args.attn.split(",")):],
                        ["batch", "prompt", "attn", "cache", "ms_per_step", "tokens_per_s",
                         "tokens_match_sdpa", "error"])  # fmt: skip
            sys.stdout.flush()
            # rewritten as rows arrive, so a run cut short still leaves its rows
            path = write_results(
                "e2e_generate", rows, args.out, quick=args.quick,
                compile_static=not args.no_compile,
                model="llama-1.2B-random (2048h, 16L, 32/8 heads, d64, vocab 128256)",
            )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
