"""The Megatron-Core strategy plug-in under its first name,
``shardstore.tools.megatron_strategy``: the module is
``shardstore.compat.megatron.strategy`` (``import shardstore.tools.megatron_strategy``
gives that very module, so its state and its classes are one, whichever name imported
them first).
"""

from __future__ import annotations

__all__ = [
    "ShardstoreLoadShardedStrategy", "ShardstoreSaveShardedStrategy",
]

import sys

from shardstore.compat.megatron import strategy as _module
from shardstore.compat.megatron.strategy import (  # the names, for readers and linters
    ShardstoreLoadShardedStrategy,
    ShardstoreSaveShardedStrategy,
)

sys.modules[__name__] = _module
