"""Megatron-Core's ``dist_checkpointing.strategies.checkpointable`` names, under the name its
users import: those of ``shardstore.compat.megatron.strategies.checkpointable``, re-
exported (the same objects, so a pickle naming a class by this module loads it, and type
checkers see each name).
"""

from __future__ import annotations

__all__ = [
    "CheckpointableShardedTensor", "LocalShardsContainer", "to_dcp_state_dict",
]

from shardstore.compat.megatron.strategies.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
    to_dcp_state_dict,
)
