"""Shards inside blocks (``in_block_sharded_record``): an array whose large blocks split
a later axis (Megatron's row-parallel weights) is stored one shard per chunk, each written
by its block's holder, no gather.
"""

from __future__ import annotations

__all__ = ["IN_BLOCK_PARTS", "MAX_INNER_BYTES", "in_block_sharded_record"]

import math
from dataclasses import replace

from shardstore.format.records import ArrayRecord
from shardstore.format.sharding import MAX_FLAT_INNER_CHUNKS, ShardingIndexed
from shardstore.planning.layout import (
    bound_chunk,
    largest_divisor_at_most,
)
from shardstore.planning.plans.shard_sizes import (
    INNER_PARTS,
    MIN_INNER_BYTES,
    count_chunks,
    split_axis,
)

# Shards inside blocks (``in_block_sharded_record``): chunks of at least an
# IN_BLOCK_PARTS-th of ``shard_bytes`` (a gathered shard would hold at most that many:
# files multiply little), inner chunks of at most MAX_INNER_BYTES.
IN_BLOCK_PARTS = 8
MAX_INNER_BYTES = 1 << 20


def in_block_sharded_record(record: ArrayRecord, shard_bytes: int) -> ArrayRecord | None:
    """``record`` stored in shards that lie inside its blocks, each written by the
    block's holder as its unsharded chunks are (no gather), when its blocks split an
    axis after the first longer one of its chunks (Megatron's row-parallel weights:
    ``[out, in/TP]``, layer-stacked ``[1, out, in/TP]``), whose chunks hold at least
    ``shard_bytes / IN_BLOCK_PARTS`` (smaller ones gather across blocks,
    ``sharded_record``, where inner chunks of whole rows make a TP 4 reader of a TP 2
    block read all of it: 2x); else None. Not flattened arrays (``_flat_sharded_record``).

    The shard: the chunk (the files are an unsharded save's; ``shard_bytes`` merges small
    chunks, it does not cut large ones). Its inner chunks: along each split later axis
    a ``k``-th of the shard, ``k`` the largest divisor of its length up to
    ``INNER_PARTS`` (8), so a reader of part of a block's columns reads at most one
    inner chunk more per end that is off the inner grid (TP 2 -> 4: 1.0x; 2 -> 3:
    1.125x); then leading axes split to at most ``MAX_INNER_BYTES`` (1 MiB: a reader
    of a few rows, plain ones included, reads little more), or a
    ``MAX_FLAT_INNER_CHUNKS``-th of the shard where that is more. None where the inner
    chunk would be under ``MIN_INNER_BYTES`` or the shard would hold more than
    ``MAX_FLAT_INNER_CHUNKS`` of them (lengths without small divisors). A shard's decoded bytes are then not its C order: its
    writer packs them (``ShardingIndexed.pack``, one copy; ``execution.save``)."""
    shape, chunk, itemsize = record.shape, record.chunk_shape, record.itemsize
    split = split_axis(chunk)
    later = [a for a in range(split + 1, len(chunk)) if chunk[a] < shape[a]]
    if record.flattened_block is not None or not later or math.prod(chunk) * itemsize * IN_BLOCK_PARTS < shard_bytes:
        return None
    columns = list(chunk)
    for axis in later:
        columns[axis] //= largest_divisor_at_most(chunk[axis], INNER_PARTS)
    most = max(MAX_INNER_BYTES, math.prod(chunk) * itemsize // MAX_FLAT_INNER_CHUNKS)
    inner = bound_chunk(tuple(columns), itemsize, most)
    if all(columns[a] == chunk[a] for a in later) or math.prod(inner) * itemsize < MIN_INNER_BYTES:
        return None
    if count_chunks(chunk, inner) > MAX_FLAT_INNER_CHUNKS:
        return None
    return replace(record, codec=ShardingIndexed(inner, itemsize))
