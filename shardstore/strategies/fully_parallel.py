"""Megatron-Core's ``dist_checkpointing.strategies.fully_parallel`` names, under the name its
users import: those of ``shardstore.compat.megatron.strategies.fully_parallel``, re-
exported (the same objects, so a pickle naming a class by this module loads it, and type
checkers see each name).
"""

from __future__ import annotations

__all__ = [
    "FullyParallelLoadStrategyWrapper", "FullyParallelSaveStrategyWrapper",
    "_sharded_tensor_shard_id", "distribute_main_replicas_with_precomputed_distribution",
]

from shardstore.compat.megatron.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    _sharded_tensor_shard_id,
    distribute_main_replicas_with_precomputed_distribution,
)
