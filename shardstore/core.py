"""Megatron-Core's ``dist_checkpointing.core`` names under its first name,
``shardstore.core``: the module is ``shardstore.compat.megatron.core`` (``import
shardstore.core`` gives that very module, so its state and its classes are one,
whichever name imported them first).
"""

from __future__ import annotations

__all__ = [
    "CONFIG_FNAME", "CheckpointingConfig", "CheckpointingException", "SaveOptions",
    "check_is_distributed_checkpoint", "gc_paused", "maybe_load_config", "save_config",
]

import sys

from shardstore.compat.megatron import core as _module
from shardstore.compat.megatron.core import (  # the names, for readers and linters
    CONFIG_FNAME,
    CheckpointingConfig,
    CheckpointingException,
    SaveOptions,
    check_is_distributed_checkpoint,
    gc_paused,
    maybe_load_config,
    save_config,
)

sys.modules[__name__] = _module
