"""flash-attn 2.x compatible attention API on hf_flash's Triton kernels.

Layering: this module validates inputs, registers the ``torch.library`` custom ops (with fake
implementations so ``torch.compile(fullgraph=True)`` traces forward and backward), wires autograd,
and exposes the public functions. All arithmetic happens in :mod:`hf_flash.kernels`.

Causal masking is aligned to the bottom-right corner of the score matrix whenever
``seqlen_q != seqlen_k``, exactly like flash-attn >= 2.1. For seqlen_q = 2, seqlen_k = 5::

    1 1 1 1 0
    1 1 1 1 1

and for seqlen_q = 5, seqlen_k = 2 (the first three queries see no key; their output is 0)::

    0 0
    0 0
    0 0
    1 0
    1 1

GQA/MQA: q has ``nheads`` heads and k/v ``nheads_k``; query head ``h`` reads K/V head
``h // (nheads // nheads_k)``. K/V are never repeated in memory.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .kernels import flash_bwd as _bwd
from .kernels import flash_fwd as _fwd

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def interpreter_active() -> bool:
    """True when Triton's CPU interpreter is on (``TRITON_INTERPRET=1`` at import time)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# --------------------------------------------------------------------------------------------
# Validation (public boundary only; skipped while torch.compile traces)
# --------------------------------------------------------------------------------------------


def host_reads_allowed() -> bool:
    """False while torch.compile traces or a CUDA graph is being captured: reading a device
    value then would break the graph (dynamo) or the capture. Checked in this order so the
    tracer never sees the capture query."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def eager_call(*tensors) -> bool:
    """True when a kernel may be launched directly instead of through its custom op: not
    tracing (torch.compile) and every tensor a plain one (no fake or functional wrapper). The
    custom ops exist for the tracers; in eager mode their dispatch only adds host time."""
    return not torch.compiler.is_compiling() and all(type(t) is Tensor for t in tensors)


def direct_call(*tensors) -> bool:
    """:func:`eager_call`, no TorchDispatchMode active and no torch.func transform (grad, vmap)
    running: selective activation checkpointing (:mod:`hf_flash.checkpointing`), FakeTensorMode
    and FunctionalTensorMode see ops at the dispatcher, and torch.func accepts only the op's
    registered autograd, so they must get the custom op. Otherwise autograd can run the same kernels
    through a plain ``torch.autograd.Function``: the custom op's Python dispatch and autograd
    wrapper cost ~0.3-0.5 ms of host time per call, which a LoRA step at 4K tokens (host-bound)
    pays for every layer's attention and rotary, forward, recompute and backward."""
    return (
        eager_call(*tensors)
        and torch._C._len_torch_dispatch_stack() == 0
        and not _functorch_active()
    )


def _functorch_active() -> bool:
    # torch.func transforms (grad, vmap, ...) wrap tensors below Python's view of their type and
    # accept only autograd.Functions with setup_context: they get the custom op
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def _check_tensor_basics(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
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
    if q.device.type == "cpu" and not interpreter_active():
        raise ValueError(
            "hf_flash kernels run on CUDA tensors; got CPU tensors. To run on the CPU (slowly, "
            "for tests), set TRITON_INTERPRET=1 before importing hf_flash."
        )
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {q.device}; hf_flash supports CUDA GPUs")


def _check_heads(q_heads: int, k_heads: int, v_heads: int, q_dim: int, k_dim: int, v_dim: int):
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


def _check_options(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, nheads, batch):
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    if softmax_scale is not None and not math.isfinite(float(softmax_scale)):
        raise ValueError(f"softmax_scale={softmax_scale} must be a finite number or None")
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or any(int(w) < -1 for w in window_size)
    ):
        raise ValueError(
            f"window_size={window_size!r} must be a pair (left, right) of ints >= -1 "
            "(-1 = unbounded)"
        )
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


def _check_cu_seqlens(
    name: str, cu: Tensor, total: int, max_seqlen: int, device, check_values: bool = True
) -> None:
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
        return  # reading values would sync; the shape checks above still ran
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


def _prepare(t: Tensor) -> Tensor:
    # The kernels need unit stride on the head dimension; any other layout is fine.
    return t if t.stride(-1) == 1 else t.contiguous()


def _new_rng_state(device) -> Tensor:
    # (seed, offset) for the kernels' Philox stream, drawn from torch's generator on the
    # tensors' device so torch.manual_seed reproduces dropout and no host sync is needed.
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------


_OPTION_NAMES = (
    "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
    "window_left", "window_right", "softcap", "alibi_slopes", "dropout_p", "rng_state",
)  # fmt: skip


def _kernel_options(*values) -> dict:
    """The kernels' keyword options from the ops' positional ones (order of _OPTION_NAMES)."""
    return dict(zip(_OPTION_NAMES, values))


def _attn_fwd_impl(q, k, v, *options):
    """The body of ``hf_flash::attn_fwd``; ``options`` in the op's order (_OPTION_NAMES)."""
    out = torch.empty_like(q)
    lse = _empty_lse(q, options[0])
    _fwd.flash_attn_forward(q, k, v, out, lse, **_kernel_options(*options))
    return out, lse


@torch.library.custom_op("hf_flash::attn_fwd", mutates_args=())
def _attn_fwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    dropout_p: float,
    rng_state: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    return _attn_fwd_impl(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
    )  # fmt: skip


def _empty_lse(q: Tensor, cu_seqlens_q: Optional[Tensor]) -> Tensor:
    if cu_seqlens_q is None:
        b, s, h, _ = q.shape
        return torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    t, h, _ = q.shape
    return torch.empty((h, t), dtype=torch.float32, device=q.device)


@_attn_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state):  # fmt: skip
    return torch.empty_like(q), _empty_lse(q, cu_seqlens_q)


def _attn_bwd_impl(dout, dlse, q, k, v, out, lse, *options):
    """The body of ``hf_flash::attn_bwd``; ``options`` as for :func:`_attn_fwd_impl`."""
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    _bwd.flash_attn_backward(
        _prepare(dout), dlse, q, k, v, out, lse, dq, dk, dv, **_kernel_options(*options)
    )
    return dq, dk, dv


@torch.library.custom_op("hf_flash::attn_bwd", mutates_args=())
def _attn_bwd_op(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    dropout_p: float,
    rng_state: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    return _attn_bwd_impl(
        dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
        rng_state,
    )  # fmt: skip


@_attn_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
      rng_state):  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_FWD_ARG_NAMES = (
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
    "softmax_scale", "causal", "window_left", "window_right", "softcap", "alibi_slopes",
    "dropout_p", "rng_state",
)  # fmt: skip


def _setup_context(ctx, inputs, output):
    args = dict(zip(_FWD_ARG_NAMES, inputs))
    out, lse = output
    ctx.save_for_backward(
        args["q"], args["k"], args["v"], out, lse,
        args["cu_seqlens_q"], args["cu_seqlens_k"], args["alibi_slopes"], args["rng_state"],
    )  # fmt: skip
    ctx.params = {
        name: args[name]
        for name in (
            "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_left",
            "window_right", "softcap", "dropout_p",
        )
    }  # fmt: skip


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, alibi, rng = ctx.saved_tensors
    p = ctx.params
    if dout is None:  # only the log-sum-exp was used (grads not materialised: _AttnEager)
        dout = torch.zeros_like(out)
    # Gradients through the returned log-sum-exp are honoured: d lse_i / d s_ij = P_ij, which
    # the kernel folds into its per-row term (delta_i = rowsum(dO * O) - dlse_i).
    dq, dk, dv = _attn_bwd(
        dout, dlse, q, k, v, out, lse, cu_q, cu_k,
        p["max_seqlen_q"], p["max_seqlen_k"], p["softmax_scale"], p["causal"],
        p["window_left"], p["window_right"], p["softcap"], alibi, p["dropout_p"], rng,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("hf_flash::attn_fwd", _backward, setup_context=_setup_context)


class _AttnEager(torch.autograd.Function):
    """The op's forward and backward for plain eager autograd (see :func:`direct_call`)."""

    @staticmethod
    def forward(ctx, *args):
        ctx.set_materialize_grads(False)  # an unused lse gets no zero-filled gradient
        output = _attn_fwd_impl(*args)
        _setup_context(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


def _attn_fwd(*args) -> Tuple[Tensor, Tensor]:
    """Attention forward (the arguments of ``hf_flash::attn_fwd``): the custom op for tracers
    and dispatch modes, the kernels directly (autograd through :class:`_AttnEager` when a
    gradient is needed) in plain eager mode. One kernel path either way."""
    q, k, v = args[0], args[1], args[2]
    if not direct_call(q, k, v, *(a for a in args[3:] if isinstance(a, Tensor))):
        return _attn_fwd_op(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _AttnEager.apply(*args)
    return _attn_fwd_impl(*args)


def _attn_bwd(*args) -> Tuple[Tensor, Tensor, Tensor]:
    """Attention backward (the arguments of ``hf_flash::attn_bwd``), dispatched like
    :func:`_attn_fwd`; it runs inside autograd's backward, never differentiated itself."""
    if direct_call(*(a for a in args if isinstance(a, Tensor))):
        return _attn_bwd_impl(*args)
    return _attn_bwd_op(*args)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _normalise_window(causal: bool, window_size: Sequence[int]) -> Tuple[int, int]:
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    return left, right


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Exact attention on padded-free batches, flash-attn 2.x compatible.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim). float16, bfloat16 or float32 (float32 is
            computed in true float32, no TF32).
        k: (batch, seqlen_k, nheads_k, headdim). nheads must be a multiple of nheads_k.
        v: (batch, seqlen_k, nheads_k, headdim).
        dropout_p: float. Dropout probability on the attention weights; pass 0.0 in eval.
            The mask comes from torch's generator on q's device (reproducible under
            ``torch.manual_seed``) and the backward pass applies the same mask. Default 0.0.
        softmax_scale: float. Scale of QK^T before softmax. Default 1 / sqrt(headdim).
        causal: bool. Causal mask aligned to the bottom-right corner (see module docstring).
        window_size: (left, right). Sliding window: query at key position p sees keys in
            [p - left, p + right]; -1 means unbounded on that side. Whole key tiles outside
            the window are skipped, so cost grows with seqlen * window. Default (-1, -1).
        softcap: float. If > 0, scores become ``softcap * tanh(scores / softcap)`` (Gemma 2).
        alibi_slopes: (nheads,) or (batch, nheads), float32. Adds ``-slope * |p - j|`` to the
            score of query position p and key j.
        deterministic: bool. Accepted for compatibility: hf_flash's backward never uses atomics
            and is always deterministic.
        return_attn_probs: bool. If True, also return the softmax log-sum-exp (see Return).

    Return:
        out: (batch, seqlen_q, nheads, headdim), q's dtype.
        softmax_lse [if return_attn_probs]: (batch, nheads, seqlen_q), float32, natural log;
            +inf for queries that see no key (their output is 0). Differentiable.
        None [if return_attn_probs]: hf_flash never materialises the attention probabilities;
            the third element flash-attn returns (a debugging aid) is always None.
    """
    if not torch.compiler.is_compiling():
        _check_tensor_basics(q, k, v)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(
                    f"{name} must be 4-D (batch, seqlen, nheads, headdim), got shape "
                    f"{tuple(t.shape)}; packed sequences go to flash_attn_varlen_func"
                )
        if not (q.shape[0] == k.shape[0] == v.shape[0]):
            raise ValueError(
                f"batch sizes differ: q={q.shape[0]}, k={k.shape[0]}, v={v.shape[0]}"
            )
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k has seqlen {k.shape[1]} but v has {v.shape[1]}")
        _check_heads(q.shape[2], k.shape[2], v.shape[2], q.shape[3], k.shape[3], v.shape[3])
        _check_options(
            dropout_p, softmax_scale, window_size, softcap, alibi_slopes, q.shape[2], q.shape[0]
        )
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left, right = _normalise_window(causal, window_size)
    rng = _new_rng_state(q.device) if dropout_p > 0.0 else None
    out, lse = _attn_fwd(
        _prepare(q), _prepare(k), _prepare(v), None, None, q.shape[1], k.shape[1],
        float(scale), bool(causal), left, right, float(softcap), alibi_slopes,
        float(dropout_p), rng,
    )  # fmt: skip
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[Tensor] = None,
):
    """Exact attention on packed sequences (no attention across sequence boundaries).

    Arguments:
        q: (total_q, nheads, headdim), the batch's queries concatenated.
        k: (total_k, nheads_k, headdim). v: (total_k, nheads_k, headdim).
        cu_seqlens_q: (batch + 1,), int32. Sequence b owns q rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``; starts at 0, ends at total_q.
        cu_seqlens_k: (batch + 1,), int32. Likewise for k/v.
        max_seqlen_q, max_seqlen_k: int. Upper bounds of the sequence lengths (they size the
            launch grid; a longer sequence is an error, never silently truncated).
        Other arguments: as :func:`flash_attn_func`; causal alignment is bottom-right per
        sequence, and alibi_slopes may be per sequence (batch, nheads).
        block_table: paged K/V is not supported by this function yet; must be None.

    Return:
        out: (total_q, nheads, headdim).
        softmax_lse [if return_attn_probs]: (nheads, total_q), float32.
        None [if return_attn_probs]: see :func:`flash_attn_func`.

    The cu_seqlens values are checked on the host (one device sync) unless a CUDA graph is
    being captured or torch.compile is tracing.
    """
    return varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
        block_table, check_cu_seqlens=True,
    )  # fmt: skip


def varlen_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    return_attn_probs=False, block_table=None, *, check_cu_seqlens: bool = True,
):  # fmt: skip
    """:func:`flash_attn_varlen_func` for callers that built ``cu_seqlens`` themselves on the
    device (hf_flash's transformers integration): ``check_cu_seqlens=False`` skips the host-side
    value check and its device sync; shapes, dtypes and devices are still checked."""
    if not torch.compiler.is_compiling():
        _check_tensor_basics(q, k, v)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3:
                raise ValueError(
                    f"{name} must be 3-D (total_tokens, nheads, headdim) for the varlen API, got "
                    f"shape {tuple(t.shape)}"
                )
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
        if block_table is not None:
            raise ValueError(
                "block_table (paged KV) is not supported by flash_attn_varlen_func; pass "
                "block_table=None"
            )
        _check_heads(q.shape[1], k.shape[1], v.shape[1], q.shape[2], k.shape[2], v.shape[2])
        for name, cu, total, max_len in (
            ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
            ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k),
        ):
            _check_cu_seqlens(name, cu, total, int(max_len), q.device, check_cu_seqlens)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k has "
                f"{cu_seqlens_k.numel()}; both must be batch + 1"
            )
        _check_options(
            dropout_p, softmax_scale, window_size, softcap, alibi_slopes, q.shape[1],
            cu_seqlens_q.numel() - 1,
        )  # fmt: skip
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left, right = _normalise_window(causal, window_size)
    rng = _new_rng_state(q.device) if dropout_p > 0.0 else None
    out, lse = _attn_fwd(
        _prepare(q), _prepare(k), _prepare(v), cu_seqlens_q, cu_seqlens_k,
        int(max_seqlen_q), int(max_seqlen_k), float(scale), bool(causal), left, right,
        float(softcap), alibi_slopes, float(dropout_p), rng,
    )  # fmt: skip
    return (out, lse, None) if return_attn_probs else out
