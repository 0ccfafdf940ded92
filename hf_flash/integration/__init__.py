"""transformers integration: ``attn_implementation="hf_flash"``.

Nothing here imports transformers at import time (kernel-only users never pay for it).
``hf_flash/__init__.py`` calls :func:`install_transformers_hook`, which registers hf_flash with
transformers at once if transformers is already imported, and otherwise right after the
``transformers`` package finishes importing (a one-shot ``sys.meta_path`` finder). The work itself
lives in :mod:`hf_flash.integration.registration`; :func:`register` is its explicit entry point.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings

# The name users pass as attn_implementation; transformers sees "flash" in it (docs/design.md).
ATTN_IMPLEMENTATION = "hf_flash"

__all__ = ["ATTN_IMPLEMENTATION", "register", "install_transformers_hook"]


def register(*, fused_rope: bool = True, fused_decode: bool = True, unpad: bool = True) -> None:
    """Make ``attn_implementation="hf_flash"`` available in transformers (idempotent).

    Registers hf_flash's attention function and mask function, points transformers' flash
    loader at hf_flash's flash-attn-compatible functions for the name "hf_flash", and arranges
    that every model built with (or switched to) "hf_flash" gets the instance patches switched
    on here, for the families :mod:`hf_flash.integration.families` lists them for:

    * ``fused_rope`` (:mod:`hf_flash.integration.rope_patch`; Llama, Mistral, Qwen2, Qwen3):
      the attention forward rotates q and k with one fused kernel launch;
    * ``fused_decode`` (:mod:`hf_flash.integration.decode_patch`; Llama, Mistral): a decode
      step on a StaticCache or a DynamicCache appends the new keys/values, rotates them and
      attends in one launch (inference only);
    * ``unpad`` (:mod:`hf_flash.integration.unpad_patch`; Llama, Mistral, Qwen2, Qwen3, Phi3,
      Gemma2): padded batches without a KV cache run the decoder stack on their valid tokens
      only.

    Calling it again only updates the switches, for models built or switched afterwards.

    Raises:
        ImportError: transformers is missing or its version is outside the supported range.
    """
    from . import registration

    registration.register(fused_rope=fused_rope, fused_decode=fused_decode, unpad=unpad)


def install_transformers_hook() -> None:
    """Register with transformers now if it is imported, else right after it is (never raises:
    a failure becomes a warning here; :func:`register` raises it)."""
    if "transformers" in sys.modules:
        _register_or_warn()
        return
    if not any(isinstance(f, _AfterTransformersImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTransformersImport())


def _register_or_warn() -> None:
    from . import registration

    try:
        registration.ensure_registered()
    except ImportError as err:
        warnings.warn(
            f"hf_flash could not register attn_implementation='hf_flash': {err}",
            stacklevel=3,
        )


class _AfterTransformersImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``transformers`` is about to be imported, it asks the other
    finders for the real spec and wraps that loader's ``exec_module`` so hf_flash registers once
    the package has executed. Removes itself when that happens, not at the lookup: libraries
    probe for transformers with ``importlib.util.find_spec("transformers")`` (TRL does on
    import) and never execute the spec they get, so the lookup alone must not use it up."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "transformers":
            return None
        spec = None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is not self and find_spec is not None:
                spec = find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module
        finder = self

        def exec_then_register(module):
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            exec_module(module)
            _register_or_warn()

        # An instance attribute shadows the method for this one loader only.
        spec.loader.exec_module = exec_then_register
        return spec
