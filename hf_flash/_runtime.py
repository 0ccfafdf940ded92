"""Where a call runs: the interpreter, tracing and capture predicates, and the op-or-eager rule.

Every entry point of hf_flash asks these, so each question has one answer:

* :func:`interpreter_active`: Triton's CPU interpreter is on (kernels then take CPU tensors).
* :func:`host_reads_allowed`: a device value may be read on the host (not while torch.compile
  traces, not while a CUDA graph is captured).
* :class:`TensorKeyedCache`: values derived from a tensor (a mask's key ranges, a position_ids
  tensor's sequence boundaries), kept while that tensor lives unmodified, never while tracing.
* :func:`eager_call` / :func:`direct_call`: whether an op's body may run directly instead of
  through its ``torch.library`` custom op. The custom ops exist for the tracers (torch.compile,
  FakeTensorMode, FunctionalTensorMode, selective checkpointing, torch.func); in plain eager
  mode their Python dispatch and autograd wrapper only add host time (~0.1-0.5 ms per call,
  paid per layer of every training step and decode step).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from .kernels.configs import interpreting as interpreter_active

__all__ = [
    "interpreter_active", "host_reads_allowed", "eager_call", "direct_call", "TensorKeyedCache",
]  # fmt: skip


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


class TensorKeyedCache:
    """Values derived from a tensor, found again while that tensor lives and is unmodified.

    An entry matches the same tensor object at the same version counter (an in-place change
    misses) and the same ``extra`` key. Entries hold a weak reference and are dropped when their
    tensor dies: small device tensors kept alive past their forward pass shift the caching
    allocator's small-block pattern from one generate() call to the next, so a fresh StaticCache
    (generate makes one per call) gets its fill-level tensors at new addresses and the compiled
    decode step re-records its CUDA graph on every call. Only plain tensors are cached, and
    only outside tracing and CUDA-graph capture (:meth:`usable`): tensors made there hold no
    value outside the graph. ``slots`` bounds the entries (a model with sliding and full layers
    alternates between two masks, hence a few).
    """

    def __init__(self, slots: int):
        self._slots = slots
        self._entries: list = []  # (weakref, version, extra, value), newest first

    @staticmethod
    def usable(t) -> bool:
        # host_reads_allowed first: dynamo cannot trace is_inference(); inference tensors have
        # no version counter to detect in-place changes
        return type(t) is Tensor and host_reads_allowed() and not t.is_inference()

    def get(self, t: Tensor, extra=None):
        """The value stored for ``t`` (and ``extra``), or None. Call only when :meth:`usable`."""
        version = t._version
        for ref, ver, key, value in self._entries:
            if ref() is t and ver == version and key == extra:
                return value
        return None

    def put(self, t: Tensor, value, extra=None) -> None:
        """Store ``value`` for ``t``, replacing what ``t`` had. Call only when :meth:`usable`."""
        live = [e for e in self._entries if e[0]() is not None and e[0]() is not t]
        ref = weakref.ref(t, self._forget)
        self._entries = [(ref, t._version, extra, value)] + live[: self._slots - 1]

    def holds(self, t: Tensor) -> bool:
        return any(e[0]() is t for e in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def _forget(self, dead: weakref.ref) -> None:
        self._entries = [e for e in self._entries if e[0] is not dead]
