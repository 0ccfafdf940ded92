"""Sequence parallelism (DeepSpeed Ulysses over hf_flash's kernels): 2 and 4 processes against
the single-process run (gloo and Triton's interpreter on the CPU; NCCL, one GPU per rank, on a
GPU machine), and the set-ups refused before any kernel runs."""

from __future__ import annotations

import socket

import pytest
import torch

from hf_flash.integration import sequence_parallel as spmod
from hf_flash.integration.sequence_parallel import (
    SequenceParallel, SequenceParallelError, check_sequence_parallel, shard_batch,
)
from hf_flash.reference import FWD_FACTOR, GRAD_FACTOR, allowed_error, max_abs_err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_rule(name, got, exact, lowp, factor):
    """hf_flash.reference's rule: err(got) <= factor * err(float32 oracle) + float32 floor, both
    measured against the float64 oracle."""
    assert torch.isfinite(exact).all(), f"{name}: reference not finite"
    err = max_abs_err(got, exact)
    allowed = allowed_error(max_abs_err(lowp, exact), factor, torch.float32)
    assert err <= allowed, f"{name}: max err {err:.3e} exceeds {allowed:.3e}"


@pytest.mark.parametrize(
    "world, cases", [(2, ("packed", "one_document")), (4, ("packed",))], ids=["2proc", "4proc"]
)
def test_sequence_parallel_matches_one_process(world, cases, tmp_path):
    """Loss and every LoRA gradient of a packed row whose documents cross the rank boundaries
    (and, on 2 ranks, of a single-document row: the dense kernel) equal the single-process run
    within the error rule. 4 ranks repeat the 2 key/value heads. After model.eval() nothing is
    split: a rank's whole batch gives one process's logits."""
    pytest.importorskip("deepspeed", reason="sequence parallelism needs deepspeed: pip install -e '.[sp]'")
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(f"the GPU run takes one GPU per rank: {world} needed, {torch.cuda.device_count()} here")
    import torch.multiprocessing as mp

    import sp_worker

    out = tmp_path / "result.pt"
    mp.spawn(sp_worker.run, args=(world, world, _free_port(), str(out), cases), nprocs=world, join=True)
    res = torch.load(out, weights_only=False)
    assert res["sp"] == (0, world, 1)
    assert set(res["got"]) == set(cases)
    assert res["eval_equal"], "in eval mode a rank's whole batch must run unsplit, as in one process"
    for case in cases:
        exact_loss, exact_grads = res["exact"][case]
        lowp_loss, lowp_grads = res["lowp"][case]
        got_loss, got_grads = res["got"][case]
        _assert_rule(f"{case} loss", got_loss, exact_loss, lowp_loss, FWD_FACTOR)
        assert set(got_grads) == set(exact_grads) and len(got_grads) == 2 * 5 * 2
        for n in exact_grads:
            assert exact_grads[n].abs().max() > 0, f"{n}: no gradient to compare"
            _assert_rule(f"{case} {n}", got_grads[n], exact_grads[n], lowp_grads[n], GRAD_FACTOR)


# ------------------------------------------------------------------------------------------------
# Sharding
# ------------------------------------------------------------------------------------------------


def _sp(rank, size):
    return SequenceParallel(group=None, rank=rank, size=size, dp_rank=0, dp_size=1)


def test_shard_batch_shifts_labels_before_slicing():
    ids = torch.arange(10, 22)[None]  # 12 tokens, documents [0, 5) and [5, 12)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    labels = ids.clone()
    labels[pos == 0] = -100
    batch = {"input_ids": ids, "position_ids": pos, "labels": labels,
             "cu_seq_lens_q": torch.tensor([0, 5, 12]), "max_length_q": 7}
    parts = [shard_batch(batch, _sp(r, 3), labels_shifted=False) for r in range(3)]
    assert [p["input_ids"].tolist() for p in parts] == [[[10, 11, 12, 13]], [[14, 15, 16, 17]], [[18, 19, 20, 21]]]
    assert parts[1]["position_ids"].tolist() == [[4, 0, 1, 2]]
    # the last token of a shard predicts the next shard's first token; never across a document
    assert parts[0]["shift_labels"].tolist() == [[11, 12, 13, 14]]
    assert parts[1]["shift_labels"].tolist() == [[-100, 16, 17, 18]]
    assert parts[2]["shift_labels"].tolist() == [[19, 20, 21, -100]]
    assert all("labels" not in p and "cu_seq_lens_q" not in p and "max_length_q" not in p for p in parts)
    # labels already shifted (the recipe's): sliced as they are
    done = shard_batch({"input_ids": ids, "position_ids": pos, "labels": ids + 1}, _sp(2, 3), labels_shifted=True)
    assert done["labels"].tolist() == [[19, 20, 21, 22]] and "shift_labels" not in done


def test_shard_batch_refuses_what_cannot_be_split():
    ids = torch.zeros(1, 10, dtype=torch.long)
    with pytest.raises(SequenceParallelError, match="10 tokens per row, not divisible by sp_size=4"):
        shard_batch({"input_ids": ids, "position_ids": ids}, _sp(0, 4), labels_shifted=True)
    with pytest.raises(SequenceParallelError, match="needs input_ids and position_ids"):
        shard_batch({"input_ids": ids}, _sp(0, 2), labels_shifted=True)
    mask = torch.ones(1, 10, dtype=torch.long)
    assert "attention_mask" not in shard_batch({"input_ids": ids, "position_ids": ids, "attention_mask": mask},
                                               _sp(0, 2), labels_shifted=True)
    mask[0, -2:] = 0
    with pytest.raises(SequenceParallelError, match="attention_mask has padding; pack the documents"):
        shard_batch({"input_ids": ids, "position_ids": ids, "attention_mask": mask}, _sp(0, 2), labels_shifted=True)


# ------------------------------------------------------------------------------------------------
# Bad configurations
# ------------------------------------------------------------------------------------------------


def _config(hq=32, hkv=8):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hq * 8, num_attention_heads=hq, num_key_value_heads=hkv, num_hidden_layers=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sp_size=3), "32 attention heads, not divisible by sp_size=3"),
        (dict(sp_size=4, config=(48, 6)), "6 key/value heads; Ulysses needs sp_size=4 to divide them or be a multiple"),
        (dict(sp_size=2, seq_len=1001), "seq_len=1001 is not divisible by sp_size=2"),
        (dict(sp_size=4, world_size=6), "6 process(es) cannot be split into sequence-parallel groups of sp_size=4"),
        (dict(sp_size=2, attn_implementation="sdpa"), "attn_implementation='sdpa'.*use attn_implementation='hf_flash'"),
        (dict(sp_size=0), "sp_size=0 must be an integer >= 1"),
    ],
    ids=["heads", "kv_heads", "seq_len", "world", "attention", "size"],
)
def test_bad_configurations_are_refused(kwargs, message):
    config = _config(*kwargs.pop("config", (32, 8)))
    with pytest.raises(SequenceParallelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_sequence_parallel(config, **kwargs)


def test_gqa_sizes_that_work_are_accepted():
    for sp_size in (1, 2, 4, 8, 16, 32):
        check_sequence_parallel(_config(hq=32, hkv=4 if sp_size == 16 else 8), sp_size, seq_len=2**16)
    check_sequence_parallel(_config(hq=32, hkv=2), 8)  # k/v heads repeated 4x


def test_missing_engine_is_named(monkeypatch):
    from importlib import metadata

    real = metadata.version

    def version(name):
        if name == "deepspeed":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(SequenceParallelError, match=r"deepspeed >= 0\.19\.8; deepspeed is not installed.*hf_flash\[sp\]"):
        spmod.require_deepspeed()


def test_enable_needs_torch_distributed():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_config(hq=4, hkv=2), attn_implementation="hf_flash")
    with pytest.raises(SequenceParallelError, match="needs torch.distributed initialised first"):
        spmod.enable_sequence_parallel(model, 2)


def test_trainer_with_sequence_parallel_matches_one_process(tmp_path):
    """transformers' Trainer (DDP over gloo, padding-free DataCollatorWithFlattening) made
    sequence-parallel by sequence_parallel_trainer: the logged loss and gradient norm of a step
    equal a one-process Trainer's up to float32 summation order (the float32 floor of the error
    rule). A document crosses the middle of every row, where the two ranks meet."""
    pytest.importorskip("deepspeed", reason="sequence parallelism needs deepspeed: pip install -e '.[sp]'")
    if torch.cuda.is_available():
        pytest.skip("a CPU (gloo) test of the Trainer path")
    import torch.multiprocessing as mp

    import sp_worker
    from hf_flash.reference import floor_for

    one = sp_worker.trainer_losses(1, str(tmp_path / "one"))
    out = tmp_path / "trainer.pt"
    mp.spawn(sp_worker.run_trainer, args=(2, 2, _free_port(), str(out)), nprocs=2, join=True)
    sp = torch.load(out)
    assert len(one) == len(sp) == 1
    for (la, ga), (lb, gb) in zip(one, sp):
        assert abs(la - lb) <= floor_for(torch.float32) and abs(ga - gb) <= floor_for(torch.float32), (one, sp)
