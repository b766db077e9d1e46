"""Megatron-Core's ``dist_checkpointing.strategies.async_utils`` names, under the name its
users import: those of ``shardstore.engine.async_requests``, re-exported
(the same objects, so a pickle naming a class by this module loads it, and type checkers
see each name).
"""

from __future__ import annotations

__all__ = [
    "AsyncCallsQueue", "AsyncRequest", "Finalization", "IO_PRIORITIES",
]

from shardstore.engine.async_requests import (
    IO_PRIORITIES,
    AsyncCallsQueue,
    AsyncRequest,
    Finalization,
)
