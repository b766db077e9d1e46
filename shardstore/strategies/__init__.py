"""Megatron-Core's ``dist_checkpointing.strategies`` modules under the names its users
import: each module here re-exports the names of the module of the same name in
``shardstore.compat.megatron.strategies`` (base, zarr, torch, fully_parallel, async_utils,
common, resharding, checkpointable). Importing this package imports that one, which
registers shardstore's own strategies as the defaults.
"""

from __future__ import annotations

__all__: list[str] = []

import shardstore.compat.megatron.strategies  # noqa: F401  (registers the default strategies)
