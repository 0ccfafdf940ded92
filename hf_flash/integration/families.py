"""The model families hf_flash patches, in one table.

Each family names its transformers modeling module, its attention and base-model classes, and
the instance patches that apply to it (switched on or off by
:func:`hf_flash.integration.register`):

* ``fused_rope`` (:mod:`.rope_patch`): the attention forward calls hf_flash's fused rotary
  kernel; needs an attention class whose forward calls the module-level
  ``apply_rotary_pos_emb`` (the Llama template).
* ``fused_decode`` (:mod:`.decode_patch`): projection, RoPE, cache append and attention of a
  decode step in one kernel launch; needs Llama's attention layout and cache calls.
* ``unpad`` (:mod:`.unpad_patch`): padded batches without a cache run the decoder stack on
  their valid tokens only; needs a base model whose forward takes ``position_ids`` and passes
  attention keywords through to every layer.

Models of other families still run on ``attn_implementation="hf_flash"`` through the attention
function; they only miss these patches. Adding a family is a row here, once its model tests
pass with the patch.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import NamedTuple, Optional

PATCHES = ("fused_rope", "fused_decode", "unpad")


class Family(NamedTuple):
    attention: str  # attention class name in the modeling module
    base_model: str  # base model class name (the decoder stack)
    patches: frozenset  # which of PATCHES apply


_ALL = frozenset(PATCHES)
_ROPE_UNPAD = frozenset({"fused_rope", "unpad"})
_UNPAD = frozenset({"unpad"})

# model_type -> family; the modeling module is transformers.models.<type>.modeling_<type>
FAMILIES = {
    "llama": Family("LlamaAttention", "LlamaModel", _ALL),
    "mistral": Family("MistralAttention", "MistralModel", _ALL),
    "qwen2": Family("Qwen2Attention", "Qwen2Model", _ROPE_UNPAD),
    "qwen3": Family("Qwen3Attention", "Qwen3Model", _ROPE_UNPAD),
    "phi3": Family("Phi3Attention", "Phi3Model", _UNPAD),
    "gemma2": Family("Gemma2Attention", "Gemma2Model", _UNPAD),
}


def model_type(model) -> Optional[str]:
    return getattr(getattr(model, "config", None), "model_type", None)


def patch_target(model, patch: str):
    """``(modeling module, family)`` when ``patch`` applies to this model's family, else None.
    Imports the modeling module (transformers' version is checked first)."""
    name = model_type(model)
    family = FAMILIES.get(name)
    if family is None or patch not in family.patches:
        return None
    from .registration import check_transformers_version

    check_transformers_version()
    return modeling_module(name), family


def modeling_module(name: str) -> ModuleType:
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
