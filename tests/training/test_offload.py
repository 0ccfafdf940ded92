"""Checkpointed layer inputs held in host memory (hf_flash.training.offload), on the CPU.

On the CPU the same code path runs with plain copies in place of the side-stream ones, so what
these tests check holds there too: the layer inputs leave the (device) memory after the forward,
the recomputation gets them back in the order the backward needs them (each prefetched while
the layer after it is recomputed), and the loss and every LoRA gradient are bitwise equal to
plain checkpointing's (the copies are exact and every kernel sees the same bits).
tests/training/test_training_gpu.py checks device memory and stream use on a GPU."""

from __future__ import annotations

import pytest
import torch
from memory_models import assert_bitwise, batch, checkpointing, step, tiny_lora_model
from torch.multiprocessing.reductions import StorageWeakRef

from hf_flash.training import checkpoint_with_offload, offload_checkpoints, unoffload_checkpoints
from hf_flash.training import offload as offload_mod


@pytest.fixture
def boxes(monkeypatch):
    """Every _OffloadedInput made, by weak reference, and a log of prefetch / unpack calls."""
    import weakref

    made, log = [], []
    cls = offload_mod._OffloadedInput
    init, prefetch, unpack = cls.__init__, cls.prefetch, cls.unpack

    def tracked_init(self, x, step):
        init(self, x, step)
        made.append(weakref.ref(self))

    def tracked_prefetch(self):
        if self._fetched is None:
            log.append(("prefetch", self._index))
        prefetch(self)

    def tracked_unpack(self):
        log.append(("unpack", self._index))
        return unpack(self)

    monkeypatch.setattr(cls, "__init__", tracked_init)
    monkeypatch.setattr(cls, "prefetch", tracked_prefetch)
    monkeypatch.setattr(cls, "unpack", tracked_unpack)
    return made, log


@pytest.mark.parametrize("layers", [3])
def test_offload_is_bitwise_and_frees_layer_inputs(boxes, layers):
    model = tiny_lora_model("eager", layers=layers)
    inputs = batch()
    checkpointing(model)
    ref = step(model, inputs)

    stats = offload_checkpoints(model)
    assert stats.layers == layers
    inputs_seen = []
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, args: inputs_seen.append(StorageWeakRef(args[0].untyped_storage()))
        )
        for layer in model.get_base_model().model.layers
    ]
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    # every layer's input left the (device) memory; only the host copies remain
    assert len(inputs_seen) == layers and all(w.expired() for w in inputs_seen)
    rows, seq = inputs["input_ids"].shape
    assert stats.last_step_tensors == layers
    assert stats.last_step_bytes == layers * rows * seq * 64 * 4
    loss.backward()
    got = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    for h in hooks:
        h.remove()
    assert_bitwise(ref, got, "offload vs plain checkpointing")

    made, log = boxes
    # recomputed last layer first; each unpack prefetches the layer recomputed next, which then
    # finds its copy already made
    expected = [("unpack", layers - 1), ("prefetch", layers - 1)]  # nothing to prefetch it
    for i in range(layers - 1, 0, -1):
        expected += [("prefetch", i - 1), ("unpack", i - 1)]
    assert log == expected
    del loss, got
    assert all(b() is None for b in made), "host copies outlived the graph"

    assert unoffload_checkpoints(model) == layers
    made.clear()
    assert_bitwise(ref, step(model, inputs), "after unoffload_checkpoints")
    assert not made


def test_offload_with_keep_attention_is_bitwise(launches):
    """hf_flash attention with keep-attention selective checkpointing: the context_fn passes
    through, the attention forward kernel still runs once per layer, and the results are
    bitwise those of keep-attention checkpointing without offload."""
    model = tiny_lora_model("hf_flash")
    inputs = batch(rows=1)
    kwargs = checkpointing(model, keep_attention=True)
    ref = step(model, inputs)
    offload_checkpoints(model, kwargs)
    launches.update(fwd=0, bwd=0)
    got = step(model, inputs)
    assert launches == {"fwd": 2, "bwd": 2}
    assert_bitwise(ref, got, "offload + keep-attention vs keep-attention")


def test_two_forwards_then_two_backwards(boxes):
    model = tiny_lora_model("eager")
    a, b = batch(seed=1), batch(seed=2)
    checkpointing(model)
    made, log = boxes

    def both(m, check=None):
        m.zero_grad(set_to_none=True)
        loss_a = m(**a).loss
        loss_b = m(**b).loss
        if check:
            check()
        loss_b.backward()
        loss_a.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
        return torch.stack([loss_a.detach(), loss_b.detach()]), grads

    def each_forward_has_its_own_boxes():
        steps = [box()._step for box in made]
        assert len(steps) == 4 and steps[0] is steps[1] and steps[2] is steps[3]
        assert steps[0] is not steps[2]

    ref = both(model)
    offload_checkpoints(model)
    got = both(model, each_forward_has_its_own_boxes)
    assert_bitwise(ref, got, "two forwards, two backwards")
    # b's backward, then a's: each prefetch stays within its own forward pass
    assert log == [("unpack", 1), ("prefetch", 1), ("prefetch", 0), ("unpack", 0)] * 2
    assert all(box() is None for box in made)


def test_no_grad_and_eval_forwards_offload_nothing(boxes):
    model = tiny_lora_model("eager")
    inputs = batch()
    stats = offload_checkpoints(model)
    made, _ = boxes
    with torch.no_grad():
        model(**inputs)
    model.eval()
    model(**inputs)
    model.train()
    assert not made and stats.last_step_tensors == 0
    step(model, inputs)  # a training step offloads both layers' inputs and frees the copies
    assert len(made) == 2 and all(b() is None for b in made)
    with torch.no_grad():  # and a grad-free forward after it keeps nothing either
        model(**inputs)
    assert len(made) == 2 and stats.last_step_tensors == 2


def test_input_without_grad_and_extra_arguments():
    """A layer whose input does not require grad (only its weights do), called the way
    transformers calls the checkpoint function, with a second tensor argument and a keyword."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    scale = torch.randn(16)

    def fn(h, s, *, bias=0.0):
        return torch.tanh(layer(h) * s) + bias

    ref = torch.utils.checkpoint.checkpoint(fn, x, scale, bias=1.0, use_reentrant=False)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    got = checkpoint_with_offload(fn, x, scale, bias=1.0)
    assert got.requires_grad and not x.requires_grad
    got.sum().backward()
    assert torch.equal(ref, got)
    for r, g in zip(ref_grads, [p.grad for p in layer.parameters()]):
        assert torch.equal(r, g)

    # and the input's gradient when it does require grad
    xg = x.clone().requires_grad_()
    out = checkpoint_with_offload(fn, xg, scale, bias=1.0)
    (grad_x,) = torch.autograd.grad(out.sum(), xg)
    xr = x.clone().requires_grad_()
    (ref_x,) = torch.autograd.grad(fn(xr, scale, bias=1.0).sum(), xr)
    assert torch.equal(grad_x, ref_x)


def test_errors():
    fn = lambda h: h  # noqa: E731
    with pytest.raises(TypeError, match="args\\[0\\] must be the layer's floating-point hidden states, got a torch.int64 tensor"):
        checkpoint_with_offload(fn, torch.arange(4))
    with pytest.raises(TypeError, match="got NoneType"):
        checkpoint_with_offload(fn, None)
    with pytest.raises(TypeError, match="first positional argument, got none"):
        checkpoint_with_offload(fn)
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        checkpoint_with_offload(fn, torch.ones(2, requires_grad=True), use_reentrant=True)
    model = tiny_lora_model("eager")
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        offload_checkpoints(model, {"use_reentrant": True})
    assert unoffload_checkpoints(model) == 0
    with pytest.raises(ValueError, match="no checkpointed decoder layers"):
        offload_checkpoints(_NoLayers())


class _NoLayers(torch.nn.Module):
    supports_gradient_checkpointing = True

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
        pass


def test_host_pieces_are_powers_of_two_and_round_trip_exactly():
    """Layer inputs are held on the host in power-of-two pieces (the pinned allocator rounds each
    block up to one): 3 MiB + 10 bytes of bf16 is a 2 MiB piece, a 1 MiB piece and the rest."""
    from hf_flash.training.offload import MIN_PIECE_BYTES, _OffloadedInput, _Step, host_pieces

    numel = (3 * 2**20 + 10) // 2
    pieces = host_pieces(numel, 2)
    assert pieces == [2**20, 2**19, 5] and sum(pieces) == numel
    assert host_pieces(2**20, 4) == [2**20]  # a power of two: one piece
    assert host_pieces(7, 8) == [7]
    assert all(p * 8 <= MIN_PIECE_BYTES or (p * 8) & (p * 8 - 1) == 0 for p in host_pieces(10**7 + 3, 8))
    x = torch.randn(3, numel // 3 + 1, dtype=torch.float32).to(torch.bfloat16)[:, 1:]  # not contiguous
    held = _OffloadedInput(x, _Step())
    back = held.unpack()
    assert back.shape == x.shape and back.dtype == x.dtype and torch.equal(back, x)
