"""Megatron-Core's ``dist_checkpointing.strategies.torch`` names, under the name its users
import: those of ``shardstore.compat.megatron.strategies.torch``, re-exported (the same
objects, so a pickle naming a class by this module loads it, and type checkers see each
name).
"""

from __future__ import annotations

__all__ = [
    "TorchDistLoadShardedStrategy", "TorchDistSaveShardedStrategy",
    "get_reformulation_metadata", "register_default_torch_dist_save_strategy",
]

from shardstore.compat.megatron.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    get_reformulation_metadata,
    register_default_torch_dist_save_strategy,
)
