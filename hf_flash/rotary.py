"""Rotary position embeddings on hf_flash's fused Triton kernel.

Two public entry points, both differentiable (the backward pass is the same kernel with the
rotation conjugated) and traceable by ``torch.compile`` (``torch.library`` custom ops with fake
implementations; in plain eager mode the kernel is launched without the op's dispatch, see
:func:`hf_flash._runtime.direct_call`):

* :func:`apply_rotary_emb`: flash-attn 2.x ``flash_attn.layers.rotary.apply_rotary_emb``
  semantics. A ``(seqlen_ro, rotary_dim / 2)`` cos/sin table, rows picked by position.
* :func:`apply_rotary_pos_emb`: a drop-in for transformers' Llama/Mistral
  ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``. cos/sin are what the model's rotary
  module returned (already gathered per token and already multiplied by its
  ``attention_scaling``, e.g. YaRN's mscale), so any scaling method and any ``position_ids``
  (packed sequences restarting at 0 included) work unchanged. q and k are rotated in one launch.

Rotate-half pairing (Llama, Mistral, Qwen; default) versus interleaved pairing (GPT-J)::

    rotate half, rotary_dim = 8:  (x0, x4) (x1, x5) (x2, x6) (x3, x7)
    interleaved, rotary_dim = 8:  (x0, x1) (x2, x3) (x4, x5) (x6, x7)

Pair ``(x1, x2)`` at angle ``theta`` becomes ``(x1 cos - x2 sin, x2 cos + x1 sin)``. Features
past ``rotary_dim`` (partial rotary) pass through unchanged. Arithmetic is float32.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from ._checks import DTYPES, check_kernel_device, unit_last_stride
from ._runtime import direct_call, eager_call, host_reads_allowed
from .kernels import rotary as _kernel

__all__ = ["apply_rotary_emb", "apply_rotary_pos_emb", "rotary_table"]

_INT_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------
# Custom ops. Tensors reach them in the kernel layout (batch, seqlen, nheads, headdim). The
# scalar options are keyword-only, named once in _OPTIONS (both schemas), and passed on as
# **options down to the kernel launcher, whose keyword parameters have the same names.
# --------------------------------------------------------------------------------------------

_OPTIONS = "int rotary_dim, int cos_half_offset, int offset, bool interleaved, bool conjugate"
_TABLES = "Tensor cos, Tensor sin, Tensor? position_ids, Tensor? seqlen_offsets"


def _rotated(xs: List[Tensor], cos, sin, position_ids, seqlen_offsets, **options) -> List[Tensor]:
    """Rotated copies of ``xs`` (the body of ``hf_flash::rotary``)."""
    outs = [torch.empty_like(x) for x in xs]
    _kernel.rotary_forward(xs, outs, cos, sin, position_ids=position_ids,
                           seqlen_offsets=seqlen_offsets, **options)  # fmt: skip
    return outs


def _rotate_in_place(xs: List[Tensor], cos, sin, position_ids, seqlen_offsets, **options) -> None:
    _kernel.rotary_forward(xs, xs, cos, sin, position_ids=position_ids,
                           seqlen_offsets=seqlen_offsets, **options)  # fmt: skip


_rotary_op = torch.library.custom_op(
    "hf_flash::rotary", _rotated, mutates_args=(),
    schema=f"(Tensor[] xs, {_TABLES}, *, {_OPTIONS}) -> Tensor[]",
)  # fmt: skip
_rotary_inplace_op = torch.library.custom_op(
    "hf_flash::rotary_", _rotate_in_place, mutates_args=("xs",),
    schema=f"(Tensor(a!)[] xs, {_TABLES}, *, {_OPTIONS}) -> ()",
)  # fmt: skip


@_rotary_op.register_fake
def _(xs, *tables, **options):
    return [torch.empty_like(x) for x in xs]


@_rotary_inplace_op.register_fake
def _(xs, *tables, **options):
    return None


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    xs, cos, sin, position_ids, seqlen_offsets = inputs
    ctx.save_for_backward(cos, sin, position_ids, seqlen_offsets)
    ctx.options = dict(keyword_only_inputs)
    ctx.n = len(xs)


def _backward(ctx, grads):
    # The Jacobian of a per-pair rotation is the rotation itself, so d/dx = R^T g: the same
    # kernel with the rotation conjugated (transposed, for cos/sin halves that differ).
    tables = ctx.saved_tensors
    options = dict(ctx.options, conjugate=not ctx.options["conjugate"])
    live = [i for i, g in enumerate(grads) if g is not None]
    dxs = [None] * ctx.n
    if live:
        gs = [unit_last_stride(grads[i]) for i in live]
        if eager_call(*gs):
            # eager backward: launch directly, skipping a second trip through the dispatcher
            outs = _rotated(gs, *tables, **options)
        else:  # traced (AOTAutograd): the custom op keeps the graph opaque to the tracer
            outs = _rotary_op(gs, *tables, **options)
        for i, d in zip(live, outs):
            dxs[i] = d
    return dxs, None, None, None, None


_rotary_op.register_autograd(_backward, setup_context=_setup_context)


class _RotaryEager(torch.autograd.Function):
    """``hf_flash::rotary``'s forward and backward for plain eager autograd
    (:func:`hf_flash._runtime.direct_call`): the same launches without the op's dispatch."""

    @staticmethod
    def forward(ctx, n, *flat):
        ctx.set_materialize_grads(False)
        xs, tables, options = list(flat[:n]), flat[n:-1], flat[-1]
        outs = _rotated(xs, *tables, **options)
        _setup_context(ctx, (xs, *tables), options, outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        dxs = _backward(ctx, list(grads))[0]
        return (None, *dxs, None, None, None, None, None)


def _rotary(xs: List[Tensor], cos, sin, position_ids, seqlen_offsets, **options) -> List[Tensor]:
    """Out-of-place rotation (``hf_flash::rotary``'s arguments): the custom op for tracers and
    dispatch modes, the kernel directly in plain eager mode."""
    tables = (cos, sin, position_ids, seqlen_offsets)
    if not direct_call(*xs):
        return _rotary_op(xs, *tables, **options)
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        return list(_RotaryEager.apply(len(xs), *xs, *tables, options))
    return _rotated(xs, *tables, **options)


class _RotaryInplace(torch.autograd.Function):
    """In-place rotation that autograd can differentiate (the input is marked dirty)."""

    @staticmethod
    def forward(ctx, x, cos, sin, position_ids, seqlen_offsets, varlen, options):
        xk = x.unsqueeze(0) if varlen else x
        _rotary_inplace_op([xk], cos, sin, position_ids, seqlen_offsets, **options)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin, position_ids, seqlen_offsets)
        ctx.varlen, ctx.options = varlen, options
        return x

    @staticmethod
    def backward(ctx, g):
        g = unit_last_stride(g)
        gk = g.unsqueeze(0) if ctx.varlen else g
        options = dict(ctx.options, conjugate=True)
        (dx,) = _rotary([gk], *ctx.saved_tensors, **options)
        return (dx[0] if ctx.varlen else dx), None, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_float(name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name}.dtype is {t.dtype}; supported: float16, bfloat16, float32")


def _check_device(x: Tensor, *others: Tuple[str, Optional[Tensor]]) -> None:
    check_kernel_device(x.device, "hf_flash rotary kernels")
    for name, t in others:
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but the rotated tensor is on {x.device}")


def _check_no_grad_tables(cos: Tensor, sin: Tensor) -> None:
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            "cos/sin require grad, but hf_flash's rotary kernels give gradients only for the "
            "rotated tensors; compute cos/sin under torch.no_grad() (as transformers does) or "
            "detach them"
        )


def _check_int(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name}.dtype is {t.dtype}; expected int32 or int64")


# --------------------------------------------------------------------------------------------
# flash-attn style API
# --------------------------------------------------------------------------------------------


def apply_rotary_emb(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: Union[int, Tensor] = 0,
    cu_seqlens: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
    *,
    position_ids: Optional[Tensor] = None,
) -> Tensor:
    """Rotary embedding, flash-attn 2.x ``apply_rotary_emb`` semantics.

    Arguments:
        x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens.
            float16, bfloat16 or float32; unit stride on headdim.
        cos, sin: (seqlen_ro, rotary_dim / 2), one angle per feature pair; rotary_dim <= headdim.
            Any float dtype (float32 tables give the most accurate angles at long positions).
            Row ``p`` is used for the token at position ``p``; they get no gradient.
        interleaved: bool. Pair features (2i, 2i+1) (GPT-J) instead of (i, i + rotary_dim/2)
            (GPT-NeoX/Llama "rotate half"). Default False.
        inplace: bool. Rotate x in place and return it. Autograd still works (x is marked as
            modified), unless x is a leaf or a view of a leaf that requires grad. Default False.
        seqlen_offsets: int or (batch,) int32/int64 tensor. Token ``s`` of sequence ``b`` sits at
            position ``s + seqlen_offsets[b]`` (KV-cache decode). Default 0.
        cu_seqlens: (batch + 1,) int32 or None. Packed sequences: token ``t`` of sequence ``b``
            (rows ``cu_seqlens[b]:cu_seqlens[b+1]``) sits at position ``t - cu_seqlens[b]``
            (+ seqlen_offsets).
        max_seqlen: int. Longest sequence in a packed batch; required with cu_seqlens.
        position_ids: keyword only, hf_flash extension. (batch, seqlen), or (total_seqlen,)
            with cu_seqlens: the cos/sin row of each token, given explicitly (e.g. packed rows
            whose positions restart at 0). Replaces seqlen_offsets/cu_seqlens positions.

    Return:
        (batch, seqlen, nheads, headdim) or (total_seqlen, nheads, headdim), x's dtype.

    Positions must lie in ``[0, seqlen_ro)``; this is checked on the host (one device sync when
    the positions are a tensor), except while torch.compile traces or a CUDA graph is captured,
    where out-of-range tokens get cos = sin = 0.
    """
    varlen = cu_seqlens is not None
    if not torch.compiler.is_compiling():
        _check_float("x", x)
        for name, t in (("cos", cos), ("sin", sin)):
            _check_float(name, t)
        if x.dim() != (3 if varlen else 4):
            want = "(total_seqlen, nheads, headdim) with cu_seqlens" if varlen else (
                "(batch, seqlen, nheads, headdim)"
            )
            raise ValueError(f"x must be {want}, got shape {tuple(x.shape)}")
        if cos.dim() != 2 or cos.shape != sin.shape:
            raise ValueError(
                f"cos and sin must both be (seqlen_ro, rotary_dim / 2), got cos "
                f"{tuple(cos.shape)} and sin {tuple(sin.shape)}"
            )
        if cos.dtype != sin.dtype:
            raise TypeError(f"cos and sin dtypes differ: {cos.dtype} vs {sin.dtype}")
        headdim = x.shape[-1]
        if not 1 <= 2 * cos.shape[1] <= headdim:
            raise ValueError(
                f"rotary_dim = 2 * cos.shape[1] = {2 * cos.shape[1]} must be in [2, headdim="
                f"{headdim}]"
            )
        if x.stride(-1) != 1 and inplace:
            raise ValueError("inplace=True needs x with unit stride on headdim")
        _check_no_grad_tables(cos, sin)
        offs_t = seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None
        _check_device(
            x, ("cos", cos), ("sin", sin), ("cu_seqlens", cu_seqlens),
            ("position_ids", position_ids), ("seqlen_offsets", offs_t),
        )  # fmt: skip
        _check_positions(x, cos, seqlen_offsets, cu_seqlens, max_seqlen, position_ids)
    cos, sin = cos.contiguous(), sin.contiguous()
    rotary_dim = 2 * cos.shape[1]
    pos, offs, offset = _positions(x, seqlen_offsets, cu_seqlens, position_ids)
    cos3, sin3 = cos.unsqueeze(0), sin.unsqueeze(0)
    options = dict(rotary_dim=rotary_dim, cos_half_offset=0, offset=offset,
                   interleaved=bool(interleaved), conjugate=False)  # fmt: skip
    if inplace:
        return _RotaryInplace.apply(x, cos3, sin3, pos, offs, varlen, options)
    xk = unit_last_stride(x)
    xk = xk.unsqueeze(0) if varlen else xk
    (out,) = _rotary([xk], cos3, sin3, pos, offs, **options)
    return out[0] if varlen else out


def _check_positions(x, cos, seqlen_offsets, cu_seqlens, max_seqlen, position_ids) -> None:
    seqlen_ro = cos.shape[0]
    varlen = cu_seqlens is not None
    if varlen:
        _check_int("cu_seqlens", cu_seqlens)
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                f"cu_seqlens must be 1-D of length batch + 1 >= 2, got {tuple(cu_seqlens.shape)}"
            )
        if max_seqlen is None and position_ids is None:
            raise ValueError("max_seqlen is required with cu_seqlens")
    if position_ids is not None:
        _check_int("position_ids", position_ids)
        want = (x.shape[0],) if varlen else tuple(x.shape[:2])
        if tuple(position_ids.shape) != want:
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)}; expected {want} (one "
                "position per token)"
            )
        if not (isinstance(seqlen_offsets, int) and seqlen_offsets == 0):
            raise ValueError(
                "pass either position_ids or seqlen_offsets, not both (position_ids already "
                "give every token's absolute position)"
            )
        if host_reads_allowed() and position_ids.numel():
            lo, hi = int(position_ids.min()), int(position_ids.max())
            if lo < 0 or hi >= seqlen_ro:
                raise ValueError(
                    f"position_ids span [{lo}, {hi}] but the cos/sin table has {seqlen_ro} rows"
                )
        return
    seqlen = int(max_seqlen) if varlen else x.shape[1]
    if isinstance(seqlen_offsets, Tensor):
        _check_int("seqlen_offsets", seqlen_offsets)
        batch = cu_seqlens.numel() - 1 if varlen else x.shape[0]
        if tuple(seqlen_offsets.shape) != (batch,):
            raise ValueError(
                f"seqlen_offsets has shape {tuple(seqlen_offsets.shape)}; expected ({batch},)"
            )
        if host_reads_allowed() and batch:
            lo, hi = int(seqlen_offsets.min()), int(seqlen_offsets.max())
            if lo < 0 or hi + seqlen > seqlen_ro:
                raise ValueError(
                    f"seqlen_offsets span [{lo}, {hi}]: with seqlen {seqlen} positions reach "
                    f"{hi + seqlen - 1} but the cos/sin table has {seqlen_ro} rows"
                )
    else:
        if not isinstance(seqlen_offsets, int):
            raise TypeError(
                f"seqlen_offsets must be an int or an int tensor, got {type(seqlen_offsets).__name__}"
            )
        if seqlen_offsets < 0 or seqlen_offsets + seqlen > seqlen_ro:
            raise ValueError(
                f"seqlen_offsets={seqlen_offsets} with seqlen {seqlen} needs {seqlen_offsets + seqlen} "
                f"cos/sin rows but the table has {seqlen_ro}"
            )


def _positions(x, seqlen_offsets, cu_seqlens, position_ids):
    """(position_ids (batch, seqlen) or None, per-batch offsets or None, scalar offset)."""
    if position_ids is not None:
        pos = position_ids.view(1, -1) if cu_seqlens is not None else position_ids
        return pos, None, 0
    if cu_seqlens is None:
        if isinstance(seqlen_offsets, Tensor):
            return None, seqlen_offsets, 0
        return None, None, int(seqlen_offsets)
    # Packed: position = token index - start of its sequence (+ that sequence's offset),
    # computed with tensor ops so no value leaves the device.
    total = x.shape[0]
    tok = torch.arange(total, device=x.device, dtype=torch.int64)
    cu = cu_seqlens.to(torch.int64)
    seq = torch.searchsorted(cu[1:], tok, right=True)
    pos = tok - cu[seq]
    if isinstance(seqlen_offsets, Tensor):
        pos = pos + seqlen_offsets.to(torch.int64)[seq]
    else:
        pos = pos + int(seqlen_offsets)
    return pos.view(1, -1), None, 0


# --------------------------------------------------------------------------------------------
# transformers drop-in
# --------------------------------------------------------------------------------------------


def apply_rotary_pos_emb(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> Tuple[Tensor, Tensor]:
    """Drop-in for transformers' Llama/Mistral ``apply_rotary_pos_emb``; one fused launch.

    Arguments (as transformers):
        q: (batch, nheads, seqlen, headdim) with unsqueeze_dim=1, or (batch, seqlen, nheads,
            headdim) with unsqueeze_dim=2. Any strides with unit stride on headdim (the usual
            transposed view of the projection output is read in place).
        k: like q, with nheads_k heads.
        cos, sin: (batch or 1, seqlen, rotary_dim), the rotary module's output for each token's
            position (its ``attention_scaling`` already folded in). As in transformers, feature
            ``i < rotary_dim / 2`` uses ``cos[..., i]`` and feature ``i + rotary_dim / 2`` uses
            ``cos[..., i + rotary_dim / 2]``. rotary_dim < headdim (partial rotary) leaves the
            remaining features unchanged (an extension: transformers' function needs
            rotary_dim == headdim).
        unsqueeze_dim: 1 or 2, the heads axis of q/k. Default 1.

    Return:
        (q_embed, k_embed) with q's and k's shapes, dtypes and memory layouts. Gradients flow to
        q and k (cos and sin get none; they are computed under no_grad in transformers).
    """
    ud = unsqueeze_dim
    if not torch.compiler.is_compiling():
        _check_float("q", q)
        _check_float("k", k)
        _check_float("cos", cos)
        _check_float("sin", sin)
        if isinstance(ud, bool) or not isinstance(ud, int) or ud not in (1, 2, -2, -3):
            raise ValueError(
                f"unsqueeze_dim={unsqueeze_dim!r} is unsupported; use 1 for q/k laid out "
                "(batch, heads, seq, dim) or 2 for (batch, seq, heads, dim)"
            )
        if q.dim() != 4 or k.dim() != 4:
            raise ValueError(
                f"q and k must be 4-D, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        if cos.dim() != 3 or cos.shape != sin.shape:
            raise ValueError(
                f"cos and sin must both be (batch, seqlen, rotary_dim), got cos "
                f"{tuple(cos.shape)} and sin {tuple(sin.shape)}"
            )
        _check_no_grad_tables(cos, sin)
        _check_device(q, ("k", k), ("cos", cos), ("sin", sin))
    ud = ud % 4
    qb = q.transpose(1, 2) if ud == 1 else q
    kb = k.transpose(1, 2) if ud == 1 else k
    if not torch.compiler.is_compiling():
        _check_hf_shapes(qb, kb, cos)
    qb, kb = unit_last_stride(qb), unit_last_stride(kb)
    rotary_dim = cos.shape[-1]
    cos, sin = cos.contiguous(), sin.contiguous()
    # launched directly in plain eager mode, grads or not
    qo, ko = _rotary(
        [qb, kb], cos, sin, None, None, rotary_dim=rotary_dim, cos_half_offset=rotary_dim // 2,
        offset=0, interleaved=False, conjugate=False,
    )  # fmt: skip
    if ud == 1:
        qo, ko = qo.transpose(1, 2), ko.transpose(1, 2)
    return qo, ko


def _check_hf_shapes(qb: Tensor, kb: Tensor, cos: Tensor) -> None:
    batch, seqlen, _, headdim = qb.shape
    if kb.shape[0] != batch or kb.shape[1] != seqlen or kb.shape[3] != headdim:
        raise ValueError(
            f"q (batch, seq, heads, dim) = {tuple(qb.shape)} and k = {tuple(kb.shape)} must share "
            "batch, seqlen and head dim"
        )
    if cos.shape[0] not in (1, batch) or cos.shape[1] != seqlen:
        raise ValueError(
            f"cos/sin of shape {tuple(cos.shape)} do not broadcast to q/k with batch {batch} "
            f"and seqlen {seqlen}; expected ({batch} or 1, {seqlen}, rotary_dim)"
        )
    rd = cos.shape[2]
    if rd % 2 or not 2 <= rd <= headdim:
        raise ValueError(
            f"rotary_dim = cos.shape[-1] = {rd} must be even and in [2, headdim={headdim}]"
        )


def rotary_table(
    inv_freq: Tensor, seqlen: int, *, attention_scaling: float = 1.0, device=None
) -> Tuple[Tensor, Tensor]:
    """float32 (seqlen, rotary_dim / 2) cos/sin tables for :func:`apply_rotary_emb`.

    ``inv_freq`` is what :mod:`hf_flash.rope_scaling` (or a transformers rotary module) gives;
    ``attention_scaling`` multiplies both tables, as transformers does for YaRN.
    """
    if not math.isfinite(attention_scaling):
        raise ValueError(f"attention_scaling={attention_scaling} must be finite")
    inv_freq = inv_freq.to(device=device or inv_freq.device, dtype=torch.float32)
    t = torch.arange(seqlen, device=inv_freq.device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
