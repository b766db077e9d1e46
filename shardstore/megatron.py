"""shardstore as a strategy of Megatron-Core's own ``dist_checkpointing.save``/``load``.

A Megatron-LM user changes two lines::

    from shardstore.megatron import ShardstoreLoadShardedStrategy, ShardstoreSaveShardedStrategy
    dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=ShardstoreSaveShardedStrategy())
    dist_checkpointing.load(sharded_state_dict, ckpt_dir, sharded_strategy=ShardstoreLoadShardedStrategy())

Megatron's ``save`` refuses strategies that are not instances of its own base classes,
so these subclass them and delegate to shardstore's storage core. Megatron keeps its
part of the flow: it writes ``common.pt`` and the sharded objects with its own common
strategy before the sharded save, and ``metadata.json`` (backend ``"shardstore"``)
after it. The tensors become shardstore's Zarr v3 arrays with a commit record; since
Megatron writes into the directory itself, the save is in place (no staging directory
and no atomic replacement: those need ``shardstore.save``). ``shardstore.load`` and
the queries read such a checkpoint too.

Importing this module needs megatron-core; shardstore itself never imports it.
"""

from __future__ import annotations

from typing import Any

try:
    from megatron.core.dist_checkpointing.strategies import base as _megatron_base
except ImportError as exc:  # pragma: no cover - exercised where megatron-core is absent
    raise ImportError(
        "shardstore.megatron plugs shardstore into megatron.core.dist_checkpointing and needs megatron-core "
        "(pip install megatron-core); shardstore.save/load work without it"
    ) from exc

from shardstore.distributed import Group
from shardstore.foreign import convert_foreign
from shardstore.locations import open_location
from shardstore.mapping import apply_factories, apply_factory_merges
from shardstore.protocol import gather_and_plan
from shardstore.serialization import load_preprocess
from shardstore.strategies.base import DelegatingLoadStrategy
from shardstore.strategies.zarr import (
    SHARDSTORE_BACKEND,
    ZARR_VERSION,
    ZarrLoadShardedStrategy,
    ZarrSaveShardedStrategy,
)
from shardstore.utils import local_sharded_items


class ShardstoreSaveShardedStrategy(_megatron_base.SaveShardedStrategy):
    """Megatron-Core save strategy writing shardstore's format.

    Args:
        options: ``ZarrSaveShardedStrategy``'s (``max_chunk_bytes``, ``fully_parallel``,
            ``process_group``, ...).
    """

    def __init__(self, backend: str = SHARDSTORE_BACKEND, version: int = ZARR_VERSION, **options: Any) -> None:
        super().__init__(backend, version)
        self.base_strategy = ZarrSaveShardedStrategy(backend, version, **options)

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        """Collective: validates the global layout and writes the tensors, committing
        them with shardstore's commit record (in place)."""
        sharded_state_dict = convert_foreign(sharded_state_dict)
        apply_factories(sharded_state_dict)  # irregular shards, as flattened ranges
        location = open_location(checkpoint_dir)
        tensors, objects = local_sharded_items(sharded_state_dict)
        group = Group(self.base_strategy.process_group)
        plan = gather_and_plan(tensors, objects, group, self.base_strategy.plan_save, place=location.describe())
        self.base_strategy.save_with_plan(sharded_state_dict, location, plan)


class ShardstoreLoadShardedStrategy(DelegatingLoadStrategy, _megatron_base.LoadShardedStrategy):
    """Megatron-Core load strategy reading shardstore's format (any layout).

    Args:
        options: ``ZarrLoadShardedStrategy``'s (``fully_parallel``, ``allow_lossy_casts``, ...).
    """

    def __init__(self, **options: Any) -> None:
        self.base_strategy = ZarrLoadShardedStrategy(**options)

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        sharded_state_dict, _, factories = load_preprocess(convert_foreign(sharded_state_dict))
        return apply_factory_merges(self.base_strategy.load(sharded_state_dict, checkpoint_dir), factories)


__all__ = ["ShardstoreLoadShardedStrategy", "ShardstoreSaveShardedStrategy"]
