"""Megatron-Core's fully-parallel strategy wrappers, with Megatron's knobs.

megatron.training wraps its strategies:

    strategy = FullyParallelSaveStrategyWrapper(strategy, mpu.get_data_parallel_group(...))

Around any other strategy (Megatron's own, a test's recording mock) they do what
Megatron's do:

- save: ``apply_saving_parallelization`` gathers shard metadata over
  ``parallelization_group`` (one all-gather, no data), balances the replicated shards
  by bytes (``shard_exchange.distribute_shards_to_ranks``, Megatron's greedy rule, so
  the same rank saves the same key), and sets ``replica_id`` to 0 on the one rank
  that saves each shard and 1 elsewhere; the wrapped strategy then saves main replicas.
- load: the same distribution over every shard the group holds; the wrapped
  strategy's ``load`` sees only this rank's part, and the shards reach the other ranks
  that hold them by ``exchange_algo`` (``shard_exchange.EXCHANGE_ALGOS``). A
  ShardedObject is loaded by its main replica and gathered over the load's ranks.
- ``do_cache_distribution=True``: the distribution of the first call is reused, with
  no metadata gather. The caller promises the same state dict structure and group on
  every call (a call on another group, as a save's ``process_group`` that stands in
  for ``parallelization_group=None`` can be, is refused on every rank);
  a rank whose shards (ids, shapes, dtypes) differ from the cached call, or that holds
  the main replica of a shard whose main replica was outside the group then, fails the
  save on every rank (``CheckpointingException`` naming it and its shards) instead of
  silently saving nothing for those shards (as Megatron's does): only that rank sees the
  change, so the save agrees on it first (one small all-gather on ``save``; none on
  ``save_with_plan``, where the wrapped strategy's agreement carries it). Build a new
  wrapper after changing the model.

Around shardstore's own strategies (``ZarrSaveShardedStrategy``,
``ZarrLoadShardedStrategy``) they wrap a copy with its fully-parallel plans on and
delegate: those plans already balance replicated writes by bytes and
read each replicated block once, over the whole save group rather than one
data-parallel group, in the plan the save or load makes anyway, so
``parallelization_group`` and ``exchange_algo`` have nothing left to decide there.
``do_cache_distribution=True`` on the save wrapper turns on the strategy's cached plan
(``ZarrSaveShardedStrategy.cache_plan``, ``protocol.plan_cache``): a save whose
structure is unchanged on every rank reuses the last plan, and one whose structure
changed on any rank plans in full, so nothing is left unsaved. On the load wrapper it
changes nothing there: every load plans.
"""

from __future__ import annotations

__all__ = [
    "FullyParallelLoadStrategyWrapper", "FullyParallelSaveStrategyWrapper",
    "_sharded_tensor_shard_id", "distribute_main_replicas_with_precomputed_distribution",
]

import copy
import logging
import math
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist

from shardstore.compat.megatron.strategies.shard_exchange import (
    EXCHANGE_ALGOS,
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    exchange_loaded_objects_gather_object,
    prepare_exchange_by_distribution,
)
from shardstore.dict_utils import dict_list_map_outplace, nested_values
from shardstore.engine.async_requests import AsyncRequest
from shardstore.engine.save import SaveSettings
from shardstore.engine.strategies import (
    AsyncSaveShardedStrategy,
    CheckpointDir,
    DelegatingLoadStrategy,
    LoadShardedStrategy,
    SaveShardedStrategy,
    agree_before_save,
)
from shardstore.engine.zarr_strategies import (
    ZarrLoadShardedStrategy,
    ZarrSaveShardedStrategy,
)
from shardstore.errors import CheckpointingException, first_failure
from shardstore.format.storage_layout import StorageLayout
from shardstore.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    is_main_replica,
)
from shardstore.opened import bare_location
from shardstore.protocol.collectives import Group
from shardstore.protocol.plan_cache import PlanCache
from shardstore.protocol.stage import run_stage
from shardstore.utils import _sharded_object_id, _sharded_tensor_shard_id, _ShardId

logger = logging.getLogger(__name__)

# What a cached distribution depends on: each local shard's id, shape and dtype.
_Structure = frozenset[tuple[_ShardId, tuple[int, ...], torch.dtype]]


def _is_shardstores_own(strategy: Any) -> bool:
    """shardstore's strategies plan fully parallel loads and saves themselves."""
    return isinstance(strategy, (ZarrSaveShardedStrategy, ZarrLoadShardedStrategy))


def _fully_parallel(strategy: Any, cache_plan: bool = False) -> Any:
    """shardstore's own ``strategy`` as a copy with its fully-parallel plans on (and, for
    a save, a cached plan of its own when ``cache_plan``); any other as it is. A copy,
    because Megatron wraps the process-wide default strategy
    (``get_default_save_sharded_strategy()``), which later unwrapped saves use too."""
    if not _is_shardstores_own(strategy):
        return strategy
    own = copy.copy(strategy)
    own.fully_parallel = True
    if isinstance(own, ZarrSaveShardedStrategy):
        keep = own.cache_plan or cache_plan
        own.cache_plan = False  # never share the original's cached plan
        own.cache_plan = keep
    return own


def _local_tensors(sharded_state_dict: ShardedStateDict) -> list[ShardedTensor]:
    return [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]


def _structure(sharded_state_dict: ShardedStateDict) -> _Structure:
    return frozenset((_sharded_tensor_shard_id(t), t.local_shape, t.dtype) for t in _local_tensors(sharded_state_dict))


def _group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: the default group), in its order."""
    if not (dist.is_available() and dist.is_initialized()):
        return (0,)
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


class _DistributionCache:
    """One wrapper's distribution and the local structure and group it was computed for."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.distribution: ShardDistribution | None = None
        self.structure: _Structure | None = None
        self.group_ranks: tuple[int, ...] = ()

    def get_or_compute(
        self, sharded_state_dict: ShardedStateDict, group: dist.ProcessGroup | None,
        compute: Callable[[], ShardDistribution | None], what: str,
        shard_id_of: Callable[[ShardedTensor], _ShardId] = _sharded_tensor_shard_id,
    ) -> ShardDistribution | None:
        """The cached distribution when enabled and present (no gather), else
        ``compute()`` (collective on ``group``), kept when enabled. ``shard_id_of``: how
        ``compute`` identifies shards."""
        if not self.enabled or self.structure is None:
            distribution = compute()
            if self.enabled:
                self.distribution, self.structure = distribution, _structure(sharded_state_dict)
                self.group_ranks = _group_ranks(group)
            return distribution
        self._check_same_group(_group_ranks(group), what)
        self._check_unchanged(_structure(sharded_state_dict), what)
        self._check_mains_kept(sharded_state_dict, what, shard_id_of)
        logger.debug("%s: cached distribution", what)
        return self.distribution

    def _check_same_group(self, ranks: tuple[int, ...], what: str) -> None:
        """Refuses a group other than the one the distribution was cached for: its main
        ranks are that group's ranks, and would name other ranks here (or none)."""
        if ranks != self.group_ranks:
            raise CheckpointingException(
                f"{what} with do_cache_distribution=True: the distribution was cached for the group of global "
                f"ranks {list(self.group_ranks)[:8]} and this call is on another group, of ranks {list(ranks)[:8]}, "
                "whose ranks it does not name. Use one wrapper per parallelization group (or pass "
                "parallelization_group), or do_cache_distribution=False."
            )

    def _check_unchanged(self, now: _Structure, what: str) -> None:
        if now == self.structure:
            return
        new = sorted({s[0] for s in now - self.structure}, key=str)
        gone = sorted({s[0] for s in self.structure - now}, key=str)
        raise CheckpointingException(
            f"{what} with do_cache_distribution=True: this rank's sharded state dict changed since the "
            f"distribution was cached (new or reshaped shards {new[:5]}, gone {gone[:5]}), so the cached "
            "distribution would leave shards unsaved or unloaded. Build a new wrapper after changing the "
            "state dict's structure, or pass do_cache_distribution=False."
        )

    def _check_mains_kept(
        self, sharded_state_dict: ShardedStateDict, what: str, shard_id_of: Callable[[ShardedTensor], _ShardId],
    ) -> None:
        """Refuses a main replica of a shard the cached distribution left to another group
        (its main replica was elsewhere when it was made): every rank would mark it a
        replica, and no rank would save it. A state dict the distribution rewrote keeps
        its main replicas in the group's shards, so it passes."""
        if self.distribution is None:  # a group of one rank: nothing is rewritten
            return
        in_group = self.distribution.shards_in_this_group
        left_out = sorted({t.key for t in _local_tensors(sharded_state_dict)
                           if is_main_replica(t.replica_id) and shard_id_of(t) not in in_group})
        if left_out:
            raise CheckpointingException(
                f"{what} with do_cache_distribution=True: this rank holds the main replica of {left_out[:5]}, whose "
                "main replica was outside the parallelization group when the distribution was cached, so the "
                "cached distribution would save it on no rank. Build a new wrapper after changing replica ids, or "
                "pass do_cache_distribution=False."
            )


def _exchanged_shard_id(sh_ten: ShardedTensor) -> _ShardId:
    """What makes two ranks' requests one shard for a fully parallel load around another
    strategy: Megatron's id (key, global offset, flattened range) and the local shape
    and dtype, since the loader's tensor itself reaches the other holders. Two requests
    at the same offset with different local shapes (the same flattened range of
    different blocks, or blocks of different sizes on an irregular grid) are different
    bytes: each is loaded for itself, never received into a tensor of another size."""
    return (*_sharded_tensor_shard_id(sh_ten), tuple(sh_ten.local_shape), str(sh_ten.dtype))


def _sharing_group(
    parallelization_group: dist.ProcessGroup | None, operation_group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """The ranks that share a save's or load's work: ``parallelization_group``, else
    every rank of the save or load (its process group; None: the world, which is what
    Megatron's None means, its saves and loads being the world's). A save or load on a
    subgroup so never waits for ranks that take no part in it."""
    return parallelization_group if parallelization_group is not None else operation_group


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group: dist.ProcessGroup | None,
    precomputed_distribution: ShardDistribution | None,
    shard_id_of: Callable[[ShardedTensor], _ShardId] = _sharded_tensor_shard_id,
) -> None:
    """Sets ``replica_id`` of each local ShardedTensor to 0 where this rank is the
    shard's main rank in ``precomputed_distribution`` and to 1 elsewhere, so a strategy
    that saves (or loads) main replicas does exactly this rank's share. Nothing to do in
    a group of one rank.

    Raises:
        ValueError: ``precomputed_distribution`` is None for a group of several ranks.
    """
    group = Group(parallelization_group)
    if group.world_size <= 1:
        return
    if precomputed_distribution is None:
        raise ValueError("precomputed_distribution must not be None for a parallelization group of several ranks")
    main_rank = precomputed_distribution.main_rank_for_shard
    in_group = precomputed_distribution.shards_in_this_group
    for sh_ten in _local_tensors(sharded_state_dict):
        shard_id = shard_id_of(sh_ten)
        sh_ten.replica_id = 0 if shard_id in in_group and main_rank[shard_id] == group.rank else 1


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Spreads the save of replicated shards over ``parallelization_group`` (see the
    module docstring).

    Args:
        strategy: the strategy that writes.
        parallelization_group: ranks that share the work (None: every rank of the save,
            the process group ``serialization.save`` was given, else the world); it
            should cover the replication pattern (usually the data-parallel group).
        do_cache_distribution: around another strategy, reuse the first call's
            distribution, with no metadata gather, on the promise that the state dict's
            structure never changes; around shardstore's own, reuse its last plan while
            every rank's structure is unchanged (checked in the plan's round trip).
    """

    def __init__(
        self, strategy: SaveShardedStrategy, parallelization_group: dist.ProcessGroup | None = None,
        do_cache_distribution: bool = False,
    ) -> None:
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = _fully_parallel(strategy, cache_plan=do_cache_distribution)
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self._cache = _DistributionCache(do_cache_distribution)

    @property
    def plan_cache(self) -> PlanCache | None:
        """The wrapped strategy's cached plan (``protocol.plan_cache``), if it keeps one."""
        return self.base_strategy.plan_cache if _is_shardstores_own(self.base_strategy) else None

    @property
    def save_settings(self) -> SaveSettings | None:
        """The wrapped strategy's where it is shardstore's own (whose plan already spreads
        the writes), else None: this wrapper distributes, then the wrapped one writes."""
        return self.base_strategy.save_settings if _is_shardstores_own(self.base_strategy) else None

    @property
    def plan_settings(self) -> Hashable:
        """The wrapped strategy's (``SaveShardedStrategy.plan_settings``)."""
        return self.base_strategy.plan_settings if _is_shardstores_own(self.base_strategy) else ()

    @property
    def cached_distribution(self) -> ShardDistribution | None:
        """The cached save distribution (None before the first save or without the cache)."""
        return self._cache.distribution

    def apply_saving_parallelization(
        self, sharded_state_dict: ShardedStateDict, process_group: dist.ProcessGroup | None = None
    ) -> None:
        """Collective on ``parallelization_group`` (None: ``process_group``, the save's)
        unless cached: decides who saves each shard and sets the replica ids
        accordingly (in place)."""
        group = _sharing_group(self.parallelization_group, process_group)
        distribution = self._cache.get_or_compute(
            sharded_state_dict, group,
            lambda: determine_main_replica_uniform_distribution(sharded_state_dict, group),
            "Fully parallel save",
        )
        distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, group, distribution)

    def _prepare(self, sharded_state_dict: ShardedStateDict, local_error: BaseException | None = None,
                 process_group: dist.ProcessGroup | None = None) -> BaseException | None:
        """Distributes the save (on ``process_group``) around another strategy; returns
        this rank's failure (a structure changed under the cache is seen by this rank
        only) instead of raising it, so that every rank learns of it before any saves
        (``_agreed``)."""
        if _is_shardstores_own(self.base_strategy):
            return local_error
        try:
            self.apply_saving_parallelization(sharded_state_dict, process_group)
        except CheckpointingException as exc:
            return first_failure(local_error, exc)
        return local_error

    def _agreed(self, sharded_state_dict: ShardedStateDict, where: str) -> None:
        """``_prepare`` for ``save``/``async_save``, which no plan stage of ours precedes.
        With the cache on, a rank whose structure changed would otherwise raise alone
        while the others wait in the wrapped strategy's collectives: one agreement
        (``strategies.base.agree_before_save``, a small all-gather) makes every rank
        raise. Without the cache the distribution's own all-gather is symmetric."""
        error = self._prepare(sharded_state_dict)
        if self._cache.enabled and not _is_shardstores_own(self.base_strategy):
            agree_before_save(None, where, error)
        elif error is not None:
            raise error

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> AsyncRequest:
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(f"{self.base_strategy} cannot save asynchronously: not an async strategy")
        self._agreed(sharded_state_dict, bare_location(checkpoint_dir).describe())
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def plan_save(self, layout: Any, storage: StorageLayout | None = None) -> list[Any]:
        return self.base_strategy.plan_save(layout, storage)

    def async_save_with_plan(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir, plan: Any,
                             process_group: Any = None, local_error: BaseException | None = None) -> AsyncRequest:
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(f"{self.base_strategy} cannot save asynchronously: not an async strategy")
        local_error = self._prepare(sharded_state_dict, local_error, process_group)  # agreed by the wrapped strategy
        return self.base_strategy.async_save_with_plan(sharded_state_dict, checkpoint_dir, plan, process_group,
                                                       local_error)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> None:
        self._agreed(sharded_state_dict, bare_location(checkpoint_dir).describe())
        self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def save_with_plan(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir, plan: Any,
                       process_group: Any = None, local_error: BaseException | None = None) -> None:
        local_error = self._prepare(sharded_state_dict, local_error, process_group)  # agreed by the wrapped strategy
        self.base_strategy.save_with_plan(sharded_state_dict, checkpoint_dir, plan, process_group, local_error)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects


def _split_by_main_replica(items: list[Any], shard_id: Callable[[Any], _ShardId]) -> tuple[dict, dict]:
    """(items this rank loads, items other ranks load), by shard id."""
    to_load, others = {}, {}
    for item in items:
        (to_load if is_main_replica(item.replica_id) else others)[shard_id(item)] = item
    return to_load, others


def _check_loaded(requested: dict[_ShardId, ShardedTensor], loaded: dict[_ShardId, Any], strategy: Any) -> None:
    """The wrapped strategy returned a tensor of the requested dtype and size for each
    shard: other ranks receive it into tensors of exactly that size."""
    for shard_id, request in requested.items():
        tensor = loaded.get(shard_id)
        f_range = request.flattened_range
        numel = math.prod(request.local_shape) if f_range is None else f_range.stop - f_range.start
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != request.dtype or tensor.numel() != numel:
            got = "nothing" if tensor is None else (
                f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            )
            raise CheckpointingException(
                f"{strategy} returned {got} for {request.key!r} at offset {request.global_offset}, requested "
                f"{request.local_shape} {request.dtype}: a fully parallel load hands each shard to the other "
                "ranks that hold it, so the wrapped strategy must return exactly what was requested"
            )


class FullyParallelLoadStrategyWrapper(DelegatingLoadStrategy, LoadShardedStrategy):
    """Loads each shard once in ``parallelization_group`` and exchanges it (see the
    module docstring). Metadata queries and compatibility checks are the wrapped
    strategy's.

    Args:
        strategy: the strategy that reads.
        parallelization_group: ranks that share the reads (None: every rank of the
            load, the process group ``serialization.load`` was given, else the world).
        do_cache_distribution: reuse the first call's distribution, with no metadata gather.
        exchange_algo: how loaded shards reach the others (``EXCHANGE_ALGOS``).
    """

    def __init__(
        self, strategy: LoadShardedStrategy, parallelization_group: dist.ProcessGroup | None = None,
        do_cache_distribution: bool = False, exchange_algo: str = "broadcast",
    ) -> None:
        if exchange_algo not in EXCHANGE_ALGOS:
            raise ValueError(f"Unknown exchange_algo {exchange_algo!r}; choose one of {EXCHANGE_ALGOS}")
        self.base_strategy = _fully_parallel(strategy)
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self._cache = _DistributionCache(do_cache_distribution)

    @property
    def cached_distribution(self) -> ShardDistribution | None:
        """The cached load distribution (None before the first load or without the cache)."""
        return self._cache.distribution

    def apply_loading_parallelization(
        self, sharded_state_dict: ShardedStateDict, process_group: dist.ProcessGroup | None = None
    ) -> ShardDistribution | None:
        """Collective on ``parallelization_group`` (None: ``process_group``, the load's)
        unless cached: decides who loads each shard (every shard the group holds) and
        sets the replica ids accordingly."""
        group = _sharing_group(self.parallelization_group, process_group)
        distribution = self._cache.get_or_compute(
            sharded_state_dict, group,
            lambda: determine_main_replica_uniform_distribution(
                sharded_state_dict, group, ignore_groups=True, shard_id_of=_exchanged_shard_id
            ),
            "Fully parallel load",
            _exchanged_shard_id,
        )
        distribute_main_replicas_with_precomputed_distribution(
            sharded_state_dict, group, distribution, _exchanged_shard_id
        )
        return distribution

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> StateDict:
        if _is_shardstores_own(self.base_strategy):
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        return self._load_distributed(
            sharded_state_dict, lambda part: self.base_strategy.load(part, checkpoint_dir), Group(), str(checkpoint_dir)
        )

    def load_with_record(self, sharded_state_dict: ShardedStateDict, location: Any, record: Any,
                         process_group: Any = None) -> StateDict:
        if _is_shardstores_own(self.base_strategy):
            return self.base_strategy.load_with_record(sharded_state_dict, location, record, process_group)
        group = process_group if isinstance(process_group, Group) else Group(process_group)
        return self._load_distributed(
            sharded_state_dict, lambda part: self.base_strategy.load_with_record(part, location, record, group),
            group, location.describe(),
        )

    def load_with_plan(self, sharded_state_dict: ShardedStateDict, location: Any, record: Any, plan: Any,
                       group: Any, local_error: BaseException | None = None) -> StateDict:
        if _is_shardstores_own(self.base_strategy):
            return self.base_strategy.load_with_plan(sharded_state_dict, location, record, plan, group, local_error)
        run_stage(group, f"Loading checkpoint {location.describe()}", lambda: None, local_error=local_error)
        return self.load_with_record(sharded_state_dict, location, record, group)

    def _load_distributed(
        self, sharded_state_dict: ShardedStateDict, base_load: Callable[[dict], dict], load_group: Group, where: str
    ) -> StateDict:
        """Collective on ``load_group`` (every rank of this load) and the
        parallelization group (``_sharing_group``): distribute, load this rank's part and
        allocate what it receives, agree that every rank did, exchange tensors in the
        parallelization group and objects in ``load_group``, put everything in place of
        its request."""
        sharing = _sharing_group(self.parallelization_group, load_group.process_group)
        if Group(sharing).world_size <= 1:
            return base_load(sharded_state_dict)
        error, loaded, exchange = None, {}, None
        objects_to_load: dict[_ShardId, ShardedObject] = {}
        try:  # a changed structure under the cache, a failed read or allocation: raised on every rank
            distribution = self.apply_loading_parallelization(sharded_state_dict, load_group.process_group)
            values = list(nested_values(sharded_state_dict))
            tensors_to_load, tensors_elsewhere = _split_by_main_replica(
                [v for v in values if isinstance(v, ShardedTensor)], _exchanged_shard_id
            )
            objects_to_load, _ = _split_by_main_replica(
                [v for v in values if isinstance(v, ShardedObject)], _sharded_object_id
            )
            loaded = base_load({**tensors_to_load, **objects_to_load})
            _check_loaded(tensors_to_load, loaded, self.base_strategy)
            exchange = prepare_exchange_by_distribution(
                {k: loaded[k] for k in tensors_to_load}, tensors_elsewhere, distribution, sharing, self.exchange_algo,
            )
        except Exception as exc:  # raised on every rank by run_stage, before any exchange
            error = exc
        run_stage(load_group, f"Fully parallel load of checkpoint {where}", lambda: None, local_error=error)
        tensors = exchange()
        objects = exchange_loaded_objects_gather_object(
            {k: loaded[k] for k in objects_to_load}, load_group.process_group
        )
        return dict_list_map_outplace(lambda x: _loaded_value(x, tensors, objects, where), sharded_state_dict)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects


def _loaded_value(x: Any, tensors: dict[_ShardId, Any], objects: dict[_ShardId, Any], where: str) -> Any:
    """The loaded value in place of a request (other values stay as they are)."""
    if isinstance(x, ShardedTensor):
        found, shard_id = tensors, _exchanged_shard_id(x)
    elif isinstance(x, ShardedObject):
        found, shard_id = objects, _sharded_object_id(x)
    else:
        return x
    if shard_id not in found:
        raise CheckpointingException(
            f"Fully parallel load of checkpoint {where}: no rank loaded {x.key!r} (shard {shard_id}); a "
            "ShardedObject is loaded by its main replica, so exactly one rank must hold it with replica_id 0"
        )
    return found[shard_id]
