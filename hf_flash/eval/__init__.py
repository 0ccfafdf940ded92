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
from .perplexity import PerplexityResult, load_tokens, perplexity_of_tokens, perplexity_vs_length

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
]
