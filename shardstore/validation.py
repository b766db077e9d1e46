"""Megatron-Core's ``dist_checkpointing.validation`` names under their first name,
``shardstore.validation``: the module is ``shardstore.compat.megatron.validation``
(``import shardstore.validation`` gives that very module, so its state and its classes
are one, whichever name imported them first).
"""

from __future__ import annotations

__all__ = [
    "StrictHandling", "adjust_non_strict_load", "determine_global_metadata",
    "maybe_report_missing_and_unexpected_keys", "parse_strict_flag", "plan_load",
    "reported_mismatches", "validate_common_state_dict", "validate_sharded_objects_handling",
    "validate_sharding_integrity",
]

import sys

from shardstore.compat.megatron import validation as _module
from shardstore.compat.megatron.validation import (  # the names, for readers and linters
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

sys.modules[__name__] = _module
