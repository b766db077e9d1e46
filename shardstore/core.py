"""Megatron-Core's ``dist_checkpointing.core`` names, under the name its users import: those
of ``shardstore.compat.megatron.core``, re-exported (the same objects, so a pickle naming
a class by this module loads it, and type checkers see each name).
"""

from __future__ import annotations

__all__ = [
    "CONFIG_FNAME", "CheckpointingConfig", "CheckpointingException", "SaveOptions",
    "check_is_distributed_checkpoint", "gc_paused", "maybe_load_config", "save_config",
]

from shardstore.compat.megatron.core import (
    CONFIG_FNAME,
    CheckpointingConfig,
    CheckpointingException,
    SaveOptions,
    check_is_distributed_checkpoint,
    gc_paused,
    maybe_load_config,
    save_config,
)
