"""Megatron-Core's ``dist_checkpointing.exchange_utils`` names, under the name its users
import: those of ``shardstore.compat.megatron.exchange_utils``, re-exported (the same
objects, so a pickle naming a class by this module loads it, and type checkers see each
name).
"""

from __future__ import annotations

__all__ = [
    "EXCHANGE_ALGOS", "ShardDistribution", "build_shard_distribution",
    "determine_main_replica_uniform_distribution", "distribute_shards_to_ranks",
    "exchange_by_distribution", "exchange_loaded_objects_gather_object",
    "prepare_exchange_by_distribution",
]

from shardstore.compat.megatron.exchange_utils import (
    EXCHANGE_ALGOS,
    ShardDistribution,
    build_shard_distribution,
    determine_main_replica_uniform_distribution,
    distribute_shards_to_ranks,
    exchange_by_distribution,
    exchange_loaded_objects_gather_object,
    prepare_exchange_by_distribution,
)
