"""``python -m hf_flash.eval passkey|ppl --model PATH ...``: load a local model and evaluate it.

Writes ``passkey.json`` + ``passkey.png`` or ``perplexity.json`` into ``--out`` and prints the
table. ``--extend N --method yarn`` applies :func:`hf_flash.extend_context` before evaluating;
``--adapter DIR`` loads a PEFT adapter on top of the model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _ints(text: str):
    return [int(x) for x in text.split(",") if x]


def _floats(text: str):
    return [float(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hf_flash.eval", description=__doc__)
    sub = parser.add_subparsers(dest="task", required=True)
    for name in ("passkey", "ppl"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True, help="local model folder (or hub id if cached)")
        p.add_argument("--adapter", default=None, help="PEFT adapter folder to load on top")
        p.add_argument("--attn", default="hf_flash", help="attn_implementation (default hf_flash)")
        p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
        p.add_argument("--device", default="cuda")
        p.add_argument("--extend", type=int, default=None, help="extend_context target length")
        p.add_argument("--method", default="yarn", help="extend_context method (default yarn)")
        p.add_argument("--lengths", type=_ints, required=True, help="comma-separated token counts")
        p.add_argument("--out", type=Path, default=Path("eval_results"))
    sub.choices["passkey"].add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    sub.choices["passkey"].add_argument("--trials", type=int, default=3)
    sub.choices["passkey"].add_argument("--seed", type=int, default=0)
    sub.choices["ppl"].add_argument("--text", type=Path, required=True, help="UTF-8 text file")
    sub.choices["ppl"].add_argument("--max-windows", type=int, default=4)
    sub.choices["ppl"].add_argument("--score-last", type=int, default=None)
    return parser


def load(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    return model.to(args.device).eval(), tokenizer


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
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
