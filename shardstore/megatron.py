"""shardstore behind Megatron-Core's ``dist_checkpointing`` entry points under its first
name, ``shardstore.megatron``: the module is ``shardstore.compat.megatron.entry_points``
(``import shardstore.megatron`` gives that very module, so its state and its classes are
one, whichever name imported them first).
"""

from __future__ import annotations

__all__ = [
    "ENTRY_POINTS", "check_is_distributed_checkpoint", "install", "is_installed",
    "load", "load_content_metadata_entry", "previous_checkpoint", "save",
    "strategy_for_save", "uninstall",
]

import sys

from shardstore.compat.megatron import entry_points as _module
from shardstore.compat.megatron.entry_points import (  # the names, for readers and linters
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

sys.modules[__name__] = _module
