"""Checkpointed decoder-layer inputs held in pinned host memory, with asynchronous copies.

With activation checkpointing every decoder layer keeps one tensor from the forward to the
backward pass: its input (tokens x hidden in the compute dtype). At long context these are what
is left of the activations: on the 8B Llama-3 shape at 256K tokens, 32 layers x 2 GiB = 64 GiB of
bf16. :func:`checkpoint_with_offload` keeps each one only in pinned host memory between the
layer's forward and its recomputation::

    forward, layer i     compute stream: layer i                    (input x_i live on the device)
                         side stream:    x_i -> host  (starts once x_i is produced; x_i's memory
                                         is reused only after this copy has read it)
    backward, layer i    side stream:    host -> x_(i-1)   prefetch for the next recomputation
                         compute stream: wait for x_i (prefetched while layer i+1 ran), recompute
                                         layer i, its backward

Each layer input then costs one device-to-host copy in the forward and one host-to-device copy in
the backward, both on a side stream, overlapped with the layers' compute. Only the layer that is
being recomputed and the one prefetched for the next recomputation have their input on the device.

How: the layer runs under plain non-reentrant ``torch.utils.checkpoint.checkpoint`` (its options,
hf_flash's keep-attention ``context_fn`` included, pass through unchanged), inside saved-tensor
hooks of our own. The checkpoint saves its tensor arguments before it pushes its own hooks for
the inside of the layer, so our pack hook gets the hidden states: it starts the copy to host and
returns a small box in place of the tensor, and the device memory is freed when the forward drops
the tensor. When the backward needs the layer, the checkpoint unpacks its inputs (before it
enters the recomputation and its dispatch modes): the box returns the device copy, bitwise
equal, and prefetches the next one. The forward's autograd graph is untouched, so gradients reach
the hidden states exactly as without offload.

What transformers offers (finding, 2026-11-25, transformers 5.23, torch 2.13 on CPU; torch 2.11's
code read): ``activation_checkpointing_enable(offload=True)`` runs each layer's
``checkpoint(...)`` inside ``torch.autograd.graph.save_on_cpu(pin_memory=True)``. That does move
the layer inputs off the device: the non-reentrant checkpoint saves its tensor arguments *before*
it pushes its own saved-tensor hooks (torch 2.13: ``_CheckpointFrame.save_inputs`` makes a
``SavedTensor``; torch <= 2.11: ``_NoopSaveInputs.apply(dummy, kwargs, *args)`` calls
``save_for_backward``), so save_on_cpu's pack hook gets exactly those, one hidden-state tensor per
layer (plus a 0-element dummy before 2.13), and the device tensor is freed. Everything saved
inside the layer goes to the checkpoint's inner hooks (which take precedence, and store nothing).
Counted on a tiny 3-layer Llama: 3 pack calls, each the (1, 32, 64) layer input, and every layer
input's device storage freed after the forward (.notes/offload.md). Except under peft: there
transformers makes the embedding output require grad, a graph leaf that stays alive anyway, so
the first layer's input is copied and not freed (:func:`offload_checkpoints` avoids that). What
it lacks: both copies run
on the compute stream (the device-to-host copy delays the next layer; the host-to-device copy
runs only when the recomputation asks for the input, and the compute waits for it), and nothing
is prefetched. That is what this module adds.

Host memory: PyTorch's pinned-memory allocator rounds every block up to a power of two and caches
it. A 3 GiB layer input (the 8B shape at 384K tokens) would take a 4 GiB block; so each input is
held in pieces whose byte sizes are powers of two (its size's binary digits, the last piece at
most :data:`MIN_PIECE_BYTES`), and a step holds ``layers x tokens x hidden x bytes`` of pinned
memory plus at most one rounded small piece per layer.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint as _checkpoint

__all__ = [
    "OffloadStats",
    "checkpoint_with_offload",
    "offload_checkpoints",
    "unoffload_checkpoints",
]

_STATE_ATTR = "_hf_flash_offload_state"  # on the (base) model: what offload_checkpoints replaced


@dataclass
class OffloadStats:
    """What :func:`offload_checkpoints` set up, and what the last forward pass offloaded.

    Fields:
        layers: int. Decoder layers whose checkpointed input goes to host memory.
        last_step_bytes: int. Bytes copied to host memory by the most recent forward pass with
            gradients (reset when the decoder's forward starts).
        last_step_tensors: int. Layer inputs copied by that forward pass.
    """

    layers: int = 0
    last_step_bytes: int = 0
    last_step_tensors: int = 0

    def _start_step(self) -> None:
        self.last_step_bytes = 0
        self.last_step_tensors = 0

    def _add(self, nbytes: int) -> None:
        self.last_step_bytes += nbytes
        self.last_step_tensors += 1


# --------------------------------------------------------------------------------------------
# Copies: a side stream per CUDA device; plain copies elsewhere
# --------------------------------------------------------------------------------------------

_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


# --------------------------------------------------------------------------------------------
# One forward pass's boxes, in forward order (the recomputations run in reverse)
# --------------------------------------------------------------------------------------------


class _Step:
    __slots__ = ("boxes", "backward_started")

    def __init__(self) -> None:
        self.boxes: list = []  # weakrefs to _OffloadedInput, forward order
        self.backward_started = False

    def push(self, box: "_OffloadedInput") -> int:
        self.boxes.append(weakref.ref(box))
        return len(self.boxes) - 1

    def before(self, index: int) -> Optional["_OffloadedInput"]:
        """The box recomputed after the one at ``index``: the layer before it in the forward."""
        return self.boxes[index - 1]() if index > 0 else None

    def stale(self) -> bool:
        """True once a new forward pass must start a step of its own: its backward has begun,
        or the graph of its last layer is gone."""
        return self.backward_started or (bool(self.boxes) and self.boxes[-1]() is None)


_local = threading.local()  # the forward pass under way in this thread: .step


def _begin_step() -> None:
    _local.step = _Step()


def _current_step() -> _Step:
    step = getattr(_local, "step", None)
    if step is None or step.stale():
        step = _local.step = _Step()
    return step


MIN_PIECE_BYTES = 1 << 20
"""Below this the rest of a layer input goes into one piece (rounded up by the allocator)."""


def host_pieces(numel: int, element_size: int) -> list[int]:
    """Element counts of the pieces a tensor of ``numel`` elements is held in on the host: byte
    sizes that are powers of two, largest first, then one last piece of at most
    :data:`MIN_PIECE_BYTES`."""
    rest, pieces = numel * element_size, []
    while rest > MIN_PIECE_BYTES:
        piece = 1 << (rest.bit_length() - 1)
        pieces.append(piece // element_size)
        rest -= piece
    if rest:
        pieces.append(rest // element_size)
    return pieces


class _OffloadedInput:
    """One layer input from its forward to its recomputation, in host memory.

    Made by the pack hook while the checkpoint saves its inputs: starts the copy to host and
    holds no device memory. :meth:`unpack`, called when a recomputation fetches its inputs,
    returns a device copy (prefetched if the layer recomputed before it asked for it) and
    prefetches the input of the layer that will be recomputed next."""

    __slots__ = (
        "_host", "_device", "_stream", "_fetched", "_fetched_ready", "_step", "_index", "nbytes",
        "__weakref__",
    )  # fmt: skip

    def __init__(self, x: torch.Tensor, step: _Step) -> None:
        self._device = x.device
        self._stream = _side_stream(x.device)
        self._fetched: Optional[torch.Tensor] = None
        self._fetched_ready = None
        self.nbytes = x.numel() * x.element_size()
        self._host = self._to_host(x)
        self._step = step
        self._index = step.push(self)

    def _to_host(self, x: torch.Tensor) -> tuple:
        """``(shape, dtype, pieces)``: x's elements in row-major order, in host tensors sized by
        :func:`host_pieces` (pinned, copied on the side stream, on CUDA)."""
        stream = self._stream
        with torch.no_grad():
            flat = x.contiguous().view(-1)
            pinned = stream is not None
            pieces = [torch.empty(n, dtype=x.dtype, device="cpu", pin_memory=pinned)
                      for n in host_pieces(flat.numel(), flat.element_size())]  # fmt: skip
            if not pinned:
                _copy_pieces(pieces, flat, to_host=True, non_blocking=False)
                return x.shape, x.dtype, pieces
            stream.wait_stream(torch.cuda.current_stream(x.device))  # after x's producer
            with torch.cuda.stream(stream):
                _copy_pieces(pieces, flat, to_host=True, non_blocking=True)
            # x's memory goes back to the allocator when the forward drops x; it is not reused
            # before this copy has read it (nor flat's, when x was not contiguous)
            x.record_stream(stream)
            flat.record_stream(stream)
        return x.shape, x.dtype, pieces

    def prefetch(self) -> None:
        """Start the copy back to the device (once; a no-op while one is pending)."""
        if self._fetched is not None:
            return
        stream = self._stream
        with torch.no_grad():
            shape, dtype, pieces = self._host
            # allocated on the compute stream (its memory pool); the side stream writes it only
            # after the compute stream's earlier use of that memory
            t = torch.empty(shape, dtype=dtype, device=self._device)
            if stream is None:
                _copy_pieces(pieces, t.view(-1), to_host=False, non_blocking=False)
                self._fetched = t
                return
            stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(stream):
                # stream order puts this after the forward's device-to-host copy (same stream)
                _copy_pieces(pieces, t.view(-1), to_host=False, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
            t.record_stream(stream)  # dropped unused (graph freed): not reused before the write
            self._fetched, self._fetched_ready = t, ready

    def unpack(self) -> torch.Tensor:
        self._step.backward_started = True
        self.prefetch()  # no-op when the previous recomputation prefetched it
        t, ready = self._fetched, self._fetched_ready
        self._fetched = self._fetched_ready = None
        if ready is not None:
            torch.cuda.current_stream(self._device).wait_event(ready)
        following = self._step.before(self._index)
        if following is not None:
            following.prefetch()
        return t


def _copy_pieces(pieces: list, flat: torch.Tensor, to_host: bool, non_blocking: bool) -> None:
    """Copy the 1-D ``flat`` into consecutive ``pieces`` (``to_host``) or back."""
    start = 0
    for piece in pieces:
        part = flat[start : start + piece.numel()]
        if to_host:
            piece.copy_(part, non_blocking=non_blocking)
        else:
            part.copy_(piece, non_blocking=non_blocking)
        start += piece.numel()


class _OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks around one ``checkpoint`` call: of the tensors the checkpoint saves as
    its inputs (before its own hooks take over inside the layer), ``x`` goes to host memory;
    the others (a 0-element dummy before torch 2.13, further tensor arguments) stay as they are."""

    def __init__(self, x: torch.Tensor, stats: Optional[OffloadStats]) -> None:
        state = {"x": x}

        def pack(t: torch.Tensor):
            target = state.get("x")
            if target is None or not _same_tensor(t, target):
                return t
            if t.is_leaf and t.requires_grad:
                # the graph's AccumulateGrad node holds a leaf: a host copy would free nothing
                return t
            del state["x"]  # once: an argument repeated stays on the device
            box = _OffloadedInput(t, _current_step())
            if stats is not None:
                stats._add(box.nbytes)
            return box

        def unpack(packed):
            return packed.unpack() if isinstance(packed, _OffloadedInput) else packed

        self._state = state
        super().__init__(pack, unpack)

    def __exit__(self, *exc):
        self._state.clear()  # no reference to x once the forward is done
        return super().__exit__(*exc)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    # the pack hook may get another Python object for the same tensor
    return (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
        and a.dtype == b.dtype and a.device == b.device
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The checkpoint function
# --------------------------------------------------------------------------------------------


def _checkpoint_offloaded(function, args: tuple, kwargs: dict, stats: Optional[OffloadStats]):
    if not args:
        raise TypeError(
            "checkpoint_with_offload(function, *args): the layer input (hidden states) must be the "
            "first positional argument, got none. transformers' decoder layers pass it so; call "
            "your layer as layer(hidden_states, ...)"
        )
    x = args[0]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        what = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(
            f"checkpoint_with_offload: args[0] must be the layer's floating-point hidden states, "
            f"got {what}. Pass the hidden states first (the tensor to hold in host memory), or "
            f"use torch.utils.checkpoint.checkpoint for this layer"
        )
    kwargs = dict(kwargs)
    use_reentrant = kwargs.pop("use_reentrant", False)
    if use_reentrant is not False:
        raise ValueError(
            f"checkpoint_with_offload: use_reentrant={use_reentrant!r} is not supported; offload "
            f"needs the non-reentrant checkpoint (gradients reach the hidden states through the "
            f"forward's own graph). Pass use_reentrant=False or leave it out"
        )
    if not torch.is_grad_enabled():  # eval / no_grad: the checkpoint only runs the function
        return _checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    with _OffloadHooks(x, stats):
        del x
        return _checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def checkpoint_with_offload(function: Callable, *args, **kwargs) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``,
    holding ``args[0]`` (the layer's hidden states) only in pinned host memory between the forward
    and the recomputation, with asynchronous copies and prefetch (module docstring).

    A drop-in ``gradient_checkpointing_func`` for transformers' decoder layers, which call
    ``func(partial(layer.forward, **kwargs), hidden_states)``; bind checkpoint options with
    ``functools.partial(checkpoint_with_offload, context_fn=..., ...)``, or use
    :func:`offload_checkpoints`.

    Arguments:
        function: callable. The layer's forward, called as ``function(*args, **fn_kwargs)``.
        args: ``args[0]``: floating-point tensor, the hidden states (any shape); the rest is passed
            through (tensors among them are kept on their device, as plain checkpointing does).
        kwargs: ``torch.utils.checkpoint.checkpoint`` options (``context_fn``,
            ``preserve_rng_state``, ``determinism_check``, ``debug``, ``early_stop``), e.g.
            :func:`hf_flash.gradient_checkpointing_kwargs`'s; other keywords go to ``function``
            as checkpoint passes them. ``use_reentrant`` must be False (the default here).

    Return: what ``function`` returns. Without gradients (``torch.no_grad``, eval) nothing is
    offloaded and nothing is kept.

    Raises TypeError when ``args[0]`` is missing or not a floating-point tensor, ValueError for
    ``use_reentrant=True``. On the CPU the same path runs with plain copies.

    An ``args[0]`` that is a leaf requiring grad stays on the device (the graph holds it anyway).
    Assumes ``function`` does not write into ``args[0]`` in place (the copy to host runs while
    the layer computes); transformers' decoder layers do not.
    """
    return _checkpoint_offloaded(function, args, kwargs, None)


class _OffloadingCheckpoint:
    """The ``gradient_checkpointing_func`` that :func:`offload_checkpoints` installs: checkpoint
    options bound, bytes counted into ``stats``."""

    def __init__(self, checkpoint_kwargs: dict, stats: OffloadStats) -> None:
        self.checkpoint_kwargs = checkpoint_kwargs
        self.stats = stats

    def __call__(self, function, *args, **kwargs):
        kwargs = {**self.checkpoint_kwargs, **kwargs}
        return _checkpoint_offloaded(function, args, kwargs, self.stats)


# --------------------------------------------------------------------------------------------
# On a transformers model
# --------------------------------------------------------------------------------------------


def _base_model(model):
    get_base = getattr(model, "get_base_model", None)  # peft
    return get_base() if callable(get_base) else model


def _detach_leaf_output(module, args, output):
    if isinstance(output, torch.Tensor) and output.is_leaf and output.requires_grad:
        return output.detach()
    return None


def offload_checkpoints(model, checkpoint_kwargs: Optional[dict] = None) -> OffloadStats:
    """Switch on transformers' activation checkpointing for ``model`` with every checkpointed
    decoder layer's input held in pinned host memory (:func:`checkpoint_with_offload`).

    Arguments:
        model: a transformers ``PreTrainedModel``, or a peft model wrapping one.
        checkpoint_kwargs: dict or None. ``torch.utils.checkpoint.checkpoint`` options, e.g.
            ``hf_flash.gradient_checkpointing_kwargs(keep_attention=True)``. ``use_reentrant``
            must be False. Default None (plain non-reentrant checkpointing).

    Return: :class:`OffloadStats`: the number of layers, and the bytes the last forward pass
    offloaded (updated as the model runs).

    Checkpointing is switched on the usual way first
    (:func:`hf_flash.enable_activation_checkpointing`: ``activation_checkpointing_enable``, or
    ``gradient_checkpointing_enable`` before 5.23). Under peft, transformers then makes the
    embedding output require grad (a leaf of the graph, which would keep the first layer's input
    on the device); a forward hook on the input embeddings undoes that (the non-reentrant
    checkpoint does not need it). Then each checkpointed layer's ``_gradient_checkpointing_func``
    is replaced, and the module that runs the layers gets a forward pre-hook marking where a
    forward pass starts (for the prefetch order). Calling it again replaces the previous set-up.
    :func:`unoffload_checkpoints` undoes it.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    from ..checkpointing import enable_activation_checkpointing

    base = _base_model(model)
    if getattr(base, _STATE_ATTR, None) is not None:
        unoffload_checkpoints(base)
    kwargs = {"use_reentrant": False, **(checkpoint_kwargs or {})}
    if kwargs["use_reentrant"] is not False:
        raise ValueError(
            f"offload_checkpoints: use_reentrant={kwargs['use_reentrant']!r} is not supported; "
            f"offload needs the non-reentrant checkpoint. Pass use_reentrant=False or leave it out"
        )
    enable_activation_checkpointing(base, kwargs)
    # Under peft, transformers makes the embedding output require grad (for the reentrant
    # checkpoint, which needs a differentiable input; its hooks stack up when enabled twice).
    # That output is then a leaf, held by the graph until the backward, so the first layer's
    # input could not leave the device. The non-reentrant checkpoint does not need it (the LoRA
    # gradients are the same bits without): a hook after theirs hands on a detached output.
    hooks = []
    embeddings = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    if isinstance(embeddings, torch.nn.Module):
        hooks.append(embeddings.register_forward_hook(_detach_leaf_output))
    stats = OffloadStats()
    func = _OffloadingCheckpoint(kwargs, stats)
    replaced = []
    for module in base.modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            replaced.append((module, module.__dict__.get("_gradient_checkpointing_func")))
            module._gradient_checkpointing_func = func
    if not replaced:
        raise ValueError(
            f"offload_checkpoints: {type(base).__name__} has no checkpointed decoder layers "
            f"(transformers GradientCheckpointingLayer) after enabling activation checkpointing; "
            f"this model's layers cannot offload their inputs"
        )
    stats.layers = len(replaced)

    def start_step(module, args):
        if torch.is_grad_enabled() and module.training:
            _begin_step()
            stats._start_step()

    layer_ids = {id(m) for m, _ in replaced}
    for module in base.modules():
        runs_layers = any(
            isinstance(child, torch.nn.ModuleList) and any(id(c) in layer_ids for c in child)
            for child in module.children()
        )
        if runs_layers:
            hooks.append(module.register_forward_pre_hook(start_step))
    object.__setattr__(base, _STATE_ATTR, (replaced, hooks, stats))
    return stats


def unoffload_checkpoints(model) -> int:
    """Undo :func:`offload_checkpoints`: the layers go back to the checkpoint function they had
    (plain checkpointing with the same options) and its hooks are removed. Checkpointing stays
    on (``model.gradient_checkpointing_disable()`` switches it off). Returns the number of layers
    restored (0 when offload was not on)."""
    base = _base_model(model)
    state = base.__dict__.get(_STATE_ATTR)
    if state is None:
        return 0
    replaced, hooks, stats = state
    for module, previous in replaced:
        if previous is None:
            module.__dict__.pop("_gradient_checkpointing_func", None)
        else:
            module._gradient_checkpointing_func = previous
    for hook in hooks:
        hook.remove()
    del base.__dict__[_STATE_ATTR]
    stats.layers = 0
    return len(replaced)
