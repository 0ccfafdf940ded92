"""``hf-flash-eval passkey|ppl --model PATH ...`` (or ``python -m hf_flash.eval``): load a local
model and evaluate it.

Writes ``passkey.json`` + ``passkey.png`` or ``perplexity.json`` into ``--out`` and prints the
table. ``--extend N --method yarn`` applies :func:`hf_flash.extend_context` before evaluating;
``--adapter DIR`` loads a PEFT adapter on top of the model. Models saved by the LoRA recipe's
embedded tiny model (a byte tokenizer, ``byte_tokenizer.json``) are read too. Without a CUDA GPU
it runs on the CPU, through Triton's interpreter for ``--attn hf_flash``, in float32.

With no arguments it runs a small embedded default: perplexity on the packaged text of
*Persuasion* at 32 and 64 tokens of the tiny model that ``hf-flash-finetune`` (no arguments)
trains, with its LoRA adapter when that run has finished (the base model is built if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

FINETUNE_DEFAULT_DIR = Path("runs/hf-flash-finetune-default")
EMBEDDED_DEFAULT = [
    "ppl", "--model", str(FINETUNE_DEFAULT_DIR / "tiny-llama-base"), "--extend", "64", "--lengths", "32,64",
    "--max-windows", "2", "--out", "runs/hf-flash-eval-default",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _ints(text: str):
    return [int(x) for x in text.split(",") if x]


def _floats(text: str):
    return [float(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = _Parser(prog="hf-flash-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="task", required=True, metavar="{passkey,ppl}")
    helps = {"passkey": "pass-key retrieval accuracy over a length x depth grid (+ PNG heatmap)",
             "ppl": "perplexity against context length on a text file"}
    for name in ("passkey", "ppl"):
        p = sub.add_parser(name, help=helps[name], description=helps[name], formatter_class=fmt)
        p.error = parser.error  # one-line errors in the subcommands too
        p.add_argument("--model", required=True, help="local model folder (or hub id if cached)")
        p.add_argument("--adapter", default=None, help="PEFT adapter folder to load on top")
        p.add_argument("--attn", default="hf_flash", help="attn_implementation")
        p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                       help="model dtype; default bfloat16 on CUDA, float32 on the CPU")
        p.add_argument("--device", default=None, help="torch device; default cuda when available, else cpu")
        p.add_argument("--extend", type=int, default=None, help="extend_context target length")
        p.add_argument("--method", default="yarn", help="extend_context method")
        p.add_argument("--lengths", type=_ints, required=True, help="comma-separated token counts")
        p.add_argument("--out", type=Path, default=Path("eval_results"), help="folder for the results")
    passkey, ppl = sub.choices["passkey"], sub.choices["ppl"]
    passkey.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                         help="comma-separated key depths in [0, 1]")
    passkey.add_argument("--trials", type=int, default=3, help="prompts (random keys) per cell")
    passkey.add_argument("--seed", type=int, default=0, help="seed of the keys and filler")
    ppl.add_argument("--text", default="persuasion",
                     help="UTF-8 text file (.gz read too), or a packaged corpus name: persuasion, northanger-abbey")
    ppl.add_argument("--max-windows", type=int, default=4, help="windows scored per length")
    ppl.add_argument("--score-last", type=int, default=None,
                     help="score only the last N tokens of each window (None: all of them)")
    return parser


def load_tokenizer(path):
    """transformers' tokenizer of ``path``, or the byte tokenizer of the recipe's tiny model."""
    if (Path(path) / "byte_tokenizer.json").is_file():
        from hf_flash.recipes.data import ByteTokenizer

        return ByteTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load(args):
    import torch
    from transformers import AutoModelForCausalLM

    if args.attn == "hf_flash":
        import hf_flash

        hf_flash.register()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=args.attn, dtype=dtype)
    if args.extend is not None:
        from hf_flash.rope_scaling import extend_context

        extend_context(model, args.extend, method=args.method)
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    tokenizer = load_tokenizer(args.model)
    return model.to(args.device).eval(), tokenizer


def _settle_device(args) -> None:
    """CUDA when available, else the CPU in float32 with Triton's interpreter for hf_flash (set
    before any kernel is defined). Raises ValueError with a one-line reason."""
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA GPU is available; use --device cpu")
    if args.device == "cpu" and args.attn == "hf_flash":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from hf_flash._cli import interpreter_problem

        problem = interpreter_problem()
        if problem is not None:
            raise ValueError(problem)
        if args.dtype == "bfloat16":
            raise ValueError("on the CPU hf_flash runs through Triton's interpreter, which computes bfloat16 "
                             "wrongly; use --dtype float32 (or float16)")


def _embedded_model() -> None:
    """The tiny model ``hf-flash-finetune`` trains by default, built here if that never ran."""
    from hf_flash.recipes.data import ByteTokenizer
    from hf_flash.recipes.model import build_tiny_model

    build_tiny_model(FINETUNE_DEFAULT_DIR / "tiny-llama-base", "llama", ByteTokenizer.vocab_size, seed=0)


def main(argv=None) -> int:
    """The ``hf-flash-eval`` command; returns the exit status (2: a one-line error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    embedded = not argv
    if embedded:
        argv = list(EMBEDDED_DEFAULT)
        adapter = FINETUNE_DEFAULT_DIR / "adapter"
        if (adapter / "adapter_config.json").is_file():
            argv += ["--adapter", str(adapter)]
    args = build_parser().parse_args(argv)
    try:
        _settle_device(args)
        if embedded:
            print(
                f"hf-flash-eval: no arguments given, running the embedded default on {args.device} "
                f"({args.dtype}): perplexity on Persuasion at {args.lengths} tokens of the recipe's tiny "
                f"model {args.model}, {'with its LoRA adapter ' + args.adapter if args.adapter else 'without an adapter (run hf-flash-finetune first for one)'}, "
                f"RoPE extended to {args.extend} with {args.method}; results in {args.out}. See --help.",
                flush=True,
            )
            _embedded_model()
        if not Path(args.model).exists():
            raise ValueError(f"--model {args.model} does not exist (give a local model folder)")
        if args.adapter and not Path(args.adapter).is_dir():
            raise ValueError(f"--adapter {args.adapter} is not a folder")
        if args.task == "ppl" and not Path(args.text).is_file():
            from . import CORPUS, corpus_path

            if args.text not in CORPUS:
                raise ValueError(f"--text {args.text}: no such file, nor a packaged corpus ({', '.join(CORPUS)})")
            args.text = corpus_path(args.text)
    except ValueError as e:
        print(f"hf-flash-eval: error: {e}", file=sys.stderr)
        return 2
    model, tokenizer = load(args)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.task == "passkey":
        from .passkey import format_grid, passkey_grid, save_heatmap

        result = passkey_grid(model, tokenizer, args.lengths, args.depths, trials=args.trials, seed=args.seed)
        print(format_grid(result))
        (args.out / "passkey.json").write_text(json.dumps(result.to_dict(), indent=1))
        save_heatmap(result, args.out / "passkey.png", title=f"passkey: {Path(args.model).name}")
    else:
        from .perplexity import perplexity_vs_length

        result = perplexity_vs_length(model, tokenizer, args.text, args.lengths,
                                      max_windows=args.max_windows, score_last=args.score_last)  # fmt: skip
        print(result.format())
        (args.out / "perplexity.json").write_text(json.dumps(result.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
