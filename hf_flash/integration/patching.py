"""Per-instance forward patches: one wrap / unwrap mechanism for every family patch.

A patch gives one module instance an instance-level ``forward`` built from the forward it had
(the class's, or another patch's instance-level one), and records on the module, under the
patch's own record name, what it replaced; :func:`unwrap_forwards` restores exactly that.
Other instances of the class, and models loaded later, are untouched.

When accelerate has hooked the module (``device_map=...``) its wrapper stays outermost and the
patch goes to ``module._old_forward``, which the wrapper calls. A wrapper installed *after* the
patch (accelerate moves ``forward`` to ``_old_forward``) is kept on revert: the attribute that
now holds the patch is pointed back at what the patch replaced. A patch's forward that
another patch may wrap checks its record at each call and passes the call through once the
record is gone, so reverting it takes effect under the other wrapper too.

transformers 5.24 renamed the KV-cache argument of the models' and attention layers' forwards
from ``past_key_values`` to ``cache`` (the old name still works through a ``deprecate_kwarg``
wrapper); :func:`cache_parameter` reads which one a forward takes from its signature, once, when
a patch is made.
"""

from __future__ import annotations

import inspect
import types
from typing import Callable

_MARK = "__hf_flash_patch__"  # on an installed forward function: its record name

# the KV-cache argument of transformers' forwards: its name from 5.24 on, and before
CACHE_NAMES = ("cache", "past_key_values")


def cache_parameter(forward: Callable) -> str:
    """The name under which ``forward`` takes the KV cache: ``"cache"`` (transformers >= 5.24)
    or ``"past_key_values"`` (5.17 ... 5.23). Read from its signature (decorators that set
    ``__wrapped__`` are looked through); TypeError when it has neither."""
    params = inspect.signature(forward).parameters
    for name in CACHE_NAMES:
        if name in params:
            return name
    raise TypeError(
        f"{getattr(forward, '__qualname__', forward)!r} takes neither of {CACHE_NAMES} "
        f"(parameters: {list(params)}); hf_flash's patches know transformers 5.17 ... 5.24"
    )


def wrap_forward(
    module, record: str, make_forward: Callable, *, over_class_forward: bool = False
) -> bool:
    """Install ``make_forward(current_bound_forward)`` as ``module``'s forward, noting what it
    replaced under ``record``. False (nothing done) when ``record`` is already there, or when
    ``over_class_forward`` and the module already has an instance-level forward (a patch whose
    forward re-implements the class's instead of calling the current one would drop it)."""
    if record in module.__dict__:
        return False
    attr = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    previous = module.__dict__.get(attr)  # an instance-level forward (another patch), or None
    if over_class_forward and attr == "forward" and previous is not None:
        return False
    current = getattr(module, attr)  # bound: the instance's or the class's forward
    fn = make_forward(current)
    setattr(fn, _MARK, record)
    object.__setattr__(module, record, (attr, previous))
    object.__setattr__(module, attr, types.MethodType(fn, module))
    return True


def wrap_instances(model, cls, record: str, make_forward: Callable, **options) -> tuple:
    """:func:`wrap_forward` on every module of ``model`` whose type is exactly ``cls``.
    Returns ``(found, refused)``: whether any such module exists, and the names of those it
    left alone because ``options`` forbade the patch there (already patched ones are fine)."""
    found, refused = False, []
    for name, module in model.named_modules():
        if type(module) is not cls:
            continue
        found = True
        if record not in module.__dict__ and not wrap_forward(
            module, record, make_forward, **options
        ):
            refused.append(name)
    return found, refused


def unwrap_forwards(model, record: str) -> int:
    """Undo :func:`wrap_forward` for ``record`` on every module of ``model``; returns how many."""
    count = 0
    for module in model.modules():
        saved = module.__dict__.get(record)
        if saved is None:
            continue
        attr, previous = saved
        holder = _holder(module, record)
        if holder == attr:
            if previous is None:  # the class's forward was in use (None survives deepcopy)
                module.__dict__.pop(attr, None)
            else:
                object.__setattr__(module, attr, previous)
        elif holder is not None:
            # a wrapper installed after the patch moved it: keep the wrapper, point it at what
            # the patch replaced
            replaced = previous or types.MethodType(type(module).forward, module)
            object.__setattr__(module, holder, replaced)
        # else another patch wraps this one and stays: the patch's forward sees its record gone
        # and passes calls through (see the patch modules)
        del module.__dict__[record]
        count += 1
    return count


def is_wrapped(module, record: str) -> bool:
    return record in getattr(module, "__dict__", {})


def _holder(module, record: str):
    """The attribute that holds this patch's forward now (None if neither does)."""
    for attr in ("forward", "_old_forward"):
        fn = getattr(module.__dict__.get(attr), "__func__", None)
        if getattr(fn, _MARK, None) == record:
            return attr
    return None
