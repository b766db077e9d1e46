"""Strategy interfaces and the registry of default strategies.

A save or load is split between a *sharded* strategy (ShardedTensors, the storage core:
``engine.zarr_strategies``) and a *common* strategy (the non-sharded state and, here, the
ShardedObjects: ``engine.common_state``). ``engine.save`` and ``engine.load`` pick them
from the registry by action, backend and version, and never touch bytes themselves.
"""

from __future__ import annotations

__all__ = [
    "AsyncCallsQueue", "AsyncRequest", "AsyncSaveShardedStrategy", "CheckpointDir",
    "DelegatingLoadStrategy", "LoadCommonStrategy", "LoadShardedStrategy", "LoadStrategyBase",
    "SaveCommonStrategy", "SaveShardedStrategy", "SaveStrategyBase", "StrategyAction",
    "agree_before_save", "async_calls", "default_strategies", "get_default_strategy", "plan_load_with_record",
    "register_default_strategy", "require_committed", "strategy_by_name", "validate_sharded_objects_handling",
]

import functools
import inspect
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Hashable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from shardstore.engine.async_requests import AsyncCallsQueue, AsyncRequest
from shardstore.errors import CheckpointingException
from shardstore.format.storage_layout import StorageLayout
from shardstore.mapping import ShardedStateDict, StateDict
from shardstore.opened import bare_location
from shardstore.protocol.collectives import Group
from shardstore.protocol.plan_cache import PlanCache
from shardstore.protocol.stage import run_stage

if TYPE_CHECKING:
    from shardstore.execution.pipeline import SavePipeline
    from shardstore.planning.layout import GatheredShards

CheckpointDir = Union[str, Path]


class StrategyAction(Enum):
    """Specifies save vs load and sharded vs common action."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


default_strategies: defaultdict[str, dict[tuple, Any]] = defaultdict(dict)

async_calls = AsyncCallsQueue()


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> Any:
    """The default strategy registered for ``action``, ``backend`` and ``version``
    (shardstore's own are registered when ``shardstore.engine`` is imported, which
    importing this module does first)."""
    try:
        return default_strategies[action.value][(backend, version)]
    except KeyError as exc:
        known = sorted(default_strategies[action.value])
        raise CheckpointingException(
            f"No default strategy for {action.value} with backend {backend!r} version {version}; "
            f"known (backend, version) pairs: {known}"
        ) from exc


def strategy_by_name(strategy: Any, action: StrategyAction) -> Any:
    """``strategy`` as ``save``/``load`` take it, Megatron-Core's two ways: a strategy
    object (or None) as it is, or a ``(backend, version)`` tuple naming the default
    registered for ``action`` (``get_default_strategy``).

    Raises:
        CheckpointingException: a tuple naming no registered strategy (the known pairs named).
        TypeError: anything else, such as a backend name alone.
    """
    if isinstance(strategy, tuple):
        if len(strategy) != 2 or not isinstance(strategy[0], str) or not isinstance(strategy[1], int):
            raise TypeError(f"A strategy named by a tuple is (backend, version), such as ('zarr', 1); got {strategy!r}")
        return get_default_strategy(action, *strategy)
    if isinstance(strategy, str):
        raise TypeError(
            f"A strategy is a strategy object or a (backend, version) tuple, such as ({strategy!r}, 1); got the "
            f"string {strategy!r}"
        )
    return strategy


def register_default_strategy(
    action: StrategyAction,
    backend: str,
    version: int,
    strategy: SaveStrategyBase | LoadStrategyBase,
) -> None:
    """Makes ``strategy`` the default for ``action``, ``backend`` and ``version``."""
    default_strategies[action.value][(backend, version)] = strategy


class LoadStrategyBase(ABC):
    """Base class for a load strategy: checks compatibility with a checkpoint's backend."""

    @abstractmethod
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raises CheckpointingException if this strategy cannot read ``loaded_backend``."""

    @abstractmethod
    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raises CheckpointingException if this strategy cannot read ``loaded_version``."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy loads ShardedObjects."""
        return False


class SaveStrategyBase(ABC):  # noqa: B024 (abstract by convention, as in the seed)
    """Base class for a save strategy: names the backend and version of its format."""

    def __init__(self, backend: str, version: int) -> None:
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy saves ShardedObjects."""
        return False

    def __str__(self) -> str:
        return f"{self.__class__.__name__}({self.backend}, {self.version})"


class LoadCommonStrategy(LoadStrategyBase):
    """Load strategy for the common (non-sharded) state."""

    @abstractmethod
    def load_common(self, checkpoint_dir: CheckpointDir) -> StateDict:
        """Loads the common part of the checkpoint."""

    @abstractmethod
    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> StateDict:
        """Loads the ShardedObjects of the state dict."""

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """Data-less ShardedObjects of the checkpoint, keyed by their sharded key."""
        raise NotImplementedError(f"{self} cannot list sharded object metadata")


class LoadShardedStrategy(LoadStrategyBase):
    """Load strategy for ShardedTensors."""

    @property
    def load_settings(self) -> Any:
        """How shardstore's own strategy reads (``engine.load.LoadSettings``), read once
        when a load starts; None for a strategy that reads its own way
        (``load_with_plan``)."""
        return None

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> StateDict:
        """Loads the sharded part of the checkpoint."""

    def load_with_record(
        self, sharded_state_dict: ShardedStateDict, location: Any, record: Any, process_group: Any = None
    ) -> StateDict:
        """``load`` given the opened location and the commit record ``serialization.load``
        has already read, so a strategy need not read and parse it again (for 5,000
        arrays that parse was a tenth of the load), and ``serialization.load``'s process
        group when it was given one. Default: plain ``load``."""
        return self.load(sharded_state_dict, location)

    def load_alone(self, sharded_state_dict: ShardedStateDict, location: Any, record: Any) -> StateDict:
        """``load_with_record`` in this process alone: no collective, whatever process
        group is initialized (for what any one process may run, such as a conversion
        reading a checkpoint's arrays batch by batch)."""
        return self.load_with_record(sharded_state_dict, location, record, Group.local())

    def plan_load(self, layout: GatheredShards, record: Any = None) -> list[Any]:
        """Coordinator: every rank's read plan for the gathered requests (index = group
        rank; ``shardstore.planning.plans``), given the checkpoint's commit record where
        it has one. Default: each rank reads what it asked for."""
        from shardstore.planning.plans import plan_reads

        return plan_reads(layout, fully_parallel=False)

    def load_with_plan(
        self, sharded_state_dict: ShardedStateDict, location: Any, record: Any, plan: Any, group: Any,
        local_error: BaseException | None = None,
    ) -> StateDict:
        """Collective: ``load_with_record`` with this rank's part of ``plan_load``.
        ``local_error``: this rank failed before the read; every rank raises it instead
        of reading. Default: the error is agreed, then ``load_with_record``."""
        run_stage(group, f"Loading checkpoint {location.describe()}", lambda: None, local_error=local_error)
        return self.load_with_record(sharded_state_dict, location, record, group)

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """Data-less ShardedTensors of every checkpoint tensor, keyed by tensor key.

        Only the global shape and dtype are meaningful: each is a single shard covering
        the whole tensor.
        """

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """Data-less ShardedTensors and ShardedObjects, keyed by sharded key."""
        if not self.can_handle_sharded_objects:
            return self.load_tensors_metadata(checkpoint_dir)
        raise NotImplementedError(f"{self} must implement load_sharded_metadata")

    def remove_sharded_tensors(self, checkpoint_dir: CheckpointDir, key_prefix: str) -> None:
        """Removes every tensor (and ShardedObject shard, by its unique key) whose key
        starts with ``key_prefix``.

        Concrete, as in Megatron-Core: a custom load strategy that does not support it
        can still be instantiated."""
        raise NotImplementedError(f"{self} does not support removing tensors from a checkpoint")


def plan_load_with_record(strategy: Any, layout: GatheredShards, record: Any) -> list[Any]:
    """``strategy.plan_load`` of ``layout``, given the checkpoint's commit ``record``
    where its ``plan_load`` takes one (a strategy that overrides it with the layout
    alone plans from that)."""
    if "record" in inspect.signature(strategy.plan_load).parameters:
        return strategy.plan_load(layout, record=record)
    return strategy.plan_load(layout)


class DelegatingLoadStrategy:
    """Mixin for a load strategy that wraps another one (``base_strategy``): metadata
    queries, removal and the compatibility checks are the wrapped strategy's. Listed
    before the abstract base, it supplies those methods (the fully-parallel wrapper,
    the Megatron-Core plug-in)."""

    base_strategy: Any

    @property
    def load_settings(self) -> Any:
        """The wrapped strategy's (None where it reads its own way)."""
        return getattr(self.base_strategy, "load_settings", None)

    def plan_load(self, layout: GatheredShards, record: Any = None) -> list[Any]:
        return plan_load_with_record(self.base_strategy, layout, record)

    def load_with_plan(self, sharded_state_dict: ShardedStateDict, location: Any, record: Any, plan: Any,
                       group: Any, local_error: BaseException | None = None) -> StateDict:
        return self.base_strategy.load_with_plan(sharded_state_dict, location, record, plan, group, local_error)

    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: CheckpointDir, key_prefix: str) -> None:
        self.base_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base_strategy.check_version_compatibility(loaded_version)


class SaveCommonStrategy(SaveStrategyBase):
    """Save strategy for the common (non-sharded) state."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: CheckpointDir) -> None:
        """Saves the common part of the state dict (called on the coordinator only)."""

    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> None:
        """Saves this rank's ShardedObjects."""
        raise NotImplementedError(f"{self} does not save ShardedObjects")


class SaveShardedStrategy(SaveStrategyBase):
    """Save strategy for ShardedTensors."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> None:
        """Saves the sharded part of the state dict (collective)."""

    @property
    def plan_cache(self) -> PlanCache | None:
        """The plan this strategy reuses while every rank's structure is unchanged
        (``protocol.plan_cache``); None: every save plans."""
        return None

    @property
    def save_settings(self) -> Any:
        """How shardstore's own strategy stages and writes (``engine.save.SaveSettings``),
        read once when a save starts; None for a strategy that writes its own way
        (``save_into``)."""
        return None

    @property
    def plan_settings(self) -> Hashable:
        """What this strategy's plans depend on besides the save's layout, part of a
        cached plan's key; () for a strategy whose plans depend on nothing else."""
        return ()

    def plan_save(self, layout: GatheredShards, storage: StorageLayout | None = None) -> list[Any]:
        """Coordinator: every rank's part of the save of a validated layout (index =
        group rank), which ``engine.save`` scatters (``shardstore.planning.plans``);
        ``storage``: the save's chosen ``StorageLayout``, as planned at its site
        (``SavePipeline`` passes it: ``StorageLayout.planned_at``).

        This default hands every rank the whole layout."""
        return [layout] * layout.world_size

    def save_with_plan(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir, plan: Any,
        process_group: Any = None, local_error: BaseException | None = None,
    ) -> None:
        """Like ``save``, with this rank's part of ``plan_save`` (the global sharding is
        already validated), on ``serialization.save``'s process group when given one.
        ``local_error``: this rank's failure in the step before (the common state),
        which every rank must learn of before the sharded save (collective).

        Strategies that need no plan inherit this and ignore it.
        """
        agree_before_save(process_group, bare_location(checkpoint_dir).describe(), local_error)
        self.save(sharded_state_dict, checkpoint_dir)


    def save_into(
        self, sharded_state_dict: ShardedStateDict, pipeline: SavePipeline, plan: Any,
        local_error: BaseException | None = None,
    ) -> None:
        """Collective: writes this rank's part of ``plan`` into the save ``pipeline`` has
        begun and joined (``execution.pipeline``), committing through it. ``serialization.
        save`` calls this; the default hands the location the pipeline writes into to
        ``save_with_plan`` (the seed's signature), which a strategy overrides.

        Raises:
            CheckpointingException: on every rank, when the save was not committed
                through that location (``require_committed``)."""
        self.save_with_plan(sharded_state_dict, pipeline.location, plan, pipeline.group.process_group, local_error)
        require_committed(self, pipeline)


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """Save strategy that can return its I/O as an ``AsyncRequest``."""

    @abstractmethod
    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir
    ) -> AsyncRequest:
        """Prepares the save and returns the request; the caller schedules it.

        Returns:
            AsyncRequest with the I/O function and the finalization functions.
        """

    def async_save_with_plan(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir, plan: Any,
        process_group: Any = None, local_error: BaseException | None = None,
    ) -> AsyncRequest:
        """Like ``async_save``, with this rank's part of ``plan_save`` (``local_error``:
        as in ``save_with_plan``)."""
        agree_before_save(process_group, bare_location(checkpoint_dir).describe(), local_error)
        return self.async_save(sharded_state_dict, checkpoint_dir)

    def async_save_into(
        self, sharded_state_dict: ShardedStateDict, pipeline: SavePipeline, plan: Any,
        local_error: BaseException | None = None,
    ) -> AsyncRequest:
        """Like ``save_into``, returning the request whose finalization commits (its last
        finalization step fails the save on every rank where none did:
        ``require_committed``, the save then abandoned)."""
        request = self.async_save_with_plan(
            sharded_state_dict, pipeline.location, plan, pipeline.group.process_group, local_error
        )
        request.add_finalize_fn(functools.partial(_require_committed_or_abandon, self, pipeline))
        return request

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> None:
        """Every async strategy can be used synchronously."""
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()

    def save_with_plan(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir, plan: Any,
        process_group: Any = None, local_error: BaseException | None = None,
    ) -> None:
        self.async_save_with_plan(sharded_state_dict, checkpoint_dir, plan, process_group, local_error).execute_sync()


def require_committed(strategy: SaveShardedStrategy, pipeline: SavePipeline) -> None:
    """After ``strategy`` saved through ``pipeline``'s location: the save must be committed
    (shardstore's own strategy, alone or wrapped, commits through it on every rank). A
    strategy that writes its own files there commits nothing shardstore could publish:
    every rank of the save raises alike.

    Raises:
        CheckpointingException: naming the strategy, the checkpoint and what to pass.
    """
    if pipeline.committed:
        return
    raise CheckpointingException(
        f"{strategy} committed nothing into {pipeline.describe()}: shardstore.save publishes only the saves of "
        "shardstore's strategies (ZarrSaveShardedStrategy, alone or in a wrapper such as "
        "FullyParallelSaveStrategyWrapper), which commit through the location the save hands them. Nothing was "
        f"published. Pass one of those, or save with {strategy} through its own library's save"
    )


def _require_committed_or_abandon(strategy: SaveShardedStrategy, pipeline: SavePipeline) -> None:
    """``require_committed`` as an async request's last finalization step: an uncommitted
    save is abandoned (the coordinator deletes what it staged) before it raises."""
    try:
        require_committed(strategy, pipeline)
    except CheckpointingException:
        if pipeline.group.is_coordinator:
            pipeline.abandon()
        else:
            pipeline.release()
        raise


def agree_before_save(process_group: Any, where: str, local_error: BaseException | None) -> None:
    """Collective (``protocol.stage.run_stage``, agreement only): a strategy that runs no
    stage of ours raises every rank's earlier failure before it saves into the checkpoint
    ``where`` names. shardstore's own strategy carries it in its staging stage instead, at
    no extra collective."""
    run_stage(Group(process_group), f"Preparing the sharded save into {where}", lambda: None, local_error=local_error)


def validate_sharded_objects_handling(sharded_strategy: Any, common_strategy: Any) -> None:
    """One of the two strategies must handle ShardedObjects."""
    if not sharded_strategy.can_handle_sharded_objects and not common_strategy.can_handle_sharded_objects:
        raise CheckpointingException(
            f"Either the sharded strategy or the common strategy must handle ShardedObjects; "
            f"neither {sharded_strategy} nor {common_strategy} does"
        )
