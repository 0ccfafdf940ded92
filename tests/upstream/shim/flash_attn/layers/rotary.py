"""``flash_attn.layers.rotary`` for flash-attn's tests."""

from hf_flash import apply_rotary_emb  # noqa: F401
