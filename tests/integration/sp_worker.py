"""One process of the sequence-parallel CPU tests (spawned by test_sequence_parallel.py).

Every process builds the same tiny LoRA Llama (4 query / 2 key-value heads, so 4 ranks repeat
k/v heads), computes the single-process references on the whole batch (sdpa over each document
on its own, in float64: the exact oracle; in float32: the oracle in the test dtype), then enables sequence parallelism
and runs hf_flash on its slice. Rank 0 writes the losses and the summed LoRA gradients to a file.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

VOCAB = 128
IGNORE = -100

# documents of a packed 48-token row: boundaries at 5, 25, 34; shards of 24 (2 ranks) or 12
# (4 ranks) cut documents at 12, 24 and 36
PACKED = [5, 20, 9, 14]


def batches(device="cpu", cases=("packed", "one_document")):
    g = torch.Generator().manual_seed(1)
    out = {}
    for name, lens in (("packed", PACKED), ("one_document", [sum(PACKED)])):
        if name not in cases:
            continue
        ids = torch.randint(3, VOCAB, (1, sum(lens)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        labels = ids.clone()
        labels[pos == 0] = IGNORE  # DataCollatorWithFlattening's convention: the model shifts
        out[name] = {"input_ids": ids.to(device), "position_ids": pos.to(device), "labels": labels.to(device)}
    return out


def model(attn: str, dtype, device="cpu"):
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():  # attention far from uniform, so a lost document boundary shows
        for name, p in m.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(20.0)
    m = get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
                                     init_lora_weights=False))  # random A and B: both get gradients
    return m.to(device=device, dtype=dtype).train()


def lora_grads(m) -> dict:
    return {n: p.grad.detach().clone() for n, p in m.named_parameters() if "lora_" in n}


def _cpu(res: dict) -> dict:
    return {k: (loss.cpu(), {n: g.cpu() for n, g in grads.items()}) for k, (loss, grads) in res.items()}


def single_process(attn: str, dtype, device="cpu", cases=("packed", "one_document")) -> dict:
    """The oracle: each document of the row run on its own (no packing logic involved),
    transformers' own label shift, the token-weighted mean over the row."""
    m = model(attn, dtype, device)
    res = {}
    for name, b in batches(device, cases).items():
        m.zero_grad()
        starts = (b["position_ids"][0] == 0).nonzero().flatten().tolist() + [b["input_ids"].shape[1]]
        count = int((b["labels"][:, 1:] != IGNORE).sum())  # no document start is a target
        total = 0.0
        for lo, hi in zip(starts[:-1], starts[1:]):
            doc = {k: v[:, lo:hi] for k, v in b.items()}
            n = int((doc["labels"][:, 1:] != IGNORE).sum())
            loss = m(input_ids=doc["input_ids"], labels=doc["labels"]).loss * (n / count)
            loss.backward()
            total = total + loss.detach()
        res[name] = (total, lora_grads(m))
    return _cpu(res)


def run(rank: int, world: int, sp_size: int, port: int, out_path: str, cases=("packed", "one_document")) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = "cpu"
    if torch.cuda.is_available():  # the device run: one GPU per rank, NCCL
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device != "cpu" else "gloo", rank=rank, world_size=world)
    try:
        _run(rank, world, sp_size, out_path, device, cases)
    finally:
        dist.destroy_process_group()


def _run(rank, world, sp_size, out_path, device, cases):
    import hf_flash  # noqa: F401  (registers "hf_flash")
    from hf_flash.integration.sequence_parallel import enable_sequence_parallel, shard_batch

    exact = single_process("sdpa", torch.float64, device, cases) if rank == 0 else None
    lowp = single_process("sdpa", torch.float32, device, cases) if rank == 0 else None

    m = model("hf_flash", torch.float32, device)
    sp = enable_sequence_parallel(m, sp_size, seq_len=sum(PACKED))
    got = {}
    for name, b in batches(device, cases).items():
        m.zero_grad()
        part = shard_batch(b, sp, labels_shifted=False)
        logits = m(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits
        y = part["shift_labels"].reshape(-1)
        loss_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y, ignore_index=IGNORE, reduction="sum")
        count = (y != IGNORE).sum().float()
        dist.all_reduce(count, group=sp.group)
        loss = loss_sum / count
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=sp.group)
        grads = lora_grads(m)
        for g in grads.values():
            dist.all_reduce(g, group=sp.group)
        got[name] = (total, grads)
    # in eval mode nothing is split: every rank runs its whole batch, as one process would
    b = batches(device, ("packed",))["packed"]
    m.eval()
    with torch.no_grad():
        whole = m(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
    m.train()
    alone = model("hf_flash", torch.float32, device).eval()
    with torch.no_grad():
        reference = alone(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
    eval_equal = bool(torch.equal(whole, reference))
    if rank == 0:
        torch.save({"exact": exact, "lowp": lowp, "got": _cpu(got), "sp": (sp.rank, sp.size, sp.dp_size),
                    "eval_equal": eval_equal}, out_path)


# ------------------------------------------------------------------------------------------------
# transformers Trainer (DDP over gloo) with sequence_parallel_trainer
# ------------------------------------------------------------------------------------------------

DOC = 16  # tokens per document; three per packed row: boundaries at 16 and 32 of 48


def trainer_losses(sp_size: int, out_dir: str) -> list:
    """One optimiser step of a Trainer on packed rows of three 16-token documents (the middle
    one crosses the middle of the row), DataCollatorWithFlattening, hf_flash; the logged
    (loss, grad_norm)."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from hf_flash.integration.sequence_parallel import sequence_parallel_trainer

    g = torch.Generator().manual_seed(2)
    doc = torch.randint(3, VOCAB, (DOC,), generator=g).tolist()
    dataset = [{"input_ids": doc} for _ in range(12)]  # every row alike: any sampler order gives it
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=3, max_steps=1, learning_rate=1e-2, warmup_steps=0,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True, **({"ddp_backend": "gloo"} if sp_size > 1 else {}),
    )
    m = model("hf_flash", torch.float32)
    trainer = Trainer(model=m, args=args, train_dataset=dataset, data_collator=DataCollatorWithFlattening())
    sequence_parallel_trainer(trainer, sp_size)
    trainer.train()
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def run_trainer(rank: int, world: int, sp_size: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import hf_flash  # noqa: F401

    logs = trainer_losses(sp_size, os.path.dirname(out_path) + f"/trainer-{rank}")
    if rank == 0:
        torch.save(logs, out_path)
    dist.destroy_process_group()
    _leave()


def _leave() -> None:
    """End a spawned worker once its results are saved, without the interpreter's teardown: a
    fresh CI venv once aborted there ("terminate called without an active exception", after
    both ranks had trained and written their results), which spawn reports as a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
