"""hf_flash.training.enable and its parts that need no GPU: the planner's choices, the chunked
loss inside a causal LM's forward (equal to transformers' own loss), and Trainer runs with the
plan applied (equal losses to the same Trainer run without it)."""

from __future__ import annotations

import pytest
import torch

import hf_flash
from hf_flash.reference import FWD_FACTOR, allowed_error
from hf_flash.training import causal_lm
from hf_flash.training.plan import LADDER, Shape, default_mlp_chunk, make_plan, predict

LLAMA3_8B = Shape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                  vocab=128256, param_bytes=2 * 8_030_000_000, trainable_params=42_000_000,
                  trainable_bytes=4 * 42_000_000)  # fmt: skip


def _tiny(attn="hf_flash", seed=0, **overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
    cfg.update(overrides)
    hf_flash.register()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(LlamaConfig(**cfg), attn_implementation=attn,
                                                dtype=torch.float32)  # fmt: skip


# ---- the planner --------------------------------------------------------------------------


def test_planner_picks_the_fastest_rung_that_fits():
    short = make_plan(LLAMA3_8B, 4096, act_bytes=2, device_budget_gib=79.0, host_budget_gib=120.0)
    assert short.name == "none" and short.fits
    long = make_plan(LLAMA3_8B, 262144, act_bytes=2, device_budget_gib=79.0, host_budget_gib=120.0)
    assert long.fits and long.checkpointing == "offload" and long.tiled_mlp_tokens and long.chunked_loss
    # the layer inputs, each held in power-of-two pieces (at most one more small piece a layer)
    assert 64.0 <= long.host_gib <= 64.0 + 32 * 2**-10
    # every rung before the chosen one was considered and predicted not to fit
    names = [name for name, *_ in LADDER]
    assert [c[0] for c in long.considered] == names
    assert all(dev > 79.0 for _, dev, _ in long.considered[:-1])


def test_planner_predictions_fall_along_the_ladder():
    peaks = [predict(LLAMA3_8B, 65536, checkpointing=ckpt, chunked_loss=chunked,
                     tiled_mlp_tokens=default_mlp_chunk(LLAMA3_8B, 65536) if tiled else None,
                     act_bytes=2)[0] for _, ckpt, chunked, tiled in LADDER]  # fmt: skip
    assert peaks == sorted(peaks, reverse=True), peaks


def test_planner_constraints_and_host_budget():
    # offload refused: the most frugal device-only rung, flagged as not fitting
    plan = make_plan(LLAMA3_8B, 262144, act_bytes=2, device_budget_gib=79.0, host_budget_gib=120.0,
                     allow={"offload": False})  # fmt: skip
    assert plan.checkpointing == "recompute" and not plan.fits and "WARNING" in plan.describe()
    # too little host memory for the offload: not fitting either
    plan = make_plan(LLAMA3_8B, 262144, act_bytes=2, device_budget_gib=79.0, host_budget_gib=40.0)
    assert plan.checkpointing == "offload" and not plan.fits
    # a forced form is taken even where a faster one fits
    plan = make_plan(LLAMA3_8B, 4096, act_bytes=2, device_budget_gib=79.0,
                     allow={"checkpointing": "keep_attention"})  # fmt: skip
    assert plan.checkpointing == "keep_attention"
    # no device budget (CPU): the first allowed rung
    assert make_plan(LLAMA3_8B, 262144, act_bytes=2, device_budget_gib=None).name == "none"
    with pytest.raises(ValueError, match="unknown plan constraints"):
        make_plan(LLAMA3_8B, 10, act_bytes=2, device_budget_gib=None, allow={"loss": True})
    # fixed values combine with the ladder's other features
    plan = make_plan(LLAMA3_8B, 262144, act_bytes=2, device_budget_gib=79.0, host_budget_gib=120.0,
                     allow={"chunked_loss": False})  # fmt: skip
    assert not plan.chunked_loss and plan.checkpointing == "offload"


def test_enable_errors_name_the_fix():
    model = _tiny("eager")
    with pytest.raises(ValueError, match="pass seq_len"):
        hf_flash.training.enable(model, log=None)
    with pytest.raises(ValueError, match="checkpointing='sometimes'"):
        hf_flash.training.enable(model, seq_len=64, checkpointing="sometimes", log=None)
    with pytest.raises(ValueError, match="offload=True needs"):
        hf_flash.training.enable(model, seq_len=64, checkpointing="none", offload=True, log=None)
    from transformers import Gemma2Config, AutoModelForCausalLM

    gemma = AutoModelForCausalLM.from_config(Gemma2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=64, final_logit_softcapping=30.0))  # fmt: skip
    with pytest.raises(causal_lm.ChunkedLossUnsupported, match="final_logit_softcapping"):
        hf_flash.training.enable(gemma, seq_len=64, chunked_loss=True, log=None)
    # "auto" leaves such a model's loss alone and says why
    lines = []
    plan = hf_flash.training.enable(gemma, seq_len=64, device_budget_gib=1e-6, log=lines.append)
    assert not plan.chunked_loss and "chunked loss is not available" in lines[0]


# ---- the chunked loss in the model's forward ----------------------------------------------


def _loss_and_grads(model, **batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("how", ["labels", "shift_labels", "num_items"])
def test_chunked_loss_equals_transformers_loss(how):
    model = _tiny("eager").train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 40), generator=g)
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt that is not trained on
    batch = {"input_ids": ids}
    batch["labels"] = labels
    if how == "shift_labels":
        # already-shifted targets (sequence parallelism passes them), used as given: here other
        # targets than the labels' own shift, so the test sees which ones were used
        batch["shift_labels"] = torch.randint(3, 128, (2, 40), generator=g)
    if how == "num_items":
        batch["num_items_in_batch"] = torch.tensor(100)
    ref, ref_grads = _loss_and_grads(model, **batch)
    causal_lm.use_chunked_loss(model, chunk_tokens=24)  # several chunks, the last one short
    got, got_grads = _loss_and_grads(model, **batch)
    assert got.logits is None
    # fp32 both ways; the sums run in another order, so within the error rule, not bitwise
    tol = allowed_error(0.0, FWD_FACTOR, torch.float32)
    assert abs(got.loss.item() - ref.loss.item()) <= tol * max(1.0, abs(ref.loss.item()))
    assert got_grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        torch.testing.assert_close(got_grads[name], ref_grad, rtol=1e-4, atol=1e-6, msg=name)
    # evaluation takes the model's own forward (logits returned), and restore undoes the patch
    model.eval()
    with torch.no_grad():
        assert model(**batch).logits is not None
    assert causal_lm.restore_loss(model) and not causal_lm.uses_chunked_loss(model)


# ---- Trainer ------------------------------------------------------------------------------


def _trainer_losses(tmp_path, tag, plan_kwargs=None, gradient_checkpointing=False):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # the adapters' initialisation
    model = get_peft_model(_tiny("hf_flash").train(), LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                            "up_proj", "down_proj"], task_type="CAUSAL_LM"))  # fmt: skip
    plan = None
    if plan_kwargs is not None:
        plan = hf_flash.training.enable(model, log=None, **plan_kwargs)
    g = torch.Generator().manual_seed(0)
    docs = [{"input_ids": torch.randint(3, 128, (n,), generator=g).tolist()}
            for n in (9, 17, 5, 12, 20, 7, 14, 11)]  # fmt: skip
    args = TrainingArguments(
        output_dir=str(tmp_path / tag), max_steps=2, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0, data_seed=0,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        gradient_checkpointing=gradient_checkpointing,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=docs, data_collator=DataCollatorWithFlattening())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], plan, model


def test_trainer_with_the_plan_matches_trainer_without(tmp_path, launches):
    ref, _, _ = _trainer_losses(tmp_path, "plain")
    # a budget no rung fits forces the most frugal device-only form the constraints allow:
    # keep-attention checkpointing and the chunked loss, asked for through TrainingArguments too
    got, plan, model = _trainer_losses(
        tmp_path, "planned", dict(seq_len=64, checkpointing="keep_attention", device_budget_gib=1e-6, tiled_mlp=False),
        gradient_checkpointing=True,
    )  # fmt: skip
    assert plan.checkpointing == "keep_attention" and plan.chunked_loss
    assert causal_lm.uses_chunked_loss(model)
    assert hf_flash.training.plan_of(model) is plan
    assert model.get_base_model().is_gradient_checkpointing
    assert launches["fwd"] > 0 and launches["bwd"] > 0
    assert len(got) == len(ref) == 2
    for a, b in zip(got, ref):
        # the Trainer rounds logged losses to 4 decimals
        assert abs(a - b) <= allowed_error(0.0, FWD_FACTOR, torch.float32) + 1e-4, (got, ref)


def test_trainer_with_every_memory_feature_matches_trainer_without(tmp_path):
    ref, _, _ = _trainer_losses(tmp_path, "plain")
    # nothing fits a tiny budget: the ladder's last rung (offload + tiled MLP + chunked loss)
    got, plan, model = _trainer_losses(tmp_path, "frugal", dict(seq_len=64, device_budget_gib=1e-6))
    assert (plan.checkpointing, plan.chunked_loss) == ("offload", True) and plan.tiled_mlp_tokens
    assert not plan.fits
    for a, b in zip(got, ref):
        # the tiled MLP sums its parameter gradients per chunk: fp32 rounding, well inside the
        # loss's error rule after one Adam step; the Trainer rounds logged losses to 4 decimals
        assert abs(a - b) <= allowed_error(0.0, FWD_FACTOR, torch.float32) + 1e-4, (got, ref)


# ---- TRL's SFTTrainer ---------------------------------------------------------------------


def _tokenizer():
    """A word-level tokenizer over the tiny vocabulary, built in memory (no files, no hub)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>", bos_token="<s>", eos_token="</s>",
    )  # fmt: skip


def _sft_losses(tmp_path, tag, plan_kwargs=None):
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from peft import LoraConfig

    g = torch.Generator().manual_seed(0)
    docs = Dataset.from_list([{"input_ids": torch.randint(3, 128, (n,), generator=g).tolist()}
                              for n in (9, 17, 5, 12, 20, 7, 14, 11)])  # fmt: skip
    model = _tiny("hf_flash").train()
    args = trl.SFTConfig(
        output_dir=str(tmp_path / tag), max_steps=2, per_device_train_batch_size=2,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0, data_seed=0,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, packing=True,
        padding_free=True, max_length=64, bf16=False,
    )  # fmt: skip
    torch.manual_seed(0)  # the adapters' initialisation
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=docs, processing_class=_tokenizer(),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj",
                                                                   "down_proj"], task_type="CAUSAL_LM"),
    )  # fmt: skip
    plan = hf_flash.training.enable(trainer.model, log=None, **plan_kwargs) if plan_kwargs else None
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], plan


def test_sft_trainer_with_the_plan_matches_sft_trainer_without(tmp_path, launches):
    ref, _ = _sft_losses(tmp_path, "plain")
    assert launches["fwd"] > 0 and launches["bwd"] > 0  # packed rows through hf_flash
    got, plan = _sft_losses(tmp_path, "frugal", dict(seq_len=64, device_budget_gib=1e-6))
    assert plan.checkpointing == "offload" and plan.tiled_mlp_tokens, plan.describe()
    assert len(got) == len(ref) == 2
    for a, b in zip(got, ref):
        assert abs(a - b) <= allowed_error(0.0, FWD_FACTOR, torch.float32) + 1e-4, (got, ref)
