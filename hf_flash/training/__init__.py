"""Memory features for long-context training: checkpointed layer inputs offloaded to host memory
(:mod:`hf_flash.training.offload`) and a tiled MLP (:mod:`hf_flash.training.tiled_mlp`)."""

from .offload import (
    OffloadStats, checkpoint_with_offload, offload_checkpoints, unoffload_checkpoints,
)
from .tiled_mlp import tile_mlp, untile_mlp

__all__ = [
    "OffloadStats",
    "checkpoint_with_offload",
    "offload_checkpoints",
    "tile_mlp",
    "unoffload_checkpoints",
    "untile_mlp",
]
