"""Megatron-Core's ``dist_checkpointing.exchange_utils`` names under their first name,
``shardstore.exchange_utils``: the module is ``shardstore.compat.megatron.exchange_utils``
(``import shardstore.exchange_utils`` gives that very module, so its state and its classes
are one, whichever name imported them first).
"""

from __future__ import annotations

__all__ = [
    "EXCHANGE_ALGOS", "ShardDistribution", "build_shard_distribution",
    "determine_main_replica_uniform_distribution", "distribute_shards_to_ranks",
    "exchange_by_distribution", "exchange_loaded_objects_gather_object", "prepare_exchange_by_distribution",
]

import sys

from shardstore.compat.megatron import exchange_utils as _module
from shardstore.compat.megatron.exchange_utils import (  # the names, for readers and linters
    EXCHANGE_ALGOS,
    ShardDistribution,
    build_shard_distribution,
    determine_main_replica_uniform_distribution,
    distribute_shards_to_ranks,
    exchange_by_distribution,
    exchange_loaded_objects_gather_object,
    prepare_exchange_by_distribution,
)

sys.modules[__name__] = _module
