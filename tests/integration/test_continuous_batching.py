"""transformers' continuous batching (``model.generate_batch``) on hf_flash's kernels.

Greedy ``generate_batch`` over three prompts of different lengths must give, token for token,
what ``model.generate`` gives for each prompt alone (float32 tiny models; the reference runs on
"sdpa", so it shares no code with hf_flash), and the log-probabilities of those tokens must agree
to float32 accuracy (tokens alone would miss small attention errors that do not flip an argmax).
Kernel launches are counted, so a run that fell back to another attention implementation fails:
the varlen kernel must serve every step, and the paged kernel the decode steps exactly when
transformers uses a block table (all layers full attention and a page size that is a multiple
of 16; otherwise decoding stays on varlen).

Continuous batching runs on the CPU in both supported transformers versions (5.17: the model
runs as "paged|hf_flash", keywords ``max_seqlen_*``; 5.20+: "hf_flash" with ``cache=``): CUDA
graphs are unavailable there and torch.compile is off by default, so no padding is added. The
cache is kept tiny (16 whole-model blocks, 64 tokens per step) so that sizing it is instant.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import hf_flash
from hf_flash.kernels import decode as decode_kernel
from hf_flash.kernels import flash_fwd
from hf_flash.integration.attention import hf_flash_attention_forward
from tiny_models import WINDOW, load

hf_flash.register()

# lengths 5, 19 and 3: the long prompt spans more than two of Mistral's 8-token windows
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 29)), [30, 31, 32]]
NEW_TOKENS = 5
# float32 end to end (looser on the GPU, whose reductions run in other orders); the attention
# mistakes tried while writing these tests (window dropped, causal mask dropped, one key too
# few) each failed them
LOGPROB_ATOL = 1e-3 if torch.cuda.is_available() else 1e-4


@pytest.fixture
def launches(monkeypatch):
    """Counts hf_flash kernel launches: the varlen attention kernel (cu_seqlens given) and the
    paged decode kernel (block_table given)."""
    counts = {"varlen": 0, "paged": 0}
    attn_fwd, decode = flash_fwd.flash_attn_forward, decode_kernel.flash_decode

    def counting_attn_fwd(*args, **kwargs):
        counts["varlen"] += kwargs["cu_seqlens_q"] is not None
        return attn_fwd(*args, **kwargs)

    def counting_decode(*args, **kwargs):
        counts["paged"] += kwargs["block_table"] is not None
        return decode(*args, **kwargs)

    monkeypatch.setattr(flash_fwd, "flash_attn_forward", counting_attn_fwd)
    monkeypatch.setattr(decode_kernel, "flash_decode", counting_decode)
    return counts


def cb_config(page: int, **kwargs) -> ContinuousBatchingConfig:
    """A tiny cache (16 blocks, 64 tokens per step unless given) on both versions: transformers
    5.20+ call the page size ``page_size``, 5.17 ``block_size``. (sdpa's masks grow with the
    tokens per step: the default 8192 makes its runs take minutes on the CPU.) CUDA graphs are
    off unless asked for: replayed steps never reach Python, so launches could not be counted."""
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_field = "page_size" if "page_size" in fields else "block_size"
    kwargs.setdefault("max_batch_tokens", 64)
    kwargs.setdefault("use_cuda_graph", False)
    return ContinuousBatchingConfig(
        **{page_field: page}, num_blocks=16, return_logprobs=True, **kwargs
    )


def _generation_config(model) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )  # fmt: skip


def _reference(device, family, root):
    """Each prompt alone through model.generate, on sdpa: (tokens, log-probabilities) per
    prompt."""
    model = load(family, "sdpa", root, device=device)
    tokens, logprobs = [], []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=_generation_config(model),
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        new = out.sequences[0, len(prompt) :]
        steps = torch.stack(out.logits)[:, 0].float().log_softmax(-1)  # (new tokens, vocab)
        tokens.append(new.tolist())
        logprobs.append(steps.gather(1, new[:, None])[:, 0].tolist())
    return tokens, logprobs


def _generate_batch(model, config):
    """(tokens, log-probabilities) per prompt."""
    out = model.generate_batch(
        PROMPTS, generation_config=_generation_config(model), continuous_batching_config=config
    )
    assert len(out) == len(PROMPTS)
    # request ids follow the prompts' order ("req_0", "req_1", ...)
    results = [out[f"req_{i}"] for i in range(len(PROMPTS))]
    return [r.generated_tokens for r in results], [r.logprobs for r in results]


def _assert_same(got, want):
    (tokens, logprobs), (want_tokens, want_logprobs) = got, want
    assert tokens == want_tokens
    err = max(abs(a - b) for g, w in zip(logprobs, want_logprobs) for a, b in zip(g, w))
    assert err <= LOGPROB_ATOL, f"log-probabilities differ by up to {err:.3e}"


@pytest.mark.parametrize(
    "family,page,extra,paged_decode",
    [
        pytest.param("llama", 16, {}, True, id="llama-paged-decode"),
        pytest.param("llama", 16, {"max_blocks_per_request": 0}, False, id="llama-varlen-decode"),
        pytest.param("llama", 8, {}, False, id="llama-page8-varlen"),
        pytest.param("llama", 16, {"max_batch_tokens": 8}, True, id="llama-chunked-prefill"),
        pytest.param("mistral", 16, {}, False, id="mistral-window"),
        pytest.param("qwen2", 16, {}, False, id="qwen2-full-and-sliding"),
    ],
)
def test_generate_batch_matches_generate(root, launches, family, page, extra, paged_decode, device):
    model = load(family, "hf_flash", root, device=device)
    _assert_same(_generate_batch(model, cb_config(page, **extra)), _reference(device, family, root))
    steps_with_decode = NEW_TOKENS - 1
    layers = model.config.num_hidden_layers
    assert launches["varlen"] >= layers, f"the varlen kernel did not run: {launches}"
    if paged_decode:
        # every decode step of the three requests went through the paged kernel, layer by layer
        assert launches["paged"] >= steps_with_decode * layers, launches
    else:
        assert launches["paged"] == 0, launches
    # the model is back on its own name afterwards (5.17 switched it to "paged|hf_flash")
    assert model.config._attn_implementation == "hf_flash"


def test_window_changes_the_long_prompt(root, device):
    """The Mistral case above is sensitive to the window: the same weights without it (Llama,
    identical shapes and seed) continue the 11-token prompt differently."""
    (mistral, _), (llama, _) = (_reference(device, family, root) for family in ("mistral", "llama"))
    assert len(PROMPTS[1]) > 2 * WINDOW
    assert mistral[1] != llama[1]


def test_generate_batch_matches_sdpa_generate_batch(root, launches, device):
    model = load("llama", "hf_flash", root, device=device)
    got = _generate_batch(model, cb_config(16))
    _assert_same(got, _generate_batch(load("llama", "sdpa", root, device=device), cb_config(16)))
    assert launches["paged"] > 0


@pytest.fixture
def ordered_async_reset(monkeypatch):
    """Orders transformers' async-batching reset before the first batch's input copies.

    ``ContinuousBatchingAsyncIOs.reset`` (transformers 5.17 - 5.24) zeroes the device input
    buffers on the generation thread's current stream, but the first batches' inputs are copied
    on a side stream that does not wait for it, so under GPU load the zeroing can land after the
    copies: every request then reads zeros (identical tokens for different prompts). This fails
    with sdpa as with hf_flash: on an H200, with the zeroing delayed on purpose, both generated
    wrong tokens (zeros first) and both were right once reset synchronised its stream
    (benchmarks/results/logs/2026-11-29-s32-call4b-cb-race.log). The fixture adds that
    synchronisation, so the test checks hf_flash's padded steps and not transformers' race."""
    from transformers.generation.continuous_batching import input_outputs

    cls = getattr(input_outputs, "ContinuousBatchingAsyncIOs", None)
    if cls is None:  # no async IO pairs in this transformers: nothing to order
        return
    original = cls.reset

    def reset(self, *args, **kwargs):
        original(self, *args, **kwargs)
        torch.cuda.current_stream().synchronize()

    monkeypatch.setattr(cls, "reset", reset)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_gpu_generate_batch_with_cuda_graphs(root, launches, family, device, ordered_async_reset):
    """transformers' default for flash names on CUDA: CUDA graphs and async batching, so every
    step is padded to a fixed size (trailing tokens of no request, zero-length requests with -1
    page-table rows). The padding must not disturb the real requests."""
    model = load(family, "hf_flash", root, device=device)
    got = _generate_batch(model, cb_config(16, use_cuda_graph=True))
    _assert_same(got, _reference(device, family, root))
    assert launches["varlen"] > 0  # graph capture runs the Python path once per graph
    if family == "llama":
        assert launches["paged"] > 0


# ------------------------------------------------------------------------------------------
# Bad input: a clear ValueError before the cache or a kernel is touched
# ------------------------------------------------------------------------------------------


class _Allocator:
    def __init__(self, layer_type):
        self.layer_type = layer_type
        self.index = 0


class _Cache:
    """The transformers >= 5.20 PagedAttentionCache surface the attention function uses; update
    hands back page views of ``page`` rows with a block table, as the real cache does."""

    def __init__(self, layer_type="full_attention", page=16):
        self.layer_to_allocator = {0: _Allocator(layer_type)}
        self.page = page
        self.updates = 0

    def update(self, key_states, value_states, layer_idx, kwargs):
        self.updates += 1
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"]["full_attention"]
        kwargs["max_length_k"] = kwargs["max_length_k"]["full_attention"]
        kwargs["block_table"] = kwargs["block_table"][0]
        pages = torch.zeros(4, self.page, key_states.shape[1], key_states.shape[-1])
        pages = pages.to(key_states.device)  # the cache lives where the keys are
        kwargs["k_cache"], kwargs["v_cache"] = pages, pages.clone()
        return key_states, value_states


class _NotPaged:
    updates = 0

    def update(self, key_states, value_states):
        raise AssertionError("not a paged cache: must not be called")


class _Attn(torch.nn.Module):
    is_causal = True
    layer_idx = 0

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


def _decode_kwargs(device, tokens=2):
    cu = torch.arange(tokens + 1, dtype=torch.int32, device=device)
    return dict(
        cu_seq_lens_q=cu, max_length_q=1, cu_seq_lens_k={"full_attention": cu * 3},
        max_length_k={"full_attention": 3},
        block_table=torch.zeros(1, tokens, 2, dtype=torch.int32, device=device),
        read_index=[], write_index=[],
    )  # fmt: skip


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda kw, cache: kw.update(cache=_NotPaged()), "PagedAttentionCache"),
        (lambda kw, cache: kw.update(batch=2), "one row"),
        (lambda kw, cache: kw.pop("cu_seq_lens_q"), "cu_seq_lens_q"),
        (lambda kw, cache: setattr(cache, "page", 8), "multiple of 16"),
        (lambda kw, cache: kw.update(cache=_Cache("sliding_attention")), "sliding"),
        (lambda kw, cache: kw.update(dropout=0.1), "inference-only"),
    ],
    ids=["not-a-paged-cache", "batch-2", "missing-cu-seqlens", "page-8", "window-mismatch",
         "dropout"],
)  # fmt: skip
def test_bad_continuous_batching_input_raises(launches, change, match, device):
    cache = _Cache()
    kw = dict(_decode_kwargs(device), cache=cache, batch=1)
    change(kw, cache)
    batch = kw.pop("batch")
    q = torch.randn(batch, 4, 2, 16, device=device)
    k = torch.randn(batch, 2, 2, 16, device=device)
    with pytest.raises(ValueError, match=match):
        hf_flash_attention_forward(_Attn(), q, k, k.clone(), None, **kw)
    assert launches == {"varlen": 0, "paged": 0}
    # only the page size needs the page views, which the (block-table) update hands back
    assert kw["cache"].updates == (match == "multiple of 16")


def _updated_kwargs(device, kw=None):
    """The keywords a transformers >= 5.24 attention function gets for a block-table step: the
    attention module ran ``cache.update(..., kwargs=kwargs)`` itself and passes no cache."""
    kw = _decode_kwargs(device) if kw is None else kw
    k = torch.randn(1, 2, 2, 16, device=device)
    _Cache().update(k, k, 0, kw)
    return kw


def _own_pages(kw):
    """Each request on pages of its own (the shared zero table would have both write one slot)."""
    kw["block_table"] = torch.arange(4, dtype=torch.int32, device=kw["block_table"].device)
    kw["block_table"] = kw["block_table"].view(1, 2, 2)
    return kw


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda kw: kw.update(batch=2), "one row"),
        (lambda kw: kw.pop("cu_seq_lens_q"), "cu_seq_lens_q"),
        (lambda kw: kw.update(k_cache=kw["k_cache"][:, :8], v_cache=kw["v_cache"][:, :8]),
         "multiple of 16"),
        (lambda kw: kw.update(cu_seq_lens_k={"full_attention": kw["cu_seq_lens_k"]}),
         "keyed by layer type"),
        (lambda kw: kw.update(block_table=kw["block_table"][None]), "2-D"),
        (lambda kw: kw.update(dropout=0.1), "inference-only"),
    ],
    ids=["batch-2", "missing-cu-seqlens", "page-8", "unresolved-keywords", "3-d-block-table",
         "dropout"],
)  # fmt: skip
def test_bad_updated_step_raises(launches, change, match, device):
    """transformers >= 5.24: the step is recognised from its batch keywords (no cache=) and
    checked the same way before any kernel runs."""
    kw = dict(_updated_kwargs(device), batch=1)
    change(kw)
    batch = kw.pop("batch")
    q = torch.randn(batch, 4, 2, 16, device=device)
    k = torch.randn(batch, 2, 2, 16, device=device)
    with pytest.raises(ValueError, match=match):
        hf_flash_attention_forward(_Attn(), q, k, k.clone(), None, **kw)
    assert launches == {"varlen": 0, "paged": 0}


def test_updated_step_equals_cache_step(launches, device):
    """The same block-table decode step in both forms (cache= before 5.24; keywords already
    resolved by the module from 5.24 on) runs the paged kernel and gives the same output."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 2, 16, device=device)
    k, v = torch.randn(1, 2, 2, 16, device=device), torch.randn(1, 2, 2, 16, device=device)
    old, _ = hf_flash_attention_forward(
        _Attn(), q, k, v, None, cache=_Cache(), **_own_pages(_decode_kwargs(device))
    )
    updated = _updated_kwargs(device, _own_pages(_decode_kwargs(device)))
    new, _ = hf_flash_attention_forward(_Attn(), q, k, v, None, **updated)
    assert launches == {"varlen": 0, "paged": 2}
    assert torch.equal(old, new)


def test_paged_name_is_registered():
    """transformers 5.17 runs continuous batching as "paged|hf_flash": the same function, and
    the flash loader resolves the name like "hf_flash"."""
    from transformers import modeling_flash_attention_utils as fa
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS._global_mapping["paged|hf_flash"] is hf_flash_attention_forward
    fns = fa._lazy_imports("paged|hf_flash")
    assert fns[1] is hf_flash.flash_attn_varlen_func
    assert fns[2] is hf_flash.flash_attn_with_kvcache


def test_decode_fast_path_gate():
    """transformers offers the block table only to flash-attn names on CUDA; for "hf_flash" it
    stays on exactly when the paged kernel can serve it."""
    from transformers.generation.continuous_batching import initialization

    gate = initialization.ensure_decode_fast_path_is_available
    assert hasattr(gate, "__hf_flash_original__")
    assert list(inspect.signature(gate.__hf_flash_original__).parameters) == [
        "config", "cb_config", "user_requested",
    ]  # fmt: skip

    def resolved(family, page, name="hf_flash", blocks=6):
        from tiny_models import config_for

        config = config_for(family)
        config._attn_implementation = name
        cfg = cb_config(page, max_blocks_per_request=blocks)
        gate(config, cfg, True)
        return cfg.max_blocks_per_request

    assert resolved("llama", 16) == 6
    assert resolved("llama", 16, name="paged|hf_flash") == 6
    assert resolved("llama", 16, blocks=0) == 0  # the user turned it off
    assert resolved("llama", 8) == 0  # page size the paged kernel cannot take
    assert resolved("mistral", 16) == 0  # sliding-window layers live in ring buffers
    assert resolved("llama", 16, name="sdpa") == 0  # other names: transformers' own decision
