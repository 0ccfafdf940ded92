"""Long-context training on one GPU: the memory features and the planner that picks them.

    import hf_flash.training
    model = get_peft_model(model, lora_config)
    plan = hf_flash.training.enable(model, seq_len=131072)   # prints the plan
    # then Trainer / SFTTrainer / your own loop as usual

:func:`enable` predicts the step's peak memory from the model's shape, the tokens per
micro-batch and the free device and host memory, and switches on only what is needed, fastest
first (:mod:`hf_flash.training.plan`): the chunked linear cross-entropy
(:mod:`~hf_flash.training.causal_lm`, :mod:`~hf_flash.training.loss`), activation checkpointing
that keeps hf_flash's attention outputs (:mod:`hf_flash.checkpointing`), plain checkpointing, the
tiled MLP (:mod:`~hf_flash.training.tiled_mlp`) and checkpointed layer inputs offloaded to pinned
host memory (:mod:`~hf_flash.training.offload`). Where Liger-Kernel is installed, the model's
RMSNorms and SwiGLU MLPs run on its fused functions on every setting
(:mod:`~hf_flash.training.fused_ops`). Each is also usable on its own.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "enable": "api",
    "plan_of": "api",
    "keep_lora_inputs_under_autocast": "api",
    "Plan": "plan",
    "make_plan": "plan",
    "use_chunked_loss": "causal_lm",
    "restore_loss": "causal_lm",
    "chunked_linear_cross_entropy": "loss",
    "OffloadStats": "offload",
    "checkpoint_with_offload": "offload",
    "offload_checkpoints": "offload",
    "unoffload_checkpoints": "offload",
    "tile_mlp": "tiled_mlp",
    "untile_mlp": "tiled_mlp",
    "use_liger": "fused_ops",
    "unuse_liger": "fused_ops",
    "liger_problem": "fused_ops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_flash.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
