"""Strategies: how a save or load reaches storage (``base``: the interfaces and the
registry). Importing the package registers shardstore's own strategies as the defaults,
so the registry in ``base`` never imports the modules that import it.
"""

__all__: list[str] = []

from shardstore.compat.megatron.strategies.common import register_default_common_strategies
from shardstore.compat.megatron.strategies.other_formats import (
    register_default_other_format_strategies,
)
from shardstore.compat.megatron.strategies.torch import register_default_torch_dist_save_strategy
from shardstore.compat.megatron.strategies.zarr import register_default_zarr_strategies

register_default_zarr_strategies()
register_default_common_strategies()
register_default_other_format_strategies()
register_default_torch_dist_save_strategy()
