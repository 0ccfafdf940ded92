"""Fused-RoPE patch for Llama-family models: logits and gradients of a patched model against the
same model unpatched, for eager and sdpa attention (the patch must work with any attention
implementation), scaling methods with attention_scaling (YaRN), packed position_ids, PEFT, and
isolation (other instances untouched, revert restores the original).

Budget (hf_flash.reference's error rule): the patched float32 model may differ from the
unpatched float32 model by at most 2x (3x for gradients) the unpatched float32 model's own error
against float64, plus a floor.
"""

import copy
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config  # noqa: E402

import hf_flash  # noqa: E402
from hf_flash.integration import decode_patch, patching, rope_patch  # noqa: E402
from hf_flash.integration.rope_patch import is_patched, patch_model, revert_model  # noqa: E402
from hf_flash.kernels import rotary as rotary_kernel  # noqa: E402
from hf_flash.reference import max_abs_err  # noqa: E402
from hf_flash.rope_scaling import extend_context  # noqa: E402

SMALL = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, head_dim=16,
)  # fmt: skip
CONFIGS = {
    "llama": lambda **kw: LlamaConfig(**SMALL, **kw),
    "mistral": lambda **kw: MistralConfig(**SMALL, sliding_window=None, **kw),
    "qwen2": lambda **kw: Qwen2Config(**SMALL, **kw),
    "qwen3": lambda **kw: Qwen3Config(**SMALL, **kw),
}


def _model(device, family="llama", attn="eager", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = CONFIGS[family](**kw)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(device).eval()


def _attention_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts launches of the fused rotary kernel."""
    calls = []
    real = rotary_kernel.rotary_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(rotary_kernel, "rotary_forward", counting)
    return calls


def _budget_check(name, patched, unpatched, truth, factor):
    err = max_abs_err(patched, unpatched)
    budget = max_abs_err(unpatched, truth)
    floor = 2 * torch.finfo(torch.float32).eps * truth.abs().max().item()
    assert err <= factor * budget + floor, (
        f"{name}: patched vs unpatched {err:.3g}, unpatched float32 vs float64 {budget:.3g}"
    )


def _compare(model, ids, position_ids=None, grads=True):
    """(logits, grad of q_proj weight) for the model as is, in float32, and a float64 copy."""
    def run(m):
        m.zero_grad(set_to_none=True)
        out = m(ids, position_ids=position_ids).logits
        loss = out.float().square().mean()
        if grads:
            loss.backward()
        g = m.model.layers[0].self_attn.q_proj.weight.grad
        return out.detach().float(), (g.detach().clone() if g is not None else None)

    return run(model)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_patched_matches_unpatched(family, attn, kernel_calls, device):
    model = _model(device, family, attn)
    ids = torch.randint(0, 97, (2, 37), device=device)
    truth_logits, truth_grad = _compare(copy.deepcopy(model).double(), ids)
    ref_logits, ref_grad = _compare(model, ids)
    assert patch_model(model) is True
    assert all(is_patched(m) for m in _attention_modules(model))
    logits, grad = _compare(model, ids)
    assert len(kernel_calls) == 2 * model.config.num_hidden_layers  # forward + backward, per layer
    _budget_check("logits", logits, ref_logits, truth_logits, 2.0)
    _budget_check("dq_proj", grad, ref_grad, truth_grad, 3.0)


def test_yarn_scaling_and_packed_positions(kernel_calls, device):
    model = _model(device, "llama", "sdpa")
    extend_context(model, 256, method="yarn")
    assert model.model.rotary_emb.attention_scaling > 1.0
    ids = torch.randint(0, 97, (1, 150), device=device)
    # two packed sequences restarting at position 0, the second beyond the original 64
    pos = torch.cat([torch.arange(40), torch.arange(110)])[None].to(device)
    truth, _ = _compare(copy.deepcopy(model).double(), ids, pos, grads=False)
    ref, _ = _compare(model, ids, pos, grads=False)
    patch_model(model)
    out, _ = _compare(model, ids, pos, grads=False)
    assert kernel_calls
    _budget_check("yarn logits", out, ref, truth, 2.0)


def test_other_instances_untouched_and_revert(device):
    a = _model(device, "llama", "eager", seed=1)
    b = _model(device, "llama", "eager", seed=1)
    ids = torch.randint(0, 97, (1, 20), device=device)
    with torch.no_grad():
        before = b(ids).logits
        ref_a = a(ids).logits
    assert patch_model(a)
    assert patch_model(a)  # idempotent
    assert not any(is_patched(m) for m in _attention_modules(b))
    assert all("forward" not in m.__dict__ for m in _attention_modules(b))
    with torch.no_grad():
        assert torch.equal(b(ids).logits, before)
    assert revert_model(a) == a.config.num_hidden_layers
    assert all("forward" not in m.__dict__ for m in _attention_modules(a))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, ref_a)
    assert revert_model(a) == 0


def test_patched_forward_keeps_the_cache_argument_and_its_old_name(kernel_calls, device):
    """transformers 5.24 renamed the attention forward's ``past_key_values`` to ``cache`` and
    wraps the forward in ``deprecate_kwarg``, which still maps the old keyword: the patched
    forward keeps that wrapper, so the cache is updated under either name (5.17 ... 5.23 take
    ``past_key_values`` only)."""
    import warnings

    from transformers import DynamicCache

    model = _model(device, "llama")
    assert patch_model(model)
    attn = model.model.layers[0].self_attn
    name = patching.cache_parameter(type(attn).forward)
    assert name == patching.cache_parameter(attn.forward)
    names = ["past_key_values"] + (["cache"] if name == "cache" else [])
    hidden = torch.randn(1, 5, 64, device=device)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(5, device=device)[None])
    for keyword in names:
        cache = DynamicCache(config=model.config)
        kernel_calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the old name on 5.24
            attn(hidden, position_embeddings, None, **{keyword: cache})
        assert kernel_calls, keyword
        assert cache.get_seq_length(0) == 5, keyword


def test_unsupported_family_is_a_noop(device):
    from transformers import GPT2Config

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, n_positions=32)
    model = AutoModelForCausalLM.from_config(cfg).to(device)
    state = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    assert patch_model(model) is False
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == state
    llama = _model(device, "llama")
    assert patch_model(llama, rope=False) is False
    assert not any(is_patched(m) for m in _attention_modules(llama))


def test_generate_and_peft(kernel_calls, device):
    model = _model(device, "mistral", "sdpa")
    ids = torch.randint(0, 97, (1, 12), device=device)
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    patch_model(model)
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)
    assert kernel_calls
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(
        _model(device, "llama"),
        peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    assert patch_model(lora) is True
    loss = lora(ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for n, p in lora.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_patched_model_compiles_fullgraph(kernel_calls, device):
    """The re-bound forward and the rotary custom op trace without graph breaks."""
    model = _model(device, "llama", "sdpa")
    ids = torch.randint(0, 97, (1, 20), device=device)
    with torch.no_grad():
        truth = copy.deepcopy(model).double()(ids).logits
        ref = model(ids).logits
    patch_model(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        # no cache: transformers 5.17 builds a DynamicCache through a generator, which dynamo
        # (torch 2.11) cannot trace; the cache is not what this test is about
        out = compiled(ids, use_cache=False).logits
    assert kernel_calls
    _budget_check("compiled logits", out, ref, truth.float(), 2.0)


def test_accelerate_style_wrapper_stays_outermost(device):
    model = _model(device, "llama")
    attn = model.model.layers[0].self_attn
    # what accelerate's add_hook_to_module leaves behind
    attn._old_forward = attn.forward
    calls = []

    def hooked(*args, **kwargs):
        calls.append(1)
        return attn._old_forward(*args, **kwargs)

    attn.forward = hooked
    patch_model(model)
    assert attn.__dict__["forward"] is hooked
    assert patching._holder(attn, rope_patch._RECORD) == "_old_forward"
    ids = torch.randint(0, 97, (1, 8), device=device)
    with torch.no_grad():
        model(ids)
    assert calls
    revert_model(model)
    assert attn.__dict__["forward"] is hooked and not is_patched(attn)


def test_revert_under_a_later_wrapper(kernel_calls, device):
    """Another per-instance patch stacked on top (as the fused-decode patch does) keeps calling
    the forward it wrapped; reverting the RoPE patch must still switch the fused path off."""
    model = _model(device, "llama")
    ids = torch.randint(0, 97, (1, 10), device=device)
    with torch.no_grad():
        ref = model(ids).logits
    patch_model(model)
    for attn in _attention_modules(model):
        inner = attn.forward

        def outer(*args, _inner=inner, **kwargs):
            return _inner(*args, **kwargs)

        attn.forward = outer
    assert revert_model(model) == model.config.num_hidden_layers
    with torch.no_grad():
        out = model(ids).logits
    assert not kernel_calls and torch.equal(out, ref)


def test_refuses_to_drop_a_foreign_instance_forward(kernel_calls, device):
    model = _model(device, "llama")
    attn = model.model.layers[1].self_attn
    attn.forward = types.MethodType(type(attn).forward, attn)  # someone else's instance patch
    with pytest.warns(UserWarning, match="already have an instance-level forward"):
        assert patch_model(model) is False
    assert is_patched(model.model.layers[0].self_attn) and not is_patched(attn)
    revert_model(model)


def test_extended_model_runs_beyond_original_length_on_hf_flash(kernel_calls, device):
    """YaRN-extended Llama through hf_flash attention and generate, past its original 64
    positions; the fused RoPE is applied automatically and matches the eager model."""
    hf_flash.register()
    torch.manual_seed(0)
    cfg = LlamaConfig(**SMALL)
    extend_context(cfg, 256, method="yarn")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="hf_flash").to(device).eval()
    assert all(is_patched(m) for m in _attention_modules(model)), "hf_flash did not apply fused RoPE"
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    assert not any(is_patched(m) for m in _attention_modules(eager))
    ids = torch.randint(0, 97, (1, 72), device=device)
    with torch.no_grad():
        out = model(ids).logits
        ref = eager(ids).logits
        truth = copy.deepcopy(eager).double()(ids).logits
    assert kernel_calls
    _budget_check("hf_flash logits", out.float(), ref.float(), truth.float(), 2.0)
    gen = model.generate(ids, max_new_tokens=3, do_sample=False)
    gen_ref = eager.generate(ids, max_new_tokens=3, do_sample=False)
    assert gen.shape == (1, 75) and torch.equal(gen, gen_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "hf_flash"])
def test_bf16_gpu_patched_matches_unpatched(attn):
    """bf16 on the GPU, YaRN-extended, 3K tokens (past the original 1K): the patched model's
    logits and LoRA-free gradients stay within 2x (3x) the unpatched bf16 model's own error
    against the unpatched float32 model."""
    hf_flash.register()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024)  # fmt: skip
    extend_context(cfg, 4096, method="yarn")
    truth_model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").cuda().eval()
    model = copy.deepcopy(truth_model).to(torch.bfloat16)
    model.set_attn_implementation(attn)
    # start unpatched where hf_flash patched automatically (the fused-decode wrapper sits on top
    # of the RoPE patch; it only changes decode steps, which this comparison does not run)
    decode_patch.revert_model(model)
    revert_model(model)
    ids = torch.randint(0, 1000, (1, 3000), device="cuda")
    truth_logits, truth_grad = _compare(truth_model, ids)
    ref_logits, ref_grad = _compare(model, ids)
    assert patch_model(model)
    logits, grad = _compare(model, ids)
    _budget_check("bf16 logits", logits, ref_logits, truth_logits, 2.0)
    _budget_check("bf16 dq_proj", grad.float(), ref_grad.float(), truth_grad, 3.0)
    gen = model.generate(ids[:, :2000], max_new_tokens=8, do_sample=False)
    assert gen.shape == (1, 2008)
