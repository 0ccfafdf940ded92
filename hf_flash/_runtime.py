"""Where a call runs: the interpreter, tracing and capture predicates, and the op-or-eager rule.

Every entry point of hf_flash asks these, so each question has one answer:

* :func:`interpreter_active`: Triton's CPU interpreter is on (kernels then take CPU tensors).
* :func:`host_reads_allowed`: a device value may be read on the host (not while torch.compile
  traces, not while a CUDA graph is captured).
* :func:`eager_call` / :func:`direct_call`: whether an op's body may run directly instead of
  through its ``torch.library`` custom op. The custom ops exist for the tracers (torch.compile,
  FakeTensorMode, FunctionalTensorMode, selective checkpointing, torch.func); in plain eager
  mode their Python dispatch and autograd wrapper only add host time (~0.1-0.5 ms per call,
  paid per layer of every training step and decode step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels.configs import interpreting as interpreter_active

__all__ = ["interpreter_active", "host_reads_allowed", "eager_call", "direct_call"]


def host_reads_allowed() -> bool:
    """False while torch.compile traces or a CUDA graph is being captured: reading a device
    value then would break the graph (dynamo) or the capture. Checked in this order so the
    tracer never sees the capture query."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def eager_call(*tensors) -> bool:
    """True when an op's body may run directly: not tracing (torch.compile) and every tensor a
    plain one (no fake or functional wrapper). For ops that autograd never differentiates
    (the decode op, backward kernels)."""
    return not torch.compiler.is_compiling() and all(type(t) is Tensor for t in tensors)


def direct_call(*tensors) -> bool:
    """:func:`eager_call`, and also no TorchDispatchMode active and no torch.func transform
    (grad, vmap) running: selective activation checkpointing (:mod:`hf_flash.checkpointing`),
    FakeTensorMode and FunctionalTensorMode see ops at the dispatcher, and torch.func accepts
    only the op's registered autograd, so they must get the custom op. Otherwise a
    differentiable op runs through a plain ``torch.autograd.Function`` around the same body."""
    return (
        eager_call(*tensors)
        and torch._C._len_torch_dispatch_stack() == 0
        and not _functorch_active()
    )


def _functorch_active() -> bool:
    # torch.func transforms wrap tensors below Python's view of their type and accept only
    # autograd.Functions with setup_context: they get the custom op
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None
