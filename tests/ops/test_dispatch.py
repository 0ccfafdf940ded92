"""Eager calls launch the kernels without the custom ops' dispatch; tracers and dispatch modes
still get the custom ops.

In plain eager autograd, attention and rotary run through ``torch.autograd.Function``s that call
the same kernels as the ops ``hf_flash::attn_fwd`` / ``hf_flash::rotary`` (the ops' Python
dispatch cost ~0.3-0.5 ms of host time per call on the H100, a large part of a host-bound 4K
LoRA step). Under any TorchDispatchMode (selective checkpointing, fake tensors) the op must be
used, since the mode sees ops only. Both routes must give bit-identical outputs and gradients.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_flash import flash_attn_func, interface, rotary


class _Passthrough(TorchDispatchMode):
    """Sees every op and runs it unchanged: the situation of a checkpointing policy."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("use", ["out", "lse", "both"])
def test_attention_eager_path_skips_the_op_and_equals_it(use, monkeypatch, device):
    torch.manual_seed(0)
    base = [torch.randn(2, 24, h, 16, device=device) for h in (4, 2, 2)]
    g = torch.randn(2, 24, 4, 16, device=device)
    op_fwd = _counting(monkeypatch, interface, "_attn_fwd_op")
    op_bwd = _counting(monkeypatch, interface, "_attn_bwd_op")

    def run(mode):
        q, k, v = _leaves(*base)
        with mode if mode is not None else contextlib.nullcontext():
            out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        loss = {"out": (out * g).sum(), "lse": lse.sum(), "both": (out * g).sum() + lse.sum()}[use]
        loss.backward()
        return [out, lse, q.grad, k.grad, v.grad]

    direct = run(None)
    assert op_fwd == [] and op_bwd == [], "plain eager autograd went through the custom ops"
    mode = _Passthrough()
    via_op = run(mode)
    assert "hf_flash.attn_fwd.default" in mode.ops, mode.ops
    assert len(op_fwd) == 1
    for a, b in zip(direct, via_op):
        assert torch.equal(a, b)


def test_attention_no_grad_and_inference_skip_the_op(monkeypatch, device):
    op_fwd = _counting(monkeypatch, interface, "_attn_fwd_op")
    q, k, v = (torch.randn(1, 20, h, 16, device=device) for h in (2, 1, 1))
    with torch.no_grad():
        a = flash_attn_func(q, k, v, causal=True)
    with torch.inference_mode():
        b = flash_attn_func(q, k, v, causal=True)
    assert op_fwd == [] and torch.equal(a, b)


def test_rotary_eager_path_skips_the_op_and_equals_it(monkeypatch, device):
    torch.manual_seed(1)
    q0, k0 = torch.randn(2, 4, 9, 16, device=device), torch.randn(2, 2, 9, 16, device=device)
    ang = torch.randn(1, 9, 8, device=device)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    gq, gk = torch.randn_like(q0), torch.randn_like(k0)
    op = _counting(monkeypatch, rotary, "_rotary_op")

    def run(mode, only_q=False):
        q, k = _leaves(q0, k0)
        with mode if mode is not None else contextlib.nullcontext():
            qo, ko = rotary.apply_rotary_pos_emb(q, k, cos, sin)
        loss = (qo * gq).sum() + (0 if only_q else (ko * gk).sum())
        loss.backward()
        return [qo, ko, q.grad, torch.zeros_like(k0) if k.grad is None else k.grad]

    for only_q in (False, True):
        op.clear()
        direct = run(None, only_q)
        assert op == [], "plain eager autograd went through hf_flash::rotary"
        via_op = run(_Passthrough(), only_q)
        assert op, "a dispatch mode must see hf_flash::rotary"
        for a, b in zip(direct, via_op):
            assert torch.equal(a, b)


def test_hopper_forward_rule(monkeypatch):
    """The Gluon forward may run only on a compute-capability 9.0 GPU, outside the interpreter,
    while switched on, and never while a tile override (a Triton sweep) is in force."""
    from hf_flash.kernels import configs

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(configs, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "_HOPPER", True)
    assert configs.hopper_enabled(gpu)
    assert not configs.hopper_enabled(torch.device("cpu"))
    with configs.use_hopper(False):
        assert not configs.hopper_enabled(gpu)
    assert configs.hopper_enabled(gpu)
    with configs.override(fwd={"BLOCK_M": 64}):
        assert not configs.hopper_enabled(gpu)
    for capability in ((8, 0), (10, 0), (12, 0)):
        monkeypatch.setattr(configs, "_capability", lambda device, c=capability: c)
        assert not configs.hopper_enabled(gpu), capability
    monkeypatch.setattr(configs, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "interpreting", lambda: True)
    assert not configs.hopper_enabled(gpu)


def test_hopper_kernels_need_the_triton_release_they_are_written_for(monkeypatch):
    """Gluon's API moves between Triton releases: with another release the Triton kernels run,
    and a warning says so once."""
    import triton

    from hf_flash.kernels import configs

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(configs, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "_HOPPER", True)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert configs.hopper_enabled(gpu)
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    monkeypatch.setattr(configs, "_GLUON_NOTE_SHOWN", False)
    with pytest.warns(UserWarning, match="written for Triton 3.6"):
        assert not configs.hopper_enabled(gpu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not configs.hopper_enabled(gpu)  # said once


def test_attention_paths_without_a_hopper_gpu(device):
    """Every call runs the Triton kernels here (the CPU interpreter, or any non-sm_90 GPU)."""
    from hf_flash.interface import attention_paths
    from hf_flash.kernels import configs

    q = torch.randn(1, 32, 4, 128, device=device, dtype=torch.float16)
    k = torch.randn(1, 32, 2, 128, device=device, dtype=torch.float16)
    paths = attention_paths(q, k, k, causal=True)
    expected = "hopper" if configs.hopper_enabled(q.device) else "triton"
    assert paths == {"forward": expected, "backward": expected}
    assert attention_paths(q, k, k, causal=True, varlen=True) == {"forward": "triton", "backward": "triton"}


def test_attention_variants_name_the_gluon_forms(monkeypatch):
    """attention_variants names the Gluon forms a call runs (benchmark rows record them): by
    query length for dense calls, by head dim for packed ones, the windowed call's form with a
    window, none where a pass runs Triton. The paths are forced here (no Hopper GPU on the CPU)."""
    from hf_flash import interface
    from hf_flash.kernels import configs
    from hf_flash.kernels.hopper import attention_bwd, attention_dq, attention_fwd

    forced = {"forward": "hopper", "backward": "hopper"}
    monkeypatch.setattr(interface, "attention_paths", lambda *a, **kw: dict(forced))
    q, k = torch.empty(4, 4096, 32, 128), torch.empty(4, 4096, 8, 128)
    got = interface.attention_variants(q, k, k)
    assert got == {"forward": attention_fwd.default_variant(128, False, seqlen_q=4096),
                   "backward": attention_bwd.variant_for(128, False, seqlen_q=4096), "dq": None}  # fmt: skip
    assert attention_fwd.VARIANTS[got["forward"]].carry  # the length decides: 4K non-causal d128
    long = interface.attention_variants(torch.empty(1, 16384, 32, 128), k[:1], k[:1])
    assert not attention_fwd.VARIANTS[long["forward"]].carry
    windowed = interface.attention_variants(q, k, k, causal=True, window_size=(4095, 0))
    assert windowed["forward"] == attention_fwd.DEFAULT[(128, True)]
    packed = interface.attention_variants(torch.empty(16384, 32, 128), k[0], k[0], causal=True, varlen=True)
    assert packed["forward"] == attention_fwd.VARLEN_DEFAULT[(128, True)]
    # the packed causal backward computes dK/dV only: the dQ kernel's variant is named beside it
    assert not attention_bwd.VARIANTS[packed["backward"]].dq_atomic
    assert packed["dq"] == attention_dq.DEFAULT[128]
    forced["forward"] = "triton"
    assert interface.attention_variants(q, k, k)["forward"] is None
    forced.update(forward="hopper", backward="triton")
    assert interface.attention_variants(q, k, k)["backward"] is None
    assert interface.attention_variants(torch.empty(16384, 32, 128), k[0], k[0], varlen=True)["dq"] is None
    # soft-capped d128 calls run the Triton dK/dV kernel and, on a Hopper GPU, the Gluon dQ beside
    # it (d64 ones the Triton dQ)
    monkeypatch.setattr(configs, "hopper_enabled", lambda device: True)
    monkeypatch.setattr(attention_fwd, "supports", lambda *a, alibi=None, **kw: alibi is None)
    for d, dq in ((128, attention_dq.DEFAULT[128]), (64, None)):
        qd, kd = torch.empty(4, 4096, 32, d), torch.empty(4, 4096, 8, d)
        capped = interface.attention_variants(qd, kd, kd, causal=True, softcap=30.0)
        assert capped["backward"] is None and capped["dq"] == dq, (d, capped)
    assert interface.attention_variants(q, k, k, causal=True, softcap=30.0, alibi_slopes=torch.ones(32))["dq"] is None
