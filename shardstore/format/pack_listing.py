"""The packs feature in the commit record (feature ``packs``): which packs a checkpoint
has and which arrays are in them.

A record using it lists every pack, ``packs/<rank>-<n>.zip``, with its size in bytes
(``CommitRecord.packs``), and each packed array names its pack and the offsets of its
chunks' stored bytes inside it (``ArrayRecord.pack``, ``chunk_offsets``). A reader reads
a packed chunk as a ranged read of its pack; ``format.packs`` writes and checks the zips
themselves. Format version 8 introduced it; from version 9 a record lists it in
``requires`` (``format.features``).

The root group's attribute ``packed_arrays`` names each packed array's pack for plain
readers; ``packs_recipe`` is this feature's part of their recipe (``format.readers_recipe``).
"""

from __future__ import annotations

__all__ = [
    "MAX_PACK_BYTES",
    "PACKED_ARRAYS_ATTRIBUTE",
    "PACKS_DIR",
    "PACKS_FEATURE",
    "PACKS_SINCE",
    "PACK_NAME",
    "in_a_pack",
    "packs_from_json",
    "packs_recipe",
]

import math
import re
from collections.abc import Mapping
from typing import Any

from shardstore.errors import CheckpointingException

PACKS_FEATURE = "packs"
# The format version that introduced it.
PACKS_SINCE = 8
# Where the packs live, and how they are named (``packs/<rank>-<n>.zip``).
PACKS_DIR = "packs"
PACK_NAME = re.compile(r"packs/(0|[1-9][0-9]{0,8})-(0|[1-9][0-9]{0,8})\.zip")
# The root group's attribute that lists the packed arrays by key, each with its pack.
PACKED_ARRAYS_ATTRIBUTE = "packed_arrays"
# The most bytes of a pack (``format.packs`` starts a new one well before: no zip64).
MAX_PACK_BYTES = 2**32 - 1


def in_a_pack(array: Any) -> bool:
    """Whether the ``ArrayRecord`` ``array`` is stored in a pack (uses feature ``packs``)."""
    return array.pack is not None


def packs_from_json(raw: Any, arrays: Mapping[str, Any], where: str) -> dict[str, int]:
    """The record's ``packs`` (name: size), checked: named as the format names them,
    sizes a zip without zip64 may have, every packed array's pack among them and each of
    its chunks' stored bytes inside it. Unused packs are refused too: no save writes one."""
    if not isinstance(raw, dict) or any(
        not isinstance(name, str) or not PACK_NAME.fullmatch(name) or type(size) is not int
        or not 0 < size <= MAX_PACK_BYTES for name, size in raw.items()
    ):
        raise CheckpointingException(
            f"{where}: 'packs' must map pack names (packs/<rank>-<n>.zip) to their sizes in bytes; the commit record "
            "was edited or damaged"
        )
    used = set()
    for key, array in arrays.items():
        if array.pack is None:
            continue
        size = raw.get(array.pack)
        if size is None:
            raise CheckpointingException(
                f"{where}: array {key!r} is in pack {array.pack!r}, which the record's 'packs' does not list; the "
                "commit record was edited or damaged"
            )
        used.add(array.pack)
        stored = math.prod(array.chunk_shape) * array.itemsize + 4  # [bytes, crc32c]
        if any(o + stored > size for o in array.chunk_offsets or ()):
            raise CheckpointingException(
                f"{where}: array {key!r} names chunk offsets past the end of pack {array.pack!r} ({size} bytes); the "
                "commit record was edited or damaged"
            )
    if unused := sorted(set(raw) - used):
        raise CheckpointingException(
            f"{where}: the record lists pack {unused[0]!r}, which no array is in; the commit record was edited or "
            "damaged"
        )
    return dict(raw)


def packs_recipe() -> dict[str, Any]:
    """The plain readers' recipe for packed arrays: listed, each with its pack's path
    relative to the checkpoint, in the root group's attribute ``packed_arrays``; a pack
    is a stored (uncompressed) zip that is a Zarr v3 hierarchy, the array at its key with
    its own ``zarr.json``."""
    return {"listed_in": ["attributes", PACKED_ARRAYS_ATTRIBUTE], "store": "zip_pack", "document": "zarr_json"}
