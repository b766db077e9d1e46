"""The load side of Megatron-Core's ``dist_checkpointing.serialization`` names (``engine.load``).
"""

from __future__ import annotations

__all__ = [
    "get_default_load_sharded_strategy",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_preprocess",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "remove_sharded_tensors",
    "verify_before_load",
    "verify_checkpoint_and_load_strategy",
]

from shardstore.engine.load import (
    get_default_load_sharded_strategy,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_preprocess,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    verify_before_load,
    verify_checkpoint_and_load_strategy,
)
