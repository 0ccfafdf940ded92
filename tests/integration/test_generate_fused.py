"""The fused StaticCache decode path (hf_flash.integration.decode_patch) in real generate() runs.

Greedy generation must equal sdpa's token for token (float32, tiny models, CPU interpreter), and
the fused kernel must really run on the decode steps (counted), not silently fall back. bf16 on
the GPU: logits of every step against sdpa within the error rule.
"""

from __future__ import annotations

import pytest
import torch

import hf_flash
from hf_flash.integration import decode_patch
from hf_flash.reference import FWD_FACTOR
from tiny_models import VOCAB, assert_model_close, load

hf_flash.register()


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts fused decode steps: the fused path's calls of the decode op that append new keys.
    Counted where the patch calls it (Python that torch.compile inlines, so the count is
    replayed on every compiled step too; a kernel-launcher count would stop at the CUDA
    graph's recording)."""
    calls = []
    real = decode_patch.decode_attention

    def counting(q, k_cache, v_cache, **kwargs):
        if kwargs.get("k_new") is not None:
            calls.append(q.shape)
        return real(q, k_cache, v_cache, **kwargs)

    monkeypatch.setattr(decode_patch, "decode_attention", counting)
    return calls


def _prompts(device, batch):
    """batch prompts of 9 tokens; row 1 (if any) left-padded by 3, as generate wants it."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (batch, 9), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :3] = 0
        mask[1, :3] = 0
    return ids.to(device), mask.to(device)


def _attn_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


@pytest.mark.parametrize("batch", [1, 2], ids=["b1", "b2-leftpad"])
@pytest.mark.parametrize("family", ["llama", "mistral-full"])
def test_static_generate_equals_sdpa_and_runs_fused(family, batch, root, fused_calls, device):
    fam, kw = ("mistral", {"sliding_window": None}) if family == "mistral-full" else (family, {})
    ours = load(fam, "hf_flash", root, device=device, **kw)
    sdpa = load(fam, "sdpa", root, device=device, **kw)
    assert all(decode_patch.is_patched(m) for m in _attn_modules(ours)), "hook did not patch"
    ids, mask = _prompts(device, batch)
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = sdpa.generate(ids, attention_mask=mask, **gen)
    got = ours.generate(ids, attention_mask=mask, **gen)
    assert torch.equal(got, expected), f"hf_flash {got.tolist()} != sdpa {expected.tolist()}"
    layers = ours.config.num_hidden_layers
    # prefill takes the generic path; each of the 4 decode steps runs the fused op per layer
    assert len(fused_calls) == 4 * layers, f"fused op ran {len(fused_calls)} times"
    assert all(s[1] == 1 for s in fused_calls)


@pytest.mark.parametrize("batch", [1, 2], ids=["b1", "b2-leftpad"])
@pytest.mark.parametrize("family", ["llama", "mistral-full"])
def test_dynamic_generate_equals_sdpa_and_runs_fused(family, batch, root, fused_calls, device):
    """The default DynamicCache: decode steps run the fused kernel too, appending into spare
    slots of the layer's buffers (decode_patch._dynamic_buffers)."""
    fam, kw = ("mistral", {"sliding_window": None}) if family == "mistral-full" else (family, {})
    ours = load(fam, "hf_flash", root, device=device, **kw)
    sdpa = load(fam, "sdpa", root, device=device, **kw)
    ids, mask = _prompts(device, batch)
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = sdpa.generate(ids, attention_mask=mask, **gen)
    got = ours.generate(ids, attention_mask=mask, **gen)
    assert torch.equal(got, expected), f"hf_flash {got.tolist()} != sdpa {expected.tolist()}"
    assert len(fused_calls) == 4 * ours.config.num_hidden_layers


def test_sliding_caches_fall_back(root, fused_calls, device):
    """Sliding-window caches (mistral, window 8 < prompt + new tokens), static and dynamic, are
    not fused; generation still equals sdpa."""
    for cache in ("static", "dynamic"):
        ours = load("mistral", "hf_flash", root, device=device)
        sdpa = load("mistral", "sdpa", root, device=device)
        ids, mask = _prompts(device, 2)
        gen = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
        if cache == "static":
            gen["cache_implementation"] = "static"
        expected = sdpa.generate(ids, attention_mask=mask, **gen)
        assert torch.equal(ours.generate(ids, attention_mask=mask, **gen), expected)
    assert fused_calls == []


def _dynamic_steps(model, ids, mask, prefill, edits=()):
    """Prefill ``ids[:, :prefill]`` into a DynamicCache, then one token per step; ``edits`` maps
    a step index to a function applied to the cache before that step. Returns the logits of
    every step and the cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    edits = dict(edits)
    out = []
    with torch.no_grad():
        model(input_ids=ids[:, :prefill], attention_mask=mask[:, :prefill], past_key_values=cache)
        for i, t in enumerate(range(prefill, ids.shape[1])):
            if i in edits:
                edits[i](cache)
            n = cache.get_seq_length() + 1
            step_mask = torch.cat([mask[:, : n - 1], mask[:, t : t + 1]], dim=1)
            out.append(model(input_ids=ids[:, t : t + 1], attention_mask=step_mask,
                             past_key_values=cache).logits)  # fmt: skip
    return out, cache


@pytest.mark.parametrize("edit", ["none", "crop", "reorder"])
def test_fused_dynamic_steps_match_generic(edit, root, fused_calls, monkeypatch, device):
    """Fused DynamicCache steps against the generic hf_flash path (patch reverted) from the same
    prompt: same logits and cache contents, also when the buffers must grow (small growth step
    here), after crop() (the view shrinks; later tokens overwrite the cropped slots) and after
    batch_select_indices() (a plain tensor again: copied into new buffers)."""
    from hf_flash.integration import decode_patch as dp

    monkeypatch.setattr(dp, "_GROWTH_MIN", 4)
    ours = load("llama", "hf_flash", root, device=device)
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(8)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 left-padded by 3
    edits = {"none": {}, "crop": {3: lambda c: c.crop(-2)},
             "reorder": {3: lambda c: c.batch_select_indices(torch.tensor([1, 0], device=device))}}[edit]
    if edit == "reorder":
        mask = torch.ones_like(ids)  # no padding: the mask stays right for the swapped rows
    fused, fused_cache = _dynamic_steps(ours, ids, mask, 10, edits)
    layer0 = fused_cache.layers[0]
    assert layer0.keys._base is not None, "fused steps must leave the keys as a buffer view"
    assert len(fused_calls) == len(fused) * ours.config.num_hidden_layers
    dp.revert_model(ours)
    try:
        generic, generic_cache = _dynamic_steps(ours, ids, mask, 10, edits)
    finally:
        dp.patch_model(ours)
    for i, (a, b) in enumerate(zip(fused, generic)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=f"step {i}")
    for lf, lg in zip(fused_cache.layers, generic_cache.layers):
        assert lf.keys.shape == lg.keys.shape
        torch.testing.assert_close(lf.keys, lg.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lf.values, lg.values, atol=1e-5, rtol=1e-5)


def test_fused_step_matches_generic_step(root, fused_calls, device):
    """One decode step (3 speculative tokens) through the fused path and through the generic
    hf_flash path (patch reverted) from the same cache: logits within the error rule against
    float64 eager, and the caches hold the same keys/values afterwards."""
    from transformers import StaticCache

    ours = load("llama", "hf_flash", root, device=device)
    exact = load("llama", "eager", root, dtype=torch.float64, device=device)
    lowp = load("llama", "eager", root, device=device)
    ids = torch.randint(3, VOCAB, (2, 14), generator=torch.Generator().manual_seed(5)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # row 0 left-padded by 4
    results = {}
    with torch.no_grad():
        for mode in ("fused", "generic"):
            if mode == "generic":
                decode_patch.revert_model(ours)
            cache = StaticCache(config=ours.config, max_cache_len=24)
            ours(input_ids=ids[:, :11], attention_mask=mask[:, :11], past_key_values=cache)
            logits = ours(input_ids=ids[:, 11:], attention_mask=mask, past_key_values=cache).logits
            results[mode] = (logits, [(l.keys.clone(), l.values.clone()) for l in cache.layers])
        decode_patch.patch_model(ours)
        # references row by row without the padding (eager turns fully masked pad rows into NaN,
        # which then reach the real tokens), at the same positions as the padded run
        want, want_lp = [], []
        for b, pad in enumerate((4, 0)):
            row = dict(input_ids=ids[b : b + 1, pad:],
                       position_ids=torch.arange(pad, 14, device=device)[None])  # fmt: skip
            want.append(exact(**row).logits[:, 11 - pad :])
            want_lp.append(lowp(**row).logits[:, 11 - pad :])
        want, want_lp = torch.cat(want), torch.cat(want_lp)
    assert len(fused_calls) == ours.config.num_hidden_layers
    for mode in ("fused", "generic"):
        assert_model_close(mode, results[mode][0], want, want_lp, FWD_FACTOR, torch.float32)
    for (kf, vf), (kg, vg) in zip(results["fused"][1], results["generic"][1]):
        assert torch.allclose(kf, kg, atol=1e-5) and torch.allclose(vf, vg, atol=1e-5)


def test_compiled_decode_step_is_one_graph(root, device):
    """torch.compile(fullgraph=True) traces the fused step (custom op mutating the cache
    buffers, cumulative_length bump) and gives the eager generic path's logits and caches."""
    from transformers import StaticCache

    # Dynamo keys its compiled code and recompile counters on the code object, here the class's
    # forward, which earlier tests of the same process (generate's automatic compile) may have
    # compiled up to the recompile limit, after which frames run eagerly. Start clean.
    torch._dynamo.reset()
    ours = load("llama", "hf_flash", root, device=device)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    caches, logits = [], []
    with torch.no_grad():
        for mode in ("compiled", "generic"):
            if mode == "generic":
                decode_patch.revert_model(ours)
            cache = StaticCache(config=ours.config, max_cache_len=24)
            ours(input_ids=ids[:, :10], attention_mask=mask[:, :10], past_key_values=cache)
            step = ours.forward
            if mode == "compiled":
                step = torch.compile(ours.forward, backend="aot_eager", fullgraph=True)
            for t in (10, 11):
                out = step(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1],
                           past_key_values=cache)  # fmt: skip
                logits.append(out.logits)
            caches.append(cache)
        decode_patch.patch_model(ours)
    assert int(caches[0].get_seq_length()) == 12
    for a, b in zip(logits[:2], logits[2:]):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    for la, lb in zip(caches[0].layers, caches[1].layers):
        assert torch.allclose(la.keys, lb.keys, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_generate_compiled_static_decode_has_no_graph_break(family, root, device):
    """generate() with the static cache compiles the whole decode step once (on CUDA it records
    one CUDA graph), including the last step, which fills the cache. A graph break anywhere in the patched model (the unpad wrapper, the mask
    function, the fused or the generic attention) splits the step into per-layer frames that
    recompile on ``layer_idx`` until dynamo gives up and runs them eagerly: seen on the H100 as a
    host-bound compiled decode. Forced here on the CPU (transformers compiles on CUDA only by
    default) with the eager backend; tokens must equal the uncompiled run. qwen2 takes the
    generic attention path (no fused decode) with the mask built on the device."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig, GenerationConfig

    torch._dynamo.reset()
    counters.clear()
    ours = load(family, "hf_flash", root, device=device)
    ids, mask = _prompts(device, 2)
    outs = {}
    for mode in ("compiled", "eager"):
        gen = GenerationConfig(max_new_tokens=5, do_sample=False, cache_implementation="static",
                               pad_token_id=0, eos_token_id=None)  # fmt: skip
        if mode == "compiled":
            gen.compile_config = CompileConfig(backend="eager", fullgraph=False)
            gen.compile_config._compile_all_devices = True
        else:
            gen.disable_compile = True
        outs[mode] = ours.generate(ids, attention_mask=mask, generation_config=gen)
    breaks = dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled: the test checks nothing"
    assert not breaks, f"graph breaks in the compiled decode step: {breaks}"
    # one graph for every step, the last one (which fills the cache) included; the tiny qwen2
    # has a sliding-window layer, whose static layer (transformers') guards on a Python int
    # fill level and recompiles once as it fills, under sdpa too
    graphs = 1 if family == "llama" else 2
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    assert torch.equal(outs["compiled"], outs["eager"])
    torch._dynamo.reset()


def test_patch_and_revert_explicitly(root, device):
    ours = load("llama", "hf_flash", root, device=device)
    mods = _attn_modules(ours)
    decode_patch.revert_model(ours)
    assert not any(decode_patch.is_patched(m) for m in mods)
    assert decode_patch.patch_model(ours) is True
    assert decode_patch.patch_model(ours) is True  # idempotent
    assert all(m.forward.__func__.__hf_flash_patch__ == decode_patch._RECORD for m in mods)
    decode_patch.revert_model(ours)
    assert not any(decode_patch.is_patched(m) for m in mods)
    qwen = load("qwen2", "hf_flash", root, device=device)
    assert decode_patch.patch_model(qwen) is False  # not a fused-decode family
    # switching away from hf_flash reverts the family patches (registration hook)
    ours = load("llama", "hf_flash", root, device=device)
    ours.set_attn_implementation("sdpa")
    assert not any(decode_patch.is_patched(m) for m in _attn_modules(ours))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_gpu_bf16_static_logits_over_128_steps(batch, root, device):
    """bf16 on the GPU: 128 greedy steps; the fused run's per-step logits, on sdpa's own tokens
    (teacher forcing keeps both runs on one sequence), within the error rule: float64 eager as
    the truth, sdpa's bf16 generate logits as the budget."""
    from transformers import StaticCache

    dtype = torch.bfloat16
    steps = 128
    ours = load("llama", "hf_flash", root, dtype=dtype, device=device)
    sdpa = load("llama", "sdpa", root, dtype=dtype, device=device)
    exact = load("llama", "eager", root, dtype=torch.float64, device=device)
    ids, mask = _prompts(device, batch)
    n = ids.shape[1]
    gen = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0,
               cache_implementation="static", output_logits=True, return_dict_in_generate=True)
    ref = sdpa.generate(ids, attention_mask=mask, **gen)
    seq = ref.sequences  # (batch, n + steps)
    full_mask = torch.cat([mask, torch.ones_like(seq[:, n:])], dim=1)
    # generate's positions: count real tokens only (left-padded rows start at 0)
    pos = (full_mask.long().cumsum(-1) - 1).clamp(min=0)
    lowp = torch.stack(ref.logits, dim=1).float()  # (batch, steps, vocab)
    with torch.no_grad():
        want = []  # row by row without its padding (eager turns pad rows into NaN)
        for b in range(batch):
            pad = int((mask[b] == 0).sum())
            logits = exact(input_ids=seq[b : b + 1, pad:], position_ids=pos[b : b + 1, pad:]).logits
            want.append(logits[:, n - 1 - pad : -1])
        want = torch.cat(want)
        cache = StaticCache(config=ours.config, max_cache_len=seq.shape[1] + 8)
        got = [ours(input_ids=seq[:, :n], attention_mask=full_mask[:, :n], position_ids=pos[:, :n],
                    past_key_values=cache).logits[:, -1]]  # fmt: skip
        for t in range(n, n + steps - 1):
            step = ours(
                input_ids=seq[:, t : t + 1], attention_mask=full_mask[:, : t + 1],
                position_ids=pos[:, t : t + 1], past_key_values=cache,
            )  # fmt: skip
            got.append(step.logits[:, -1])
    got = torch.stack(got, dim=1).float()
    assert got.shape == lowp.shape == want.shape
    assert_model_close("bf16 fused decode logits", got, want, lowp, FWD_FACTOR, dtype)


@pytest.mark.gpu
def test_gpu_static_generate_compiled_equals_sdpa(root, device):
    """cache_implementation="static" on CUDA: generate compiles the decode step (CUDA graphs)
    with the fused op inside; float32 greedy tokens equal sdpa's, batch 1 and left-padded."""
    ours = load("llama", "hf_flash", root, device=device)
    sdpa = load("llama", "sdpa", root, device=device)
    for batch in (1, 2):
        ids, mask = _prompts(device, batch)
        gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0,
                   cache_implementation="static")  # fmt: skip
        expected = sdpa.generate(ids, attention_mask=mask, **gen)
        assert torch.equal(ours.generate(ids, attention_mask=mask, **gen), expected)
