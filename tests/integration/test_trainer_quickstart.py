"""The README's Trainer quick start: a model loaded with attn_implementation="hf_flash", packed
batches from DataCollatorWithFlattening, transformers' Trainer. Two optimiser steps on a tiny
Llama must give the losses eager attention gives (float32, hf_flash.reference's error rule on
the loss) and must run hf_flash's attention."""

from __future__ import annotations

import torch
from tiny_models import load

import hf_flash
from hf_flash.reference import FWD_FACTOR, allowed_error


def _train(path_root, attn: str, tmp_path) -> list[float]:
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    model = load("llama", attn, path_root).train()
    g = torch.Generator().manual_seed(0)
    # eight documents of different lengths, packed four per batch into one row
    docs = [{"input_ids": torch.randint(3, 128, (n,), generator=g).tolist()}
            for n in (9, 17, 5, 12, 20, 7, 14, 11)]  # fmt: skip
    args = TrainingArguments(
        output_dir=str(tmp_path / attn), max_steps=2, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        data_seed=0, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=docs,
                      data_collator=DataCollatorWithFlattening())  # fmt: skip
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_flattening_collator_matches_eager(root, tmp_path, launches):
    hf_flash.register()
    ours = _train(root, "hf_flash", tmp_path)
    # forward and backward kernels ran: the packed batches reached hf_flash, not another path
    assert launches["fwd"] > 0 and launches["bwd"] > 0, launches
    eager = _train(root, "eager", tmp_path)
    assert len(ours) == len(eager) == 2
    for a, b in zip(ours, eager):
        # the logged loss is rounded to 4 decimals by the Trainer
        assert abs(a - b) <= allowed_error(0.0, FWD_FACTOR, torch.float32) + 1e-4, (ours, eager)
