"""Per-instance forward wrappers shared by the family patches (fused decode, unpad).

A patch gives one module instance an instance-level ``forward`` built around the forward it
had (the class's, or another patch's instance-level one), and records on the module what it
replaced, so that :func:`unwrap_forwards` restores exactly that. When accelerate has hooked the
module (``device_map=...``) its wrapper stays outermost and the patch goes to
``module._old_forward``, which the wrapper calls.
"""

from __future__ import annotations

import types
from typing import Callable


def wrap_forward(module, record: str, make_forward: Callable) -> bool:
    """Install ``make_forward(current_bound_forward)`` as ``module``'s forward, noting the
    replaced attribute under ``record``. False (nothing done) when ``record`` is already there."""
    if record in module.__dict__:
        return False
    attr = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    previous = module.__dict__.get(attr)  # an instance-level forward (another patch), or None
    current = getattr(module, attr)  # bound: the instance's or the class's forward
    object.__setattr__(module, record, (attr, previous))
    object.__setattr__(module, attr, types.MethodType(make_forward(current), module))
    return True


def unwrap_forwards(model, record: str) -> int:
    """Undo :func:`wrap_forward` for ``record`` on every module of ``model``; returns how many."""
    count = 0
    for module in model.modules():
        saved = module.__dict__.get(record)
        if saved is None:
            continue
        attr, previous = saved
        if previous is None:  # the class's forward was in use
            module.__dict__.pop(attr, None)
        else:
            object.__setattr__(module, attr, previous)
        del module.__dict__[record]
        count += 1
    return count
