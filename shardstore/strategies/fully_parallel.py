"""Megatron-Core's fully-parallel strategy wrappers, for code that builds them.

megatron.training wraps its strategies::

    strategy = FullyParallelSaveStrategyWrapper(strategy, mpu.get_data_parallel_group(...))

shardstore's own strategies are fully parallel already, and over the whole save group
rather than one data-parallel group: replicated blocks are written by their replicas
in turn, balanced by bytes (``layout.balance_writers``), and read once per replica
group on load. So the wrappers switch that on for the wrapped shardstore strategy and
otherwise delegate; ``parallelization_group``, ``do_cache_distribution`` and
``exchange_algo`` are accepted and have nothing left to decide.
"""

from __future__ import annotations

from typing import Any

from shardstore.strategies.async_utils import AsyncRequest
from shardstore.strategies.base import (
    AsyncSaveShardedStrategy,
    CheckpointDir,
    DelegatingLoadStrategy,
    LoadShardedStrategy,
    SaveShardedStrategy,
)


def _fully_parallel(strategy: Any) -> Any:
    if hasattr(strategy, "fully_parallel"):
        strategy.fully_parallel = True
    return strategy


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Delegates to ``strategy`` with its fully-parallel save on (see the module docstring)."""

    def __init__(
        self, strategy: SaveShardedStrategy, parallelization_group: Any = None, do_cache_distribution: bool = False
    ) -> None:
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = _fully_parallel(strategy)
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: CheckpointDir) -> AsyncRequest:
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise TypeError(f"{self.base_strategy} cannot save asynchronously")
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def plan_save(self, layout: Any) -> list[Any]:
        return self.base_strategy.plan_save(layout)

    def async_save_with_plan(self, sharded_state_dict: Any, checkpoint_dir: CheckpointDir, plan: Any,
                             process_group: Any = None) -> AsyncRequest:
        return self.base_strategy.async_save_with_plan(sharded_state_dict, checkpoint_dir, plan, process_group)

    def save(self, sharded_state_dict: Any, checkpoint_dir: CheckpointDir) -> None:
        self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def save_with_plan(self, sharded_state_dict: Any, checkpoint_dir: CheckpointDir, plan: Any,
                       process_group: Any = None) -> None:
        self.base_strategy.save_with_plan(sharded_state_dict, checkpoint_dir, plan, process_group)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects


class FullyParallelLoadStrategyWrapper(DelegatingLoadStrategy, LoadShardedStrategy):
    """Delegates to ``strategy`` with its fully-parallel load on (see the module docstring)."""

    def __init__(
        self, strategy: LoadShardedStrategy, parallelization_group: Any = None, do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ) -> None:
        self.base_strategy = _fully_parallel(strategy)
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo

    def load_with_record(self, sharded_state_dict: Any, location: Any, record: Any, process_group: Any = None) -> Any:
        return self.base_strategy.load_with_record(sharded_state_dict, location, record, process_group)

    def load(self, sharded_state_dict: Any, checkpoint_dir: CheckpointDir) -> Any:
        return self.base_strategy.load(sharded_state_dict, checkpoint_dir)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects
