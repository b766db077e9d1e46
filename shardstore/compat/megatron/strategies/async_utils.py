"""Megatron-Core's ``strategies.async_utils`` names: async save requests and the queue that
runs them (``engine.async_requests``).
"""

from __future__ import annotations

__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "Finalization",
    "IO_PRIORITIES",
]

from shardstore.engine.async_requests import (
    IO_PRIORITIES,
    AsyncCallsQueue,
    AsyncRequest,
    Finalization,
)
