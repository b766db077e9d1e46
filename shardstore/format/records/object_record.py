"""Where a ShardedObject's shards are (``ObjectRecord``): its key and the unique keys of
its shards, each a file at ``names.object_path``.
"""

from __future__ import annotations

__all__ = [
    "ObjectRecord",
]

from dataclasses import dataclass


@dataclass(frozen=True)
class ObjectRecord:
    """Where a ShardedObject's shards are: its key and the unique keys of its shards."""

    key: str
    shard_keys: tuple[str, ...]
