"""Fused RoPE for Llama-family attention modules, one model instance at a time.

In transformers 5.17 ... 5.23 ``LlamaAttention.forward`` (and Mistral's, Qwen2's, Qwen3's, which
are generated from it) calls the module-level function ``apply_rotary_pos_emb(q, k, cos, sin)``
of its modeling file; there is no per-instance hook (the ``use_kernelized_func`` class decorator
is a no-op unless the Hub ``kernels`` package is installed and enabled). Replacing that
module-level name would change every model of the family in the process. Instead each attention
module of the patched model gets an instance-level ``forward``: the class's own forward function
(same code object, same defaults and closure) whose globals map ``apply_rotary_pos_emb`` to
:func:`hf_flash.rotary.apply_rotary_pos_emb`. Everything else in the forward (projections, KV
cache, the attention function chosen by ``config._attn_implementation``) is transformers' code.
Other instances, and models loaded later, are untouched; :func:`revert_model` deletes the
instance attribute, and the fused path also checks a per-module record at each call, so a revert
takes effect even when another per-instance wrapper (the fused-decode patch) was stacked on top.

cos/sin come from the model's rotary module unchanged, so every RoPE scaling method and its
``attention_scaling`` (YaRN's mscale, multiplied into cos and sin) is kept.

When accelerate has hooked a module (``device_map=...``), its wrapper stays outermost and the
patch goes to ``module._old_forward``, which the wrapper calls.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
import warnings
from typing import Callable, Dict, Tuple

__all__ = [
    "patch_model",
    "revert_model",
    "patch_llama",
    "patch_mistral",
    "patch_qwen2",
    "patch_qwen3",
    "FAMILY_PATCHES",
    "is_patched",
]

_ORIGINAL = "_hf_flash_rope_original"  # on a patched module: (attribute name, what it held)
_ROTARY_NAME = "apply_rotary_pos_emb"
_HF_SIGNATURE = ["q", "k", "cos", "sin", "unsqueeze_dim"]

# model_type -> (modeling module, attention class)
_FAMILIES: Dict[str, Tuple[str, str]] = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaAttention"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralAttention"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3Attention"),
}


def _version_gate() -> None:
    from .registration import check_transformers_version

    check_transformers_version()


def _patched_forward(cls, modeling) -> Callable:
    """The class's forward function re-bound to globals where RoPE is hf_flash's."""
    from hf_flash.rotary import apply_rotary_pos_emb

    fn = cls.__dict__.get("forward")
    if not isinstance(fn, types.FunctionType) or _ROTARY_NAME not in fn.__code__.co_names:
        raise _Unsupported(
            f"{cls.__name__}.forward does not call {_ROTARY_NAME} by its module-level name in "
            "this transformers release"
        )
    original = getattr(modeling, _ROTARY_NAME, None)
    if original is None or list(inspect.signature(original).parameters) != _HF_SIGNATURE:
        raise _Unsupported(
            f"{modeling.__name__}.{_ROTARY_NAME} is missing or its signature changed (expected "
            f"{_HF_SIGNATURE})"
        )
    namespace = dict(fn.__globals__)
    namespace[_ROTARY_NAME] = apply_rotary_pos_emb
    # A code object of its own: torch.compile caches its transformed bytecode per code object
    # and puts the compiled graphs into the globals of the function it compiled first, so the
    # class's forward (module globals) and this one (a copy) must not share one code object.
    code = fn.__code__.replace(co_name=fn.__code__.co_name)
    patched = types.FunctionType(code, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    patched.__kwdefaults__ = fn.__kwdefaults__
    patched.__qualname__ = fn.__qualname__
    patched.__doc__ = fn.__doc__

    # The fused forward runs only while the module carries the patch record, so a revert takes
    # effect even when a later wrapper (e.g. the fused-decode patch) still holds this function.
    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        impl = patched if _ORIGINAL in self.__dict__ else fn
        return impl(self, *args, **kwargs)

    forward.__hf_flash_fused_rope__ = True
    return forward


class _Unsupported(Exception):
    pass


def _patch_family(model, family: str, rope: bool) -> bool:
    if not rope:
        return False
    _version_gate()
    module_name, cls_name = _FAMILIES[family]
    modeling = importlib.import_module(module_name)
    cls = getattr(modeling, cls_name)
    try:
        forward = _patched_forward(cls, modeling)
    except _Unsupported as err:
        warnings.warn(f"hf_flash fused RoPE not applied: {err}", stacklevel=3)
        return False
    found, blocked = False, []
    for name, module in model.named_modules():
        if type(module) is not cls:
            continue
        found = True
        if _ORIGINAL in module.__dict__:
            continue  # already patched (post_init runs once per nested PreTrainedModel)
        attr = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
        previous = module.__dict__.get(attr)
        if attr == "forward" and previous is not None:
            # another per-instance patch (e.g. fused decode) would be silently dropped
            blocked.append(name)
            continue
        object.__setattr__(module, _ORIGINAL, (attr, previous))
        object.__setattr__(module, attr, types.MethodType(forward, module))
    if blocked:
        warnings.warn(
            f"hf_flash fused RoPE not applied to {len(blocked)} module(s) (first: {blocked[0]}) "
            "that already have an instance-level forward from another patch; apply the fused "
            "RoPE patch first (hf_flash.integration.register does)",
            stacklevel=3,
        )
    return found and not blocked


def patch_llama(model, rope: bool = True) -> bool:
    """Fused RoPE in every ``LlamaAttention`` of ``model``. Returns True if any was found."""
    return _patch_family(model, "llama", rope)


def patch_mistral(model, rope: bool = True) -> bool:
    """Fused RoPE in every ``MistralAttention`` of ``model``."""
    return _patch_family(model, "mistral", rope)


def patch_qwen2(model, rope: bool = True) -> bool:
    """Fused RoPE in every ``Qwen2Attention`` of ``model``."""
    return _patch_family(model, "qwen2", rope)


def patch_qwen3(model, rope: bool = True) -> bool:
    """Fused RoPE in every ``Qwen3Attention`` of ``model``."""
    return _patch_family(model, "qwen3", rope)


FAMILY_PATCHES: Dict[str, Callable] = {
    "llama": patch_llama,
    "mistral": patch_mistral,
    "qwen2": patch_qwen2,
    "qwen3": patch_qwen3,
}


def patch_model(model, rope: bool = True) -> bool:
    """Use hf_flash's fused rotary kernel in this model instance's attention modules.

    Works with any ``attn_implementation`` (eager, sdpa, hf_flash, ...), and with PEFT-wrapped
    models. Returns True when the model's family is supported and its attention modules are
    patched (or already were), False, changing nothing, for other families (dispatch on
    ``config.model_type``: llama, mistral, qwen2, qwen3) or ``rope=False``.

    Raises:
        ImportError: unsupported transformers version (see hf_flash.integration.registration).
    """
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    patch = FAMILY_PATCHES.get(family)
    if patch is None:
        return False
    return patch(model, rope=rope)


def revert_model(model) -> int:
    """Undo :func:`patch_model` on every module of ``model``; returns how many were reverted."""
    count = 0
    for module in model.modules():
        saved = module.__dict__.get(_ORIGINAL)
        if saved is None:
            continue
        attr, previous = saved
        holder = _holder_of_patch(module)
        if holder == attr:
            if previous is None:  # the class's forward was in use (None survives deepcopy)
                module.__dict__.pop(attr, None)
            else:
                object.__setattr__(module, attr, previous)
        elif holder is not None:
            # a wrapper installed after the patch (accelerate moves forward to _old_forward):
            # keep the wrapper, point it at the class's forward
            object.__setattr__(module, holder, types.MethodType(type(module).forward, module))
        del module.__dict__[_ORIGINAL]
        count += 1
    return count


def _holder_of_patch(module):
    for attr in ("forward", "_old_forward"):
        fn = getattr(module.__dict__.get(attr), "__func__", None)
        if getattr(fn, "__hf_flash_fused_rope__", False):
            return attr
    return None


def is_patched(module) -> bool:
    """True if this attention module runs hf_flash's fused RoPE."""
    return _ORIGINAL in getattr(module, "__dict__", {})
