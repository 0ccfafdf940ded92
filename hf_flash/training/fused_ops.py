"""Liger-Kernel's fused RMSNorm and SwiGLU on a transformers model, when it is installed.

hf_flash writes its own kernels only where no well-kept library has them. For the parts of a
decoder layer around attention, Liger-Kernel (``pip install liger-kernel``; the ``test`` extra
installs it) has Triton kernels whose memory matters at long context:

- RMSNorm: transformers' Llama-style norm computes in float32 and autograd keeps that float32 copy
  of its input for the backward pass: ``tokens x hidden x 4`` bytes per norm, two norms per layer
  (16 KiB per token per norm on the 8B Llama-3 shape; 6 GiB per norm at 384K tokens). Liger's
  kernel keeps only its input (which the layer holds anyway) and one float32 per row.
- SwiGLU: ``act(gate) * up`` keeps ``act(gate)`` besides ``gate`` and ``up``; Liger's fused
  function keeps ``gate`` and ``up`` only and recomputes the activation in the backward pass.

:func:`use_liger` rebinds the ``forward`` of the model's own RMSNorm and MLP modules (instances
only: no class or module-level function of transformers or of other models in the process
changes) to call ``liger_kernel.ops.LigerRMSNormFunction`` / ``LigerSiLUMulFunction``, the same
functions Liger's ``LigerRMSNorm`` and ``LigerSwiGLUMLP`` call, with the options Liger uses for
these model types (``casting_mode="llama"``, no offset, ``in_place=True``). The projections stay
the model's own modules, so peft's LoRA layers inside the MLP keep working, and
:mod:`~hf_flash.training.tiled_mlp` tiles the fused MLP like any other.

Numerics: not bitwise. Liger's norm rounds ``x * rstd`` to the activation dtype before the weight
multiplies it, as transformers' does, but its reductions run in another order; its SwiGLU computes
``silu(gate) * up`` in float32 before rounding once, where transformers rounds ``silu(gate)``
first. tests/training checks losses and LoRA gradients against the unfused model with the error
rule (GPU: Liger's kernels need CUDA).

Only model types whose norm and MLP are exactly Llama's are patched (:data:`SUPPORTED`);
Gemma's ``1 + weight`` norms, fused ``gate_up`` projections (Phi-3) and mixture-of-experts
blocks keep transformers' code.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch
from torch import nn

from ..integration.patching import unwrap_forwards, wrap_forward

__all__ = ["SUPPORTED", "liger_problem", "use_liger", "unuse_liger"]

_RECORD = "_hf_flash_liger"

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
"""Model types whose RMSNorm is ``weight * (x * rsqrt(mean(x^2) + eps))`` computed in float32
and rounded before the weight, and whose MLP is ``down(silu(gate(x)) * up(x))``."""

_SWIGLU_ACTS = ("silu", "swish")


def _base(model):
    get_base = getattr(model, "get_base_model", None)  # peft
    return get_base() if callable(get_base) else model


def _config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def liger_problem(model, device: Optional[torch.device] = None) -> Optional[str]:
    """Why :func:`use_liger` cannot run on ``model`` (None: it can). ``device``: where training
    runs (default: the model's parameters' device). Checks the package, the device (Liger's
    kernels need CUDA) and the model type, before anything is changed."""
    base = _base(model)
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    if device is None:
        device = next(base.parameters()).device
    if torch.device(device).type != "cuda":
        return f"Liger-Kernel's kernels need a CUDA device, and training runs on {torch.device(device).type}"
    model_type = getattr(_config(base), "model_type", None)
    if model_type not in SUPPORTED:
        return (f"model type {model_type!r} is not one whose RMSNorm and MLP are Llama's "
                f"(supported: {', '.join(SUPPORTED)})")  # fmt: skip
    return None


def _rms_norm_forward(eps: float):
    from liger_kernel.ops import LigerRMSNormFunction

    def make(previous):
        def forward(self, hidden_states):
            # Liger's options for Llama-style norms: float32 rstd, the product rounded before the
            # weight, dY overwritten by dX in the backward pass (nothing else reads the norm's
            # output gradient)
            return LigerRMSNormFunction.apply(hidden_states, self.weight, eps, 0.0, "llama", True, None)

        return forward

    return make


def _swiglu_forward(previous):
    from liger_kernel.ops import LigerSiLUMulFunction

    def forward(self, x):
        return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))

    return forward


def _is_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and getattr(module, "variance_epsilon", None) is not None)  # fmt: skip


def _is_swiglu(module: nn.Module, hidden_act: Optional[str]) -> bool:
    return (type(module).__name__.endswith("MLP") and hidden_act in _SWIGLU_ACTS
            and all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")))  # fmt: skip


def use_liger(model, *, rms_norm: bool = True, swiglu: bool = True,
              device: Optional[torch.device] = None) -> dict:  # fmt: skip
    """Run ``model``'s RMSNorms and SwiGLU MLPs on Liger-Kernel's fused functions (module
    docstring).

    Arguments:
        model: a transformers model of a type in :data:`SUPPORTED`, or peft's wrapper of one.
            Call it before :func:`~hf_flash.training.tiled_mlp.tile_mlp` when both are used
            (:func:`hf_flash.training.enable` does).
        rms_norm, swiglu: which to patch.
        device: where training runs (default: the model's device); must be CUDA.

    Return: ``{"rms_norm": n, "swiglu": m}``, the modules patched (already patched ones count).

    Raises RuntimeError naming the reason (:func:`liger_problem`) when Liger cannot be used.
    :func:`unuse_liger` restores transformers' forwards.
    """
    problem = liger_problem(model, device)
    if problem:
        raise RuntimeError(f"use_liger: {problem}")
    base = _base(model)
    hidden_act = getattr(_config(base), "hidden_act", None)
    counts = {"rms_norm": 0, "swiglu": 0}
    for module in base.modules():
        if rms_norm and _is_norm(module):
            if _RECORD in module.__dict__ or wrap_forward(
                module, _RECORD, _rms_norm_forward(float(module.variance_epsilon)), over_class_forward=True
            ):  # fmt: skip
                counts["rms_norm"] += 1
        elif swiglu and _is_swiglu(module, hidden_act):
            if _RECORD in module.__dict__ or wrap_forward(module, _RECORD, _swiglu_forward, over_class_forward=True):
                counts["swiglu"] += 1
    return counts


def unuse_liger(model) -> int:
    """Restore the forwards :func:`use_liger` replaced; returns how many (0 if none)."""
    return unwrap_forwards(_base(model), _RECORD)
