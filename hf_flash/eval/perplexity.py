"""Perplexity versus context length on a local text file.

The file is tokenized once. For each context length ``L`` the token stream is cut into
consecutive, non-overlapping windows of ``L`` tokens (at most ``max_windows`` of them, the
same starting offsets for every ``L`` as far as the text allows) and each window is scored in
one forward pass. With ``score_last=k`` only the last ``k`` tokens of each window count, so every
length is judged on tokens that see at least ``L - k`` tokens of context, which isolates the
benefit (or harm) of longer context; by default every predicted token counts.

``perplexity = exp(mean negative log-likelihood)`` over the scored tokens, computed in float32
from the model's logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .passkey import device_of

__all__ = [
    "PerplexityResult", "perplexity_vs_length", "perplexity_of_tokens", "load_tokens", "read_text",
]  # fmt: skip


@dataclass
class PerplexityResult:
    lengths: List[int]
    perplexity: List[float]
    nll: List[float]  # mean negative log-likelihood per scored token (nats)
    tokens_scored: List[int]
    windows: List[int]

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def format(self) -> str:
        lines = [f"{'length':>8} {'windows':>8} {'tokens':>10} {'ppl':>10}"]
        for n, w, t, p in zip(self.lengths, self.windows, self.tokens_scored, self.perplexity):
            lines.append(f"{n:>8d} {w:>8d} {t:>10d} {p:>10.3f}")
        return "\n".join(lines)


def read_text(path: Union[str, Path]) -> str:
    """A UTF-8 text file's contents; ``*.gz`` files are decompressed."""
    path = Path(path)
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


def load_tokens(tokenizer, path: Union[str, Path]) -> torch.Tensor:
    """Token ids (int64, 1-D) of a UTF-8 text file (``*.gz`` too), with the tokenizer's BOS
    first if it has one."""
    text = read_text(path)
    if not text.strip():
        raise ValueError(f"{path} contains no text")
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    bos = getattr(tokenizer, "bos_token_id", None)
    return torch.tensor(([bos] if bos is not None else []) + ids, dtype=torch.long)


@torch.no_grad()
def perplexity_of_tokens(
    model,
    tokens: torch.Tensor,
    lengths: Sequence[int],
    *,
    max_windows: int = 4,
    score_last: Optional[int] = None,
) -> PerplexityResult:
    """Perplexity at each context length over windows of a 1-D token tensor (see module doc)."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if max_windows < 1:
        raise ValueError(f"max_windows={max_windows} must be >= 1")
    device = device_of(model)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    out = PerplexityResult([], [], [], [], [])
    try:
        for length in lengths:
            length = int(length)
            if length < 2:
                raise ValueError(f"context length {length} must be >= 2")
            if score_last is not None and not 1 <= score_last < length:
                raise ValueError(f"score_last={score_last} must be in [1, {length})")
            n_windows = min(max_windows, tokens.numel() // length)
            if n_windows == 0:
                raise ValueError(
                    f"the text has {tokens.numel()} tokens, fewer than one window of {length}; "
                    "use a longer file or shorter lengths"
                )
            total_nll, total_tokens = 0.0, 0
            for w in range(n_windows):
                window = tokens[w * length : (w + 1) * length].to(device)[None]
                logits = model(input_ids=window).logits[0, :-1].float()  # predicts tokens 1..L-1
                targets = window[0, 1:]
                if score_last is not None:
                    logits, targets = logits[-score_last:], targets[-score_last:]
                nll = F.cross_entropy(logits, targets, reduction="sum")
                total_nll += nll.item()
                total_tokens += targets.numel()
            mean = total_nll / total_tokens
            out.lengths.append(length)
            out.nll.append(mean)
            out.perplexity.append(math.exp(mean))
            out.tokens_scored.append(total_tokens)
            out.windows.append(n_windows)
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    return out


def perplexity_vs_length(
    model,
    tokenizer,
    path: Union[str, Path],
    lengths: Sequence[int],
    *,
    max_windows: int = 4,
    score_last: Optional[int] = None,
) -> PerplexityResult:
    """Perplexity of ``model`` on the text file at ``path`` for each context length."""
    tokens = load_tokens(tokenizer, path)
    return perplexity_of_tokens(model, tokens, lengths, max_windows=max_windows, score_last=score_last)
