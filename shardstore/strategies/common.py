"""Megatron-Core's ``dist_checkpointing.strategies.common`` names, under the name its users
import: those of ``shardstore.engine.common_state``, re-exported (the same
objects, so a pickle naming a class by this module loads it, and type checkers see each
name).
"""

from __future__ import annotations

__all__ = [
    "COMMON_BACKEND", "COMMON_VERSION", "TorchCommonLoadStrategy", "TorchCommonSaveStrategy",
    "register_default_common_strategies",
]

from shardstore.engine.common_state import (
    COMMON_BACKEND,
    COMMON_VERSION,
    TorchCommonLoadStrategy,
    TorchCommonSaveStrategy,
    register_default_common_strategies,
)
