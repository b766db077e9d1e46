"""Megatron-Core's strategy modules under their names (``base``, ``zarr``, ``common``,
``async_utils``: the engine's, ``shardstore.engine``), and the ones that are Megatron-Core's
alone (``fully_parallel``, ``torch``, ``checkpointable``, ``resharding``). Importing the
package registers ``("torch_dist", 1)``'s save strategy beside the engine's defaults.
"""

from __future__ import annotations

__all__: list[str] = []

from shardstore.compat.megatron.strategies.torch import register_default_torch_dist_save_strategy

register_default_torch_dist_save_strategy()
