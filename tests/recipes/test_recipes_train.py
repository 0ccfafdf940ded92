"""End-to-end recipe runs on the embedded tiny model with hf_flash attention (Triton interpreter on
CPU, fp32): the loss falls, an interrupted-then-resumed run reproduces the uninterrupted losses
exactly, a two-process accelerate (gloo) run completes, and bad set-ups fail before training."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_flash.recipes.config import ConfigError, load_config
from hf_flash.recipes.lora_long_context import main, train
from hf_flash.recipes.model import lr_lambda

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "configs" / "tiny.yaml"

# 64-token rows extend the tiny model's 32-token context 2x with YaRN
BASE = [
    "--config", str(TINY), "--seq_len", "64", "--max_steps", "12", "--learning_rate", "1e-2",
    "--warmup_steps", "2", "--lora_dropout", "0.1", "--save_every", "4", "--progress", "false",
    "--synthetic_documents", "24",
]


def _losses(out: Path) -> list:
    return [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    summary = train(load_config(
        BASE + ["--output_dir", str(out), "--save_merged", "true", "--profile_step", "6"]))
    return out, summary


def test_loss_decreases_and_outputs_are_saved(uninterrupted):
    out, summary = uninterrupted
    losses = _losses(out)
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    assert (out / "adapter" / "adapter_config.json").is_file()
    base_config = json.loads((out / "adapter" / "base_config" / "config.json").read_text())
    assert base_config["rope_parameters"]["rope_type"] == "yarn"
    assert (out / "merged" / "config.json").is_file()
    assert (out / "checkpoints" / "latest").read_text() == "step-000008"
    assert summary["steps"] == 12 and summary["tok_per_s"] > 0
    # the profiled step: hf_flash's attention and the chunked loss among the host operators
    profile = (out / "profile-step6.txt").read_text()
    assert "_AttnEager" in profile and "_ChunkedLinearCrossEntropy" in profile, profile[:2000]


def test_interrupted_then_resumed_run_reproduces_losses(uninterrupted, tmp_path):
    full_out, _ = uninterrupted
    out = tmp_path / "resumed"
    args = BASE + ["--output_dir", str(out)]
    # stops after step 5: the checkpoint of step 4 is the latest, step 5 is lost and redone
    assert train(load_config(args + ["--interrupt_after", "5"])) == {"interrupted_at": 5}
    (out / "checkpoints" / ".tmp-step-000005").mkdir()  # a save killed half-way
    assert main(args + ["--resume"]) == 0
    assert _losses(out) == _losses(full_out)  # exact, step by step
    assert not (out / "checkpoints" / ".tmp-step-000005").exists()


def test_resume_refuses_changed_options(uninterrupted, capsys):
    full_out, _ = uninterrupted
    assert main(BASE + ["--output_dir", str(full_out), "--resume", "--seq_len", "96"]) == 2
    assert "options differ" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lora_target_modules", "[q_proj, query_key_value]"], "match no module"),
        (["--seq_len", "32"], "is not above the model's original context of 32"),
        (["--rope_method", "none"], "exceeds the model's context (32)"),
        (["--max_memory_gib", "0.0001"], "predicted peak memory"),
        (["--attn_implementation", "not_an_attention"], "is not registered with transformers"),
        (["--resume"], "no complete checkpoint"),
        (["--synthetic_documents", "1", "--micro_batch_size", "8"], "fewer than"),
        (["--memory_plan", "fixed", "--tiled_mlp_tokens", "16"], "tiled_mlp_tokens needs memory_plan: auto"),
        (["--gradient_checkpointing", "true", "--offload_activations", "true", "--keep_attention_outputs",
          "true"], "the offload recomputes the attention"),  # fmt: skip
        (["--memory_plan", "sometimes"], "choose auto or fixed"),
    ],
    ids=["lora_targets", "short_seq", "no_rope", "memory", "attn", "resume", "no_data", "tiled_fixed",
         "offload_keep", "plan_name"],  # fmt: skip
)
def test_bad_setups_fail_before_training(extra, message, tmp_path, capsys):
    out = tmp_path / "bad"
    assert main(BASE + ["--output_dir", str(out)] + extra) == 2
    assert message in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists() or _losses(out) == []


def test_data_files_are_read_and_bad_fields_reported(tmp_path, capsys):
    data = tmp_path / "docs.jsonl"
    rows = [{"body": "a long text " * 20}] * 8
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    assert main(BASE + ["--output_dir", str(out), "--data", str(data)]) == 2
    assert "has no field 'text' (set text_field)" in capsys.readouterr().err
    summary = train(load_config(BASE + [
        "--output_dir", str(out), "--data", str(data), "--text_field", "body", "--max_steps", "1", "--warmup_steps", "0",
        "--save_every", "0",
    ]))
    assert summary["steps"] == 1


@pytest.mark.slow
def test_two_process_accelerate_launch(tmp_path):
    out = tmp_path / "ddp"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    # "--multi_gpu" selects accelerate's torchrun launcher; without a GPU each process then
    # runs as MULTI_CPU over gloo ("--cpu" alone would start a single process)
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "-m", "hf_flash.recipes.lora_long_context", *BASE, "--output_dir", str(out), "--max_steps", "3",
        "--save_every", "2",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 process(es), MULTI_CPU, backend gloo" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    # the schedule advances once per optimiser step, whatever the number of processes
    cfg = load_config(BASE + ["--max_steps", "3"])
    lrs = [json.loads(l)["lr"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([cfg.learning_rate * lr_lambda(cfg)(k) for k in (1, 2, 3)])
    assert (out / "checkpoints" / "step-000002" / "random_states_1.pkl").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_gradient_checkpointing_keeps_attention_outputs(tmp_path, monkeypatch):
    """The recipe's default with gradient checkpointing: the attention forward kernel runs once per
    layer per step instead of twice, and the run is otherwise identical (losses, gradient norms)."""
    from hf_flash.kernels import flash_fwd

    launches = []
    launcher = flash_fwd.flash_attn_forward
    monkeypatch.setattr(
        flash_fwd, "flash_attn_forward", lambda *a, **k: launches.append(1) or launcher(*a, **k)
    )
    args = BASE + ["--gradient_checkpointing", "true", "--max_steps", "2", "--save_every", "0",
                   "--save_adapter", "false"]  # fmt: skip
    runs = {}
    for keep in ("true", "false"):
        launches.clear()
        out = tmp_path / keep
        summary = train(load_config(args + ["--output_dir", str(out), "--keep_attention_outputs", keep]))
        metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        runs[keep] = (len(launches), [(m["loss"], m["grad_norm"]) for m in metrics], summary)
    layers, steps = 2, 2  # the embedded tiny model; one micro-batch per step
    assert runs["true"][0] == layers * steps and runs["false"][0] == 2 * layers * steps
    assert runs["true"][1] == runs["false"][1]  # exact
    assert runs["true"][2]["keep_attention_outputs"] is True
    assert runs["false"][2]["keep_attention_outputs"] is False


def _launch(nproc: int, args: list, out: Path) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "-m", "hf_flash.recipes.lora_long_context", *args, "--output_dir", str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


SP_ARGS = BASE + ["--lora_dropout", "0", "--max_steps", "2", "--save_every", "0", "--save_adapter", "false",
                  "--gradient_checkpointing", "true", "--gradient_accumulation_steps", "2"]


def test_sequence_parallel_groups_match_data_parallel(tmp_path):
    """4 processes in 2 groups of sp_size 2 (DeepSpeed Ulysses, hf_flash attention, kept attention
    outputs, gradient accumulation) train the same rows as 2 data-parallel processes: the same
    losses and gradient norms up to float32 summation order (the float32 floor of
    hf_flash.reference's error rule), so the loss scale, the groups' rows and the token counts are
    right. The synthetic rows pack several documents, some crossing the middle of a row, where
    the two ranks of a group meet. No LoRA dropout: each rank draws the masks of its own tokens."""
    pytest.importorskip("deepspeed", reason="sequence parallelism needs deepspeed: pip install -e '.[sp]'")
    from hf_flash.reference import floor_for

    _launch(2, SP_ARGS, tmp_path / "dp2")
    proc = _launch(4, SP_ARGS + ["--sp_size", "2"], tmp_path / "dp2sp2")
    assert "2 group(s) of sp_size=2, 32 tokens of each row per process" in proc.stdout
    rows = [[json.loads(l) for l in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("dp2", "dp2sp2")]
    assert [r["tokens"] for r in rows[1]] == [r["tokens"] for r in rows[0]] == [256, 512]
    for a, b in zip(*rows):
        assert abs(a["loss"] - b["loss"]) <= floor_for(torch.float32), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= floor_for(torch.float32), (a, b)
    assert json.loads((tmp_path / "dp2sp2" / "summary.json").read_text())["sp_size"] == 2


def test_sequence_parallel_bad_setups_fail_at_start(tmp_path, capsys):
    with pytest.raises(ConfigError, match="seq_len=66 is not divisible by sp_size=4"):
        load_config(BASE + ["--seq_len", "66", "--sp_size", "4"])
    with pytest.raises(ConfigError, match="sp_size=2 runs hf_flash's kernels.*attn_implementation='sdpa'"):
        load_config(BASE + ["--sp_size", "2", "--attn_implementation", "sdpa"])
    # one process cannot hold a group of two: refused before the model is built
    with pytest.raises(ConfigError, match="1 process\\(es\\) cannot be split into sequence-parallel groups of sp_size=2"):
        train(load_config(BASE + ["--sp_size", "2", "--output_dir", str(tmp_path)]))
    assert not (tmp_path / "tiny-llama-base").exists()


def test_checkpoints_from_before_sp_size_still_resume():
    """sp_size became a resume key later: a checkpoint without it was written with sp_size 1."""
    from hf_flash.recipes.checkpoint import RESUME_KEYS, resume_differences

    cfg = load_config(BASE)
    state = {"world_size": 1, "config": {k: cfg.to_dict()[k] for k in RESUME_KEYS if k != "sp_size"}}
    assert resume_differences(state, cfg, 1) == []
    cfg.sp_size = 2
    assert resume_differences(state, cfg, 2) == ["sp_size: checkpoint 1, now 2", "processes: checkpoint 1, now 2"]


def test_resume_with_offload_and_tiled_mlp_reproduces_losses(tmp_path):
    """The memory features on (checkpointed inputs offloaded, the MLP in 24-token chunks of the
    64-token rows, LoRA dropout replayed per chunk): an interrupted-then-resumed run still gives
    the uninterrupted run's losses exactly, and the plan is recorded."""
    args = BASE[:BASE.index("--max_steps")] + ["--max_steps", "8"] + BASE[BASE.index("--max_steps") + 2:] + [
        "--gradient_checkpointing", "true", "--keep_attention_outputs", "false",
        "--offload_activations", "true", "--tiled_mlp_tokens", "24",
    ]  # fmt: skip
    full = train(load_config(args + ["--output_dir", str(tmp_path / "full")]))
    assert full["memory_plan"] == "offloaded checkpointing + tiled MLP + chunked loss"
    assert full["tiled_mlp_tokens"] == 24 and full["offload_activations"]
    out = tmp_path / "resumed"
    assert train(load_config(args + ["--output_dir", str(out), "--interrupt_after", "5"])) == {"interrupted_at": 5}
    assert main(args + ["--output_dir", str(out), "--resume"]) == 0
    assert _losses(out) == _losses(tmp_path / "full")
