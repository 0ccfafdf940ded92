"""Fused RoPE for Llama-family attention modules, one model instance at a time.

In transformers 5.17 ... 5.24 ``LlamaAttention.forward`` (and Mistral's, Qwen2's, Qwen3's, which
are generated from it) calls the module-level function ``apply_rotary_pos_emb(q, k, cos, sin)``
of its modeling file; there is no per-instance hook (the ``use_kernelized_func`` class decorator
is a no-op unless the Hub ``kernels`` package is installed and enabled). Replacing that
module-level name would change every model of the family in the process. Instead each attention
module of the patched model gets an instance-level ``forward``: the class's own forward function
(same code object, same defaults and closure) whose globals map ``apply_rotary_pos_emb`` to
:func:`hf_flash.rotary.apply_rotary_pos_emb`. Everything else in the forward (projections, KV
cache, the attention function chosen by ``config._attn_implementation``) is transformers' code.
A decorator on the class's forward (5.24's ``deprecate_kwarg``, which still accepts the old
``past_key_values`` keyword) is rebuilt around the patched function, so calls behave the same.
Other instances, and models loaded later, are untouched; :func:`revert_model` deletes the
instance attribute (:mod:`hf_flash.integration.patching`), and the fused path also checks its
per-module record at each call, so a revert takes effect even when another per-instance wrapper
(the fused-decode patch) was stacked on top.

cos/sin come from the model's rotary module unchanged, so every RoPE scaling method and its
``attention_scaling`` (YaRN's mscale, multiplied into cos and sin) is kept.

When accelerate has hooked a module (``device_map=...``), its wrapper stays outermost and the
patch goes to ``module._old_forward``, which the wrapper calls.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from typing import Callable

from .families import patch_target
from .patching import is_wrapped, unwrap_forwards, wrap_instances

__all__ = ["patch_model", "revert_model", "is_patched"]

_RECORD = "_hf_flash_rope_original"  # on a patched module: (attribute name, what it held)
_ROTARY_NAME = "apply_rotary_pos_emb"
_HF_SIGNATURE = ["q", "k", "cos", "sin", "unsqueeze_dim"]


def _patched_forward(cls, modeling) -> Callable:
    """The class's forward function re-bound to globals where RoPE is hf_flash's."""
    from hf_flash.rotary import apply_rotary_pos_emb

    fn = cls.__dict__.get("forward")
    # the class's forward may be decorated (transformers 5.24: ``deprecate_kwarg`` maps the old
    # ``past_key_values`` keyword to ``cache``): the chain down to the function that calls RoPE
    chain = [fn]
    while not (isinstance(chain[-1], types.FunctionType)
               and _ROTARY_NAME in chain[-1].__code__.co_names):  # fmt: skip
        inner = getattr(chain[-1], "__wrapped__", None)
        if inner is None or len(chain) > 8:
            raise _Unsupported(
                f"{cls.__name__}.forward does not call {_ROTARY_NAME} by its module-level name "
                "in this transformers release"
            )
        chain.append(inner)
    original = getattr(modeling, _ROTARY_NAME, None)
    if original is None or list(inspect.signature(original).parameters) != _HF_SIGNATURE:
        raise _Unsupported(
            f"{modeling.__name__}.{_ROTARY_NAME} is missing or its signature changed (expected "
            f"{_HF_SIGNATURE})"
        )
    namespace = dict(chain[-1].__globals__)
    namespace[_ROTARY_NAME] = apply_rotary_pos_emb
    patched = _copy_function(chain[-1], namespace, chain[-1].__closure__)
    # each decorator again, around the patched function instead of the original one
    for wrapper, inner in zip(reversed(chain[:-1]), reversed(chain[1:])):
        patched = _rewrapped(cls, wrapper, inner, patched)

    # The fused forward runs only while the module carries the patch record, so a revert takes
    # effect even when a later wrapper (e.g. the fused-decode patch) still holds this function.
    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        impl = patched if _RECORD in self.__dict__ else fn
        return impl(self, *args, **kwargs)

    return forward


def _copy_function(fn: types.FunctionType, namespace: dict, closure) -> types.FunctionType:
    # A code object of its own: torch.compile caches its transformed bytecode per code object
    # and puts the compiled graphs into the globals of the function it compiled first, so the
    # class's forward (module globals) and this one (a copy) must not share one code object.
    code = fn.__code__.replace(co_name=fn.__code__.co_name)
    copy = types.FunctionType(code, namespace, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    copy.__dict__.update(fn.__dict__)
    return copy


def _rewrapped(cls, wrapper, inner, patched) -> types.FunctionType:
    """``wrapper`` (a decorator's closure around ``inner``) rebuilt around ``patched``."""
    cells = wrapper.__closure__ if isinstance(wrapper, types.FunctionType) else None
    if not cells or not any(_holds(c, inner) for c in cells):
        raise _Unsupported(
            f"{cls.__name__}.forward is wrapped by {getattr(wrapper, '__qualname__', wrapper)!r}, "
            "whose closure does not hold the function it wraps"
        )
    closure = tuple(types.CellType(patched) if _holds(c, inner) else c for c in cells)
    copy = _copy_function(wrapper, wrapper.__globals__, closure)
    copy.__wrapped__ = patched
    return copy


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


class _Unsupported(Exception):
    pass


def patch_model(model, rope: bool = True) -> bool:
    """Use hf_flash's fused rotary kernel in this model instance's attention modules.

    Works with any ``attn_implementation`` (eager, sdpa, hf_flash, ...), and with PEFT-wrapped
    models. Returns True when the model's family has the ``fused_rope`` patch
    (:mod:`hf_flash.integration.families`: llama, mistral, qwen2, qwen3) and its attention
    modules are patched (or already were); False, changing nothing, for other families or
    ``rope=False``.

    Raises:
        ImportError: unsupported transformers version (see hf_flash.integration.registration).
    """
    target = patch_target(model, "fused_rope") if rope else None
    if target is None:
        return False
    modeling, family = target
    cls = getattr(modeling, family.attention)
    try:
        forward = _patched_forward(cls, modeling)
    except _Unsupported as err:
        warnings.warn(f"hf_flash fused RoPE not applied: {err}", stacklevel=2)
        return False
    # post_init runs once per nested PreTrainedModel: patched modules are skipped; a module with
    # another per-instance forward (e.g. fused decode) is refused, that patch would be dropped
    found, blocked = wrap_instances(
        model, cls, _RECORD, lambda current: forward, over_class_forward=True
    )
    if blocked:
        warnings.warn(
            f"hf_flash fused RoPE not applied to {len(blocked)} module(s) (first: {blocked[0]}) "
            "that already have an instance-level forward from another patch; apply the fused "
            "RoPE patch first (hf_flash.integration.register does)",
            stacklevel=2,
        )
    return found and not blocked


def revert_model(model) -> int:
    """Undo :func:`patch_model` on every module of ``model``; returns how many were reverted."""
    return unwrap_forwards(model, _RECORD)


def is_patched(module) -> bool:
    """True if this attention module runs hf_flash's fused RoPE."""
    return is_wrapped(module, _RECORD)
