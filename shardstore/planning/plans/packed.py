"""Packed whole arrays: a small array split over ranks gathered whole into one chunk on
one writer, who packs it (``plan_packed_whole``).
"""

from __future__ import annotations

__all__ = ["plan_packed_whole"]

import math
from dataclasses import replace

from shardstore.format.codecs import BYTES_CRC32C
from shardstore.format.records import ArrayRecord
from shardstore.planning.layout import (
    FlatChunk,
    ShardRecord,
)


def plan_packed_whole(
    record: ArrayRecord, main: list[ShardRecord], pack_up_to: int, load: list[int],
) -> tuple[ArrayRecord, FlatChunk] | None:
    """An array of at most ``pack_up_to`` bytes (``SaveOptions.pack_arrays_up_to``) whose
    whole blocks several ranks hold (FSDP2's ``Shard(0)``), each block a contiguous run
    of the array's C order: stored as ONE ``[bytes, crc32c]`` chunk (the whole array),
    assembled from every block by exchange on the holder of one of them with the fewest
    bytes to write so far (``load``, updated: the shard writers' balance), which packs
    it (``execution.save.packed_keys``), so such arrays cost a pack per rank instead of
    a chunk or shard each and a document. Its record and that chunk; None where this
    does not apply (no packing, larger arrays, one holder, flattened ranges)."""
    shape = record.shape
    nbytes = math.prod(shape) * record.itemsize
    held = [s for s in main if math.prod(s.block_shape)]
    if (
        not pack_up_to or not shape or not 0 < nbytes <= pack_up_to or len({s.rank for s in held}) < 2
        or any(s.flat_range is not None or s.allow_shape_mismatch or not _runs_in_c_order(s.block_shape, shape)
               for s in main)
    ):
        return None
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    pieces = tuple(
        (s.rank, s.index, 0, math.prod(s.block_shape), sum(o * st for o, st in zip(s.offset, strides)))
        for s in held
    )
    writer = min({s.rank for s in held}, key=lambda r: (load[r], r))
    load[writer] += nbytes
    whole = replace(record, chunk_shape=shape, codec=BYTES_CRC32C)
    return whole, FlatChunk(record.key, tuple(slice(0, n) for n in shape), writer, pieces)


def _runs_in_c_order(block: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether a block of shape ``block`` is one contiguous run of an array of ``shape``
    in C order: single elements along the axes before its first longer one, whole
    along those after it."""
    lead = next((a for a, b in enumerate(block) if b != 1), len(block))
    return tuple(block[lead + 1 :]) == tuple(shape[lead + 1 :])
