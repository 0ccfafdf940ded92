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
of ``--repeats`` (3) is kept. The eager rows (DynamicCache; the static cache with
``--no-compile``) are bound by host time, which drifts on a shared machine: their providers'
runs alternate within a point (A B A B ...) instead of running one after the other. ``tokens_match_sdpa`` is the fraction of generated tokens equal to
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


def _prompt(model, batch, prompt):
    g = torch.Generator(device=DEVICE).manual_seed(batch * 100003 + prompt)
    return torch.randint(0, min(128000, model.config.vocab_size), (batch, prompt), device=DEVICE,
                         generator=g)  # fmt: skip


def _row(batch, prompt, attn, cache_impl, n_new, t_one, t_all, compiled):
    ms = (t_all - t_one) / (n_new - 1) * 1e3
    if ms <= 0:
        # the one-token run took as long as all of them: the decode steps are lost in the
        # timing noise (a loaded host, too few new tokens); no per-step number to report
        return _error_row(batch, prompt, attn, cache_impl, RuntimeError(
            f"per-step time not measurable: {n_new} new tokens took {t_all * 1e3:.2f} ms, one took "
            f"{t_one * 1e3:.2f} ms (timing noise over the decode steps; use more new tokens)"))
    return dict(
        batch=batch, prompt=prompt, attn=attn, cache=cache_impl, new_tokens=n_new,
        ms_per_step=ms, tokens_per_s=batch * 1e3 / ms, prefill_plus_setup_ms=t_one * 1e3,
        compiled=compiled,
    )  # fmt: skip


def _error_row(batch, prompt, attn, cache_impl, e):
    return dict(batch=batch, prompt=prompt, attn=attn, cache=cache_impl,
                error=f"{type(e).__name__}: {str(e)[:300]}")  # fmt: skip


def run_compiled(model, batch, prompt, attn, n_new, repeats):
    """A static-cache row with generate's compiled decode step: one provider at a time, each
    from a clean compiler state."""
    from transformers import StaticCache

    model.set_attn_implementation(attn)
    ids = _prompt(model, batch, prompt)
    cache = StaticCache(config=model.config, max_cache_len=prompt + n_new + 8)
    torch._dynamo.reset()
    with torch.no_grad():
        _generate(model, ids, 4, "static", cache, True)  # warm-up / compile
        gen = lambda n: _generate(model, ids, n, "static", cache, True)  # noqa: E731
        t_one = min(gen(1)[0] for _ in range(repeats))
        runs = [gen(n_new) for _ in range(repeats)]
    del cache
    row = _row(batch, prompt, attn, "static", n_new, t_one, min(t for t, _ in runs), True)
    return row, runs[0][1]


def run_interleaved(model, batch, prompt, attns, cache_impl, n_new, repeats):
    """Rows of the eager (host-bound) runs: every provider is warmed up, then their timed runs
    alternate (A B A B ...), so a drift in the machine's speed during the point falls on all of
    them alike; each keeps its best time. After each switch of the attention implementation an
    untimed one-token run takes the switch's one-time cost, which would otherwise land in the
    one-token time and bias the per-step estimate low (negative on the CPU test model)."""
    from transformers import StaticCache

    ids = _prompt(model, batch, prompt)
    cache = None
    if cache_impl == "static":
        cache = StaticCache(config=model.config, max_cache_len=prompt + n_new + 8)
    gen = lambda n: _generate(model, ids, n, cache_impl, cache, False)  # noqa: E731
    rows, tokens, ones, alls = {}, {}, {}, {}
    with torch.no_grad():
        for attn in attns:
            try:
                model.set_attn_implementation(attn)
                gen(4)  # warm-up: Triton compilation, cuBLAS handles
                ones[attn], alls[attn] = [], []
            except Exception as e:  # recorded, the other providers go on
                rows[attn] = _error_row(batch, prompt, attn, cache_impl, e)
        for _ in range(repeats):
            for attn in list(ones):
                try:
                    model.set_attn_implementation(attn)
                    gen(1)  # untimed: takes the switch's one-time cost (see the docstring)
                    ones[attn].append(gen(1)[0])
                    t, tokens[attn] = gen(n_new)
                    alls[attn].append(t)
                except Exception as e:
                    rows[attn] = _error_row(batch, prompt, attn, cache_impl, e)
                    del ones[attn]
    for attn in ones:
        rows[attn] = _row(batch, prompt, attn, cache_impl, n_new, min(ones[attn]),
                          min(alls[attn]), False)  # fmt: skip
    del cache
    return [rows[a] for a in attns], tokens


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
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
    attns = args.attn.split(",")
    for batch, prompt in points(args.quick):
        for cache_impl in args.caches.split(","):
            tokens = {}
            if cache_impl == "static" and not args.no_compile:
                for attn in attns:
                    try:
                        row, tokens[attn] = run_compiled(model, batch, prompt, attn,
                                                         args.new_tokens, args.repeats)  # fmt: skip
                    except Exception as e:  # recorded, the grid goes on
                        row = _error_row(batch, prompt, attn, cache_impl, e)
                    rows.append(row)
                    gc.collect()
                    torch.cuda.empty_cache()
            else:
                point_rows, tokens = run_interleaved(model, batch, prompt, attns, cache_impl,
                                                     args.new_tokens, args.repeats)  # fmt: skip
                rows.extend(point_rows)
                gc.collect()
                torch.cuda.empty_cache()
            if "sdpa" in tokens:
                for r in rows[-len(attns):]:
                    if r.get("attn") in tokens and "error" not in r:
                        same = (tokens[r["attn"]] == tokens["sdpa"]).float().mean().item()
                        r["tokens_match_sdpa"] = same
            print_table(rows[-len(attns):],
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
