"""Packing checked through attention: each document of a packed row must get exactly the logits
and loss it gets when run alone, for hf_flash (the recipe's default) and for sdpa."""

import pytest
import torch

from hf_flash.recipes.config import RecipeConfig
from hf_flash.recipes.data import ByteTokenizer, PackedBatches, labels_for, pack_documents
from hf_flash.recipes.model import CausalLMWithLinearCE, apply_lora, build_tiny_model, load_model

# one packed row of 64 tokens, no tail; the first document is longer than the tiny Mistral's
# 32-token sliding window, so the window matters inside it
DOC_LENGTHS = (40, 11, 13)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {f: build_tiny_model(root / f, f, ByteTokenizer.vocab_size, seed=0) for f in ("llama", "mistral")}


def _model(tiny_dir, attn):
    cfg = RecipeConfig(attn_implementation=attn, dtype="float32", seq_len=64, rope_method="yarn",
                       lora_dropout=0.0, gradient_checkpointing=False)
    torch.manual_seed(0)
    model = load_model(cfg, tiny_dir, log=lambda *a: None)
    peft_model = apply_lora(model, cfg)
    with torch.no_grad():  # non-zero LoRA B so the adapters take part in the check
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return peft_model.eval(), CausalLMWithLinearCE(peft_model, "chunked", 16)


@pytest.mark.parametrize(
    "family, attn, flash_kwargs",
    [("llama", "hf_flash", True), ("llama", "hf_flash", False), ("llama", "sdpa", False),
     ("mistral", "hf_flash", True)],
    ids=["llama-hf_flash-cu_seqlens", "llama-hf_flash-position_ids", "llama-sdpa-position_ids",
         "mistral-hf_flash-cu_seqlens"],
)
def test_packed_row_equals_documents_run_alone(tiny_dirs, family, attn, flash_kwargs):
    peft_model, wrapper = _model(tiny_dirs[family], attn)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in DOC_LENGTHS]
    rows = pack_documents(docs, seq_len=64)
    batch = PackedBatches(rows, 1, 0, 1, seed=0, flash_kwargs=flash_kwargs).get(0, "cpu")
    base = peft_model.get_base_model()
    with torch.no_grad():
        attn_kwargs = {k: v for k, v in batch.items() if k not in ("input_ids", "position_ids", "labels")}
        packed = base(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **attn_kwargs).logits[0]
        packed_loss = wrapper(**batch)
        alone_loss = 0.0
        start = 0
        for doc in docs:
            ids = torch.tensor([doc])
            pos = torch.arange(len(doc))[None]
            alone = base(input_ids=ids, position_ids=pos).logits[0]
            torch.testing.assert_close(packed[start : start + len(doc)], alone, rtol=1e-5, atol=1e-5)
            alone_loss = alone_loss + wrapper(input_ids=ids, position_ids=pos, labels=labels_for(ids, pos))
            start += len(doc)
        # sensitivity: the same tokens as one continuous sequence change the later documents
        flat = base(input_ids=batch["input_ids"], position_ids=torch.arange(64)[None]).logits[0]
    torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-5, atol=1e-5)
    assert (flat[DOC_LENGTHS[0]:] - packed[DOC_LENGTHS[0]:]).abs().max() > 1e-3


def test_lora_without_input_casts_is_exact_under_autocast(tiny_dirs):
    """keep_lora_inputs_under_autocast drops peft's fp32 copy of each adapted layer's input (bf16
    weights, fp32 adapters, bf16 autocast): loss and every adapter gradient must be the same bits
    as with it; without autocast peft's cast stays on."""
    from hf_flash.training import keep_lora_inputs_under_autocast

    cfg = RecipeConfig(attn_implementation="sdpa", dtype="bfloat16", seq_len=64, rope_method="yarn",
                       lora_dropout=0.0, gradient_checkpointing=False)
    torch.manual_seed(0)
    peft_model = apply_lora(load_model(cfg, tiny_dirs["llama"], log=lambda *a: None), cfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    assert {p.dtype for n, p in peft_model.named_parameters() if "lora_" in n} == {torch.float32}
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))

    def run():
        peft_model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}

    loss_cast, grads_cast = run()
    assert keep_lora_inputs_under_autocast(peft_model) == 7 * peft_model.config.num_hidden_layers
    loss_kept, grads_kept = run()
    lora_layers = [m for m in peft_model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert lora_layers and not any(m.cast_input_dtype_enabled for m in lora_layers)
    with torch.no_grad():
        peft_model(input_ids=ids)  # no autocast: the cast is needed and back on
    assert all(m.cast_input_dtype_enabled for m in lora_layers)
    assert torch.equal(loss_cast, loss_kept)
    assert grads_cast.keys() == grads_kept.keys() and len(grads_cast) > 0
    for n in grads_cast:
        assert torch.equal(grads_cast[n], grads_kept[n]), n
