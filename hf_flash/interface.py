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

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _checks, _packing
from ._checks import kernel_window, unit_last_stride
from ._runtime import direct_call, host_reads_allowed
from .kernels import configs, launch
from .kernels import flash_bwd as _bwd
from .kernels import flash_fwd as _fwd

__all__ = [
    "flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func", "attention_paths", "attention_variants",
]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Custom ops. Tensors are positional (torch.library takes no keyword-only tensors); the scalar
# options are keyword-only and named once, in _OPTIONS, which both schemas share. The bodies,
# fakes, autograd and the eager path pass them on as **options, down to the kernel launchers,
# whose keyword parameters have the same names.
# --------------------------------------------------------------------------------------------

_OPTIONS = (
    "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, int window_left, "
    "int window_right, float softcap, float dropout_p"
)
# per-call tensors besides q/k/v: packed-sequence boundaries, ALiBi slopes, dropout seed,
# position_ids of dense rows that may hold packed sequences (found at run time, _packing),
# learnable sink logits (H,) float32, and per-row key ranges (int32 (..., 2))
_EXTRA_TENSORS = (
    "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? alibi_slopes, Tensor? rng_state, "
    "Tensor? position_ids, Tensor? sinks, Tensor? key_bounds"
)


def _new_rng_state(device) -> Tensor:
    """(seed, offset) for the kernels' Philox stream, drawn from torch's generator on the
    tensors' device so torch.manual_seed reproduces dropout and no host sync is needed."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def _empty_lse(q: Tensor, cu_seqlens_q: Optional[Tensor]) -> Tensor:
    if cu_seqlens_q is None:
        b, s, h, _ = q.shape
        return torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    t, h, _ = q.shape
    return torch.empty((h, t), dtype=torch.float32, device=q.device)


def _fwd_body(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, position_ids, sinks,
              key_bounds, **options):  # fmt: skip
    packed = _packing.packed_boundaries(position_ids, q.shape[0], q.shape[1])
    if packed is not None:
        return _packed_fwd(q, k, v, packed, alibi_slopes, rng_state, sinks, **options)
    out = torch.empty_like(q)
    lse = _empty_lse(q, cu_seqlens_q)
    _fwd.flash_attn_forward(
        q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        alibi_slopes=alibi_slopes, rng_state=rng_state, sinks=sinks, key_bounds=key_bounds,
        **options,
    )  # fmt: skip
    return out, lse


def _bwd_body(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
              rng_state, position_ids, sinks, key_bounds, **options):  # fmt: skip
    dq, dk, dv, dsinks = _bwd_grads(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                    rng_state, position_ids, sinks, key_bounds, **options)  # fmt: skip
    return dq, dk, dv, _empty_dsinks(q, None) if dsinks is None else dsinks


def _bwd_grads(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
               rng_state, position_ids, sinks, key_bounds, **options):  # fmt: skip
    """The backward's gradients (dq, dk, dv, dsinks); dsinks None without sinks (the op's body,
    whose outputs cannot be None, gives an empty tensor there)."""
    dsinks = None if sinks is None else _empty_dsinks(q, sinks)
    packed = _packing.packed_boundaries(position_ids, q.shape[0], q.shape[1])
    if packed is not None:
        dq, dk, dv = _packed_bwd(dout, dlse, q, k, v, out, lse, packed, alibi_slopes, rng_state,
                                 sinks, dsinks, **options)  # fmt: skip
        return dq, dk, dv, dsinks
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _bwd.flash_attn_backward(
        unit_last_stride(dout), dlse, q, k, v, out, lse, dq, dk, dv,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes,
        rng_state=rng_state, sinks=sinks, dsinks=dsinks,
        key_bounds=key_bounds, **options,
    )  # fmt: skip
    return dq, dk, dv, dsinks


def _empty_dsinks(q: Tensor, sinks: Optional[Tensor]) -> Tensor:
    """The sinks' gradient buffer; (0,) without sinks (an op output cannot be None)."""
    return torch.empty(0 if sinks is None else sinks.shape[0], dtype=torch.float32, device=q.device)


def _flat(t: Tensor) -> Tensor:
    """(B, S, ...) -> (B * S, ...), a view where the strides allow it."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _packed_options(q, packed, alibi_slopes, options):
    cu, max_len = packed
    if alibi_slopes is not None and alibi_slopes.dim() == 2:  # per row -> per sequence
        alibi_slopes = alibi_slopes[_packing.rows_of_documents(cu, q.shape[1])]
    varlen = dict(options, max_seqlen_q=max_len, max_seqlen_k=max_len)
    return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, alibi_slopes=alibi_slopes, **varlen)


def _packed_fwd(q, k, v, packed, alibi_slopes, rng_state, sinks, **options):
    """Dense (B, S, H, D) rows holding packed sequences: the varlen kernel over the flattened
    tokens; results in the dense op's layouts (out like q, lse (B, H, S))."""
    b, s, h, d = q.shape
    out = torch.empty_like(q)
    flat_lse = torch.empty((h, b * s), dtype=torch.float32, device=q.device)
    flat_out = _flat_buffer(out)
    _fwd.flash_attn_forward(
        _flat(q), _flat(k), _flat(v), flat_out, flat_lse, rng_state=rng_state, sinks=sinks,
        **_packed_options(q, packed, alibi_slopes, options),
    )  # fmt: skip
    _unflatten_into(out, flat_out)
    return out, flat_lse.view(h, b, s).transpose(0, 1).contiguous()


def _flat_buffer(t: Tensor) -> Tensor:
    """A (B * S, ...) buffer for ``t``'s values: a view of ``t`` when its layout allows it (the
    usual case), else a new tensor that :func:`_unflatten_into` copies back."""
    if t.is_contiguous():
        return t.view(t.shape[0] * t.shape[1], *t.shape[2:])
    return torch.empty((t.shape[0] * t.shape[1], *t.shape[2:]), dtype=t.dtype, device=t.device)


def _unflatten_into(t: Tensor, flat: Tensor) -> None:
    if flat.data_ptr() != t.data_ptr():
        t.copy_(flat.view(t.shape))


def _packed_bwd(dout, dlse, q, k, v, out, lse, packed, alibi_slopes, rng_state, sinks, dsinks,
                **options):  # fmt: skip
    """The backward of :func:`_packed_fwd`: the varlen kernels over the flattened tokens."""
    b, s, h, _ = q.shape
    to_varlen = lambda t: t.transpose(0, 1).reshape(h, b * s)  # noqa: E731  (B,H,S) -> (H, B*S)
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    flat = [_flat_buffer(g) for g in grads]
    _bwd.flash_attn_backward(
        unit_last_stride(_flat(dout)), None if dlse is None else to_varlen(dlse), _flat(q),
        _flat(k), _flat(v), _flat(out), to_varlen(lse), *flat, rng_state=rng_state, sinks=sinks,
        dsinks=dsinks, **_packed_options(q, packed, alibi_slopes, options),
    )  # fmt: skip
    for g, f in zip(grads, flat):
        _unflatten_into(g, f)
    return grads


_attn_fwd_op = torch.library.custom_op(
    "hf_flash::attn_fwd", _fwd_body, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_EXTRA_TENSORS}, *, {_OPTIONS}) -> (Tensor, Tensor)",
)  # fmt: skip
_attn_bwd_op = torch.library.custom_op(
    "hf_flash::attn_bwd", _bwd_body, mutates_args=(),
    schema=(
        "(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        f"{_EXTRA_TENSORS}, *, {_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
)  # fmt: skip


@_attn_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, *tensors, **options):
    return torch.empty_like(q), _empty_lse(q, cu_seqlens_q)


@_attn_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, *tensors, **options):
    sinks = tensors[-2]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _empty_dsinks(q, sinks)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, cu_q, cu_k, alibi, rng, position_ids, sinks, key_bounds = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi, rng, position_ids, sinks, key_bounds)
    ctx.options = dict(keyword_only_inputs)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *extra = ctx.saved_tensors
    if dout is None:  # only the log-sum-exp was used (grads not materialised: _AttnEager)
        dout = torch.zeros_like(out)
    # Gradients through the returned log-sum-exp are honoured: d lse_i / d s_ij = P_ij, which
    # the kernel folds into its per-row term (delta_i = rowsum(dO * O) - dlse_i).
    dq, dk, dv, dsinks = _attn_bwd(dout, dlse, q, k, v, out, lse, *extra, **ctx.options)
    sinks = extra[-2]
    return dq, dk, dv, None, None, None, None, None, None if sinks is None else dsinks, None


_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _AttnEager(torch.autograd.Function):
    """The op's forward and backward for plain eager autograd (see
    :func:`hf_flash._runtime.direct_call`)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, alibi, rng, position_ids, sinks, key_bounds, options):
        ctx.set_materialize_grads(False)  # an unused lse gets no zero-filled gradient
        tensors = (q, k, v, cu_q, cu_k, alibi, rng, position_ids, sinks, key_bounds)
        output = _fwd_body(*tensors, **options)
        _setup_context(ctx, tensors, options, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_backward(ctx, dout, dlse), None)


def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
    rng_state: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None, key_bounds: Optional[Tensor] = None, **options,
) -> Tuple[Tensor, Tensor]:  # fmt: skip
    """``(out, lse)`` of attention (``hf_flash::attn_fwd``'s arguments by name; ``options`` are
    the keyword-only scalars of :data:`_OPTIONS`). The one entry to the forward: the custom op
    for tracers and dispatch modes, in plain eager mode the kernels directly (through
    :class:`_AttnEager` when a gradient is needed). Inputs are validated by the caller.
    ``position_ids`` (dense q only): rows may hold packed sequences, found when the op runs
    (:mod:`hf_flash._packing`); the results keep the dense layouts. ``sinks``: (H,) float32
    learnable sink logits, differentiable. ``key_bounds``: int32 per-row key ranges
    (:func:`flash_attn_func`)."""
    tensors = (
        q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, position_ids, sinks, key_bounds,
    )  # fmt: skip
    if not direct_call(q, k, v, *(t for t in tensors[3:] if t is not None)):
        return _attn_fwd_op(*tensors, **options)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        return _AttnEager.apply(*tensors, options)
    return _fwd_body(*tensors, **options)


def _attn_bwd(*tensors, **options) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Attention backward (``hf_flash::attn_bwd``'s arguments), dispatched like the forward; it
    runs inside autograd's backward, never differentiated itself. dsinks is None without sinks
    on the direct path."""
    if direct_call(*(t for t in tensors if t is not None)):
        return _bwd_grads(*tensors, **options)
    return _attn_bwd_op(*tensors, **options)


def _call_options(q, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                  softcap) -> dict:  # fmt: skip
    """The ops' scalar options from a public call's arguments."""
    left, right = kernel_window(causal, window_size)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return dict(
        max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
        softmax_scale=float(scale), causal=bool(causal), window_left=left, window_right=right,
        softcap=float(softcap), dropout_p=float(dropout_p),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Call plans: repeated plain dense calls on the Gluon Hopper kernels. Everything the general path
# decides for such a call (the checks, the options, which kernels and variants run) follows from
# its signature, so the first call of a signature goes through the general path's checks and
# dispatch and keeps the result; later calls allocate, launch and wire autograd directly (about
# a third of the public forward + backward's host time, measured on an H200 host). The kernels'
# launchers are the same ones, called with the same arguments.
# --------------------------------------------------------------------------------------------


class _DensePlan:
    """What one signature of :func:`dense_attention` runs: the ops' ``options``, the kernels'
    ``window``, the Hopper forward and backward variants, the Gluon dQ kernel's variant beside a
    dK/dV-only backward variant (``dq``; None where the backward variant computes dQ itself) and
    the statistics rows the backward's preprocess writes; ``backward`` None where the Hopper
    backward leaves dQ to the Triton kernel: the general backward runs those."""

    __slots__ = ("options", "window", "forward", "backward", "dq", "stats_m")

    def __init__(self, options: dict, window: tuple, forward: str, backward: Optional[str], dq: Optional[str],
                 stats_m: int):  # fmt: skip
        self.options, self.window, self.stats_m = options, window, stats_m
        self.forward, self.backward, self.dq = forward, backward, dq

    def run(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _HopperDense.apply(q, k, v, self)
        return self.attend(q, k, v)[0]

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """(out, lse) of the forward."""
        from .kernels.hopper.attention_fwd import hopper_attention_forward

        b, s, h, _ = q.shape
        out = torch.empty_like(q)
        lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
        o = self.options
        hopper_attention_forward(q, k, v, out, lse, softmax_scale=o["softmax_scale"], causal=o["causal"],
                                 variant=self.forward, window=self.window, softcap=o["softcap"])  # fmt: skip
        return out, lse

    def grads(self, dout, q, k, v, out, lse) -> Tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv); a ``dout`` laid out unlike ``out`` (or a call autograd runs under a
        dispatch mode) takes the general backward, which decides for it, as does a plan without
        a ``backward``."""
        if self.backward is None or dout.stride() != out.stride() or dout.data_ptr() % 16 or not direct_call(dout):
            return _attn_bwd(dout, None, q, k, v, out, lse, *(None,) * 7, **self.options)[:3]
        from .kernels.hopper.attention_bwd import hopper_attention_backward, sem_from_preprocess

        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        o = self.options
        dq_sem = sem_from_preprocess(q, self.backward, False)
        delta, stats = _bwd.backward_preprocess(out, dout, None, lse, cu_seqlens_q=None, max_seqlen_q=q.shape[1],
                                                stats_m=self.stats_m, dq_sem=dq_sem)  # fmt: skip
        hopper_attention_backward(q, k, v, dout, lse, delta, dq, dk, dv, softmax_scale=o["softmax_scale"],
                                  causal=o["causal"], variant=self.backward, window=self.window, softcap=o["softcap"],
                                  stats=stats, dq_sem=dq_sem)  # fmt: skip
        if self.dq is not None:  # dout is laid out like out, so like q: the dQ kernel covers it
            from .kernels.hopper.attention_dq import hopper_attention_dq

            hopper_attention_dq(q, k, v, dout, lse, delta, dq, softmax_scale=o["softmax_scale"], causal=o["causal"],
                                variant=self.dq, window=self.window, softcap=o["softcap"])  # fmt: skip
        return dq, dk, dv


class _HopperDense(torch.autograd.Function):
    """Autograd for a :class:`_DensePlan` call (the output alone: its lse is not returned)."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = plan.attend(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout):
        return (*ctx.plan.grads(dout, *ctx.saved_tensors), None)


# plans by signature; False: a signature the general path serves (a PlanCache rebuilds on None)
_DENSE_PLANS = launch.PlanCache()
_SCALARS = (int, float, type(None))


def _dense_plan(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                position_ids, learnable_sink, key_bounds) -> Optional[_DensePlan]:  # fmt: skip
    """The kept plan of a plain dense call (no dropout, ALiBi, sinks, key bounds or returned lse;
    tensors, not subclasses; Python scalars; packed rows in ``position_ids`` excluded) in eager
    mode on a device where the Gluon Hopper kernels run, or None: the general path serves it.
    Launch plans switched off (:func:`~hf_flash.kernels.launch.launch_plans`,
    ``HF_FLASH_LAUNCH_PLANS=0``) switch these off too."""
    if torch.compiler.is_compiling():  # first: a tracer reads nothing below
        return None
    if (dropout_p or alibi_slopes is not None or learnable_sink is not None or key_bounds is not None
            or return_attn_probs or not launch.plans_enabled()):  # fmt: skip
        return None
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor or q.dim() != 4:
        return None
    if type(window_size) is not tuple or type(causal) is not bool or type(softmax_scale) not in _SCALARS:
        return None
    if type(softcap) not in _SCALARS or not all(type(w) is int for w in window_size):
        return None
    if not configs.hopper_backward_enabled(q.device):
        return None
    if position_ids is None:
        if not direct_call(q, k, v):
            return None
    elif not direct_call(q, k, v, position_ids) or _packing.packed_boundaries(position_ids, q.shape[0], q.shape[1]):
        return None
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
           k.device, v.device, (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0, softmax_scale, causal,
           window_size, softcap, position_ids is None, configs.deterministic(), configs.dispatch_epoch())  # fmt: skip
    args = (q, k, v, softmax_scale, causal, window_size, softcap, position_ids)
    return _DENSE_PLANS.get(key, lambda: _new_dense_plan(*args)) or None


def _new_dense_plan(q, k, v, softmax_scale, causal, window_size, softcap, position_ids):
    """:func:`_dense_plan`'s plan for a signature not seen yet, found as the general path finds
    its way (its checks raise here as they would there), or False."""
    _check_dense(q, k, v, 0.0, softmax_scale, causal, window_size, softcap, None, position_ids, None, None)
    if q.numel() == 0 or k.shape[1] == 0 or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    options = _call_options(q, q.shape[1], k.shape[1], 0.0, softmax_scale, causal, window_size, softcap)
    paths = dict(varlen=False, alibi_slopes=None, **options)
    if _fwd.forward_path(q, k, v, None, **paths) != "hopper":
        return False
    if _bwd.backward_path(q, k, v, None, None, None, None, **paths) != "hopper":
        return False
    from .kernels.hopper import attention_bwd as hopper_bwd

    window = (options["window_left"], options["window_right"])
    variants = _gluon_variants(_BOTH_HOPPER, q, False, options)
    var = hopper_bwd.VARIANTS[variants["backward"]]
    backward = variants["backward"] if var.dq_atomic or variants["dq"] is not None else None
    return _DensePlan(options, window, variants["forward"], backward, variants["dq"], var.stats_rows)


_BOTH_HOPPER = {"forward": "hopper", "backward": "hopper"}


def _gluon_variants(paths: dict, q: Tensor, varlen: bool, options: dict, k: Optional[Tensor] = None,
                    v: Optional[Tensor] = None, **extras) -> dict:  # fmt: skip
    """The Gluon variants of a call whose passes take ``paths`` (:func:`attention_paths`), from
    its normalised ``options`` (:func:`_call_options`): ``{"forward": name or None, "backward":
    name or None, "dq": name or None}`` (None where a pass runs Triton; ``"dq"``: the dQ
    kernel's variant where the dK/dV kernel leaves dQ to a kernel of its own, None where the
    backward variant computes it or the Triton dQ kernel does; with ``k``, ``v`` and the call's
    ``alibi_slopes`` / ``sinks`` / ``key_bounds`` in ``extras``, also beside the Triton dK/dV
    kernel: ``flash_bwd.gluon_dq_variant``). Dense calls pick by query length."""
    from .kernels.hopper import attention_bwd as hopper_bwd
    from .kernels.hopper import attention_fwd as hopper_fwd

    head_dim, seqlen_q = q.shape[-1], 0 if varlen else q.shape[1]
    window = (options["window_left"], options["window_right"])
    causal = options["causal"]
    backward = dq = None
    if paths["backward"] == "hopper":
        backward = hopper_bwd.variant_for(head_dim, causal, varlen, seqlen_q, window)
    if backward is not None or k is not None:
        dq = _bwd.gluon_dq_variant(q, k, v, None, None, backward_variant=backward, varlen=varlen, **extras,
                                   **options)  # fmt: skip
    return {
        "forward": hopper_fwd.default_variant(head_dim, causal, varlen, window, seqlen_q, options["softcap"])
        if paths["forward"] == "hopper" else None,
        "backward": backward,
        "dq": dq,
    }  # fmt: skip


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def attention_paths(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None, varlen: bool = False,
    learnable_sink: Optional[Tensor] = None, key_bounds: Optional[Tensor] = None,
) -> dict:  # fmt: skip
    """Which kernels :func:`flash_attn_func` (or, with ``varlen=True``,
    :func:`flash_attn_varlen_func`) runs for these arguments: ``{"forward": "hopper" or
    "triton", "backward": "hopper" or "triton"}``. ``"hopper"`` is the Gluon
    FlashAttention-3-style code for H100/H200 (:mod:`hf_flash.kernels.hopper`), taken for
    fp16/bf16 calls, causal or not, with or without a sliding window, without ALiBi, dropout,
    sinks or ``key_bounds``: the forward (softcap too) of dense calls at head dim 64 or 128, and
    of packed calls (``varlen=True``; q/k/v then (total, nheads, headdim)) at head dim 64 or 128
    (``HF_FLASH_HOPPER_VARLEN=0`` keeps those on Triton); the backward (dense: dK, dV and dQ in one
    kernel; packed: dK/dV, with the Gluon dQ kernel beside it; the delta preprocess stays Triton)
    at head dims 64 and 128 for dense and packed calls alike (whichever forward ran), without
    softcap; at head dim 256 a split-D dK/dV kernel (dQ from the Gluon dQ kernel for dense calls,
    from Triton for packed ones), dense and packed, softcap too. Soft-capped d128 calls run the
    Triton dK/dV kernel beside the Gluon dQ kernel (``attention_variants`` names the dQ kernel's
    form). Everything else runs the portable Triton kernels.
    ``HF_FLASH_HOPPER=0`` keeps every call on Triton. The backward's answer assumes the incoming
    gradient is laid out like q (as autograd usually hands it); one TMA cannot address sends
    that call's backward to Triton. Arguments as :func:`flash_attn_func`; nothing is launched."""
    options = _call_options(q, 0, 0, dropout_p, softmax_scale, causal, window_size, softcap)
    forward = _fwd.forward_path(
        q, k, v, None, varlen=varlen, alibi_slopes=alibi_slopes, sinks=learnable_sink,
        key_bounds=key_bounds, **options,
    )  # fmt: skip
    backward = _bwd.backward_path(
        q, k, v, None, None, None, None, varlen=varlen, alibi_slopes=alibi_slopes,
        sinks=learnable_sink, key_bounds=key_bounds, **options,
    )  # fmt: skip
    return {"forward": forward, "backward": backward}


def attention_variants(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> dict:
    """The Gluon kernel forms (``hf_flash.kernels.hopper``'s ``VARIANTS`` names) a call runs by
    default: ``{"forward": name or None, "backward": name or None, "dq": name or None}``, None
    where that pass runs the Triton kernels (``"dq"``: the Gluon dQ kernel beside a backward
    variant that computes dK/dV only, or beside the Triton dK/dV kernel (soft-capped d128 calls,
    where ``"backward"`` is None); None where the backward variant computes dQ itself or the
    Triton dQ kernel runs). Keyword arguments as :func:`attention_paths`'s. Dense calls without a
    window or softcap pick their forms by query length; nothing is launched."""
    paths = attention_paths(q, k, v, **kwargs)
    options = _call_options(q, 0, 0, kwargs.get("dropout_p", 0.0), kwargs.get("softmax_scale"),
                            kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)),
                            kwargs.get("softcap", 0.0))  # fmt: skip
    extras = dict(alibi_slopes=kwargs.get("alibi_slopes"), sinks=kwargs.get("learnable_sink"),
                  key_bounds=kwargs.get("key_bounds"))  # fmt: skip
    return _gluon_variants(paths, q, kwargs.get("varlen", False), options, k, v, **extras)


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
    learnable_sink: Optional[Tensor] = None,
    key_bounds: Optional[Tensor] = None,
):
    """Exact attention on batches of equal-length sequences (no padding), flash-attn 2.x compatible.

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
            [p - left, p + right]; a negative bound (-1) is unbounded on that side. A pair of
            ints or a two-element integer tensor. Whole key tiles outside
            the window are skipped, so cost grows with seqlen * window. Default (-1, -1).
        softcap: float. If > 0, scores become ``softcap * tanh(scores / softcap)`` (Gemma 2).
        alibi_slopes: (nheads,) or (batch, nheads), float32. Adds ``-slope * |p - j|`` to the
            score of query position p and key j.
        deterministic: bool. Accepted for compatibility and ignored: hf_flash's backward is
            bitwise deterministic unless ``HF_FLASH_DETERMINISTIC=0`` (or
            ``kernels.configs.use_deterministic(False)``) lets the Hopper backward add dQ
            in any order where that measured faster (packed d128 non-causal calls). It is a
            process-wide switch because flash-attn's default here (False) would otherwise make
            every call non-deterministic.
        return_attn_probs: bool. If True, also return the softmax log-sum-exp and, with dropout,
            the probabilities (see Return).
        learnable_sink: (nheads,) floating point, or None. One more logit per query head in
            every row's softmax, with no value (gpt-oss's attention sinks; the argument of
            flash-attn 4's interface): rows put part of their weight on it, and a row that sees
            no key outputs 0. In the scaled scores' units; differentiable (its gradient comes
            from the backward's per-row term). Not with dropout.
        key_bounds: (batch, seqlen_q, 2) int32, or None. hf_flash's extension: query row i of
            batch b sees exactly the keys ``key_bounds[b, i, 0] <= j < key_bounds[b, i, 1]``
            (clamped to ``[0, seqlen_k)``; an empty range sees no key and outputs 0), in place of
            ``causal`` and ``window_size`` (pass causal=False, window_size=(-1, -1) and put them
            into the bounds). Any union of ranges that contain row i is one range, e.g. causal
            OR "the image block that holds row i" (gemma3's bidirectional image tokens), with
            row 4 in the block of rows 3..5::

                row 2:  1 1 1 0 0 0     [0, 3)
                row 4:  1 1 1 1 1 1     [0, 6)  (sees 5, later in its block)

            Whole key tiles outside every row's range are skipped, forward and backward. Runs the
            portable Triton kernels on every GPU (:func:`attention_paths`).

    Return:
        out: (batch, seqlen_q, nheads, headdim), q's dtype.
        softmax_lse [if return_attn_probs]: (batch, nheads, seqlen_q), float32, natural log;
            +inf for queries that see no key (their output is 0). Differentiable.
        S_dmask [if return_attn_probs]: with dropout_p > 0, flash-attn's debugging aid: the
            probabilities (batch, nheads, seqlen_q and seqlen_k rounded up to 128), q's dtype,
            negated where dropout removed them (materialised S x S per head: small shapes only);
            None without dropout.
    """
    return dense_attention(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        return_attn_probs, learnable_sink=learnable_sink, key_bounds=key_bounds,
    )  # fmt: skip


def dense_attention(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, return_attn_probs=False, *, position_ids: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None, key_bounds: Optional[Tensor] = None,
):  # fmt: skip
    """:func:`flash_attn_func` for hf_flash's transformers integration, which may pass the
    model's ``position_ids`` ((1, seqlen) or (batch, seqlen); seqlen_q == seqlen_k): rows
    whose positions restart hold packed sequences, which then attend only within themselves
    (found when the op runs, :mod:`hf_flash._packing`, so torch.compile traces no host read).
    A repeated plain call on the Gluon Hopper kernels runs its kept plan (:func:`_dense_plan`)."""
    plan = _dense_plan(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       return_attn_probs, position_ids, learnable_sink, key_bounds)  # fmt: skip
    if plan is not None:
        return plan.run(q, k, v)
    if not torch.compiler.is_compiling():
        _check_dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, position_ids,
                     learnable_sink, key_bounds)  # fmt: skip
    return _attention(
        q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, return_attn_probs, position_ids=position_ids,
        learnable_sink=learnable_sink, key_bounds=key_bounds,
    )  # fmt: skip


def _check_dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, position_ids,
                 learnable_sink, key_bounds) -> None:  # fmt: skip
    """:func:`dense_attention`'s argument checks (errors before any kernel runs)."""
    _checks.check_tensor_basics(q, k, v)
    _checks.check_dims(
        4, "(batch, seqlen, nheads, headdim) (packed sequences go to flash_attn_varlen_func)",
        q=q, k=k, v=v,
    )  # fmt: skip
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"batch sizes differ: q={q.shape[0]}, k={k.shape[0]}, v={v.shape[0]}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k has seqlen {k.shape[1]} but v has {v.shape[1]}")
    _checks.check_heads(q.shape[2], k.shape[2], v.shape[2], q.shape[3], k.shape[3], v.shape[3])
    _checks.check_options(
        dropout_p=dropout_p, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, nheads=q.shape[2], batch=q.shape[0],
        learnable_sink=learnable_sink, device=q.device,
    )  # fmt: skip
    if position_ids is not None and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"position_ids describe packed rows of self-attention; seqlen_q={q.shape[1]} "
            f"and seqlen_k={k.shape[1]} differ"
        )
    if key_bounds is not None:
        _checks.check_key_bounds(key_bounds, q.shape[:2], q.device, causal, window_size)
        if position_ids is not None:
            raise ValueError(
                "key_bounds with position_ids (packed rows) is not supported; give the "
                "bounds of each row's own sequence instead"
            )


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
    learnable_sink: Optional[Tensor] = None,
    key_bounds: Optional[Tensor] = None,
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
        block_table: optional (batch, max_pages_per_sequence) int32 page table: paged K/V, as
            in flash-attn. k and v are then (num_pages, page_size, nheads_k, headdim) caches and
            sequence b's key j lives in page ``block_table[b, j // page_size]`` at row
            ``j % page_size``; cu_seqlens_k still gives the sequences' key lengths. Forward only
            (k/v must not require grad; flash-attn has no backward for it either). The pages a
            call can see are first gathered into one contiguous buffer of
            ``batch x max_pages x page_size`` keys (one copy of that much K/V in one indexing
            launch, sized from shapes alone), then the varlen kernel runs over it. The page
            table's values are checked on the host together with cu_seqlens.
        learnable_sink: (nheads,) sink logits, as in :func:`flash_attn_func`.
        key_bounds: (total_q, 2) int32, or None: each packed query row's key range, as in
            :func:`flash_attn_func`, in key indices of its own sequence (0 = the sequence's
            first key).

    Return:
        out: (total_q, nheads, headdim).
        softmax_lse [if return_attn_probs]: (nheads, total_q), float32.
        S_dmask [if return_attn_probs]: see :func:`flash_attn_func`; sequence b fills the top-left
            corner of slot b.

    The cu_seqlens values are checked on the host (one device sync) unless a CUDA graph is
    being captured or torch.compile is tracing.
    """
    return varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
        block_table, check_cu_seqlens=True, learnable_sink=learnable_sink, key_bounds=key_bounds,
    )  # fmt: skip


def varlen_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    return_attn_probs=False, block_table=None, *, check_cu_seqlens: bool = True,
    learnable_sink: Optional[Tensor] = None, key_bounds: Optional[Tensor] = None,
):  # fmt: skip
    """:func:`flash_attn_varlen_func` for callers that built ``cu_seqlens`` themselves on the
    device (hf_flash's transformers integration): ``check_cu_seqlens=False`` skips the host-side
    value check and its device sync; shapes, dtypes and devices are still checked."""
    if block_table is not None:  # first: paged k/v would fail the contiguous checks below
        k, v, total_k = _gather_pages(q, k, v, block_table, cu_seqlens_k, max_seqlen_k,
                                      check_cu_seqlens)  # fmt: skip
    else:
        total_k = k.shape[0]
    if not torch.compiler.is_compiling():
        _checks.check_tensor_basics(q, k, v)
        _checks.check_dims(3, "(total_tokens, nheads, headdim) for the varlen API", q=q, k=k, v=v)
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
        _checks.check_heads(q.shape[1], k.shape[1], v.shape[1], q.shape[2], k.shape[2], v.shape[2])
        for name, cu, total, max_len in (
            ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
            ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k),
        ):
            _checks.check_cu_seqlens(name, cu, total, int(max_len), q.device, check_cu_seqlens)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k has "
                f"{cu_seqlens_k.numel()}; both must be batch + 1"
            )
        _checks.check_options(
            dropout_p=dropout_p, softmax_scale=softmax_scale, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, nheads=q.shape[1],
            batch=cu_seqlens_q.numel() - 1, learnable_sink=learnable_sink, device=q.device,
        )  # fmt: skip
        if key_bounds is not None:
            _checks.check_key_bounds(key_bounds, q.shape[:1], q.device, causal, window_size)
    return _attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
        learnable_sink=learnable_sink, key_bounds=key_bounds,
    )  # fmt: skip


def _gather_pages(q, k_pages, v_pages, block_table, cu_seqlens_k, max_seqlen_k, check_values):
    """Paged K/V of :func:`flash_attn_varlen_func` -> contiguous varlen k/v with the sequences
    packed as cu_seqlens_k says, plus the number of real keys (``cu_seqlens_k[-1]``, read only
    when host reads are allowed; otherwise the buffer's length, which the value checks skip).

    The buffer holds ``batch x max_pages x page_size`` rows, an upper bound on the keys, so its
    shape needs no device value: row t belongs to the sequence b whose range holds t, at key
    ``t - cu_seqlens_k[b]``; rows past the last sequence gather page 0 and are never read."""
    if not isinstance(k_pages, Tensor) or not isinstance(v_pages, Tensor):
        raise TypeError("k and v must be torch.Tensors")
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            "with block_table, k and v must be paged caches of one shape (num_pages, page_size, "
            f"nheads_k, headdim); got k {tuple(k_pages.shape)}, v {tuple(v_pages.shape)}"
        )
    if k_pages.requires_grad or v_pages.requires_grad:
        raise ValueError(
            "gradients through paged K/V (block_table) are not supported (flash-attn has no "
            "backward for them either); pass detached caches, or contiguous k/v to train"
        )
    batch = cu_seqlens_k.numel() - 1 if isinstance(cu_seqlens_k, Tensor) else -1
    num_pages, page, hk, d = k_pages.shape
    _checks.check_page_table(block_table, batch, q.device)
    for name, t in (("k", k_pages), ("v", v_pages)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if cu_seqlens_k.dtype != torch.int32 or cu_seqlens_k.device != q.device:
        raise ValueError("cu_seqlens_k must be an int32 tensor on q's device")
    capacity = block_table.shape[1] * page
    total = batch * capacity
    if check_values and host_reads_allowed():
        vals = cu_seqlens_k.tolist()
        longest = max(b - a for a, b in zip(vals[:-1], vals[1:]))
        if longest > capacity:
            raise ValueError(
                f"a sequence in cu_seqlens_k has {longest} keys but block_table holds "
                f"{block_table.shape[1]} pages of {page} = {capacity} per sequence"
            )
        pages_used = [-(-(b - a) // page) for a, b in zip(vals[:-1], vals[1:])]
        used = torch.cat([block_table[i, :n] for i, n in enumerate(pages_used)])
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
            raise ValueError(
                f"block_table points outside the {num_pages} pages of k/v (page ids "
                f"{int(used.min())}..{int(used.max())} among the pages the sequences use)"
            )
        total_k = vals[-1]
    else:
        total_k = total
    t = torch.arange(total, device=q.device, dtype=torch.int32)
    seq = (torch.searchsorted(cu_seqlens_k, t, right=True) - 1).clamp_(0, batch - 1)
    key = (t - cu_seqlens_k[seq]).clamp_(0, capacity - 1)
    slot = block_table[seq, key // page].long().clamp_(0, num_pages - 1) * page + key % page
    k = k_pages.reshape(num_pages * page, hk, d).index_select(0, slot)
    v = v_pages.reshape(num_pages * page, hk, d).index_select(0, slot)
    return k, v, total_k


def _attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
    causal, window_size, softcap, alibi_slopes, return_attn_probs, position_ids=None,
    learnable_sink=None, key_bounds=None,
):  # fmt: skip
    """The dense and varlen functions after their checks: one forward (and its autograd), the
    flash-attn return form."""
    if learnable_sink is not None and dropout_p > 0.0:
        raise ValueError("learnable_sink with dropout_p > 0 is not supported; pass dropout_p=0.0")
    if key_bounds is not None and return_attn_probs and dropout_p > 0.0:
        raise ValueError(
            "return_attn_probs=True with dropout is not available with key_bounds; pass "
            "return_attn_probs=False (the output and lse are)"
        )
    rng_state = _new_rng_state(q.device) if dropout_p > 0.0 else None
    options = _call_options(q, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                            window_size, softcap)  # fmt: skip
    out, lse = attention_forward(
        unit_last_stride(q), unit_last_stride(k), unit_last_stride(v), cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes, position_ids=position_ids,
        sinks=None if learnable_sink is None else learnable_sink.float(), rng_state=rng_state,
        key_bounds=unit_last_stride(key_bounds), **options,
    )  # fmt: skip
    if not return_attn_probs:
        return out
    probs = None
    if dropout_p > 0.0:
        if position_ids is not None:
            raise ValueError(
                "return_attn_probs=True with dropout needs the dense or varlen call, not "
                "position_ids"
            )
        probs = _dropout_encoded_probs(q, k, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state,
                                       options)  # fmt: skip
    return out, lse, probs


def _dropout_encoded_probs(q, k, cu_q, cu_k, alibi_slopes, rng_state, options) -> Tensor:
    """flash-attn's third return value with dropout (a testing and debugging aid): the softmax
    probabilities (batch, nheads, seqlen_q rounded up to 128, seqlen_k rounded up to 128), in
    q's dtype, with every entry the kernel's dropout removed negated (the kept ones positive),
    zero outside the attention. Packed sequences each fill the top-left corner of their own
    (max_seqlen_q, max_seqlen_k) slot. Materialises S x S per head, so meant for small shapes;
    the probabilities come from hf_flash.reference (exact), the pattern from the kernels' own
    Philox stream."""
    from . import reference
    from .kernels.flash_common import dropout_keep_mask

    def _round(n: int) -> int:
        return -(-n // 128) * 128

    nheads = q.shape[-2]
    ref_opts = dict(
        softmax_scale=options["softmax_scale"], causal=options["causal"],
        window_size=(options["window_left"], options["window_right"]), softcap=options["softcap"],
    )  # fmt: skip
    if cu_q is None:
        pieces = [(q, k, alibi_slopes)]
        batch, max_q, max_k = q.shape[0], q.shape[1], k.shape[1]
    else:
        bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
        batch, max_q, max_k = len(bounds_q) - 1, options["max_seqlen_q"], options["max_seqlen_k"]
        pieces = [
            (q[None, bounds_q[b]:bounds_q[b + 1]], k[None, bounds_k[b]:bounds_k[b + 1]],
             alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes)
            for b in range(batch)
        ]  # fmt: skip
    keep = dropout_keep_mask(rng_state, batch, nheads, max_q, max_k, options["dropout_p"])
    probs = torch.zeros((batch, nheads, _round(max_q), _round(max_k)), dtype=q.dtype,
                        device=q.device)  # fmt: skip
    with torch.no_grad():
        for b, (qb, kb, slopes) in enumerate(pieces):
            p, _ = reference.attention_probs(qb, kb, alibi_slopes=slopes, **ref_opts)
            rows = slice(b, b + 1) if cu_q is not None else slice(None)
            sq, sk = p.shape[-2:]
            signed = torch.where(keep[rows, :, :sq, :sk], p, -p)
            probs[rows, :, :sq, :sk] = signed.to(q.dtype)
    return probs


# --------------------------------------------------------------------------------------------
# Packed forms (flash-attn's qkv-packed and kv-packed functions)
# --------------------------------------------------------------------------------------------


def _unpack(name: str, t, parts: int, ndim: int, layout: str) -> Tuple[Tensor, ...]:
    """Views of the ``parts`` tensors packed on ``t``'s axis ``ndim - 3`` (no copy)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    axis = ndim - 3
    if t.dim() != ndim or t.shape[axis] != parts:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    return t.unbind(axis)


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """:func:`flash_attn_func` with q, k and v packed in one tensor (flash-attn's layout of a
    fused QKV projection).

    Arguments:
        qkv: (batch, seqlen, 3, nheads, headdim). q, k and v are read in place (views on axis 2,
            one kernel launch); its gradient is one (batch, seqlen, 3, nheads, headdim) tensor.
        Other arguments and return: as :func:`flash_attn_func` (MHA: k/v have nheads heads).
    """
    q, k, v = _unpack("qkv", qkv, 3, 5, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """:func:`flash_attn_func` with k and v packed in one tensor (a fused KV projection, e.g.
    cross-attention or a KV cache kept as one buffer).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim).
        kv: (batch, seqlen_k, 2, nheads_k, headdim); nheads a multiple of nheads_k (GQA/MQA).
            k and v are read in place (views on axis 2).
        Other arguments and return: as :func:`flash_attn_func`.
    """
    k, v = _unpack("kv", kv, 2, 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """:func:`flash_attn_varlen_func` with q, k and v packed in one tensor.

    Arguments:
        qkv: (total, 3, nheads, headdim), the sequences concatenated. q, k and v are views on
            axis 1 (one kernel launch).
        cu_seqlens: (batch + 1,) int32, for queries and keys alike. max_seqlen: int.
        Other arguments and return: as :func:`flash_attn_varlen_func`.
    """
    q, k, v = _unpack("qkv", qkv, 3, 4, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
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
):
    """:func:`flash_attn_varlen_func` with k and v packed in one tensor.

    Arguments:
        q: (total_q, nheads, headdim). kv: (total_k, 2, nheads_k, headdim); k and v are views on
            axis 1.
        Other arguments and return: as :func:`flash_attn_varlen_func`.
    """
    k, v = _unpack("kv", kv, 2, 4, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip
