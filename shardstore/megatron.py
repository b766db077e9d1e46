"""shardstore behind Megatron-Core's ``dist_checkpointing`` entry points: one call,
``shardstore.megatron.install()``, before training. The names of
``shardstore.compat.megatron.entry_points``, re-exported (the same objects); its
docstring says what ``install`` replaces.
"""

from __future__ import annotations

__all__ = [
    "ENTRY_POINTS", "check_is_distributed_checkpoint", "install", "is_installed", "load",
    "load_content_metadata_entry", "previous_checkpoint", "save", "strategy_for_save",
    "uninstall",
]

from shardstore.compat.megatron.entry_points import (
    ENTRY_POINTS,
    check_is_distributed_checkpoint,
    install,
    is_installed,
    load,
    load_content_metadata_entry,
    previous_checkpoint,
    save,
    strategy_for_save,
    uninstall,
)
