"""A padding mask's per-row valid block, and the mask as bool at a chosen width, in one launch.

The attention integration reads every 2-D padding mask once on the host (is it all valid, is
every row's valid part contiguous, where does it start and end). Spelled in torch ops that is
about fifteen small launches and one device-to-host copy per forward pass; a compiled decode
step of a 1B model then spends more host time building its mask than launching its CUDA graph.
This kernel does the same work in one launch:

    out[b, j]     = mask[b, j] != 0 for j < width_in, False for width_in <= j < width_out
    stats[0, b]   = first j with out[b, j] (width_out if none)
    stats[1, b]   = one past the last such j, at least stats[0, b]
    stats[2, b]   = number of such j

so a row's True entries are contiguous iff ``stats[1, b] - stats[0, b] == stats[2, b]``. One
program per row walks it in blocks; masks are small (bytes per key, not per head and dim).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .launch import CachedLauncher

_BLOCK = 1024


@triton.jit
def _key_mask_kernel(
    Mask, Out, Stats,
    stride_mb, stride_mj, stride_ob, batch, width_in, width_out,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    mask_row = Mask + row.to(tl.int64) * stride_mb
    out_row = Out + row.to(tl.int64) * stride_ob
    first = width_out
    last = 0
    count = 0
    for start in range(0, width_out, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = tl.load(mask_row + offs.to(tl.int64) * stride_mj, mask=offs < width_in, other=0) != 0
        tl.store(out_row + offs, valid, mask=offs < width_out)
        first = tl.minimum(first, tl.min(tl.where(valid, offs, width_out), 0))
        last = tl.maximum(last, tl.max(tl.where(valid, offs + 1, 0), 0))
        count += tl.sum(valid.to(tl.int32), 0)
    tl.store(Stats + row, first)
    tl.store(Stats + batch + row, tl.maximum(last, first))
    tl.store(Stats + 2 * batch + row, count)


_KEY_MASK = CachedLauncher(_key_mask_kernel)
_META = None


@configs.on_input_device
def key_mask_rows(mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, stats)`` of a (B, M) padding mask (any dtype, nonzero = valid, any strides):
    ``out`` the (B, width) bool mask, ``width >= M``, padded with False; ``stats`` a (3, B) int32
    tensor whose rows are each row's first valid index, one past its last and its count (see
    the module docstring). One launch, no host sync."""
    global _META
    if mask.dim() != 2:
        raise ValueError(f"key_mask_rows needs a 2-D (batch, keys) mask, got shape {tuple(mask.shape)}")
    batch, width_in = mask.shape
    if width < width_in:
        raise ValueError(f"width {width} is narrower than the mask's {width_in} keys")
    if width >= 2**31 - _BLOCK:
        raise ValueError(f"masks of up to {2**31 - _BLOCK - 1} keys are supported, got {width}")
    out = torch.empty((batch, width), dtype=torch.bool, device=mask.device)
    stats = torch.empty((3, batch), dtype=torch.int32, device=mask.device)
    if batch == 0:
        return out, stats
    if _META is None:
        _META = _KEY_MASK.meta(BLOCK=_BLOCK, num_warps=4)
    _KEY_MASK((batch,), (mask, out, stats),
              (mask.stride(0), mask.stride(1), width, batch, width_in, width), (), _META)  # fmt: skip
    return out, stats
