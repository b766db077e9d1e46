"""shardstore as a strategy of Megatron-Core's own ``dist_checkpointing.save``/``load``.

A Megatron-LM user changes two lines:

```python
from shardstore.tools.megatron_strategy import ShardstoreLoadShardedStrategy, ShardstoreSaveShardedStrategy
dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=ShardstoreSaveShardedStrategy())
dist_checkpointing.load(sharded_state_dict, ckpt_dir, sharded_strategy=ShardstoreLoadShardedStrategy())
```

Megatron's ``save`` refuses strategies that are not instances of its own base classes,
so these subclass them and delegate to shardstore's storage core. Megatron keeps its
part of the flow: it writes ``common.pt`` and the sharded objects with its own common
strategy before the sharded save, and ``metadata.json`` (backend ``"shardstore"``)
after it. The tensors become shardstore's Zarr v3 arrays with a commit record; since
Megatron writes into the directory itself, the save is in place (no staging directory
and no atomic replacement: those need ``shardstore.save``). ``shardstore.load`` and
the queries read such a checkpoint too.

Megatron's async path works too (``async_sharded_save=True`` with its
``AsyncCallsQueue``): see ``ShardstoreSaveShardedStrategy``.

A directory that already holds a committed shardstore checkpoint is refused before
anything is written, on every rank: Megatron's ``save`` would rewrite it in place,
``common.pt`` first, and a crash or a full disk midway would leave neither the old nor
the new checkpoint. Megatron writes ``common.pt`` before it calls the sharded strategy,
so the check runs in its common strategy (``TorchCommonSaveStrategy.save_common``,
guarded once a save strategy of ours exists). To replace a checkpoint, save through
``shardstore.megatron.install()`` or ``shardstore.save(..., overwrite=True)``, which
replace it atomically.

Importing this module needs megatron-core; shardstore itself never imports it.
"""

from __future__ import annotations

__all__ = ["ShardstoreLoadShardedStrategy", "ShardstoreSaveShardedStrategy"]

import functools
from typing import Any

try:
    from megatron.core.dist_checkpointing.strategies import async_utils as _megatron_async
    from megatron.core.dist_checkpointing.strategies import base as _megatron_base
    from megatron.core.dist_checkpointing.strategies import common as _megatron_common
except ImportError as exc:  # pragma: no cover - exercised where megatron-core is absent
    raise ImportError(
        "shardstore.tools.megatron_strategy plugs shardstore into megatron.core.dist_checkpointing and needs megatron-core "
        "(pip install megatron-core); shardstore.save/load work without it"
    ) from exc

from shardstore.compat.megatron.strategies.forked_writes import for_another_process
from shardstore.dict_utils import extract_matching_values, merge
from shardstore.engine.common_state import TorchCommonLoadStrategy
from shardstore.engine.load import load_preprocess
from shardstore.engine.strategies import DelegatingLoadStrategy
from shardstore.engine.walk import holds_committed_checkpoint, open_dir
from shardstore.engine.zarr_strategies import (
    SHARDSTORE_BACKEND,
    ZARR_VERSION,
    ZarrLoadShardedStrategy,
    ZarrSaveShardedStrategy,
)
from shardstore.errors import CheckpointingException
from shardstore.inputs.megatron_objects import convert_megatron_objects
from shardstore.mapping import ShardedObject, apply_factories, apply_factory_merges


class ShardstoreSaveShardedStrategy(_megatron_base.AsyncSaveShardedStrategy):
    """Megatron-Core save strategy writing shardstore's format, synchronously or through
    Megatron's async path (``save(..., async_sharded_save=True)`` and its
    ``AsyncCallsQueue``).

    Megatron runs an async request's ``async_fn`` in another process, so the writes
    report to the finalization through a file (``strategies.forked_writes``).

    Args:
        options: ``ZarrSaveShardedStrategy``'s (``max_chunk_bytes``, ``fully_parallel``,
            ``process_group``, ``max_staging_bytes``, ...).
    """

    def __init__(self, backend: str = SHARDSTORE_BACKEND, version: int = ZARR_VERSION, **options: Any) -> None:
        super().__init__(backend, version)
        self.base_strategy = ZarrSaveShardedStrategy(backend, version, **options)
        _guard_common_save()

    def _plan(self, sharded_state_dict: Any, checkpoint_dir: Any) -> tuple[Any, Any, Any]:
        """Collective: the state dict in shardstore's objects, the save into Megatron's
        directory (``ZarrSaveShardedStrategy.into_callers_directory``: Megatron made it
        and wrote its ``common.pt`` and sharded objects there) and this rank's plan
        (``plan_into``); keys the target cannot store are refused there, before any array
        is written."""
        sharded_state_dict = convert_megatron_objects(sharded_state_dict)
        apply_factories(sharded_state_dict)  # irregular shards, as flattened ranges
        pipeline = self.base_strategy.into_callers_directory(checkpoint_dir)
        return sharded_state_dict, pipeline, self.base_strategy.plan_into(sharded_state_dict, pipeline)

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        """Collective: validates the global layout and writes the tensors, committing
        them with shardstore's commit record (in place)."""
        self.base_strategy.save_into(*self._plan(sharded_state_dict, checkpoint_dir))

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        """Collective: plans and snapshots the tensors to host memory (the part the
        caller waits for); returns Megatron's AsyncRequest, whose ``async_fn`` writes
        and whose finalization commits."""
        ours = self.base_strategy.async_save_into(*self._plan(sharded_state_dict, checkpoint_dir))
        return for_another_process(ours, _megatron_async.AsyncRequest)


def _guard_common_save() -> None:
    """Makes Megatron's ``TorchCommonSaveStrategy.save_common`` (the first thing its
    ``save`` writes, on rank 0; every rank calls it) refuse, on every rank alike, a
    directory that holds a committed shardstore checkpoint (module docstring).
    Idempotent; nothing else about Megatron's save changes."""
    strategy = _megatron_common.TorchCommonSaveStrategy
    original = strategy.save_common
    if getattr(original, "_shardstore_guarded", False):
        return

    @functools.wraps(original)
    def save_common(self: Any, common_state_dict: Any, checkpoint_dir: Any) -> Any:
        if holds_committed_checkpoint(checkpoint_dir):
            raise CheckpointingException(
                f"Not saving into {checkpoint_dir}: it holds a committed shardstore checkpoint, which Megatron-Core's "
                "save would rewrite in place (common.pt first), so a crash or a full disk midway would lose both the "
                "old and the new checkpoint. Nothing was written. Save into a new directory, or replace it "
                "atomically through shardstore.megatron.install() or shardstore.save(..., overwrite=True)"
            )
        return original(self, common_state_dict, checkpoint_dir)

    save_common._shardstore_guarded = True  # type: ignore[attr-defined]
    strategy.save_common = save_common


class ShardstoreLoadShardedStrategy(DelegatingLoadStrategy, _megatron_base.LoadShardedStrategy):
    """Megatron-Core load strategy reading shardstore's format (any layout).

    Args:
        options: ``ZarrLoadShardedStrategy``'s (``fully_parallel``, ``allow_lossy_casts``, ...).
    """

    def __init__(self, **options: Any) -> None:
        self.base_strategy = ZarrLoadShardedStrategy(**options)

    @property
    def can_handle_sharded_objects(self) -> bool:
        """True: the ShardedObjects are read here, wherever the checkpoint holds them
        (``CommitRecord.object_shard_files``: under ``__objects__/`` from
        ``shardstore.save``, at the top level where Megatron's own save through the
        plug-in wrote them), checked against the commit record. Megatron's common
        strategy would look at the top level only, and read unchecked."""
        return True

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        sharded_state_dict, _, factories = load_preprocess(convert_megatron_objects(sharded_state_dict))
        objects, sharded_state_dict = extract_matching_values(sharded_state_dict, _is_sharded_object)
        opened = open_dir(checkpoint_dir)  # once: the record read and checked once for both parts
        loaded = apply_factory_merges(self.base_strategy.load(sharded_state_dict, opened), factories)
        return merge(loaded, TorchCommonLoadStrategy().load_sharded_objects(objects, opened))

    def load_sharded_metadata(self, checkpoint_dir: Any) -> Any:
        """The checkpoint's ShardedTensors and ShardedObjects (``can_handle_sharded_objects``),
        keyed by sharded key."""
        opened = open_dir(checkpoint_dir)
        return {
            **self.base_strategy.load_sharded_metadata(opened),
            **TorchCommonLoadStrategy().load_sharded_metadata(opened),
        }


def _is_sharded_object(value: Any) -> bool:
    return isinstance(value, ShardedObject)

