"""The README's plots, drawn from the committed results (no GPU needed)::

    python -m benchmarks.plots            # -> docs/img/*.png

- ``attention.png``: attention TFLOP/s against sequence length, hf_flash beside SDPA's default
  (cuDNN), SDPA's flash backend (FA2) and FlexAttention (``benchmarks/results/attention-*.json``),
  with the latest run of the current default kernels marked separately
  (``benchmarks/results/attention_latest-*.json``) when it exists;
- ``e2e_train.png``: training tokens/s per workload, hf_flash beside transformers' sdpa,
  flex_attention and eager paths (``e2e_train-*.json``);
- ``decode.png``: KV-cache decode bandwidth against context length (``decode-*.json``);
- ``generate.png``: ``generate`` milliseconds per token, DynamicCache and StaticCache
  (``e2e_generate-*.json``).

Each figure's title names the GPU, the shapes and the date of the run it draws.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
COLORS = {
    "hf_flash": "#d62728", "sdpa_cudnn": "#1f77b4", "sdpa": "#1f77b4", "sdpa_flash": "#2ca02c",
    "flex": "#9467bd", "flex_attention": "#9467bd", "eager": "#7f7f7f", "sdpa_gqa": "#1f77b4",
    "hf_sdpa": "#17becf",
}  # fmt: skip
LABELS = {
    "hf_flash": "hf_flash", "sdpa_cudnn": "SDPA default (cuDNN)", "sdpa_flash": "SDPA flash (FA2)",
    "flex": "FlexAttention", "sdpa": "transformers sdpa", "flex_attention": "transformers flex_attention",
    "eager": "transformers eager", "sdpa_gqa": "SDPA (enable_gqa)", "hf_sdpa": "transformers sdpa path",
}  # fmt: skip


def _load(prefix: str) -> dict | None:
    files = sorted(RESULTS.glob(f"{prefix}-*.json"))
    files = [f for f in files if "H100" in f.name] or files
    return json.loads(files[0].read_text()) if files else None


def _date(data: dict) -> str:
    return data["env"]["date"][:10]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def attention(out: Path) -> Path | None:
    data = _load("attention")
    if data is None:
        return None
    latest = _load("attention_latest")
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, pas in zip(axes, ("fwd", "fwd+bwd")):
        rows = sorted((r for r in data["rows"] if r["head_dim"] == 128 and r["mask"] == "causal"
                       and r["pass"] == pas), key=lambda r: r["seqlen"])  # fmt: skip
        seqs = [r["seqlen"] for r in rows]
        for p in ("hf_flash", "sdpa_cudnn", "sdpa_flash", "flex"):
            label = LABELS[p] + (" (Triton kernels)" if p == "hf_flash" and latest else "")
            ax.plot(seqs, [r["tflops"].get(p) for r in rows], marker="o", color=COLORS[p],
                    label=label, linestyle="--" if p == "hf_flash" and latest else "-")  # fmt: skip
        if latest:
            lr = [r for r in latest["rows"] if r["head_dim"] == 128 and r["mask"] == "causal"
                  and r["pass"] == pas]  # fmt: skip
            ax.plot([r["seqlen"] for r in lr], [r["tflops"]["hf_flash"] for r in lr], marker="*",
                    markersize=14, linestyle="none", color=COLORS["hf_flash"],
                    label=f"hf_flash, current default ({_date(latest)})")  # fmt: skip
            # SDPA with no backend forced (cuDNN on an H100); older runs timed the cuDNN backend
            peer = [r["tflops"].get("sdpa", r["tflops"].get("sdpa_cudnn")) for r in lr]
            ax.plot([r["seqlen"] for r in lr], peer, marker="*",
                    markersize=14, linestyle="none", color=COLORS["sdpa_cudnn"],
                    label=f"SDPA default, same run ({_date(latest)})")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (16K tokens per batch)")
        ax.set_title(f"{pas}, head dim 128, causal")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Attention, bf16, 32 query / 8 KV heads, {data['env']['gpu']} "
                 f"(grid {_date(data)})", fontsize=10)  # fmt: skip
    return _save(fig, out / "attention.png")


def e2e_train(out: Path) -> Path | None:
    data = _load("e2e_train")
    if data is None:
        return None
    plt = _plt()
    import numpy as np

    providers = ["hf_flash", "sdpa", "flex_attention", "eager"]
    work = []
    for r in data["rows"]:
        key = (r["model"], r["workload"])
        if r["provider"] == "hf_flash" and r["status"] == "ok" and key not in work:
            work.append(key)
    val = {(r["model"], r["workload"], r["provider"]): r["tok_per_s"] for r in data["rows"]
           if r["status"] == "ok"}  # fmt: skip
    fig, ax = plt.subplots(figsize=(11, 4.4))
    x = np.arange(len(work))
    width = 0.2
    for i, p in enumerate(providers):
        ys = [val.get((m, w, p), 0) or 0 for m, w in work]
        ax.bar(x + (i - 1.5) * width, [y / 1e3 for y in ys], width, color=COLORS[p], label=LABELS[p])
    ax.set_xticks(x, [f"{m}\n{w.replace(' 8x', chr(10) + '8x')}" for m, w in work], fontsize=7)
    ax.set_ylabel("training tokens/s (thousands)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"LoRA training step (r=16), bf16, 1.2B Llama/Mistral shape (2048 hidden, 16 layers,\n"
                 f"32/8 heads of 64), {data['env']['gpu']} ({_date(data)}; no bar: out of memory or not run)",
                 fontsize=9)  # fmt: skip
    return _save(fig, out / "e2e_train.png")


def decode(out: Path) -> Path | None:
    data = _load("decode")
    if data is None:
        return None
    plt = _plt()
    batches = sorted({r["batch"] for r in data["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.6), sharey=True)
    for ax, b in zip(axes, batches):
        for p in ("hf_flash", "sdpa_gqa", "hf_sdpa"):
            rows = sorted((r for r in data["rows"] if r["batch"] == b and r["provider"] == p
                           and r.get("GB_s")), key=lambda r: r["context"])  # fmt: skip
            if not rows:
                continue
            ax.plot([r["context"] for r in rows], [r["GB_s"] for r in rows], marker="o",
                    color=COLORS[p], label=LABELS[p])  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s of K/V read")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"One-token decode attention, bf16, CUDA graphs, {data['env']['gpu']} "
                 f"({_date(data)})", fontsize=10)  # fmt: skip
    return _save(fig, out / "decode.png")


def generate(out: Path) -> Path | None:
    data = _load("e2e_generate")
    if data is None:
        return None
    plt = _plt()
    import numpy as np

    keys = []
    for r in data["rows"]:
        k = (r["batch"], r["prompt"], r["cache"])
        if k not in keys:
            keys.append(k)
    val = {(r["batch"], r["prompt"], r["cache"], r["attn"]): r["ms_per_step"] for r in data["rows"]}
    fig, ax = plt.subplots(figsize=(9, 3.8))
    x = np.arange(len(keys))
    for i, p in enumerate(("hf_flash", "sdpa")):
        ax.bar(x + (i - 0.5) * 0.38, [val.get(k + (p,), 0) for k in keys], 0.38, color=COLORS[p],
               label=LABELS[p] if p != "sdpa" else "transformers sdpa")  # fmt: skip
    ax.set_xticks(x, [f"B={b}, {s // 1024}K\n{c}" for b, s, c in keys], fontsize=8)
    ax.set_ylabel("ms per generated token (lower is better)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"generate(), 128 new tokens, {data['meta']['model']},\nbf16, {data['env']['gpu']} "
                 f"({_date(data)})", fontsize=9)  # fmt: skip
    return _save(fig, out / "generate.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "docs" / "img",
                        help="folder for the PNG files (default: docs/img)")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for fn in (attention, e2e_train, decode, generate):
        path = fn(args.out)
        print(f"{fn.__name__}: {path if path else 'no results file, skipped'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
