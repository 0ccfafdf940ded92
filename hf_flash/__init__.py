"""hf_flash: FlashAttention in Triton for Hugging Face transformers.

Kernel API (flash-attn 2.x names and semantics, layout ``(batch, seqlen, nheads, headdim)``)::

    from hf_flash import flash_attn_func, flash_attn_varlen_func

Importing ``hf_flash`` does not import transformers. The ``attn_implementation="hf_flash"``
registration with transformers happens when transformers is (or has been) imported, or
explicitly with :func:`hf_flash.register`.
"""

from .interface import flash_attn_func, flash_attn_varlen_func

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "__version__"]
