"""Megatron-Core's ``dist_checkpointing.exchange_utils`` names: which rank of a
parallelization group saves or loads each shard, and how the shards one rank loaded reach
the other ranks that hold them. The distribution and the exchange are the fully-parallel
wrappers' (``shardstore.compat.megatron.strategies.shard_exchange``, re-exported here);
``exchange_by_distribution`` is Megatron's one-call form of a prepared exchange.
``shardstore.exchange_utils`` re-exports its names.
"""

from __future__ import annotations

__all__ = [
    "EXCHANGE_ALGOS", "ShardDistribution", "build_shard_distribution",
    "determine_main_replica_uniform_distribution", "distribute_shards_to_ranks",
    "exchange_by_distribution", "exchange_loaded_objects_gather_object", "prepare_exchange_by_distribution",
]

import torch
import torch.distributed as dist

from shardstore.compat.megatron.strategies.shard_exchange import (
    EXCHANGE_ALGOS,
    ShardDistribution,
    build_shard_distribution,
    determine_main_replica_uniform_distribution,
    distribute_shards_to_ranks,
    exchange_loaded_objects_gather_object,
    prepare_exchange_by_distribution,
)
from shardstore.mapping import ShardedTensor
from shardstore.utils import _ShardId


def exchange_by_distribution(
    loaded_tensors: dict[_ShardId, torch.Tensor],
    unloaded_shards: dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution | None,
    parallelization_group: dist.ProcessGroup | None = None,
    exchange_algo: str = "broadcast",
) -> dict[_ShardId, torch.Tensor]:
    """Collective on ``parallelization_group``: every rank ends with every shard its
    state dict holds (``prepare_exchange_by_distribution``, then its exchange).

    Args:
        loaded_tensors: the shards this rank loaded (it is their main rank in
            ``shard_distribution``), each with the shape and dtype of its metadata.
        unloaded_shards: the ShardedTensors this rank holds but others load.
        shard_distribution: ``determine_main_replica_uniform_distribution``'s result
            for this group (with ``ignore_groups=True``).
        parallelization_group: the group; None is the world.
        exchange_algo: one of ``EXCHANGE_ALGOS`` (see there).

    Returns:
        ``loaded_tensors`` and the received shards, by shard id.
    """
    return prepare_exchange_by_distribution(
        loaded_tensors, unloaded_shards, shard_distribution, parallelization_group, exchange_algo
    )()
