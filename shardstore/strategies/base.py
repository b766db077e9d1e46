"""Megatron-Core's ``dist_checkpointing.strategies.base`` names, under the name its users
import: those of ``shardstore.engine.strategies``, re-exported (the same
objects, so a pickle naming a class by this module loads it, and type checkers see each
name).
"""

from __future__ import annotations

__all__ = [
    "AsyncCallsQueue", "AsyncRequest", "AsyncSaveShardedStrategy", "CheckpointDir",
    "DelegatingLoadStrategy", "LoadCommonStrategy", "LoadShardedStrategy", "LoadStrategyBase",
    "SaveCommonStrategy", "SaveShardedStrategy", "SaveStrategyBase", "StrategyAction",
    "agree_before_save", "async_calls", "default_strategies", "get_default_strategy",
    "plan_load_with_record", "register_default_strategy", "require_committed",
    "strategy_by_name", "validate_sharded_objects_handling",
]

from shardstore.engine.strategies import (
    AsyncCallsQueue,
    AsyncRequest,
    AsyncSaveShardedStrategy,
    CheckpointDir,
    DelegatingLoadStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    LoadStrategyBase,
    SaveCommonStrategy,
    SaveShardedStrategy,
    SaveStrategyBase,
    StrategyAction,
    agree_before_save,
    async_calls,
    default_strategies,
    get_default_strategy,
    plan_load_with_record,
    register_default_strategy,
    require_committed,
    strategy_by_name,
    validate_sharded_objects_handling,
)
