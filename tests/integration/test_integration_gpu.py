"""GPU-only integration checks (``-m gpu``): bfloat16 at realistic lengths, inductor, and the
static-cache decode path captured in a CUDA graph (which fails on any host sync).

The per-family bf16 cases live in test_models.py (their bf16 parameters are marked gpu); the
float32 model tests there also run on the GPU, where generate compiles static-cache decoding.
"""

from __future__ import annotations

import pytest
import torch

import hf_flash
from hf_flash.integration.attention import hf_flash_attention_forward
from hf_flash.reference import FWD_FACTOR, GRAD_FACTOR, assert_close_to_ref
from test_attention_fn import _Attn, _mask, _oracle, _query_rows
from tiny_models import assert_model_close

pytestmark = pytest.mark.gpu

hf_flash.register()


def _medium(family, attn, dtype, root):
    import transformers

    path = root / family
    if not path.exists():
        cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[family]
        extra = {"sliding_window": 256} if family == "mistral" else {}
        config = cls(
            hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096, **extra,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn, dtype=dtype
    )
    return model.cuda()


def _loss_sum(logits, ids, valid):
    """Sum of next-token cross-entropies over the valid positions of one row, and their count."""
    n = int(valid.sum())
    lg, tgt = logits[0, : n - 1].float(), ids[0, 1:n]
    return torch.nn.functional.cross_entropy(lg, tgt, reduction="sum"), n - 1


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_bf16_padded_training_step_at_1k(family, root):
    """Right-padded 1K batch through hf_flash against eager run on each row *without* its
    padding (float64 truth, bf16 budget): logits of the real tokens, the loss and a gradient.
    Eager itself cannot be the truth on the padded batch: with a sliding window, pad queries
    that see no valid key give NaN in float64 eager, and the NaN reaches real rows through the
    next layer's pad keys (masking adds to the scores after the NaN product)."""
    ours = _medium(family, "hf_flash", torch.bfloat16, root).train()
    lowp = _medium(family, "eager", torch.bfloat16, root).train()
    exact = _medium(family, "eager", torch.float64, root).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1024, (2, 1024), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, 700:] = 0
    labels = ids.masked_fill(mask == 0, -100)

    out = ours(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    got = (out.logits.detach()[mask.bool()], out.loss.detach(), ours.model.layers[0].self_attn.q_proj.weight.grad)

    res = {}
    for name, m in (("lowp", lowp), ("exact", exact)):
        logits, total, count = [], 0.0, 0
        for b in range(2):
            n = int(mask[b].sum())
            row = m(input_ids=ids[b : b + 1, :n]).logits
            s, c = _loss_sum(row, ids[b : b + 1], mask[b])
            logits.append(row[0].detach())
            total, count = total + s, count + c
        loss = total / count
        loss.backward()
        res[name] = (torch.cat(logits), loss.detach(), m.model.layers[0].self_attn.q_proj.weight.grad)
    for i, what in enumerate(("logits", "loss", "grad")):
        factor = GRAD_FACTOR if what == "grad" else FWD_FACTOR
        assert_model_close(what, got[i], res["exact"][i], res["lowp"][i], factor, torch.bfloat16)


def test_inductor_training_step(root):
    """torch.compile (inductor) around the whole model: loss and gradients by the error rule."""
    ours = torch.compile(_medium("llama", "hf_flash", torch.bfloat16, root).train())
    lowp = _medium("llama", "eager", torch.bfloat16, root).train()
    exact = _medium("llama", "eager", torch.float64, root).train()
    ids = torch.randint(3, 1024, (2, 512), generator=torch.Generator().manual_seed(1)).cuda()
    res = {}
    for name, m in (("ours", ours), ("lowp", lowp), ("exact", exact)):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        inner = getattr(m, "_orig_mod", m)
        res[name] = (loss.detach(), inner.model.layers[1].self_attn.k_proj.weight.grad)
    assert_model_close("loss", res["ours"][0], res["exact"][0], res["lowp"][0], FWD_FACTOR, torch.bfloat16)
    assert_model_close("grad", res["ours"][1], res["exact"][1], res["lowp"][1], GRAD_FACTOR, torch.bfloat16)


def test_static_cache_decode_is_cuda_graph_capturable():
    """The StaticCache decode call (zero-padded buffer + 2-D mask) issues no host sync: it is
    captured in a CUDA graph and replayed with new contents."""
    torch.manual_seed(2)
    b, hq, hkv, d, lmax = 2, 8, 2, 64, 256
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(b, hkv, lmax, d, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    mask = torch.zeros(b, 100, dtype=torch.bool, device="cuda")
    module = _Attn(True, torch.bfloat16).cuda()

    def fill(length, pads):
        k.zero_(), v.zero_()
        k[:, :, :length] = torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16)
        v[:, :, :length] = torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16)
        q.copy_(torch.randn_like(q))
        mask.copy_(_mask("cuda", b, 100, pads))

    fill(100, [(10, 0), (0, 0)])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        hf_flash_attention_forward(module, q, k, v, mask)  # warm-up (compiles the kernels)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = hf_flash_attention_forward(module, q, k, v, mask)
    fill(100, [(37, 0), (3, 0)])
    graph.replay()
    torch.cuda.synchronize()
    ref = _oracle(q, k, v, mask, causal=True)
    lp = _oracle(q, k, v, mask, causal=True, upcast=False)
    rows = _query_rows("cuda", mask, 1, b)
    assert_close_to_ref("graph replay", out[rows], ref[rows], lp[rows], FWD_FACTOR, torch.bfloat16)


def test_compiled_static_generate_matches_dynamic(root):
    """generate() compiles static-cache decoding on CUDA (CUDA graphs): it must give the same
    tokens as the uncompiled DynamicCache path, with a left-padded batch."""
    model = _medium("llama", "hf_flash", torch.float32, root).eval()
    ids = torch.randint(3, 1024, (2, 40), generator=torch.Generator().manual_seed(3)).cuda()
    mask = torch.ones_like(ids)
    ids[0, :9] = 0
    mask[0, :9] = 0
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    dynamic = model.generate(ids, attention_mask=mask, **gen)
    static = model.generate(ids, attention_mask=mask, cache_implementation="static", **gen)
    assert torch.equal(static, dynamic)
