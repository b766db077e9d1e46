"""The first name of the strategies, ``shardstore.compat.megatron.strategies``: each
module here is that package's module of the same name under its first name
(``import shardstore.strategies.zarr`` gives ``shardstore.engine.zarr_strategies``
itself). Importing this package imports that one, which registers shardstore's own
strategies as the defaults.
"""

from __future__ import annotations

__all__: list[str] = []

import shardstore.compat.megatron.strategies  # noqa: F401  (registers the default strategies)
