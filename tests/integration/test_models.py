"""Tiny models of every supported family on attn_implementation="hf_flash" versus eager/sdpa.

Logits, losses and gradients follow hf_flash.reference's error rule against the same model in
float64 eager (see ``tiny_models.assert_model_close``); generation must equal sdpa token for
token in float32. On CPU the kernels run through Triton's interpreter in float32; the bfloat16
cases run on the GPU (``-m gpu``).
"""

from __future__ import annotations

import json

import pytest
import torch

import hf_flash
from hf_flash.reference import FWD_FACTOR, GRAD_FACTOR
from tiny_models import TINY_CONFIGS, VOCAB, assert_model_close, load

hf_flash.register()

FAMILY_IDS = list(TINY_CONFIGS)
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu),
]


def test_every_patched_family_has_a_tiny_model():
    """The families hf_flash patches are the ones these model tests run."""
    from hf_flash.integration.families import FAMILIES

    assert set(FAMILIES) <= set(TINY_CONFIGS)


def _trio(device, family, root, dtype):
    """(hf_flash model in dtype, eager in dtype, eager in float64)."""
    ours = load(family, "hf_flash", root, dtype=dtype, device=device)
    lowp = load(family, "eager", root, dtype=dtype, device=device)
    exact = load(family, "eager", root, dtype=torch.float64, device=device)
    return ours, lowp, exact


def _padded_batch(device):
    """Row 0 left-padded by 5, row 1 right-padded by 4. A label counts only when its token and
    the token predicting it are real (the logit at a pad position is never used)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, -4:] = 0
    counted = mask.bool().clone()
    counted[:, 1:] &= mask[:, :-1].bool()
    labels = ids.masked_fill(~counted, -100)
    return ids.to(device), mask.to(device), labels.to(device)


def _forward_backward(model, ids, mask, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _exact_rows(model, ids, mask, labels):
    """The float64 truth, each row run alone without its padding (eager in float64 turns fully
    masked pad rows into NaN, which then leaks through zero attention weights). Returns the
    logits at the real tokens in row order, the batch-mean loss and the gradients."""
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    logits, loss_sum = [], 0.0
    for r in range(ids.shape[0]):
        keep = mask[r].bool()
        pos = torch.arange(ids.shape[1], device=ids.device)[keep]
        out = model(input_ids=ids[r, keep][None], position_ids=pos[None])
        logits.append(out.logits[0])
        row_labels = labels[r, keep]
        loss_sum = loss_sum + F.cross_entropy(
            out.logits[0, :-1], row_labels[1:], ignore_index=-100, reduction="sum"
        )
    loss = loss_sum / (labels[:, 1:] != -100).sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits).detach(), loss.detach(), grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["dense", "padded", "unpadded"])
@pytest.mark.parametrize("family", FAMILY_IDS)
def test_logits_loss_grads_match_eager(family, mode, dtype, root, monkeypatch, device):
    """"padded" keeps the default use_cache (a cache is built, so every attention call cuts the
    padded rows into varlen segments); "unpadded" passes use_cache=False, so the unpad patch runs
    the decoder stack on the valid tokens only (checked: it must have unpadded, and the logits at
    padding positions are exactly zero)."""
    from hf_flash.integration import unpad_patch

    unpadded = []
    real_unpad = unpad_patch.unpad_inputs
    monkeypatch.setattr(unpad_patch, "unpad_inputs", lambda m: unpadded.append(real_unpad(m)) or unpadded[-1])
    ours, lowp, exact = _trio(device, family, root, dtype)
    ids, mask, labels = _padded_batch(device)
    padded = mode != "dense"
    if not padded:
        mask, labels = torch.ones_like(ids), ids
    kwargs = {"use_cache": False} if mode == "unpadded" else {}
    res = {name: _forward_backward(m, ids, mask if padded else None, labels, **kwargs)
           for name, m in (("ours", ours), ("lowp", lowp))}  # fmt: skip
    assert any(u is not None for u in unpadded) == (mode == "unpadded")
    res["exact"] = _exact_rows(exact, ids, mask, labels)
    valid = mask.bool()
    if mode == "unpadded":
        assert torch.equal(res["ours"][0][~valid], torch.zeros_like(res["ours"][0][~valid]))
    logits = {k: v[0] if k == "exact" else v[0][valid] for k, v in res.items()}
    assert_model_close("logits", logits["ours"], logits["exact"], logits["lowp"], FWD_FACTOR, dtype)
    assert_model_close(
        "loss", res["ours"][1], res["exact"][1], res["lowp"][1], FWD_FACTOR, dtype
    )
    grads = res["ours"][2]
    assert grads.keys() == res["exact"][2].keys()
    for name in grads:
        assert_model_close(
            f"grad {name}", grads[name], res["exact"][2][name], res["lowp"][2][name],
            GRAD_FACTOR, dtype,
        )  # fmt: skip


def _three_sequences():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in (7, 11, 6)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILY_IDS)
def test_packed_equals_separate(family, dtype, root, device):
    """One packed row (position_ids restarts, and DataCollatorWithFlattening's cu_seq_lens) gives
    each sequence the logits it gets alone."""
    from transformers import DataCollatorWithFlattening

    ours, lowp, exact = _trio(device, family, root, dtype)
    seqs = _three_sequences()
    with torch.no_grad():
        alone = {
            name: torch.cat([m(input_ids=s[None].to(device)).logits[0] for s in seqs])
            for name, m in (("lowp", lowp), ("exact", exact))
        }
        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        batch = collator([{"input_ids": s.tolist()} for s in seqs])
        ids = batch["input_ids"].to(device)
        pos = batch["position_ids"].to(device)
        by_position_ids = ours(input_ids=ids, position_ids=pos).logits[0]
        flash_kwargs = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k",
                                              "max_length_q", "max_length_k")}  # fmt: skip
        by_cu_seqlens = ours(input_ids=ids, position_ids=pos, **flash_kwargs).logits[0]
    for name, got in (("position_ids", by_position_ids), ("cu_seq_lens", by_cu_seqlens)):
        assert_model_close(f"packed via {name}", got, alone["exact"], alone["lowp"], FWD_FACTOR, dtype)


@pytest.mark.parametrize("packed", [False, True], ids=["one-sequence", "packed"])
def test_compiled_fullgraph_without_mask(packed, root, device):
    """torch.compile(fullgraph=True) of a whole model called with attention_mask=None
    (transformers' test_flash_attn_2_can_compile_with_attention_mask_None_without_graph_break):
    the model passes position_ids to every layer and hf_flash finds packed sequences inside the
    attention op when it runs, so nothing data-dependent is traced. The compiled model gives what
    the eager one gives, packed rows included (each sequence as if alone, gradients too)."""
    dtype = torch.float32
    ours, lowp, exact = _trio(device, "llama", root, dtype)
    seqs = _three_sequences()
    ids = torch.cat(seqs)[None].to(device)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None].to(device)
    kwargs = {"position_ids": pos} if packed else {}
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    got = compiled(input_ids=ids, attention_mask=None, use_cache=False, **kwargs).logits[0]
    with torch.no_grad():
        if packed:
            ref = {name: torch.cat([m(input_ids=s[None].to(device)).logits[0] for s in seqs])
                   for name, m in (("lowp", lowp), ("exact", exact))}  # fmt: skip
        else:
            ref = {name: m(input_ids=ids).logits[0] for name, m in (("lowp", lowp), ("exact", exact))}
        eager = ours(input_ids=ids, attention_mask=None, use_cache=False, **kwargs).logits[0]
    assert_model_close("compiled logits", got.detach(), ref["exact"], ref["lowp"], FWD_FACTOR, dtype)
    assert torch.equal(got.detach(), eager)
    got.float().square().mean().backward()  # the compiled backward runs the same op pair
    grads = [p.grad for p in ours.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def _prompts(device):
    """Left-padded batch of two prompts (lengths 9 and 6)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3] = 0
    mask[1, :3] = 0
    return ids.to(device), mask.to(device)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", FAMILY_IDS)
def test_greedy_generate_equals_sdpa(family, cache, root, device):
    ours = load(family, "hf_flash", root, device=device)
    # Gemma 2's softcapping has no sdpa path in transformers: its peer is eager.
    sdpa = load(family, "eager" if family == "gemma2" else "sdpa", root, device=device)
    ids, mask = _prompts(device)
    # 9-token prompts > the sliding window of 8: windows slide in prefill and decode.
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    if cache == "static":
        gen["cache_implementation"] = "static"
    expected = sdpa.generate(ids, attention_mask=mask, **gen)
    got = ours.generate(ids, attention_mask=mask, **gen)
    assert torch.equal(got, expected), f"hf_flash {got.tolist()} != sdpa {expected.tolist()}"
    if cache == "dynamic":  # and a single unpadded prompt (no mask at all)
        got1 = ours.generate(ids[:1], **gen)
        assert torch.equal(got1, sdpa.generate(ids[:1], **gen))


def test_generate_from_right_padded_prompt_equals_sdpa(root, device):
    """generate() appends each new token after a right-padded prompt's padding, so the decode
    steps' masks have a hole: the valid tokens are gathered (never the padding attended), as
    flash_attention_2 unpads, and greedy tokens equal sdpa's. A static cache (whose step may be
    compiled and cannot gather) refuses such a mask."""
    ours = load("llama", "hf_flash", root, device=device)
    sdpa = load("llama", "sdpa", root, device=device)
    ids, _ = _prompts(device)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    gen = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    got, expected = ours.generate(ids, **gen), sdpa.generate(ids, **gen)
    assert torch.equal(got, expected), f"hf_flash {got.tolist()} != sdpa {expected.tolist()}"
    with pytest.raises(ValueError, match="padding inside a sequence"):
        ours.generate(ids, cache_implementation="static", **gen)


def test_padding_inside_rows_matches_eager(root, device):
    """transformers' model tests use random masks with zeros anywhere in a row: hf_flash
    matches eager at every real token (each row's valid tokens gathered into one sequence)."""
    ours = load("llama", "hf_flash", root, device=device)
    exact = load("llama", "eager", root, dtype=torch.float64, device=device)
    lowp = load("llama", "eager", root, device=device)
    ids, mask = _right_padded_rows(device)
    mask[0, 2] = mask[1, 5:7] = mask[2, 3] = 0  # holes (no left padding: eager stays finite)
    valid = mask.bool()
    with torch.no_grad():
        got, ex, lo = (m(input_ids=ids, attention_mask=mask, use_cache=False).logits
                       for m in (ours, exact, lowp))  # fmt: skip
    assert_model_close("logits (padding inside rows)", got[valid], ex[valid], lo[valid],
                       FWD_FACTOR, torch.float32)  # fmt: skip


def test_static_cache_forward_without_mask(root, device):
    """A StaticCache hands the attention its whole zero-padded buffer; with no attention_mask the
    valid length comes from the cache itself."""
    from transformers import StaticCache

    ours = load("llama", "hf_flash", root, device=device)
    exact = load("llama", "eager", root, dtype=torch.float64, device=device)
    lowp = load("llama", "eager", root, device=device)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4)).to(device)
    with torch.no_grad():
        cache = StaticCache(config=ours.config, max_cache_len=32)
        ours(input_ids=ids[:, :8], past_key_values=cache)
        got = ours(input_ids=ids[:, 8:], past_key_values=cache).logits
        want = exact(input_ids=ids).logits[:, 8:]
        want_lp = lowp(input_ids=ids).logits[:, 8:]
    assert_model_close("static-cache continuation", got, want, want_lp, FWD_FACTOR, torch.float32)


def test_set_attn_implementation_round_trip(root, device):
    model = load("llama", "sdpa", root, device=device)
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        model.set_attn_implementation("hf_flash")
        assert model.config._attn_implementation == "hf_flash"
        got = model(input_ids=ids).logits
        model.set_attn_implementation("sdpa")
        assert model.config._attn_implementation == "sdpa"
    exact = load("llama", "eager", root, dtype=torch.float64, device=device)
    with torch.no_grad():
        want = exact(input_ids=ids).logits
    assert_model_close("after set_attn_implementation", got, want, ref, FWD_FACTOR, torch.float32)


def test_save_and_reload_does_not_persist_the_name(root, tmp_path, device):
    model = load("llama", "hf_flash", root, device=device)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "hf_flash" not in json.dumps(saved), saved
    again = type(model).from_pretrained(tmp_path, attn_implementation="hf_flash").to(device)
    plain = type(model).from_pretrained(tmp_path).to(device)
    assert again.config._attn_implementation == "hf_flash"
    assert plain.config._attn_implementation != "hf_flash"
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(6)).to(device)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_output_attentions_is_refused(root, device):
    model = load("llama", "hf_flash", root, device=device)
    ids = torch.randint(3, VOCAB, (1, 8)).to(device)
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=ids, output_attentions=True)


def _right_padded_rows(device):
    """Right padding only, so float64 eager stays finite at every real token."""
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(3, VOCAB, (3, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    mask[2, -9:] = 0
    return ids.to(device), mask.to(device)


def test_unpadded_hidden_states_are_repadded(root, device):
    """output_hidden_states through the unpad patch: every layer's states come back (B, S, H),
    zero at padding, and match eager at the real tokens."""
    from hf_flash.integration import unpad_patch

    ours, lowp, exact = _trio(device, "llama", root, torch.float32)
    assert unpad_patch.is_patched(ours.model) and not unpad_patch.is_patched(lowp.model)
    ids, mask = _right_padded_rows(device)
    with torch.no_grad():
        got = ours.model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
        refs = [m.model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
                for m in (lowp, exact)]  # fmt: skip
    valid = mask.bool()
    assert len(got.hidden_states) == len(refs[0].hidden_states) == ours.config.num_hidden_layers + 1
    states = [("last", got.last_hidden_state, refs[0].last_hidden_state, refs[1].last_hidden_state)]
    states += [(f"layer {i}", *hs) for i, hs in enumerate(zip(got.hidden_states, refs[0].hidden_states,
                                                               refs[1].hidden_states))]  # fmt: skip
    for name, g, lo, ex in states:
        assert g.shape == lo.shape == (*ids.shape, ours.config.hidden_size), name
        assert not g[~valid].any(), f"{name}: padding positions must be zero"
        assert_model_close(f"hidden states ({name})", g[valid], ex[valid], lo[valid], FWD_FACTOR, torch.float32)


def test_unpad_leaves_other_inputs_alone(root, monkeypatch, device):
    """No padding, a cache, or padding inside a row: the model's forward runs untouched (the
    last one then gathers the valid tokens in each attention call)."""
    from hf_flash.integration import unpad_patch

    calls = []
    real = unpad_patch.unpad_inputs
    monkeypatch.setattr(unpad_patch, "unpad_inputs", lambda m: calls.append(real(m)) or calls[-1])
    model = load("llama", "hf_flash", root, device=device)
    ids, mask = _right_padded_rows(device)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(mask), use_cache=False)
        model(input_ids=ids, attention_mask=mask, use_cache=True)  # builds a DynamicCache
        assert all(c is None for c in calls) and len(calls) == 1
        holes = mask.clone()
        holes[1, 3] = 0
        model(input_ids=ids, attention_mask=holes, use_cache=False)
        assert calls[-1] is None


def test_unpad_switch(root, device):
    from hf_flash.integration import unpad_patch

    hf_flash.register(unpad=False)
    try:
        off = load("llama", "hf_flash", root, device=device)
        assert not unpad_patch.is_patched(off.model)
    finally:
        hf_flash.register()
    assert unpad_patch.is_patched(load("llama", "hf_flash", root, device=device).model)
