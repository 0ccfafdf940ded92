"""Atomic, resumable checkpoints.

Layout under ``<output_dir>/checkpoints/``::

    step-000100/          complete checkpoints (accelerate state + trainer_state.json)
    .tmp-step-000200/     a save in progress (removed at the next start)
    latest                text file naming the newest complete checkpoint

A save writes everything into ``.tmp-step-N``, flushes it to disk, renames it to ``step-N`` and
only then replaces ``latest`` (write + fsync + ``os.replace``). A kill at any moment leaves
``latest`` naming a complete checkpoint. accelerate's state holds the trainable weights (LoRA
only: frozen base weights are not copied into every checkpoint unless FSDP shards them), the
optimizer, the LR scheduler and every process's Python/NumPy/torch/CUDA RNG states; the data
position is the optimiser step (batches are a pure function of the step, see data.PackedBatches).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from .config import ConfigError

STATE_FILE = "trainer_state.json"
# options that must match between a run and its resumption for the loss curve to continue
RESUME_KEYS = (
    "model", "tiny_model", "data", "seq_len", "rope_method", "rope_factor", "micro_batch_size",
    "gradient_accumulation_steps", "seed", "lora_r", "lora_alpha", "lora_target_modules",
    "max_steps", "learning_rate", "warmup_steps", "min_lr_ratio", "dtype", "sp_size",
)
# resume keys added after checkpoints were written without them: the value those runs had
RESUME_DEFAULTS = {"sp_size": 1}


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoints_dir(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def latest_checkpoint(output_dir) -> Optional[Path]:
    root = checkpoints_dir(output_dir)
    marker = root / "latest"
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"{marker} names {path}, which is not a complete checkpoint")
    return path


def clean_partial(output_dir) -> None:
    root = checkpoints_dir(output_dir)
    if root.is_dir():
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def trainable_only_hook(models, weights, output_dir):
    """accelerate save pre-hook: keep only trainable tensors (the LoRA weights) in the state."""
    for i, (model, sd) in enumerate(zip(models, weights)):
        keep = {n for n, p in model.named_parameters() if p.requires_grad}
        weights[i] = {k: v for k, v in sd.items() if k in keep}


def save_checkpoint(accelerator, output_dir, step: int, trainer_state: dict, keep: int) -> Path:
    root = checkpoints_dir(output_dir)
    name = f"step-{step:06d}"
    tmp = root / f".tmp-{name}"
    final = root / name
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=1))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        marker_tmp = root / "latest.tmp"
        with open(marker_tmp, "w") as fh:
            fh.write(name)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(marker_tmp, root / "latest")
        _fsync_dir(root)
        done = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def resume_differences(state: dict, cfg, num_processes: int) -> list[str]:
    """What differs between a checkpoint's ``state`` and this run (empty: it may resume)."""
    saved = {**RESUME_DEFAULTS, **state.get("config", {})}
    current = cfg.to_dict()
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in RESUME_KEYS if saved.get(k) != current.get(k)]
    if state.get("world_size") != num_processes:
        diffs.append(f"processes: checkpoint {state.get('world_size')}, now {num_processes}")
    return diffs


def load_checkpoint(accelerator, path: Path, cfg) -> dict:
    state = json.loads((path / STATE_FILE).read_text())
    diffs = resume_differences(state, cfg, accelerator.num_processes)
    if diffs:
        raise ConfigError(
            f"cannot resume from {path}: options differ from the checkpointed run:\n  - "
            + "\n  - ".join(diffs)
        )
    weights = path / "model.safetensors"
    if weights.is_file():  # single process / DDP: only the trainable tensors were saved
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as fh:
            saved_keys = set(fh.keys())
        model = accelerator._models[0]
        missing = sorted(n for n, p in model.named_parameters() if p.requires_grad and n not in saved_keys)
        if missing:
            raise ConfigError(f"{path} lacks {len(missing)} trainable tensors, e.g. {missing[:3]}")
    # strict=False: the frozen base weights are deliberately not in the checkpoint
    accelerator.load_state(str(path), strict=False)
    return state
