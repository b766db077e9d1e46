"""Megatron-Core's ``strategies.common`` names: ``common.pt`` and the ShardedObjects
(``engine.common_state``).
"""

from __future__ import annotations

__all__ = [
    "COMMON_BACKEND",
    "COMMON_VERSION",
    "TorchCommonLoadStrategy",
    "TorchCommonSaveStrategy",
    "register_default_common_strategies",
]

from shardstore.engine.common_state import (
    COMMON_BACKEND,
    COMMON_VERSION,
    TorchCommonLoadStrategy,
    TorchCommonSaveStrategy,
    register_default_common_strategies,
)
