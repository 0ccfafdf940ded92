"""hf_flash.checkpointing without transformers: torch.utils.checkpoint around hf_flash attention
keeps the attention forward's outputs (the kernel runs once, not twice), the gradients are the
ones of plain checkpointing and of no checkpointing, dropout included, and bad options fail.

The kernel launches are counted by wrapping the launchers the custom ops call
(``hf_flash.kernels.flash_fwd.flash_attn_forward`` / ``flash_bwd.flash_attn_backward``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import hf_flash
import hf_flash.checkpointing as hc


class _Block(torch.nn.Module):
    """A pre-norm attention block: what a decoder layer does around the attention op."""

    def __init__(self, dim=32, heads=4, kv_heads=2, dropout=0.0, packed=None):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.hd)
        self.out = torch.nn.Linear(heads * self.hd, dim)
        self.dropout = dropout
        self.packed = packed  # (cu_seqlens, max_seqlen): varlen attention over one row

    def forward(self, x):
        b, s, _ = x.shape
        h = torch.nn.functional.layer_norm(x, x.shape[-1:])
        q, k, v = self.qkv(h).split(
            [self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], dim=-1
        )
        q = q.view(b, s, self.heads, self.hd)
        k = k.view(b, s, self.kv_heads, self.hd)
        v = v.view(b, s, self.kv_heads, self.hd)
        if self.packed is None:
            o = hf_flash.flash_attn_func(q, k, v, dropout_p=self.dropout, causal=True)
        else:
            cu, m = self.packed
            o = hf_flash.flash_attn_varlen_func(
                q[0], k[0], v[0], cu, cu, m, m, dropout_p=self.dropout, causal=True
            ).unsqueeze(0)
        return x + self.out(o.reshape(b, s, -1))


def _grads(blocks, x, mode, seed=0):
    """Gradients of all parameters and of x after one step; mode: none, plain or keep."""
    for blk in blocks:
        blk.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    h = x
    for blk in blocks:
        if mode == "none":
            h = blk(h)
        else:
            kwargs = hf_flash.gradient_checkpointing_kwargs(keep_attention=mode == "keep")
            h = checkpoint(blk, h, **kwargs)
    (h.float() ** 2).mean().backward()
    return [x.grad] + [p.grad for blk in blocks for p in blk.parameters()]


def _blocks(device, n=2, **kwargs):
    torch.manual_seed(0)
    return [_Block(**kwargs).to(device) for _ in range(n)]


PACKED_CU = torch.tensor([0, 7, 12, 20], dtype=torch.int32)


@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_attention_forward_runs_once_per_layer_with_kept_outputs(layout, launches, device):
    packed = (PACKED_CU.to(device), 8) if layout == "packed" else None
    blocks = _blocks(device, packed=packed)
    x = torch.randn(1, 20, 32, device=device)
    counts = {}
    grads = {}
    for mode in ("none", "plain", "keep"):
        launches.update(fwd=0, bwd=0)
        grads[mode] = _grads(blocks, x, mode)
        counts[mode] = dict(launches)
    # two layers: forward once each; plain checkpointing runs it again in backward
    assert counts == {
        "none": {"fwd": 2, "bwd": 2},
        "plain": {"fwd": 4, "bwd": 2},
        "keep": {"fwd": 2, "bwd": 2},
    }
    # The kept tensors are what the recomputation would have produced (same deterministic
    # kernels on bitwise equal inputs), so the gradients are identical, not merely close.
    for name in ("plain", "none"):
        for i, (a, b) in enumerate(zip(grads["keep"], grads[name])):
            assert torch.equal(a, b), f"grad {i}: keep vs {name}: {(a - b).abs().max().item():.3e}"


def test_dropout_is_replayed_exactly(launches, device):
    blocks = _blocks(device, dropout=0.25)
    x = torch.randn(2, 12, 32, device=device)
    grads = {mode: _grads(blocks, x, mode, seed=7) for mode in ("none", "plain", "keep")}
    for name in ("plain", "none"):
        for i, (a, b) in enumerate(zip(grads["keep"], grads[name])):
            assert torch.equal(a, b), f"grad {i}: keep vs {name}: {(a - b).abs().max().item():.3e}"
    # the dropout is live: another seed gives other gradients
    other = _grads(blocks, x, "keep", seed=8)
    assert not torch.equal(other[0], grads["keep"][0])


def test_policy_keeps_only_the_attention_forward():
    import hf_flash.interface  # noqa: F401  (registers the ops)
    import hf_flash.rotary  # noqa: F401

    policy = hc.attention_checkpoint_policy
    assert policy(None, torch.ops.hf_flash.attn_fwd.default) == CheckpointPolicy.MUST_SAVE
    for op in (torch.ops.hf_flash.attn_bwd.default, torch.ops.aten.mm.default,
               torch.ops.hf_flash.rotary.default):  # fmt: skip
        assert policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE


def test_kwargs():
    plain = {"use_reentrant": False}
    assert hf_flash.gradient_checkpointing_kwargs(keep_attention=False) == plain
    kw = hf_flash.gradient_checkpointing_kwargs(determinism_check="none")
    assert kw == {
        "use_reentrant": False,
        "determinism_check": "none",
        "context_fn": hf_flash.attention_checkpoint_context,
    }
    # reentrant checkpointing without keeping is the user's call, passed through untouched
    reentrant = hf_flash.gradient_checkpointing_kwargs(False, use_reentrant=True)
    assert reentrant == {"use_reentrant": True}


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"use_reentrant": True}, ValueError,
         r"use_reentrant=True cannot keep the attention outputs.*use_reentrant=False"),
        ({"preserve_rng_state": False}, ValueError,
         r"preserve_rng_state=False with keep_attention=True.*dropout"),
        ({"context_fn": lambda: None}, ValueError, r"context_fn is already given"),
        ({"keep_attention": 1}, TypeError, r"keep_attention must be a bool, got int"),
    ],
    ids=["reentrant", "no_rng_replay", "own_context_fn", "not_bool"],
)
def test_bad_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        hf_flash.gradient_checkpointing_kwargs(**kwargs)


def test_torch_without_selective_checkpointing_is_named(monkeypatch):
    monkeypatch.setattr(hc, "_CREATE_SAC", None)
    with pytest.raises(RuntimeError, match=r"selective activation checkpointing.*lacks"):
        hf_flash.gradient_checkpointing_kwargs()
    with pytest.raises(RuntimeError, match=r"keep_attention=False"):
        hc.attention_checkpoint_context()
    plain = {"use_reentrant": False}
    assert hf_flash.gradient_checkpointing_kwargs(keep_attention=False) == plain
