"""The tiled MLP (hf_flash.training.tiled_mlp), on the CPU.

Tiled and untiled MLPs run the same ops on different row blocks, so their results differ by
float summation order only: parameter gradients are sums of per-chunk products instead of one
product over all tokens. The comparisons therefore use docs/design.md's rule with a float64 run of
the same weights as the exact reference: the tiled float32 error must be at most 2x (loss) / 3x
(gradients) the untiled float32 error, plus the float32 floor.
"""

from __future__ import annotations

import pytest
import torch
from memory_models import assert_within_rule, batch, step, tiny_lora_model

from hf_flash.training import tile_mlp, untile_mlp


def _mlp_grad_fns(model, inputs) -> set:
    names = set()
    for layer in model.get_base_model().model.layers:
        layer.mlp.register_forward_hook(lambda m, a, out: names.add(type(out.grad_fn).__name__))
    model(**inputs)
    return names


@pytest.mark.parametrize("chunk", [24, 48], ids=["chunk24", "chunk48"])
def test_tiled_mlp_matches_untiled(chunk):
    """2 x 64 tokens in chunks of 24 or 48: neither divides the sequence, and the flattened
    chunks straddle the two rows."""
    inputs = batch()
    exact = step(tiny_lora_model("eager", torch.float64), inputs)
    model = tiny_lora_model("eager")
    lowp = step(model, inputs)
    assert tile_mlp(model, chunk) == 2
    assert _mlp_grad_fns(model, inputs) == {"_TiledMLPBackward"}
    got = step(model, inputs)
    assert_within_rule(exact, lowp, got, torch.float32, f"tiled MLP, chunk {chunk}")
    assert untile_mlp(model) == 2
    assert "_TiledMLPBackward" not in _mlp_grad_fns(model, inputs)
    again = step(model, inputs)
    assert torch.equal(again[0], lowp[0])


def test_tiled_mlp_under_autocast_recomputes_in_the_autocast_dtype():
    """CPU autocast to bfloat16: the backward's recomputation runs under the forward's autocast
    state (every projection returns bfloat16, in the forward and in the backward)."""
    model = tiny_lora_model("eager")
    inputs = batch()
    tile_mlp(model, 40)
    dtypes = []
    gate = model.get_base_model().model.layers[0].mlp.gate_proj.base_layer
    gate.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**inputs).loss
    loss.backward()
    # 128 tokens: 4 chunks in the forward, 4 again in the backward
    assert dtypes == [torch.bfloat16] * 8
    grads = [p.grad for n, p in model.named_parameters() if "mlp" in n and p.requires_grad]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_dropout_masks_replayed_in_backward():
    """peft lora_dropout=0.5: the backward redraws each chunk's masks from the RNG state the
    forward started from. Reference: the untiled MLP run chunk by chunk with autograd, from
    the same RNG state (so drawing the same masks)."""
    model = tiny_lora_model("eager", lora_dropout=0.5)
    mlp = model.get_base_model().model.layers[0].mlp
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(3))
    w = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(4))
    params = [p for p in mlp.parameters() if p.requires_grad]

    torch.manual_seed(11)
    xr = x.clone().requires_grad_()
    flat = xr.reshape(-1, 64)
    ref_out = torch.cat([mlp(flat[s:s + 32].unsqueeze(0)).squeeze(0) for s in range(0, 80, 32)])
    (ref_out.view(2, 40, 64) * w).sum().backward()
    ref = [xr.grad] + [p.grad.clone() for p in params]
    after_ref = torch.get_rng_state()

    mlp.zero_grad(set_to_none=True)
    tile_mlp(model, 32)
    torch.manual_seed(11)
    xt = x.clone().requires_grad_()
    out = mlp(xt)
    assert torch.equal(out, ref_out.view(2, 40, 64))  # the same masks in the forward
    after_forward = torch.get_rng_state()
    (out * w).sum().backward()
    assert torch.equal(torch.get_rng_state(), after_forward)  # the backward leaves the RNG alone
    assert torch.equal(after_forward, after_ref)
    got = [xt.grad] + [p.grad for p in params]
    for r, g in zip(ref, got):
        # the same per-chunk products; only the order of the sum over chunks may differ
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_half_parameters_sum_in_float32():
    """A full fine-tune in float16 (no LoRA): the parameter gradients come back in float16,
    summed over the chunks in float32, and meet the rule against float64 with the float16
    untiled MLP as the low-precision reference."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp64 = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=128)).double()
    x = torch.randn(3, 50, 64, dtype=torch.float64)
    g = torch.randn(3, 50, 64, dtype=torch.float64)

    def grads(module, dtype, chunk=None):
        m = type(module)(module.config).to(dtype)
        m.load_state_dict(module.state_dict())
        if chunk:
            holder = torch.nn.Module()
            holder.layers = torch.nn.ModuleList([_Layer(m)])
            tile_mlp(holder, chunk)
        xi = x.to(dtype).clone().requires_grad_()
        out = m(xi)
        (out * g.to(dtype)).sum().backward()
        return [out, xi.grad] + [p.grad for p in m.parameters()]

    exact, lowp, got = grads(mlp64, torch.float64), grads(mlp64, torch.float16), grads(mlp64, torch.float16, 16)
    from hf_flash.reference import FWD_FACTOR, GRAD_FACTOR, assert_close_to_ref

    assert all(t.dtype == torch.float16 for t in got)
    assert_close_to_ref("output", got[0], exact[0], lowp[0], FWD_FACTOR, torch.float16)
    for i, (e, lo, t) in enumerate(zip(exact[1:], lowp[1:], got[1:])):
        assert_close_to_ref(f"grad {i}", t, e, lo, GRAD_FACTOR, torch.float16)


class _Layer(torch.nn.Module):
    """Stands in for a decoder layer (class name ends in DecoderLayer)."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp


_Layer.__name__ = "TestDecoderLayer"


def test_short_inputs_and_no_grad():
    model = tiny_lora_model("eager")
    mlp = model.get_base_model().model.layers[0].mlp
    x = torch.randn(1, 20, 64)
    ref = mlp(x)
    tile_mlp(model, 32)
    out = mlp(x)  # one chunk: the original forward
    assert torch.equal(out, ref) and type(out.grad_fn).__name__ != "_TiledMLPBackward"
    x = torch.randn(2, 33, 64)
    ref = mlp.__class__.forward(mlp, x)
    with torch.no_grad():
        out = mlp(x)  # chunked, without autograd
    assert out.grad_fn is None
    torch.testing.assert_close(out, ref.detach(), rtol=1e-6, atol=1e-6)


def test_retile_untile_and_instance_forward():
    """An instance-level forward (as Liger-Kernel's SwiGLU patch installs) is wrapped and
    restored; tiling again changes the chunk size without wrapping twice."""
    model = tiny_lora_model("eager")
    mlps = [layer.mlp for layer in model.get_base_model().model.layers]
    calls = []
    for mlp in mlps:
        original = mlp.forward

        def fused(x, _orig=original):
            calls.append(x.shape[-2])
            return _orig(x)

        mlp.forward = fused
    patched = [mlp.__dict__["forward"] for mlp in mlps]
    assert tile_mlp(model, 50) == 2 and tile_mlp(model, 30) == 2
    mlps[0](torch.randn(1, 70, 64))
    assert calls == [30, 30, 10]
    assert untile_mlp(model) == 2
    assert [mlp.__dict__["forward"] for mlp in mlps] == patched
    assert untile_mlp(model) == 0


def test_errors():
    model = tiny_lora_model("eager")
    with pytest.raises(TypeError, match="chunk_tokens must be an int, got str"):
        tile_mlp(model, "8")
    with pytest.raises(TypeError, match="got bool"):
        tile_mlp(model, True)
    with pytest.raises(ValueError, match="chunk_tokens must be positive, got 0"):
        tile_mlp(model, 0)
    with pytest.raises(ValueError, match="found no MLP to tile in Linear"):
        tile_mlp(torch.nn.Linear(4, 4), 8)

    class TupleMLP(torch.nn.Module):
        def forward(self, x):
            return x, x

    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([_Layer(TupleMLP())])
    assert tile_mlp(holder, 4) == 1
    with pytest.raises(TypeError, match="TupleMLP.forward must map .* returned tuple"):
        holder.layers[0].mlp(torch.randn(1, 9, 8))
