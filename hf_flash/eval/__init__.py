"""Long-context evaluation for any causal LM: passkey retrieval and perplexity vs length.

Library use::

    from hf_flash.eval import passkey_grid, format_grid, save_heatmap, perplexity_vs_length

    grid = passkey_grid(model, tokenizer, lengths=[4096, 8192], depths=[0, 0.5, 1])
    print(format_grid(grid)); save_heatmap(grid, "passkey.png")
    print(perplexity_vs_length(model, tokenizer, "book.txt", [1024, 4096]).format())

Command line: ``python -m hf_flash.eval {passkey,ppl} --help``.
"""

from .passkey import (
    PasskeyResult,
    build_passkey_prompt,
    format_grid,
    passkey_drill,
    passkey_grid,
    save_heatmap,
)
from .perplexity import (
    PerplexityResult,
    load_tokens,
    perplexity_of_tokens,
    perplexity_vs_length,
    read_text,
)

# Real prose kept in the package (corpus/README.md): two public-domain novels by Jane Austen
CORPUS = {
    "persuasion": "austen-persuasion.txt.gz",
    "northanger-abbey": "austen-northanger-abbey.txt.gz",
}


def corpus_path(name: str):
    """Path of a corpus text (gzip; ``read_text`` and ``load_tokens`` read it): one of
    ``CORPUS``."""
    from pathlib import Path

    if name not in CORPUS:
        raise ValueError(f"unknown corpus text {name!r}; available: {sorted(CORPUS)}")
    return Path(__file__).parent / "corpus" / CORPUS[name]


__all__ = [
    "PasskeyResult",
    "build_passkey_prompt",
    "format_grid",
    "passkey_drill",
    "passkey_grid",
    "save_heatmap",
    "PerplexityResult",
    "load_tokens",
    "perplexity_of_tokens",
    "perplexity_vs_length",
    "read_text",
    "CORPUS",
    "corpus_path",
]
