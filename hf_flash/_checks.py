"""Input checks shared by every public entry point, and the conversions every path makes alike.

Checks run at the public boundary, before any kernel launches, and raise ``TypeError`` /
``ValueError`` naming what was wrong and what is supported. Entry points skip them while
torch.compile traces (the traced call was checked eagerly, or the tracer checks shapes itself);
checks that read device values on the host also skip while a CUDA graph is captured
(:func:`hf_flash._runtime.host_reads_allowed`).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._runtime import host_reads_allowed, interpreter_active

# dtypes the attention, decode and rotary kernels take (float32 is computed in true float32)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the kernels' head-dim limit (gemma4's global layers use 512); configs.py sizes tiles up to it
MAX_HEAD_DIM = 512
# paged K/V caches: page sizes must be a multiple of this (the decode kernel's key tiles)
PAGE_MULTIPLE = 16


def kernel_window(causal: bool, window_size) -> Tuple[int, int]:
    """flash-attn's ``(left, right)`` window as the kernels take it: every negative bound is -1
    (unbounded, as flash-attn reads any negative value), and causal attention is the window
    with ``right = 0`` (bottom-right aligned). ``window_size`` was checked at the public
    boundary (:func:`check_window`); this runs on every call, so it only converts."""
    left, right = max(int(window_size[0]), -1), max(int(window_size[1]), -1)
    return left, (0 if causal else right)


def check_window(window_size) -> None:
    """A pair of ints, or a two-element integer tensor (flash-attn accepts both); any negative
    bound is unbounded. ValueError for anything else."""
    if isinstance(window_size, Tensor):
        if window_size.numel() == 2 and _integer_dtype(window_size):
            return
    elif isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        if all(_integer(w) for w in window_size):
            return
    raise ValueError(
        f"window_size={window_size!r} must be a pair (left, right) of ints or a two-element "
        "integer tensor; a negative bound is unbounded"
    )


def _integer_dtype(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _integer(w) -> bool:
    if isinstance(w, Tensor):
        return w.numel() == 1 and _integer_dtype(w)
    return isinstance(w, int) and not isinstance(w, bool)


def unit_last_stride(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t`` itself when its last dimension has unit stride (any other layout is fine for the
    kernels), else a contiguous copy."""
    if t is None or t.stride(-1) == 1:
        return t
    return t.contiguous()


def as_int(x) -> int:
    """A Python int from an int or a one-element tensor (one host read)."""
    return int(x.item()) if isinstance(x, Tensor) else int(x)


def check_tensor_basics(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Tensors, one supported dtype, one device, a device the kernels run on."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(
                f"{name}.dtype is {t.dtype}; hf_flash supports float16, bfloat16 and float32"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}"
        )
    check_kernel_device(q.device, "hf_flash kernels")


def check_kernel_device(device: torch.device, what: str) -> None:
    """CUDA, or the CPU while Triton's interpreter is on."""
    if device.type == "cpu" and not interpreter_active():
        raise ValueError(
            f"{what} run on CUDA tensors; got CPU tensors. To run on the CPU (slowly, for "
            "tests), set TRITON_INTERPRET=1 before importing hf_flash."
        )
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {device}; hf_flash supports CUDA GPUs")


def check_dims(ndim: int, layout: str, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def check_heads(q_heads: int, k_heads: int, v_heads: int, q_dim: int, k_dim: int, v_dim: int):
    if k_heads != v_heads:
        raise ValueError(f"k has {k_heads} heads but v has {v_heads}; they must match")
    if k_heads == 0 or q_heads % k_heads:
        raise ValueError(
            f"nheads={q_heads} (q) must be a positive multiple of nheads_k={k_heads} (k/v) "
            "for MHA/GQA/MQA"
        )
    if not (q_dim == k_dim == v_dim):
        raise ValueError(
            f"head dims differ: q={q_dim}, k={k_dim}, v={v_dim}; hf_flash needs one head dim"
        )
    if not 1 <= q_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={q_dim} is unsupported; hf_flash supports 1..{MAX_HEAD_DIM}")


def check_options(
    *, softmax_scale, window_size, softcap, alibi_slopes, nheads: int, batch: int,
    dropout_p: float = 0.0, learnable_sink=None, device=None,
) -> None:  # fmt: skip
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    if softmax_scale is not None and not math.isfinite(float(softmax_scale)):
        raise ValueError(f"softmax_scale={softmax_scale} must be a finite number or None")
    check_window(window_size)
    if float(softcap) < 0.0:
        raise ValueError(f"softcap={softcap} must be >= 0 (0 disables it)")
    if alibi_slopes is not None:
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
            raise ValueError(
                f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected ({nheads},) or "
                f"({batch}, {nheads})"
            )
    if learnable_sink is not None:
        if not isinstance(learnable_sink, Tensor) or not learnable_sink.is_floating_point():
            raise TypeError(
                "learnable_sink must be a floating-point tensor of one logit per query head, got "
                f"{getattr(learnable_sink, 'dtype', type(learnable_sink).__name__)}"
            )
        if tuple(learnable_sink.shape) != (nheads,):
            raise ValueError(
                f"learnable_sink has shape {tuple(learnable_sink.shape)}; expected ({nheads},), "
                "one logit per query head"
            )
        if device is not None and learnable_sink.device != device:
            raise ValueError(f"learnable_sink is on {learnable_sink.device} but q is on {device}")


def check_key_bounds(key_bounds, rows: Tuple[int, ...], device, causal: bool, window_size) -> None:
    """Per-row key ranges: an int32 tensor of shape ``rows + (2,)`` on ``device`` (``rows``:
    (batch, seqlen_q) dense, (total_q,) packed), with causal and window masks off (the ranges
    replace them). The values need no check: the kernels clamp each range to its sequence and
    read an empty one (lo >= hi) as a row that sees no key."""
    if not isinstance(key_bounds, Tensor):
        raise TypeError(f"key_bounds must be a torch.Tensor, got {type(key_bounds).__name__}")
    want = tuple(rows) + (2,)
    if key_bounds.dtype != torch.int32 or tuple(key_bounds.shape) != want:
        raise ValueError(
            f"key_bounds must be an int32 tensor of shape {want} (each query row's [lo, hi) key "
            f"range), got dtype={key_bounds.dtype}, shape={tuple(key_bounds.shape)}"
        )
    if key_bounds.device != device:
        raise ValueError(f"key_bounds is on {key_bounds.device} but q is on {device}")
    left, right = kernel_window(causal, window_size)
    if left >= 0 or right >= 0:
        raise ValueError(
            f"key_bounds replaces the causal and sliding-window masks (got causal={causal}, "
            f"window_size={tuple(int(w) for w in window_size)}); put them into the bounds and "
            "pass causal=False, window_size=(-1, -1)"
        )


def check_cu_seqlens(
    name: str, cu: Tensor, total: int, max_seqlen: int, device, check_values: bool = True
) -> None:
    """Shape, dtype and device; with ``check_values`` also the values (one device sync, skipped
    while tracing or capturing): 0 first, non-decreasing, ``total`` last, no sequence longer
    than ``max_seqlen``."""
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be a 1-D int32 tensor of length batch + 1 >= 2, got dtype={cu.dtype}, "
            f"shape={tuple(cu.shape)}"
        )
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    if not check_values or not host_reads_allowed():
        return
    vals = cu.tolist()
    lengths = [b - a for a, b in zip(vals[:-1], vals[1:])]
    if vals[0] != 0 or any(n < 0 for n in lengths):
        raise ValueError(f"{name} must start at 0 and be non-decreasing, got {vals[:8]}...")
    if vals[-1] != total:
        raise ValueError(
            f"{name}[-1]={vals[-1]} must equal the number of packed tokens ({total})"
        )
    if max(lengths) > max_seqlen:
        raise ValueError(
            f"a sequence in {name} has length {max(lengths)} > max_seqlen={max_seqlen}; "
            "nothing would be computed past max_seqlen"
        )


def check_index_tensor(name: str, t, batch: int, device) -> None:
    """A per-row int32 ``(batch,)`` tensor on ``device``."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32 or tuple(t.shape) != (batch,):
        raise ValueError(
            f"{name} must be an int32 tensor of shape ({batch},), got dtype={t.dtype}, "
            f"shape={tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def check_page_table(block_table, batch: int, device) -> None:
    """A page table ``(batch, max_pages >= 1)`` int32 on ``device``."""
    if not isinstance(block_table, Tensor) or block_table.dtype != torch.int32:
        raise TypeError("block_table must be an int32 tensor (batch, max_pages_per_sequence)")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ValueError(
            f"block_table has shape {tuple(block_table.shape)}; expected ({batch}, "
            "max_pages_per_sequence >= 1), one row per sequence"
        )
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {device}")


def check_paged_cache(block_table, batch: int, page_size: int, device) -> None:
    """A page table (:func:`check_page_table`) for pages of a size the decode kernel takes."""
    check_page_table(block_table, batch, device)
    if page_size % PAGE_MULTIPLE:
        raise ValueError(
            f"page size (k_cache.shape[1]) is {page_size}; paged caches need a multiple of "
            f"{PAGE_MULTIPLE}"
        )


def check_caches(k_cache: Tensor, v_cache: Tensor) -> None:
    """Equal shapes, and the strides :func:`check_cache_strides` asks for."""
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape"
        )
    check_cache_strides(k_cache, v_cache)


def check_cache_strides(k_cache: Tensor, v_cache: Tensor) -> None:
    """A unit last stride: the caches are written in place, and a contiguous copy would swallow
    the append. Checked while tracing too (strides are static)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on its last (headdim) dimension")


def check_new_tokens(q: Tensor, k, v, nheads_k: int, head_dim: int) -> int:
    """New keys/values to append (both or neither), shaped ``(batch, seqlen_new, nheads_k,
    head_dim)`` with q's dtype and device; returns seqlen_new (0 without them)."""
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (new tokens to append) or neither")
    if k is None:
        return 0
    batch = q.shape[0]
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(
                f"{name} must match q's dtype and device ({q.dtype}, {q.device}), got "
                f"({t.dtype}, {t.device})"
            )
        if t.dim() != 4 or t.shape[0] != batch or tuple(t.shape[2:]) != (nheads_k, head_dim):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; expected ({batch}, seqlen_new, "
                f"{nheads_k}, {head_dim})"
            )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k has {k.shape[1]} new tokens but v has {v.shape[1]}")
    return k.shape[1]
