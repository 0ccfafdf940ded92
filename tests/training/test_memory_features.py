"""Offload and the tiled MLP together, with plain and keep-attention checkpointing.

The tiled MLP reorders float sums (tests/training/test_tiled_mlp.py); offload changes no
arithmetic. So the combination is held to docs/design.md's rule: against a float64 eager run of the
same weights, its float32 error is at most 2x (loss) / 3x (gradients) the error of the same model
in float32 with neither feature, plus the float32 floor.
"""

from __future__ import annotations

import torch
from memory_models import assert_within_rule, batch, checkpointing, step, tiny_lora_model

from hf_flash.training import offload_checkpoints, tile_mlp


def test_offload_and_tiled_mlp():
    inputs = batch()
    exact = step(tiny_lora_model("eager", torch.float64), inputs)
    model = tiny_lora_model("eager")
    checkpointing(model)
    lowp = step(model, inputs)
    stats = offload_checkpoints(model)
    assert tile_mlp(model, 24) == 2
    got = step(model, inputs)
    assert stats.last_step_tensors == 2
    assert_within_rule(exact, lowp, got, torch.float32, "offload + tiled MLP")


def test_offload_tiled_mlp_and_keep_attention(launches):
    """hf_flash attention: the attention forward kernel still runs once per layer per step."""
    inputs = batch(rows=1)
    exact = step(tiny_lora_model("eager", torch.float64), inputs)
    model = tiny_lora_model("hf_flash")
    kwargs = checkpointing(model, keep_attention=True)
    lowp = step(model, inputs)
    stats = offload_checkpoints(model, kwargs)
    tile_mlp(model, 24)
    launches.update(fwd=0, bwd=0)
    got = step(model, inputs)
    assert launches == {"fwd": 2, "bwd": 2}
    assert stats.last_step_tensors == 2
    assert_within_rule(exact, lowp, got, torch.float32, "offload + tiled MLP + keep-attention")
