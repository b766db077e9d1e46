"""Megatron-Core's ``dist_checkpointing.serialization`` names, under the name its users
import: those of ``shardstore.compat.megatron.serialization``, re-exported (the same
objects, so a pickle naming a class by this module loads it, and type checkers see each
name).
"""

from __future__ import annotations

__all__ = [
    "get_default_load_sharded_strategy", "get_default_save_common_strategy",
    "get_default_save_sharded_strategy", "load", "load_common_state_dict",
    "load_content_metadata", "load_plain_tensors", "load_preprocess", "load_sharded_metadata",
    "load_tensors_metadata", "remove_sharded_tensors", "save", "verify_before_load",
    "verify_checkpoint_and_load_strategy",
]

from shardstore.compat.megatron.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_common_strategy,
    get_default_save_sharded_strategy,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_preprocess,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
    verify_before_load,
    verify_checkpoint_and_load_strategy,
)
