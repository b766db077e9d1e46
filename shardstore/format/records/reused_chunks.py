"""What a checkpoint shares with the earlier one its save reused from (``ReusedChunks``,
``reused_from`` in the commit record): informational, for ``inspect`` and the logs.
"""

from __future__ import annotations

__all__ = [
    "ReusedChunks",
]

from dataclasses import dataclass
from typing import Any

from shardstore.errors import CheckpointingException


@dataclass(frozen=True)
class ReusedChunks:
    """What a checkpoint shares with the earlier one its save reused from
    (``format.reuse``): informational, for ``inspect`` and the logs. The chunks are
    listed in the record like any other; the checkpoint stands alone.

    Attributes:
        checkpoint: where the earlier checkpoint was, as its save saw it.
        save_id: the earlier checkpoint's save id.
        chunks: how many chunks were shared instead of written.
        nbytes: their stored bytes (each chunk's data and its crc32c).
    """

    checkpoint: str
    save_id: str
    chunks: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "save_id": self.save_id, "chunks": self.chunks, "bytes": self.nbytes}

    @classmethod
    def from_json(cls, value: Any, where: str) -> ReusedChunks | None:
        if value is None:
            return None
        fields = (value.get("checkpoint"), value.get("save_id"), value.get("chunks"), value.get("bytes")) if (
            isinstance(value, dict)) else None
        if (fields is None or not isinstance(fields[0], str) or not isinstance(fields[1], str)
                or not all(isinstance(n, int) and n >= 0 for n in fields[2:])):
            raise CheckpointingException(f"{where}: malformed 'reused_from' in the commit record")
        return cls(*fields)
