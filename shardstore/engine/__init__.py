"""The engine every door stands on: a save (``engine.save``) and a load (``engine.load``)
of a sharded state dict, and the strategies they run (``engine.strategies``: the
interfaces and the registry; ``engine.zarr_strategies``: shardstore's storage core;
``engine.common_state``: ``common.pt`` and the ShardedObjects; ``engine.other_formats``:
other tools' checkpoints). The dialects (``shardstore.compat``) and the tools call it;
it never imports them.

Importing the package registers shardstore's own strategies as the defaults, so the
registry in ``engine.strategies`` never imports the modules that import it.
"""

from __future__ import annotations

__all__: list[str] = []

from shardstore.engine.common_state import register_default_common_strategies
from shardstore.engine.other_formats import register_default_other_format_strategies
from shardstore.engine.zarr_strategies import register_default_zarr_strategies

register_default_zarr_strategies()
register_default_common_strategies()
register_default_other_format_strategies()
