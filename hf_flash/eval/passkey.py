"""Synthetic passkey retrieval: can a causal LM fetch a number hidden deep in filler text?

A prompt of exactly ``length`` tokens is filler text with one key sentence inserted at a
relative ``depth`` (0 = start of the filler, 1 = just before the question), ending with a
question whose answer is the key::

    <bos> There is a pass key hidden in this text; find it and remember it.
    <filler ...> The pass key is 48213. Remember it: 48213 is the pass key. <filler ...>
    What is the pass key? The pass key is 48213

A trial succeeds when greedy decoding after "The pass key is" produces exactly the key's
tokens. Greedy decoding emits a sequence iff each of its tokens is the argmax given the
previous ones, so one teacher-forced forward pass over prompt + answer decides it (no
``generate`` loop). Accuracy is reported per (length, depth) cell over several random keys.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import torch

__all__ = [
    "PasskeyResult", "build_passkey_prompt", "passkey_drill", "passkey_grid", "format_grid",
    "save_heatmap",
]  # fmt: skip

_INTRO = "There is a pass key hidden in this text; find it and remember it."
_FILLER = (
    " Rivers run down to the sea. Clouds drift over the hills. Bread is baked in the morning."
    " The train leaves at noon and comes back at night."
)
_KEY = " The pass key is {key}. Remember it: {key} is the pass key."
_QUESTION = " What is the pass key? The pass key is"


def _encode(tokenizer, text: str) -> List[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_passkey_prompt(tokenizer, length: int, depth: float, key: str):
    """(prompt_ids, answer_ids): a prompt of exactly ``length`` tokens and the key's tokens.

    The filler is tokenized once and cut at token granularity, so the total length is exact
    whatever the tokenizer. Raises ValueError when ``length`` cannot hold the fixed parts.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1]")
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    intro = _encode(tokenizer, _INTRO)
    key_ids = _encode(tokenizer, _KEY.format(key=key))
    question = _encode(tokenizer, _QUESTION)
    answer = _encode(tokenizer, " " + key)
    fixed = len(bos) + len(intro) + len(key_ids) + len(question)
    n_filler = length - fixed
    if n_filler < 0:
        raise ValueError(
            f"length={length} tokens cannot hold the prompt's fixed parts ({fixed} tokens); use a "
            f"length >= {fixed}"
        )
    unit = _encode(tokenizer, _FILLER)
    filler = (unit * (n_filler // max(len(unit), 1) + 1))[:n_filler]
    cut = int(round(depth * n_filler))
    prompt = bos + intro + filler[:cut] + key_ids + filler[cut:] + question
    assert len(prompt) == length
    return prompt, answer


def passkey_drill(tokenizer, keys: Sequence[str]) -> List[int]:
    """Training text in the prompt's own words, dense in retrieval: BOS, the intro, then for
    every key its key sentence, the question and the answer, with no filler.

    With one key this is exactly the shortest prompt (``build_passkey_prompt`` with no filler)
    followed by its answer. Each later question asks for the key given just before it, so the
    text holds a copy of every key at two distances and distractors (the earlier keys). For
    pretraining small models, whose retrieval skill (an induction head) forms only when copying
    is a large enough share of the training signal; evaluation uses ``build_passkey_prompt``.
    """
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    ids = bos + _encode(tokenizer, _INTRO)
    for key in keys:
        ids += _encode(tokenizer, _KEY.format(key=key)) + _encode(tokenizer, _QUESTION) + _encode(tokenizer, " " + key)
    return ids


@dataclass
class PasskeyResult:
    lengths: List[int]
    depths: List[float]
    trials: int
    accuracy: List[List[float]]  # [length index][depth index], in [0, 1]
    details: List[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"lengths": self.lengths, "depths": self.depths, "trials": self.trials,
                "accuracy": self.accuracy, "details": self.details}  # fmt: skip


def device_of(model) -> torch.device:
    """Where the model's first parameter lives (the CPU for a model without parameters)."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


@torch.no_grad()
def _retrieved(model, prompt: List[int], answer: List[int]) -> bool:
    device = device_of(model)
    ids = torch.tensor([prompt + answer], device=device)
    logits = model(input_ids=ids).logits[0]  # (len, vocab)
    # logits at position t predict token t + 1: the answer's predictions start at len(prompt) - 1
    pred = logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)].argmax(-1)
    return bool((pred == torch.tensor(answer, device=device)).all())


def passkey_grid(
    model,
    tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    *,
    trials: int = 3,
    seed: int = 0,
    digits: int = 5,
) -> PasskeyResult:
    """Accuracy of passkey retrieval for every (length, depth); ``trials`` random keys each.

    Works with any causal LM returning ``.logits`` (transformers models, PEFT models). Runs in
    eval mode under ``torch.no_grad``; the model's mode is restored afterwards.
    """
    if trials < 1:
        raise ValueError(f"trials={trials} must be >= 1")
    if not lengths or not depths:
        raise ValueError("lengths and depths must be non-empty")
    rng = random.Random(seed)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    accuracy, details = [], []
    try:
        for length in lengths:
            row = []
            for depth in depths:
                hits = 0
                for trial in range(trials):
                    key = str(rng.randrange(10 ** (digits - 1), 10**digits))
                    prompt, answer = build_passkey_prompt(tokenizer, int(length), float(depth), key)
                    ok = _retrieved(model, prompt, answer)
                    hits += ok
                    details.append({"length": int(length), "depth": float(depth), "trial": trial,
                                    "key": key, "retrieved": ok})  # fmt: skip
                row.append(hits / trials)
            accuracy.append(row)
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    return PasskeyResult([int(n) for n in lengths], [float(d) for d in depths], trials, accuracy, details)


def format_grid(result: PasskeyResult) -> str:
    """Accuracy table: one row per context length, one column per depth (percent)."""
    head = "length \\ depth " + " ".join(f"{d:>6.2f}" for d in result.depths)
    lines = [head]
    for n, row in zip(result.lengths, result.accuracy):
        lines.append(f"{n:>14d} " + " ".join(f"{100 * a:>5.0f}%" for a in row))
    return "\n".join(lines)


def save_heatmap(result: PasskeyResult, path, title: Optional[str] = None) -> Path:
    """PNG heatmap of the grid (depth on x, length on y, green = retrieved)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(result.depths), 1.0 + 0.5 * len(result.lengths)))
    im = ax.imshow(result.accuracy, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", origin="lower")
    ax.set_xticks(range(len(result.depths)), [f"{d:.2f}" for d in result.depths])
    ax.set_yticks(range(len(result.lengths)), [str(n) for n in result.lengths])
    ax.set_xlabel("key depth (0 = start, 1 = end)")
    ax.set_ylabel("context length (tokens)")
    for i, row in enumerate(result.accuracy):
        for j, a in enumerate(row):
            ax.text(j, i, f"{100 * a:.0f}", ha="center", va="center", fontsize=8)
    ax.set_title(title or f"passkey retrieval, {result.trials} keys per cell")
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
