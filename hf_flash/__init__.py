"""hf_flash: FlashAttention in Triton for Hugging Face transformers.

Kernel API (flash-attn 2.x names and semantics, layout ``(batch, seqlen, nheads, headdim)``)::

    from hf_flash import flash_attn_func, flash_attn_varlen_func

Training with gradient checkpointing, keeping the attention outputs instead of recomputing
them (:mod:`hf_flash.checkpointing`)::

    hf_flash.enable_activation_checkpointing(model, hf_flash.gradient_checkpointing_kwargs())

(``model.activation_checkpointing_enable(activation_checkpointing_kwargs=...)`` on transformers
5.23+, ``gradient_checkpointing_enable`` on older releases).

Importing ``hf_flash`` does not import transformers, and the kernel modules load on first use
(so a program can still switch on Triton's CPU interpreter, ``TRITON_INTERPRET=1``, after
``import hf_flash``). It does arrange for ``attn_implementation="hf_flash"`` to be registered
with transformers: at once if transformers is already imported, otherwise right after it is.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> submodule that defines it; resolved lazily by __getattr__
_EXPORTS = {
    "flash_attn_func": "interface",
    "flash_attn_varlen_func": "interface",
    "flash_attn_qkvpacked_func": "interface",
    "flash_attn_kvpacked_func": "interface",
    "flash_attn_varlen_qkvpacked_func": "interface",
    "flash_attn_varlen_kvpacked_func": "interface",
    "register": "integration",
    "flash_attn_with_kvcache": "kvcache",
    "apply_rotary_emb": "rotary",
    "apply_rotary_pos_emb": "rotary",
    "extend_context": "rope_scaling",
    "gradient_checkpointing_kwargs": "checkpointing",
    "enable_activation_checkpointing": "checkpointing",
    "attention_checkpoint_context": "checkpointing",
    "attention_checkpoint_policy": "checkpointing",
    "load_smollm2": "pretrained",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_flash' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


from .integration import install_transformers_hook as _install_transformers_hook  # noqa: E402

_install_transformers_hook()
