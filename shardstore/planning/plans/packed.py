"""Packed whole arrays: a small array split over ranks gathered whole to one writer, who
packs it (``plan_packed_whole``): as one chunk, or, where each block is a chunk of the
array's grid and at least ``MIN_PACKED_BLOCK_BYTES``, as those chunks, so that a rank
loading its block again reads only that member of the pack.
"""

from __future__ import annotations

__all__ = ["MIN_PACKED_BLOCK_BYTES", "plan_packed_whole"]

import math
from dataclasses import replace

from shardstore.format.codecs import BYTES_CRC32C
from shardstore.format.records import ArrayRecord
from shardstore.planning.layout import (
    FlatChunk,
    ShardRecord,
)

# A packed array's blocks stay chunks of their own from this size on: below it a load
# reads the whole array in the one ranged read it makes anyway (``format.packs``' runs
# join members less than a few KiB apart), and fewer members keep the zip small.
MIN_PACKED_BLOCK_BYTES = 64 * 1024


def plan_packed_whole(
    record: ArrayRecord, main: list[ShardRecord], pack_up_to: int, load: list[int],
) -> tuple[ArrayRecord, list[FlatChunk]] | None:
    """An array of at most ``pack_up_to`` bytes (``SaveOptions.pack_arrays_up_to``) whose
    whole blocks several ranks hold (FSDP2's ``Shard(0)``), each block a contiguous run
    of the array's C order: gathered by exchange to the holder of one of them with the
    fewest bytes to write so far (``load``, updated: the shard writers' balance), which
    packs it (``execution.save.packed_keys``), so such arrays cost a pack per rank
    instead of a chunk or shard each and a document. Stored as ``[bytes, crc32c]``
    chunks: a chunk per block where the blocks are the record's chunks
    (``_block_chunks``), else ONE chunk, the whole array. Its record and the chunks;
    None where this does not apply (no packing, larger arrays, one holder, flattened
    ranges)."""
    shape = record.shape
    nbytes = math.prod(shape) * record.itemsize
    held = [s for s in main if math.prod(s.block_shape)]
    if (
        not pack_up_to or not shape or not 0 < nbytes <= pack_up_to or len({s.rank for s in held}) < 2
        or any(s.flat_range is not None or s.allow_shape_mismatch or not _runs_in_c_order(s.block_shape, shape)
               for s in main)
    ):
        return None
    writer = min({s.rank for s in held}, key=lambda r: (load[r], r))
    load[writer] += nbytes
    blocks = _block_chunks(record, held, writer)
    if blocks is not None:
        return replace(record, codec=BYTES_CRC32C), blocks
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    pieces = tuple(
        (s.rank, s.index, 0, math.prod(s.block_shape), sum(o * st for o, st in zip(s.offset, strides)))
        for s in held
    )
    whole = replace(record, chunk_shape=shape, codec=BYTES_CRC32C)
    return whole, [FlatChunk(record.key, tuple(slice(0, n) for n in shape), writer, pieces)]


def _block_chunks(record: ArrayRecord, held: list[ShardRecord], writer: int) -> list[FlatChunk] | None:
    """A chunk per block, each assembled from that block alone, where every block is
    exactly one chunk of ``record``'s grid (its offset on the grid, its extent the
    chunk's, cut at the array's edge) of at least ``MIN_PACKED_BLOCK_BYTES``; else None."""
    grid, shape = record.chunk_shape, record.shape
    if math.prod(grid) * record.itemsize < MIN_PACKED_BLOCK_BYTES:
        return None
    chunks = []
    for s in held:
        if any(o % n for o, n in zip(s.offset, grid)) or tuple(s.block_shape) != tuple(
                min(n, g - o) for n, g, o in zip(grid, shape, s.offset)):
            return None
        region = tuple(slice(o, o + b) for o, b in zip(s.offset, s.block_shape))
        chunks.append(FlatChunk(record.key, region, writer, ((s.rank, s.index, 0, math.prod(s.block_shape), 0),)))
    return chunks


def _runs_in_c_order(block: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether a block of shape ``block`` is one contiguous run of an array of ``shape``
    in C order: single elements along the axes before its first longer one, whole
    along those after it."""
    lead = next((a for a, b in enumerate(block) if b != 1), len(block))
    return tuple(block[lead + 1 :]) == tuple(shape[lead + 1 :])
