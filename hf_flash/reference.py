"""Pure-PyTorch oracles. Tests and benchmarks import these and nothing else as ground truth.

Every oracle materialises what the kernels avoid (repeated K/V heads, the full score matrix),
which is what makes it easy to read and trust. Two precisions:

* ``upcast=True``: inputs are cast to float32 and the result stays float32. This is the truth.
* ``upcast=False``: the same maths in the inputs' own dtype. Its distance to the truth is the
  error budget a kernel is allowed (the error rule below: kernel error <= 2x this, 3x for
  gradients).

Layouts follow flash-attn: q ``(batch, seqlen_q, nheads, headdim)``, k/v ``(batch, seqlen_k,
nheads_k, headdim)``, packed (varlen) tensors ``(total_tokens, nheads, headdim)`` with int32
``cu_seqlens`` of length ``batch + 1``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = [
    "attention_ref",
    "attention_varlen_ref",
    "attention_mask_ref",
    "max_abs_err",
    "FWD_FACTOR",
    "GRAD_FACTOR",
    "floor_for",
    "allowed_error",
    "assert_close_to_ref",
    "assert_grads_close_to_ref",
    "poisoned_like",
    "rotary_ref",
    "kvcache_attention_ref",
]


def attention_mask_ref(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    device=None,
) -> torch.Tensor:
    """Boolean ``(seqlen_q, seqlen_k)`` mask, True where query i may attend key j.

    Queries are aligned to the bottom-right of the key range: query ``i`` sits at key position
    ``i + seqlen_k - seqlen_q``. With ``window_size=(left, right)`` (-1 = unbounded) key ``j`` is
    visible iff ``pos(i) - left <= j <= pos(i) + right``; ``causal`` forces ``right = 0``.

    For seqlen_q=2, seqlen_k=5, causal::

        1 1 1 1 0
        1 1 1 1 1
    """
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device).view(-1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    pos = i + (seqlen_k - seqlen_q)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= pos + right
    if left >= 0:
        visible &= j >= pos - left
    return visible


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    dropout_keep: Optional[torch.Tensor] = None,
    upcast: bool = True,
    return_lse: bool = False,
    sinks: Optional[torch.Tensor] = None,
    key_bounds: Optional[torch.Tensor] = None,
):
    """Exact attention, flash-attn semantics.

    q: (batch, seqlen_q, nheads, headdim). k, v: (batch, seqlen_k, nheads_k, headdim), nheads a
    multiple of nheads_k (GQA: query head h reads K/V head ``h // (nheads // nheads_k)``).
    softcap > 0: scores become ``softcap * tanh(scores / softcap)`` after scaling, before ALiBi.
    alibi_slopes: (nheads,) or (batch, nheads); adds ``-slope * |pos(i) - j|``.
    dropout_keep: bool (batch, nheads, seqlen_q, seqlen_k), True = kept; kept probabilities are
    divided by ``1 - dropout_p``. The log-sum-exp is that of the undropped softmax.
    sinks: (nheads,) learnable sink logits (gpt-oss): one more column of every row's softmax,
    holding the sink's logit and no value; the log-sum-exp includes it.
    key_bounds: int (batch, seqlen_q, 2): query row i of batch b sees keys
    ``key_bounds[b, i, 0] <= j < key_bounds[b, i, 1]``, intersected with the causal/window mask
    (the kernels take one or the other).

    Returns out (batch, seqlen_q, nheads, headdim) (float32 if ``upcast``, else q.dtype) and,
    with ``return_lse``, the natural-log LSE (batch, nheads, seqlen_q) in float32, ``+inf`` for
    rows that see no key (their output is 0).
    """
    dtype = torch.float32 if upcast else q.dtype
    probs, lse = attention_probs(
        q, k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, upcast=upcast, sinks=sinks,
        key_bounds=key_bounds,
    )  # fmt: skip
    if dropout_p > 0.0:
        if dropout_keep is None:
            raise ValueError("dropout_p > 0 needs the keep mask the kernel used (dropout_keep)")
        probs = probs.masked_fill(~dropout_keep, 0.0) / (1.0 - dropout_p)
    group = q.shape[2] // k.shape[2]
    out = torch.einsum("bhij,bjhd->bihd", probs, v.to(dtype).repeat_interleave(group, dim=2))
    return (out, lse) if return_lse else out


def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    upcast: bool = True,
    sinks: Optional[torch.Tensor] = None,
    key_bounds: Optional[torch.Tensor] = None,
):
    """The softmax probabilities (batch, nheads, seqlen_q, seqlen_k) of :func:`attention_ref`
    (before dropout; rows that see no key are 0) and its log-sum-exp (batch, nheads, seqlen_q)."""
    dtype = torch.float32 if upcast else q.dtype
    q, k = q.to(dtype), k.to(dtype)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if nheads % nheads_k:
        raise ValueError(f"nheads={nheads} is not a multiple of nheads_k={nheads_k}")
    group = nheads // nheads_k
    k = k.repeat_interleave(group, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(headdim)

    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype)
        slopes = slopes.view(1, nheads) if slopes.dim() == 1 else slopes
        i = torch.arange(seqlen_q, device=q.device).view(-1, 1) + (seqlen_k - seqlen_q)
        j = torch.arange(seqlen_k, device=q.device).view(1, -1)
        dist = (i - j).abs().to(dtype)
        scores = scores - slopes.view(-1, nheads, 1, 1) * dist
    visible = attention_mask_ref(
        seqlen_q, seqlen_k, causal=causal, window_size=window_size, device=q.device
    ).expand(batch, seqlen_q, seqlen_k)
    if key_bounds is not None:
        j = torch.arange(seqlen_k, device=q.device).view(1, 1, -1)
        bounds = key_bounds.to(q.device, torch.int64)
        visible = visible & (j >= bounds[..., :1]) & (j < bounds[..., 1:])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sinks is not None:
        column = sinks.to(dtype).view(1, nheads, 1, 1).expand(batch, nheads, seqlen_q, 1)
        scores = torch.cat([scores, column], dim=-1)
    lse = torch.logsumexp(scores.float(), dim=-1)  # (b, h, i)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]  # the sink's share goes nowhere
    else:
        empty = ~visible.any(dim=-1)  # (b, i)
        probs = probs.masked_fill(empty[:, None, :, None], 0.0)
        lse = lse.masked_fill(empty[:, None], float("inf"))
    return probs, lse


def attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_keep: Optional[Sequence[torch.Tensor]] = None,
    return_lse: bool = False,
    key_bounds: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Packed sequences: q (total_q, nheads, d), k/v (total_k, nheads_k, d).

    Sequence ``b`` owns rows ``cu_seqlens[b]:cu_seqlens[b+1]`` and attends only within itself,
    with its own bottom-right alignment. ``dropout_keep`` is a list of per-sequence masks
    (1, nheads, seqlen_q_b, seqlen_k_b); ``key_bounds`` (total_q, 2) holds each row's key
    range in its own sequence's key indices. LSE is returned as (nheads, total_q), as flash-attn.
    Other keyword arguments are those of :func:`attention_ref`.
    """
    upcast = kwargs.get("upcast", True)
    out_dtype = torch.float32 if upcast else q.dtype
    out = torch.zeros(q.shape, dtype=out_dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qe == qs:
            continue
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
        keep = dropout_keep[b] if dropout_keep is not None else None
        o, l = attention_ref(
            q[qs:qe].unsqueeze(0),
            k[ks:ke].unsqueeze(0),
            v[ks:ke].unsqueeze(0),
            alibi_slopes=slopes,
            dropout_keep=keep,
            return_lse=True,
            key_bounds=None if key_bounds is None else key_bounds[qs:qe].unsqueeze(0),
            **kwargs,
        )
        out[qs:qe] = o[0]
        lse[:, qs:qe] = l[0]
    return (out, lse) if return_lse else out


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise |a - b| in float32, NaN-aware (any NaN gives inf)."""
    d = (a.float() - b.float()).abs()
    if torch.isnan(d).any():
        return float("inf")
    return d.max().item() if d.numel() else 0.0


# --------------------------------------------------------------------------------------------
# The error rule shared by tests, the demo and benchmarks
# --------------------------------------------------------------------------------------------
#
# A kernel result is compared against the float32 oracle. Its max error must be at most
# ``factor`` times the max error of the same oracle computed in the input dtype (2x for outputs,
# 3x for gradients), plus a small absolute floor for float32, where the low-precision oracle *is*
# the float32 oracle and its own error is zero.

FWD_FACTOR = 2.0
GRAD_FACTOR = 3.0


def floor_for(dtype: torch.dtype) -> float:
    """Absolute error always allowed in ``dtype`` for an element of magnitude <= 1, on top of
    ``factor`` x the oracle's own (:func:`assert_close_to_ref` scales it by larger magnitudes)."""
    # float32: summation-order differences only (~1e-6 on unit-scale data); half types: the
    # rounding of one output element (one ulp in [1, 2)), so all-zero reference errors do not
    # demand exactness.
    return {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]


def allowed_error(ref_lowp_err: float, factor: float, dtype: torch.dtype) -> float:
    """The largest max error the rule accepts on unit-scale data: ``factor * ref_lowp_err +
    floor_for(dtype)``."""
    return factor * ref_lowp_err + floor_for(dtype)


def assert_close_to_ref(name: str, got, ref_exact, ref_lowp, factor: float, dtype) -> None:
    """got / ref_lowp versus ref_exact, element by element: |got - ref| <= factor *
    err(ref_lowp) + floor * max(1, |ref|), err the max error over the tensor.

    The floor is one rounding of the element in ``dtype``, which grows with its magnitude: a
    reduction such as the sink logits' gradient (a sum over rows, |value| ~ 5) lands one bf16 ulp
    (0.031 in [4, 8)) from the rounded exact value whenever the exact sum is near a rounding
    boundary, even when the low-precision oracle happens to round the same way (its error 0).
    Raises AssertionError naming ``name`` with the max and mean errors and the budget."""
    budget = max_abs_err(ref_lowp, ref_exact)
    diff = (got.float() - ref_exact.float()).abs()
    floor = floor_for(dtype) * ref_exact.float().abs().clamp(min=1.0)
    if not bool((diff <= factor * budget + floor).all()):  # a NaN compares False: it fails
        err = max_abs_err(got, ref_exact)
        mean = diff.mean().item()
        raise AssertionError(
            f"{name}: max err {err:.3e} (mean {mean:.3e}) exceeds {factor}x the {dtype} reference's "
            f"own error {budget:.3e} + floor {floor_for(dtype):.1e} x max(1, |ref|)"
        )


def assert_grads_close_to_ref(out, ref_exact, ref_lowp, inputs, dout, dtype, names=("dq", "dk", "dv")) -> None:
    """The gradients of ``out`` with respect to ``inputs`` (for the incoming gradient ``dout``)
    against those of the exact oracle ``ref_exact`` (``dout`` in float32) with the error rule
    (:data:`GRAD_FACTOR` x the low-precision oracle ``ref_lowp``'s own error). Consumes the
    three graphs."""
    got = torch.autograd.grad(out, inputs, dout)
    exact = torch.autograd.grad(ref_exact, inputs, dout.float())
    lowp = torch.autograd.grad(ref_lowp, inputs, dout)
    for name, g, e, lp in zip(names, got, exact, lowp):
        assert_close_to_ref(name, g, e, lp, GRAD_FACTOR, dtype)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """torch.empty_like filled with NaN, so unwritten elements fail comparisons."""
    return torch.full_like(t, float("nan"))


# --------------------------------------------------------------------------------------------
# Rotary embeddings
# --------------------------------------------------------------------------------------------


def rotary_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of x, flash-attn conventions.

    x: (batch, seqlen, nheads, headdim). cos, sin: (seqlen, rotary_dim / 2) or
    (batch, seqlen, rotary_dim / 2), one angle per pair. Non-interleaved ("rotate half", Llama)
    pairs feature i with i + rotary_dim/2; interleaved (GPT-J) pairs 2i with 2i + 1. Features past
    rotary_dim pass through. Computed in float32, returned in x's dtype.
    """
    rd = 2 * cos.shape[-1]
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    cos = cos.float().unsqueeze(2)  # (b, s, 1, rd/2)
    sin = sin.float().unsqueeze(2)
    xf = x.float()
    xr, rest = xf[..., :rd], xf[..., rd:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
        rot = torch.stack((o1, o2), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
        rot = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((rot, rest), dim=-1).to(x.dtype)


# --------------------------------------------------------------------------------------------
# KV-cache attention (flash_attn_with_kvcache)
# --------------------------------------------------------------------------------------------


def kvcache_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    *,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens=None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    rotary_interleaved: bool = True,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    alibi_slopes: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    **kwargs,
):
    """``flash_attn_with_kvcache`` without side effects: returns ``(out, k_cache', v_cache')``
    (plus the LSE with ``return_lse``), the caches as they must be after the in-place append.

    Row ``b`` reads cache row ``cache_batch_idx[b]`` (or the pages ``block_table[b]`` of a paged
    cache ``(num_pages, page_size, nheads_k, d)``). New keys/values are written at rows
    ``cache_seqlens[b] + t``, keys rotated by the angle of that row. Attention runs over rows
    ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)`` with :func:`attention_ref` (its
    bottom-right causal alignment and windows count keys from the left pad); q is rotated at
    rows ``cache_seqlens[b] + i`` when causal or windowed, else all at ``cache_seqlens[b]``.
    3-D rotary tables ``(batch or 1, seqlen_new, rotary_dim / 2)`` hold per-token angles: new
    token t and query t use row t (row 0 for every query when neither causal nor windowed).
    Other keyword arguments (softmax_scale, softcap, upcast) go to :func:`attention_ref`.
    """
    batch, seqlen_q = q.shape[0], q.shape[1]
    seqlen_new = k.shape[1] if k is not None else 0
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    if cache_seqlens is None:
        full = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
        cache_seqlens = [full] * batch
    elif isinstance(cache_seqlens, int):
        cache_seqlens = [cache_seqlens] * batch
    else:
        cache_seqlens = cache_seqlens.tolist()
    leftpad = cache_leftpad.tolist() if cache_leftpad is not None else [0] * batch
    local = tuple(int(w) for w in window_size) != (-1, -1)
    outs, lses = [], []
    for b in range(batch):
        if block_table is not None:
            pages = block_table[b].long()
            kc = k_cache[pages].flatten(0, 1)  # (pages * page_size, nheads_k, d), a copy
            vc = v_cache[pages].flatten(0, 1)
        else:
            row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
            kc, vc = k_cache[row], v_cache[row]  # views: writes land in the cache copies
        cs, lp = int(cache_seqlens[b]), int(leftpad[b])
        qb = q[b : b + 1]
        cos, sin, first = rotary_cos, rotary_sin, cs
        if rotary_cos is not None and rotary_cos.dim() == 3:
            # per-token tables: row t holds the angles of new token t
            row = b if rotary_cos.shape[0] > 1 else 0
            cos, sin, first = rotary_cos[row], rotary_sin[row], 0
        if seqlen_new:
            kb = k[b : b + 1]
            if rotary_cos is not None:
                pos = torch.arange(first, first + seqlen_new, device=q.device)
                kb = rotary_ref(kb, cos[pos], sin[pos], interleaved=rotary_interleaved)
            kc[cs : cs + seqlen_new] = kb[0]
            vc[cs : cs + seqlen_new] = v[b]
        if rotary_cos is not None and seqlen_new:
            if causal or local:
                pos = torch.arange(first, first + seqlen_q, device=q.device)
            else:
                pos = torch.full((seqlen_q,), first, device=q.device, dtype=torch.long)
            qb = rotary_ref(qb, cos[pos], sin[pos], interleaved=rotary_interleaved)
        if block_table is not None:
            page_size = k_cache.shape[1]
            k_cache[pages] = kc.view(-1, page_size, *kc.shape[1:])
            v_cache[pages] = vc.view(-1, page_size, *vc.shape[1:])
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
        o, lse = attention_ref(
            qb, kc[None, lp : cs + seqlen_new], vc[None, lp : cs + seqlen_new],
            causal=causal, window_size=window_size, alibi_slopes=slopes, return_lse=True,
            **kwargs,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs)
    if return_lse:
        return out, k_cache, v_cache, torch.cat(lses)
    return out, k_cache, v_cache
