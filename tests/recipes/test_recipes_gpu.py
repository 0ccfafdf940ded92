"""The recipe on a CUDA GPU: bf16 weights, bf16 autocast, hf_flash kernels compiled for the device."""

import json
from pathlib import Path

import pytest
import torch

from hf_flash.recipes.config import load_config
from hf_flash.recipes.data import IGNORE_INDEX
from hf_flash.training.loss import chunked_linear_cross_entropy, full_linear_cross_entropy

pytestmark = pytest.mark.gpu
TINY = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "tiny.yaml"


def test_chunked_loss_matches_full_in_bf16():
    torch.manual_seed(0)
    n, h, v = 3000, 512, 32000
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[::7] = IGNORE_INDEX
    got = chunked_linear_cross_entropy(hidden, weight, labels, 700)
    got.backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref = full_linear_cross_entropy(hidden, weight, labels)
    ref.backward()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=0)
    torch.testing.assert_close(gh.float(), hidden.grad.float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw.float(), weight.grad.float(), rtol=2e-2, atol=2e-3)


def test_tiny_recipe_trains_in_bf16_at_long_context(tmp_path):
    from hf_flash.recipes.lora_long_context import train

    cfg = load_config([
        "--config", str(TINY), "--dtype", "bfloat16", "--mixed_precision", "bf16",
        "--seq_len", "2048", "--gradient_checkpointing", "true", "--max_steps", "30",
        "--synthetic_documents", "256", "--output_dir", str(tmp_path), "--progress", "false",
        "--save_every", "0",
    ])
    summary = train(cfg)
    losses = [json.loads(l)["loss"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses
    assert summary["peak_mem_gib"] < 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_config_on_two_gpus_trains_saves_and_resumes(tmp_path):
    import os
    import subprocess
    import sys

    repo = TINY.parents[2]
    base = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(repo / "recipes/configs/accelerate_fsdp.yaml"), "--num_processes", "2",
        "-m", "hf_flash.recipes.lora_long_context", "--config", str(TINY), "--dtype", "bfloat16",
        "--mixed_precision", "bf16", "--seq_len", "2048", "--gradient_checkpointing", "true",
        "--max_steps", "6", "--save_every", "3", "--synthetic_documents", "128",
        "--output_dir", str(tmp_path), "--progress", "false",
    ]
    env = dict(os.environ, PYTHONPATH=str(repo))
    first = subprocess.run(base + ["--interrupt_after", "4"], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "2 process(es), FSDP" in first.stdout
    second = subprocess.run(base + ["--resume", "--save_merged", "true"], cwd=repo, env=env,
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout and "at step 3" in second.stdout
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "merged" / "config.json").is_file()
