"""A tiled MLP: each decoder layer's MLP runs over chunks of the tokens, forward and backward.

A Llama-style MLP, ``down(act(gate(x)) * up(x))``, holds two or three ``tokens x intermediate``
temporaries while it runs and, under autograd, keeps them for the backward pass: on the 8B Llama-3
shape (intermediate 14336, 3.5x hidden) at 256K tokens that is ~7 GiB per bf16 temporary, the
largest activation of a checkpointed layer. :func:`tile_mlp` replaces each decoder layer's MLP
forward by one that runs the original forward ``chunk_tokens`` tokens (of the flattened
batch x sequence) at a time::

    forward    no_grad: out[c] = mlp(x[c]) for each chunk c      (out preallocated; saves x only)
    backward   for each chunk c: y = mlp(x[c]) with grad,
               dx[c], dW_c = autograd.grad(y, (x[c], W), dout[c]);  dW = sum_c dW_c

so at most one chunk's temporaries exist at any time. The module's trainable parameters (LoRA
adapters, or every weight in a full fine-tune) are explicit inputs of the autograd Function, whose
backward returns their gradients summed over the chunks (in float32 when the parameters are lower
precision); autograd accumulates them into ``.grad`` as it would for the untiled MLP.

Cost: the backward runs the MLP forward once more per chunk. With activation checkpointing the
recomputation also runs the whole tiled forward again, so the MLP forward runs three times per
step instead of two (about +1/3 of the MLP's FLOPs, ~+15-20% of a layer's GEMM time on the 8B
shape, less where attention dominates). Use it when the MLP's temporaries decide the peak;
sequences of at most ``chunk_tokens`` tokens run the original forward unchanged.

Numerics: every chunk runs the same ops as the untiled MLP on fewer rows. Outputs and the input
gradient are computed row by row (equal up to the GEMM library's blocking); parameter gradients
are sums of per-chunk GEMMs, so they differ from the untiled ones by summation order only.

Autocast: the autocast state of the forward (per device type, and the weight-cast cache switch)
is captured and re-entered for the backward's recomputation. Dropout (e.g. peft's
``lora_dropout``): the RNG state (CPU and the input's CUDA device) is saved before the forward's
first chunk and restored for the backward's, which draw again in the same order and sizes, so
each chunk's backward uses the masks its forward used; the ambient RNG stream is left as the
forward left it. The masks differ from the untiled MLP's (drawn per chunk rather than at once):
equal in distribution, not in bits.

Generic: the module named ``mlp`` in every transformers decoder layer, whatever its forward is
(peft's LoRA layers inside it, Liger-Kernel's fused SwiGLU forward, Phi-3's fused gate_up), as
long as it maps ``(..., hidden)`` to ``(..., features)`` token by token and returns one tensor
(checked at the first call). Mixture-of-experts blocks are left alone (their routers' outputs are
recorded for the auxiliary loss, which chunking would split).
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch
from torch import nn

from ..integration.patching import unwrap_forwards, wrap_forward

__all__ = ["tile_mlp", "untile_mlp"]

_RECORD = "_hf_flash_tiled_mlp"  # patching record: what the tiled forward replaced
_CHUNK_ATTR = "_hf_flash_mlp_chunk_tokens"
_LOW_PRECISION = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Autocast and RNG state, captured in the forward and re-entered in the backward
# --------------------------------------------------------------------------------------------


def _autocast_state(device_type: str) -> tuple:
    states = []
    for dt in dict.fromkeys((device_type, "cpu")):
        if torch.amp.is_autocast_available(dt):
            states.append((dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)))
    return tuple(states), torch.is_autocast_cache_enabled()


@contextlib.contextmanager
def _autocast(state: tuple):
    states, cache = state
    with contextlib.ExitStack() as stack:
        for dt, enabled, dtype in states:
            stack.enter_context(
                torch.autocast(dt, dtype=dtype, enabled=enabled, cache_enabled=cache)
            )
        yield


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replayed_rng(state: Optional[tuple], device: torch.device):
    if state is None:
        yield
        return
    cpu, cuda = state
    devices = [device] if cuda is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


# --------------------------------------------------------------------------------------------
# The chunked forward and the autograd Function
# --------------------------------------------------------------------------------------------


def _chunks(n: int, chunk: int):
    for start in range(0, n, chunk):
        yield start, min(start + chunk, n)


def _chunk_view(flat: torch.Tensor, start: int, end: int, ndim: int) -> torch.Tensor:
    """Rows start:end of the flattened input, with the input's rank: (1, ..., rows, hidden)."""
    rows = flat[start:end]
    return rows.view(*((1,) * (ndim - 2)), end - start, flat.shape[-1])


def _check_output(y, module_name: str, rows: int) -> torch.Tensor:
    if not isinstance(y, torch.Tensor) or y.dim() < 1 or y.numel() // max(y.shape[-1], 1) != rows:
        what = type(y).__name__ if not isinstance(y, torch.Tensor) else f"shape {tuple(y.shape)}"
        raise TypeError(
            f"tile_mlp: {module_name}.forward must map (..., hidden) to (..., features) token by "
            f"token and return one tensor; for a chunk of {rows} tokens it returned {what}. This "
            f"module cannot be tiled: call hf_flash.training.untile_mlp(model)"
        )
    return y


def _chunked_forward(run: Callable, module_name: str, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``run`` over chunks of ``x``'s tokens into one preallocated output (no autograd)."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    out = None
    for start, end in _chunks(n, chunk):
        y = _check_output(run(_chunk_view(flat, start, end, x.dim())), module_name, end - start)
        if out is None:
            out = y.new_empty((n, y.shape[-1]))
        out[start:end] = y.reshape(end - start, -1)
    return out.view(*x.shape[:-1], out.shape[-1])


class _TiledMLP(torch.autograd.Function):
    """forward(run, module_name, chunk, x, *params) -> run(x), chunk by chunk. ``params``: the
    module's trainable parameters, inputs so that their gradients come back through autograd."""

    @staticmethod
    def forward(ctx, run, module_name, chunk, x, *params):
        ctx.run, ctx.module_name, ctx.chunk, ctx.params = run, module_name, chunk, params
        ctx.autocast = _autocast_state(x.device.type)
        ctx.rng = _rng_state(x.device)
        ctx.save_for_backward(x)
        return _chunked_forward(run, module_name, x, chunk)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        targets = [p for p, need in zip(ctx.params, ctx.needs_input_grad[4:]) if need]
        flat = x.detach().reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat) if need_x else None
        sums: List[Optional[torch.Tensor]] = [None] * len(targets)
        with _replayed_rng(ctx.rng, x.device), _autocast(ctx.autocast), torch.enable_grad():
            for start, end in _chunks(flat.shape[0], ctx.chunk):
                xc = _chunk_view(flat, start, end, x.dim()).detach().requires_grad_(need_x)
                y = ctx.run(xc)
                inputs = ([xc] if need_x else []) + targets
                grads = torch.autograd.grad(
                    y, inputs, grad_flat[start:end].view(y.shape), allow_unused=True
                )
                if need_x:
                    grad_x[start:end] = grads[0].reshape(end - start, -1)
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    if g is None:
                        continue
                    if sums[i] is None:
                        sums[i] = g.float() if g.dtype in _LOW_PRECISION else g
                    else:
                        sums[i] += g  # float32 accumulator for half parameters
        results = iter(sums)
        param_grads = []
        for p, need in zip(ctx.params, ctx.needs_input_grad[4:]):
            g = next(results) if need else None
            param_grads.append(None if g is None else g.to(p.dtype))
        ctx.run = ctx.params = None
        return (None, None, None, None if grad_x is None else grad_x.view(x.shape), *param_grads)


def _tiled_call(run: Callable, module: nn.Module, x: torch.Tensor, chunk: int) -> torch.Tensor:
    if x.dim() < 2 or x.numel() // max(x.shape[-1], 1) <= chunk:
        return run(x)  # one chunk: the original forward, bit for bit
    name = type(module).__name__
    params = tuple(p for p in module.parameters() if p.requires_grad)
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        return _chunked_forward(run, name, x, chunk)
    return _TiledMLP.apply(run, name, chunk, x, *params)


def _make_tiled_forward(previous: Callable) -> Callable:
    def tiled_forward(self, x, *args, **kwargs):
        chunk = self.__dict__.get(_CHUNK_ATTR)
        # reverted under another patch that wraps this one, or a call the tiling does not cover
        tiled = _RECORD in self.__dict__ and chunk is not None
        if not tiled or args or kwargs or not isinstance(x, torch.Tensor):
            return previous(x, *args, **kwargs)
        return _tiled_call(previous, self, x, chunk)

    return tiled_forward


# --------------------------------------------------------------------------------------------
# On a model
# --------------------------------------------------------------------------------------------


def _decoder_layer_types() -> tuple:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers absent or reorganised: the class-name test below remains
        return ()
    return (GradientCheckpointingLayer,)


def _is_moe(mlp: nn.Module) -> bool:
    names = set(mlp._modules)
    return bool(names & {"experts", "router"}) or "moe" in type(mlp).__name__.lower()


def _find_mlps(model: nn.Module) -> tuple:
    """(dense MLPs of the decoder layers, names of MoE blocks left alone)."""
    layer_types = _decoder_layer_types()
    mlps, moe = [], []
    for name, module in model.named_modules():
        is_layer = isinstance(module, layer_types) or type(module).__name__.endswith("DecoderLayer")
        mlp = module._modules.get("mlp") if is_layer else None
        if mlp is None:
            continue
        (moe if _is_moe(mlp) else mlps).append((f"{name}.mlp", mlp))
    return mlps, moe


def tile_mlp(model: nn.Module, chunk_tokens: int) -> int:
    """Make every decoder layer's MLP run over chunks of ``chunk_tokens`` tokens, in the forward
    and the backward pass (module docstring).

    Arguments:
        model: a transformers model (or a peft model wrapping one). The MLPs found are the
            submodules named ``mlp`` of its decoder layers (transformers'
            ``GradientCheckpointingLayer``, or a class whose name ends in ``DecoderLayer``);
            mixture-of-experts blocks are skipped.
        chunk_tokens: int > 0. Tokens (of the flattened batch x sequence) per chunk; the last
            chunk takes the remainder. Inputs of at most ``chunk_tokens`` tokens run the original
            forward. Calling again changes the chunk size.

    Return: int, the number of MLP modules tiled.

    Raises TypeError / ValueError for a bad ``chunk_tokens``, ValueError when the model has no
    decoder-layer MLP. :func:`untile_mlp` restores the original forwards.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
        raise TypeError(f"tile_mlp: chunk_tokens must be an int, got {type(chunk_tokens).__name__}")
    if chunk_tokens <= 0:
        raise ValueError(f"tile_mlp: chunk_tokens must be positive, got {chunk_tokens}")
    mlps, moe = _find_mlps(model)
    if not mlps:
        names = ", ".join(n for n, _ in moe[:3])
        skipped = f"; mixture-of-experts blocks are not tiled: {names}" if moe else ""
        raise ValueError(
            f"tile_mlp: found no MLP to tile in {type(model).__name__}: it looks for a submodule "
            f"named 'mlp' in each decoder layer (transformers GradientCheckpointingLayer){skipped}"
        )
    for _, mlp in mlps:
        mlp.__dict__[_CHUNK_ATTR] = chunk_tokens
        wrap_forward(mlp, _RECORD, _make_tiled_forward)  # False when already tiled: chunk updated
    return len(mlps)


def untile_mlp(model: nn.Module) -> int:
    """Restore the MLP forwards :func:`tile_mlp` replaced; returns how many (0 if none)."""
    for module in model.modules():
        module.__dict__.pop(_CHUNK_ATTR, None)
    return unwrap_forwards(model, _RECORD)
