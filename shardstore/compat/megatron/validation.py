"""Megatron-Core's ``dist_checkpointing.validation`` names: the global sharding check, the
common-state check and every rank's metadata (``shardstore.cross_rank_checks``), load
mismatches (``StrictHandling`` and the load's plan: ``shardstore.load_strictness``), the
strategies' ShardedObjects check (``strategies.base``), each re-exported here, and
``adjust_non_strict_load``. ``shardstore.validation`` re-exports its names.
"""

from __future__ import annotations

__all__ = [
    "StrictHandling", "adjust_non_strict_load", "determine_global_metadata",
    "maybe_report_missing_and_unexpected_keys", "parse_strict_flag", "plan_load",
    "reported_mismatches", "validate_common_state_dict", "validate_sharded_objects_handling",
    "validate_sharding_integrity",
]

from typing import Any

from shardstore.cross_rank_checks import (
    determine_global_metadata,
    validate_common_state_dict,
    validate_sharding_integrity,
)
from shardstore.dict_utils import extract_matching_values
from shardstore.engine.strategies import validate_sharded_objects_handling
from shardstore.load_strictness import (
    StrictHandling,
    maybe_report_missing_and_unexpected_keys,
    parse_strict_flag,
    plan_load,
    reported_mismatches,
)
from shardstore.mapping import ShardedBase, ShardedStateDict


def adjust_non_strict_load(
    sharded_state_dict: ShardedStateDict, sharded_keys_to_remove: set[str] | frozenset[str]
) -> ShardedStateDict:
    """Drops the ShardedBase entries whose key is in ``sharded_keys_to_remove``."""
    if not sharded_keys_to_remove:
        return sharded_state_dict

    def is_unexpected(x: Any) -> bool:
        return isinstance(x, ShardedBase) and x.key in sharded_keys_to_remove

    _, kept = extract_matching_values(sharded_state_dict, is_unexpected)
    return kept
