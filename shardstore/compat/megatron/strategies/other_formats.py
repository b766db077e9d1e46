"""Loading other tools' checkpoints directly (``engine.other_formats``), under its earlier name.
"""

from __future__ import annotations

__all__ = [
    "OtherFormatLoadCommonStrategy",
    "OtherFormatLoadShardedStrategy",
    "open_other_format",
    "read_requested",
    "register_default_other_format_strategies",
]

from shardstore.engine.other_formats import (
    OtherFormatLoadCommonStrategy,
    OtherFormatLoadShardedStrategy,
    open_other_format,
    read_requested,
    register_default_other_format_strategies,
)
