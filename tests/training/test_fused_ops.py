"""Liger-Kernel's RMSNorm and SwiGLU through hf_flash.training (fused_ops, enable, the planner).

Liger's kernels need CUDA (they do not run in Triton's interpreter), so here the wiring is checked
with stand-ins for Liger's two functions that record their arguments and compute transformers'
formulas: the patched model must give the unpatched model's loss exactly and its gradients to
float32 rounding, which fails if an argument (eps, weight, gate/up order) is passed wrong. tests/training/
test_training_gpu.py runs Liger's real kernels against the unfused model with the error rule.
"""

from __future__ import annotations

import pytest
import torch
from memory_models import batch, step, tiny_lora_model

from hf_flash.training import enable, liger_problem, unuse_liger, use_liger
from hf_flash.training.plan import make_plan, predict

pytest.importorskip("liger_kernel")


class _FakeRMSNorm(torch.autograd.Function):
    calls: list = []

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, in_place, row_mode):
        _FakeRMSNorm.calls.append((eps, offset, casting_mode, in_place, row_mode))
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            x32 = xd.float()
            y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        ctx.save_for_backward(xd, y)
        return y.detach()

    @staticmethod
    def backward(ctx, dy):
        xd, y = ctx.saved_tensors
        (dx,) = torch.autograd.grad(y, xd, dy)
        return dx, None, None, None, None, None, None


class _FakeSiLUMul(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, gate, up):
        _FakeSiLUMul.calls += 1
        with torch.enable_grad():
            g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
            out = torch.nn.functional.silu(g) * u
        ctx.save_for_backward(g, u, out)
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        g, u, out = ctx.saved_tensors
        return torch.autograd.grad(out, (g, u), dout)


@pytest.fixture
def fake_liger(monkeypatch):
    import liger_kernel.ops as ops

    monkeypatch.setattr(ops, "LigerRMSNormFunction", _FakeRMSNorm)
    monkeypatch.setattr(ops, "LigerSiLUMulFunction", _FakeSiLUMul)
    _FakeRMSNorm.calls, _FakeSiLUMul.calls = [], 0


def test_patched_forwards_call_liger_with_the_models_arguments(fake_liger):
    model = tiny_lora_model("eager")
    inputs = batch()
    ref = step(model, inputs)
    counts = use_liger(model, device="cuda")  # the device check only: the stand-ins run on CPU
    # 2 layers x (input, post-attention) norms + the final norm; one MLP per layer
    assert counts == {"rms_norm": 5, "swiglu": 2}
    got = step(model, inputs)
    eps = model.config.rms_norm_eps
    assert len(_FakeRMSNorm.calls) == 5 and _FakeSiLUMul.calls == 2
    assert set(_FakeRMSNorm.calls) == {(eps, 0.0, "llama", True, None)}
    # the same float32 operations; only the order in which autograd adds a norm input's two
    # gradient paths differs (one node here, several in transformers'), so equal to rounding
    assert torch.equal(ref[0], got[0])
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], msg=name)
    assert use_liger(model, device="cuda") == counts  # again: nothing doubles
    assert unuse_liger(model) == 7 and unuse_liger(model) == 0
    _FakeRMSNorm.calls = []
    step(model, inputs)
    assert _FakeRMSNorm.calls == []


def test_liger_then_tiled_mlp_tiles_the_fused_forward(fake_liger):
    from hf_flash.training import tile_mlp, untile_mlp

    model = tiny_lora_model("eager")
    inputs = batch(seq=64)
    ref = step(model, inputs)
    use_liger(model, swiglu=True, rms_norm=False, device="cuda")
    tile_mlp(model, 48)  # 2 rows x 64 tokens: 3 chunks per MLP
    got = step(model, inputs)
    # per layer: 3 chunks in the forward, 3 again in the backward's recomputation
    assert _FakeSiLUMul.calls == 2 * 6
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-6)
    untile_mlp(model)
    unuse_liger(model)


def test_problems_are_named_before_anything_changes(monkeypatch):
    from transformers import AutoModelForCausalLM, GemmaConfig

    model = tiny_lora_model("eager")
    assert "CUDA" in liger_problem(model)  # on the CPU
    with pytest.raises(RuntimeError, match="use_liger: Liger-Kernel's kernels need a CUDA device"):
        use_liger(model)
    gemma = AutoModelForCausalLM.from_config(GemmaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=128))  # fmt: skip
    assert "'gemma' is not one whose RMSNorm and MLP are Llama's" in liger_problem(gemma, "cuda")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "liger_kernel" else real(n, *a))
    assert "liger-kernel is not installed" in liger_problem(model, "cuda")
    # enable: required -> the error; auto -> off, with the reason among the plan's notes
    with pytest.raises(RuntimeError, match="liger=True: liger-kernel is not installed"):
        enable(model, seq_len=64, liger=True, device="cuda", device_budget_gib=10, log=None)
    assert not any("_hf_flash" in k for m in model.modules() for k in m.__dict__)


def test_enable_auto_on_cpu_leaves_liger_off_and_says_why():
    model = tiny_lora_model("eager")
    plan = enable(model, seq_len=64, log=None)
    assert plan.liger == ()
    assert any("Liger-Kernel's RMSNorm and SwiGLU not used" in n and "CUDA" in n for n in plan.notes)
    assert "liger=off" in plan.describe()


def test_planner_counts_what_liger_removes():
    """Without the norms' float32 copies (4 bytes x hidden per token, two norms per layer) and the
    SwiGLU activation (a x intermediate per token of the MLP's chunk), the predicted peak drops
    by exactly those bytes (plus the planner's 10% slack)."""
    from test_enable import LLAMA3_8B as shape

    tokens, chunk = 393216, 8192
    args = dict(checkpointing="offload", chunked_loss=True, tiled_mlp_tokens=chunk, act_bytes=2)
    plain, _ = predict(shape, tokens, **args)
    fused, _ = predict(shape, tokens, fused_norm=True, fused_swiglu=True, **args)
    saved = (tokens * 2 * 4 * shape.hidden + chunk * 2 * shape.intermediate) * 1.10 / 2**30
    assert plain - fused == pytest.approx(saved, rel=1e-9)
    plan = make_plan(shape, tokens, act_bytes=2, device_budget_gib=79.0, liger=("rms_norm", "swiglu"))
    assert plan.liger == ("rms_norm", "swiglu") and plan.device_gib == pytest.approx(fused)
