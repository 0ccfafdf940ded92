"""RoPE scaling maths against transformers' ROPE_INIT_FUNCTIONS and hand-computed values, and
extend_context on configs and live models."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from hf_flash import rope_scaling as rope  # noqa: E402
from hf_flash.rope_scaling import (  # noqa: E402
    dynamic_ntk_rope,
    extend_context,
    linear_rope,
    llama3_rope,
    ntk_rope,
    yarn_rope,
)

EPS32 = torch.finfo(torch.float32).eps


def _hf_bound(base):
    # transformers evaluates base ** (2i / dim) in float32: the rounded exponent's relative error
    # (eps) is amplified by ln(base), plus the roundings of the power and the division
    return (math.log(base) + 3) * EPS32


def _config(rope_parameters, head_dim=64, max_pos=32768):
    return LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=max_pos, rope_parameters=rope_parameters, num_hidden_layers=1,
        intermediate_size=64, vocab_size=64,
    )  # fmt: skip


CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096},
    "yarn-opts": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048,
                  "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "mscale": 1.0, "mscale_all_dim": 0.707},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
}  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case, head_dim):
    base = 500000.0
    rp = dict(CASES[case], rope_theta=base)
    cfg = _config(rp, head_dim, max_pos=rp.get("original_max_position_embeddings", 4096) * int(rp["factor"]))
    seq_lens = [None, 100_000, 3 * cfg.max_position_embeddings] if case == "dynamic" else [None]
    for seq_len in seq_lens:
        kw = {} if seq_len is None else {"seq_len": seq_len}
        ref, ref_factor = ROPE_INIT_FUNCTIONS[rp["rope_type"]](cfg, None, **kw)
        ours, factor = rope.inv_freq_for_config(cfg, seq_len)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape == (head_dim // 2,)
        rel = ((ours.double() - ref.double()).abs() / ref.double()).max().item()
        assert rel <= _hf_bound(base), f"{case} seq_len={seq_len}: relative error {rel:.3g}"
        assert factor == pytest.approx(ref_factor, rel=1e-12)


def test_hand_computed_small_dim():
    # d = 4, base 10000: theta = (1, 1/100)
    inv, f = linear_rope(4, 10000.0, 2.0)
    assert torch.allclose(inv, torch.tensor([0.5, 0.005]), rtol=EPS32) and f == 1.0
    # static NTK: base' = 10000 * 4 ** (4 / 2) = 160000, theta_1 = 160000 ** -0.5 = 1/400
    inv, _ = ntk_rope(4, 10000.0, 4.0)
    assert torch.allclose(inv, torch.tensor([1.0, 0.0025]), rtol=EPS32)
    # dynamic NTK at n = 300, L = 100, s = 2: scale 2 * 3 - 1 = 5, base' = 10000 * 25
    inv, _ = dynamic_ntk_rope(4, 10000.0, 2.0, 100, 300)
    assert torch.allclose(inv, torch.tensor([1.0, 0.002]), rtol=EPS32)
    inv_short, _ = dynamic_ntk_rope(4, 10000.0, 2.0, 100, 50)  # no change up to L
    assert torch.allclose(inv_short, torch.tensor([1.0, 0.01]), rtol=EPS32)
    # YaRN, d = 8, base 10000 -> theta = (1, .1, .01, .001); L = 2048 gives (326, 32.6, 3.3, .33)
    # turns; low = floor(8 ln(2048 / 64 pi) / 2 ln 1e4) = 1, high = ceil(8 ln(2048 / 2 pi) /
    # 2 ln 1e4) = 3, ramp = (0, 0, 1/2, 1); s = 4
    inv, f = yarn_rope(8, 10000.0, 4.0, 2048)
    want = torch.tensor([1.0, 0.1, 0.5 * 0.01 + 0.5 * 0.01 / 4, 0.001 / 4])
    assert torch.allclose(inv, want, rtol=4 * EPS32)
    assert f == pytest.approx(0.1 * math.log(4) + 1, rel=1e-15)
    # Llama 3, d = 8, base 1e4, L = 8192, s = 8: wavelengths 2 pi / theta = (6.3, 63, 628, 6283);
    # the first three are < L / 4 (kept), the last lies in [L/4, L]: a = (8192/6283.19 - 1) / 3
    inv, f = llama3_rope(8, 10000.0, 8.0, 8192)
    a = (8192 / (2 * math.pi * 1000) - 1) / 3
    want = torch.tensor([1.0, 0.1, 0.01, (1 - a) * 0.001 / 8 + a * 0.001])
    assert torch.allclose(inv, want, rtol=4 * EPS32) and f == 1.0
    inv, _ = llama3_rope(8, 10000.0, 8.0, 4096)  # L = 4096: 6283 > L, divided by s
    assert inv[3].item() == pytest.approx(0.001 / 8, rel=4 * EPS32)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: linear_rope(4, 10000.0, 1.0), ValueError, "factor=1.0"),
        (lambda: ntk_rope(5, 10000.0, 2.0), ValueError, "even int"),
        (lambda: yarn_rope(8, 10000.0, 2.0, 64, beta_fast=1, beta_slow=2), ValueError, "beta_fast"),
        (lambda: llama3_rope(8, 1.0, 2.0, 64), ValueError, "base"),
        (lambda: linear_rope(4, 10000.0, "2"), TypeError, "number"),
    ],
    ids=["factor1", "odd-dim", "betas", "base", "factor-type"],
)
def test_maths_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("method", ["yarn", "linear", "ntk", "dynamic", "llama3"])
def test_extend_context_live_model(method):
    torch.manual_seed(0)
    cfg = _config({"rope_type": "default", "rope_theta": 10000.0}, head_dim=16, max_pos=64)
    model = LlamaForCausalLM(cfg).eval()
    assert extend_context(model, 256, method=method) is model
    rp = cfg.rope_parameters
    assert rp["rope_type"] == rope.METHODS[method] and rp["factor"] == 4.0
    assert cfg.max_position_embeddings == (64 if method == "dynamic" else 256)
    rot = model.model.rotary_emb
    ours, scaling = rope.inv_freq_for_config(cfg)
    assert torch.allclose(rot.inv_freq, ours, rtol=_hf_bound(10000.0), atol=0)
    assert rot.attention_scaling == pytest.approx(scaling)
    if method == "yarn":
        assert scaling == pytest.approx(0.1 * math.log(4) + 1)
    # the config survives a save/load round trip and still validates
    again = LlamaConfig.from_dict(cfg.to_dict())
    assert again.rope_parameters["rope_type"] == rp["rope_type"]
    ids = torch.randint(0, 64, (1, 300))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()


def test_ntk_static_is_not_dynamic():
    """transformers recomputes frequencies per forward for rope types containing 'dynamic'."""
    cfg = _config({"rope_type": "default", "rope_theta": 10000.0}, head_dim=16, max_pos=64)
    model = LlamaForCausalLM(cfg).eval()
    extend_context(model, 128, method="ntk")
    rot = model.model.rotary_emb
    before = rot.inv_freq.clone()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 400)))
    assert torch.equal(rot.inv_freq, before)
    assert "dynamic" not in rope.NTK_STATIC_ROPE_TYPE
    assert ROPE_INIT_FUNCTIONS[rope.NTK_STATIC_ROPE_TYPE] is rope._ntk_static_init


def test_extend_context_retarget_and_errors():
    cfg = _config({"rope_type": "default", "rope_theta": 10000.0}, head_dim=16, max_pos=64)
    with pytest.raises(ValueError, match="must exceed"):
        extend_context(cfg, 32)
    with pytest.raises(ValueError, match="must exceed"):
        extend_context(cfg, 64)
    with pytest.raises(ValueError, match="unknown method"):
        extend_context(cfg, 128, method="rope-magic")
    with pytest.raises(ValueError, match="factor"):
        extend_context(cfg, 128, factor=0.5)
    with pytest.raises(TypeError, match="unexpected options"):
        extend_context(cfg, 128, method="linear", beta_fast=3)
    assert cfg.rope_parameters["rope_type"] == "default"  # untouched by refused requests
    extend_context(cfg, 128, method="yarn", beta_fast=16)
    assert cfg.rope_parameters["beta_fast"] == 16.0
    # re-target from the recorded original length
    extend_context(cfg, 512, method="yarn")
    assert cfg.rope_parameters["factor"] == 8.0
    assert cfg.rope_parameters["original_max_position_embeddings"] == 64
    with pytest.raises(ValueError, match="already uses rope_type 'yarn'"):
        extend_context(cfg, 1024, method="llama3")
    with pytest.raises(TypeError, match="PreTrainedConfig"):
        extend_context({"rope_theta": 1}, 128)
