"""Megatron-Core's ``dist_checkpointing.validation`` names, under the name its users import:
those of ``shardstore.compat.megatron.validation``, re-exported (the same objects, so a
pickle naming a class by this module loads it, and type checkers see each name).
"""

from __future__ import annotations

__all__ = [
    "StrictHandling", "adjust_non_strict_load", "determine_global_metadata",
    "maybe_report_missing_and_unexpected_keys", "parse_strict_flag", "plan_load",
    "reported_mismatches", "validate_common_state_dict", "validate_sharded_objects_handling",
    "validate_sharding_integrity",
]

from shardstore.compat.megatron.validation import (
    StrictHandling,
    adjust_non_strict_load,
    determine_global_metadata,
    maybe_report_missing_and_unexpected_keys,
    parse_strict_flag,
    plan_load,
    reported_mismatches,
    validate_common_state_dict,
    validate_sharded_objects_handling,
    validate_sharding_integrity,
)
