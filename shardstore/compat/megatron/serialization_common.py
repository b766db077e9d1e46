"""What the seed API's save and load share (``engine.walk``), under its earlier name.
"""

from __future__ import annotations

__all__ = [
    "CONTENT_METADATA_KEY",
    "CheckpointDir",
    "group_of",
    "request_visitor",
]

from shardstore.engine.walk import (
    CONTENT_METADATA_KEY,
    CheckpointDir,
    group_of,
    request_visitor,
)
