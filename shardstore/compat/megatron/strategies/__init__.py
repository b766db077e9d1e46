"""The strategies that are Megatron-Core's alone (``fully_parallel`` with its distribution
``shard_exchange``, ``torch``, ``checkpointable``, ``resharding``, ``forked_writes``); its
``base``, ``zarr``, ``common`` and ``async_utils`` are the engine's (``shardstore.engine``),
offered under those names by ``shardstore.strategies``. Importing the package registers
``("torch_dist", 1)``'s save strategy beside the engine's defaults.
"""

from __future__ import annotations

__all__: list[str] = []

from shardstore.compat.megatron.strategies.torch import register_default_torch_dist_save_strategy

register_default_torch_dist_save_strategy()
