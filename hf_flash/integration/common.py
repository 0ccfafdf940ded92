"""What every attention path of the transformers integration does alike to its inputs: the
window convention and the compute dtype. Plain PyTorch; never imports transformers."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

_HALF = (torch.float16, torch.bfloat16)


def flash_window(sliding_window: Optional[int]) -> Tuple[int, int]:
    """flash-attn's ``window_size`` for transformers' ``sliding_window``: transformers' window w
    counts the query itself (key j visible to query i iff ``i - w < j <= i``), flash-attn's left
    bound is inclusive, so w becomes ``(w - 1, w - 1)`` (the right bound is then cut to 0 by
    causal attention). None / False: no window."""
    if sliding_window is None or sliding_window is False:
        return (-1, -1)
    w = int(sliding_window)
    if w <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be a positive int or None")
    return (w - 1, w - 1)


def cast_to_kernel_dtype(module, q, k, v):
    """PEFT (fp32 layer norms) and autocast hand over fp32 q/k/v; run them in the half dtype the
    model computes in, as transformers' flash path does. A genuinely fp32 model stays fp32."""
    if q.dtype != torch.float32:
        return q, k.to(q.dtype), v.to(q.dtype)
    target = None
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        target = torch.get_autocast_dtype(device_type)
    else:
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_is_quantized"):
            target = getattr(config, "dtype", None)
        else:
            for sub in module.modules():
                if isinstance(sub, torch.nn.Linear):
                    target = sub.weight.dtype
                    break
    if target in _HALF:
        return q.to(target), k.to(target), v.to(target)
    return q, k.float(), v.float()
