"""shardstore as a strategy of Megatron-Core's own ``dist_checkpointing.save``/``load``
(Megatron-Core <= 0.16): the strategy classes of ``shardstore.compat.megatron.strategy``,
re-exported (the same objects).
"""

from __future__ import annotations

__all__ = [
    "ShardstoreLoadShardedStrategy", "ShardstoreSaveShardedStrategy",
]

from shardstore.compat.megatron.strategy import (
    ShardstoreLoadShardedStrategy,
    ShardstoreSaveShardedStrategy,
)
